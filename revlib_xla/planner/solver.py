"""The optimal persistent schedule of a chain under a memory budget (rotor's dynamic program, extended).

``Opt[m][i][l]`` is the least time to run the forward and backward of stages ``i..l`` (``l = L`` includes the
loss) with ``m`` memory slots free, x_i held outside them and the gradient of x_{l+1} inside them. A persistent
schedule for ``[i, l]`` is one of:

* base (``i == l``): ``Fe_i B_i`` (or the loss ``L``); right after ``CF_i`` (the earlier segment of a leaf at
  ``j = i + 1``), the plain ``Fe_i`` stops early and costs ``stopped_fw[i]`` (:func:`~.schedule.early_stops`);
* chain: ``Fe_i``, then ``[i+1, l]`` with ``m - |x̄_{i+1}|``, then ``B_i``;
* leaf at ``j`` (``i < j <= l``): ``CF_i Fn_{i+1} .. Fn_{j-1}``, then ``[j, l]`` with ``m - |x_j|``, then
  ``[i, j-1]`` with ``m``;
* reversible (stage i reversible): ``Fr_i``, then ``[i+1, l]`` with ``m + |x_i| - |x_{i+1}|``, then ``Br_i``;
* offloaded leaf at ``j``: the leaf, with x_i written to host memory while ``[j, l]`` runs (``WM_i``/``RM_i``),
  which gives ``[j, l]`` the ``|x_i|`` slots as well.

* cached leaf at ``j`` (stage i has an attention cache, ``Chain.caches``): ``CA_i Fn_{i+1} .. Fn_{j-1}``, then
  ``[j, l]`` with ``m - |x_j| - |cache_i|``, then ``[i, j-1]`` *cached* with ``m - |cache_i|``: a third table,
  ``Opt`` for segments whose stage i keeps its cache (outside their slots), where stage i's plain forwards cost
  and keep what the cache makes them (its leaves run ``CF_i``, its chain and base ``Fe_i``, all cheaper).

Dropping or offloading x_i frees memory only when x_i is a tensor of its own: not when it is part of x̄_i (the
chain case) or the caller's input x_0. So the program keeps two tables, for inputs that can and cannot be freed.

Every candidate is evaluated for all ``i`` of one segment length and all ``m`` at once (tensor operations over
``[i, j, m]``), so 100 stages and 500 slots take about a second. Ties go to the leaf, then the chain, as in rotor.
The tables live in :mod:`revlib_xla.planner.tables`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch

from .chain import Chain
from .schedule import Op, OpKind, Schedule, simulate
from .tables import _Arrays, _Tables

__all__ = ["solve", "plan", "min_memory", "no_checkpoint_memory", "InfeasibleBudget"]

_INF = math.inf


class InfeasibleBudget(ValueError):
    """No schedule fits in the budget. ``minimum`` is the smallest budget any schedule fits in (chain units).
    ``unit`` is set when the budget is at least that minimum but the plan's sizes, rounded up to multiples of
    ``unit`` (the budget over the finest number of slots tried), are not: a budget a little larger fits."""

    def __init__(self, message: str, minimum: float, unit: float | None = None) -> None:
        super().__init__(message)
        self.minimum = minimum
        self.unit = unit

    def naming(self, budget: str) -> str:
        """The message with the budget called what the user typed (``--budget``, ``strategy.budget``) instead of
        ``Checkpointable``'s ``mem_limit``."""
        return str(self).removeprefix("Checkpointable: ").replace("mem_limit", budget)


class _Segment(NamedTuple):
    """Segment [i, l] to run with m slots, its input x_i freeable or not (see :class:`_Tables`); ``after_cf``: a
    base case right after ``CF_i``; ``cached``: stage i keeps its attention cache."""

    free: bool
    i: int
    l: int
    m: int
    after_cf: bool = False
    cached: bool = False


# A choice's operations and sub-segments, built only for the choice taken (lambdas bind their loop values as
# defaults, hence the open signature).
_Steps = Callable[..., Sequence["Op | _Segment"]]


def _choices(
    t: _Tables, a: _Arrays, free: bool, i: int, l: int, m: int, after_cf: bool = False, cached: bool = False
) -> Iterator[tuple[float, _Steps]]:
    """Every way to run segment [i, l] with m slots, as (time, a function giving its operations and sub-segments),
    in rotor's order of preference for ties: leaves (nearest j first), chain, cached leaves, reversible,
    offloaded leaves."""
    cw, fw, prefix, fmax = a.lists["cw"], a.lists["fw"], a.lists["prefix"], a.fmax_list
    obw = a.lists["obw"]
    ofw, oxb = (a.lists["cofw"], a.lists["coxb"]) if cached else (a.lists["ofw"], a.lists["oxb"])
    if i == l:
        for c in range(a.k):
            if m >= a.fe_b_need(i, i, c, cached):
                yield (
                    a.base_time(i, c, after_cf, cached),
                    (lambda c=c: [Op(OpKind.L, a.n)] if i == a.n else [Op(OpKind.FE, i, c), Op(OpKind.B, i, c)]),
                )
        return

    def forward(j: int, first: OpKind = OpKind.CF) -> list[Op | _Segment]:
        steps: list[Op | _Segment] = [Op(first, i)]
        return steps + [Op(OpKind.FN, k) for k in range(i + 1, j)]

    gain = fw[i] - a.lists["cfw"][i] if cached else 0.0
    leaf_fmax = a.fmax_cached_list if cached else fmax
    for j in range(i + 1, l + 1):
        if m >= cw[l + 1] + leaf_fmax[i][j]:
            stops = j == i + 1  # the earlier segment is stage i's base case right after CF_i
            yield (
                prefix[j]
                - prefix[i]
                - gain
                + t.value(True, j, l, m - int(cw[j]))
                + t.value(free, i, j - 1, m, stops, cached),
                lambda j=j, stops=stops: (
                    forward(j) + [_Segment(True, j, l, m - int(cw[j])), _Segment(free, i, j - 1, m, stops, cached)]
                ),
            )
    for c in range(a.k):
        if m >= a.fe_b_need(i, l, c, cached):
            sub = m - int(oxb[i][c])
            yield (
                ofw[i][c] + obw[i][c] + t.value(False, i + 1, l, sub),
                lambda c=c, sub=sub: [Op(OpKind.FE, i, c), _Segment(False, i + 1, l, sub), Op(OpKind.B, i, c)],
            )
    if not cached and a.lists["has_ca"][i]:
        own = int(a.lists["ca"][i])
        for j in range(i + 1, l + 1):
            if m >= cw[l + 1] + fmax[i][j] + own:
                stops = j == i + 1
                rest = m - own
                yield (
                    prefix[j]
                    - prefix[i]
                    + t.value(True, j, l, rest - int(cw[j]))
                    + t.value(free, i, j - 1, rest, stops, True),
                    lambda j=j, stops=stops, rest=rest: (
                        forward(j, OpKind.CA)
                        + [_Segment(True, j, l, rest - int(cw[j])), _Segment(free, i, j - 1, rest, stops, True)]
                    ),
                )
    if not free or cached:
        return
    if a.lists["rev"][i]:
        sub = m + int(cw[i]) - int(cw[i + 1])
        for c in range(a.k):
            if m >= a.fr_br_need(i, l, c):
                yield (
                    fw[i] + a.lists["inv"][i] + ofw[i][c] + obw[i][c] + t.value(True, i + 1, l, sub),
                    lambda c=c: [Op(OpKind.FR, i), _Segment(True, i + 1, l, sub), Op(OpKind.BR, i, c)],
                )
    off = a.lists["off"][i]
    if math.isfinite(off):
        for j in range(i + 1, l + 1):
            if m >= cw[l + 1] + fmax[i][j]:
                sub = m + int(cw[i]) - int(cw[j])
                yield (
                    prefix[j] - prefix[i] + 2 * off + t.value(True, j, l, sub) + t.value(True, i, j - 1, m),
                    lambda j=j, sub=sub: (
                        forward(j)
                        + [
                            Op(OpKind.WM, i),
                            _Segment(True, j, l, sub),
                            Op(OpKind.RM, i),
                            _Segment(True, i, j - 1, m),
                        ]
                    ),
                )


def _rebuild(t: _Tables, a: _Arrays, top: int) -> list[Op]:
    ops: list[Op] = []
    # An explicit stack instead of recursion: deep chains would exceed Python's recursion limit.
    stack: list[Op | _Segment] = [_Segment(False, 0, a.n, top)]
    while stack:
        item = stack.pop()
        if isinstance(item, Op):
            ops.append(item)
            continue
        free, i, l, m, after_cf, cached = item
        target = t.value(free, i, l, m, after_cf, cached)
        # The table was computed in its own precision and order of additions: accept the first choice within it.
        slack = 1e-9 if t.free.dtype == torch.float64 else 1e-5
        steps = next(
            (
                steps
                for value, steps in _choices(t, a, free, i, l, m, after_cf, cached)
                if value <= target + slack * max(1.0, abs(target))
            ),
            None,
        )
        if steps is None:
            raise AssertionError(f"planner: no choice reaches the table's value for [{i}, {l}] at {m} slots")
        stack.extend(reversed(steps()))
    return ops


def min_memory(chain: Chain) -> float:
    """The smallest budget (in the chain's size unit, the input x_0 included) that any schedule fits in.

    Feasibility is monotone in the budget, so the DP over slots becomes a DP over the least budget per segment
    (max of what the operations need and what the sub-segments need, shifted by what stays held meanwhile). Its
    tables are real tensors also inside ``FakeTensorMode`` (an infeasible budget met while sizing a step).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _least(_Arrays(chain, 1.0, float))


def _least(a: _Arrays) -> float:
    """:func:`min_memory` in the units of ``a`` (bytes, or slots when ``a`` holds rounded sizes)."""
    n = a.n
    cw, fmax, rev, off = a.lists["cw"], a.fmax_list, a.lists["rev"], a.lists["off"]
    opts = [[c for c in range(a.k) if math.isfinite(a.lists["ofw"][i][c])] for i in range(n + 1)]
    oxb = a.lists["oxb"]
    free = [[_INF] * (n + 1) for _ in range(n + 1)]
    kept = [[_INF] * (n + 1) for _ in range(n + 1)]
    for i in range(n + 1):
        free[i][i] = kept[i][i] = min(a.fe_b_need(i, i, c) for c in opts[i])
    for d in range(1, n + 1):
        for i in range(0, n + 1 - d):
            l = i + d
            chain_need = min(max(a.fe_b_need(i, l, c), kept[i + 1][l] + oxb[i][c]) for c in opts[i])
            leaf_free = leaf_kept = _INF
            for j in range(i + 1, l + 1):
                head = max(cw[l + 1] + fmax[i][j], free[j][l] + cw[j])
                leaf_free = min(leaf_free, max(head, free[i][j - 1]))
                leaf_kept = min(leaf_kept, max(head, kept[i][j - 1]))
                if math.isfinite(off[i]):
                    leaf_free = min(
                        leaf_free, max(cw[l + 1] + fmax[i][j], free[j][l] + cw[j] - cw[i], free[i][j - 1], 0.0)
                    )
            best_free = min(chain_need, leaf_free)
            if rev[i]:
                need = min(a.fr_br_need(i, l, c) for c in opts[i])
                best_free = min(best_free, max(need, free[i + 1][l] + cw[i + 1] - cw[i], 0.0))
            free[i][l] = best_free
            kept[i][l] = min(chain_need, leaf_kept)
    return max(kept[0][n], 0.0) + cw[0]


def _plain_ops(chain: Chain) -> list[Op]:
    n = chain.length
    return [Op(OpKind.FE, i) for i in range(n)] + [Op(OpKind.L, n)] + [Op(OpKind.B, i) for i in reversed(range(n))]


def no_checkpoint_memory(chain: Chain) -> float:
    """The peak of the plain schedule (every stage keeps what autograd saves): the budget at which nothing needs
    recomputing."""
    return simulate(chain, _plain_ops(chain))[1]


def _plain_is_fastest(chain: Chain) -> bool:
    """Whether no schedule is faster than the plain one: every schedule runs each stage's backward once with one of
    its options (``B``, or ``Br`` which adds an inverse), after a forward with autograd of that option, so when the
    plain option is the cheapest of each stage, the plain schedule's time is a lower bound."""
    return all(chain.fw[i] + chain.bw[i] <= opt.fw + opt.bw for i in range(chain.length) for opt in chain.options[i])


#: The largest table the solver builds when it refines the resolution: (stages + 1)**2 * (slots + 1) entries.
_MAX_TABLE = 1 << 22


def solve(chain: Chain, mem_limit: float, mem_slots: int = 500, dtype: torch.dtype = torch.float64) -> Schedule:
    """The fastest persistent schedule of ``chain`` whose memory stays within ``mem_limit`` (the chain's size unit,
    input x_0 included: rotor's budget), or :class:`InfeasibleBudget` (a ValueError) stating the smallest budget
    that works.

    Sizes are rounded up to multiples of ``mem_limit / mem_slots`` (rotor's discretization), so the plan is
    optimal within that resolution and never exceeds the limit. Returns a :class:`Schedule` with ``ops``,
    ``makespan`` and ``peak_memory`` (peak computed on the exact sizes). The tables are real tensors also when
    planning inside ``FakeTensorMode`` (a step sized without running it).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _solve(chain, mem_limit, mem_slots, dtype)


def _solve(chain: Chain, mem_limit: float, mem_slots: int, dtype: torch.dtype) -> Schedule:
    if not isinstance(chain, Chain):
        raise TypeError(f"solve: chain must be a revlib_xla.planner.Chain, not {type(chain).__name__}")
    if not (isinstance(mem_slots, int) and mem_slots >= 1):
        raise ValueError(f"solve: mem_slots must be a positive integer, got {mem_slots!r}")
    if not (isinstance(mem_limit, (int, float)) and math.isfinite(mem_limit) and mem_limit > 0):
        raise ValueError(f"solve: mem_limit must be a positive number, got {mem_limit!r}")
    for i, opts in enumerate(chain.options):
        for opt in opts:
            if opt.cbw < chain.cw[i + 1]:
                raise ValueError(
                    f"solve: option {opt.name!r} of stage {i} keeps {opt.cbw} < cw[{i + 1}] = "
                    f"{chain.cw[i + 1]}: what a stage keeps alive with autograd includes its output"
                )
    plain = _plain_ops(chain)
    plain_time, plain_peak = simulate(chain, plain)
    if mem_limit >= plain_peak and _plain_is_fastest(chain):
        # Exact: rounding sizes up could make the plain schedule miss a budget it fits.
        return Schedule(tuple(plain), plain_time, plain_peak, chain)
    slots = mem_slots
    tables, a, top = _table(chain, mem_limit / slots, slots, dtype)
    if tables is None:
        minimum = min_memory(chain)
        if mem_limit < minimum:
            raise InfeasibleBudget(
                f"no schedule of this {chain.length}-stage chain fits in {mem_limit:.6g}: the smallest budget any "
                f"schedule fits in is {minimum:.6g} (x_0 included); pass a larger mem_limit",
                minimum,
            )
        # The budget holds a plan, but not once every size is rounded up to mem_limit/mem_slots: sizes in whole
        # multiples of one grid (bytes are) fit exactly on it, if the table is not too large; else refine.
        finest = max(mem_slots, _MAX_TABLE // (chain.length + 1) ** 2)
        grid = _grid(chain)
        if grid is not None and mem_limit // grid <= finest:
            slots = int(mem_limit // grid)
            tables, a, top = _table(chain, grid, slots, dtype)
        while tables is None and slots < finest:
            slots = min(2 * slots, finest)
            if _least(_Arrays(chain, mem_limit / slots, _round_up)) <= slots:
                tables, a, top = _table(chain, mem_limit / slots, slots, dtype)
        if tables is None:
            unit = mem_limit / slots
            raise InfeasibleBudget(
                f"the smallest budget of this {chain.length}-stage chain is {minimum:.6g} (x_0 included) and "
                f"mem_limit is {mem_limit:.6g}, but the planner rounds every size up to a multiple of "
                f"mem_limit/slots ({unit:.6g} at {slots} slots, the finest it tries for this chain), and rounded "
                f"up the plan no longer fits: pass a mem_limit a little larger",
                minimum,
                unit,
            )
    ops = _rebuild(tables, a, top)
    time, peak = simulate(chain, ops)
    return Schedule(tuple(ops), time, peak, chain)


def _grid(chain: Chain) -> int | None:
    """The largest size every size of the chain is a whole multiple of, if they are all whole numbers."""
    sizes = [*chain.cw, *chain.cbw, *chain.fwd_tmp, *(chain.grad_fwd_tmp or ()), *chain.bwd_tmp]
    sizes += [v for opts in chain.options for o in opts for v in (o.cbw, o.fwd_tmp, o.bwd_tmp)]
    sizes += [v for c in chain.caches if c is not None for v in (c.bytes, c.cbw)]
    if not all(float(v).is_integer() for v in sizes):
        return None
    return math.gcd(*(int(v) for v in sizes)) or None


def _round_up(value: float) -> float:
    return float(math.ceil(value - 1e-9))


def _table(chain: Chain, unit: float, slots: int, dtype: torch.dtype) -> tuple[_Tables | None, _Arrays, int]:
    """The DP tables for ``slots`` slots of ``unit`` each (sizes rounded up to whole slots), or None when no
    schedule fits at that resolution."""
    a = _Arrays(chain, unit, _round_up)
    top = slots - int(a.cw[0])
    if top < 0:
        return None, a, top
    tables = _Tables(a, slots, dtype)
    return (tables if math.isfinite(tables.value(False, 0, a.n, top)) else None), a, top


def plan(chain: Chain, mem_limit: float, mem_slots: int = 500, held: float = 0.0) -> Schedule:
    """The planning step (a chain of costs in, a schedule out): :func:`solve` for a budget ``mem_limit`` of which
    ``held`` is taken by values outside the chain for the whole backward (a model's output and its gradient).
    :class:`InfeasibleBudget` says, in budgets that include ``held``, the smallest one that works."""
    if mem_limit <= held:
        raise InfeasibleBudget(
            f"Checkpointable: mem_limit {mem_limit:.6g} does not even hold the model's output and "
            f"its gradient ({held:.6g} bytes); pass a larger mem_limit",
            held + min_memory(chain),
        )
    try:
        return solve(chain, mem_limit - held, mem_slots)
    except InfeasibleBudget as exc:
        smallest = exc.minimum + held
        if exc.unit is None:
            why = f"the smallest budget for this model and input is {smallest:.6g} bytes"
        else:
            why = (
                f"it is above the smallest budget for this model and input ({smallest:.6g} bytes), but the "
                f"planner rounds sizes up to multiples of {exc.unit:.6g} bytes and the rounded plan does not "
                f"fit"
            )
        raise InfeasibleBudget(
            f"Checkpointable: no schedule fits in mem_limit {mem_limit:.6g} bytes: {why} "
            f"(budgets include {held:.6g} bytes for the output and its gradient); pass a "
            f"larger mem_limit",
            smallest,
            exc.unit,
        ) from None
