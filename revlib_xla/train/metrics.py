"""What a training run reports: a progress bar, a JSON-lines log, and TensorBoard when it is installed.

Each logged step records the loss, the learning rate, tokens per second, the step time, an estimate of the model
FLOPs utilisation (MFU) on the configured chip, and the device memory its allocator reports, where it reports one
(cuda; accelerators served by ``torch.accelerator``): ``peak_bytes``, the most bytes allocated at once during the
steps since the last record (what a step needs: weights, gradients, optimizer state and its activations at their
peak), ``reserved_bytes``, the most the allocator held from the device meanwhile (allocated or cached: what the
device must have), ``memory_bytes``, what stays allocated between steps (weights, gradients kept, optimizer
state), and ``phase_peak_bytes``, the peak of each phase of those steps (``forward``, ``backward``, ``optimizer
step``: which one to make smaller). The progress bar shows the peak.
MFU = (training FLOPs per token, :func:`revlib_xla.models.llama.train_flops_per_token`) x tokens per second /
(the peak dense bf16 FLOP/s of the chips the run is on: :func:`revlib_xla.train.strategy.peak_flops`); ``null`` and
not shown where no peak is known (the CPU).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from .. import backends

__all__ = ["MetricsLogger", "PhasePeaks", "StepMemory", "cut_back", "device_memory", "step_memory", "start_peak"]


def device_memory(device: torch.device) -> int | None:
    """Bytes the device's allocator holds now, where it reports them (cuda, TorchTPU); else ``None``."""
    found = backends.backend_for(device)
    return found.memory_allocated(device) if found.allocator_statistics(device) else None


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Device memory of the steps since :func:`start_peak`, from the allocator's statistics (bytes): ``peak`` (the
    most allocated at once), ``reserved`` (the most held from the device, allocated or cached; ``None`` where the
    allocator does not report it) and ``between`` (allocated now, after the last step)."""

    peak: int
    reserved: int | None
    between: int
    #: the peak of each phase of the steps (forward, backward, optimizer step), where :class:`PhasePeaks` measured it
    phases: dict[str, int] | None = None


class PhasePeaks:
    """The device-memory peak of each phase of the training steps (``StepReport.on_phase`` calls :meth:`mark` as
    the step enters each), where the device's allocator keeps statistics (cuda; elsewhere nothing is measured):
    at each phase's start the allocator's peak so far is the phase before's, and its statistics start again.
    :meth:`take` gives the peaks since the last take; since the statistics restart at every phase, the steps' own
    peak is the largest of them (:func:`step_memory` with ``phases``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.backend = backends.backend_for(device)
        self.on = self.backend.allocator_statistics(device)
        self.current: str | None = None
        self.peaks: dict[str, int] = {}
        self.reserved: int | None = None

    def mark(self, name: str | None) -> None:
        if not self.on:
            return
        if self.current is not None:
            peak = self.backend.max_memory_allocated(self.device)
            self.peaks[self.current] = max(self.peaks.get(self.current, 0), peak)
        reserved = self.backend.max_memory_reserved(self.device)
        if reserved is not None:
            self.reserved = max(self.reserved or 0, reserved)
        self.backend.reset_peak_memory_stats(self.device)
        self.current = name

    def take(self) -> PhasePeaks:
        """Close the current phase; the peaks so far are kept in the returned copy, and this one starts again."""
        self.mark(None)
        taken = PhasePeaks.__new__(PhasePeaks)
        taken.__dict__.update(self.__dict__, peaks=dict(self.peaks))
        self.peaks, self.reserved = {}, None
        return taken


def start_peak(device: torch.device) -> None:
    """Start the peak that the next :func:`step_memory` reads (where the allocator keeps statistics)."""
    found = backends.backend_for(device)
    if found.allocator_statistics(device):
        found.reset_peak_memory_stats(device)


def step_memory(device: torch.device, phases: PhasePeaks | None = None) -> StepMemory | None:
    """The memory of the steps since :func:`start_peak` (:class:`StepMemory`), or ``None`` where the device's
    allocator reports none (cpu; XLA, whose compiler plans memory: see ``revlib-xla memory``). ``phases``: what a
    :class:`PhasePeaks` took of the same steps (its restarts of the statistics are folded in)."""
    found = backends.backend_for(device)
    if not found.allocator_statistics(device):
        return None
    peak, reserved = found.max_memory_allocated(device), found.max_memory_reserved(device)
    by_phase = None
    if phases is not None and phases.peaks:
        by_phase = dict(phases.peaks)
        peak = max(peak, *by_phase.values())
        if reserved is not None and phases.reserved is not None:
            reserved = max(reserved, phases.reserved)
    return StepMemory(peak=peak, reserved=reserved, between=found.memory_allocated(device), phases=by_phase)


class MetricsLogger:
    """Writes ``<out_dir>/metrics.jsonl`` (one JSON object per logged step and per evaluation, appended on resume;
    the file is created at the first record, so a run that fails before its first step leaves none),
    TensorBoard scalars under ``<out_dir>/tb`` when ``tensorboard`` is installed, and a tqdm progress bar."""

    def __init__(
        self,
        out_dir: str | Path,
        total_steps: int,
        start_step: int,
        tokens_per_step: int,
        flops_per_token: float,
        peak_flops: float | None,
        progress: bool = True,
    ) -> None:
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file: Any = None  # opened at the first record
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.tensorboard: Any = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(Path(out_dir) / "tb"))
        except ImportError:  # tensorboard is optional
            pass
        self.bar: Any = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        self._last = time.perf_counter()

    def _write(self, record: dict[str, Any]) -> None:
        if self.file is None:
            self.file = self.path.open("a")
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tensorboard is not None:
            for key, value in record.items():
                if key not in ("step", "kind") and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    def step(
        self, step: int, loss: float, lr: float, seconds: float, memory: StepMemory | None, steps_since: int = 1
    ) -> dict[str, Any]:
        """Record training step ``step`` (1-based: steps done) whose last ``steps_since`` steps took ``seconds`` and
        used ``memory`` (None where the allocator reports nothing: the memory fields are null)."""
        tokens_per_s = self.tokens_per_step * steps_since / max(seconds, 1e-9)
        record: dict[str, Any] = {
            "kind": "train",
            "step": step,
            "loss": loss,
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "step_time_s": seconds / steps_since,
            "mfu": None if self.peak_flops is None else self.flops_per_token * tokens_per_s / self.peak_flops,
            "peak_bytes": None if memory is None else memory.peak,
            "reserved_bytes": None if memory is None else memory.reserved,
            "memory_bytes": None if memory is None else memory.between,
            "phase_peak_bytes": None if memory is None else memory.phases,
        }
        self._write(record)
        if self.bar is not None:
            postfix = {
                "loss": f"{loss:.3f}",
                "tok/s": f"{tokens_per_s:,.0f}",
                "step": f"{1000 * seconds / steps_since:.0f}ms",
            }
            if record["mfu"] is not None:
                postfix["mfu"] = f"{100 * record['mfu']:.1f}%"
            if memory is not None:
                postfix["peak"] = f"{memory.peak / 2**30:.2f}GiB"
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(steps_since)
        return record

    def eval(self, step: int, loss: float) -> dict[str, Any]:
        """Record the validation loss after step ``step``."""
        record = {"kind": "eval", "step": step, "val_loss": loss}
        self._write(record)
        if self.bar is not None:
            self.bar.write(f"step {step}: validation loss {loss:.4f}")
        return record

    def message(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.file is not None:
            self.file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def cut_back(path: str | Path, step: int) -> int:
    """Drop the records of ``metrics.jsonl`` at ``path`` after step ``step`` (what a run killed after its last
    checkpoint logged, which the resumed run logs again), and lines that are not whole records (a write cut short);
    the file is replaced atomically. Returns the number of lines dropped (0, and nothing written, when none)."""
    file = Path(path)
    if not file.is_file():
        return 0
    kept, dropped = [], 0
    for line in file.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            keep = isinstance(record, dict) and int(record.get("step", 0)) <= step
        except (ValueError, TypeError):
            keep = False
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = file.with_name(f".{file.name}.tmp")
        tmp.write_text("".join(kept))
        tmp.replace(file)
    return dropped
