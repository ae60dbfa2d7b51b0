"""Schedules: the operations a plan runs, in order, and what they cost.

Operation kinds (rotor's names, then ours):

====== =====================================================================================================
``Fn`` run stage i without autograd; its input is dropped afterwards
``CF`` keep x_i as a checkpoint and run stage i without autograd
``Fe`` run stage i with autograd, keeping x̄_{i+1} until ``B`` (``option`` names a compressed variant)
``B``  backward of stage i: gradient of x_i from that of x_{i+1}; frees x̄_{i+1} and x_i (unless a pending
       ``Br_{i-1}`` needs it)
``L``  the loss: forward phase ends, backward phase begins
``Fr`` reversible stage i: run without autograd and drop x_i (it will be rebuilt from x_{i+1})
``Br`` reversible stage i: rebuild x_i from x_{i+1}, run with autograd and backward; frees x_{i+1} (and x_i,
       unless a pending ``Br_{i-1}`` needs it)
``WM`` write x_i to host memory (offload), freeing its device memory
``RM`` read x_i back from host memory
====== =====================================================================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .chain import Chain

__all__ = ["Op", "Schedule", "simulate", "ScheduleError", "KINDS"]

KINDS = ("Fn", "CF", "Fe", "B", "L", "Fr", "Br", "WM", "RM")


class ScheduleError(ValueError):
    """An operation sequence that cannot run: an input that is not there, or a memory item freed twice."""


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation of a schedule: its kind, the stage it applies to and, for ``Fe``/``B``/``Br``, which of the
    stage's options runs (0 is the plain one)."""

    kind: str
    index: int
    option: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Op: unknown kind {self.kind!r}; expected one of {', '.join(KINDS)}")

    def __str__(self) -> str:
        if self.kind == "L":
            return "L"
        suffix = f"[{self.option}]" if self.option else ""
        return f"{self.kind}_{self.index}{suffix}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A plan: the operations, their total time (``makespan``, in the chain's time unit) and the peak memory they
    need (``peak_memory``, in the chain's size unit, the chain input x_0 included)."""

    ops: tuple[Op, ...]
    makespan: float
    peak_memory: float
    chain: Chain = dataclasses.field(repr=False, compare=False)

    def __str__(self) -> str:
        return " ".join(str(op) for op in self.ops)

    def counts(self) -> dict[str, int]:
        """How many operations of each kind the plan runs."""
        out: dict[str, int] = {}
        for op in self.ops:
            out[op.kind] = out.get(op.kind, 0) + 1
        return out

    def describe(self) -> str:
        """A readable summary: time, peak, what each stage does in the forward phase, and the operations."""
        chain = self.chain
        first: dict[int, Op] = {}
        for op in self.ops:
            if op.kind in ("Fn", "CF", "Fe", "Fr") and op.index not in first:
                first[op.index] = op
        words = {
            "Fn": "recomputed",
            "CF": "checkpointed input, recomputed",
            "Fe": "kept for backward",
            "Fr": "reversible (input rebuilt)",
        }
        offloaded = {op.index for op in self.ops if op.kind == "WM"}
        lines = [
            f"schedule: makespan {self.makespan:.6g}, peak memory {self.peak_memory:.6g}, "
            f"{len(self.ops)} operations ({', '.join(f'{k} {n}' for k, n in sorted(self.counts().items()))})"
        ]
        for i in range(chain.length):
            op = first.get(i)
            word = words.get(op.kind, op.kind) if op else "?"
            if op is not None and op.kind == "Fe" and op.option:
                word += f" ({chain.stage_options(i)[op.option].name})"
            if i in offloaded:
                word += ", input offloaded"
            lines.append(f"  {i:3d} {chain.names[i]:<24} {word}")
        lines.append("  ops: " + str(self))
        return "\n".join(lines)


def simulate(chain: Chain, ops: Sequence[Op]) -> tuple[float, float]:
    """Run ``ops`` on the cost model: the total time and the peak memory (x_0 counted), or ScheduleError.

    The memory model is rotor's: x_i (size ``cw[i]``) is live from when it is computed until it is consumed
    (``Fn``, ``Fr``, ``WM``, or the backward of its stage); x̄_{i+1} (size of the chosen option's ``cbw``) holds
    x_{i+1} and lives from ``Fe_i`` to ``B_i``; a gradient lives from when it is computed until the next backward
    consumes it. Transients add to the level while their operation runs.
    """
    n = chain.length
    cw = chain.cw + (0.0,)
    live: dict[tuple[str, int], float] = {("x", 0): cw[0]}
    owned = {("x", 0)}  # the caller's input: never freed by the schedule
    held = set()  # x_{i+1} after Fr_i: kept until Br_i rebuilds x_i from it
    host = set()
    level = cw[0]
    peak = level
    time = 0.0
    live[("d", n + 1)] = 0.0
    loss_seen = False

    def add(key: tuple[str, int], size: float) -> None:
        nonlocal level
        if key in live:
            raise ScheduleError(f"{key[0]}_{key[1]} computed while already live")
        live[key] = size
        level += size

    def drop(key: tuple[str, int]) -> None:
        nonlocal level
        level -= live.pop(key)

    def has_input(i: int) -> bool:
        return ("x", i) in live or ("xb", i) in live

    def need(cond: bool, what: str, op: Op) -> None:
        if not cond:
            raise ScheduleError(f"{op}: {what}")

    for op in ops:
        i = op.index
        if op.kind == "L":
            i = n
        if not 0 <= i <= n:
            raise ScheduleError(f"{op}: stage index out of range 0..{n}")
        opts = chain.stage_options(i)
        need(0 <= op.option < len(opts), f"no option {op.option}", op)
        opt = opts[op.option]
        if op.kind in ("Fn", "CF", "Fr"):
            need(i < n, "the loss has no forward", op)
            need(has_input(i), f"x_{i} is not live", op)
            if op.kind == "Fr":
                need(chain.reversible[i], "stage is not reversible", op)
                need(("x", i) in live and ("x", i) not in owned, f"x_{i} cannot be dropped", op)
            peak = max(peak, level + cw[i + 1] + chain.fwd_tmp[i])
            add(("x", i + 1), cw[i + 1])
            if op.kind == "Fr":
                held.add(i + 1)
            if op.kind == "Fr" or (op.kind == "Fn" and ("x", i) in live and ("x", i) not in owned):
                drop(("x", i))
            time += chain.fw[i]
        elif op.kind == "Fe":
            need(i < n, "the loss has no forward", op)
            need(has_input(i), f"x_{i} is not live", op)
            peak = max(peak, level + opt.cbw + opt.fwd_tmp)
            add(("xb", i + 1), opt.cbw)
            time += opt.fw
        elif op.kind in ("B", "L"):
            need(has_input(i), f"x_{i} is not live", op)
            if op.kind == "B":
                need(i < n and ("xb", i + 1) in live, f"x̄_{i + 1} is not live", op)
            need(("d", i + 1) in live, f"the gradient of x_{i + 1} is not there", op)
            loss_seen = loss_seen or op.kind == "L"
            need(loss_seen, "backward before the loss", op)
            peak = max(peak, level + cw[i] + opt.bwd_tmp)
            if op.kind == "B":
                drop(("xb", i + 1))
            drop(("d", i + 1))
            if ("x", i) in live and ("x", i) not in owned and i not in held:
                drop(("x", i))
            add(("d", i), cw[i])
            time += opt.fw + opt.bw if op.kind == "L" else opt.bw
        elif op.kind == "Br":
            need(i < n and chain.reversible[i], "stage is not reversible", op)
            need(("x", i + 1) in live and ("d", i + 1) in live, f"x_{i + 1} or its gradient is not live", op)
            need(not has_input(i), f"x_{i} is live: use B", op)
            peak = max(peak, level + cw[i] + opt.cbw + opt.fwd_tmp, level + 2 * cw[i] + opt.cbw + opt.bwd_tmp)
            drop(("x", i + 1))
            held.discard(i + 1)
            drop(("d", i + 1))
            add(("d", i), cw[i])
            if i in held:  # the rebuilt x_i is what Br_{i-1} will rebuild from
                add(("x", i), cw[i])
            time += chain.inverse_time[i] + opt.fw + opt.bw
        elif op.kind == "WM":
            need(i < n and chain.offload_time[i] is not None, "offload not allowed for this stage", op)
            need(("x", i) in live and ("x", i) not in owned, f"x_{i} cannot be offloaded", op)
            drop(("x", i))
            host.add(i)
            time += chain.offload_time[i]
        elif op.kind == "RM":
            need(i in host, f"x_{i} is not in host memory", op)
            host.discard(i)
            add(("x", i), cw[i])
            peak = max(peak, level)
            time += chain.offload_time[i]
    if ("d", 0) not in live:
        raise ScheduleError("the schedule does not reach the gradient of x_0")
    return time, peak
