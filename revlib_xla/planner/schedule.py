"""Schedules: the operations a plan runs, in order, and what each one does.

Operation kinds (:class:`OpKind`; rotor's names, then ours):

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

Each kind has one row in :data:`OPERATIONS` holding everything about it side by side: its time, its rule on the
cost model (what it needs live, what it creates and frees, its peak: :class:`Simulation`) and its rule on the
executor (the same steps on real tensors, through the :class:`Executor` interface that
:mod:`revlib_xla.planner.execute` implements). Adding an operation is one :class:`OpKind` member and one row.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

from .chain import Chain, StageOption

__all__ = [
    "Op",
    "OpKind",
    "ValueKind",
    "Operation",
    "OPERATIONS",
    "Executor",
    "Schedule",
    "Simulation",
    "simulate",
    "early_stops",
    "ScheduleError",
    "KINDS",
]


class OpKind(str, enum.Enum):
    """The kinds of operation of a schedule. Members are strings (``OpKind.FN == "Fn"``), so the names rotor prints
    and users write keep working as kinds, dictionary keys and in comparisons."""

    FN = "Fn"
    CF = "CF"
    FE = "Fe"
    B = "B"
    L = "L"
    FR = "Fr"
    BR = "Br"
    WM = "WM"
    RM = "RM"
    CA = "CA"

    def __str__(self) -> str:
        return self.value


KINDS: tuple[str, ...] = tuple(kind.value for kind in OpKind)


class ValueKind(str, enum.Enum):
    """What a live value of a schedule is: an input x_i, what stage i-1 keeps with autograd x̄_i (its output
    included), the gradient of x_i, or stage i's attention cache (``CA``)."""

    X = "x"
    XBAR = "xb"
    GRAD = "d"
    CACHE = "c"

    def __str__(self) -> str:
        return self.value


Value = tuple[ValueKind, int]


class ScheduleError(ValueError):
    """An operation sequence that cannot run: an input that is not there, or a memory item freed twice."""


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation of a schedule: its kind (an :class:`OpKind`, or its name: ``Op("Fe", 3)``), the stage it
    applies to and, for ``Fe``/``B``/``Br``, which of the stage's options runs (0 is the plain one)."""

    kind: OpKind
    index: int
    option: int = 0

    def __post_init__(self) -> None:
        try:
            kind = OpKind(self.kind)
        except ValueError:
            raise ValueError(f"Op: unknown kind {self.kind!r}; expected one of {', '.join(KINDS)}") from None
        object.__setattr__(self, "kind", kind)

    def __str__(self) -> str:
        if self.kind is OpKind.L:
            return "L"
        suffix = f"[{self.option}]" if self.option else ""
        return f"{self.kind.value}_{self.index}{suffix}"


class Simulation:
    """The cost model run operation by operation (rotor's memory model): which values are live and their sizes
    (:attr:`live`), the level (their sum, the chain input x_0 included), the peak and the time so far.

    x_i (size ``cw[i]``) is live from when it is computed until it is consumed (``Fn``, ``Fr``, ``WM``, or the
    backward of its stage); x̄_{i+1} (size of the chosen option's ``cbw``) holds x_{i+1} and lives from ``Fe_i`` to
    ``B_i``; a gradient lives from when it is computed until the next backward consumes it. Transients add to the
    level while their operation runs. The caller's input x_0 is never freed, and an input that a pending ``Br``
    will rebuild from (x_{i+1} after ``Fr_i``) is held until that ``Br``. Stage i's cache lives from ``CA_i`` to
    ``B_i``; meanwhile stage i's plain forwards cost and keep what :class:`~.chain.StageCache` says.
    """

    def __init__(self, chain: Chain, stopped: Collection[int] = ()) -> None:
        self.chain = chain
        self.stopped = frozenset(stopped)  # positions of the Fe that stop early (early_stops), priced stopped_fw
        self.position = 0  # of the next operation
        self.cw = chain.cw + (0.0,)
        n = chain.length
        self.live: dict[Value, float] = {(ValueKind.X, 0): self.cw[0], (ValueKind.GRAD, n + 1): 0.0}
        self.owned: set[Value] = {(ValueKind.X, 0)}  # the caller's input: never freed by the schedule
        self.held: set[int] = set()  # i + 1 after Fr_i: x_{i+1} is kept until Br_i rebuilds x_i from it
        self.host: set[int] = set()
        self.level = self.cw[0]
        self.peak = self.level
        self.time = 0.0
        self.loss_seen = False

    # The vocabulary of the rules in OPERATIONS.
    def add(self, key: Value, size: float) -> None:
        if key in self.live:
            raise ScheduleError(f"{key[0]}_{key[1]} computed while already live")
        self.live[key] = size
        self.level += size

    def drop(self, key: Value) -> None:
        self.level -= self.live.pop(key)

    def at_most(self, *levels: float) -> None:
        """The operation's memory reaches ``levels`` while it runs."""
        self.peak = max(self.peak, *levels)

    def has_input(self, i: int) -> bool:
        return (ValueKind.X, i) in self.live or (ValueKind.XBAR, i) in self.live

    def frees(self, i: int) -> bool:
        """Whether x_i is a value of its own that consuming it frees: not the caller's input x_0, not held for a
        pending ``Br``, and not part of x̄_i."""
        key = (ValueKind.X, i)
        return key in self.live and key not in self.owned and i not in self.held

    def free_input(self, i: int) -> None:
        if self.frees(i):
            self.drop((ValueKind.X, i))

    @staticmethod
    def need(cond: bool, what: str, op: Op) -> None:
        if not cond:
            raise ScheduleError(f"{op}: {what}")

    def step(self, op: Op) -> None:
        """Run one operation on the cost model, or :class:`ScheduleError` if it cannot run here."""
        n = self.chain.length
        i = n if op.kind is OpKind.L else op.index
        if not 0 <= i <= n:
            raise ScheduleError(f"{op}: stage index out of range 0..{n}")
        options = self.chain.stage_options(i)
        self.need(0 <= op.option < len(options), f"no option {op.option}", op)
        operation = OPERATIONS[op.kind]
        cached = self.cached(i, op)
        operation.simulate(self, i, op, options[op.option])
        stops = op.kind is OpKind.FE and self.position in self.stopped
        if stops:
            self.time += self.chain.cached_stopped_fw(i) if cached else self.chain.stopped_fw[i]
        elif cached:
            self.time += self.chain.caches[i].fw  # type: ignore[union-attr]  # (cached: there is one)
        else:
            self.time += operation.time(self.chain, i, options[op.option])
        self.position += 1

    def cached(self, i: int, op: Op) -> bool:
        """Whether ``op`` is a plain forward of stage i that reads the stage's kept attention cache."""
        return (
            op.kind in (OpKind.FN, OpKind.CF, OpKind.FE)
            and op.option == 0
            and i < self.chain.length
            and (ValueKind.CACHE, i) in self.live
        )

    def result(self) -> tuple[float, float]:
        """The total time and the peak, once the whole schedule has run."""
        if (ValueKind.GRAD, 0) not in self.live:
            raise ScheduleError("the schedule does not reach the gradient of x_0")
        return self.time, self.peak


class Executor(Protocol):
    """What a schedule's operations do to real tensors (implemented by :mod:`revlib_xla.planner.execute`), in the
    same terms as :class:`Simulation`: ``x`` inputs, ``xbar`` what a stage keeps with autograd, ``grad``."""

    def forward(self, i: int, *, grad: bool, option: int = 0) -> None:
        """Run stage i on x_i: without autograd, storing x_{i+1}; with autograd (option ``option``), keeping
        x̄_{i+1} for its backward."""

    def keep_cache(self, i: int) -> None:
        """Keep what stage i's attention returns in its next run, for its later runs, until its backward."""

    def free_input(self, i: int) -> None:
        """Drop x_i unless it is the caller's input or held for a pending ``Br``."""

    def hold(self, i: int) -> None:
        """Keep x_i until the ``Br`` that rebuilds x_{i-1} from it; drop x_{i-1}."""

    def backward(self, i: int) -> None:
        """Stage i's backward from x̄_{i+1}: the gradient of x_i from that of x_{i+1}; frees x̄_{i+1}."""

    def rebuild_backward(self, i: int, option: int) -> None:
        """Rebuild x_i from x_{i+1}, run stage i with autograd and its backward; frees x_{i+1}."""

    def to_host(self, i: int) -> None:
        """Move x_i to host memory."""

    def from_host(self, i: int) -> None:
        """Bring x_i back from host memory."""


Time = Callable[[Chain, int, StageOption], float]


@dataclasses.dataclass(frozen=True)
class Operation:
    """Everything about one kind of operation: what it means, its time (``time(chain, i, option)``), its rule on
    the cost model (``simulate(simulation, i, op, option)``: checks, peak, values created and freed) and its rule
    on the executor (``execute(executor, op)``). ``first_forward``: how :meth:`Schedule.describe` names a stage
    whose first forward is this operation (None: not a forward)."""

    kind: OpKind
    meaning: str
    time: Time
    simulate: Callable[[Simulation, int, Op, StageOption], None]
    execute: Callable[[Executor, Op], None]
    first_forward: str | None = None


def _forward_time(chain: Chain, i: int, opt: StageOption) -> float:
    return chain.fw[i]


def _simulate_forward(sim: Simulation, i: int, op: Op, opt: StageOption) -> None:
    """``Fn``, ``CF``, ``Fr``, ``CA``: x_{i+1} from x_i without autograd."""
    chain = sim.chain
    sim.need(i < chain.length, "the loss has no forward", op)
    sim.need(sim.has_input(i), f"x_{i} is not live", op)
    if op.kind is OpKind.CA:
        cache = chain.caches[i]
        sim.need(cache is not None, "the stage has no attention cache", op)
        sim.need((ValueKind.CACHE, i) not in sim.live, "its cache is already kept", op)
        sim.add((ValueKind.CACHE, i), cache.bytes)  # type: ignore[union-attr]  # (checked above)
    if op.kind is OpKind.FR:
        sim.need(chain.reversible[i], "stage is not reversible", op)
        key = (ValueKind.X, i)  # a held x_i too: the Br of this stage rebuilds it
        sim.need(key in sim.live and key not in sim.owned, f"x_{i} cannot be dropped", op)
    tmp = chain.cached_fwd_tmp(i, grad=False) if sim.cached(i, op) else chain.fwd_tmp[i]
    sim.at_most(sim.level + sim.cw[i + 1] + tmp)
    sim.add((ValueKind.X, i + 1), sim.cw[i + 1])
    if op.kind is OpKind.FR:
        sim.drop((ValueKind.X, i))
        sim.held.add(i + 1)
    elif op.kind is OpKind.FN:
        sim.free_input(i)


def _execute_fn(run: Executor, op: Op) -> None:
    run.forward(op.index, grad=False)
    run.free_input(op.index)


def _execute_cf(run: Executor, op: Op) -> None:
    run.forward(op.index, grad=False)


def _execute_ca(run: Executor, op: Op) -> None:
    run.keep_cache(op.index)
    run.forward(op.index, grad=False)


def _execute_fr(run: Executor, op: Op) -> None:
    run.forward(op.index, grad=False)
    run.hold(op.index + 1)


def _simulate_fe(sim: Simulation, i: int, op: Op, opt: StageOption) -> None:
    sim.need(i < sim.chain.length, "the loss has no forward", op)
    sim.need(sim.has_input(i), f"x_{i} is not live", op)
    cache = sim.chain.caches[i]
    if cache is not None and sim.cached(i, op):
        cbw, tmp = cache.cbw, sim.chain.cached_fwd_tmp(i, grad=True)
    else:
        cbw, tmp = opt.cbw, opt.fwd_tmp
    sim.at_most(sim.level + cbw + tmp)
    sim.add((ValueKind.XBAR, i + 1), cbw)


def _execute_fe(run: Executor, op: Op) -> None:
    run.forward(op.index, grad=True, option=op.option)


def _simulate_backward(sim: Simulation, i: int, op: Op, opt: StageOption) -> None:
    """``B`` and ``L`` (the loss's backward): the gradient of x_i from that of x_{i+1}."""
    sim.need(sim.has_input(i), f"x_{i} is not live", op)
    if op.kind is OpKind.B:
        sim.need(i < sim.chain.length and (ValueKind.XBAR, i + 1) in sim.live, f"x̄_{i + 1} is not live", op)
    sim.need((ValueKind.GRAD, i + 1) in sim.live, f"the gradient of x_{i + 1} is not there", op)
    sim.loss_seen = sim.loss_seen or op.kind is OpKind.L
    sim.need(sim.loss_seen, "backward before the loss", op)
    sim.at_most(sim.level + sim.cw[i] + opt.bwd_tmp)
    if op.kind is OpKind.B:
        sim.drop((ValueKind.XBAR, i + 1))
        if (ValueKind.CACHE, i) in sim.live:
            sim.drop((ValueKind.CACHE, i))
    sim.drop((ValueKind.GRAD, i + 1))
    sim.free_input(i)
    sim.add((ValueKind.GRAD, i), sim.cw[i])


def _execute_b(run: Executor, op: Op) -> None:
    run.backward(op.index)
    run.free_input(op.index)


def _execute_l(run: Executor, op: Op) -> None:
    # The model's output is the caller's from here on; its gradient comes with the backward phase.
    run.free_input(op.index)


def _simulate_br(sim: Simulation, i: int, op: Op, opt: StageOption) -> None:
    chain = sim.chain
    sim.need(i < chain.length and chain.reversible[i], "stage is not reversible", op)
    sim.need(
        (ValueKind.X, i + 1) in sim.live and (ValueKind.GRAD, i + 1) in sim.live,
        f"x_{i + 1} or its gradient is not live",
        op,
    )
    sim.need(not sim.has_input(i), f"x_{i} is live: use B", op)
    sim.at_most(sim.level + sim.cw[i] + opt.cbw + opt.fwd_tmp, sim.level + 2 * sim.cw[i] + opt.cbw + opt.bwd_tmp)
    sim.need((ValueKind.CACHE, i) not in sim.live, "a reversible stage's backward does not read a cache", op)
    sim.drop((ValueKind.X, i + 1))
    sim.held.discard(i + 1)
    sim.drop((ValueKind.GRAD, i + 1))
    sim.add((ValueKind.GRAD, i), sim.cw[i])
    if i in sim.held:  # the rebuilt x_i is what Br_{i-1} will rebuild from
        sim.add((ValueKind.X, i), sim.cw[i])


def _execute_br(run: Executor, op: Op) -> None:
    run.rebuild_backward(op.index, op.option)


def _offload_time(chain: Chain, i: int, opt: StageOption) -> float:
    time = chain.offload_time[i]
    return 0.0 if time is None else time


def _simulate_wm(sim: Simulation, i: int, op: Op, opt: StageOption) -> None:
    sim.need(i < sim.chain.length and sim.chain.offload_time[i] is not None, "offload not allowed for this stage", op)
    key = (ValueKind.X, i)
    sim.need(key in sim.live and key not in sim.owned, f"x_{i} cannot be offloaded", op)
    sim.drop(key)
    sim.host.add(i)


def _simulate_rm(sim: Simulation, i: int, op: Op, opt: StageOption) -> None:
    sim.need(i in sim.host, f"x_{i} is not in host memory", op)
    sim.host.discard(i)
    sim.add((ValueKind.X, i), sim.cw[i])
    sim.at_most(sim.level)


#: One row per operation kind: its time, its rule on the cost model and its rule on the executor.
OPERATIONS: Mapping[OpKind, Operation] = {
    row.kind: row
    for row in (
        Operation(
            OpKind.FN,
            "run stage i without autograd; drop its input",
            _forward_time,
            _simulate_forward,
            _execute_fn,
            "recomputed",
        ),
        Operation(
            OpKind.CF,
            "keep x_i as a checkpoint; run stage i without autograd",
            _forward_time,
            _simulate_forward,
            _execute_cf,
            "checkpointed input, recomputed",
        ),
        Operation(
            OpKind.CA,
            "keep x_i and what stage i's attention returns (until B_i); run stage i without autograd",
            _forward_time,
            _simulate_forward,
            _execute_ca,
            "checkpointed input and attention, recomputed",
        ),
        Operation(
            OpKind.FE,
            "run stage i with autograd, keeping x̄_{i+1} until its backward",
            lambda chain, i, opt: opt.fw,
            _simulate_fe,
            _execute_fe,
            "kept for backward",
        ),
        Operation(
            OpKind.B,
            "backward of stage i from x̄_{i+1}",
            lambda chain, i, opt: opt.bw,
            _simulate_backward,
            _execute_b,
        ),
        Operation(
            OpKind.L,
            "the loss: the forward phase ends, the backward phase begins",
            lambda chain, i, opt: opt.fw + opt.bw,
            _simulate_backward,
            _execute_l,
        ),
        Operation(
            OpKind.FR,
            "reversible stage i without autograd; drop x_i, to be rebuilt from x_{i+1}",
            _forward_time,
            _simulate_forward,
            _execute_fr,
            "reversible (input rebuilt)",
        ),
        Operation(
            OpKind.BR,
            "rebuild x_i from x_{i+1}, run stage i with autograd and its backward",
            lambda chain, i, opt: chain.inverse_time[i] + opt.fw + opt.bw,
            _simulate_br,
            _execute_br,
        ),
        Operation(
            OpKind.WM,
            "write x_i to host memory, freeing its device memory",
            _offload_time,
            _simulate_wm,
            lambda run, op: run.to_host(op.index),
        ),
        Operation(
            OpKind.RM,
            "read x_i back from host memory",
            _offload_time,
            _simulate_rm,
            lambda run, op: run.from_host(op.index),
        ),
    )
}


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
        """How many operations of each kind the plan runs, by name (equal to the :class:`OpKind` members)."""
        out: dict[str, int] = {}
        for op in self.ops:
            out[op.kind.value] = out.get(op.kind.value, 0) + 1
        return out

    def describe(self) -> str:
        """A readable summary: time, peak, what each stage does in the forward phase, and the operations."""
        chain = self.chain
        first: dict[int, Op] = {}
        for op in self.ops:
            if OPERATIONS[op.kind].first_forward is not None and op.index not in first:
                first[op.index] = op
        offloaded = {op.index for op in self.ops if op.kind is OpKind.WM}
        lines = [
            f"schedule: makespan {self.makespan:.6g}, peak memory {self.peak_memory:.6g}, "
            f"{len(self.ops)} operations ({', '.join(f'{k} {n}' for k, n in sorted(self.counts().items()))})"
        ]
        for i in range(chain.length):
            found = first.get(i)
            word = "?" if found is None else str(OPERATIONS[found.kind].first_forward)
            if found is not None and found.kind is OpKind.FE and found.option:
                word += f" ({chain.stage_options(i)[found.option].name})"
            if i in offloaded:
                word += ", input offloaded"
            lines.append(f"  {i:3d} {chain.names[i]:<24} {word}")
        lines.append("  ops: " + str(self))
        return "\n".join(lines)


def early_stops(ops: Sequence[Op]) -> dict[int, int]:
    """The recomputations that stop at the last tensor their backward reads (:mod:`revlib_xla.planner.early_stop`), as
    {position of ``Fe_i``: position of the ``CF_i`` that builds its graph}, positions in ``ops``.

    Such an ``Fe_i`` is stage i's last recomputation, immediately followed by ``B_i`` (plain option), and stage i's
    run before it is a ``CF_i`` (or ``CA_i``) with x_i stored in between (no ``WM_i`` or ``Br_{i-1}`` drops it):
    that ``CF_i`` builds the stage's graph without keeping activations, its input being live anyway until ``B_i``,
    and the pair ``Fe_i B_i`` becomes the backward of that graph, recomputing only what it reads: nothing after
    ``B_i`` reads x_{i+1}, so the recomputation need not produce it."""
    runs = (OpKind.FN, OpKind.CF, OpKind.CA, OpKind.FE, OpKind.FR, OpKind.BR, OpKind.B)
    found: dict[int, int] = {}
    last_run: dict[int, int] = {}  # stage -> position of its latest run
    dropped: set[int] = set()  # stages whose stored input left the device (or a Br dropped it) since that run
    for k, op in enumerate(ops):
        i = op.index
        if op.kind is OpKind.WM:
            dropped.add(i)
        elif op.kind is OpKind.BR:
            dropped.add(i + 1)
        if (
            op == Op(OpKind.FE, i)
            and k + 1 < len(ops)
            and ops[k + 1] == Op(OpKind.B, i)
            and i in last_run
            and ops[last_run[i]].kind in (OpKind.CF, OpKind.CA)
            and i not in dropped
        ):
            found[k] = last_run[i]
        if op.kind in runs:
            last_run[i] = k
            dropped.discard(i)
    return found


def simulate(chain: Chain, ops: Sequence[Op]) -> tuple[float, float]:
    """Run ``ops`` on the cost model (:class:`Simulation`): the total time and the peak memory (x_0 counted), or
    :class:`ScheduleError`. ``Fe`` operations that stop early (:func:`early_stops`) cost ``stopped_fw``."""
    sim = Simulation(chain, early_stops(ops))
    for op in ops:
        sim.step(op)
    return sim.result()
