"""Measuring a sequential model's stages: the numbers the planner's :class:`~revlib_xla.planner.Chain` needs.

Sizes are bytes of tensor storages (each storage once): ``cw`` of a stage's input, ``cbw`` of what its forward
with autograd leaves alive (saved tensors and output, what existed before not counted), and the transient peaks
of its forward and backward, tracked by :class:`~revlib_xla.memory.StorageTracker` (allocations and frees of tensor
storages, on any eager device, as PyTorch's ``MemTracker`` counts them, without the module hooks through which
``MemTracker`` keeps every measured input and graph alive; parameter gradients are allocated beforehand so they are
not counted). Times are medians of repeated
runs on the device, synchronised.

On XLA nothing runs eagerly: sizes here come from shapes (what autograd saves, the stage's input not counted, as on
eager devices), temporaries are taken as 0, and the time of a stage is its FLOP count
(``torch.utils.flop_counter``), a time model that does not need the device. ``Checkpointable`` then replaces the
sizes with what the TPU compiler keeps: :func:`stage_programs` gives each stage's programs, compiled deviceless for a
TPU with every buffer in HBM (fused programs keep fusion inputs, not every tensor autograd saves).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import backends
from .._tree import detached, tensor_leaves
from ..backends import tracing
from ..compiled.stablehlo import stablehlo_of
from ..memory import SavedTensorCounter, StorageTracker, tensor_bytes
from .roots import roots as root_of
from .roots import stops_early
from .stages import inverse_of

__all__ = [
    "StageMeasurement",
    "StagePrograms",
    "InPlaceInput",
    "measure_stage",
    "stage_programs",
    "grad_leaves",
    "differentiable",
    "tensor_leaves",
    "detached",
    "value_bytes",
]


def executing() -> bool:
    """Whether stages run (outside :func:`without_execution`)."""
    return not tracing.standing_in()


#: Within the block, :func:`measure_chain` on lazy (XLA) stages runs nothing: each stage's input is stood in for
#: (:func:`revlib_xla.backends.tracing.stand_in_inputs`, which this name is).
without_execution = tracing.stand_in_inputs


def device_argument(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Device data of ``shape`` for a lazy program to take as an argument (not a constant it could fold): within
    :func:`without_execution`, over untouched host memory (a llama-1b head's logits gradient is 1 GiB a sequence;
    at a searched batch, zeros made on the host and copied exceeded a 24 GB machine's memory); else zeros copied
    to the device."""
    if tracing.standing_in():
        return backends.zero_copy_device_tensor(torch.empty(shape, dtype=dtype), device)
    return torch.zeros(shape, dtype=dtype).to(device)


class InPlaceInput(ValueError):
    """A stage modified its input in place (its input may be a checkpoint the schedule still needs)."""


@dataclasses.dataclass(frozen=True)
class StageMeasurement:
    """What one stage costs: times (seconds, or FLOPs on XLA), sizes in bytes."""

    fw: float
    bw: float
    cw: int
    cbw: int
    fwd_tmp: int
    bwd_tmp: int
    inverse_time: float | None
    #: the transient memory of the forward with autograd alone, above what it keeps (``fwd_tmp`` covers the
    #: forward without autograd too); None where it is not measured apart (XLA: from the compiled programs)
    grad_fwd_tmp: int | None = None
    #: the time of the stage's last recomputation where the executor stops it at the last saved tensor
    #: (:mod:`revlib_xla.planner.early_stop`); None where it does not (XLA, forward hooks, FSDP2 units)
    stopped_fw: float | None = None
    #: the stage's attention cache (:mod:`revlib_xla.planner.attention_cache`): its bytes, the forward's time reading
    #: it, what the forward with autograd keeps then, and the transient memory of a forward without autograd reading it
    #: (:class:`~revlib_xla.planner.StageCache`); None: no fused attention, or not measured
    cache: tuple[int, float, int, int] | None = None


def _seconds(fn: Callable[[], Any], device: torch.device) -> float:
    """The time ``fn`` takes on ``device``, synchronised before and after."""
    backends.sync(device)
    start = time.perf_counter()
    fn()
    backends.sync(device)
    return time.perf_counter() - start


def _median_time(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    return statistics.median(_seconds(fn, device) for _ in range(repeats))


def _cost(fn: Callable[[], Any], device: torch.device, counted: bool) -> float:
    """What ``fn`` costs: its time on ``device``, or, ``counted`` (tensors that hold no data: fake tensors, whose
    operations take the time of their dispatch alone), the FLOPs it runs, as on a lazy device."""
    return _flops(fn) if counted else _seconds(fn, device)


def _stopped_share(stage: nn.Module, x: Any, device: torch.device, repeats: int, counted: bool = False) -> float:
    """The share of a stage's forward that a recomputation stopping at its last saved tensor runs
    (:class:`~revlib_xla.planner.early_stop.DeferredSaves`): the least time of that recomputation over the least time of
    the run that recorded the slots, both with autograd and saved-tensor hooks, so that the share applies to the
    plain forward's time (at most 1). The least of a few runs: the noise of a shared machine (and a first run's
    allocations) only lengthens either time of the ratio. ``counted``: the FLOPs of either, counted once."""
    from .early_stop import DeferredSaves, RecomputationMismatch

    full, stopped = [], []
    for _ in range(1 if counted else max(2, repeats)):
        saves = DeferredSaves(f"measuring {type(stage).__name__}")

        def record(saves: DeferredSaves = saves) -> None:
            # The output is dropped with its graph and slots: the recomputation then runs as far as it would,
            # filling nothing.
            with torch.enable_grad(), saves.recording():
                stage(grad_leaves(x))

        full.append(_cost(record, device, counted))
        if not saves.count:
            return 0.0  # the backward reads nothing: the recomputation never runs
        saves.recompute = lambda: stage(grad_leaves(x))
        try:
            stopped.append(_cost(saves.fill, device, counted))
        except RecomputationMismatch:
            return 1.0  # priced in full; the executor refuses such a stage where it runs (naming it)
    return min(1.0, min(stopped) / max(min(full), 1e-12))


def _backward(roots: Sequence[Any], seeds: Sequence[Any]) -> None:
    if roots:
        torch.autograd.backward(roots, seeds)


def _flops(fn: Callable[[], Any]) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def grad_leaves(x: Any, needs: Sequence[bool] | None = None) -> Any:
    """``x`` with every floating tensor detached and requiring grad (the input of a stage run with autograd); with
    ``needs`` (one flag per tensor, in :func:`tensor_leaves` order), requiring grad where it says."""
    flags = iter(needs) if needs is not None else None

    def leaf(t: torch.Tensor) -> torch.Tensor:
        wanted = next(flags) if flags is not None else t.is_floating_point() or t.is_complex()
        return t.detach().requires_grad_(wanted)

    return pytree.tree_map_only(torch.Tensor, leaf, x)


def value_bytes(x: Any) -> int:
    """Bytes of the tensors in ``x`` (:func:`tensor_leaves`), each storage once."""
    return tensor_bytes(tensor_leaves(x))


def differentiable(x: Any) -> list[torch.Tensor]:
    return [t for t in tensor_leaves(x) if t.requires_grad]


@dataclasses.dataclass(frozen=True)
class StagePrograms:
    """The XLA programs of one stage, as StableHLO text, to be compiled deviceless for a TPU.

    ``forward``: the forward without autograd (x_i -> x_{i+1}). ``backward``: the forward with autograd, then an
    optimization barrier over the output and its incoming gradient (an argument of the program, as in a training
    step), then the backward (x_i, parameters, gradient -> the output's ``output_count`` tensors, the input's
    ``input_gradient_count`` gradients, the parameter gradients, returned in that order).
    The barrier keeps every instruction that uses the gradient after the whole forward, so the program's schedule
    splits into the forward and the backward at the first of them, and what is live across that point is what the
    compiled stage keeps for its backward. ``gradient_arguments``: the numbers of the ``backward`` program's
    arguments that hold the gradient.
    """

    forward: str
    backward: str
    gradient_arguments: tuple[int, ...]
    output_count: int = 0
    input_gradient_count: int = 0


def stage_programs(stage: nn.Module, x: Any) -> StagePrograms:
    """The programs of a stage (see :class:`StagePrograms`) for an XLA input ``x`` that is device data."""
    from ..compiled.liveness import all_optimization_barrier_arguments

    with torch.no_grad():
        out = stage(x)
        forward = stablehlo_of(list(tensor_leaves(out)))
    params = [p for p in stage.parameters() if p.requires_grad]
    kept = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        inp = grad_leaves(x)
        outs = differentiable(stage(inp))
        if not outs:
            return StagePrograms(forward, forward, ())

        # Device data: arguments of the program, not constants it could fold.
        dys = [device_argument(o.shape, o.dtype, o.device) for o in outs]
        fenced = backends.optimization_barrier(outs + dys)
        outs, dys = fenced[: len(outs)], fenced[len(outs) :]
        torch.autograd.backward(outs, dys)
        grads = [t.grad for t in tensor_leaves(inp) if t.requires_grad and t.grad is not None]
        input_gradients = len(grads)
        grads += [p.grad for p in params if p.grad is not None]
        # The output is returned too: the chain keeps it anyway (it is x_{i+1}), and an output nobody uses would
        # let the compiler drop the barrier's hold on the backward.
        backward = stablehlo_of(outs + grads)
        # The stage's own layers may hold barriers too (FewBit's, in the forward): ours is the one over the
        # outputs whose last operands are arguments, the gradients.
        barriers = all_optimization_barrier_arguments(backward)
        ours = [
            ops for ops in barriers if len(ops) == len(outs) + len(dys) and all(a is not None for a in ops[len(outs) :])
        ]
        if len(ours) != 1:
            raise RuntimeError(
                f"stage_programs: the gradient of {type(stage).__name__}'s output is not an argument "
                f"of exactly one barrier of its backward program (barrier operands {barriers})"
            )
        arguments = tuple(a for a in ours[0][len(outs) :] if a is not None)
    finally:
        for p, g in zip(params, kept):
            p.grad = g
    return StagePrograms(forward, backward, arguments, len(outs), input_gradients)


def _appending_to(into: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A pack hook that notes each saved tensor in ``into`` and saves it as it is."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        into.append(t)
        return t

    return pack


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def measure_stage(
    stage: nn.Module,
    x: Any,
    *,
    repeats: int = 3,
    reversible: bool = False,
    early_stop: bool = True,
    attention_cache: bool = False,
) -> tuple[StageMeasurement, Any]:
    """Measure ``stage`` on input ``x``; returns the measurement and the stage's output (computed without
    autograd), the next stage's input. ``early_stop``: time its recomputation stopped at the last saved tensor
    too, where the executor does that (:func:`~revlib_xla.planner.execute.stops_early`). ``attention_cache``:
    measure what keeping its fused attention outputs costs and saves (:class:`StageMeasurement` ``cache``)."""

    tensors = list(tensor_leaves(x))
    if not tensors:
        raise TypeError(
            f"the input of {type(stage).__name__} holds no tensor; a planned stage takes a tensor or a tuple of tensors"
        )
    device = tensors[0].device
    lazy = backends.is_tracing_lazily(tensors[0])
    cw = value_bytes(x)
    versions = [t._version for t in tensors]
    with torch.no_grad():
        out = stage(x)
    if [t._version for t in tensors] != versions:
        raise InPlaceInput(f"{type(stage).__name__} modifies its input in place")
    params = [p for p in stage.parameters() if p.requires_grad]
    if lazy:
        fw = _flops(lambda: stage(grad_leaves(x)))
        inp = grad_leaves(x)
        # The stage's input is x_i, counted by the chain as cw[i]: the eager tracker does not count it either.
        with SavedTensorCounter(exclude=params + tensors + list(tensor_leaves(inp))) as counter:
            y = stage(inp)
        outs = differentiable(y)
        cbw = counter.bytes + value_bytes(y)
        bw = _flops(lambda: torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])) if outs else 0.0  # noqa: F821 (ruff: `del outs` below)
        for p in params:
            p.grad = None
        inverse_time = None
        if reversible:
            with torch.no_grad():
                inverse_time = _flops(lambda: inverse_of(stage)(out))
        return StageMeasurement(fw, bw, cw, max(cbw, value_bytes(out)), 0, 0, inverse_time), out

    # Fake tensors: their operations cost the time of their dispatch alone, so their costs are counted in FLOPs.
    counted = not backends.holds_data(tensors[0])
    with torch.no_grad():
        fw = _flops(lambda: stage(x)) if counted else _median_time(lambda: stage(x), device, repeats)
        # The transient memory of a forward without autograd (Fn, CF) differs from that of one with it (Fe):
        # intermediates are freed as they are consumed instead of being kept. fwd_tmp covers both; grad_fwd_tmp,
        # what the plan charges a forward with autograd, only the latter (a layer's attention scores and MLP
        # activations are kept there, counted in cbw, not transient).
        tracker = StorageTracker()
        tracker.track(stage, *tensors)
        with tracker:
            start = tracker.current(device)
            nograd_out = stage(x)
            nograd_tmp = max(0, tracker.peak(device) - start - value_bytes(nograd_out))
        del nograd_out
    inverse_time = None
    if reversible:
        with torch.no_grad():
            inverse = inverse_of(stage)
            if counted:
                inverse_time = _flops(lambda: inverse(out))
            else:
                inverse_time = _median_time(lambda: inverse(out), device, repeats)
    stopped_fw = fw * _stopped_share(stage, x, device, repeats, counted) if early_stop and stops_early(stage) else None
    # Parameter gradients exist before measuring (as in a training step after the first), so accumulating into
    # them is not counted; the caller's gradients are put back afterwards.
    kept_grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        bw_times = []
        fwd_tmp = grad_fwd_tmp = bwd_tmp = cbw = 0
        for _ in range(1 if counted else max(1, repeats)):
            inp = grad_leaves(x)
            saved: list[torch.Tensor] = []
            tracker = StorageTracker()
            tracker.track(stage, *tensor_leaves(inp))
            with torch.autograd.graph.saved_tensors_hooks(_appending_to(saved), _same), tracker:
                start = tracker.current(device)
                y = stage(inp)
                end = tracker.current(device)
                peak = tracker.peak(device)
            cbw = max(end - start, value_bytes(y))
            grad_fwd_tmp = max(0, peak - end)
            fwd_tmp = max(grad_fwd_tmp, nograd_tmp)
            outs = differentiable(y)
            grads = [torch.ones_like(o) for o in outs]
            tracker = StorageTracker()
            # Known to the tracker, so that freeing them during the backward lowers its level.
            tracker.track(stage, *saved, *tensor_leaves(inp), *tensor_leaves(y), *grads)
            # Emptied, not just unnamed: the list outlives this scope (the pack hook's closure), and the saved
            # tensors it held would stay alive through the whole backward, where autograd frees each node's as
            # it goes (the executor's backward does): measured so, a layer's bwd_tmp counted most of its saved
            # activations a second time.
            saved.clear()
            in_grad = tensor_bytes([t for t in tensor_leaves(inp) if t.requires_grad])
            with tracker:
                start = tracker.current(device)
                # The backward as the executor runs it (roots.roots): from the outputs' gradient edges where
                # torch takes them, so the output's values (x_{i+1}, counted in cbw) are freed before it runs.
                roots, seeds = root_of(y, tuple(grads))
                del y, outs, grads
                bw_times.append(_cost(functools.partial(_backward, roots, seeds), device, counted))
                peak = tracker.peak(device)
            bwd_tmp = max(0, peak - start - in_grad)
            del roots, seeds, inp
    finally:
        for p, g in zip(params, kept_grads):
            p.grad = g
    bw = statistics.median(bw_times)
    cache = _cache_costs(stage, x, device, repeats, fw, cbw, value_bytes(out), counted) if attention_cache else None
    return StageMeasurement(fw, bw, cw, cbw, fwd_tmp, bwd_tmp, inverse_time, grad_fwd_tmp, stopped_fw, cache), out


def _cache_costs(
    stage: nn.Module,
    x: Any,
    device: torch.device,
    repeats: int,
    fw: float,
    cbw: int,
    out_bytes: int,
    counted: bool = False,
) -> tuple[int, float, int, int] | None:
    """What keeping the stage's fused attention outputs costs and saves: their bytes, the forward's time reading
    them (at most ``fw``), what the forward with autograd keeps then (the cached tensors are the cache's), and the
    transient memory of a forward without autograd reading them (without attention's workspace); None when the
    stage has no fused attention."""
    from .attention_cache import AttentionCache

    cache = AttentionCache()
    with torch.no_grad(), cache.capturing():
        stage(x)
    size = cache.bytes
    if not size:
        return None

    def replayed() -> Any:
        with torch.no_grad(), cache.replaying():
            return stage(x)

    def computed() -> Any:
        with torch.no_grad():
            return stage(x)

    # A share of the forward, as for early stops: the least of interleaved runs of the forward reading the cache
    # and of the plain one. Timed apart (the medians of runs at other moments), the share followed the machine's
    # load, and with it the schedule (a depth-32 Llama plan at one budget recomputed 26 or 31 layers).
    replayed()  # the replaying path's first run (its dispatch mode's set-up) is not the forward's time
    plain, cached = [], []
    for _ in range(1 if counted else max(2, repeats)):
        plain.append(_cost(computed, device, counted))
        cached.append(_cost(replayed, device, counted))
    cached_fw = fw * min(1.0, min(cached) / max(min(plain), 1e-12))
    # the cache's tensors exist before: what the forward returns from them (views) is not an allocation
    tracker = StorageTracker()
    tracker.track(stage, *tensor_leaves(x), *cache.tensors())
    with tracker:
        start = tracker.current(device)
        out = replayed()
        nograd_tmp = tracker.peak(device) - start - value_bytes(out)
    del out
    inp = grad_leaves(x)
    tracker = StorageTracker()
    tracker.track(stage, *tensor_leaves(inp), *cache.tensors())
    with tracker, cache.replaying():
        start = tracker.current(device)
        y = stage(inp)
        end = tracker.current(device)
    del y, inp
    # the cached tensors are at most all the forward stops keeping; its output it keeps in any case
    return size, cached_fw, max(end - start, cbw - size, out_bytes), max(0, nograd_tmp)
