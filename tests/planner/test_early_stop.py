"""Recomputations that stop at the last tensor their backward needs (revlib_xla.planner.early_stop, through the
planner's executor): what they skip (counted), that gradients, random numbers and running statistics stay the plain
model's in every backward form users combine with it, and a clear error where a stage does not compute the same thing
twice."""

import copy

import pytest
import torch
from conftest import max_rel_err
from torch import nn

import revlib_xla as revlib
from revlib_xla import backends
from revlib_xla.planner import Op, Schedule, simulate
from revlib_xla.planner.early_stop import DeferredSaves, RecomputationMismatch
from revlib_xla.planner.execute import deferrable_stages

WIDTH = 12


class Counted(nn.Linear):
    """A linear layer that counts its calls: the last operation of a block, which a backward never needs."""

    calls = 0

    def forward(self, x):
        out = super().forward(x)
        type(self).calls += 1  # counted once computed: a recomputation stopped within it does not count
        return out


class Block(nn.Module):
    """A pre-norm residual block with dropout and a batch norm (random numbers and running statistics to replay).
    Its output projection is the last operation: the recomputation saves its input and weight, then stops."""

    def __init__(self, p: float = 0.2) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(WIDTH)
        self.up = nn.Linear(WIDTH, 3 * WIDTH)
        self.drop = nn.Dropout(p)
        self.out = Counted(3 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.out(self.drop(torch.tanh(self.up(self.norm(x)))))


def _model(depth: int = 4, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(depth)]).double()


def _every_block_checkpointed(n: int) -> list[Op]:
    """HF-style checkpointing of every block: each input kept, each block recomputed just before its backward."""
    return (
        [Op("CF", i) for i in range(n)]
        + [Op("L", n)]
        + [op for i in reversed(range(n)) for op in (Op("Fe", i), Op("B", i))]
    )


def _planned(model: nn.Module, x: torch.Tensor, ops: list[Op] | None = None) -> revlib.Checkpointable:
    checkpointed = revlib.Checkpointable(model)
    chain = checkpointed.measure(x)
    ops = _every_block_checkpointed(chain.length) if ops is None else ops
    checkpointed.chain, checkpointed.sequence = chain, Schedule(tuple(ops), *simulate(chain, ops), chain)
    return checkpointed


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(16, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).requires_grad_()


def _step(module: nn.Module, x: torch.Tensor, weights: torch.Tensor, seed: int = 7) -> torch.Tensor:
    torch.manual_seed(seed)
    return (module(x) * weights).sum()


def test_the_last_operation_is_not_recomputed_and_gradients_buffers_equal_the_plain_models():
    """Every block checkpointed: each block's output projection runs once (its first run), not again in the
    backward; gradients (float64), the input's gradient and the batch norms' running statistics equal those of the
    same blocks with every activation kept (no recomputation; the same dropout masks, drawn from the same seeds)."""
    weights = torch.randn(16, WIDTH, dtype=torch.float64)
    reference, model = _model(), _model()
    x_ref, x = _x(), _x()
    kept = [Op("Fe", i) for i in range(4)] + [Op("L", 4)] + [Op("B", i) for i in reversed(range(4))]
    plain = _planned(reference, x_ref.detach(), kept)  # keeps every activation: no recomputation at all
    planned = _planned(model, x.detach())
    assert deferrable_stages(planned.sequence) == {0, 1, 2, 3}
    _step(plain, x_ref, weights).backward()
    Counted.calls = 0
    _step(planned, x, weights).backward()
    assert Counted.calls == 4  # the forward phase's four; none in the backward
    for got, want in zip(model.parameters(), reference.parameters()):
        assert max_rel_err(got.grad, want.grad) <= 1e-12
    assert max_rel_err(x.grad, x_ref.grad) <= 1e-12
    for got, want in zip(model.buffers(), reference.buffers()):
        assert torch.equal(got, want)


def _grads_of(module, model, x, weights, how):
    model.zero_grad(set_to_none=True)
    x.grad = None
    loss = _step(module, x, weights)
    params = list(model.parameters())
    if how == "grad":
        return list(torch.autograd.grad(loss, [x, *params]))
    if how == "inputs":  # backward(inputs=...): only some parameters accumulate
        loss.backward(inputs=[x, params[0], params[-1]])
        return [x.grad, params[0].grad, params[-1].grad]
    if how == "retain":  # two backwards through one forward: the second runs the forward phase again
        loss.backward(retain_graph=True)
        loss.backward()
        return [x.grad] + [p.grad for p in params]
    if how == "double":  # a gradient penalty: create_graph=True runs the whole model with autograd
        (gx,) = torch.autograd.grad(loss, [x], create_graph=True)
        return list(torch.autograd.grad(gx.square().sum(), [x, *params], allow_unused=True))
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["grad", "inputs", "retain", "double"])
def test_backward_forms_equal_the_recompute_everything_run(how):
    """autograd.grad (gradients captured, not accumulated), backward(inputs=...), a second backward with
    retain_graph and double backward: the same gradients as the same schedule with nothing deferred (Fn/CF
    recomputation without early stop: every block run from a checkpoint one stage earlier, so no stage defers)."""
    weights = torch.randn(16, WIDTH, dtype=torch.float64)
    model, reference = _model(seed=3), _model(seed=3)
    x, x_ref = _x(4), _x(4)
    n = 4
    # x_0 and x_2 kept; blocks 1 and 3 rebuilt from them with Fn, so only blocks 0 and 2 defer.
    ops = [Op("CF", 0), Op("Fn", 1), Op("CF", 2), Op("Fn", 3), Op("L", n)]
    ops += [Op("CF", 2), Op("Fe", 3), Op("B", 3), Op("Fe", 2), Op("B", 2)]
    ops += [Op("CF", 0), Op("Fe", 1), Op("B", 1), Op("Fe", 0), Op("B", 0)]
    planned = _planned(model, x.detach(), ops)
    assert deferrable_stages(planned.sequence) == {0, 2}
    # The same blocks, every backward run from a full recomputation (Fe in the forward phase keeps the graph).
    kept = [Op("Fe", i) for i in range(n)] + [Op("L", n)] + [Op("B", i) for i in reversed(range(n))]
    plain = _planned(reference, x_ref.detach(), kept)
    assert not deferrable_stages(plain.sequence)
    got = _grads_of(planned, model, x, weights, how)
    want = _grads_of(plain, reference, x_ref, weights, how)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)  # the output bias does not reach dloss/dx
        if g is not None:
            assert max_rel_err(g, w) <= 1e-10


def test_under_autocast_with_a_grad_scaler_equals_the_run_that_keeps_every_activation():
    """CPU bfloat16 autocast and a GradScaler, with dropout and batch norms: the recomputations that stop early run
    in the first run's autocast state (they save bfloat16 tensors, as it did; another state would be refused as a
    mismatch), so the scaled gradients and running statistics equal those of the same blocks in float32 with every
    activation kept."""
    weights = torch.randn(16, WIDTH)
    reference, model = _model().float(), _model().float()
    x_ref, x = _x().float().detach().requires_grad_(), _x().float().detach().requires_grad_()
    kept = [Op("Fe", i) for i in range(4)] + [Op("L", 4)] + [Op("B", i) for i in reversed(range(4))]
    plain = _planned(reference, x_ref.detach(), kept)
    planned = _planned(model, x.detach())
    assert deferrable_stages(planned.sequence) == {0, 1, 2, 3}
    for module, inp in ((plain, x_ref), (planned, x)):
        Counted.calls = 0
        scaler = torch.amp.GradScaler("cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _step(module, inp, weights)
        scaler.scale(loss).backward()
    assert Counted.calls == 4  # the output projections ran in the forward phase only
    for got, want in zip(model.parameters(), reference.parameters()):
        assert got.grad.dtype == torch.float32
        assert max_rel_err(got.grad, want.grad) <= 1e-6
    assert max_rel_err(x.grad, x_ref.grad) <= 1e-6
    for got, want in zip(model.buffers(), reference.buffers()):
        assert torch.equal(got, want)


class Flaky(nn.Module):
    """A block whose forward saves differently shaped tensors on its second call (data-dependent control flow the
    engine cannot replay)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        if self.calls % 2 == 0:
            h = h[:, : WIDTH // 2].exp().repeat(1, 2)
        return x + torch.tanh(h)


def test_a_stage_that_does_not_compute_the_same_thing_twice_is_refused():
    """Its recomputation saves other shapes than its first run: a RecomputationMismatch naming the stage, not a
    gradient from the wrong tensors."""
    torch.manual_seed(0)
    model = nn.Sequential(Flaky(), Flaky()).double()
    x = _x()
    planned = _planned(model, x.detach())
    for block in model:
        block.calls = 0
    with pytest.raises(RecomputationMismatch, match=r"Checkpointable stage 1 \(Flaky\): saved tensor .* first run"):
        planned(x).sum().backward()


def test_deferred_saves_alone():
    """The mechanism on its own: the backward fills the slots from the recomputation, which stops at the last save
    (the final exp never runs again); fewer saves than the first run is an error."""
    w = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 5, dtype=torch.float64)
    ran = []

    def f(scale: float = 1.0):
        ran.append("mm")
        h = torch.tanh(x @ w) * scale
        ran.append("exp")
        return h.exp()  # saves its result: the last save, after which nothing is left to run

    saves = DeferredSaves("test unit")
    with saves.recording():
        out = f()
    assert saves.count == 3  # x (for the mm), tanh's result, exp's result
    saves.recompute = f
    ran.clear()
    (gw,) = torch.autograd.grad(out.sum(), [w])
    (want,) = torch.autograd.grad(f().sum(), [w])
    assert ran[:2] == ["mm", "exp"] and torch.allclose(gw, want, rtol=1e-12, atol=0)

    saves = DeferredSaves("short unit")
    with saves.recording():
        out = f()
    saves.recompute = lambda: torch.tanh(x @ w)  # two saves where there were three
    with pytest.raises(RecomputationMismatch, match="short unit: its recomputation saved 2 tensors.*first run 3"):
        out.sum().backward()


def test_lazy_devices_recompute_whole_stages(device):
    """On XLA the compiler drops the unread operations itself: the executor runs the whole recomputation there
    (one graph shape, behind its barriers), and stops early on eager devices."""
    if not backends.is_tracing_lazily(torch.empty(0, device=device)):
        expected = 4
    else:
        expected = 8
    model = copy.deepcopy(_model()).to(device)
    x = _x().to(device).detach().requires_grad_()
    planned = _planned(model, x.detach())
    Counted.calls = 0
    planned(x).sum().backward()
    backends.sync(device)
    assert Counted.calls == expected
    if expected == 8:  # the planner prices what the executor does (times on eager devices: the fake clock's test)
        assert planned.chain.stopped_fw == planned.chain.fw


class _Clock:
    """A stand-in for ``time.perf_counter`` that only the measured stage advances."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class _Timed(nn.Module):
    """A stage that takes 1 unit of the fake clock up to its last saved tensor (tanh's result) and 10 after it."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.clock = clock

    def forward(self, x):
        self.clock.now += 1
        h = torch.tanh(self.lin(x))
        self.clock.now += 10  # e.g. an output projection of a layer whose backward reads nothing of it
        return h + 1  # saves nothing


def test_the_planner_prices_a_recomputation_stopped_at_its_last_save(monkeypatch):
    """``stopped_fw`` is the stage's forward time scaled by the share its stopped recomputation runs (1 unit of
    11 here, with a clock only the stage advances); a stage with a forward hook, which the executor recomputes in
    full, is priced in full; the solver's makespan counts the stopped runs."""
    import revlib_xla.planner.measure as measure

    clock = _Clock()
    monkeypatch.setattr(measure, "time", clock)
    stages = nn.Sequential(_Timed(clock), _Timed(clock))
    chain = revlib.planner.measure_chain(list(stages), torch.randn(3, 4)).chain
    assert chain.fw == (11.0, 11.0)
    assert chain.stopped_fw == pytest.approx((1.0, 1.0))
    ops = _every_block_checkpointed(2)
    assert simulate(chain, ops)[0] == pytest.approx(2 * 11 + 2 * 1 + sum(chain.bw))

    stages[1].register_forward_hook(lambda *args: None)
    chain = revlib.planner.measure_chain(list(stages), torch.randn(3, 4)).chain
    assert chain.stopped_fw == pytest.approx((1.0, 11.0))


def test_double_backward_with_running_statistics_equals_plain_autograd():
    """A gradient penalty through blocks with batch norms (create_graph=True): it used to fail with autograd's
    "modified by an inplace operation" (the recomputation's saved running statistics were put back in place before
    the second backward read them). The recomputation now runs on copies of the buffers: both orders of gradient
    and the running statistics equal plain autograd's on the bare blocks (no dropout: the same function)."""
    torch.manual_seed(5)
    blocks = nn.Sequential(*[Block(p=0.0) for _ in range(3)]).double()
    reference = copy.deepcopy(blocks)
    x, x_ref = _x(6), _x(6)
    planned = _planned(blocks, x.detach())
    for module, inp in ((planned, x), (reference, x_ref)):
        (gx,) = torch.autograd.grad(module(inp).tanh().sum(), [inp], create_graph=True)
        gx.square().sum().backward()
    for got, want in zip(blocks.parameters(), reference.parameters()):
        assert max_rel_err(got.grad, want.grad) <= 1e-10
    assert max_rel_err(x.grad, x_ref.grad) <= 1e-10
    for got, want in zip(blocks.buffers(), reference.buffers()):
        assert torch.equal(got, want)


class Table(nn.Module):
    """A module shared by several stages, as one rotary table serves every block: a buffer every stage's graph
    saves."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0.5, 1.5, WIDTH, dtype=torch.float64))

    def forward(self, x):
        return x * self.table


class SharedBlock(nn.Module):
    def __init__(self, shared: Table) -> None:
        super().__init__()
        self.shared = shared
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.lin(self.shared(x)))


def test_overlapping_recomputations_of_stages_sharing_a_buffer_taken_as_changing(monkeypatch):
    """Stages 1 and 2 are recomputed with autograd one after the other and their backwards run afterwards
    (Fe_1 Fe_2 B_2 B_1): both graphs save the shared buffer. On XLA a buffer whose value is still pending (the
    rotary tables right after the model is built) is taken as changed by each stage's forward (the engine cannot
    compare it without running the step; here forced). Recomputations used to write its earlier value into it in
    place and put the later one back after each backward, which changed what stage 1's graph had saved: autograd's
    "modified by an inplace operation" (found tracing llama-1b with plan + FewBit for a v6e). They now run on
    copies: the gradients equal those of the run that keeps every activation, and the buffer is untouched."""
    from revlib_xla.recompute import RecomputeState

    monkeypatch.setattr(RecomputeState, "_kept", lambda self, key, tensor, before: False)
    results = []
    for ops in (
        [Op("Fe", 0), Op("Fe", 1), Op("Fe", 2), Op("L", 3), Op("B", 2), Op("B", 1), Op("B", 0)],
        [Op("CF", 0), Op("CF", 1), Op("CF", 2), Op("L", 3)]
        + [Op("Fe", 1), Op("Fe", 2), Op("B", 2), Op("B", 1), Op("Fe", 0), Op("B", 0)],
    ):
        torch.manual_seed(2)
        shared = Table()
        model = nn.Sequential(*[SharedBlock(shared) for _ in range(3)]).double()
        x = _x(8)
        planned = _planned(model, x.detach(), ops)
        for _ in range(2):
            planned(x).square().sum().backward()
        assert torch.equal(shared.table, torch.linspace(0.5, 1.5, WIDTH, dtype=torch.float64))
        results.append([p.grad for p in model.parameters()] + [x.grad])
    want, got = results
    for g, w in zip(got, want):
        assert max_rel_err(g, w) <= 1e-12
