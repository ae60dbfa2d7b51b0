"""Sizing a sequential model: its stages measured into a :class:`~revlib_xla.planner.Chain`, and budgets searched
against the TPU compiler.

:func:`measure_chain` runs each stage on a sample input (eager devices: times on the device, sizes from tensor
storages; XLA: FLOP counts, and sizes from each stage's programs compiled deviceless for a TPU, see
:func:`compiled_sizes`). :func:`fit_budget` finds the planner budget whose compiled step fits a TPU's memory.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from .. import backends
from .._tree import detached, map_tensors, tensor_leaves
from ..recompute import probe
from .chain import Chain, StageCache, StageOption
from .measure import (
    InPlaceInput,
    StageMeasurement,
    StagePrograms,
    device_argument,
    executing,
    measure_stage,
    stage_programs,
    value_bytes,
    without_execution,
)
from .schedule import Schedule
from .solver import InfeasibleBudget

__all__ = ["Sizing", "MeasuredChain", "measure_chain", "compiled_sizes", "fit_budget", "without_execution"]

logger = logging.getLogger("revlib_xla.checkpointable")


@dataclasses.dataclass(frozen=True)
class Sizing:
    """How to measure a model's stages.

    ``reversible``: stages with an ``inverse`` may rebuild their input (their inversion is timed).
    ``offload_bandwidth``: bytes/second between device and host; given, stage inputs x_1.. may be offloaded.
    ``loss_tmp_memory_usage``: transient memory of the loss (rotor's parameter). ``tpu_generation``: on XLA, size
    stages from their programs compiled deviceless for this TPU (None: from shapes, temporaries 0).
    ``attention_cache``: stages whose attention is a fused kernel may keep its outputs for their later runs
    (selective recomputation, :mod:`revlib_xla.planner.attention_cache`; eager devices: they are measured).
    ``verbosity``: 1 shows progress, 2 also logs each stage's measurement."""

    reversible: bool = True
    offload_bandwidth: float | None = None
    loss_tmp_memory_usage: float = 0
    tpu_generation: str | None = "v5e"
    verbosity: int = 0
    attention_cache: bool = True


@dataclasses.dataclass(frozen=True)
class MeasuredChain:
    """The chain of a model on one input, the per-stage measurements behind it, and whether the input is lazy (XLA)
    device data."""

    chain: Chain
    measurements: list[StageMeasurement]
    lazy: bool


def measure_chain(
    stages: Sequence[nn.Module],
    sample_input: Any,
    options: Mapping[int, Sequence[tuple[str, nn.Module]]] | None = None,
    sizing: Sizing = Sizing(),
) -> MeasuredChain:
    """Measure every stage (and each of its ``options``, alternative modules for running it with autograd) on
    ``sample_input`` and build the chain. Measuring leaves no trace: buffers, the stages' own generators and torch's
    global generators are as before."""
    options = options or {}
    x = detached(sample_input)
    if not tensor_leaves(x):
        raise ValueError(
            f"Checkpointable: the sample input holds no tensor (a {type(sample_input).__name__}); measure on the "
            f"model's input: a tensor, or a tuple, list or dict of tensors"
        )
    measured: list[StageMeasurement] = []
    stage_options: list[list[StageOption]] = []
    progress = _progress(len(stages), "measuring stages", sizing.verbosity)
    lazy = any(backends.is_tracing_lazily(t) for t in tensor_leaves(x))
    # The TPU generation to size compiled stages for: the runtime's chip, or the user's where tracing for a TPU.
    generation = backends.sizing_generation(tensor_leaves(x)[0].device, sizing.tpu_generation) if lazy else None
    programs: list[list[StagePrograms]] = []  # per stage: the plain stage, then its options
    out_bytes: list[int] = []
    # The solver plans no attention cache in a chain with reversible stages or offload (not planned together yet):
    # measuring them there would only lengthen the first step.
    caches = (
        sizing.attention_cache
        and not sizing.offload_bandwidth
        and not (sizing.reversible and any(callable(getattr(s, "inverse", None)) for s in stages))
    )
    for i, stage in enumerate(stages):
        alternatives = [module for _, module in options.get(i, [])]
        if generation:
            x = _as_device_data(x)  # the stage's input as device data
            programs.append([stage_programs(s, x) for s in [stage, *alternatives]])
        rev = sizing.reversible and callable(getattr(stage, "inverse", None))
        opts = []
        # Measuring runs the stage (and its options) several times: it must leave no trace (buffers, the
        # stage's own generators, torch's global generators, autocast's weight-cast cache: a cast made without
        # autograd would be reused by the step's runs with it, and the stage's parameters get no gradient).
        with probe(tensor_leaves(x)[0].device, list(stage.buffers()), i), backends.autocast_cache_off():
            try:
                m, out = measure_stage(stage, x, reversible=rev, attention_cache=caches)
            except InPlaceInput:
                raise ValueError(
                    f"Checkpointable: stage {i} ({type(stage).__name__}) modifies its input in place; its "
                    f"input may be a checkpoint. Make its first operation out of place, or wrap it with the "
                    f"stage before it in revlib_xla.atomic(nn.Sequential(...))"
                ) from None
            except ValueError:
                raise
            except Exception as exc:
                raise type(exc)(f"Checkpointable: measuring stage {i} ({type(stage).__name__}) failed: {exc}") from exc
            if not tensor_leaves(out):
                raise ValueError(
                    f"Checkpointable: stage {i} ({type(stage).__name__}) returned {type(out).__name__}, which holds "
                    f"no tensor; each stage must return a tensor (or a tuple, list or dict of tensors) for the next "
                    f"stage and the loss"
                )
            for (name, _), module in zip(options.get(i, []), alternatives):
                alt, _ = measure_stage(module, x, early_stop=False)  # options run only as Fe, in full
                cbw = max(alt.cbw, value_bytes(out))
                opts.append(StageOption(name, alt.fw, alt.bw, cbw, _with_autograd(alt), alt.bwd_tmp))
        stage_options.append(opts)
        measured.append(m)
        out_bytes.append(value_bytes(out))
        if sizing.verbosity >= 2:
            logger.info("stage %d %s: %s", i, type(stage).__name__, m)
        x = out
        progress.update()
    progress.close()
    if programs and generation:
        measured, stage_options = compiled_sizes(measured, stage_options, programs, out_bytes, generation)
    n = len(measured)
    chain = Chain(
        fw=[m.fw for m in measured],
        bw=[m.bw for m in measured] + [0.0],
        cw=[m.cw for m in measured] + [value_bytes(x)],
        cbw=[0] + [max(m.cbw, measured[i + 1].cw if i + 1 < n else value_bytes(x)) for i, m in enumerate(measured)],
        fwd_tmp=[m.fwd_tmp for m in measured],
        bwd_tmp=[m.bwd_tmp for m in measured] + [sizing.loss_tmp_memory_usage],
        reversible=[m.inverse_time is not None for m in measured],
        inverse_time=[m.inverse_time if m.inverse_time is not None else m.fw for m in measured],
        options=stage_options,
        names=[type(s).__name__ for s in stages],
        grad_fwd_tmp=[_with_autograd(m) for m in measured],
        stopped_fw=[m.fw if m.stopped_fw is None else m.stopped_fw for m in measured],
        caches=[None if m.cache is None else StageCache(*m.cache) for m in measured],
    )
    if sizing.offload_bandwidth:
        chain = chain.with_bandwidth(sizing.offload_bandwidth, stages=range(1, n))
    return MeasuredChain(chain, measured, lazy)


def _with_autograd(m: StageMeasurement) -> float:
    """The transient memory of a stage's forward with autograd (options run only that way)."""
    return m.fwd_tmp if m.grad_fwd_tmp is None else m.grad_fwd_tmp


def _as_device_data(x: Any) -> Any:
    """``x`` as device data: computed (a sync), or, within :func:`without_execution`, stood in for."""
    if executing():
        backends.sync(tensor_leaves(x)[0].device)
        return x

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        return device_argument(t.shape, t.dtype, t.device).requires_grad_(t.requires_grad)

    return map_tensors(stand_in, x)


def compiled_sizes(
    measured: list[StageMeasurement],
    options: list[list[StageOption]],
    programs: list[list[StagePrograms]],
    out_bytes: list[int],
    generation: str,
) -> tuple[list[StageMeasurement], list[list[StageOption]]]:
    """What each stage (and each option) keeps and its transient memory, from its programs compiled deviceless
    for the TPU ``generation`` with every buffer in HBM (see :class:`~revlib_xla.planner.measure.StagePrograms`),
    in the terms of the chain (rotor's model; ``y`` is the stage's output, x_{i+1}):

    * ``cbw`` (x̄_{i+1}): what the backward program keeps live across the point where its backward starts (not
      its arguments x_i, parameters and the gradient of y, nor y, one of its outputs) + ``y``. The compiled
      stage keeps fusion inputs, not everything autograd saves.
    * ``fwd_tmp``: the larger of the forward program's live peak and the backward program's forward peak above
      what it keeps.
    * ``bwd_tmp``: the backward's live peak, the input gradient counted from when it is computed, above what
      the chain already holds while the stage's backward runs: x̄_{i+1} (of which ``y`` only if the backward
      reads it: the plan holds y, the compiled step may not) and the input gradient (``cw[i]``).

    Without the TPU compiler (a missing dependency), warns and returns the sizes unchanged.
    """
    from ..compiled.liveness import forward_backward_split
    from ..compiled.memory import MissingDependencyError, tpu_memory_many

    flat = [p for stage in programs for p in stage]
    try:
        compiled = tpu_memory_many(
            [text for p in flat for text in (p.forward, p.backward)], generation, hbm_only=True, liveness=True
        )
    except MissingDependencyError as exc:
        warnings.warn(
            f"Checkpointable: {exc}; planning with what autograd saves and temporaries taken as 0", stacklevel=4
        )
        return measured, options

    def sizes(k: int, y: int, cw: int) -> tuple[int, int, int]:
        forward, backward, program = compiled[2 * k], compiled[2 * k + 1], flat[k]
        forward_peak = _known(forward.live_peak_bytes, "a forward program's live peak")
        if not program.gradient_arguments:
            return y, forward_peak, 0
        split = forward_backward_split(
            _known(backward.buffer_assignment, "a backward program's buffer assignment"),
            _known(backward.optimized_hlo, "a backward program's optimized HLO"),
            program.gradient_arguments,
            counted_outputs=range(program.output_count, program.output_count + program.input_gradient_count),
            read_outputs=range(program.output_count),
        )
        held_y = y if any(split.outputs_read) else 0
        return (
            split.across + y,
            max(forward_peak, split.before - split.across),
            max(0, split.after_with_outputs + held_y - split.across - y - cw),
        )

    new_measured, new_options, k = [], [], 0
    for i, m in enumerate(measured):
        cbw, fwd_tmp, bwd_tmp = sizes(k, out_bytes[i], m.cw)
        new_measured.append(dataclasses.replace(m, cbw=cbw, fwd_tmp=fwd_tmp, bwd_tmp=bwd_tmp))
        k += 1
        stage_opts = []
        for opt in options[i]:
            cbw, fwd_tmp, bwd_tmp = sizes(k, out_bytes[i], m.cw)
            stage_opts.append(dataclasses.replace(opt, cbw=cbw, fwd_tmp=fwd_tmp, bwd_tmp=bwd_tmp))
            k += 1
        new_options.append(stage_opts)
    return new_measured, new_options


def _known(value: Any, what: str) -> Any:
    if value is None:
        raise RuntimeError(f"Checkpointable: the TPU compiler gave no {what} (asked for liveness)")
    return value


def fit_budget(
    compiled_peak: Callable[[float], tuple[Schedule, int]],
    low: float,
    high: float,
    hbm_bytes: float,
    probes: int = 6,
    generation: str = "v5e",
) -> tuple[float, Schedule, int]:
    """The largest planner budget in ``[low, high]`` (found by ``probes`` bisection steps after the two ends) whose
    schedule's compiled peak (``compiled_peak(budget)`` -> (schedule, bytes)) fits ``hbm_bytes``: (budget, schedule,
    peak). ``high`` first (the fastest plan); :class:`InfeasibleBudget` if even ``low`` does not fit."""
    schedule, peak = compiled_peak(high)
    if peak <= hbm_bytes:
        return high, schedule, peak
    schedule, peak = compiled_peak(low)
    if peak > hbm_bytes:
        raise InfeasibleBudget(
            f"Checkpointable.fit_to_tpu: even the smallest plan needs {peak:.6g} bytes of "
            f"TPU {generation} HBM (compiled deviceless), more than {hbm_bytes:.6g}",
            float(peak),
        )
    best = (low, schedule, peak)
    for _ in range(probes):
        middle = (low + high) / 2
        schedule, peak = compiled_peak(middle)
        if peak <= hbm_bytes:
            low, best = middle, (middle, schedule, peak)
        else:
            high = middle
    return best


class _Progress(Protocol):
    def update(self, n: int = 1) -> Any: ...

    def close(self) -> Any: ...


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, what: str, verbosity: int) -> _Progress:
    if verbosity < 1:
        return _NoProgress()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc=what, unit="stage")
