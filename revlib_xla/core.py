"""RevLib's ``revlib.core`` names: ``from revlib_xla.core import ...`` runs code written against RevLib 1.7.

The reversible classes, couplings and type aliases are revlib_xla's own (the same objects as ``revlib_xla.X``);
the helpers RevLib's core exposes besides them are defined here. Two of RevLib's public names are pieces of its
per-layer engine, which revlib_xla replaces by one reversible backward over the whole sequence; they exist so that
an import keeps working, and say so when used:

* ``reverse_and_swap``: RevLib's autograd Function of one layer; raises, pointing to ``ReversibleSequential``.
* ``SingleBranchReversibleModule``: the layers behind RevLib's ``module_list_to_momentum_net``; raises at
  construction, pointing to :func:`revlib_xla.utils.module_list_to_momentum_net`, which builds the same drop-in
  ``ModuleList`` with memory savings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import torch
from torch import nn

from .offload import offload_tensor
from .reversible import (
    DUAL_OR_QUAD_TENSOR,
    FUSED_OPTIMIZER,
    MemoryModes,
    ReversibleError,
    ReversibleModule,
    ReversibleModuleCache,
    ReversibleSequential,
    ReversibleWrapper,
)
from .reversible.coupling import COUPLING, TENSOR_OR_LIST, additive_coupling_forward, additive_coupling_inverse

Tensor = torch.Tensor

__all__ = [
    "DUAL_OR_QUAD_TENSOR",
    "TENSOR_OR_LIST",
    "COUPLING",
    "FUSED_OPTIMIZER",
    "MemoryModes",
    "ReversibleSequential",
    "ReversibleModule",
    "ReversibleModuleCache",
    "ReversibleWrapper",
    "SingleBranchReversibleModule",
    "MergeCalls",
    "TensorOffload",
    "offload_tensor",
    "replace_grad",
    "reverse_and_swap",
    "additive_coupling_forward",
    "additive_coupling_inverse",
    "split_tensor_list",
    "take_0th_tensor",
    "get_key",
]


def split_tensor_list(inp: Tensor | Iterable[Tensor]) -> Tensor | tuple[Tensor, list[Tensor]]:
    """A tensor as it is; any other iterable as ``(first element, list of the rest)``, as a block returning extras
    is split by RevLib's couplings."""
    if isinstance(inp, torch.Tensor):
        return inp
    if isinstance(inp, Iterable):
        first, *rest = inp
        return first, rest
    raise ValueError(f"split_tensor_list: expected a tensor or an iterable of tensors, got {type(inp).__name__}")


def take_0th_tensor(inp: Tensor | Iterable[Tensor]) -> Tensor:
    """The stream of a block's output: the tensor itself, or the first element of a list of outputs."""
    split = split_tensor_list(inp)
    return split if isinstance(split, torch.Tensor) else split[0]


def get_key(idx: int, inp: Tensor) -> str:
    """A text key naming tensor number ``idx`` by its shape, device and dtype (RevLib keys saved tensors with it)."""
    return f"#{idx} shape={tuple(inp.shape)} device={inp.device} dtype={inp.dtype}"


class TensorOffload:
    """RevLib's autograd Function behind :func:`offload_tensor`: ``TensorOffload.apply(inp, reference)`` is
    ``offload_tensor(inp, reference)`` (``inp`` on ``reference``'s device; its gradient goes back to ``inp``'s)."""

    apply = staticmethod(offload_tensor)


class _ReplaceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, inp0: Tensor, inp1: Tensor, carried0: Tensor, carried1: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(inp0.detach(), inp1.detach())
        return inp0, inp1

    @staticmethod
    def backward(ctx: Any, grad0: Tensor, grad1: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        value0, value1 = ctx.saved_tensors
        return grad0, grad1, value0, value1


def replace_grad(inp0: Tensor, inp1: Tensor, carried0: Tensor, carried1: Tensor) -> tuple[Tensor, Tensor]:
    """``(inp0, inp1)`` unchanged; in the backward, their gradients flow through, and ``carried0``/``carried1``
    receive the *values* of ``inp0``/``inp1`` as their gradients. RevLib's way of handing a sequence's output to the
    backward of the layers before it (its last step); revlib_xla's own backward does not use it."""
    return _ReplaceGrad.apply(inp0, inp1, carried0, carried1)


def reverse_and_swap(*args: Any, **kwargs: Any) -> NoReturn:
    """RevLib's per-layer autograd Function; not available (see the module docstring): raises
    :class:`~revlib_xla.ReversibleError` saying what to use instead."""
    raise ReversibleError(
        "revlib_xla.core.reverse_and_swap: RevLib's autograd Function for one reversible layer has no counterpart "
        "in revlib_xla, whose reversible backward runs over the whole sequence. Build the layers as "
        "ReversibleSequential(*blocks) (or ReversibleModule(block) for one layer run by plain autograd)."
    )


class SingleBranchReversibleModule(ReversibleModule):
    """The one-stream layers behind RevLib's ``module_list_to_momentum_net``; not available (see the module
    docstring): constructing one raises :class:`~revlib_xla.ReversibleError` naming the replacement."""

    def __init__(self, secondary_branch_buffer: list[Any], wrapped_module: nn.Module, *args: Any, **kwargs: Any):
        raise ReversibleError(
            "revlib_xla.core.SingleBranchReversibleModule: RevLib's one-stream reversible layers (which hand the "
            "second stream from layer to layer through a shared buffer) are not provided. For a ModuleList that "
            "code calls one layer at a time, revlib_xla.utils.module_list_to_momentum_net(module_list, beta=...) "
            "builds the same drop-in ModuleList, with the memory savings; otherwise use ReversibleSequential."
        )


class MergeCalls(nn.Module):
    """Run ``modules`` one after the other, like ``nn.Sequential``, with extra arguments passed to each.

    A module may return a list or tuple: its first element goes on to the next module, and the whole output is
    collected; if any module did, the result is ``collate_fn(last_output, collected)``, else the last output.
    """

    def __init__(self, *modules: nn.Module, collate_fn: Callable[[Tensor, list[list[Any]]], Any]):
        super().__init__()
        self.wrapped_modules = nn.ModuleList(modules)
        self.collate_fn = collate_fn

    def forward(self, inp: Tensor, *args: Any, **kwargs: Any) -> Any:
        collected: list[list[Any]] = []
        for module in self.wrapped_modules:
            out = split_tensor_list(module(inp, *args, **kwargs))
            if isinstance(out, torch.Tensor):
                inp = out
            else:
                inp = out[0]
                collected.append([inp, *out[1]])
        return self.collate_fn(inp, collected) if collected else inp
