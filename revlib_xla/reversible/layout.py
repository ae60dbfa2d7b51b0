"""What each iteration of a scanned reversible sequence gets (:class:`Layout`): per position in the repeating group,
the block's parameters and buffers stacked over the iterations, and its arguments, shared by every layer or stacked
per iteration."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .. import _tree
from .plan import Plan, Slot
from .repeat import ScanUnsupported

Tensor = torch.Tensor


@dataclasses.dataclass
class Layout:
    """The sequence as ``iterations`` repeats of ``period`` layers: per position ``j`` in the group, the names of
    the block's parameters and buffers, and for each iteration the index of each parameter in ``plan.params``
    (``None``: not trained); the arguments, shared by every layer or stacked per iteration."""

    period: int
    iterations: int
    param_names: list[list[str]]
    buffer_names: list[list[str]]
    param_index: list[dict[str, list[int | None]]]
    arg_specs: list[Any]  # per position: the (args, kwargs) tree spec
    arg_leaves: list[list[Any]]  # per position: each leaf is a constant, a _Shared slot or a _Stacked slot list

    def tensors(self, plan: Plan, j: int) -> dict[str, Tensor]:
        """Position ``j``'s parameters and buffers stacked over the iterations (a copy)."""
        blocks = [plan.layers[t * self.period + j].block for t in range(self.iterations)]
        found = [dict(b.named_parameters()) | dict(b.named_buffers()) for b in blocks]
        with torch.no_grad():
            return {n: torch.stack([f[n] for f in found]) for n in self.param_names[j] + self.buffer_names[j]}

    def stacked_args(self, j: int, arg_tensors: Sequence[Tensor]) -> list[Tensor]:
        return [
            torch.stack([arg_tensors[k] for k in leaf.slots])
            for leaf in self.arg_leaves[j]
            if isinstance(leaf, _Stacked)
        ]

    def args(self, j: int, arg_tensors: Sequence[Tensor], stacked: Sequence[Tensor]) -> tuple[Any, Any]:
        """Position ``j``'s ``(args, kwargs)`` inside the body: shared tensors as they are, stacked ones sliced."""
        slices = iter(stacked)
        leaves = [
            arg_tensors[leaf.slot]
            if isinstance(leaf, _Shared)
            else next(slices)
            if isinstance(leaf, _Stacked)
            else leaf
            for leaf in self.arg_leaves[j]
        ]
        return _tree.tree_unflatten(leaves, self.arg_specs[j])


@dataclasses.dataclass(frozen=True)
class _Shared:
    slot: int


@dataclasses.dataclass(frozen=True)
class _Stacked:
    slots: tuple[int, ...]


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # objects whose == is not a truth value
        return False


def layout_of(plan: Plan, period: int, arg_tensors: Sequence[Tensor]) -> Layout:
    n = len(plan.layers)
    iterations = n // period
    index = {id(p): k for k, p in enumerate(plan.params)}
    param_names, buffer_names, param_index, specs, leaves_of = [], [], [], [], []
    for i, layer in enumerate(plan.layers):
        block_params = {id(p) for p in layer.block.parameters()}
        if any(id(plan.params[k]) not in block_params for k in plan.layer_params[i]):
            raise ScanUnsupported(f"{plan.describe(i)} trains a parameter outside its block (in its coupling)")
    for j in range(period):
        block = plan.layers[j].block
        param_names.append([name for name, _ in block.named_parameters()])
        buffer_names.append([name for name, _ in block.named_buffers()])
        per_name: dict[str, list[int | None]] = {name: [] for name in param_names[j]}
        for t in range(iterations):
            for name, p in plan.layers[t * period + j].block.named_parameters():
                per_name[name].append(index.get(id(p)))
        param_index.append(per_name)
        flats = [_tree.tree_flatten(plan.layer_args[t * period + j]) for t in range(iterations)]
        spec = flats[0][1]
        leaves: list[Any] = []
        for pos, leaf in enumerate(flats[0][0]):
            column = [f[0][pos] if f[1] == spec and len(f[0]) == len(flats[0][0]) else None for f in flats]
            where = f"the arguments of {plan.describe(j)} and {plan.describe((iterations - 1) * period + j)}"
            if not isinstance(leaf, Slot):
                if not all(_same(leaf, other) for other in column):
                    raise ScanUnsupported(f"{where} differ in structure or in a value that is not a tensor")
                leaves.append(leaf)
                continue
            if not all(isinstance(other, Slot) for other in column):
                raise ScanUnsupported(f"{where} differ in structure (a tensor in one, not in the other)")
            slots = tuple(other.index for other in column if isinstance(other, Slot))
            tensors = [arg_tensors[k] for k in slots]
            if any(t.requires_grad for t in tensors):
                raise ScanUnsupported(f"{where} include a tensor that requires grad (its gradient is not scanned)")
            if len(set(slots)) == 1:
                leaves.append(_Shared(slots[0]))
            elif all(t.shape == tensors[0].shape and t.dtype == tensors[0].dtype for t in tensors):
                leaves.append(_Stacked(slots))
            else:
                raise ScanUnsupported(f"{where} include tensors of different shapes or dtypes")
        specs.append(spec)
        leaves_of.append(leaves)
    return Layout(period, iterations, param_names, buffer_names, param_index, specs, leaves_of)
