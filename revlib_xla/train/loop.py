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
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import torch

from .. import backend
from ..sharding import apply_mesh
from .checkpoint import Checkpoint, latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .config import RunConfig, dump_config
from .data import BatchSampler, SamplerState, eval_batches, load_data
from .distributed import SilentLogger, distribute, join_processes, per_process_step, whole_state
from .metrics import MetricsLogger, start_peak, step_memory
from .strategy import (
    build_model,
    build_optimizer,
    chip_spec,
    compute_device,
    flops_per_token,
    lm_loss,
    lr_at,
    make_step,
    model_config,
    resolve_device,
    set_lr,
)

__all__ = ["TrainResult", "train", "evaluate", "WARMUP_STEPS"]

WARMUP_STEPS = 3
"""Steps after which the XLA compile count must stop growing (the first steps create the optimizer state)."""


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
    autocast_type = backend.backend_for(device).autocast_device_type
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
        backend.sync(device)
        return float(total) / max(1, len(batches))
    finally:
        model.train(was_training)


def train(cfg: RunConfig, *, crash_after: int | None = None) -> TrainResult:
    """Run the training ``cfg`` describes (resuming from ``<train.out_dir>/checkpoints/latest`` when
    ``train.resume`` and one exists) and return what it did. ``crash_after``: stop right after that step without
    saving anything, as a killed process would (for tests of resume)."""
    start_time = time.perf_counter()
    apply_mesh(cfg)  # before the device starts: SPMD over the mesh's devices, if several
    processes, device = join_processes(cfg, resolve_device(cfg))  # under torchrun: this process's place and device
    lm_config = model_config(cfg)
    data = load_data(cfg, lm_config.vocab_size)
    sampler = BatchSampler(data, cfg.data.seq_len, cfg.data.batch_size, cfg.train.seed)
    val = eval_batches(data, cfg.data.seq_len, cfg.data.batch_size, cfg.train.eval_batches)
    model = distribute(build_model(cfg, device), processes, cfg)
    model.train()
    optimizer = build_optimizer(cfg, model)
    step_fn = per_process_step(make_step(cfg, model, optimizer), processes)
    out = Path(cfg.train.out_dir)
    ckpt_dir = out / "checkpoints"
    config_yaml = dump_config(cfg)

    start = 0
    found = latest_checkpoint(ckpt_dir) if cfg.train.resume else None
    if found is not None:
        with whole_state(model, optimizer, loading=True) as (whole_lm, whole_optimizer):
            restored = load_checkpoint(found, whole_lm, whole_optimizer)
        start = restored.step
        sampler.state = SamplerState.from_dict(restored.sampler)
        set_rng_state(restored.rng, device)
    else:
        backend.manual_seed(device, cfg.train.seed)

    _, peak = chip_spec(cfg.chip.name)
    main = processes is None or processes.main  # logs and writes checkpoints
    logger = (MetricsLogger if main else SilentLogger)(
        out,
        cfg.train.steps,
        start,
        cfg.data.batch_size * cfg.data.seq_len,
        flops_per_token(cfg),
        peak * cfg.chip.chips,
        progress=cfg.train.progress,
    )
    if found is not None:
        logger.message(f"resumed from {found} (step {start})")
    losses: dict[int, float] = {}
    val_losses: dict[int, float] = {}
    compiled_after_warmup: int | None = None
    recompilations: int | None = None
    last_ckpt: Path | None = found
    stop = _StopRequest()

    def save(step: int, metrics: dict[str, float]) -> Path | None:
        """Write a checkpoint (rank 0; every rank gathers a sharded model's whole tensors)."""
        state = Checkpoint(step, sampler.state.to_dict(), rng_state(device), metrics)
        with whole_state(model, optimizer) as (whole_lm, whole_optimizer):
            if not main:
                return None
            return save_checkpoint(ckpt_dir, whole_lm, whole_optimizer, state, config_yaml, cfg.train.keep_checkpoints)

    with logger, stop.installed():
        since, window_start, done = 0, time.perf_counter(), start
        start_peak(device)
        for step in range(start, cfg.train.steps):
            done = step + 1
            lr = lr_at(cfg, step)
            set_lr(optimizer, lr)
            loss = step_fn(sampler.next_batch())
            backend.sync(device)
            since += 1
            compiled = backend.compilations(device)
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
                logger.step(done, value, lr, time.perf_counter() - window_start, step_memory(device), since)
                since, window_start = 0, time.perf_counter()
                start_peak(device)
            if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or last):
                val_losses[done] = evaluate(cfg, model, val)
                logger.eval(done, val_losses[done])
                window_start = time.perf_counter()
                start_peak(device)  # the evaluation's memory is not a training step's
            if crash_after is not None and done == crash_after:
                break
            periodic = cfg.train.checkpoint_every and done % cfg.train.checkpoint_every == 0
            if processes is not None and processes.any(stop.signal is not None):
                stop.signal = stop.signal or "SIGTERM"  # another process was asked to stop: stop after the same step
            if periodic or last or stop.signal:
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
    )
