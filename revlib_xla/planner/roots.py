"""Where a stage's backward starts, as the executor runs it and the sizing measures it: aliases of the stage's
outputs as the roots (their gradient edges where torch takes edges as roots), and whether the executor stops a
stage's last recomputation early."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .. import fsdp
from .._tree import tensor_leaves


def _takes_edges() -> bool:
    """Whether ``torch.autograd.backward`` and ``grad`` start from ``GradientEdge`` roots (torch >= 2.6 or so)."""
    annotation = str(inspect.signature(torch.autograd.backward).parameters["tensors"].annotation)
    return "GradEdge" in annotation or "GradientEdge" in annotation


EDGE_ROOTS = _takes_edges()


def roots(out: Any, grads: tuple[torch.Tensor | None, ...]) -> tuple[list[Any], list[torch.Tensor]]:
    """The roots and seeds of a stage's backward from its output ``out`` and their gradients.

    The roots are aliases of the outputs, not the outputs themselves: autograd never completes a multi-tensor
    gradient hook (torch.autograd.graph.register_multi_grad_hook, as trackers and sharding wrappers put on module
    outputs) whose tensor is a root of the backward, and such a hook holds the gradient it was given until Python's
    cyclic garbage collector runs. Through the alias, the output's hooks see its gradient as in the plain model.
    Where torch takes gradient edges as roots, the roots are the aliases' edges: the backward then holds the graph
    but not the output's values, which the caller can free before running it."""
    pairs = [(o, g) for o, g in zip(tensor_leaves(out), grads) if o.requires_grad and g is not None]
    with torch.enable_grad():
        aliases = [o.view_as(o) for o, _ in pairs]
    roots: list[Any] = [torch.autograd.graph.get_gradient_edge(a) for a in aliases] if EDGE_ROOTS else aliases
    return roots, [g for _, g in pairs]


def stops_early(stage: nn.Module) -> bool:
    """Whether the executor stops this stage's last recomputation at the last tensor its backward reads, on an
    eager device: where torch's backward takes gradient edges as roots, and not where a module's forward hooks
    would miss their forward's end, or FSDP2 units their reshard."""
    unit_type = fsdp.fsdp_module_type()
    return EDGE_ROOTS and not any(
        m._forward_hooks or m._forward_pre_hooks or (unit_type is not None and isinstance(m, unit_type))
        for m in stage.modules()
    )
