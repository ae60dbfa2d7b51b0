"""The planner's parts on their own: the operation table, the pure planning step, sizing, the executor running a
given schedule, and the simulator and the executor agreeing on what each operation keeps, in bytes, measured."""

import dataclasses

import pytest
import torch
from conftest import SeededUnits, max_rel_err
from torch import nn

import revlib_xla as revlib
from revlib_xla._tree import tensor_leaves
from revlib_xla.memory import eager_peak
from revlib_xla.planner import (
    KINDS,
    OPERATIONS,
    Chain,
    InfeasibleBudget,
    Op,
    OpKind,
    Schedule,
    ScheduleExecutor,
    Simulation,
    Sizing,
    StageCache,
    ValueKind,
    fit_budget,
    measure_chain,
    min_memory,
    no_checkpoint_memory,
    plan,
    run_schedule,
    simulate,
    solve,
)
from revlib_xla.planner.execute import deferrable_stages
from revlib_xla.planner.measure import measure_stage


class Coupling(nn.Module):
    """An additive coupling on the two halves of the last dimension: a stage that can rebuild its input."""

    def __init__(self, width):
        super().__init__()
        self.f = nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width))

    def forward(self, x):
        a, b = x.chunk(2, -1)
        return torch.cat([a, b + self.f(a)], -1)

    def inverse(self, y):
        a, c = y.chunk(2, -1)
        return torch.cat([a, c - self.f(a)], -1)


def _model(width=8, pairs=3):
    torch.manual_seed(0)
    blocks = []
    for _ in range(pairs):
        blocks.append(
            revlib.atomic(nn.Sequential(nn.Linear(2 * width, 6 * width), nn.Tanh(), nn.Linear(6 * width, 2 * width)))
        )
        blocks.append(Coupling(width))
    return nn.Sequential(*blocks).double(), torch.randn(16, 2 * width, dtype=torch.float64)


def _priced(chain):
    """Times by position, the same on every machine (plans follow times)."""
    n = chain.length
    return chain.replace(
        fw=[1.0 + (i % 3) for i in range(n)], bw=[2.0 + (i % 3) for i in range(n)] + [1.0], inverse_time=[1.0] * n
    )


def _couplings(depth=6, width=8):
    torch.manual_seed(0)
    model = nn.Sequential(*[Coupling(width) for _ in range(depth)]).double()
    return model, torch.randn(16, 2 * width, dtype=torch.float64)


def _saved_by_graph(outputs):
    """The tensors autograd's graph behind ``outputs`` holds for its backward (every node's saved tensors)."""
    nodes, seen, saved = [t.grad_fn for t in outputs if t.grad_fn is not None], set(), []
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                saved += [t for t in (value if isinstance(value, tuple) else (value,)) if isinstance(t, torch.Tensor)]
        nodes += [next_node for next_node, _ in node.next_functions]
    return saved


def _held_bytes(run, parameters):
    """The bytes of the tensor storages the executor holds (each storage once; parameters not counted): stage
    inputs, what each stage run with autograd keeps (its output and what its graph saved), gradients."""
    tensors = [t for value in run.x.values() for t in tensor_leaves(value)]
    for _, out in run.xbar.values():
        tensors += tensor_leaves(out) + _saved_by_graph(tensor_leaves(out))
    tensors += [g for grads in run.grad.values() for g in grads if g is not None]
    tensors += [t for cache in run.caches.values() for t in cache.tensors()]
    skip = {p.untyped_storage().data_ptr() for p in parameters}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(size for ptr, size in storages.items() if ptr not in skip)


def _run_recorded(checkpointed, chain, schedule, x, monkeypatch):
    """One training step of ``checkpointed`` with ``schedule``, recording after each operation the values the
    executor holds (their keys) and their bytes, measured."""
    records = []
    parameters = list(checkpointed.parameters())
    for kind, row in OPERATIONS.items():

        def execute(executor, op, rule=row.execute):
            rule(executor, op)
            records.append((op, executor.live(), _held_bytes(executor, parameters)))

        monkeypatch.setitem(OPERATIONS, kind, dataclasses.replace(row, execute=execute))
    checkpointed.chain, checkpointed.sequence = chain, schedule
    # The executor itself: Checkpointable runs a schedule that recomputes nothing as autograd's plain run.
    run_schedule(checkpointed, schedule, x).backward(torch.randn(x.shape, dtype=x.dtype))
    monkeypatch.undo()
    return records


def test_simulator_and_executor_agree_for_every_operation_kind(monkeypatch):
    """For the schedules the solver makes over a range of budgets (with reversible stages, and with offloading, so
    that every operation kind runs), after every operation the executor holds exactly the values the cost model
    holds (x_i, x̄_i, gradients), and the bytes of the tensor storages it holds are the model's level."""
    model, x = _couplings()
    checkpointed = revlib.Checkpointable(model, reversible=True)
    measured = _priced(checkpointed.measure(x))
    n = measured.length
    seen, stopped_early = set(), set()
    for chain in (measured, measured.replace(offload_time=[None] + [0.6] * (n - 1))):
        low, high = min_memory(chain), no_checkpoint_memory(chain)
        for fraction in (0.0, 0.1, 1.0) if chain is measured else (0.0,):
            schedule = solve(chain, low + fraction * (high - low))
            seen |= set(schedule.counts())
            records = _run_recorded(checkpointed, chain, schedule, x, monkeypatch)
            assert [op for op, _, _ in records] == list(schedule.ops)
            sim = Simulation(chain)
            # Stages whose recomputation stops early (revlib_xla.planner.early_stop): Fe_i keeps nothing until B_i.
            deferred = deferrable_stages(schedule)
            stopped_early |= deferred
            for op, live, held in records:
                sim.step(op)
                modelled = {key for key in sim.live if key != (ValueKind.GRAD, n + 1)}
                level = sim.level
                if op.kind is OpKind.L:  # the output's gradient reaches the executor as its backward phase starts
                    modelled.discard((ValueKind.GRAD, n))
                    level -= chain.cw[n]
                if (ValueKind.GRAD, 0) in sim.live:  # the input needs no gradient: the executor computes none
                    level -= chain.cw[0]
                if op.kind is OpKind.FE and op.index in deferred and sim.loss_seen:
                    level -= chain.cbw[op.index + 1]
                assert live == modelled, (str(schedule), str(op))
                assert held == level, (str(schedule), str(op))
    assert seen == set(OpKind) - {OpKind.CA} and stopped_early  # caches: below, on a model with attention


def test_simulator_and_executor_agree_with_attention_caches(monkeypatch):
    """Blocks with fused attention, at budgets where the solver keeps attention caches (``CA``): after every
    operation the executor holds exactly the values the cost model holds, caches included, and their bytes."""
    from test_attention_cache import _model as attention_blocks

    model = attention_blocks(5, seed=2)
    x = torch.randn(2, 64, 16, dtype=torch.float64, requires_grad=True)
    checkpointed = revlib.Checkpointable(model)
    sized = checkpointed.measure(x)
    measured = _priced(sized)  # times by position; a cache halves a block's forward
    measured = measured.replace(
        caches=[StageCache(c.bytes, f / 2, c.cbw) for c, f in zip(sized.caches, measured.fw)]  # type: ignore[union-attr]
    )
    n = measured.length
    low, high = min_memory(measured), no_checkpoint_memory(measured)
    cached = 0
    for fraction in (0.1, 0.3, 0.5, 0.7):
        schedule = solve(measured, low + fraction * (high - low))
        cached += schedule.counts().get("CA", 0)
        records = _run_recorded(checkpointed, measured, schedule, x, monkeypatch)
        sim = Simulation(measured)
        deferred = deferrable_stages(schedule)
        for op, live, held in records:
            sim.step(op)
            modelled = {key for key in sim.live if key != (ValueKind.GRAD, n + 1)}
            level = sim.level
            if op.kind is OpKind.L:
                modelled.discard((ValueKind.GRAD, n))
                level -= measured.cw[n]
            if op.kind is OpKind.FE and op.index in deferred and sim.loss_seen:
                cache = measured.caches[op.index]
                level -= cache.cbw if sim.cached(op.index, op) and cache is not None else measured.cbw[op.index + 1]
            assert live == modelled, (str(schedule), str(op))
            assert held == level, (str(schedule), str(op))
    assert cached


def test_the_cost_model_prices_early_stopped_recomputations_where_the_executor_stops():
    """``Fe_i`` costs ``stopped_fw[i]`` where it is stage i's last recomputation right after a ``CF_i`` with x_i
    stored meanwhile (the executor's deferred runs), and ``fw[i]`` elsewhere: after an offload of x_i, after
    ``Fn_i``, or not followed by ``B_i``."""
    from revlib_xla.planner import early_stops
    from revlib_xla.planner.execute import deferred_runs

    chain = Chain(
        [4, 8, 16], [1, 2, 3, 0], [1, 1, 1, 1], [0, 2, 2, 2], [0, 0, 0], [0, 0, 0, 0], stopped_fw=[3, 5, 9]
    ).with_bandwidth(1.0, stages=[1])  # each transfer of x_1 costs 1
    ops = [Op(k, i) for k, i in [("CF", 0), ("CF", 1), ("WM", 1), ("Fn", 2), ("L", 3), ("RM", 1)]]
    ops += [Op(k, i) for k, i in [("Fe", 1), ("Fe", 2), ("B", 2), ("B", 1), ("Fe", 0), ("B", 0)]]
    assert early_stops(ops) == {10: 0}  # Fe_0 stops (its CF_0 at position 0); Fe_1 follows WM_1, Fe_2 an Fn_2
    schedule = Schedule(tuple(ops), *simulate(chain, ops), chain)
    assert deferred_runs(schedule) == {0: 0}
    forward = 4 + 8 + 16
    assert schedule.makespan == forward + 2 + (8 + 16) + (3 + 2 + 1) + 3
    # The same schedule with x_1 kept on the device: Fe_1 is still not stage 1's last run before its B_1.
    kept = [op for op in ops if op.kind not in (OpKind.WM, OpKind.RM)]
    assert early_stops(kept) == {8: 0}
    # Every stage checkpointed, HF's way: every recomputation stops.
    hf = [Op("CF", i) for i in range(3)] + [Op("L", 3)] + [op for i in (2, 1, 0) for op in (Op("Fe", i), Op("B", i))]
    assert sorted(early_stops(hf)) == [4, 6, 8]
    assert simulate(chain, hf)[0] == forward + (3 + 5 + 9) + (1 + 2 + 3)


def test_operation_kinds_are_an_enum_with_one_row_each():
    """Every kind has its row (time, cost-model rule, executor rule); kinds given as names map to the enum, and an
    unknown one is refused naming the kinds."""
    assert set(OPERATIONS) == set(OpKind) and all(OPERATIONS[k].kind is k for k in OpKind)
    assert KINDS == ("Fn", "CF", "Fe", "B", "L", "Fr", "Br", "WM", "RM", "CA")
    op = Op("Fe", 1, 1)
    assert op.kind is OpKind.FE and op == Op(OpKind.FE, 1, 1) and str(op) == "Fe_1[1]"
    with pytest.raises(ValueError, match="unknown kind 'Xx'; expected one of Fn, CF, Fe"):
        Op("Xx", 0)
    chain = Chain([1, 1, 1], [2, 2, 2, 0], [1, 1, 1, 1], [0, 3, 3, 3], [0, 0, 0], [0, 0, 0, 0])
    schedule = solve(chain, 7, mem_slots=7)
    counts = schedule.counts()
    assert counts["CF"] == counts[OpKind.CF] == 2 and str(schedule) == "CF_0 Fn_1 Fe_2 L B_2 CF_0 Fe_1 B_1 Fe_0 B_0"


def test_plan_is_the_pure_planning_step():
    """A chain of costs in, a schedule out, no model: the budget less what is held outside the chain goes to the
    solver; a budget below the smallest one names it, held bytes included."""
    chain = Chain([1] * 6, [2] * 6 + [0], [1] * 7, [1] + [3] * 6, [0] * 6, [0] * 7)
    planned = plan(chain, 12, mem_slots=10, held=2)
    assert planned.ops == solve(chain, 10, mem_slots=10).ops and planned.peak_memory <= 10
    with pytest.raises(InfeasibleBudget, match="smallest budget for this model and input is 9") as info:
        plan(chain, 8, mem_slots=8, held=2)
    assert info.value.minimum == min_memory(chain) + 2 == 9
    with pytest.raises(InfeasibleBudget, match="does not even hold the model's output"):
        plan(chain, 2, held=2)


def test_measure_chain_alone_gives_checkpointables_sizes():
    """Sizing on its own: the stages of a model measured into a chain, the same sizes Checkpointable measures."""
    model, x = _model(pairs=2)
    alone = measure_chain(revlib.flatten_sequential(model), x, sizing=Sizing(reversible=False))
    chain = revlib.Checkpointable(model, reversible=False).measure(x)
    for field in ("cw", "cbw", "fwd_tmp", "bwd_tmp", "reversible", "names"):
        assert getattr(alone.chain, field) == getattr(chain, field), field
    assert alone.chain.reversible == (False,) * 4 and not alone.lazy and len(alone.measurements) == 4
    assert alone.chain.cw[0] == x.numel() * 8 and alone.chain.cbw[1] > alone.chain.cw[1]


def test_measure_stage_tells_the_forward_with_autograd_apart():
    """The forward without autograd frees its intermediates as it goes (a 64 x 256 hidden layer and its tanh live
    at once, above the stage's output); with autograd tanh's output is kept (in cbw), and only the linear's output is
    transient there."""
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 8)).double()
    m, _ = measure_stage(stage, torch.randn(64, 8, dtype=torch.float64), repeats=1)
    hidden, out = 64 * 256 * 8, 64 * 8 * 8
    assert (m.fwd_tmp, m.grad_fwd_tmp) == (2 * hidden - out, hidden - out)
    chain = measure_chain([stage], torch.randn(64, 8, dtype=torch.float64)).chain
    assert chain.grad_fwd_tmp == (hidden - out,) and chain.stage_options(0)[0].fwd_tmp == hidden - out


def test_schedule_executor_runs_a_given_schedule():
    """Execution on its own: a schedule solved for a model's chain runs on the model and gives the plain model's
    gradients (float64, same dropout masks); a schedule for another chain, or one that cannot run, is refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    model = model.double()
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    chain = measure_chain(revlib.flatten_sequential(model), x).chain
    schedule = solve(chain, min_memory(chain))
    assert schedule.counts().get("Fn", 0) + schedule.counts().get("CF", 0) > 0
    executor = ScheduleExecutor(model, schedule)
    weights = torch.randn(5, 3, dtype=torch.float64)

    def grads(m):
        torch.manual_seed(1)
        m.zero_grad(set_to_none=True)
        x.grad = None
        (m(x) * weights).sum().backward()
        return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]

    for got, want in zip(grads(executor), grads(SeededUnits(revlib.flatten_sequential(model)))):
        assert max_rel_err(got, want) <= 1e-12
    with pytest.raises(ValueError, match="chain of 3 stages and the model has 6"):
        ScheduleExecutor(model, solve(Chain([1] * 3, [1] * 4, [1] * 4, [1] * 4, [0] * 3, [0] * 4), 100))
    bad = Schedule((Op("CF", 0), Op("Fn", 2), Op("L", 6)), 0.0, 0.0, chain)
    with pytest.raises(ValueError, match="ScheduleExecutor: the schedule cannot run on its chain: Fn_2: x_2 is not"):
        ScheduleExecutor(model, bad)


def test_fit_budget_bisects_for_the_compiled_peak():
    """The budget search of fit_to_tpu on its own, with a stand-in for the compiler: the largest probed budget
    whose compiled peak fits, the fastest end when it fits, and a clear error when even the smallest does not."""
    chain = Chain([1] * 4, [2] * 4 + [0], [1] * 5, [1] + [3] * 4, [0] * 4, [0] * 5)
    probed = []

    def compiled_peak(budget):
        probed.append(budget)
        return solve(chain, budget), int(100 * budget)

    budget, schedule, peak = fit_budget(compiled_peak, 7.0, 15.0, 1000, probes=4)
    assert (budget, peak) == (10.0, 1000) and probed == [15.0, 7.0, 11.0, 9.0, 10.0, 10.5]
    assert schedule.ops == solve(chain, 10.0).ops
    assert fit_budget(compiled_peak, 7.0, 15.0, 1500)[0] == 15.0
    with pytest.raises(InfeasibleBudget, match="even the smallest plan needs 700 bytes of TPU v5e HBM"):
        fit_budget(compiled_peak, 7.0, 15.0, 600)


def test_stage_programs_finds_its_barrier_beside_fewbits_own():
    """A stage whose layers hold optimization barriers of their own (FewBit's, in the forward): the backward
    program's gradient argument is taken from the barrier over the stage's output, not from the first barrier
    (regression: plan + fewbit on XLA failed with 'barrier operands [None, None, None]')."""
    from revlib_xla import backends
    from revlib_xla.compiled.liveness import all_optimization_barrier_arguments
    from revlib_xla.fewbit.modules import SiLU as FewBitSiLU
    from revlib_xla.fit import stablehlo_arguments
    from revlib_xla.planner.measure import stage_programs

    if not backends.xla_available():
        pytest.skip("torch_xla is not installed")
    dev = backends.device_for("xla")
    stage = nn.Sequential(nn.Linear(16, 32), FewBitSiLU(bits=2), nn.Linear(32, 16)).to(dev)
    programs = stage_programs(stage, torch.randn(4, 16).to(dev))
    barriers = all_optimization_barrier_arguments(programs.backward)
    assert len(barriers) >= 2 and barriers[0] != barriers[-1]  # FewBit's comes first
    [gradient] = programs.gradient_arguments
    assert stablehlo_arguments(programs.backward)[gradient][:2] == ((4, 16), "f32")
    assert (programs.output_count, programs.input_gradient_count) == (1, 1)


class _WideThenNarrow(nn.Module):
    """Two residual MLP blocks, the first twice as wide: the backward runs the narrow block first and peaks in the
    wide one, after autograd has freed what the narrow one saved."""

    def __init__(self, d: int, w: int) -> None:
        super().__init__()
        self.wide = nn.Sequential(nn.Linear(d, 2 * w), nn.Tanh(), nn.Linear(2 * w, d))
        self.narrow = nn.Sequential(nn.Linear(d, w), nn.Tanh(), nn.Linear(w, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.wide(x)
        return x + self.narrow(x)


def test_planned_peak_is_what_the_step_holds():
    """The cost model's peak of a schedule is the measured peak of its run (parameters and gradients aside), not
    above it by what a stage's backward has already freed: ``bwd_tmp`` is measured with autograd freeing each node's
    saved tensors as it goes and the stage's output freed before its backward, as the executor runs it (measured
    with the saved tensors kept, the planner charged the narrow block's tanh activations, 128 KiB, to every
    backward here)."""
    torch.manual_seed(0)
    width, rows = 256, 64
    model = nn.Sequential(*[_WideThenNarrow(8, width) for _ in range(3)]).double()
    x = torch.randn(rows, 8, dtype=torch.float64, requires_grad=True)

    def step(m: nn.Module, inp: torch.Tensor) -> None:
        m(inp).sum().backward()

    planned = revlib.Checkpointable(model, reversible=False)
    planned.measure(x)
    for budget in (planned.min_memory(), planned.no_checkpoint_memory()):
        planned.compute_sequence(budget)
        step(planned, x)  # gradients exist, as in training
        peak = eager_peak(step, planned, x, zero_grad=False)
        measured = peak.total - peak.parameters - peak.gradients
        predicted = planned.get_expected_memory()
        # within a quarter of one 64 x 256 activation (the seed gradient of the output, a few KiB, is not modelled)
        assert 0 <= predicted - measured <= rows * width * 8 / 4, (budget, predicted, measured)
