"""Exact momentum stacks: a residual stack run as a MomentumNet whose backward rebuilds every layer's input bit for
bit, at any momentum ``beta``, so that a small ``beta`` keeps a pretrained stack's function.

The function of a stack of residual branches ``r_k(x) = layer_k(x) - x`` (MomentumNet, Sander et al. 2021)::

    v_1 = r_0(x_0)                                  x_1 = x_0 + v_1          (the first layer as it was)
    v_{k+1} = beta v_k + (1 - beta) r_k(x_k)        x_{k+1} = x_k + v_{k+1}  (k >= 1)

At ``beta = 0`` this is the residual stack itself; each later layer's output differs from the original's
``x_k + r_k(x_k)`` by ``beta (v_k - r_k(x_k))``, about ``beta`` times the change of the residual branch's output from
one layer to the next. Measured on a 12-layer Llama trained to a plateau (``bench/hf_keeps_what_it_learned.py``):
the validation loss moves by 0.08 % at ``beta = 2**-6`` and 0.02 % at ``2**-8``; the two-stream reversible form
moves it by 45 %.

**Why exact.** ``x`` and ``v`` are integer streams counting units of ``2**-F`` (``F`` chosen per forward from the
input's magnitude, :class:`StreamScale`), so every addition is exact. ``beta = n / 2**m`` (``n`` odd): the product
``n v_k`` loses its ``m`` lowest bits to the shift by ``m``, and those bits are kept, packed (``m`` bits per element
per layer; MacKay et al. 2018 keep them the same way for reversible recurrent networks). The backward undoes each
layer exactly: ``x_k = x_{k+1} - v_{k+1}``; ``r_k(x_k)`` recomputed (the same random numbers and autocast state);
``v_k = ((v_{k+1} - R_k) << m | kept bits) / n``. The rounding of a block output to the grid is differentiated
straight through, so plain autograd over the same integer function (:func:`reference_forward`) gives the memory-saving
backward's gradients.

**Memory.** Two ``int64`` streams (16 bytes per element of the hidden state, whatever the depth), the kept bits
(``m / 8`` bytes per element per layer: at ``beta = 2**-6``, 0.75 bytes, where checkpointing keeps each layer's input,
2 bytes in bfloat16 and 4 in float32), one layer's recomputation and the gradients of the two streams.

**Random numbers** are drawn from torch's global generators exactly as the plain stack draws them (one layer after
the other, nothing drawn besides), and each layer's recomputation replays them from the state captured before the
layer (as ``torch.utils.checkpoint`` does), so dropout masks equal the plain model's.

**Range.** The input's largest magnitude is placed :attr:`StreamScale.headroom` bits below the streams' range, so the
stack may grow it by ``2**24`` (a Llama's residual stream grows from its embeddings' 0.02 to a few thousand); the
forward bounds every stream from the largest block outputs (one reduction per layer), and on an eager device, where
that bound is read after the forward, a stack that outgrew it runs again on a coarser grid. A block output that is
not finite makes the stack's output NaN, as it would make the plain model's loss NaN (a gradient scaler then skips the
step).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .. import backends
from .._tree import tree_leaves
from ..errors import ReversibleError

Tensor = torch.Tensor

__all__ = [
    "Momentum",
    "StreamScale",
    "ExactMomentumStack",
    "reference_values",
    "reference_forward",
    "kept_bytes_per_layer",
]

#: streams stay below 2**62 in magnitude, so the sum of two never leaves int64
_LIMIT = 2.0**62


@dataclasses.dataclass(frozen=True)
class Momentum:
    """``beta = numerator / 2**bits`` with an odd numerator: the backward keeps ``bits`` bits per element per layer."""

    numerator: int
    bits: int

    @classmethod
    def of(cls, beta: float, max_bits: int = 16) -> Momentum:
        if not isinstance(beta, (int, float)) or not 0.0 < float(beta) < 1.0:
            raise ReversibleError(f"exact momentum: beta must be in (0, 1), got {beta!r}")
        for bits in range(1, max_bits + 1):
            numerator = float(beta) * 2**bits
            if numerator == int(numerator):
                return cls(int(numerator), bits)
        near = round(float(beta) * 2**max_bits) / 2**max_bits
        raise ReversibleError(
            f"exact momentum: beta={beta!r} is not a fraction n / 2**m with m <= {max_bits}; the backward keeps the m "
            f"bits the multiplication by beta drops, so beta must be one (e.g. 2**-6, 0.5, or {near!r}, the nearest "
            f"with m = {max_bits})"
        )

    @property
    def beta(self) -> float:
        return self.numerator / 2**self.bits


def kept_bytes_per_layer(elements: int, bits: int) -> int:
    """Bytes the forward keeps per layer for ``elements`` elements of the hidden state and ``bits`` bits each."""
    if bits > 8:
        return 2 * elements
    if bits == 8:
        return elements
    return bits * -(-elements // 8)


def _pack(low: Tensor, bits: int) -> Tensor:
    """``low`` (integers in ``[0, 2**bits)``) in ``bits`` bits each: ``bits`` bit planes of eight elements per byte
    below 8 bits, one byte per element at 8, two from 9 to 16."""
    if bits == 8:
        return low.to(torch.uint8)
    if bits > 8:
        return low.to(torch.int16)  # wraps modulo 2**16; _unpack masks it back
    flat = low.reshape(-1).to(torch.uint8)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    groups = flat.view(-1, 8)
    weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=low.device)
    planes = [((groups >> b) & 1).mul_(weights).sum(dim=1, dtype=torch.uint8) for b in range(bits)]
    return torch.stack(planes)


def _unpack(packed: Tensor, bits: int, like: Tensor) -> Tensor:
    """The ``int64`` integers :func:`_pack` packed, in the shape of ``like``."""
    if bits == 8:
        return packed.to(torch.int64)
    if bits > 8:
        return packed.to(torch.int64) & 0xFFFF
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    low = torch.zeros(packed.shape[1] * 8, dtype=torch.int64, device=packed.device)
    for b in range(bits):
        plane = (packed[b].unsqueeze(1) >> shifts) & 1
        low |= plane.reshape(-1).to(torch.int64) << b
    return low[: like.numel()].view(like.shape)


def _pow2(exponent: Tensor, work: torch.dtype) -> Tensor:
    """``2**exponent`` (an integer tensor within the normal range of ``work``), exact: built from its bits."""
    if work == torch.float64:
        return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


@dataclasses.dataclass
class StreamScale:
    """One forward's grid: the streams count units of ``2**-F``, with ``F`` a 0-dim integer tensor on the device
    (nothing is read) chosen so that the input's largest magnitude is ``2**-headroom`` of the streams' range: a
    block floating-point format whose one exponent follows the stack's input, so that neither large nor small
    activations lose range or precision."""

    scale: Tensor  # 2**F, in the work dtype
    unscale: Tensor  # 2**-F
    exponent: Tensor  # F (int64)
    work: torch.dtype  # float32, or float64 for float64 values

    headroom = 24

    @classmethod
    def of(cls, x: Tensor, extra: int = 0) -> StreamScale:
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        amax = torch.nan_to_num(x.detach().abs().amax().to(work), nan=0.0, posinf=0.0)
        e = torch.where(amax > 0, torch.floor(torch.log2(amax)) + 1, torch.zeros_like(amax)).to(torch.int64)
        bound = 1022 if work == torch.float64 else 126
        exponent = (62 - cls.headroom - extra - e).clamp(-bound, bound)
        return cls(_pow2(exponent, work), _pow2(-exponent, work), exponent, work)

    def coarser(self, shift: Tensor) -> StreamScale:
        """The grid ``2**shift`` times coarser (``shift``: a 0-dim integer tensor)."""
        exponent = self.exponent - shift
        return StreamScale(_pow2(exponent, self.work), _pow2(-exponent, self.work), exponent, self.work)

    def scaled(self, x: Tensor) -> Tensor:
        """``x`` in units of the grid, rounded to the nearest (floating point: scaling by a power of two is exact)."""
        return (x.detach().to(self.work) * self.scale).round_()

    def encode(self, x: Tensor) -> Tensor:
        return self.scaled(x).to(torch.int64)

    def decode(self, stream: Tensor, dtype: torch.dtype) -> Tensor:
        value = stream.to(self.work).mul_(self.unscale)
        return value if value.dtype == dtype else value.to(dtype)


class _Run:
    """One forward of a stack: its blocks, call, grid, and what the backward needs (the kept bits and random states
    per layer, the streams the backward walks down)."""

    def __init__(self, stack: ExactMomentumStack, x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.stack = stack
        self.args, self.kwargs = args, kwargs
        self.dtype = x.dtype
        self.device = x.device
        self.lazy = backends.is_tracing_lazily(x)
        self.autocast = backends.AutocastState.capture(x.device)
        self.scale: StreamScale | None = None
        self.kept: list[Tensor | None] = []
        self.rng: list[Any] = []
        self.largest: list[Tensor] = []  # per layer: the largest |block output| in units of the grid
        self.x_stream: Tensor | None = None
        self.v_stream: Tensor | None = None
        self.v_grad: Tensor | None = None  # the gradient of v_{k+1}, handed from layer k+1's backward to layer k's
        self.poisoned = False
        self.first_input: Tensor | None = None  # the first layer's input: the input on the grid
        self.input_stream: Tensor | None = None  # with stack.verify: the input's stream, to compare the rebuilt one
        self.input_largest: Tensor | None = None
        # layer-by-layer runs (make_room): bounds of |x| and |v| in units of the grid, and whether all was finite
        self.x_bound: Tensor | None = None
        self.v_bound: Tensor | None = None
        self.finite: Tensor | None = None

    def start(self, x: Tensor, extra: int = 0) -> Tensor:
        """Put ``x`` on a new grid: the streams ``(x, 0)``; returns the first layer's input (``x`` on the grid)."""
        self.scale = StreamScale.of(x, extra)
        self.input_largest = x.detach().abs().amax()
        self.x_stream = self.scale.encode(x)
        self.v_stream = torch.zeros_like(self.x_stream)
        self.x_bound = self.input_largest.to(torch.float64) * self.scale.scale.to(torch.float64)
        self.v_bound = torch.zeros_like(self.x_bound)
        self.finite = torch.isfinite(self.x_bound)
        return self.scale.decode(self.x_stream, x.dtype)

    def value(self) -> Tensor:
        """The ``x`` stream's value; NaN everywhere once a value was not finite (layer-by-layer runs)."""
        assert self.scale is not None and self.x_stream is not None and self.finite is not None
        value = self.scale.decode(self.x_stream, self.dtype)
        return value + torch.where(self.finite, 0.0, float("nan")).to(value.dtype)

    def make_room(self, k: int, r: Tensor) -> None:
        """In a layer-by-layer run (no backward rebuilds from it): before layer ``k``'s output ``r`` is added, move
        the streams to a grid coarse enough that nothing overflows (on the device: nothing is read; the bits shifted
        out are rounding no backward needs)."""
        assert self.scale is not None and self.x_bound is not None and self.v_bound is not None
        assert self.x_stream is not None and self.v_stream is not None and self.finite is not None
        m = self.momentum(k)
        beta, n = (0.0, 1.0) if m is None else (m.beta, float(m.numerator))
        r_bound = r.detach().abs().amax().to(torch.float64) * (1.0 - beta) * self.scale.scale.to(torch.float64)
        v_next = self.v_bound * beta + r_bound + 1
        x_next = self.x_bound + v_next
        worst = torch.maximum(x_next, torch.maximum(v_next, self.v_bound) * n)
        self.finite = self.finite & torch.isfinite(worst)
        worst = torch.nan_to_num(worst, nan=1.0, posinf=1.0)
        shift = torch.ceil(torch.log2(worst / 2.0**60)).clamp(0, 62).to(torch.int64)
        self.x_stream = self.x_stream >> shift
        self.v_stream = self.v_stream >> shift
        self.scale = self.scale.coarser(shift)
        down = _pow2(-shift, torch.float64)
        self.x_bound = self.x_bound * down + 1
        self.v_bound = self.v_bound * down + 1

    def momentum(self, k: int) -> Momentum | None:
        return None if k == 0 else self.stack.momentum

    def block_output(self, k: int, x: Tensor) -> Tensor:
        out = self.stack.blocks[k](x, *self.args, **self.kwargs)
        return out

    def quantized(self, k: int, r: Tensor, record: bool = False) -> Tensor:
        """``(1 - beta) r`` (the first layer: ``r``) on the grid, as the integers added to ``v``; ``record``: note
        its largest magnitude for the range check."""
        assert self.scale is not None
        m = self.momentum(k)
        value = r.detach().to(self.scale.work)  # (may share r's memory: nothing below writes into it)
        if m is not None:
            scaled = (value * (1.0 - m.beta)).mul_(self.scale.scale).round_()
        else:
            scaled = (value * self.scale.scale).round_()
        if record:
            self.largest.append(scaled.abs().amax())
        return scaled.to(torch.int64)

    def step(self, k: int, x_value: Tensor, keep: bool = True) -> None:
        """Layer ``k`` forward on the streams (no autograd); ``keep``: record its random state and kept bits for the
        backward (else: a layer-by-layer run, :meth:`make_room`)."""
        if keep:
            self.rng.append(backends.RngState.capture(self.device))
        r = self.block_output(k, x_value)
        if not keep:
            self.make_room(k, r)
        big_r = self.quantized(k, r, record=keep)
        del r
        self.add(k, big_r, keep)

    def add(self, k: int, big_r: Tensor, keep: bool) -> None:
        """Add layer ``k``'s block output on the grid, ``big_r``, to the streams: ``v <- (n v >> m) + big_r``,
        ``x <- x + v``; ``keep``: keep the ``m`` bits the shift drops (else update the layer-by-layer bounds)."""
        assert self.x_stream is not None and self.v_stream is not None
        m = self.momentum(k)
        if m is None:
            v = big_r
            if keep:
                self.kept.append(None)
        else:
            w = self.v_stream * m.numerator if m.numerator != 1 else self.v_stream
            if keep:
                self.kept.append(_pack(w & ((1 << m.bits) - 1), m.bits))
            v = (w >> m.bits).add_(big_r)
        self.v_stream = v
        self.x_stream = self.x_stream + v
        if not keep:
            self.bound_after(k, big_r)

    def bound_after(self, k: int, big_r: Tensor) -> None:
        """The bounds of a layer-by-layer run after layer ``k`` added ``big_r`` (see :meth:`make_room`)."""
        assert self.x_bound is not None and self.v_bound is not None
        m = self.momentum(k)
        beta = 0.0 if m is None else m.beta
        self.v_bound = self.v_bound * beta + big_r.abs().amax().to(torch.float64) + 1
        self.x_bound = self.x_bound + self.v_bound

    def unstep(self, k: int, r: Tensor) -> None:
        """Undo layer ``k`` on the streams, given its recomputed block output ``r`` at ``x_k``."""
        assert self.x_stream is not None and self.v_stream is not None
        big_r = self.quantized(k, r)
        m = self.momentum(k)
        kept = self.kept[k]
        self.kept[k] = None
        if m is None:
            self.v_stream = None  # v_0 = 0, not a stream anyone reads
            return
        assert kept is not None
        w = ((self.v_stream - big_r) << m.bits) | _unpack(kept, m.bits, self.v_stream)
        self.v_stream = w if m.numerator == 1 else torch.div(w, m.numerator, rounding_mode="trunc")

    def range_check(self) -> tuple[Tensor, Tensor]:
        """Two 0-dim tensors: whether every value was finite, and a bound (in units of the grid, float64) on the
        streams' magnitudes and on ``n v``, from the input's and the block outputs' largest magnitudes: below
        2**62, no integer operation overflowed."""
        assert self.scale is not None and self.input_largest is not None
        largest = torch.stack([t.to(torch.float64) for t in self.largest])
        beta = self.stack.momentum.beta
        n = float(self.stack.momentum.numerator)
        x_bound = self.input_largest.to(torch.float64) * self.scale.scale.to(torch.float64)
        finite = torch.isfinite(largest).all() & torch.isfinite(x_bound)
        v_bound = torch.zeros((), dtype=torch.float64, device=largest.device)
        worst = x_bound
        for k in range(largest.shape[0]):
            v_bound = (v_bound * beta if k else v_bound) + largest[k] + 1
            x_bound = x_bound + v_bound
            worst = torch.maximum(worst, torch.maximum(x_bound, v_bound * n))
        return finite, worst


class _LayerFn(torch.autograd.Function):
    """One layer of an exact momentum stack as one autograd node that saves no activation: its forward runs the
    layer on the streams without autograd, its backward undoes the layer and takes the block's vector-Jacobian
    product at the rebuilt input (parameter gradients accumulate per layer, as autograd accumulates them)."""

    @staticmethod
    def forward(ctx, run: _Run, k: int, x_value: Tensor, *params: Tensor):  # type: ignore[override]
        ctx.run, ctx.k = run, k
        ctx.n_params = len(params)
        ctx.save_for_backward(*params)  # (their version counters guard against in-place changes before the backward)
        block_input = run.first_input if k == 0 and run.first_input is not None else x_value
        run.step(k, block_input)
        assert run.scale is not None and run.x_stream is not None
        return run.scale.decode(run.x_stream, run.dtype)

    @staticmethod
    def backward(ctx, x_grad: Tensor):  # type: ignore[override]
        run: _Run = ctx.run
        k: int = ctx.k
        params = ctx.saved_tensors
        if run.x_stream is None:
            raise ReversibleError(
                "ExactMomentumStack: backward through the stack a second time; its streams are rebuilt once "
                "(retain_graph=True is not supported: run the forward again)"
            )
        assert run.scale is not None
        m = run.momentum(k)
        beta = 0.0 if m is None else m.beta
        v_grad = run.v_grad
        c = x_grad if v_grad is None else x_grad + v_grad
        run.v_grad = None
        if run.poisoned:
            nan = torch.full_like(x_grad, float("nan"))
            run.v_grad = nan
            if k == 0:
                run.x_stream = run.v_stream = None
            return (None, None, nan, *[None if p is None else torch.full_like(p, float("nan")) for p in params])
        # rebuild x_k, recompute the block with autograd there
        assert run.v_stream is not None
        x_stream = run.x_stream - run.v_stream
        x_k = run.scale.decode(x_stream, run.dtype)
        (x_k,) = backends.optimization_barrier([x_k])
        wants_x = bool(ctx.needs_input_grad[2])
        leaf = x_k.detach().requires_grad_(wants_x)
        grad_params = [(j, p) for j, p in enumerate(params) if ctx.needs_input_grad[3 + j]]
        now = backends.RngState.capture(run.device)
        try:
            run.rng[k].restore()
            with torch.enable_grad(), run.autocast.replay():
                r = run.block_output(k, leaf)
        finally:
            now.restore()
        run.rng[k] = None
        run.x_stream = x_stream
        run.unstep(k, r)
        inputs = ([leaf] if wants_x else []) + [p for _, p in grad_params]
        out_grad = c if m is None else c * (1.0 - beta)
        grads: Sequence[Tensor | None] = ()
        if inputs and r.requires_grad:
            grads = torch.autograd.grad(r, inputs, out_grad.to(r.dtype), allow_unused=True)
        del r
        x_in_grad = None
        if wants_x:
            x_in_grad = x_grad if not grads or grads[0] is None else x_grad + grads[0].to(x_grad.dtype)
            grads = grads[1:]
        param_grads: list[Tensor | None] = [None] * ctx.n_params
        for (j, _), g in zip(grad_params, grads):
            param_grads[j] = g
        run.v_grad = None if m is None else c * beta
        if k == 0:
            if run.input_stream is not None and not torch.equal(run.x_stream, run.input_stream):
                raise ReversibleError(
                    "ExactMomentumStack: the backward rebuilt the stack's input with different bits than the forward "
                    "had (verify=True): a block computed something else when recomputed (a nondeterministic kernel, "
                    "or a state the recomputation does not see again)"
                )
            run.x_stream = run.v_stream = run.input_stream = None  # the walk is over
        return (None, None, x_in_grad, *param_grads)


class ExactMomentumStack(nn.Module):
    """Residual branches ``blocks[k](x, *args, **kwargs) = layer_k(x) - x`` run as an exact MomentumNet (see the
    module's docstring): in a training forward with autograd, one node per layer that keeps ``bits`` bits per element
    (``beta = n / 2**bits``); otherwise the same function layer by layer.

    Each layer's parameters are the parameters of its block. Tensor arguments in ``args``/``kwargs`` are constants
    of the call (a mask, rotary tables): one that requires grad is refused."""

    def __init__(self, blocks: Sequence[nn.Module], beta: float = 2**-6) -> None:
        super().__init__()
        if not blocks:
            raise ReversibleError("ExactMomentumStack: no blocks")
        self.blocks = nn.ModuleList(blocks)
        self.momentum = Momentum.of(beta)
        #: keep the input's stream and compare the backward's rebuilt one with it, bit for bit (one more stream held)
        self.verify = False

    @property
    def beta(self) -> float:
        return self.momentum.beta

    def kept_bytes(self, elements: int) -> int:
        """Bytes the forward keeps for the backward for a hidden state of ``elements`` elements, all layers."""
        return (len(self.blocks) - 1) * kept_bytes_per_layer(elements, self.momentum.bits)

    @torch.compiler.disable  # torch.compile runs the stack eagerly, as one graph break (its engine reads the range)
    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        params = [list(b.parameters()) for b in self.blocks]
        records = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for ps in params for p in ps))
        if not records:
            return self.walk(x, args, kwargs)
        for value in tree_leaves((args, kwargs)):
            if isinstance(value, Tensor) and value.requires_grad:
                raise ReversibleError(
                    "ExactMomentumStack: a tensor argument of the layers requires grad; the stack passes its "
                    "arguments as constants of the call. Detach it"
                )
        extra = 0
        for _attempt in range(8):
            rng = backends.RngState.capture(x.device)
            run = _Run(self, x, args, kwargs)
            out = self._forward(run, x, params, extra)
            finite, worst = run.range_check()
            if not backends.holds_data(worst):  # fake tensors (sizing under FakeTensorMode): no values to check
                return out
            if run.lazy:  # nothing is read: a stream that overflowed shows as NaN, never as a finite wrong number
                fits = finite & (worst < _LIMIT)
                return out + torch.where(fits, 0.0, float("nan")).to(out.dtype)
            if not bool(finite):
                run.poisoned = True  # the plain model's loss would be NaN: so are this one's and its gradients
                return out + float("nan")
            bound = float(worst)
            if bound < _LIMIT:
                return out
            extra += math.ceil(math.log2(bound / _LIMIT)) + 2
            del out, run
            rng.restore()  # the same random numbers again, on the coarser grid
        raise ReversibleError(
            f"ExactMomentumStack: the streams outgrew every grid tried ({extra} bits of extra headroom): the "
            f"activations are diverging; lower the learning rate"
        )

    def _forward(self, run: _Run, x: Tensor, params: list[list[nn.Parameter]], extra: int) -> Tensor:
        run.first_input = run.start(x, extra)
        assert run.x_stream is not None
        run.input_stream = run.x_stream.clone() if self.verify else None
        value = x
        with backends.autocast_cache_off():
            for k in range(len(self.blocks)):
                value = _LayerFn.apply(run, k, value, *params[k])
        run.first_input = None
        return value

    def walk(self, x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        """The same function without autograd records (inference, generation): layer by layer on the streams."""
        values = list(self.layer_values(x, args, kwargs))
        return values[-1]

    def layer_values(self, x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Tensor]:
        """Yields the stack's value after each layer (the input first), running the function without recording."""
        run = _Run(self, x, args, kwargs)
        run.start(x)
        value = run.value()
        yield value
        for k in range(len(self.blocks)):
            run.step(k, value, keep=False)
            value = run.value()
            yield value


class _Straight(torch.autograd.Function):
    """``exact``'s value with ``approx``'s gradient (the rounding to the grid, differentiated straight through)."""

    @staticmethod
    def forward(ctx, exact: Tensor, approx: Tensor):  # type: ignore[override]
        return exact.detach().clone()

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return None, grad


def reference_values(stack: ExactMomentumStack, x: Tensor, *args: Any, **kwargs: Any) -> Iterator[Tensor]:
    """The stack's value after each layer (the input, on the grid, first) under plain autograd (every activation
    kept): the reference the memory-saving backward is tested against, and the forward of a call that records
    every layer's output. Values are the integer streams' (bit for bit the memory-saving forward's); gradients flow
    through ``x_{k+1} = x_k + v_{k+1}``, ``v_{k+1} = beta v_k + (1 - beta) r_k(x_k)``."""
    run = _Run(stack, x, args, kwargs)
    run.start(x)
    value = _Straight.apply(run.value(), x)
    yield value
    velocity: Tensor | None = None
    for k in range(len(stack.blocks)):
        r = run.block_output(k, value)
        m = run.momentum(k)
        if m is None or velocity is None:
            v_approx = r
        else:
            v_approx = velocity * m.beta + r * (1.0 - m.beta)
        run.make_room(k, r)
        run.add(k, run.quantized(k, r), keep=False)
        assert run.scale is not None and run.v_stream is not None
        velocity = _Straight.apply(run.scale.decode(run.v_stream, x.dtype), v_approx)
        value = _Straight.apply(run.value(), value + velocity)
        yield value


def reference_forward(stack: ExactMomentumStack, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """The stack's output under plain autograd (:func:`reference_values`)."""
    *_, out = reference_values(stack, x, *args, **kwargs)
    return out
