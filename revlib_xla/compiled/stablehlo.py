"""The StableHLO of a training step, traced on the XLA device and never run: the text that
:mod:`revlib_xla.compiled.memory` compiles. Re-exported by :mod:`revlib_xla.memory`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import backends
from .._tree import map_tensors, tensor_leaves
from ..backends.tracing import checks_suspended

__all__ = ["stablehlo_of", "step_stablehlo"]


def stablehlo_of(outputs: Sequence[torch.Tensor]) -> str:
    """StableHLO text of the pending XLA graph computing ``outputs`` (XLA tensors; nested lists are flattened).

    Call it before the step is synced (``torch_xla.sync()`` executes the graph and forgets it). Tensors that were
    already on the device when the graph began (parameters, inputs moved there and synced) become its arguments.
    """
    tensors = list(tensor_leaves(list(outputs)))
    if not tensors:
        raise ValueError("stablehlo_of needs at least one XLA tensor")
    return backends.lazy_stablehlo(tensors)


def step_stablehlo(
    step_fn: Callable[..., Any], model: torch.nn.Module, *inputs: Any, require_grads: bool = True
) -> str:
    """Trace one training step on the XLA device and return the StableHLO of its loss and parameter gradients.

    ``model`` is moved to the XLA device (``nn.Module.to`` is in place) and tensor ``inputs`` are copied there;
    after a sync they are device data, i.e. arguments of the traced graph. Then ``step_fn(model, *inputs)`` runs
    (forward and backward; it returns the loss, or any tensors to include), and the StableHLO of the returned
    XLA tensors plus every parameter's ``.grad`` is returned. Nothing is compiled or executed: the gradients are
    reset to ``None`` afterwards, which drops the pending graph. If ``step_fn`` updates parameters (an optimizer
    step), return them so that the update is part of the graph.

    ``require_grads``: raise if trainable parameters got no gradient (a forgotten ``backward()``).
    """
    dev = backends.device_for("xla")
    model.to(dev)
    moved = [map_tensors(lambda t: t.to(dev), item) for item in inputs]
    params = list(model.parameters())
    for param in params:
        param.grad = None
    backends.sync(dev)
    # torch's autograd engine sizes its per-device worker queues at the first backward of the process; after a CPU
    # backward that ran before torch_xla's runtime started, an XLA backward on a worker fails with "INTERNAL ASSERT
    # FAILED ... engine.cpp". Tracing needs no worker thread: run the backward on this thread. The reversible
    # backward's check of its rebuild adds nothing to the traced program (checks_suspended).
    with torch.autograd.set_multithreading_enabled(False), checks_suspended():
        result = step_fn(model, *moved)
    grads = [p.grad for p in params if p.grad is not None]
    if require_grads and not grads and any(p.requires_grad for p in params):
        raise ValueError(
            "step_fn produced no parameter gradients; it must run the backward pass (or pass require_grads=False)"
        )
    outputs: list[torch.Tensor] = []
    seen = set()
    for tensor in list(tensor_leaves(result)) + grads:
        if backends.is_tracing_lazily(tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            outputs.append(tensor)
    try:
        return stablehlo_of(outputs)
    finally:
        for param in params:
            param.grad = None
