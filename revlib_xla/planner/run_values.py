"""The values a run of a schedule (:mod:`revlib_xla.planner.execute`) carries between its phases, besides tensors:
the gradients taken off a stage's input leaves, stand-ins for gradients that hold no memory, the structure of a
nested value, a deferred stage's graph (its last recomputation stops early) and the output's gradient edges."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from .._tree import tensor_leaves, tree_flatten, tree_unflatten
from .early_stop import DeferredSaves


def _input_grads(x: Any) -> tuple[torch.Tensor | None, ...]:
    """The gradients of a stage's input leaves (made by ``grad_leaves`` for this run), taken off the leaves, whose
    values are released too: autograd's graph may keep a leaf alive (its AccumulateGrad node, e.g. held by a
    module hook's reference cycle until Python's garbage collector runs) after the leaf is dropped, and neither its
    gradient nor the input it aliases must live as long."""
    grads = []
    for t in tensor_leaves(x):
        grads.append(t.grad if t.requires_grad else None)
        if t.requires_grad:
            t.grad = None
            t.data = t.new_empty(0)
    return tuple(grads)


_DEFERRED = object()  # x̄_{i+1} of a deferred stage: its graph is in _Run.deferred


@functools.lru_cache(maxsize=64)
def _stand_in_of(dtype: torch.dtype, device: torch.device, shape: torch.Size) -> torch.Tensor:
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def _stand_in(grad: torch.Tensor) -> torch.Tensor:
    """A tensor of ``grad``'s shape, dtype and device that holds no memory of its own (a broadcast zero, kept
    across steps: nothing is allocated in a step after the first)."""
    return _stand_in_of(grad.dtype, grad.device, grad.shape)


class _Structure:
    """Where the tensors of a nested value sit (``torch.utils._pytree``'s flattening; other leaves are kept), to
    build the same value around other tensors."""

    def __init__(self, value: Any) -> None:
        tensor_leaves(value)  # refuses containers whose tensors pytree would miss
        leaves, self.spec = tree_flatten(value)
        self.leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.slots = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        leaves = list(self.leaves)
        for k, t in zip(self.slots, tensors):
            leaves[k] = t
        return tree_unflatten(leaves, self.spec)


class _Deferred:
    """Stage i's graph from its first run, without saved activations
    (:class:`~revlib_xla.planner.early_stop.DeferredSaves`): its input leaves, the gradient edges of its output
    tensors (None where one needs no gradient), and its slots."""

    __slots__ = ("edges", "inp", "saves")

    def __init__(self, inp: Any, edges: list[Any], saves: DeferredSaves) -> None:
        self.inp, self.edges, self.saves = inp, edges, saves


class _OutputEdges:
    """x̄_L of the last stage once the forward phase has returned the model's output: the gradient edges of the
    output's tensors (None where one needs no gradient), all its backward needs, so that the output's values are
    the caller's alone to keep or free (a language model's logits, freed once the loss has been computed from them,
    as with the plain model)."""

    __slots__ = ("edges",)

    def __init__(self, out: Any) -> None:
        with torch.enable_grad():
            self.edges = [
                torch.autograd.graph.get_gradient_edge(o.view_as(o)) if o.requires_grad else None
                for o in tensor_leaves(out)
            ]
