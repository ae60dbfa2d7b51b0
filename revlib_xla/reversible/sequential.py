"""The public reversible sequence: :class:`ReversibleSequential` (its forward and inverse), the layer-by-layer walk
(:class:`LayerWalk`), :func:`stream_range_error` and :func:`check_invertible`. How the reversible backward works:
:mod:`revlib_xla.reversible`."""

from __future__ import annotations

import collections
import warnings
from typing import Any, Literal, cast

import torch
from torch import nn

from .. import backends
from ..errors import ReversibleError
from ..fused_optimizer import FusedOptimizer, FusedOptimizerError
from ..offload import ParameterStreamer
from . import fixed_point as _fixed
from . import invertibility, rebuild_check
from .coupling import (
    COUPLING,
    first_tensor,
    pick,
)
from .engine import run_layers
from .invertibility import InvertibilityReport, inverse_layer, plain_copies
from .layers import (
    FUSED_OPTIMIZER,
    LAYERWISE_ARGS_KWARGS,
    MemoryModes,
    ReversibleModule,
    available_device,
    check_couplings,
    refuse_kv_caches,
)
from .plan import forward_fixed, forward_layer, grouped, to_streams
from .planning import PlannedSequence
from .scan import scanned_forward

Tensor = torch.Tensor


class ReversibleSequential(PlannedSequence):
    """A sequence of reversible layers whose activation memory does not grow with depth.

    Drop-in for RevLib's ``ReversibleSequential``: each module becomes one reversible layer ``(x0, x1) ->
    (x1, coupling_forward(x0, module(x1)))``; ``coupling_forward``/``coupling_inverse`` lists are cycled per layer
    (``None`` = additive); children are named ``'0-0', '0-1', '1-0', ...`` so state-dict keys read
    ``'0-1.wrapped_module.wrapped_module.weight'`` (stable, documented).

    Args:
        split_dim: the dimension along which the input is split into the two streams (and the output
            concatenated). ``None`` replicates the input into both streams and returns the mean of the two output
            streams. A ``(x0, x1)`` tuple input skips the split and returns a ``(y0, y1)`` tuple.
        memory_mode: ``autograd_function`` (default) keeps only the final output; ``no_savings`` runs plain
            autograd (the reference). ``checkpoint`` and ``autograd_graph`` run as ``autograd_function`` with a
            warning: RevLib's cache modes peak above ``no_savings``, this mode never does.
        exact: the streams' arithmetic. ``None`` (the default): exact (fixed-point) streams where every coupling is
            additive and the input is float32 or narrower, else floating-point streams. ``True``: exact streams, or
            raise naming the layer whose coupling is not additive. ``False``: floating-point streams (RevLib's
            arithmetic, checked by ``verify_inverse``). Exact streams (:mod:`revlib_xla.fixed_point`) are integers
            counting 2**-32: each block's output is rounded once to that grid and added exactly, so the backward
            subtracts the same integers and rebuilds every layer's input bit for bit, at any width, depth and
            precision, and the memory-saving gradients equal ``no_savings``' on the same model (rounding
            differentiated straight through). The blocks see the stream decoded to at least float32 (cast to the
            input's dtype when that is narrower), and the output is returned in the input's dtype. Cost: 8 bytes
            per stream element (two streams, whatever the depth), a few element-wise passes per layer, and a range
            check per layer (a value beyond 2**31 / (layers + 1), NaN or infinity raises
            :class:`revlib_xla.fixed_point.FixedStreamError` naming the layer, read once per forward; on XLA and
            in a data-parallel group nothing is read and the outputs become NaN instead, see
            :func:`stream_range_error`). Float64 inputs keep floating-point
            streams by default (they rebuild to ~1e-16). On XLA the recomputation is compiled with the backward and
            may round a reduction (normalization, softmax) differently from the forward in its last bits; the
            backward's rebuild check stays armed there.
        stream_dtype: keep both residual streams in this dtype (e.g. ``torch.float32``) while the blocks compute in
            the input's dtype (e.g. bfloat16): bounds the reconstruction drift of deep low-precision stacks on
            floating-point streams (giving it selects them, unless ``exact=True``, which refuses it). The output is
            returned in the input's dtype.
        compute_dtype: the dtype the blocks see (default: the input's dtype); useful with a two-stream input
            already in ``stream_dtype``.
        preserve_rng_state: run each layer under its own seed, derived from one seed drawn per forward from
            torch's global generator, with generators of its own, so the recomputation draws the forward's random
            numbers (dropout) on cpu, cuda and xla, also while other threads draw from the global generators (see
            :mod:`revlib_xla.recompute`). Both memory modes seed the same way, so ``no_savings`` gives the same
            masks. Costs a few microseconds per layer.
        verify_inverse: at the first forward whose backward rebuilds (a memory-saving mode, gradients on), per
            pair of stream and compute dtypes, make sure the backward rebuilds the input, and raise otherwise.
            ``True``: run :func:`check_invertible` on the real input (every block replays, every coupling pair
            inverts, the input rebuilt through all layers matches; it names the layer, and costs three block
            evaluations per layer without autograd). ``"rebuild"``: the backward compares the input it rebuilt with
            the forward's (one subtraction and one maximum, no block evaluation; the forward keeps its input until
            then) and raises from the backward where they differ by more than :func:`check_invertible`'s tolerance;
            on a lazy device (XLA) the error is a lazy value of the step, read at the next forward once the step has
            run (a step cut), never forcing it. ``None`` (the default): ``True`` when some coupling is not additive
            (momentum, affine, user pairs: their inverses can amplify rounding errors with depth), else
            ``"rebuild"`` (an additive coupling inverts exactly only in exact arithmetic: eight bfloat16 MLP blocks
            with large weights gave gradients off by more than 100 %). On a lazy device the check's output makes the
            first step's graph differ from the next ones': one more compilation where the first two steps would
            otherwise share a graph (SGD, or optimizer state restored from a checkpoint). ``False``: never.
        target_device: keep the parameters (and buffers, and so the optimizer state) where they are, normally on
            the host, and run each layer on copies streamed to this device one layer ahead (forward and
            recomputation); gradients accumulate on the host parameters. At most two layers' tensors are on the
            device at once (see :mod:`revlib_xla.offload`).
        fused_optimizer: ``params -> torch.optim.Optimizer``; one optimizer per layer is built at the first forward
            and stepped inside the backward as soon as the layer's gradients are complete, which are then freed
            (see :mod:`revlib_xla.fused_optimizer`; ``model.fused_optimizer`` is the optimizer object).
        scan: on a device that traces lazily (XLA), run the forward and the backward as two loops over the layers
            (:mod:`revlib_xla.scan`), so the step compiles one layer (or one repeating group of layers) whatever
            the depth. ``False`` (the default): unrolled, because the loops hold a stacked copy of the layers'
            weights and their stacked gradients (about 4x the parameter bytes per layer in TPU HBM, where the
            unrolled walk needs 2.3x: compile time is traded for memory); ``None``: scan when the layers repeat in
            structure and nothing rules it out (``target_device``, ``fused_optimizer``, a group of several layers
            drawing random numbers), else unrolled; ``True``: scan, or raise naming what rules it out (the first
            layer that differs, and how). Gradients, dropout masks and autocast are those of the unrolled walk.
            With the layers' parameters stacked (:func:`revlib_xla.scan.stack_layers`, which sets ``scan=None``),
            the loops read the stacks without copying them and the step holds parameters and gradients once (TPU
            HBM per layer as the unrolled walk's with bfloat16 weights, ``bench/results/scan_compile-xla-cpu.md``).
    """

    def __init__(
        self,
        *modules: nn.Module,
        split_dim: int | None = 1,
        coupling_forward: list[COUPLING | None] | None = None,
        coupling_inverse: list[COUPLING | None] | None = None,
        memory_mode: MemoryModes = MemoryModes.autograd_function,
        target_device: str | torch.device = "",
        fused_optimizer: FUSED_OPTIMIZER = None,
        stream_dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype | None = None,
        preserve_rng_state: bool = True,
        verify_inverse: bool | Literal["rebuild"] | None = None,
        scan: bool | None = False,
        exact: bool | None = None,
    ):
        if not modules:
            raise ReversibleError("ReversibleSequential needs at least one module")
        if verify_inverse not in (None, True, False, "rebuild"):
            raise ReversibleError(
                f"ReversibleSequential: verify_inverse={verify_inverse!r}; pass None (the default), True "
                f"(check_invertible at the first training forward), 'rebuild' (the backward measures its rebuilt "
                f"input) or False"
            )
        check_couplings(coupling_forward, coupling_inverse)
        if exact not in (None, True, False):
            raise ReversibleError(
                f"ReversibleSequential: exact={exact!r}; pass None (the default: exact streams where every coupling is "
                f"additive and the input is float32 or narrower), True or False"
            )
        if exact and stream_dtype is not None:
            raise ReversibleError(
                f"ReversibleSequential: exact=True keeps the streams as fixed-point integers, so "
                f"stream_dtype={stream_dtype} does not apply; drop stream_dtype, or pass exact=False for "
                f"floating-point streams in stream_dtype"
            )
        for name, dtype in (("stream_dtype", stream_dtype), ("compute_dtype", compute_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ReversibleError(
                    f"ReversibleSequential: {name}={dtype!r}, but the streams and the blocks compute in floating "
                    f"point: pass a floating dtype (torch.float32, torch.bfloat16, ...) or None (the input's dtype)"
                )
        memory_mode = MemoryModes(memory_mode)
        if memory_mode in (MemoryModes.checkpoint, MemoryModes.autograd_graph):
            warnings.warn(
                f"MemoryModes.{memory_mode.name} runs as MemoryModes.autograd_function in revlib_xla: RevLib's cache "
                f"modes keep every recomputed tensor until the next forward (a higher peak than no_savings); "
                f"autograd_function gives the same gradients with a peak that does not grow with depth.",
                stacklevel=2,
            )
        layers: collections.OrderedDict[str, nn.Module] = collections.OrderedDict()
        for i, module in enumerate(modules):
            if not isinstance(module, nn.Module):
                raise ReversibleError(
                    f"ReversibleSequential: argument {i} is a {type(module).__name__}, expected a torch.nn.Module"
                )
            if not isinstance(module, ReversibleModule):
                module = ReversibleModule(
                    module,
                    pick(coupling_forward, i),
                    pick(coupling_inverse, i),
                    memory_savings=memory_mode != MemoryModes.no_savings,
                )
            layers[f"{i // 2}-{i % 2}"] = module
        super().__init__(layers)
        self.split_dim = split_dim
        self.memory_mode = memory_mode
        self.stream_dtype = stream_dtype
        self.compute_dtype = compute_dtype
        self.preserve_rng_state = preserve_rng_state
        self.verify_inverse = verify_inverse
        self.scan = scan
        self.exact = exact
        self._verified: set = set()  # (stream dtype, compute dtype) pairs checked by verify_inverse
        self._rebuild_pending: list[rebuild_check.Verdict] = []  # measured on a lazy device, read when computed
        self.target_device: torch.device | None = available_device(target_device) if target_device else None
        if fused_optimizer is not None and not callable(fused_optimizer):
            raise FusedOptimizerError(
                f"ReversibleSequential: fused_optimizer must be a callable params -> "
                f"torch.optim.Optimizer, got {type(fused_optimizer).__name__}"
            )
        if fused_optimizer is not None and memory_mode == MemoryModes.no_savings:
            raise FusedOptimizerError(
                "ReversibleSequential: fused_optimizer needs a memory-saving mode (the "
                "reversible backward walk steps each layer); no_savings runs plain autograd"
            )
        if scan and memory_mode == MemoryModes.no_savings:
            raise ReversibleError(
                "ReversibleSequential: scan=True needs a memory-saving mode (the scanned backward rebuilds each "
                "layer); no_savings runs plain autograd, unrolled. Drop scan=True or the memory_mode."
            )
        self.fused_optimizer_factory = fused_optimizer
        self._own_fused: FusedOptimizer | None = None
        self._attached_fused_optimizer: FusedOptimizer | None = None  # see attach_fused_optimizer
        self._streamer: tuple[tuple[int, ...], ParameterStreamer] | None = None  # (tensor ids, streamer)

    def __getstate__(self):
        """Copies and pickles leave the streamer behind (device buffers, cuda streams); it is rebuilt on use."""
        state = super().__getstate__()
        state["_streamer"] = None
        state["_rebuild_pending"] = []  # lazy values of this process's steps
        state["_last_guard"] = None
        return state

    # -- forward / inverse ----------------------------------------------------------------------------------------
    # torch.compile runs the sequence eagerly, as one graph break: its engine (a call's plan, the streams' range
    # check, one autograd node per layer) would otherwise be traced again at every call (2.4 s a step against
    # 0.014 s eager, a 4-layer transformers Llama); the model around it still compiles once
    @torch.compiler.disable
    def forward(  # type: ignore[override]  # RevLib's signature: streams, then the blocks' arguments
        self, inp: Tensor | tuple[Tensor, Tensor], *args, layerwise_args_kwargs: LAYERWISE_ARGS_KWARGS = None, **kwargs
    ):
        pending = self.__dict__.get("_rebuild_pending")
        if pending:  # an earlier step's rebuild, measured on a lazy device: read it once computed
            rebuild_check.settle(pending)
        x0, x1, two_stream = self._split(inp)
        out_dtype = x0.dtype
        plan, arg_tensors = self._plan(x0, args, kwargs, layerwise_args_kwargs)
        x0, x1 = to_streams(plan, x0, x1)
        plan.fixed = eager_grid(plan.fixed, x0, x1)
        s0 = s1 = None
        inputs = (x0, x1)  # (exact streams: what the rebuild check keeps, and encodes when it compares)
        if plan.fixed is not None:  # the values x0, x1 carry the gradients, the streams s0, s1 the exact bits
            assert plan.value_dtype is not None
            if backends.holds_data(x0):  # (fake tensors, sizing a model under FakeTensorMode, have no values)
                plan.guard = _fixed.StreamGuard(plan.fixed, len(plan.layers), plan.describe_stream)
            shared = x1 is x0  # one stream's value twice (split_dim=None, or a pair of one tensor): encoded once
            x0, s0 = _fixed.encode_input(plan.fixed, x0, plan.value_dtype, plan.guard)
            x1, s1 = (grouped(x0), s0) if shared else _fixed.encode_input(plan.fixed, x1, plan.value_dtype, plan.guard)

        if self.memory_mode == MemoryModes.no_savings or not torch.is_grad_enabled():
            with plan.call.scope() as reseed:
                for i in range(len(plan.layers)):
                    a, k = plan.args_for(i, arg_tensors)
                    reseed(plan.seed_of(i))
                    copies = self._plain_offload(plan, i)
                    tensors = plain_copies(plan, i) if copies is None else plan.offloaded().mapping(i, copies)
                    if s0 is not None:
                        y1, y1_stream = forward_fixed(plan, i, s0, x1, a, k, tensors, x0, plan.guard)
                        x0, x1, s0, s1 = x1, y1, s1, y1_stream
                    else:
                        x0, x1 = x1, forward_layer(plan, i, x0, x1, a, k, tensors)
                    if copies is not None:
                        plan.offloaded().write_back_buffers(i, copies)
        else:  # the backward will rebuild every layer's input from the output
            refuse_kv_caches(args, kwargs, layerwise_args_kwargs)
            plan.fsdp_units = self._fsdp_units(plan)
            if s0 is not None and s1 is not None:
                plan.fixed_streams = (s0, s1)
            self._verify(plan, x0, x1, arg_tensors, inputs)
            with plan.state.python_random_check("ReversibleSequential"):
                scanned = scanned_forward(self, plan, x0, x1, arg_tensors)
                x0, x1 = scanned if scanned is not None else run_layers(plan, x0, x1, arg_tensors)
            plan.fixed_streams = None
        if plan.guard is not None:
            x0, x1 = self._judge(plan, plan.guard, x0, x1)
            plan.guard = None
        x0, x1 = x0.to(out_dtype), x1.to(out_dtype)
        return self._merge(x0, x1, two_stream)

    def exact_format(self, dtype: torch.dtype) -> _fixed.FixedPoint | None:
        """The fixed-point format of the streams for an input of ``dtype`` (see ``exact``), or ``None`` where they
        are floating point."""
        layers = cast(list[ReversibleModule], list(self._modules.values()))
        return self._fixed_format(dtype, layers, list(self._modules.keys()))

    def layer_walk(self, x0: Tensor, x1: Tensor) -> LayerWalk:
        """The layers one at a time with plain autograd (or none), from the streams ``(x0, x1)``: the function this
        sequence computes, exact streams included, for callers that act between layers (transformers' generation
        with its KV cache, per-layer hooks); see :class:`LayerWalk`."""
        return LayerWalk(self, x0, x1)

    def inverse(
        self,
        output: Tensor | tuple[Tensor, Tensor],
        *args,
        layerwise_args_kwargs: LAYERWISE_ARGS_KWARGS = None,
        **kwargs,
    ):
        """Reconstruct the input from the output (same ``args``/``kwargs`` as the forward).

        A tensor output is split along ``split_dim`` and the reconstructed input concatenated; a ``(y0, y1)``
        tuple gives back ``(x0, x1)``. With ``split_dim=None`` the output is a mean of two streams, which cannot
        be inverted: pass the two streams instead. Blocks with dropout reconstruct exactly only in eval mode.
        """
        if self.split_dim is None and isinstance(output, torch.Tensor):
            raise ReversibleError(
                "ReversibleSequential.inverse: with split_dim=None the output averages the two "
                "streams and cannot be inverted; run forward and inverse on (x0, x1) tuples"
            )
        y0, y1, two_stream = self._split(output)
        out_dtype = y0.dtype
        plan, arg_tensors = self._plan(y0, args, kwargs, layerwise_args_kwargs)
        y0, y1 = to_streams(plan, y0, y1)
        plan.fixed = eager_grid(plan.fixed, y0, y1, headroom=0)  # the output is the largest the streams were
        if plan.fixed is not None:  # the output's values on the grid (exact from the streams, not from rounded values)
            y0, y1 = plan.fixed.encode(y0), plan.fixed.encode(y1)
        for i in reversed(range(len(plan.layers))):
            a, k = plan.args_for(i, arg_tensors)
            y0, y1 = inverse_layer(plan, i, y0, y1, a, k, plain_copies(plan, i)), y0
        if plan.fixed is not None:
            y0, y1 = (plan.fixed.decode(y, cast(torch.dtype, plan.value_dtype)) for y in (y0, y1))
        y0, y1 = y0.to(out_dtype), y1.to(out_dtype)
        return (y0, y1) if two_stream else torch.cat([y0, y1], self.split_dim)


def eager_grid(grid: _fixed.FixedPoint | None, *values: Tensor, headroom: int = 30) -> _fixed.FixedPoint | None:
    """The exact streams' grid for streams that start as ``values``: on an eager device, the one that follows their
    scale (:meth:`~revlib_xla.reversible.fixed_point.FixedPoint.for_values`: one read of their largest magnitude);
    where they cannot be read without costing the step (a lazy device) or have no values (fake tensors), ``grid``."""
    if grid is None or not values or not backends.holds_data(values[0]) or backends.is_tracing_lazily(values[0]):
        return grid
    return _fixed.FixedPoint.for_values(*values, headroom=headroom)


class LayerWalk:
    """A :class:`ReversibleSequential`'s layers run one at a time (:meth:`layer`) with plain autograd from two
    streams; :meth:`streams` gives their current values in the input's dtype. The same function as the sequence's
    forward: on exact streams each block's output is added on the fixed-point grid. Random numbers are the
    caller's (no per-layer seeds)."""

    def __init__(self, net: ReversibleSequential, x0: Tensor, x1: Tensor) -> None:
        self.blocks = cast(list[ReversibleModule], list(net._modules.values()))
        self.dtype = x0.dtype
        self.grid = eager_grid(net.exact_format(x0.dtype), x0, x1)  # the forward's grid for these streams
        self.value_dtype = torch.promote_types(x0.dtype, torch.float32)
        self.x0, self.x1 = x0, x1
        self.s0: Tensor | None = None
        self.s1: Tensor | None = None
        if self.grid is not None:
            self.x0, self.s0 = _fixed.encode_input(self.grid, x0, self.value_dtype, None)
            self.x1, self.s1 = (
                (grouped(self.x0), self.s0) if x1 is x0 else _fixed.encode_input(self.grid, x1, self.value_dtype, None)
            )

    def layer(self, i: int, *args: Any, **kwargs: Any) -> None:
        block = self.blocks[i]
        if self.grid is None or self.s0 is None:
            self.x0, self.x1 = cast(tuple[Tensor, Tensor], block((self.x0, self.x1), *args, **kwargs))
            return
        x1 = grouped(self.x1)
        f = first_tensor(
            block.wrapped_module.fn(x1 if self.value_dtype == self.dtype else x1.to(self.dtype), args, kwargs)
        )
        value, stream = _fixed.couple(self.grid, self.s0, f, self.value_dtype, None, i, self.x0)
        self.x0, self.s0, self.x1, self.s1 = self.x1, self.s1, value, stream

    def streams(self) -> tuple[Tensor, Tensor]:
        return self.x0.to(self.dtype), self.x1.to(self.dtype)


def stream_range_error(module: nn.Module) -> _fixed.FixedStreamError | None:
    """Why the outputs of ``module``'s last forward are NaN, if its exact streams overflowed there: the
    :class:`FixedStreamError` naming the first layer at fault, for each :class:`ReversibleSequential` in
    ``module``, read now (on XLA and in a data-parallel group the range check reads nothing during the step and
    makes the outputs NaN instead; a training loop that sees a non-finite loss asks this). ``None`` if none
    overflowed."""
    for sub in module.modules():
        guard = sub.__dict__.get("_last_guard") if isinstance(sub, ReversibleSequential) else None
        if guard is None:
            continue
        try:
            guard.judge(previous=True)
        except _fixed.FixedStreamError as exc:
            return exc
    return None


def check_invertible(
    model: ReversibleSequential,
    sample: Tensor | tuple[Tensor, Tensor],
    *args,
    tolerance: float | None = None,
    layerwise_args_kwargs: LAYERWISE_ARGS_KWARGS = None,
    **kwargs,
) -> InvertibilityReport:
    """Check on ``sample`` that the backward will rebuild each layer's input, and raise otherwise.

    Three measurements, with each layer run under the random seed the backward uses, and nothing of the model's
    state (buffers, random state) changed:

    * each block gives the same output when run again (else it keeps state between calls, e.g. a KV cache);
    * each layer's ``coupling_inverse`` undoes its ``coupling_forward``;
    * the input rebuilt from the output through all layers matches the input (errors amplified over depth).

    Raises :class:`ReversibleError` naming the first layer (or the depth) whose relative error exceeds
    ``tolerance``: by default 1e-4 in float32, 1e-9 in float64, 3e-2 in bfloat16, 1e-2 in float16 (of the streams,
    or of the blocks if they compute in a coarser dtype). Costs three block evaluations per layer, without autograd.
    """
    if not isinstance(model, ReversibleSequential):
        raise ReversibleError(f"check_invertible expects a ReversibleSequential, got {type(model).__name__}")
    x0, x1, _ = model._split(sample)
    plan, arg_tensors = model._plan(x0, args, kwargs, layerwise_args_kwargs)
    x0, x1 = to_streams(plan, x0, x1)
    if plan.fixed is not None:
        plan.fixed_streams = (plan.fixed.encode(x0), plan.fixed.encode(x1))
    return invertibility.check_plan(plan, x0, x1, arg_tensors, tolerance)
