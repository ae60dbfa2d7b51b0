"""The planner's schedule for a run config at a memory budget, measured without a TPU (``revlib-xla plan``).

The config's model with ``strategy.activations=plan`` (:func:`revlib_xla.train.strategy.build_model` on ``meta``)
gets zero-copy device storage; its planner (``Checkpointable``) measures the stages from their programs compiled
deviceless for the chip (FLOP counts for time, the compiler's buffer assignment for memory), on stand-in inputs,
nothing run; then it solves for the fastest schedule within the budget. :func:`format_schedule` prints it with
runs of identical stages and operations compressed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import backends
from ..backends import tracing
from ..chips import Chip
from ..planner import Schedule
from ..units import format_bytes
from . import progress
from .trace import device_data, materialize

__all__ = ["PlannedSchedule", "plan_config", "format_schedule", "compress_ops"]


@dataclasses.dataclass(frozen=True)
class PlannedSchedule:
    """A schedule (:class:`revlib_xla.planner.Schedule`) planned for ``budget`` bytes, with what the planner
    predicts: ``flops`` (its makespan: the stages were measured as FLOP counts on XLA) and ``peak_bytes`` (the
    activations, their gradients and temporaries it holds at most), and ``held_bytes`` held beside the chain
    during the backward pass."""

    schedule: Schedule
    budget: float
    flops: float
    peak_bytes: float
    held_bytes: float
    least_bytes: float
    plain_bytes: float


def plan_config(cfg: Any, budget: float) -> PlannedSchedule:
    """Measure the planned model of ``cfg`` (``strategy.activations=plan``) and solve at ``budget`` bytes;
    :class:`revlib_xla.planner.InfeasibleBudget` when no schedule fits."""
    from ..train import strategy as train_strategy

    model = train_strategy.build_model(cfg, "meta")
    planner = getattr(model, "planned", None)
    if planner is None:
        raise ValueError("plan_config needs a config with strategy.activations=plan")
    dev = backends.device_for("xla")
    materialize(model, dev)
    micro = cfg.data.batch_size // getattr(cfg.optim, "grad_accum_steps", 1)
    tokens = device_data(torch.empty(micro, cfg.data.seq_len, dtype=torch.int64, device="meta"), dev)
    with (
        progress.waiting(f"measuring the {cfg.model.name} stages (traced, compiled deviceless; nothing run)"),
        tracing.stand_in_inputs(),
        tracing.execution_forbidden(dev),
        torch.autograd.set_multithreading_enabled(False),
    ):
        planner.measure(tokens)
    progress.say("solving for the schedule")
    schedule = planner.compute_sequence(budget)
    return PlannedSchedule(
        schedule,
        budget,
        flops=float(planner.get_expected_makespan()),
        peak_bytes=float(planner.get_expected_memory()),
        held_bytes=float(planner.held_during_backward()),
        least_bytes=float(planner.min_memory()),
        plain_bytes=float(planner.no_checkpoint_memory()),
    )


def compress_ops(ops: list[Any]) -> str:
    """Operations as text, runs of one kind over consecutive stages written once (``Fe_1..16``, ``B_16..1``), and
    alternating pairs over consecutive stages too (``(Fe_i B_i) for i 5..0``)."""
    parts = _runs(ops)
    out: list[str] = []
    k = 0
    while k < len(parts):
        j = k
        while j + 3 < len(parts) and _pair_follows(parts[j : j + 2], parts[j + 2 : j + 4]):
            j += 2
        if j > k:
            first, last = parts[k : k + 2], parts[j : j + 2]
            pattern = " ".join(p.rsplit("_", 1)[0] + "_i" for p in first)
            out.append(f"({pattern}) for i {first[0].rsplit('_', 1)[1]}..{last[0].rsplit('_', 1)[1]}")
            k = j + 2
        else:
            out.append(parts[k])
            k += 1
    return " ".join(out)


def _pair_follows(pair: list[str], after: list[str]) -> bool:
    """Whether ``after`` is ``pair`` one stage on (``Fe_5 B_5`` then ``Fe_4 B_4``), all on single stages."""
    try:
        (a, i), (b, j) = (p.rsplit("_", 1) for p in pair)
        (c, k), (d, m) = (p.rsplit("_", 1) for p in after)
        i_, j_, k_, m_ = int(i), int(j), int(k), int(m)
    except ValueError:  # "L", a run "Fe_1..3", an option suffix
        return False
    return a == c and b == d and i_ == j_ and k_ == m_ and abs(k_ - i_) == 1


def _runs(ops: list[Any]) -> list[str]:
    parts: list[str] = []
    k = 0
    while k < len(ops):
        first = ops[k]
        if str(first) == "L":
            parts.append("L")
            k += 1
            continue
        j = k
        step = 0
        while j + 1 < len(ops) and ops[j + 1].kind is first.kind and ops[j + 1].option == first.option:
            delta = ops[j + 1].index - ops[j].index
            if abs(delta) != 1 or (step and delta != step):
                break
            step = delta
            j += 1
        suffix = f"[{first.option}]" if first.option else ""
        text = str(first) if j == k else f"{first.kind.value}_{first.index}..{ops[j].index}{suffix}"
        parts.append(text)
        k = j + 1
    return parts


def format_schedule(planned: PlannedSchedule, chip: Chip) -> str:
    """The schedule readably: its predictions, one line per run of stages treated alike, the operations."""
    schedule = planned.schedule
    lines = [
        f"predicted time: {planned.flops:.4g} FLOP per step (~{planned.flops / chip.peak_bf16_flops:.3g} s at "
        f"{chip.name}'s bf16 peak: a lower bound)",
        f"predicted memory: {format_bytes(int(planned.peak_bytes))} of the {format_bytes(int(planned.budget))} "
        f"budget (activations, their gradients and temporaries; parameters and optimizer state not included); "
        f"least any schedule needs {format_bytes(int(planned.least_bytes))}, storing everything "
        f"{format_bytes(int(planned.plain_bytes))}",
        "stages:",
    ]
    rows = schedule.describe().splitlines()[1:-1]  # one per stage: "  i name  what"
    parsed = [(int(r.split()[0]), r[6:].strip()) for r in rows]
    k = 0
    while k < len(parsed):
        j = k
        while j + 1 < len(parsed) and parsed[j + 1][1] == parsed[k][1]:
            j += 1
        span = str(parsed[k][0]) if j == k else f"{parsed[k][0]}-{parsed[j][0]}"
        lines.append(f"  {span:<8} {parsed[k][1]}")
        k = j + 1
    counts = ", ".join(f"{kind} {n}" for kind, n in sorted(schedule.counts().items()))
    lines.append(f"operations ({len(schedule.ops)}: {counts}):")
    lines.append("  " + compress_ops(list(schedule.ops)))
    return "\n".join(lines)
