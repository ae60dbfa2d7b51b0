"""Checkpointable: planned schedules run, give the plain model's gradients, and stay within their budget."""

import collections
import copy
import dataclasses
import importlib.util

import pytest
import torch
from conftest import SeededUnits, max_rel_err
from torch import nn

import revlib_xla as revlib
from revlib_xla import atomic, backends
from revlib_xla.memory import eager_peak
from revlib_xla.models import TransformerConfig, gpt, resnet18
from revlib_xla.planner import Chain, InfeasibleBudget, min_memory, no_checkpoint_memory, solve

BUDGET_FRACTIONS = (0.02, 0.3, 0.6, 1.0)  # of the way from the smallest budget to the no-checkpoint peak


def small_resnet():
    torch.manual_seed(0)
    stages = list(resnet18(num_classes=10, width=8).double())
    # A dropout stage in the middle: recomputations must draw the forward's mask.
    return nn.Sequential(*stages[:6], nn.Dropout(0.2), *stages[6:]), torch.randn(4, 3, 32, 32, dtype=torch.float64)


def small_gpt(reversible=False, depth=3):
    torch.manual_seed(0)
    config = TransformerConfig(width=32, depth=depth, heads=4, seq_len=16, dropout=0.1, vocab_size=64)
    return gpt(config, reversible=reversible).double(), torch.randint(0, 64, (2, 16))


def gradients(model, step, x):
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    step(model, x)
    return [p.grad.clone() for p in model.parameters()]


def activation_peak(step, module, x):
    """Eager peak of a step minus parameters, gradients, optimizer state and buffers: what rotor's budget counts."""
    peak = eager_peak(step, module, x, zero_grad=False)
    return peak.total - peak.parameters - peak.gradients - peak.optimizer - peak.buffers


@pytest.mark.parametrize("build", [small_resnet, small_gpt], ids=["resnet18", "gpt"])
@pytest.mark.slow
def test_schedules_match_plain_gradients_within_budget(build):
    model, x = build()
    out_shape = model(x).shape
    weights = torch.randn(out_shape, dtype=torch.float64)

    def step(m, inp):
        (m(inp) * weights).sum().backward()

    checkpointed = revlib.Checkpointable(model)
    reference = gradients(SeededUnits(checkpointed.stages), step, x)  # the plain model, with the same masks
    checkpointed.measure(x)
    low, high = checkpointed.min_memory(), checkpointed.no_checkpoint_memory()
    recomputed = []
    for fraction in BUDGET_FRACTIONS:
        budget = low + fraction * (high - low)
        schedule = checkpointed.compute_sequence(budget)
        assert checkpointed.get_expected_memory() <= budget
        got = gradients(checkpointed, step, x)
        for g, r in zip(got, reference):
            assert max_rel_err(g, r) <= 1e-10
        step(checkpointed, x)  # gradients exist, as in training: the measured peak counts no new gradient
        assert activation_peak(step, checkpointed, x) <= 1.05 * budget, (fraction, schedule.describe())
        recomputed.append(schedule.counts().get("Fn", 0) + schedule.counts().get("CF", 0))
    assert recomputed[0] > recomputed[-1]  # a tighter budget recomputes more


def _priced_by_parameters(checkpointed, measured: Chain) -> Chain:
    """``measured`` with each stage's times replaced by its parameter count (backward twice the forward, an inversion
    one forward): plans follow times, which a loaded machine skews, so tests that assert a plan's shape price stages
    the same way everywhere. Sizes stay measured."""
    work = [1.0 + sum(p.numel() for p in stage.parameters()) / 1e3 for stage in checkpointed.model]
    return measured.replace(fw=work, bw=[2 * w for w in work] + [1.0], inverse_time=work)


@pytest.mark.slow
def test_hybrid_plan_is_faster_and_exact():
    """A transformer whose blocks are reversible: at a budget where rotor alone must recompute a lot, the plan
    that may also rebuild inputs from outputs is faster, and the step gives the plain gradients."""
    model, x = small_gpt(reversible=True, depth=4)
    weights = torch.randn(model(x).shape, dtype=torch.float64)

    def step(m, inp):
        (m(inp) * weights).sum().backward()

    checkpointed = revlib.Checkpointable(model)
    reference = gradients(SeededUnits(checkpointed.stages), step, x)
    chain = _priced_by_parameters(checkpointed, checkpointed.measure(x))
    assert sum(chain.reversible) == 8
    rotor_chain = chain.replace(reversible=[False] * chain.length)
    budget = 1.1 * min_memory(rotor_chain)
    rotor_only = solve(rotor_chain, budget)
    hybrid = solve(chain, budget)
    checkpointed.sequence = hybrid
    assert hybrid.makespan < rotor_only.makespan
    assert hybrid.counts().get("Br", 0) > 0
    for g, r in zip(gradients(checkpointed, step, x), reference):
        assert max_rel_err(g, r) <= 1e-10


@pytest.mark.slow
def test_rebuilt_inputs_run_at_every_budget():
    """Plans with rebuilt inputs (Fr/Br), as `Checkpointable(reversible=True)` makes them on a deeper reversible
    decoder at budgets from 20 % of the no-checkpoint peak up, run and give the plain gradients (a Br once read the
    output it rebuilds from after dropping it)."""
    model, x = small_gpt(reversible=True, depth=8)
    weights = torch.randn(model(x).shape, dtype=torch.float64)

    def step(m, inp):
        (m(inp) * weights).sum().backward()

    checkpointed = revlib.Checkpointable(model, reversible=True)
    reference = gradients(SeededUnits(checkpointed.stages), step, x)  # the plain model, with the same masks
    checkpointed.chain = _priced_by_parameters(checkpointed, checkpointed.measure(x))
    high = checkpointed.no_checkpoint_memory()
    rebuilt = 0
    for fraction in (0.2, 0.3, 0.6, 1.0):
        schedule = checkpointed.compute_sequence(max(fraction * high, 1.02 * checkpointed.min_memory()))
        rebuilt += schedule.counts().get("Br", 0)
        for g, r in zip(gradients(checkpointed, step, x), reference):
            assert max_rel_err(g, r) <= 1e-10, (fraction, schedule.describe())
    assert rebuilt > 0


def test_tuple_io_and_input_gradient():
    torch.manual_seed(0)

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8).double()

        def forward(self, pair):
            a, b = pair
            return torch.tanh(self.lin(a)) + b, a * b

    model = nn.Sequential(Pair(), Pair(), Pair(), nn.Sequential(Pair(), Pair()))
    a = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    plain = model((a, b))
    (plain[0].sum() + plain[1].square().sum()).backward()
    want = [a.grad.clone(), b.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    a.grad = b.grad = None
    model.zero_grad(set_to_none=True)
    checkpointed = revlib.Checkpointable(model, input=(a, b))
    assert len(checkpointed.stages) == 5
    checkpointed.compute_sequence(checkpointed.min_memory() * 1.05)  # sizes round up to mem_limit/mem_slots
    out = checkpointed((a, b))
    assert isinstance(out, tuple) and len(out) == 2
    (out[0].sum() + out[1].square().sum()).backward()
    got = [a.grad, b.grad] + [p.grad for p in model.parameters()]
    for g, w in zip(got, want):
        assert max_rel_err(g, w) <= 1e-12


@pytest.mark.parametrize("fraction", [0.0, 0.3])
def test_recomputing_schedules_give_plain_autograds_gradients(fraction):
    """Fast, in CI: an 8-stage float64 MLP whose planned schedules recompute (asserted, so the schedule executor runs
    them: a schedule that recomputes nothing runs as plain autograd) gives the input's and every parameter's
    gradient of plain autograd within 1e-12. A gradient 0.1 % wrong anywhere in the executor (those it receives from
    the loss, passes between stages or hands back) fails here."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)) for _ in range(8)]).double()
    x = torch.randn(16, 32, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(16, 32, dtype=torch.float64)
    (model(x) * weights).sum().backward()
    want = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad(set_to_none=True)
    checkpointed = revlib.Checkpointable(model, input=x)
    low, high = checkpointed.min_memory() * 1.02, checkpointed.no_checkpoint_memory()
    schedule = checkpointed.compute_sequence(low + fraction * (high - low))
    counts = schedule.counts()
    assert counts.get("Fn", 0) + counts.get("CF", 0) > 0, schedule.describe()
    (checkpointed(x) * weights).sum().backward()
    got = [x.grad] + [p.grad for p in model.parameters()]
    assert all(g is not None for g in got)
    for g, w in zip(got, want):
        assert max_rel_err(g, w) <= 1e-12


@pytest.mark.slow
def test_parameters_get_gradients_without_input_grad_and_eval_is_plain():
    model, x = small_resnet()
    checkpointed = revlib.Checkpointable(model, input=x, mem_limit=None)
    out = checkpointed(x)
    assert out.requires_grad
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    checkpointed.eval()
    model.eval()
    assert torch.equal(checkpointed(x), model(x))


@pytest.mark.slow
def test_running_statistics_are_updated_once():
    model, x = small_resnet()
    reference = [b.clone() for b in model.buffers()]
    plain_state = {k: v.clone() for k, v in model.state_dict().items()}
    checkpointed = revlib.Checkpointable(model, input=x)
    plain = SeededUnits(checkpointed.stages)  # the plain model, with the masks Checkpointable draws
    for b, r in zip(model.buffers(), reference):
        assert torch.equal(b, r)  # measuring did not move them
    checkpointed.compute_sequence(checkpointed.min_memory() * 1.05)
    torch.manual_seed(3)
    checkpointed(x).sum().backward()
    after = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(plain_state)
    torch.manual_seed(3)
    plain(x).sum().backward()
    for key, value in model.state_dict().items():
        assert torch.allclose(after[key].double(), value.double(), rtol=1e-12, atol=0), key


@pytest.mark.slow
def test_bad_input():
    with pytest.raises(TypeError, match="needs an nn.Sequential.*nn.Sequential\\(stage_0"):
        revlib.Checkpointable(nn.Linear(3, 3))

    class Scale(nn.Module):
        def forward(self, x):
            return x.mul_(2)

    with pytest.raises(ValueError, match="stage 1 \\(Scale\\) modifies its input in place"):
        revlib.Checkpointable(nn.Sequential(nn.Linear(4, 4), Scale(), nn.Linear(4, 4)), input=torch.randn(2, 4))
    model, x = small_resnet()
    checkpointed = revlib.Checkpointable(model, input=x)
    with pytest.raises(InfeasibleBudget, match="smallest budget") as info:
        checkpointed.compute_sequence(checkpointed.min_memory() / 2)
    assert info.value.minimum == checkpointed.min_memory()
    with pytest.raises(ValueError, match="options given for stage 99"):
        revlib.Checkpointable(model, options={99: []})
    assert checkpointed.measurements[0].cw == x.numel() * x.element_size()
    checkpointed(x[:2].clone()).sum().backward()  # a smaller batch runs the plan made for x
    assert checkpointed.measurements[0].cw == x.numel() * x.element_size()
    checkpointed(torch.cat([x, x])).sum().backward()  # a larger one is measured
    assert checkpointed.measurements[0].cw == 2 * x.numel() * x.element_size()


def test_each_input_shape_keeps_its_plan_and_smaller_ones_reuse_a_larger_ones():
    """A padding collator's batches: lengths 24, 8, 16, 24, 32, 8, 20. The model is measured for 24 and for 32 (larger
    than any before) only; 8, 16 and 20 run a plan made for a length that covers them, and every step's gradients
    equal the plain model's (float64) with a schedule that recomputes (a budget below no recomputation's)."""
    torch.manual_seed(0)
    width = 16
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), nn.Tanh(), nn.Linear(4 * width, width))
                            for _ in range(6)]).double()  # fmt: skip
    ref = copy.deepcopy(model)
    cp = revlib.Checkpointable(model)
    measured = []
    original = cp.measure

    def measure(sample):
        measured.append(tuple(sample.shape))
        chain = original(sample)
        cp.mem_limit = (cp.min_memory() + cp.no_checkpoint_memory()) / 2  # recomputes at every measured shape
        return chain

    cp.measure = measure
    for length in (24, 8, 16, 24, 32, 8, 20):
        x = torch.randn(2, length, width, dtype=torch.float64)
        for m in (cp, ref):
            m.zero_grad(set_to_none=True)
            m(x).square().sum().backward()
        assert any(op.kind.name == "FN" for op in cp.sequence.ops) or sum(
            1 for op in cp.sequence.ops if op.kind.name.startswith("F")
        ) > len(cp.stages), cp.sequence.describe()
        for p, q in zip(cp.parameters(), ref.parameters()):
            assert max_rel_err(p.grad, q.grad) <= 1e-12
    assert measured == [(2, 24, width), (2, 32, width)]


def test_inplace_relu_is_merged():
    stages = revlib.flatten_sequential(resnet18(width=8))
    assert not any(isinstance(s, nn.ReLU) for s in stages)  # the stem's ReLU(inplace=True) joined the batch norm
    assert isinstance(stages[1], nn.Sequential) and isinstance(stages[1][1], nn.ReLU)


@pytest.mark.slow
def test_xla_schedule_compiles_once_keeps_recomputation_and_matches_cpu():
    """On XLA (PJRT CPU): stage costs come from FLOP counts, the schedule runs in the one compiled training step,
    later steps compile nothing, recomputations sit behind optimization barriers, gradients equal the plain model."""
    if not backends.xla_available():
        pytest.skip("torch_xla is not installed (pip install 'revlib_xla[xla]')")
    import torch_xla.debug.metrics as metrics

    device = backends.device_for("xla")
    torch.manual_seed(0)
    model = gpt(TransformerConfig(width=32, depth=2, heads=4, seq_len=16, dropout=0.0, vocab_size=64))
    x, weights = torch.randint(0, 64, (2, 16)), torch.randn(2, 16, 64)
    model.zero_grad()
    (model(x) * weights).sum().backward()
    reference = [p.grad.clone() for p in model.parameters()]
    on_xla = copy.deepcopy(model).to(device)
    checkpointed = revlib.Checkpointable(on_xla, input=x.to(device))
    schedule = checkpointed.compute_sequence(checkpointed.min_memory() * 1.1)
    assert schedule.counts().get("Fn", 0) + schedule.counts().get("CF", 0) > 0
    compiles = []
    for step in range(3):
        for p in on_xla.parameters():
            p.grad = None
        (checkpointed(x.to(device)) * weights.to(device)).sum().backward()
        if step == 0:
            text = backends.lazy_stablehlo([p.grad for p in on_xla.parameters()])
            loss = next(k for k, op in enumerate(schedule.ops) if op.kind == "L")
            recomputations = sum(op.kind in ("Fn", "CF", "Fe") for op in schedule.ops[loss:])
            assert recomputations > 0 and text.count("optimization_barrier") >= recomputations
        backends.sync(device)
        compiles.append(metrics.metric_data("CompileTime")[0])
    assert compiles[1] == compiles[2]
    for p, r in zip(on_xla.parameters(), reference):
        assert max_rel_err(p.grad, r) <= 1e-5


@pytest.mark.parametrize("name, blocks", [("resnet18", 8), ("resnet50", 16), ("resnet101", 33)])
def test_model_zoo_is_sequential(name, blocks):
    import revlib_xla.models as zoo

    model = getattr(zoo, name)(num_classes=7, width=4)
    stages = revlib.flatten_sequential(model)
    assert len(stages) == blocks + 6  # conv, bn+relu, maxpool, blocks, pool, flatten, fc
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_cuda_peak_within_budget():
    """On a GPU: the allocator's peak (max_memory_allocated above what the step starts with) stays within the
    budget + 5 %, and the gradients equal the plain model's."""
    if not backends.cuda_available():
        pytest.skip("no CUDA GPU on this machine")
    device = backends.device_for("cuda")
    model, x = small_gpt(depth=4)
    model, x = model.to(device), x.to(device)
    weights = torch.randn(model(x).shape, dtype=torch.float64, device=device)

    def step(m, inp):
        (m(inp) * weights).sum().backward()

    checkpointed = revlib.Checkpointable(model, input=x)
    reference = gradients(SeededUnits(checkpointed.stages), step, x)  # the plain model, with the same masks
    for fraction in BUDGET_FRACTIONS:
        budget = checkpointed.min_memory() + fraction * (
            checkpointed.no_checkpoint_memory() - checkpointed.min_memory()
        )
        checkpointed.compute_sequence(budget)
        step(checkpointed, x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        for g, r in zip(gradients(checkpointed, step, x), reference):
            assert max_rel_err(g, r) <= 1e-10
        peak = torch.cuda.max_memory_allocated(device) - start
        assert peak <= 1.05 * budget + sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.slow
def test_stage_options_are_planned_and_run():
    """Stages may offer other ways to run with autograd; here every stage may store what it saves in float32 (the
    model is float64): the planner measures the options (half the saved bytes), uses them where memory is tight,
    and the executor runs them. The gradients differ from the plain ones only by float32 rounding of saved
    activations."""
    model, x = small_gpt(depth=3)
    weights = torch.randn(model(x).shape, dtype=torch.float64)

    def step(m, inp):
        (m(inp) * weights).sum().backward()

    checkpointed = revlib.Checkpointable(model, saved_dtypes=(torch.float32,))
    reference = gradients(SeededUnits(checkpointed.stages), step, x)  # the plain model, with the same masks
    chain = checkpointed.measure(x)
    for i in range(1, 7):  # the residual blocks: their floating saved tensors halve (bool dropout masks do not;
        option = chain.options[i][0]  # the output is kept at full size)
        assert option.name == "saved as float32"
        saved, plain_saved = option.cbw - chain.cw[i + 1], chain.cbw[i + 1] - chain.cw[i + 1]
        assert plain_saved / 2 <= saved <= 0.6 * plain_saved
    # Measured sizes, but times fixed (forward 1, backward 2, the option a little slower), so that which plan
    # wins does not depend on this machine's timing noise.
    n = chain.length
    chain = chain.replace(
        fw=[1.0] * n,
        bw=[2.0] * n + [0.0],
        inverse_time=[1.0] * n,
        options=[tuple(dataclasses.replace(o, fw=1.1, bw=2.1) for o in opts) for opts in chain.options],
    )
    plain_chain = chain.replace(options=[()] * chain.length)
    low, high = min_memory(plain_chain), no_checkpoint_memory(plain_chain)
    chosen = []
    for k in range(1, 20):
        budget = low + k / 20 * (high - low)
        with_options = solve(chain, budget)
        assert with_options.makespan <= solve(plain_chain, budget).makespan
        if any(op.option for op in with_options.ops):
            chosen.append(with_options)
    assert chosen
    checkpointed.sequence = chosen[0]
    for g, r in zip(gradients(checkpointed, step, x), reference):
        assert max_rel_err(g, r) <= 1e-6


@pytest.mark.slow
def test_fit_to_tpu_finds_a_plan_that_the_tpu_compiler_fits():
    """Planning for a TPU without one: the schedule chosen for an HBM limit compiles (deviceless, TPU v5e) to a
    step within the limit and is at least as fast as the smallest plan; a limit that no probe fits is refused.

    (On this model the compiled step of the smallest plan holds more HBM than the no-checkpoint step: the compiled
    peak is not monotone in the planner's budget, which is why the search compiles.)"""
    if not backends.xla_available() or importlib.util.find_spec("libtpu") is None:
        pytest.skip("needs torch_xla and libtpu (pip install 'revlib_xla[xla,tpu-compile]')")
    from revlib_xla import memory

    device = backends.device_for("xla")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 512), nn.Tanh(), nn.Linear(512, 128)) for _ in range(6)])
    model = model.to(device)
    x = torch.randn(512, 128).to(device)
    checkpointed = revlib.Checkpointable(model, input=x)

    def compiled(budget):
        schedule = checkpointed.compute_sequence(budget)
        text = memory.step_stablehlo(lambda m, inp: checkpointed(inp).sum().backward(), model, x)
        return schedule, memory.tpu_memory(text, "v5e").hbm_peak_bytes

    smallest_plan, smallest = compiled(checkpointed.min_memory() * 1.02)
    _, largest = compiled(checkpointed.no_checkpoint_memory())
    limit = (smallest + largest) / 2
    schedule = checkpointed.fit_to_tpu(limit, probes=3)
    assert checkpointed.tpu_hbm_bytes <= limit
    text = memory.step_stablehlo(lambda m, inp: checkpointed(inp).sum().backward(), model, x)
    assert memory.tpu_memory(text, "v5e").hbm_peak_bytes == checkpointed.tpu_hbm_bytes
    assert schedule.makespan <= smallest_plan.makespan
    with pytest.raises(InfeasibleBudget, match="even the smallest plan needs"):
        checkpointed.fit_to_tpu(min(smallest, largest) / 2, probes=1)


class _ResidualBlock(nn.Module):
    def __init__(self, width=128, hidden=512):
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


@pytest.mark.slow
def test_planned_peak_tracks_what_the_tpu_compiler_keeps():
    """The plan's activation peak is what the compiled step keeps: a residual MLP planned on XLA at six budgets from
    the smallest to the no-checkpoint peak, each step compiled deviceless for TPU v5e (every buffer in HBM) and its
    live values measured over the compiler's buffer assignment; the two agree within 15 % at every budget, the
    smallest included (rotor's quadratic schedule, whose recomputations from the model's input the compiler used to
    move to the start of the step: 1.33x)."""
    if not backends.xla_available() or importlib.util.find_spec("libtpu") is None:
        pytest.skip("needs torch_xla and libtpu (pip install 'revlib_xla[xla,tpu-compile]')")
    device = backends.device_for("xla")
    torch.manual_seed(0)
    model = nn.Sequential(*[_ResidualBlock() for _ in range(6)]).to(device)
    x = torch.randn(1024, 128).to(device)
    checkpointed = revlib.Checkpointable(model, input=x)
    low, high = checkpointed.min_memory() * 1.02, checkpointed.no_checkpoint_memory()
    planned, compiled = [], []
    for fraction in (0.0, 0.15, 0.3, 0.5, 0.75, 1.0):
        checkpointed.compute_sequence(low + fraction * (high - low))
        planned.append(checkpointed.get_expected_memory())
        compiled.append(checkpointed.tpu_activation_memory())
    assert len(set(planned)) >= 5, planned
    ratios = [c / p for c, p in zip(compiled, planned)]
    assert sum(abs(r - 1) <= 0.15 for r in ratios) >= 5, list(zip(planned, compiled))
    assert all(abs(r - 1) <= 0.15 for r in ratios), list(zip(planned, compiled))


# -- real use: containers, autograd's other entry points, frozen stages, budgets given as text ---------------------
Pair = collections.namedtuple("Pair", "a b")
CONTAINERS = {
    "dict": lambda a, b: {"a": a, "b": b},
    "list": lambda a, b: [a, b],
    "tuple": lambda a, b: (a, b),
    "namedtuple": Pair,
}


def _halves(x):
    return (x["a"], x["b"]) if isinstance(x, dict) else (x[0], x[1])


class Mix(nn.Module):
    """A stage taking and returning two tensors in one container of the given kind."""

    def __init__(self, kind):
        super().__init__()
        self.pack = CONTAINERS[kind]
        self.lin = nn.Linear(8, 8).double()

    def forward(self, x):
        a, b = _halves(x)
        return self.pack(torch.tanh(self.lin(a)) + b, a * b)


def _tight(checkpointed):
    """The smallest budget's plan (sizes round up to mem_limit/mem_slots, hence the margin), which recomputes. Where
    the measured sizes make it the plain plan (XLA's compiled sizes of a tiny model), the one planned for the same
    stages with unit sizes."""
    schedule = checkpointed.compute_sequence(checkpointed.min_memory() * 1.05)
    if schedule.counts().get("Fn", 0) + schedule.counts().get("CF", 0) == 0:
        n = checkpointed.chain.length
        unit = checkpointed.chain.replace(cw=[1] * (n + 1), cbw=[0] + [3] * n, fwd_tmp=[0] * n, bwd_tmp=[0] * (n + 1))
        schedule = checkpointed.sequence = solve(unit, min_memory(unit), mem_slots=int(min_memory(unit)))
    assert schedule.counts().get("Fn", 0) + schedule.counts().get("CF", 0) > 0
    return schedule


@pytest.mark.parametrize("kind", sorted(CONTAINERS))
def test_container_inputs_and_outputs_give_the_plain_gradients(kind):
    """Stages passing a dict, list, tuple or named tuple: the output keeps its kind, and the input's and the
    parameters' gradients equal the plain model's (a dict input once got no input gradient, a named tuple could
    not be rebuilt)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Mix(kind) for _ in range(5)])
    a = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    wa, wb = torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)

    def run(m):
        a.grad = b.grad = None
        model.zero_grad(set_to_none=True)
        out = m(CONTAINERS[kind](a, b))
        ya, yb = _halves(out)
        ((ya * wa).sum() + (yb * wb).sum()).backward()
        return out, [a.grad, b.grad] + [p.grad for p in model.parameters()]

    want_out, want = run(model)
    checkpointed = revlib.Checkpointable(model, input=CONTAINERS[kind](a, b))
    for _ in ("default plan", "tight plan"):
        out, got = run(checkpointed)
        assert type(out) is type(want_out)
        for g, w in zip(_halves(out), _halves(want_out)):
            assert torch.equal(g, w)
        for g, w in zip(got, want):
            assert g is not None and max_rel_err(g, w) <= 1e-12
        _tight(checkpointed)


def test_containers_pytree_cannot_walk_are_refused():
    """A stage output holding tensors in a container torch.utils._pytree does not walk (a list subclass) is
    refused when measured, naming the stage and the class: its tensors would get no gradient."""

    class Bag(list):
        pass

    class ToBag(nn.Module):
        def forward(self, x):
            return Bag([x, 2 * x])

    model = nn.Sequential(nn.Linear(4, 4), ToBag(), nn.Identity())
    with pytest.raises(
        TypeError,
        match=r"measuring stage 1 \(ToBag\).*inside a Bag, which torch.utils._pytree "
        r"does not walk",
    ):
        revlib.Checkpointable(model, input=torch.randn(2, 4))


def _dropout_mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16),
        nn.Tanh(),
        nn.Dropout(0.3),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 3),
    ).double()


def test_double_backward_gives_the_plain_gradients_of_gradients():
    """Gradient penalties (create_graph=True) on the input gradient and on the parameter gradients: the gradients of
    those gradients, with respect to the input and to the parameters, equal the plain model's, dropout included; a
    warning says the plan does not bound that backward's memory."""
    model = _dropout_mlp()
    x = torch.randn(5, 6, dtype=torch.float64)

    def step(m):
        torch.manual_seed(4)
        inp = x.clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        out = m(inp)
        (grad_x,) = torch.autograd.grad(out.square().sum(), inp, create_graph=True)
        (out.sum() + grad_x.square().sum()).backward()
        return [inp.grad] + [p.grad for p in model.parameters()]

    def penalty_on_parameter_gradients(m):
        torch.manual_seed(4)
        model.zero_grad(set_to_none=True)
        grads = torch.autograd.grad(m(x).square().sum(), list(model.parameters()), create_graph=True)
        sum(g.square().sum() for g in grads).backward()
        return [p.grad for p in model.parameters()]

    checkpointed = revlib.Checkpointable(model, input=x)
    plain = SeededUnits(checkpointed.stages)  # the plain model, with the masks Checkpointable draws
    want = step(plain) + penalty_on_parameter_gradients(plain)
    _tight(checkpointed)
    with pytest.warns(UserWarning, match="create_graph=True.*memory plan does not apply"):
        got = step(checkpointed) + penalty_on_parameter_gradients(checkpointed)
    for g, w in zip(got, want):
        assert max_rel_err(g, w) <= 1e-12


def test_second_backward_through_a_retained_graph():
    """backward(retain_graph=True) then backward again accumulates the same gradients twice, as plain autograd does
    (the second backward replays the forward phase with the first one's dropout masks and leaves running
    statistics alone); a third backward without a retained graph gets torch's own error."""
    model = _dropout_mlp()
    model.insert(1, nn.BatchNorm1d(16).double())
    x = torch.randn(5, 6, dtype=torch.float64)
    state = copy.deepcopy(model.state_dict())

    def step(m):
        model.load_state_dict(state)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(4)
        loss = m(x).square().sum()
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in model.parameters()]
        loss.backward()
        return loss, first, [p.grad.clone() for p in model.parameters()], copy.deepcopy(model.state_dict())

    checkpointed = revlib.Checkpointable(model, input=x)
    _, want_first, want, want_state = step(SeededUnits(checkpointed.stages))  # the plain model, the same masks
    _tight(checkpointed)
    loss, first, got, got_state = step(checkpointed)
    for g1, w1, g, w in zip(first, want_first, got, want):
        assert max_rel_err(g1, w1) <= 1e-12 and max_rel_err(g, w) <= 1e-12
        assert max_rel_err(g, 2 * g1) <= 1e-12
    for key, value in want_state.items():
        assert torch.equal(got_state[key], value), key
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


@pytest.mark.parametrize("budget", ["default", "tight"])
def test_frozen_first_stage(budget):
    """Fine-tuning: the first stage's parameters do not require grad. The trainable ones get the plain model's
    gradients, the frozen ones none."""
    model = _dropout_mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    x = torch.randn(5, 6, dtype=torch.float64)

    def step(m):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        m(x).square().sum().backward()
        return [p.grad for p in model.parameters()]

    checkpointed = revlib.Checkpointable(model, input=x)
    want = step(SeededUnits(checkpointed.stages))  # the plain model, with the masks Checkpointable draws
    if budget == "tight":
        _tight(checkpointed)
    got = step(checkpointed)
    assert got[0] is None and got[1] is None
    for g, w in zip(got[2:], want[2:]):
        assert max_rel_err(g, w) <= 1e-12


def _tied_model(device):
    """Stages 0 and 3 share one Linear: its gradient is the sum of both uses."""
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    model = (
        nn.Sequential(shared, nn.Tanh(), nn.Linear(8, 8), atomic(nn.Sequential(shared, nn.Tanh())), nn.Linear(8, 4))
        .double()
        .to(device)
    )
    return model, torch.randn(5, 8, dtype=torch.float64).to(device)


@pytest.mark.slow
def test_autograd_grad_and_backward_inputs_through_checkpointable(device):
    """torch.autograd.grad(loss, params) returns the plain gradients (a shared parameter's summed over its uses)
    and leaves .grad alone; torch.autograd.grad(loss, x) and backward(inputs=[x]) give the input gradient and
    touch no parameter's .grad (they once accumulated every parameter gradient); backward() still fills .grad."""
    model, x = _tied_model(device)
    params = list(model.parameters())

    def loss_of(m, inp):
        return m(inp).square().sum()

    inp = x.clone().requires_grad_(True)
    want = torch.autograd.grad(loss_of(model, inp), [inp] + params)
    checkpointed = revlib.Checkpointable(model, input=x)
    _tight(checkpointed)

    got = torch.autograd.grad(loss_of(checkpointed, x), params)
    assert all(p.grad is None for p in params)
    for g, w in zip(got, want[1:]):
        assert max_rel_err(g, w) <= 1e-10
    inp = x.clone().requires_grad_(True)
    (got_x,) = torch.autograd.grad(loss_of(checkpointed, inp), inp)
    assert all(p.grad is None for p in params)
    assert max_rel_err(got_x, want[0]) <= 1e-10
    inp = x.clone().requires_grad_(True)
    got = torch.autograd.grad(loss_of(checkpointed, inp), [inp, params[0]])
    assert all(p.grad is None for p in params)
    assert max_rel_err(got[0], want[0]) <= 1e-10 and max_rel_err(got[1], want[1]) <= 1e-10
    inp = x.clone().requires_grad_(True)
    loss_of(checkpointed, inp).backward(inputs=[inp])
    assert all(p.grad is None for p in params)
    assert max_rel_err(inp.grad, want[0]) <= 1e-10
    loss_of(checkpointed, x).backward()
    for p, w in zip(params, want[1:]):
        assert max_rel_err(p.grad, w) <= 1e-10


def test_multi_tensor_gradient_hooks_on_stage_outputs_complete():
    """A hook on all of a stage's outputs (register_multi_grad_hook, as memory trackers and sharding wrappers put
    there) runs once per backward with the plain model's gradients. A stage's backward that started from the
    output itself never completed such a hook, which then held the gradient until Python's garbage collector ran
    (torch 2.5's MemTracker counted it: the plan measured 8 % over its budget there)."""
    from torch.autograd.graph import register_multi_grad_hook

    model = _dropout_mlp()
    x = torch.randn(5, 6, dtype=torch.float64)
    seen = []

    def hook(module, args, out):
        if out.requires_grad:
            register_multi_grad_hook([out], lambda grads: seen.append(grads[0].clone()))

    checkpointed = revlib.Checkpointable(model, input=x)  # the plain plan: stage 5 runs with autograd at once
    handle = model[5].register_forward_hook(hook)
    try:
        gradients(SeededUnits(checkpointed.stages), lambda m, inp: m(inp).square().sum().backward(), x)
        want, seen[:] = list(seen), []
        gradients(checkpointed, lambda m, inp: m(inp).square().sum().backward(), x)
    finally:
        handle.remove()
    assert len(want) == 1 and len(seen) == 1
    assert max_rel_err(seen[0], want[0]) <= 1e-12


def test_budget_given_with_units():
    """mem_limit accepts bytes or text with a unit: decimal units are powers of 1000, binary ones of 1024."""
    model, x = _dropout_mlp(), torch.randn(5, 6, dtype=torch.float64)
    for text, value in [
        ("1GB", 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5 GiB", 1.5 * 2**30),
        ("2 kb", 2000),
        (12345, 12345),
    ]:
        assert revlib.Checkpointable(model, mem_limit=text).mem_limit == value
    checkpointed = revlib.Checkpointable(model, input=x, mem_limit="1GB")
    assert checkpointed.get_expected_memory() == checkpointed.no_checkpoint_memory()
    assert checkpointed.compute_sequence("10MiB") is checkpointed.sequence
    with pytest.raises(ValueError, match="mem_limit='1G'.*KiB, MiB, GiB"):
        revlib.Checkpointable(model, mem_limit="1G")
    with pytest.raises(TypeError, match="mem_limit=True"):
        revlib.Checkpointable(model, mem_limit=True)
    with pytest.raises(ValueError, match="mem_limit='-3MB'"):
        checkpointed.compute_sequence("-3MB")


def test_stages_take_one_argument():
    """A stage whose forward takes two inputs, or two arguments given to the model, are refused at once, naming
    the stage and what to write instead."""

    class Two(nn.Module):
        def forward(self, a, b):
            return a + b

    with pytest.raises(
        TypeError,
        match=r"stage 1 \(Two\) takes 2 inputs \(a, b\).*def forward\(self, inputs\): "
        r"a, b = inputs",
    ):
        revlib.Checkpointable(nn.Sequential(nn.Identity(), Two()))
    checkpointed = revlib.Checkpointable(_dropout_mlp())
    a = torch.randn(2, 6, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"one argument.*checkpointed\(\(a, b\)\)"):
        checkpointed(a, a)


def test_default_plan_where_the_smallest_budget_is_the_plain_one():
    """Checkpointable(model) with no mem_limit on an MLP whose smallest budget is the no-checkpoint one (batch 8):
    the plain plan, not InfeasibleBudget ('no schedule fits in 973404 bytes: the smallest budget ... is 972432')."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    x = torch.randn(8, 784)
    want = gradients(model, lambda m, inp: m(inp).square().sum().backward(), x)
    checkpointed = revlib.Checkpointable(model)
    for g, w in zip(gradients(checkpointed, lambda m, inp: m(inp).square().sum().backward(), x), want):
        assert max_rel_err(g, w) <= 1e-6
    assert checkpointed.min_memory() == checkpointed.no_checkpoint_memory()
    assert checkpointed.get_expected_memory() == checkpointed.no_checkpoint_memory()
    assert "Fn" not in checkpointed.sequence.counts()


class _ReturnsNone(nn.Module):
    def forward(self, x):
        return None


def test_a_stage_returning_no_tensor_and_an_input_of_no_tensor_are_refused_by_name():
    model = revlib.Checkpointable(nn.Sequential(nn.Linear(4, 4), _ReturnsNone(), nn.Linear(4, 4)), mem_limit=2**30)
    with pytest.raises(ValueError, match=r"stage 1 \(_ReturnsNone\) returned NoneType, which holds no tensor"):
        model.measure(torch.randn(2, 4))
    plain = revlib.Checkpointable(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), mem_limit=2**30)
    with pytest.raises(ValueError, match=r"the sample input holds no tensor \(a list\)"):
        plain.measure([[0.5, 1.0, 2.0, 3.0]])


def test_a_schedule_that_cannot_run_is_refused_clearly():
    """A schedule set by hand is checked against the model before it runs; the executor names a missing input
    instead of a KeyError."""
    from revlib_xla.planner import Op, Schedule
    from revlib_xla.planner.execute import _Run, _Structure

    model, x = _dropout_mlp(), torch.randn(5, 6, dtype=torch.float64)
    checkpointed = revlib.Checkpointable(model, input=x)
    bad = Schedule((Op("CF", 0), Op("Fn", 2), Op("L", 8)), 0.0, 0.0, checkpointed.chain)
    checkpointed.sequence = bad
    with pytest.raises(ValueError, match="schedule in .sequence cannot run this model: Fn_2: x_2 is not live"):
        checkpointed(x)
    run = _Run(checkpointed, bad, x.device, _Structure(x))
    run.x[0] = x
    with pytest.raises(RuntimeError, match="runs stage 2 but its input x_2 is neither stored nor kept"):
        run._barrier(2)
