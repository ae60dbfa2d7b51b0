"""Coupling functions: how a block's output ``f(x1)`` is merged into the other stream, and how that is undone.

A coupling pair is ``forward(other_stream, fn_out) -> new_stream`` and ``inverse(new_stream, fn_out) ->
other_stream``. The reversible core differentiates ``forward`` with autograd, so any invertible pair works: the
gradient of the other stream comes from the pair's own vector-Jacobian product, not from assuming it is additive.

``fn_out`` may be a list or tuple (a block returning extras, as HuggingFace layers do): element 0 is what gets
coupled, as in RevLib; the core keeps only element 0 of the result as the stream.
"""
from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Sequence, Union

import torch

Tensor = torch.Tensor
TENSOR_OR_LIST = Union[List[Tensor], Tensor]
COUPLING = Callable[[Tensor, TENSOR_OR_LIST], TENSOR_OR_LIST]

__all__ = [
    "COUPLING", "TENSOR_OR_LIST", "CouplingPair", "additive_coupling_forward", "additive_coupling_inverse",
    "momentum_coupling", "affine_coupling", "first_tensor", "optional_detach",
]


class CouplingPair(NamedTuple):
    """A coupling and its inverse, ready to pass as ``coupling_forward=[pair.forward]`` and
    ``coupling_inverse=[pair.inverse]``."""

    forward: COUPLING
    inverse: COUPLING


def optional_detach(inp: Any) -> Any:
    """Detach tensors (nested in lists/tuples too), leave everything else alone."""
    if isinstance(inp, torch.Tensor):
        return inp.detach()
    if isinstance(inp, (list, tuple)):
        return type(inp)(optional_detach(x) for x in inp)
    return inp


def first_tensor(value: TENSOR_OR_LIST) -> Tensor:
    """Element 0 of a list/tuple result, or the tensor itself."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("a block or coupling returned an empty list/tuple; expected a tensor first")
        return value[0]
    return value


def _combine(fn_out: TENSOR_OR_LIST, merge: Callable[[Tensor], Tensor]) -> TENSOR_OR_LIST:
    if isinstance(fn_out, (list, tuple)):
        return [merge(fn_out[0])] + list(fn_out[1:])
    return merge(fn_out)


def additive_coupling_forward(other_stream: Tensor, fn_out: TENSOR_OR_LIST) -> TENSOR_OR_LIST:
    """RevNet's coupling: ``other_stream + f``."""
    return _combine(fn_out, lambda f: other_stream + f)


def additive_coupling_inverse(output: Tensor, fn_out: TENSOR_OR_LIST) -> TENSOR_OR_LIST:
    """Inverse of :func:`additive_coupling_forward`: ``output - f``."""
    return _combine(fn_out, lambda f: output - f)


def momentum_coupling(beta: float) -> CouplingPair:
    """MomentumNet's coupling ``beta * other + (1 - beta) * f`` and its inverse.

    Information is scaled by ``beta`` at every layer, so deep stacks with small ``beta`` lose precision when
    inverted; :func:`revlib_xla.utils.momentum_net` folds ``beta`` into the blocks instead and loses nothing.
    """
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"momentum_coupling: beta must be in (0, 1], got {beta!r}; beta = 0 is not invertible")

    def forward(other_stream: Tensor, fn_out: TENSOR_OR_LIST) -> TENSOR_OR_LIST:
        return _combine(fn_out, lambda f: other_stream * beta + f * (1 - beta))

    def inverse(output: Tensor, fn_out: TENSOR_OR_LIST) -> TENSOR_OR_LIST:
        return _combine(fn_out, lambda f: (output - f * (1 - beta)) / beta)

    return CouplingPair(forward, inverse)


def affine_coupling(dim: int = 1, scale_offset: float = 2.0, eps: float = 1e-3) -> CouplingPair:
    """Glow/RealNVP-style affine coupling ``other * scale + shift``.

    The block returns ``2 * C`` features along ``dim`` for a stream of ``C``: the first half parameterizes the scale
    as ``sigmoid(s + scale_offset) + eps`` (positive, bounded away from 0, close to 1 at initialization), the second
    half is the shift.
    """

    def split(fn_out: Tensor):
        if fn_out.shape[dim] % 2:
            raise ValueError(
                f"affine_coupling: the block must return an even number of features along dim {dim} "
                f"(scale and shift halves), got shape {tuple(fn_out.shape)}")
        log_scale, shift = fn_out.chunk(2, dim)
        return torch.sigmoid(log_scale + scale_offset) + eps, shift

    def forward(other_stream: Tensor, fn_out: TENSOR_OR_LIST) -> TENSOR_OR_LIST:
        def merge(f):
            scale, shift = split(f)
            return other_stream * scale + shift
        return _combine(fn_out, merge)

    def inverse(output: Tensor, fn_out: TENSOR_OR_LIST) -> TENSOR_OR_LIST:
        def merge(f):
            scale, shift = split(f)
            return (output - shift) / scale
        return _combine(fn_out, merge)

    return CouplingPair(forward, inverse)


def pick(couplings: Union[None, COUPLING, Sequence], index: int) -> COUPLING:
    """RevLib's rule: a list of couplings is cycled per layer; ``None`` (or a ``None`` entry) means additive."""
    if couplings is None:
        return None
    if callable(couplings):
        return couplings
    couplings = list(couplings)
    if not couplings:
        return None
    return couplings[index % len(couplings)]
