"""The largest batch that fits a chip, by compiling the step at a few batch sizes (``revlib-xla memory --max-batch``).

The search compiles batches 1 and 2, then guesses from the line through the two largest batches that fit (a
step's memory grows by about the same amount with each sample: the activations) and compiles the guess and the
batch after it, several candidates per compiler process (:func:`revlib_xla.fit.report.compile_steps`). When no
batch has failed yet it keeps growing (at least doubling); once one has, it narrows the interval between the
largest fitting and the smallest failing batch (at the point where the line between their memory meets the chip's,
and at the middle), and it ends only when both neighbours were compiled: the answer
is the compiler's, not the guess. Every compiled batch is kept (:attr:`BatchSearch.reports`), so nothing is
compiled twice, and the compile cache (:func:`revlib_xla.memory.tpu_memory`) makes a repeated search free.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TypeVar

from ..chips import Chip
from .report import FitReport, compile_or_refuse, compile_steps

__all__ = ["BatchSearch", "max_batch"]

Step = TypeVar("Step")


@dataclasses.dataclass(frozen=True)
class BatchSearch:
    """The result of :func:`max_batch`: ``best`` is the largest batch that fits (0: not even batch 1 does,
    ``limit`` reached: ``capped``), ``reports`` every compiled batch's report."""

    label: str
    chip: Chip
    best: int
    capped: bool
    reports: dict[int, FitReport]

    @property
    def best_report(self) -> FitReport | None:
        """The report of the largest fitting batch (``None`` when none fits)."""
        return self.reports.get(self.best)

    @property
    def smallest_failure(self) -> FitReport | None:
        """The report of the smallest batch compiled that does not fit (``None`` if all fit)."""
        failing = [b for b, r in self.reports.items() if not r.fits]
        return self.reports[min(failing)] if failing else None


def _guess(reports: dict[int, FitReport], lo: int, usable: int) -> int:
    """The largest batch the line through the two largest fitting batches keeps within ``usable`` bytes."""
    fitting = sorted(b for b, r in reports.items() if r.fits)
    if len(fitting) < 2:
        return 2 * lo
    b1, b2 = fitting[-2:]
    t1, t2 = reports[b1].total, reports[b2].total
    assert t1 is not None and t2 is not None  # fitting reports have totals
    per_sample = (t2 - t1) / (b2 - b1)
    if per_sample <= 0:
        return 2 * lo
    return b2 + int((usable - t2) // per_sample)


def max_batch(
    trace_at: Callable[[int], Step],
    chip: Chip,
    *,
    label: str = "",
    limit: int = 65536,
    compile_fn: Callable[[list[Step], Chip, list[str], list[int]], list[FitReport]] = compile_steps,  # type: ignore[assignment]
) -> BatchSearch:
    """The largest batch whose step fits ``chip`` (see the module docstring). ``trace_at(batch)`` traces the step
    at that batch (:func:`revlib_xla.fit.trace_step`); ``limit`` bounds the search; ``compile_fn`` compiles traced
    steps into reports (default: the deviceless TPU compiler). Any other sizing fits the same search: the GPU
    estimate (:func:`revlib_xla.fit.gpu.gpu_max_batch`) passes run configs and estimates them."""
    if limit < 1:
        raise ValueError(f"limit={limit}: the largest batch to try must be at least 1")
    reports: dict[int, FitReport] = {}

    def compile_batches(batches: set[int]) -> None:
        todo = sorted(b for b in batches if b not in reports and 1 <= b <= limit)
        tracers = [functools.partial(trace_at, b) for b in todo]
        reports.update(zip(todo, compile_or_refuse(tracers, chip, [label] * len(todo), todo, compile_fn)))

    compile_batches({1, min(2, limit)})
    while True:
        fitting = [b for b, r in reports.items() if r.fits]
        failing = [b for b, r in reports.items() if not r.fits]
        hi = min(failing) if failing else None
        lo = max((b for b in fitting if hi is None or b < hi), default=0)
        if lo == 0:
            return BatchSearch(label, chip, 0, False, reports)
        if hi == lo + 1:
            return BatchSearch(label, chip, lo, False, reports)
        if hi is None and lo >= limit:
            return BatchSearch(label, chip, lo, True, reports)
        if hi is None:
            guess = max(_guess(reports, lo, chip.usable_bytes), 2 * lo)
            candidates = {min(guess, limit), min(guess + 1, limit)}
        else:  # between the neighbours' memory by a straight line, and the middle: never slower than bisection
            t_lo, t_hi = reports[lo].at_least, reports[hi].at_least
            slope = (t_hi - t_lo) / (hi - lo)
            guess = lo + int((chip.usable_bytes - t_lo) // slope) if slope > 0 else (lo + hi) // 2
            guess = min(max(guess, lo + 1), hi - 1)
            candidates = {guess, guess + 1, (lo + hi) // 2} - {hi}
        compile_batches(candidates)
