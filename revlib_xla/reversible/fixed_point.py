"""Fixed-point streams: reversible residual streams that invert bit for bit.

An additive coupling ``y1 = x0 + f(x1)`` undone as ``x0 = y1 - f(y0)`` rebuilds ``x0`` exactly only in exact
arithmetic. In floating point the sum rounds away the low bits of ``x0`` whenever ``f`` and ``x0`` differ in
magnitude, the subtraction cannot bring them back, and each layer's inverse multiplies what was lost by its block's
Jacobian: at Llama-3.2-1B's width (hidden 2048) sixteen layers rebuild their input only to a relative 3e-2 in
float32 and not at all in bfloat16.

Here a stream is an integer tensor counting units of ``2**-fraction_bits`` (:class:`FixedPoint`). A block's output
is rounded once to that grid and added as an integer; integer addition and subtraction are exact, so the backward
subtracts the same integers and gets the input back bit for bit whenever the recomputed block output equals the
forward's (MacKay et al. 2018 store recurrent states in fixed point for the same reason). The blocks see the stream
decoded to floating point, and the rounding is differentiated straight through, so plain autograd over the same
fixed-point function (``MemoryModes.no_savings``) is the reference for the memory-saving backward.

The grid: ``int64`` counting ``2**-F``. On an eager device ``F`` follows the input's scale
(:meth:`FixedPoint.for_values`, a block floating-point exponent chosen per forward: the input's largest magnitude
``2**-30`` of the streams' range), so neither small activations (1e-8) lose precision nor large ones range; on a lazy
device (XLA), where choosing it would read the input, ``F = 32`` (:data:`GRID`). Measured against the alternatives at
``F = 32`` (``bench/results/exact_streams-*.md``):

* the function: a block output is rounded to 2.3e-10 absolute. A float32 stream rounds every sum to 6e-8 relative
  (1.2e-9 at a stream value of 0.02, the scale of Llama's embeddings); a bfloat16 one to 4e-3 relative. The
  fixed-point stream also adds without rounding, so it is closer to exact arithmetic than a float32 stream wherever
  the stream's values exceed about 2e-3 (and within 1.2e-10 absolute below).
* the range: a stream and a block output each below ``2**62`` units (2**30, 1.1e9, at ``F = 32``), checked
  exactly: each layer records the extremes of what it adds and of the stream it leaves, so no sum can wrap around
  (far beyond any trained residual stream: Llama's largest activations are in the thousands). Beyond it, the
  forward raises naming the layer (:class:`StreamGuard`); it never wraps around.
* the bytes: 8 per stream element (float32 streams: 4; bfloat16: 2). A reversible stack keeps two streams whatever
  its depth, so this is a constant, not a per-layer cost.

An ``int32`` grid would halve the bytes but leave 31 bits for range and precision together: a grid fine enough for
small streams (2**-20) overflows at 2048 / layers. Float64 streams on a grid are exact too (53 bits) but are slow or
emulated on GPUs and TPUs, where 64-bit integer addition is cheap.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from .. import backends
from ..errors import ReversibleError

Tensor = torch.Tensor

__all__ = ["FixedPoint", "FixedStreamError", "StreamGuard", "GRID", "encode_input", "couple"]


class FixedStreamError(ReversibleError):
    """A value did not fit a fixed-point stream (beyond its range, or not finite); the message names the layer."""


@dataclasses.dataclass(frozen=True)
class FixedPoint:
    """A fixed-point stream format: ``dtype`` integers counting units of ``2**-fraction_bits``."""

    fraction_bits: int = 32
    dtype: torch.dtype = torch.int64

    @property
    def unit(self) -> float:
        return 2.0**-self.fraction_bits

    def work_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The floating dtype the values are scaled and rounded in: float32, or float64 for float64 values."""
        return torch.float64 if dtype == torch.float64 else torch.float32

    def scaled(self, x: Tensor) -> Tensor:
        """``x`` in units of the grid, rounded to the nearest (ties to even), as floating point (exact: a power of
        two scales without rounding)."""
        work = x.to(self.work_dtype(x.dtype))
        scaled = work.mul_(2.0**self.fraction_bits) if work is not x else work * 2.0**self.fraction_bits
        return scaled.round_()

    def encode(self, x: Tensor) -> Tensor:
        """``x`` as a stream: the nearest point of the grid."""
        return self.scaled(x).to(self.dtype)

    def decode(self, stream: Tensor, dtype: torch.dtype) -> Tensor:
        """The stream's values in ``dtype``."""
        value = stream.to(self.work_dtype(dtype)).mul_(self.unit)
        return value if value.dtype == dtype else value.to(dtype)

    def bound(self, addends: int) -> float:
        """The largest magnitude one of ``addends`` values added into a stream may have, in units of the grid, so
        that no sum of them leaves the integers' range."""
        return float(2 ** (torch.iinfo(self.dtype).bits - 1)) / (addends + 1)

    def range_in_values(self, addends: int) -> float:
        return self.bound(addends) * self.unit

    @classmethod
    def for_values(cls, *values: Tensor, headroom: int = 30) -> FixedPoint:
        """The grid for streams that start as ``values`` (read: an eager device only): their largest magnitude at
        ``2**-headroom`` of the streams' range (2**62 units), so that the stack may grow it ``2**headroom`` times."""
        largest = max((float(v.detach().abs().amax()) for v in values if v.numel()), default=0.0)
        exponent = math.frexp(largest)[1] if 0.0 < largest < math.inf else 1
        bound = 1000 if any(v.dtype == torch.float64 for v in values) else 100  # 2.0**F within the work dtype
        return cls(fraction_bits=max(-bound, min(bound, 62 - headroom - exponent)))


#: The format of the reversible streams on lazy devices (and the default :meth:`ReversibleSequential.exact_format`).
GRID = FixedPoint()

#: every value in a stream, and every value added to one, stays below this many units: no sum of two can wrap
LIMIT = 2.0**62


class _Encode(torch.autograd.Function):
    """A float tensor as a stream: ``(value, stream)`` with ``value = decode(stream)`` in ``dtype``; the rounding is
    differentiated straight through."""

    @staticmethod
    def forward(ctx, x: Tensor, grid: FixedPoint, dtype: torch.dtype, scaled: Tensor):  # type: ignore[override]
        ctx.x_dtype = x.dtype
        stream = scaled.to(grid.dtype)
        ctx.mark_non_differentiable(stream)
        return grid.decode(stream, dtype), stream

    @staticmethod
    def backward(ctx, dvalue: Tensor, _dstream: Tensor | None):  # type: ignore[override]
        return dvalue.to(ctx.x_dtype), None, None, None


class _Couple(torch.autograd.Function):
    """The value of ``x0 + f`` on the grid: ``decode(stream)``, where ``stream`` (computed by the caller) is
    ``x0``'s stream plus ``f`` rounded to the grid; both ``x0`` and ``f`` get the incoming gradient (straight
    through the rounding), ``f``'s summed to its shape and cast to its dtype, as autograd does for ``x0 + f``."""

    @staticmethod
    def forward(ctx, x0: Tensor, f: Tensor, stream: Tensor, grid: FixedPoint):  # type: ignore[override]
        ctx.f_shape, ctx.f_dtype, ctx.x0_shape = f.shape, f.dtype, x0.shape
        return grid.decode(stream, x0.dtype)

    @staticmethod
    def backward(ctx, dvalue: Tensor):  # type: ignore[override]
        dx0 = dvalue if ctx.x0_shape == dvalue.shape else dvalue.sum_to_size(ctx.x0_shape)
        return dx0, branch_gradient(dvalue, ctx.f_shape, ctx.f_dtype), None, None


def branch_gradient(dstream: Tensor, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """The gradient of a block output of ``shape`` and ``dtype`` added into a stream whose gradient is ``dstream``:
    summed over broadcast dimensions, in the output's dtype (what autograd gives for ``x0 + f``)."""
    g = dstream if dstream.shape == shape else dstream.sum_to_size(shape)
    return g if g.dtype == dtype else g.to(dtype)


class StreamGuard:
    """The range check of one forward: every value added into a stream (the input, each block's output) and every stream
    a layer leaves must stay below :data:`LIMIT` units and be finite, so that no sum wraps around (both terms below
    2**62, their sum below 2**63). Each layer records the extremes of what it adds and of the stream it leaves (two
    reductions, no synchronization). On an eager device alone, :meth:`judge` reads them all at once after the forward
    and raises :class:`FixedStreamError` naming the first layer at fault. Where reading would cost the step (a lazy
    device, XLA: the read runs or waits for the step's graph) or would leave other processes waiting (a data-parallel
    group: one rank raising while the others enter the gradient all-reduce), nothing is read: :meth:`poison` turns the
    forward's outputs into NaN where the check failed, so that a stream that overflowed can only show as a non-finite
    loss, never as a finite wrong number, and :meth:`judge` names the layer when asked afterwards
    (:func:`revlib_xla.reversible.stream_range_error`)."""

    def __init__(self, grid: FixedPoint, layers: int, describe) -> None:
        self.grid = grid
        self.limit = LIMIT
        self.describe = describe  # layer index -> words (-1: the input)
        self.where: list[int] = []
        self.extremes: list[Tensor] = []
        self.packed: Tensor | None = None  # (len(where), 2), once the forward is over (see close)

    def record(self, where: int, scaled: Tensor) -> None:
        """``scaled``: the values in units of the grid, before the conversion to integers (or an integer stream)."""
        if scaled.numel() == 0:
            return
        if backends.is_tracing_lazily(scaled):  # (torch_xla 2.9's aminmax crashes inside a compiled loop's body)
            lo, hi = scaled.min(), scaled.max()
        else:  # one pass
            lo, hi = torch.aminmax(scaled)
        self.where.append(where)
        self.extremes.append(torch.stack([lo.float(), hi.float()]).unsqueeze(0))

    def record_many(self, where: Sequence[int], extremes: Tensor) -> None:
        """Extremes already reduced (a compiled loop's per-iteration outputs): ``extremes[k]`` is ``(lo, hi)`` of
        ``where[k]`` (each layer's addend, then the stream it leaves)."""
        self.where.extend(where)
        self.extremes.append(extremes.float())  # one piece (a compiled program that does not grow with depth)

    def close(self) -> None:
        """The forward is over: every extreme in one tensor (on a lazy device, one more output of the step's graph,
        read with one transfer)."""
        if self.extremes:
            self.packed = torch.cat(self.extremes) if len(self.extremes) > 1 else self.extremes[0]
        self.extremes = []

    def poison(self) -> Tensor | None:
        """A 0-dim float32 tensor (after :meth:`close`): 0 where every recorded value fits the grid, NaN where one
        does not or is not finite (NaN compares false); nothing is read."""
        if self.packed is None:
            return None
        fits = (self.packed[:, 0] > -self.limit) & (self.packed[:, 1] < self.limit)
        return torch.where(fits.all(), 0.0, float("nan"))

    def finite(self) -> bool:
        """Read the extremes (after :meth:`close`): whether every recorded value was finite."""
        if self.packed is None:
            return True
        return bool(torch.isfinite(self.packed).all())

    def judge(self, previous: bool = False) -> None:
        """Read the extremes; raise :class:`FixedStreamError` for the first layer at fault (``previous``: the
        forward is an earlier one, whose outputs were made NaN instead)."""
        if self.packed is None:
            return
        values = self.packed.cpu().tolist()
        limit = self.limit
        for where, (lo, hi) in zip(self.where, values):
            if lo > -limit and hi < limit:
                continue
            what = self.describe(where)
            when = " (in an earlier forward, whose outputs were made NaN: see StreamGuard)" if previous else ""
            finite = all(v == v and abs(v) != float("inf") for v in (lo, hi))
            if not finite:
                raise FixedStreamError(
                    f"ReversibleSequential: {what} produced NaN or infinite values{when}, which the exact "
                    f"(fixed-point) streams cannot hold. The model diverged or its input is not finite: check the "
                    f"input, the learning rate and the weights (torch.isfinite)."
                )
            largest = max(abs(lo), abs(hi)) * self.grid.unit
            raise FixedStreamError(
                f"ReversibleSequential: {what} produced a value of magnitude {largest:.3g}{when}, beyond what the "
                f"exact (fixed-point) streams hold without overflowing: {limit * self.grid.unit:.3g} (a grid of "
                f"2**-{self.grid.fraction_bits} in {str(self.grid.dtype).removeprefix('torch.')}, set from the "
                f"input's magnitude on an eager device: the stack grew its input over 2**30 times). The activations "
                f"are diverging: lower the learning rate or normalize the block's output; or pass exact=False for "
                f"floating-point streams (checked, not exact)."
            )


def encode_input(grid: FixedPoint, x: Tensor, dtype: torch.dtype, guard: StreamGuard | None) -> tuple[Tensor, Tensor]:
    """``x`` entering a stream: ``(value, stream)``, ``value`` in ``dtype`` carrying ``x``'s gradient."""
    scaled = grid.scaled(x.detach())
    if guard is not None:
        guard.record(-1, scaled)
    value, stream = _Encode.apply(x, grid, dtype, scaled)
    return value, stream


def couple(
    grid: FixedPoint,
    x0_stream: Tensor,
    f: Tensor,
    dtype: torch.dtype,
    guard: StreamGuard | None,
    where: int,
    x0: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``x0 + f`` on the grid: ``(value, stream)``, ``value`` in ``dtype``. Where autograd records (plain autograd,
    the reference) and ``x0`` (the value of ``x0_stream``) or ``f`` require grad, ``value`` carries their gradients;
    in the memory-saving forward it is just the decoded stream."""
    scaled = grid.scaled(f.detach())
    if guard is not None:
        guard.record(where, scaled)
    stream = scaled.to(grid.dtype)
    del scaled
    stream = stream.add_(x0_stream) if stream.shape == x0_stream.shape else x0_stream + stream  # (in place: one
    # stream-sized integer tensor less)
    if guard is not None:
        guard.record(where, stream)  # the stream it leaves: with both terms below 2**62, no sum wraps
    if torch.is_grad_enabled() and (f.requires_grad or (x0 is not None and x0.requires_grad)):
        carrier = x0 if x0 is not None else torch.zeros((), dtype=dtype, device=f.device)
        return _Couple.apply(carrier, f, stream, grid), stream
    return grid.decode(stream, dtype), stream


def uncouple(grid: FixedPoint, y1_stream: Tensor, f: Tensor) -> Tensor:
    """The other stream rebuilt: ``y1 - f`` on the grid, exact."""
    q = grid.encode(f.detach())
    return q.neg_().add_(y1_stream) if q.shape == y1_stream.shape else y1_stream - q
