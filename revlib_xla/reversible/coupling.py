"""Coupling functions: how a block's output ``f(x1)`` is merged into the other stream, and how that is undone.

A coupling pair is ``forward(other_stream, fn_out) -> new_stream`` and ``inverse(new_stream, fn_out) ->
other_stream``. The reversible core differentiates ``forward`` with autograd, so any invertible pair works: the
gradient of the other stream comes from the pair's own vector-Jacobian product, not from assuming it is additive.

``fn_out`` may be a list or tuple (a block returning extras, as HuggingFace layers do): element 0 is what gets
coupled, as in RevLib; the core keeps only element 0 of the result as the stream.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import torch

from .. import _tree

Tensor = torch.Tensor
TENSOR_OR_LIST = list[Tensor] | Tensor
COUPLING = Callable[[Tensor, TENSOR_OR_LIST], TENSOR_OR_LIST]

__all__ = [
    "COUPLING",
    "TENSOR_OR_LIST",
    "CouplingPair",
    "additive_coupling_forward",
    "additive_coupling_inverse",
    "momentum_coupling",
    "affine_coupling",
    "first_tensor",
    "optional_detach",
    "detached_additive_coupling_forward",
    "detached_additive_coupling_inverse",
    "is_additive_forward",
    "is_additive_inverse",
    "MomentumForward",
    "MomentumInverse",
    "AffineForward",
    "AffineInverse",
]


class CouplingPair(NamedTuple):
    """A coupling and its inverse, ready to pass as ``coupling_forward=[pair.forward]`` and
    ``coupling_inverse=[pair.inverse]``."""

    forward: COUPLING
    inverse: COUPLING


def optional_detach(inp: Any) -> Any:
    """``inp`` with every tensor detached, also inside (nested) tuples, lists and dicts; everything else is kept."""
    return _tree.detached(inp)


def first_tensor(value: Tensor | Sequence[Any]) -> Tensor:
    """Element 0 of a list/tuple result, or the tensor itself."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("a block or coupling returned an empty list/tuple; expected a tensor first")
        return value[0]
    return cast(Tensor, value)  # callers check what a block returned (it may be anything)


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


def detached_additive_coupling_forward(other_stream: Tensor, fn_out: TENSOR_OR_LIST) -> TENSOR_OR_LIST:
    """``other_stream + f`` with the extras of a list output detached (RevLib's helper)."""
    if isinstance(fn_out, (list, tuple)):
        return [other_stream + fn_out[0]] + [optional_detach(x) for x in fn_out[1:]]
    return other_stream + fn_out


def detached_additive_coupling_inverse(output: Tensor, fn_out: TENSOR_OR_LIST) -> TENSOR_OR_LIST:
    """Inverse of :func:`detached_additive_coupling_forward`: ``output - f``, extras detached."""
    if isinstance(fn_out, (list, tuple)):
        return [output - fn_out[0]] + [optional_detach(x) for x in fn_out[1:]]
    return output - fn_out


# The couplings whose stream is ``other + f`` (and whose inverse is ``output - f``); ``None`` means additive.
_ADDITIVE_FORWARDS = (None, additive_coupling_forward, detached_additive_coupling_forward)
_ADDITIVE_INVERSES = (None, additive_coupling_inverse, detached_additive_coupling_inverse)


def is_additive_forward(coupling: COUPLING | None) -> bool:
    """Whether ``coupling`` is one of the library's additive couplings (or ``None``, which means additive)."""
    return any(coupling is c for c in _ADDITIVE_FORWARDS)


def is_additive_inverse(coupling: COUPLING | None) -> bool:
    """Whether ``coupling`` is one of the library's additive inverses (or ``None``)."""
    return any(coupling is c for c in _ADDITIVE_INVERSES)


# Couplings made by the factories below are small frozen dataclasses rather than closures: a model holding them
# can be pickled (``torch.save(model)``), deep-copied, and compared.


@dataclasses.dataclass(frozen=True)
class MomentumForward:
    """MomentumNet's coupling ``beta * other + (1 - beta) * f`` (made by :func:`momentum_coupling`)."""

    beta: float

    def __call__(self, other_stream: Tensor, fn_out: TENSOR_OR_LIST) -> TENSOR_OR_LIST:
        return _combine(fn_out, lambda f: other_stream * self.beta + f * (1 - self.beta))


@dataclasses.dataclass(frozen=True)
class MomentumInverse:
    """Inverse of :class:`MomentumForward`: ``(output - (1 - beta) * f) / beta``."""

    beta: float

    def __call__(self, output: Tensor, fn_out: TENSOR_OR_LIST) -> TENSOR_OR_LIST:
        return _combine(fn_out, lambda f: (output - f * (1 - self.beta)) / self.beta)


def momentum_coupling(beta: float) -> CouplingPair:
    """MomentumNet's coupling ``beta * other + (1 - beta) * f`` and its inverse.

    The inverse divides by ``beta``, so a rounding error in a rebuilt stream grows by about ``1 / beta`` every two
    layers: deep stacks with a small ``beta`` cannot be inverted in float32 (``beta=0.1``: the input rebuilt through
    8 layers is off by about 2e-4, through 12 by 3e-2). The first training forward measures this on the real input
    and refuses what would give wrong gradients (``verify_inverse`` of :class:`~revlib_xla.ReversibleSequential`).
    """
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"momentum_coupling: beta must be in (0, 1], got {beta!r}; beta = 0 is not invertible")
    return CouplingPair(MomentumForward(beta), MomentumInverse(beta))


@dataclasses.dataclass(frozen=True)
class _Affine:
    dim: int
    scale_offset: float
    eps: float

    def scale_and_shift(self, fn_out: Tensor) -> tuple[Tensor, Tensor]:
        if fn_out.shape[self.dim] % 2:
            raise ValueError(
                f"affine_coupling: the block must return an even number of features along dim {self.dim} "
                f"(scale and shift halves), got shape {tuple(fn_out.shape)}"
            )
        log_scale, shift = fn_out.chunk(2, self.dim)
        return torch.sigmoid(log_scale + self.scale_offset) + self.eps, shift


class AffineForward(_Affine):
    """Glow/RealNVP-style coupling ``other * scale + shift`` (made by :func:`affine_coupling`)."""

    def __call__(self, other_stream: Tensor, fn_out: TENSOR_OR_LIST) -> TENSOR_OR_LIST:
        def merge(f: Tensor) -> Tensor:
            scale, shift = self.scale_and_shift(f)
            return other_stream * scale + shift

        return _combine(fn_out, merge)


class AffineInverse(_Affine):
    """Inverse of :class:`AffineForward`: ``(output - shift) / scale``."""

    def __call__(self, output: Tensor, fn_out: TENSOR_OR_LIST) -> TENSOR_OR_LIST:
        def merge(f: Tensor) -> Tensor:
            scale, shift = self.scale_and_shift(f)
            return (output - shift) / scale

        return _combine(fn_out, merge)


def affine_coupling(dim: int = 1, scale_offset: float = 2.0, eps: float = 1e-3) -> CouplingPair:
    """Glow/RealNVP-style affine coupling ``other * scale + shift``.

    The block returns ``2 * C`` features along ``dim`` for a stream of ``C``: the first half parameterizes the scale
    as ``sigmoid(s + scale_offset) + eps`` (positive, bounded away from 0, close to 1 at initialization), the second
    half is the shift.
    """
    return CouplingPair(AffineForward(dim, scale_offset, eps), AffineInverse(dim, scale_offset, eps))


def pick(couplings: COUPLING | Sequence[COUPLING | None] | None, index: int) -> COUPLING | None:
    """RevLib's rule: a list of couplings is cycled per layer; ``None`` (or a ``None`` entry) means additive."""
    if couplings is None:
        return None
    if callable(couplings):
        return couplings
    couplings = list(couplings)
    if not couplings:
        return None
    return couplings[index % len(couplings)]
