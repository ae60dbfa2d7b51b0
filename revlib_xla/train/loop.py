"""The training loop of ``revlib-xla train``: one step per batch, evaluation, checkpoints, preemption, resume.

Per step: the learning rate of the step, the next batch from the resumable sampler, the strategy's step
(:func:`revlib_xla.train.strategy.make_step`) and one device sync (on XLA, the cut that compiles and runs the
step's graph). After the first steps the XLA compile count must stop growing (one compiled graph per step); a step
that compiles again is reported. Every ``eval_every`` steps the fixed validation batches are evaluated; every
``checkpoint_every`` steps, and at the end, a checkpoint is written atomically.

SIGTERM (a TPU VM's preemption notice) or SIGINT (Ctrl-C): the current step finishes, a checkpoint is written and
:func:`train` returns normally (the CLI exits 0). With ``train.resume`` (the default) a run started again with the
same ``out_dir`` continues from ``latest``: weights, optimizer state, learning-rate step, sampler position and
random states are restored, so the resumed run ends with the same weights, bit for bit, as one never interrupted.

What a run never does silently:

* Resume: a checkpoint that is not whole (a file missing, truncated or unreadable) is passed over, with a warning
  naming it and why, for the newest whole one (:func:`revlib_xla.train.checkpoint.find_resumable`); with
  checkpoints present but none whole the run refuses rather than start from step 0 (``train.resume=false`` starts
  over, setting the earlier run's files aside: :func:`revlib_xla.train.rundir.set_aside`). ``metrics.jsonl`` is cut
  back to the step resumed from, so no step is logged twice.
* One run per ``out_dir`` (:class:`revlib_xla.train.rundir.RunLock`); temporary checkpoint directories of a killed
  run are removed at the start.
* A loss or gradient norm that is NaN or inf stops the run (``train.nonfinite=stop``, the default) with
  :class:`DivergedError` naming the step; the last checkpoints stay the finite ones (weights holding NaN or inf are
  never saved). ``train.nonfinite=skip`` drops such a step's update instead (its gradients are discarded, the
  learning-rate schedule moves on) and stops after :data:`MAX_SKIPPED_IN_A_ROW` skipped steps in a row. The loss
  is read on the host one step late, so checking it does not stall an XLA device between steps; ``skip`` reads it
  (and the gradient norm) before each update, which does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from .. import backends
from ..reversible import stream_range_error
from ..reversible.fixed_point import FixedStreamError
from ..sharding import apply_mesh
from .checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointMismatch,
    NonFiniteWeights,
    checkpoint_steps,
    find_resumable,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from .config import RunConfig, dump_config
from .data import BatchSampler, SamplerState, eval_batches, load_data
from .distributed import SilentLogger, distribute, join_processes, launched_rank, per_process_step, whole_state
from .metrics import MetricsLogger, PhasePeaks, cut_back, start_peak, step_memory
from .rundir import RunLock, prepare_out_dir, remove_stale_temporaries, set_aside
from .strategy import (
    StepReport,
    build_model,
    build_optimizer,
    compute_device,
    flops_per_token,
    lm_loss,
    lr_at,
    make_step,
    model_config,
    peak_flops,
    resolve_device,
    set_lr,
)

__all__ = ["TrainResult", "DivergedError", "train", "evaluate", "WARMUP_STEPS", "MAX_SKIPPED_IN_A_ROW"]

WARMUP_STEPS = 3
"""Steps after which the XLA compile count must stop growing (the first steps create the optimizer state)."""

MAX_SKIPPED_IN_A_ROW = 5
"""``train.nonfinite=skip``: the run stops after this many skipped steps in a row (the weights themselves went bad,
or the learning rate is far too high: skipping more would train nothing)."""


class DivergedError(RuntimeError):
    """The loss, the gradient norm or the weights became NaN or inf; the message names the step, the value and the
    last checkpoint, which holds finite weights."""


def _describe(value: float) -> str:
    """A float for a message: NaN and inf by name."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.6g}"


@dataclasses.dataclass
class TrainResult:
    """What a run did: the steps it ran (``start_step`` to ``final_step``), the logged training losses and
    validation losses by step, why it stopped early (``'SIGTERM'``, ``'SIGINT'``) if it did, the last checkpoint,
    the number of graphs compiled after the warm-up steps (XLA; ``None`` elsewhere) and the wall time."""

    start_step: int
    final_step: int
    losses: dict[int, float]
    val_losses: dict[int, float]
    stopped_by: str | None
    checkpoint: Path | None
    recompilations: int | None
    seconds: float
    model: torch.nn.Module
    skipped_steps: list[int] = dataclasses.field(default_factory=list)
    """``train.nonfinite=skip``: the steps whose update was dropped (a NaN or inf loss or gradient norm)."""
    resumed_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """The metrics the checkpoint resumed from recorded (its ``loss``); empty when the run did not resume."""

    @property
    def nothing_left(self) -> bool:
        """Whether the run resumed at or after ``train.steps`` and so trained no step."""
        return self.checkpoint is not None and self.final_step == self.start_step and not self.losses

    @property
    def first_loss(self) -> float:
        return self.losses[min(self.losses)]

    @property
    def last_loss(self) -> float:
        return self.losses[max(self.losses)]


class _StopRequest:
    """SIGTERM/SIGINT handlers that ask the loop to stop after the current step (main thread only)."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal == "SIGINT" and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signal = signal.Signals(signum).name

    @contextlib.contextmanager
    def installed(self) -> Iterator[_StopRequest]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def evaluate(cfg: RunConfig, model: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    """The mean loss of ``model`` over ``batches``, without gradients (in eval mode, under the run's precision)."""
    device = compute_device(model)
    autocast_type = backends.backend_for(device).autocast_device_type
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    try:
        with (
            torch.no_grad(),
            torch.autocast(
                device_type=str(autocast_type or "cpu"), dtype=torch.bfloat16, enabled=cfg.strategy.precision == "bf16"
            ),
        ):
            for batch in batches:
                total = total + lm_loss(model, batch.to(device)).float()
        backends.sync(device)
        return float(total) / max(1, len(batches))
    finally:
        model.train(was_training)


#: the settings a resumed run must share with the run that wrote its checkpoint, beside the model and the strategy
#: (which the checkpoint's shapes check): what decides the batches and their numbers
TRAJECTORY = (
    "train.seed",
    "data.kind",
    "data.path",
    "data.hf_dataset",
    "data.token_dtype",
    "data.seq_len",
    "data.batch_size",
    "optim.grad_accum_steps",
    "strategy.precision",
)


def _config_changes(
    ckpt: Path, cfg: RunConfig, sections: tuple[str, ...] = ("model", "strategy"), keys: tuple[str, ...] = ()
) -> str:
    """The keys of ``sections`` (or only ``keys`` of them) whose values differ between the run that wrote ``ckpt``
    (its ``config.yaml``) and ``cfg``, as ``key: then -> now``; empty when they agree or it cannot be read."""
    import yaml

    def flat(node: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(node, dict):
            return {prefix.rstrip("."): node}
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flat(value, f"{prefix}{key}."))
        return out

    try:
        then = yaml.safe_load((ckpt / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return ""
    now = cfg.model_dump(mode="json")
    changed = []
    for section in sections:
        a, b = (
            flat(then.get(section, {}) if isinstance(then, dict) else {}, f"{section}."),
            flat(now[section], f"{section}."),
        )
        changed += [
            f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
            for key in sorted(set(a) | set(b))
            if a.get(key) != b.get(key) and (not keys or key in keys)
        ]
    return ", ".join(changed)


def _refuse_a_changed_run(found: Path, cfg: RunConfig) -> str:
    """The :data:`TRAJECTORY` settings that differ from the run that wrote ``found``: a :class:`CheckpointMismatch`
    naming them and the ways out, unless ``train.resume_changed`` (then the changes, to say in the log)."""
    changes = _config_changes(found, cfg, ("train", "data", "optim", "strategy"), TRAJECTORY)
    if not changes or cfg.train.resume_changed:
        return changes
    out = str(cfg.train.out_dir).rstrip("/")
    raise CheckpointMismatch(
        f"train.out_dir={out}: its checkpoint {found.name} was written by a run with other settings ({changes}); "
        f"resuming with them would mix two runs (the result matches neither). Resume with the run's own settings, "
        f"give this run its own train.out_dir=..., start over in {out} with train.resume=false (the earlier run's "
        f"files are moved aside), or set train.resume_changed=true to continue from it with the new settings",
        found,
        "other settings",
    )


def _mismatch(exc: CheckpointMismatch, cfg: RunConfig) -> CheckpointMismatch:
    """``exc`` (checkpoints in ``train.out_dir`` that this run cannot resume from) as one message: the settings that
    differ from the run that wrote them, and the two ways out (another ``train.out_dir``, or ``train.resume=false``)."""
    changes = _config_changes(exc.path, cfg) if exc.path is not None else ""
    out = str(cfg.train.out_dir).rstrip("/")
    if not changes:
        return CheckpointMismatch(
            f"{exc}. Give this run its own train.out_dir=..., or start over in {out} with train.resume=false (the "
            f"earlier run's files are moved aside)",
            exc.path,
            exc.what,
        )
    suffix = cfg.strategy.activations if "strategy.activations: " in changes else "new"
    return CheckpointMismatch(
        f"train.out_dir={out} holds the checkpoints of a run with other settings ({changes}): "
        f"{exc.path.name if exc.path is not None else 'its checkpoint'}: {exc.what}. Give this run its own "
        f"train.out_dir={out}-{suffix}, or start over in {out} with train.resume=false (the earlier run's files are "
        f"moved aside)",
        exc.path,
        exc.what,
    )


def train(cfg: RunConfig, *, crash_after: int | None = None) -> TrainResult:
    """Run the training ``cfg`` describes (resuming from ``<train.out_dir>/checkpoints`` when ``train.resume`` and
    a checkpoint exists: see the module docstring) and return what it did. ``crash_after``: stop right after that
    step without saving anything, as a killed process would (for tests of resume). Raises :class:`DivergedError`
    when the loss goes NaN or inf (``train.nonfinite=stop``), :class:`revlib_xla.train.rundir.RunDirError` when
    another run uses ``train.out_dir``, :class:`revlib_xla.train.checkpoint.CheckpointError` when checkpoints are
    present and none can be resumed from, and :class:`revlib_xla.train.checkpoint.CheckpointMismatch` when they
    belong to another model or strategy."""
    start_time = time.perf_counter()
    out = prepare_out_dir(cfg.train.out_dir)
    with RunLock(out) if launched_rank() == 0 else contextlib.nullcontext() as lock:
        return _train(cfg, out, lock, crash_after, start_time)


def _train(cfg: RunConfig, out: Path, lock: RunLock | None, crash_after: int | None, start_time: float) -> TrainResult:
    apply_mesh(cfg)  # before the device starts: SPMD over the mesh's devices, if several
    processes, device = join_processes(cfg, resolve_device(cfg))  # under torchrun: this process's place and device
    lm_config = model_config(cfg)
    data = load_data(cfg, lm_config.vocab_size)
    sampler = BatchSampler(data, cfg.data.seq_len, cfg.data.batch_size, cfg.train.seed)
    val = eval_batches(data, cfg.data.seq_len, cfg.data.batch_size, cfg.train.eval_batches)
    model = distribute(build_model(cfg, device), processes, cfg)
    model.train()
    optimizer = build_optimizer(cfg, model)
    report = StepReport()
    phases = PhasePeaks(compute_device(model))
    report.on_phase = phases.mark if phases.on else None  # each phase's peak in the log, where the allocator says
    step_fn = per_process_step(make_step(cfg, model, optimizer, report), processes)
    ckpt_dir = out / "checkpoints"
    config_yaml = dump_config(cfg)
    main = processes is None or processes.main  # logs and writes checkpoints
    notes: list[str] = []  # said once the logger exists
    if lock is not None and lock.taken_over:
        notes.append(f"took over the stale run lock of {lock.taken_over}")
    if main:
        removed = remove_stale_temporaries(ckpt_dir)
        if removed:
            notes.append(f"removed what a killed save left in {ckpt_dir}: {', '.join(removed)}")
        if not cfg.train.resume:
            moved = set_aside(out)
            if moved:
                notes.append(
                    "train.resume=false: starting over; the earlier run's files were moved aside: " + "; ".join(moved)
                )

    start = 0
    found: Path | None = None
    resumed_metrics: dict[str, float] = {}
    if cfg.train.resume and (checkpoint_steps(ckpt_dir) or (ckpt_dir / "latest").exists()):
        with whole_state(model, optimizer, loading=True) as (whole_lm, whole_optimizer):
            try:
                found, restored, skipped = find_resumable(ckpt_dir, whole_lm, whole_optimizer)
            except CheckpointMismatch as exc:
                raise _mismatch(exc, cfg) from None
            if found is None or restored is None:  # raised inside: the sharded model keeps its initial weights
                raise CheckpointError(
                    f"train.resume=true: {ckpt_dir} holds checkpoints, but none can be resumed from ("
                    + "; ".join(skipped)
                    + "); starting from step 0 would overwrite them. Set train.resume=false to start over (the "
                    "earlier run's files are moved aside), or give another train.out_dir"
                )
        changed = _refuse_a_changed_run(found, cfg)
        if changed:
            notes.append(f"train.resume_changed=true: resumed from {found.name} with other settings ({changed})")
        for line in skipped:
            warnings.warn(f"resume: passed over checkpoint {line}", stacklevel=2)
        start = restored.step
        resumed_metrics = dict(restored.metrics)
        sampler.state = SamplerState.from_dict(restored.sampler)
        set_rng_state(restored.rng, device)
    else:
        backends.manual_seed(device, cfg.train.seed)
    if main:
        dropped = cut_back(out / "metrics.jsonl", start)
        if dropped:
            notes.append(
                f"metrics.jsonl: dropped {dropped} record(s) after step {start} (this run logs those steps again)"
            )

    logger = (MetricsLogger if main else SilentLogger)(
        out,
        cfg.train.steps,
        start,
        cfg.data.batch_size * cfg.data.seq_len,
        flops_per_token(cfg),
        peak_flops(cfg, device),
        progress=cfg.train.progress and start < cfg.train.steps,
    )
    for note in notes:
        logger.message(note)
    if found is not None:
        logger.message(f"resumed from {found} (step {start})")
        if start >= cfg.train.steps:
            logger.message(
                f"nothing left to do: the run already reached train.steps={cfg.train.steps} (its checkpoint is at "
                f"step {start}); give a larger train.steps to train on, or train.resume=false to start over"
            )
    losses: dict[int, float] = {}
    val_losses: dict[int, float] = {}
    compiled_after_warmup: int | None = None
    recompilations: int | None = None
    last_ckpt: Path | None = found
    stop = _StopRequest()
    skip = cfg.train.nonfinite == "skip"
    unchecked: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []  # steps whose loss was not read yet
    skipped_steps: list[int] = []
    in_a_row = 0

    def diverged(step: int, what: str) -> DivergedError:
        kept = f"the last checkpoint, {last_ckpt}, holds finite weights" if last_ckpt else "no checkpoint was written"
        overflow = stream_range_error(model)  # exact reversible streams that overflowed make the loss NaN
        why = f" ({overflow})" if overflow is not None else ""
        advice = (
            "Skipping did not help (the weights themselves went bad): lower optim.lr (or give optim.warmup_steps, "
            "optim.grad_clip) and resume"
            if skip
            else "Lower optim.lr (or give optim.warmup_steps, optim.grad_clip) and resume, or set "
            "train.nonfinite=skip to skip such steps"
        )
        return DivergedError(f"step {step}: {what}{why}; the run stopped ({kept}). {advice}")

    def check(entries: list[tuple[int, torch.Tensor, torch.Tensor | None]]) -> None:
        """Raise :class:`DivergedError` for the first of ``entries`` whose loss or gradient norm is not finite."""
        for n, loss_value, norm in entries:
            value = float(loss_value)
            if not math.isfinite(value):
                raise diverged(n, f"the loss is {_describe(value)}")
            if norm is not None and not math.isfinite(grad := float(norm)):
                raise diverged(n, f"the gradient norm is {_describe(grad)} (the loss {_describe(value)})")
        entries.clear()

    def save(step: int, metrics: dict[str, float]) -> Path | None:
        """Write a checkpoint (rank 0; every rank gathers a sharded model's whole tensors)."""
        state = Checkpoint(step, sampler.state.to_dict(), rng_state(device), metrics)
        with whole_state(model, optimizer) as (whole_lm, whole_optimizer):
            if not main:
                return None
            try:
                return save_checkpoint(
                    ckpt_dir, whole_lm, whole_optimizer, state, config_yaml, cfg.train.keep_checkpoints
                )
            except NonFiniteWeights as exc:
                raise diverged(step, str(exc)) from None

    with logger, stop.installed():
        since, window_start, done = 0, time.perf_counter(), start
        start_peak(device)
        for step in range(start, cfg.train.steps):
            done = step + 1
            lr = lr_at(cfg, step)
            set_lr(optimizer, lr)
            overflow = None
            try:
                loss = step_fn(sampler.next_batch())
            except FixedStreamError as exc:  # a value beyond the exact streams' range: the step has no numbers
                if not skip:
                    raise diverged(done, f"the exact reversible streams overflowed ({exc})") from None
                optimizer.zero_grad(set_to_none=True)
                loss, overflow = torch.tensor(float("nan")), str(exc)
                report.skipped, report.grad_norm = True, None
            backends.sync(device)
            if skip and report.skipped:
                skipped_steps.append(done)
                in_a_row += 1
                what = (
                    f"the exact reversible streams overflowed ({overflow})"
                    if overflow is not None
                    else f"the loss is {_describe(float(loss))}, the gradient norm "
                    f"{_describe(float(report.grad_norm)) if report.grad_norm is not None else 'not computed'}"
                )
                logger.message(f"step {done}: {what}: update skipped (train.nonfinite=skip)")
                if in_a_row >= MAX_SKIPPED_IN_A_ROW:
                    raise diverged(
                        done, f"{in_a_row} steps in a row had a NaN or inf loss or gradient norm, or overflowed"
                    )
            elif skip:
                in_a_row = 0
            else:
                check(unchecked)  # the previous step's loss, computed by now: reading it does not stall the device
                unchecked.append((done, loss, report.grad_norm))
            since += 1
            compiled = backends.compilations(device)
            if compiled is not None and done - start == WARMUP_STEPS:
                compiled_after_warmup, recompilations = compiled, 0
            elif compiled is not None and compiled_after_warmup is not None and compiled > compiled_after_warmup:
                recompilations = (recompilations or 0) + compiled - compiled_after_warmup
                warnings.warn(
                    f"step {done} compiled {compiled - compiled_after_warmup} new XLA graph(s) after the warm-up "
                    f"steps; a step whose graph changes recompiles every time",
                    stacklevel=2,
                )
                compiled_after_warmup = compiled
            last = done == cfg.train.steps
            if done % cfg.train.log_every == 0 or done == start + 1 or last or stop.signal:
                value = float(loss)
                losses[done] = value
                memory = step_memory(device, phases.take())
                logger.step(done, value, lr, time.perf_counter() - window_start, memory, since)
                since, window_start = 0, time.perf_counter()
                check(unchecked)
                start_peak(device)
            if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or last):
                val_losses[done] = evaluate(cfg, model, val)
                logger.eval(done, val_losses[done])
                window_start = time.perf_counter()
                start_peak(device)  # the evaluation's memory is not a training step's
                phases.take()
            if crash_after is not None and done == crash_after:
                break
            periodic = cfg.train.checkpoint_every and done % cfg.train.checkpoint_every == 0
            if processes is not None and processes.any(stop.signal is not None):
                stop.signal = stop.signal or "SIGTERM"  # another process was asked to stop: stop after the same step
            if periodic or last or stop.signal:
                check(unchecked)
                last_ckpt = save(done, {"loss": losses.get(done, float("nan"))}) or last_ckpt
                window_start = time.perf_counter()
                start_peak(device)
            if stop.signal:
                logger.message(
                    f"{stop.signal}: stopped after step {done} of {cfg.train.steps}; checkpoint {last_ckpt}. "
                    f"Run the same command again to resume"
                )
                break
    if processes is not None:
        processes.end()
    return TrainResult(
        start_step=start,
        final_step=done,
        losses=losses,
        val_losses=val_losses,
        stopped_by=stop.signal,
        checkpoint=last_ckpt,
        recompilations=recompilations,
        seconds=time.perf_counter() - start_time,
        model=model,
        skipped_steps=skipped_steps,
        resumed_metrics=resumed_metrics,
    )
