"""revlib_xla.fit.search: the largest batch that fits, found by compiling few batches and verified at its
neighbours (here with a compiler stand-in whose memory is a known function of the batch)."""

from __future__ import annotations

import math

import pytest

from revlib_xla.fit.chips import TPU_RESERVED_BYTES, Chip
from revlib_xla.fit.report import FitReport
from revlib_xla.fit.search import max_batch
from revlib_xla.fit.trace import TracedStep

CHIP = Chip("test", "tpu", 10_000 + TPU_RESERVED_BYTES, 1.0, "v5e:2x2")


def stand_in(memory_of):
    compiled: list[int] = []

    def compile_fn(traced, chip, labels, batches):
        compiled.extend(batches)
        reports = []
        for b in batches:
            total = memory_of(b)
            reports.append(FitReport(chip, labels[0], b, total, total, 100, 0, 0, 0, total - 100, 0))
        return reports

    return compile_fn, compiled


def trace_at(batch: int) -> TracedStep:
    return TracedStep("", "", (), ())


@pytest.mark.parametrize(
    ("memory_of", "expected"),
    [
        (lambda b: 100 + 7 * b, (10_000 - 100) // 7),  # affine: found from the first guess
        (lambda b: 100 + 3 * b + b * b, int((-3 + math.sqrt(9 + 4 * 9_900)) / 2)),  # grows faster than a line
        (lambda b: 100 + 9_000 * (b > 40) + b, 900),  # a jump in memory (the compiler changes its plan)
        (lambda b: 5_000 * b, 2),
    ],
)
def test_the_largest_fitting_batch_is_found_and_verified_at_its_neighbours(memory_of, expected):
    compile_fn, compiled = stand_in(memory_of)
    found = max_batch(trace_at, CHIP, label="plain", compile_fn=compile_fn)
    assert found.best == expected and not found.capped
    assert found.best_report.fits and found.best_report.batch == expected
    assert found.smallest_failure.batch == expected + 1  # both neighbours compiled: the compiler's answer
    assert len(compiled) == len(set(compiled)) <= 24  # nothing compiled twice; at worst a bisection


def test_affine_memory_needs_two_rounds_of_two_compiles():
    compile_fn, compiled = stand_in(lambda b: 100 + 7 * b)
    max_batch(trace_at, CHIP, compile_fn=compile_fn)
    assert sorted(compiled) == [1, 2, 1414, 1415]


def test_nothing_fits_and_the_limit_caps():
    compile_fn, _ = stand_in(lambda b: 20_000 + b)
    nothing = max_batch(trace_at, CHIP, compile_fn=compile_fn)
    assert nothing.best == 0 and nothing.best_report is None and nothing.smallest_failure.batch == 1
    compile_fn, _ = stand_in(lambda b: 100 + b)
    capped = max_batch(trace_at, CHIP, limit=64, compile_fn=compile_fn)
    assert capped.best == 64 and capped.capped and capped.smallest_failure is None
    with pytest.raises(ValueError, match="limit=0"):
        max_batch(trace_at, CHIP, limit=0, compile_fn=compile_fn)


def test_a_batch_no_plan_fits_is_a_failure_not_a_crash():
    """strategy=plan at a batch whose smallest checkpointing schedule exceeds what the chip leaves: tracing raises
    StepDoesNotFit (the planner's InfeasibleBudget), and the search takes it as a batch that does not fit, with the
    planner's lower bound, instead of ending with a traceback (found searching llama-1b plan on a v6e)."""
    from revlib_xla.fit.report import PLANNER_SOURCE, StepDoesNotFit

    def planned(batch: int) -> TracedStep:
        if batch >= 6:
            raise StepDoesNotFit("no schedule fits", 9_000 + 500 * batch, 100, 0)
        return trace_at(batch)

    compile_fn, compiled = stand_in(lambda b: 100 + 1_000 * b)
    found = max_batch(planned, CHIP, label="plan", compile_fn=compile_fn)
    assert found.best == 5 and found.smallest_failure.batch == 6
    refused = found.smallest_failure
    assert not refused.fits and refused.total is None and refused.at_least == 12_000
    assert refused.source == PLANNER_SOURCE and 6 not in compiled


def test_sizing_strategies_reports_a_refused_one_in_its_place(monkeypatch):
    """revlib-xla memory at the config's batch: a strategy whose plan cannot fit is reported (does not fit, the
    planner's bound) in its place among the compiled ones."""
    from revlib_xla.fit import strategies
    from revlib_xla.fit.report import PLANNER_SOURCE, StepDoesNotFit

    def traced_or_refused(cfg):
        if cfg.strategy.activations == "plan":
            raise StepDoesNotFit("no schedule fits", 123_456, 100, 0)
        return trace_at(cfg.data.batch_size)

    def compiled(traced, chip, labels, batches):
        return [FitReport(chip, lab, b, 500, 500, 100, 0, 0, 0, 400, 0) for lab, b in zip(labels, batches)]

    monkeypatch.setattr(strategies, "trace_config", traced_or_refused)
    monkeypatch.setattr(strategies, "compile_steps", compiled)
    chosen = [strategies.STRATEGIES[n] for n in ("none", "plan", "reversible")]
    reports = strategies.size_strategies(None, ["model.name=llama-tiny"], CHIP, chosen)
    assert [r.label for r in reports] == ["none", "plan", "reversible"]
    assert [r.fits for r in reports] == [True, False, True]
    assert reports[1].at_least == 123_456 and reports[1].source == PLANNER_SOURCE
