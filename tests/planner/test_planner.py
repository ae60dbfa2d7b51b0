"""The planner's solver: rotor's published values, optimality against exhaustive search, budgets, bad input."""

import math
import random

import numpy as np
import pytest
from planner_bruteforce import best, evaluate, neighbours, sample, schedules

from revlib_xla.planner import (
    Chain,
    InfeasibleBudget,
    Op,
    ScheduleError,
    StageCache,
    StageOption,
    min_memory,
    no_checkpoint_memory,
    simulate,
    solve,
)


def homogeneous(length=10):
    return Chain(
        [1] * length, [2] * length + [0], [1] * (length + 1), [1] + [3] * length, [0] * length, [0] * (length + 1)
    )


@pytest.mark.parametrize("budget, ops, makespan", [(7, 66, 75), (8, 41, 50), (9, 36, 45), (15, 28, 37)])
def test_rotor_homogeneous_chain(budget, ops, makespan):
    """rotor's own test values for a homogeneous chain of 10 stages."""
    schedule = solve(homogeneous(), budget, mem_slots=budget)
    assert len(schedule.ops) == ops
    assert schedule.makespan == makespan
    assert schedule.peak_memory <= budget
    assert simulate(schedule.chain, schedule.ops) == (schedule.makespan, schedule.peak_memory)


def test_rotor_schedule_and_minimum():
    schedule = solve(homogeneous(), 9, mem_slots=9)
    assert str(schedule).startswith("CF_0 Fn_1 Fn_2 Fn_3 CF_4 Fn_5 Fn_6 CF_7 Fn_8 Fe_9 L B_9")
    with pytest.raises(InfeasibleBudget) as info:
        solve(homogeneous(), 6, mem_slots=6)
    assert info.value.minimum == 7
    assert "smallest budget" in str(info.value) and "7" in str(info.value)
    assert isinstance(info.value, ValueError)
    # Plenty of memory: no recomputation at all, and exactly the plain schedule's peak.
    plain = no_checkpoint_memory(homogeneous())
    schedule = solve(homogeneous(), plain, mem_slots=int(plain))
    assert schedule.makespan == 30 and schedule.counts().get("Fn", 0) == 0
    assert schedule.peak_memory == plain


def random_chain(rng, length, extended=False, options=1, caches=False):
    cw = [rng.randint(1, 4) for _ in range(length + 1)]
    cbw = [0] + [cw[i] + rng.randint(0, 4) for i in range(1, length + 1)]
    kw = {}
    if extended:
        kw["reversible"] = [rng.random() < 0.5 for _ in range(length)]
        kw["inverse_time"] = [rng.randint(0, 3) for _ in range(length)]
        kw["offload_time"] = [rng.randint(1, 6) if rng.random() < 0.5 else None for _ in range(length)]
    if options > 1:
        kw["options"] = [
            [
                StageOption(
                    f"c{c}",
                    rng.randint(1, 6),
                    rng.randint(1, 9),
                    cbw[i + 1] - rng.randint(0, cbw[i + 1] - cw[i + 1]),
                    rng.randint(0, 2),
                    rng.randint(0, 2),
                )
                for c in range(1, options)
                if rng.random() < 0.7
            ]
            for i in range(length)
        ]
    fw = [rng.randint(1, 5) for _ in range(length)]
    bw = [rng.randint(1, 8) for _ in range(length + 1)]
    fwd_tmp = [rng.randint(0, 2) for _ in range(length)]
    bwd_tmp = [rng.randint(0, 2) for _ in range(length + 1)]
    # Recomputations that stop early (revlib_xla.planner.early_stop) skip up to the whole forward.
    kw["stopped_fw"] = [f - rng.randint(0, f) for f in fw]
    if caches:
        # Attention caches: a few bytes kept from the first run; later plain forwards skip up to all their time,
        # and keep up to the cache's size less (never less than their output).
        kw["caches"] = [
            StageCache(
                size,
                fw[i] - rng.randint(0, fw[i]),
                cbw[i + 1] - rng.randint(0, min(size, cbw[i + 1] - cw[i + 1])),
                rng.choice([None, 0, 1, 3]),
            )
            if rng.random() < 0.6
            else None
            for i, size in enumerate(rng.randint(1, 3) for _ in range(length))
        ]
    return Chain(fw, bw, cw, cbw, fwd_tmp, bwd_tmp, **kw)


def as_arrays(chains, options):
    """The chains in the brute force's batched layout."""
    n = chains[0].length
    keys = ("cw", "fw", "sfw", "ftmp", "ofw", "obw", "ocbw", "oftmp", "obtmp", "rev", "inv", "off")
    keys += ("ca", "cfw", "csfw", "ccbw", "cftmp", "cgftmp")
    out = {key: [] for key in keys}
    for chain in chains:
        out["cw"].append(list(chain.cw) + [0])
        out["fw"].append(list(chain.fw))
        out["sfw"].append(list(chain.stopped_fw))
        out["ftmp"].append(list(chain.fwd_tmp))
        table = {key: np.zeros((n + 1, options)) for key in ("ofw", "obw", "ocbw", "oftmp", "obtmp")}
        table["ofw"][:] = np.inf
        for i in range(n + 1):
            for c, opt in enumerate(chain.stage_options(i)):
                table["ofw"][i, c], table["obw"][i, c], table["ocbw"][i, c] = opt.fw, opt.bw, opt.cbw
                table["oftmp"][i, c], table["obtmp"][i, c] = opt.fwd_tmp, opt.bwd_tmp
        for key, value in table.items():
            out[key].append(value)
        out["rev"].append(list(chain.reversible))
        out["inv"].append(list(chain.inverse_time))
        out["off"].append([np.inf if t is None else t for t in chain.offload_time])
        out["ca"].append([0 if c is None else c.bytes for c in chain.caches])
        out["cfw"].append([f if c is None else c.fw for c, f in zip(chain.caches, chain.fw)])
        out["csfw"].append([chain.cached_stopped_fw(i) for i in range(n)])
        out["ccbw"].append([chain.cbw[i + 1] if c is None else c.cbw for i, c in enumerate(chain.caches)])
        out["cftmp"].append([chain.cached_fwd_tmp(i, grad=False) for i in range(n)])
        out["cgftmp"].append([chain.cached_fwd_tmp(i, grad=True) for i in range(n)])
    return {key: np.array(value, dtype=bool if key == "rev" else float) for key, value in out.items()}


def check_against_brute_force(chains, budgets, options=1, extended=False, caches=False):
    n = chains[0].length
    fastest, lowest = best(
        schedules(n, options, extended, caches), as_arrays(chains, options), np.array(budgets, float)
    )
    for chain, budget, want, least in zip(chains, budgets, fastest, lowest):
        assert min_memory(chain) == least, chain
        if math.isinf(want):
            with pytest.raises(InfeasibleBudget) as info:
                solve(chain, budget, mem_slots=budget)
            assert info.value.minimum == least
            continue
        schedule = solve(chain, budget, mem_slots=budget)
        assert schedule.makespan == want, (chain, budget, str(schedule))
        assert simulate(chain, schedule.ops) == (schedule.makespan, schedule.peak_memory)
        assert schedule.peak_memory <= budget


@pytest.mark.parametrize("length", range(1, 9))
@pytest.mark.slow
def test_optimal_against_exhaustive_search(length):
    """rotor's recurrence: 26 random chains per length 1..8 (208 chains), each at a budget between its minimum and
    its no-checkpoint peak (and some below the minimum), against every persistent schedule."""
    rng = random.Random(1000 + length)
    chains = [random_chain(rng, length) for _ in range(26)]
    budgets = []
    for chain in chains:
        low, high = int(min_memory(chain)), int(no_checkpoint_memory(chain))
        budgets.append(rng.randint(max(1, low - 2), high + 1))
    check_against_brute_force(chains, budgets)


@pytest.mark.parametrize("length", range(1, 5))
def test_optimal_with_reversible_offload_and_options(length):
    """The extended program (reversible stages, offloaded checkpoints, a second option per stage) against every
    persistent schedule that uses them: 25 random chains per length 1..4."""
    rng = random.Random(2000 + length)
    chains = [random_chain(rng, length, extended=True, options=2) for _ in range(25)]
    budgets = []
    for chain in chains:
        low, high = int(min_memory(chain)), int(no_checkpoint_memory(chain))
        budgets.append(rng.randint(max(1, low - 1), high + 1))
    check_against_brute_force(chains, budgets, options=2, extended=True)


@pytest.mark.parametrize("length", range(1, 5))
def test_optimal_when_the_forward_with_autograd_has_its_own_temporaries(length):
    """``grad_fwd_tmp``: a forward with autograd (``Fe``, ``Br``) keeps what a forward without it (``Fn``, ``CF``)
    frees as it goes, so its transient memory differs; the program charges each its own: 25 random chains per length
    1..4 against every persistent schedule."""
    rng = random.Random(3000 + length)
    chains = [
        random_chain(rng, length, extended=True).replace(
            fwd_tmp=[rng.randint(0, 5) for _ in range(length)], grad_fwd_tmp=[rng.randint(0, 2) for _ in range(length)]
        )
        for _ in range(25)
    ]
    budgets = []
    for chain in chains:
        low, high = int(min_memory(chain)), int(no_checkpoint_memory(chain))
        budgets.append(rng.randint(max(1, low - 1), high + 1))
    check_against_brute_force(chains, budgets, extended=True)


@pytest.mark.parametrize("length", range(1, 6))
def test_optimal_with_attention_caches(length):
    """Attention caches (``CA``, selective recomputation), with two options per stage and recomputations that stop
    early: 25 random chains per length 1..5 against every persistent schedule whose leaves start with ``CF`` or
    ``CA``, at budgets from below the smallest to above the plain schedule's peak."""
    rng = random.Random(4000 + length)
    chains = [random_chain(rng, length, options=2, caches=True) for _ in range(25)]
    budgets = []
    for chain in chains:
        low, high = int(min_memory(chain)), int(no_checkpoint_memory(chain))
        budgets.append(rng.randint(max(1, low - 1), high + 3))
    check_against_brute_force(chains, budgets, options=2, caches=True)


def test_a_cache_is_planned_where_it_pays_and_its_memory_is_charged():
    """A homogeneous chain whose stages can keep 1 unit of cache that halves their recomputation: the plan uses
    caches only with memory to spare, is never slower than without them, and simulate agrees with the plan."""
    n = 6
    chain = Chain([4] * n, [6] * n + [1], [1] * (n + 1), [1] + [5] * n, [0] * n, [0] * (n + 1))
    cached = chain.replace(caches=[StageCache(1, 2, 5)] * n)
    seen = []
    for budget in (9, 10, 12, 14, 20, 40):
        plain, fast = solve(chain, budget, mem_slots=budget), solve(cached, budget, mem_slots=budget)
        assert fast.makespan <= plain.makespan and fast.peak_memory <= budget
        assert simulate(cached, fast.ops) == (fast.makespan, fast.peak_memory)
        seen.append(fast.counts().get("CA", 0))
    assert seen[0] == 0  # the smallest budget has no room for a cache
    assert max(seen) >= 3
    assert seen[-1] == 0  # the plain schedule fits: nothing is recomputed, nothing cached
    # A cache the schedule keeps is charged: CA_0 ... B_0 holds one more unit than CF_0 ... B_0.
    ops = [Op("CF", 0), Op("Fe", 1), Op("L", 2), Op("B", 1), Op("Fe", 0), Op("B", 0)]
    two = Chain([4, 4], [6, 6, 1], [1, 1, 1], [1, 5, 5], [0, 0], [0, 0, 0], caches=[StageCache(1, 2, 4), None])
    t_cf, p_cf = simulate(two, ops)
    t_ca, p_ca = simulate(two, [Op("CA", 0)] + ops[1:])
    assert (t_cf - t_ca, p_ca - p_cf) == (2, 1)  # the Fe_0 reads the cache: 2 instead of 4; 1 unit kept
    with pytest.raises(ScheduleError, match="no attention cache"):
        simulate(two, [Op("CF", 0), Op("CA", 1)])


def test_grad_fwd_tmp_defaults_to_fwd_tmp():
    chain = homogeneous(3).replace(fwd_tmp=[6, 6, 6])
    assert chain.grad_fwd_tmp is None and chain.stage_options(1)[0].fwd_tmp == 6
    lighter = chain.replace(grad_fwd_tmp=[0, 1, 0])
    assert lighter.stage_options(1)[0].fwd_tmp == 1 and lighter.replace(fw=[2] * 3).grad_fwd_tmp == (0, 1, 0)
    assert no_checkpoint_memory(lighter) < no_checkpoint_memory(chain)
    with pytest.raises(ValueError, match="grad_fwd_tmp needs 3 entries"):
        chain.replace(grad_fwd_tmp=[0])


def test_extensions_lower_the_time():
    """Reversible stages need no stored inputs: at a tight budget the hybrid plan rebuilds inputs where rotor
    alone recomputes them from checkpoints, and is faster; at every budget it is at least as fast. Offloading a
    checkpoint buys time at a tight budget."""
    length = 12
    plain = Chain(
        [1] * length, [2] * length + [1], [4] * (length + 1), [0] + [8] * length, [1] * length, [1] * (length + 1)
    )
    rev = plain.replace(reversible=[True] * length)
    budget = int(min_memory(plain)) + 4
    rotor_only, hybrid = solve(plain, budget, mem_slots=budget), solve(rev, budget, mem_slots=budget)
    assert hybrid.makespan < rotor_only.makespan
    assert hybrid.counts()["Fr"] > 0 and hybrid.peak_memory <= budget
    for budget in range(int(min_memory(plain)), int(no_checkpoint_memory(plain)) + 1, 3):
        assert solve(rev, budget, mem_slots=budget).makespan <= solve(plain, budget, mem_slots=budget).makespan
    offload = plain.with_bandwidth(8.0)  # 0.5 time units per transfer
    budget = int(min_memory(plain)) + 2
    planned = solve(offload, budget, mem_slots=budget)
    assert planned.makespan < solve(plain, budget, mem_slots=budget).makespan and planned.counts()["WM"] > 0


@pytest.mark.slow
def test_discretization_stays_within_the_limit():
    rng = random.Random(7)
    for _ in range(8):
        chain = random_chain(rng, 30)
        chain = chain.replace(
            cw=[c * 1e6 + rng.randint(0, 999) for c in chain.cw],
            cbw=[c * 1e6 + 1000 for c in chain.cbw],
            fwd_tmp=[c * 1e6 for c in chain.fwd_tmp],
            bwd_tmp=[c * 1e6 for c in chain.bwd_tmp],
        )
        low, high = min_memory(chain), no_checkpoint_memory(chain)
        for frac in (0.2, 0.6, 1.0):
            limit = low * 1.05 + frac * (high - low)
            schedule = solve(chain, limit, mem_slots=200)
            assert schedule.peak_memory <= limit
            assert simulate(chain, schedule.ops)[1] == schedule.peak_memory


@pytest.mark.slow
def test_long_chain():
    chain = homogeneous(300)
    schedule = solve(chain, 9, mem_slots=9)
    assert schedule.counts()["B"] == 300 and schedule.peak_memory <= 9
    assert simulate(chain, schedule.ops) == (schedule.makespan, schedule.peak_memory)


def test_schedule_printout():
    schedule = solve(homogeneous().replace(reversible=[i % 2 == 0 for i in range(10)]), 9, mem_slots=9)
    text = schedule.describe()
    assert "makespan" in text and "reversible (input rebuilt)" in text and "ops: " in text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(fw=[1, 2], bw=[1, 1], cw=[1, 1, 1], cbw=[0, 1, 1], fwd_tmp=[0, 0], bwd_tmp=[0, 0, 0]), "bw needs 3"),
        (dict(fw=[1], bw=[1, 1], cw=[1, 1], cbw=[0, 1], fwd_tmp=[-1], bwd_tmp=[0, 0]), "fwd_tmp[0] = -1.0"),
        (dict(fw=[1], bw=[1, 1], cw=[1, 3], cbw=[0, 1], fwd_tmp=[0], bwd_tmp=[0, 0]), "cbw[1] = 1.0 < cw[1]"),
        (dict(fw=["a"], bw=[1, 1], cw=[1, 1], cbw=[0, 1], fwd_tmp=[0], bwd_tmp=[0, 0]), "fw[0] is 'a'"),
        (dict(fw=[], bw=[1], cw=[1], cbw=[0], fwd_tmp=[], bwd_tmp=[0]), "at least one stage"),
    ],
)
def test_chain_bad_input(kwargs, message):
    with pytest.raises((ValueError, TypeError)) as info:
        Chain(**kwargs)
    assert message in str(info.value)


def test_solve_bad_input_and_bad_schedules():
    with pytest.raises(ValueError, match="mem_limit must be a positive number"):
        solve(homogeneous(), -1)
    with pytest.raises(ValueError, match="mem_slots"):
        solve(homogeneous(), 10, mem_slots=0)
    with pytest.raises(TypeError, match="Chain"):
        solve([1, 2], 10)
    chain = homogeneous(2)
    with pytest.raises(ScheduleError, match="x_1 is not live"):
        simulate(chain, [Op("Fn", 1)])
    with pytest.raises(ScheduleError, match="not reversible"):
        simulate(chain, [Op("CF", 0), Op("Fr", 1)])
    with pytest.raises(ScheduleError, match="does not reach"):
        simulate(chain, [Op("Fe", 0)])


def _as_bruteforce(schedule):
    return tuple((op.kind, op.index, op.option) for op in schedule.ops)


@pytest.mark.parametrize("length", range(9, 13))
def test_optimal_against_sampled_schedules(length):
    """Chains too long for the exhaustive search (9..12 stages): each plan replays in the search's own simulation
    with the solver's time and within its budget, and no schedule drawn uniformly, nor any neighbour of the plan
    (one segment run another way: every way for short segments), is faster within the budget or needs less memory
    than min_memory. (Local: of 12 plans of rotor's program that are slower than the optimum, the neighbours of 2
    are faster, the differences being elsewhere global.)"""
    rng = random.Random(3000 + length)
    chains = [random_chain(rng, length) for _ in range(6)]
    budgets = [rng.randint(int(min_memory(c)), int(no_checkpoint_memory(c))) for c in chains]
    arrays = as_arrays(chains, 1)
    drawn = [sample(0, length, length, rng) for _ in range(150)]
    fastest, lowest = best(drawn, arrays, np.array(budgets, float))
    for k, (chain, budget) in enumerate(zip(chains, budgets)):
        plan = solve(chain, budget, mem_slots=budget)
        one = {key: value[k : k + 1] for key, value in arrays.items()}
        time, peak = evaluate(_as_bruteforce(plan), one)
        assert (time[0], peak[0]) == (plan.makespan, plan.peak_memory) and peak[0] <= budget
        assert plan.makespan <= fastest[k] and min_memory(chain) <= lowest[k]
        near, near_lowest = best(neighbours(_as_bruteforce(plan), length, 100, rng), one, np.array([budget], float))
        assert plan.makespan <= near[0] and min_memory(chain) <= near_lowest[0]


# Chains (10 stages, small integer costs) whose plans rotor's dynamic program (topal-team/rockmate,
# rotor/algorithms/persistent.py, force_python=True, the same Chain, memory slots = budget) makes slower: 109 and 104.
ROTOR_MISSES = [
    (
        dict(
            fw=[5, 3, 4, 4, 2, 3, 2, 2, 2, 3],
            bw=[6, 8, 7, 7, 7, 6, 8, 5, 5, 2, 4],
            cw=[3, 4, 2, 3, 1, 3, 4, 3, 1, 1, 2],
            cbw=[0, 5, 5, 7, 1, 3, 8, 6, 1, 1, 6],
            fwd_tmp=[1, 0, 1, 2, 0, 1, 1, 0, 1, 2],
            bwd_tmp=[0, 1, 1, 0, 0, 2, 0, 1, 0, 0, 1],
        ),
        33,
        107,
        "Fe_9 L",
    ),
    (
        dict(
            fw=[3, 3, 4, 5, 1, 4, 1, 2, 2, 3],
            bw=[6, 5, 5, 2, 2, 7, 8, 5, 2, 8, 8],
            cw=[1, 2, 2, 1, 1, 3, 3, 1, 2, 1, 4],
            cbw=[0, 3, 4, 3, 5, 6, 5, 1, 2, 4, 8],
            fwd_tmp=[1, 2, 2, 2, 1, 1, 2, 0, 0, 2],
            bwd_tmp=[1, 0, 2, 2, 0, 1, 2, 0, 0, 0, 1],
        ),
        26,
        103,
        "Fe_9 L",
    ),
]


@pytest.mark.parametrize("costs, budget, makespan, step", ROTOR_MISSES)
def test_plans_rotor_misses(costs, budget, makespan, step):
    """Plans faster than rotor's own dynamic program finds (109 and 104 there). rotor evaluates the chain step of
    segment [i, l] (Fe_i, then [i+1, l], then B_i) with the base case's memory condition, which counts the gradient
    of x_{i+1} as live while Fe_i runs; in the chain step the gradient live then is that of x_{l+1} (none before the
    loss). Both plans run Fe_9 just before the loss with too few slots left for rotor, which charges the gradient of
    x_10 that does not exist yet: charged as a temporary of that forward, the plan no longer fits. The plan replays
    in the exhaustive search's own memory simulation, independent of the solver: it runs, within the budget, in the
    solver's time."""
    chain = Chain(**costs)
    plan = solve(chain, budget, mem_slots=budget)
    assert plan.makespan == makespan and step in str(plan)
    time, peak = evaluate(_as_bruteforce(plan), as_arrays([chain], 1))
    assert (time[0], peak[0]) == (plan.makespan, plan.peak_memory) and peak[0] <= budget
    assert simulate(chain, plan.ops) == (plan.makespan, plan.peak_memory)
    as_rotor_counts = chain.replace(fwd_tmp=chain.fwd_tmp[:-1] + (chain.fwd_tmp[-1] + chain.cw[-1],))
    assert simulate(as_rotor_counts, plan.ops)[1] > budget


def test_plain_plan_when_the_budget_holds_it():
    """At the no-checkpoint budget the plain plan, exactly, at any resolution: rounding each size up to
    mem_limit/mem_slots once made a budget equal to both the smallest and the plain one infeasible. A faster option
    keeps the dynamic program in charge."""
    chain = Chain([1, 1, 1], [2, 2, 2, 0], [3, 6, 7, 1], [0, 6, 7, 3], [1, 0, 0], [0, 0, 1, 0])
    plain = no_checkpoint_memory(chain)
    assert min_memory(chain) == plain == 29
    for slots in (7, 29, 500):
        schedule = solve(chain, plain, mem_slots=slots)
        assert str(schedule) == "Fe_0 Fe_1 Fe_2 L B_2 B_1 B_0" and schedule.peak_memory == plain
    faster = chain.replace(options=[[StageOption("fast", 0.5, 1.0, 6)], [], []])
    assert solve(faster, plain, mem_slots=500).ops[0] == Op("Fe", 0, 1)


def test_budget_between_the_smallest_and_its_rounding():
    """A budget at least the smallest one that fails only because sizes are rounded up to mem_limit/mem_slots: on
    whole-number sizes (bytes) the solver plans on their common grid, exactly; otherwise it refines the slots, and
    where even the finest table it builds fails, the error says so and at which resolution, not that the budget is
    below the smallest one."""
    rng = random.Random(11)
    chain = random_chain(rng, 12)
    chain = chain.replace(
        cw=[c * 1000 + 8 for c in chain.cw],
        cbw=[c * 1000 + 8 for c in chain.cbw],
        fwd_tmp=[c * 1000 for c in chain.fwd_tmp],
        bwd_tmp=[c * 1000 for c in chain.bwd_tmp],
    )
    low = min_memory(chain)
    schedule = solve(chain, low, mem_slots=7)
    assert schedule.peak_memory == low
    assert simulate(chain, schedule.ops) == (schedule.makespan, schedule.peak_memory)
    fractional = chain.replace(cw=[c + 0.5 for c in chain.cw], cbw=[c + 0.5 for c in chain.cbw])
    low = min_memory(fractional)
    schedule = solve(fractional, low * 1.001, mem_slots=7)
    assert schedule.peak_memory <= low * 1.001
    with pytest.raises(
        InfeasibleBudget, match="smallest budget .* is .* and mem_limit is .* rounds every size up"
    ) as info:
        solve(fractional, low, mem_slots=7)
    assert info.value.minimum == low and 0 < info.value.unit < low / 1000
