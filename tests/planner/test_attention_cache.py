"""Selective recomputation of attention (revlib_xla.planner.attention_cache, through the planner's ``CA``): the fused
kernel runs once per kept cache (counted), gradients are the plain model's elementwise in every backward form users
combine it with, scopes belong to their thread, and the planner keeps caches where the budget holds them."""

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import max_rel_err
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import revlib_xla as revlib
from revlib_xla.memory import eager_peak
from revlib_xla.planner import (
    Op,
    OpKind,
    Schedule,
    StageCache,
    min_memory,
    no_checkpoint_memory,
    simulate,
    solve,
)
from revlib_xla.planner.attention_cache import AttentionCache, is_fused_attention

WIDTH, HEADS, SEQ = 16, 2, 24


class Block(nn.Module):
    """A pre-norm transformer block: causal attention (one fused kernel on the CPU), then an MLP with dropout."""

    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Dropout(p), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(batch, seq, WIDTH))
        return x + self.mlp(self.norm2(x))


class KernelRuns(TorchDispatchMode):
    """Counts the fused attention kernels that run (a replayed call never reaches this outer mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.runs += is_fused_attention(func)
        return func(*args, **(kwargs or {}))


def _model(depth: int = 4, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(depth)]).double()


def _x(seed: int = 1, batch: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, SEQ, WIDTH, dtype=torch.float64, generator=g).requires_grad_()


def _planned(model: nn.Module, x: torch.Tensor, ops: list[Op]) -> revlib.Checkpointable:
    checkpointed = revlib.Checkpointable(model)
    chain = checkpointed.measure(x.detach())
    checkpointed.chain, checkpointed.sequence = chain, Schedule(tuple(ops), *simulate(chain, ops), chain)
    return checkpointed


def _checkpointed_every_block(n: int, first: str) -> list[Op]:
    """x_0 and x_2 kept (``first``: ``CF``, or ``CA`` keeping blocks 0 and 2's attention too); blocks 1 and 3 rerun
    from them in the backward (``CF`` there reads a kept cache), and blocks 0 and 2's last recomputations stop
    early."""
    ops = [Op(first, 0), Op("Fn", 1), Op(first, 2), Op("Fn", 3), Op("L", n)]
    ops += [Op("CF", 2), Op("Fe", 3), Op("B", 3), Op("Fe", 2), Op("B", 2)]
    ops += [Op("CF", 0), Op("Fe", 1), Op("B", 1), Op("Fe", 0), Op("B", 0)]
    return ops


def test_a_replayed_call_skips_the_kernel_and_gives_the_plain_gradients():
    """A block's first run captures its kernel's outputs (the output and the log-sum-exp, per head); a run with autograd
    that replays them runs no kernel, and its gradients equal the plain block's (float64, exactly: the backward
    reads the same tensors)."""
    block = _model(1)[0]
    x = _x()
    weights = torch.randn(3, SEQ, WIDTH, dtype=torch.float64)
    cache = AttentionCache()
    with torch.no_grad(), cache.capturing():
        block(x)
    assert cache.calls == 1
    assert cache.bytes == 3 * SEQ * WIDTH * 8 + 3 * HEADS * SEQ * 8  # the output and the log-sum-exp

    def grads(replay: bool) -> list[torch.Tensor]:
        block.zero_grad(set_to_none=True)
        inp = x.detach().requires_grad_()
        counter = KernelRuns()
        torch.manual_seed(5)
        with counter, cache.replaying() if replay else torch.enable_grad():
            loss = (block(inp) * weights).sum()
        loss.backward()
        assert counter.runs == (0 if replay else 1)
        return [inp.grad] + [p.grad for p in block.parameters()]

    plain, replayed = grads(False), grads(True)
    assert cache.replayed == 1 and cache.missed == 0
    for got, want in zip(replayed, plain):
        assert torch.equal(got, want)


def test_a_call_unlike_the_first_runs_is_computed():
    """Replaying on an input of another shape does not return the cached tensors: the call is computed."""
    block = _model(1)[0].eval()  # no dropout: two runs compute the same
    cache = AttentionCache()
    with torch.no_grad(), cache.capturing():
        block(_x())
    other = _x(batch=2)
    with torch.no_grad():
        want = block(other)
        with cache.replaying():
            got = block(other)
    assert cache.missed == 1 and cache.replayed == 0
    assert torch.equal(got, want)


def test_a_scope_belongs_to_its_thread():
    """While one thread replays a cache, another thread's attention calls on other inputs are computed (and
    counted nowhere in that cache)."""
    block = _model(1)[0].eval()
    cache = AttentionCache()
    with torch.no_grad(), cache.capturing():
        block(_x())
    entered, done = threading.Event(), threading.Event()
    other = _x(7)
    with torch.no_grad():
        want = block(other)
    got: list[torch.Tensor] = []

    def holder() -> None:
        with cache.replaying():
            entered.set()
            done.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    entered.wait(30)
    with torch.no_grad():
        got.append(block(other))
    done.set()
    thread.join()
    assert torch.equal(got[0], want) and cache.replayed == 0 and cache.missed == 0


def _grads_of(module, model, x, weights, how):
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(11)
    loss = (module(x) * weights).sum()
    params = list(model.parameters())
    if how == "backward":
        loss.backward()
        return [x.grad] + [p.grad for p in params]
    if how == "grad":
        return list(torch.autograd.grad(loss, [x, *params]))
    if how == "inputs":
        loss.backward(inputs=[x, params[0], params[-1]])
        return [x.grad, params[0].grad, params[-1].grad]
    if how == "retain":  # two backwards through one forward: the forward phase runs again, capturing again
        loss.backward(retain_graph=True)
        loss.backward()
        return [x.grad] + [p.grad for p in params]
    if how == "double":
        (gx,) = torch.autograd.grad(loss, [x], create_graph=True)
        return list(torch.autograd.grad(gx.square().sum(), [x, *params], allow_unused=True))
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["backward", "grad", "inputs", "retain"])
def test_planned_caches_give_the_gradients_of_the_same_schedule_without_them(how):
    """A schedule keeping blocks 0 and 2's attention (``CA``) against the same schedule without (``CF``), with
    dropout replayed: equal gradients (float64) in every backward form; the kernel runs once per block in the
    forward phase and, in the backward phase, only for blocks 1 and 3 (whose first runs kept nothing), where the
    schedule without caches runs it for all four again."""
    weights = torch.randn(3, SEQ, WIDTH, dtype=torch.float64)
    model, reference = _model(seed=3), _model(seed=3)
    x, x_ref = _x(4), _x(4)
    planned = _planned(model, x, _checkpointed_every_block(4, "CA"))
    plain = _planned(reference, x_ref, _checkpointed_every_block(4, "CF"))
    runs = []
    for module, net, inp in ((planned, model, x), (plain, reference, x_ref)):
        with KernelRuns() as counter:
            runs.append((counter, _grads_of(module, net, inp, weights, how)))
    (cached_runs, got), (plain_runs, want) = runs
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert max_rel_err(g, w) <= 1e-12
    # The forward phase runs each block once. In the backward, without caches, CF_2 Fe_3 Fe_2 and CF_0 Fe_1 Fe_0
    # run their blocks' attention again; with them only Fe_3 and Fe_1 do (blocks 1 and 3 kept nothing).
    without, with_caches = 4 + 6, 4 + 2
    if how == "retain":  # the second backward runs the forward phase again (capturing again), then the same
        without, with_caches = 2 * without, 2 * with_caches
    assert (plain_runs.runs, cached_runs.runs) == (without, with_caches)


def test_a_gradient_of_a_gradient_fails_as_in_plain_autograd():
    """create_graph=True runs the whole model again with autograd (the executor's differentiable backward), so
    with caches planned a second derivative behaves as plain autograd's: torch's fused attention has none, and the
    same error says so (no number is returned)."""
    weights = torch.randn(3, SEQ, WIDTH, dtype=torch.float64)
    model, reference = _model(seed=5), _model(seed=5)
    x, x_ref = _x(6), _x(6)
    planned = _planned(model, x, _checkpointed_every_block(4, "CA"))
    messages = []
    for module, net, inp in ((planned, model, x), (reference, reference, x_ref)):
        with pytest.raises(RuntimeError) as info, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the executor's note that this backward holds the plain model's memory
            _grads_of(module, net, inp, weights, "double")
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "derivative for" in messages[0]


def test_under_autocast_with_a_grad_scaler_equals_the_schedule_without_caches():
    """CPU bfloat16 autocast and a GradScaler: the cache holds bfloat16 attention outputs of the first run, which
    ran in the same autocast state as the recomputations; the scaled float32 gradients equal those of the same
    schedule without caches."""
    weights = torch.randn(3, SEQ, WIDTH)
    model, reference = _model(seed=8).float(), _model(seed=8).float()
    x, x_ref = _x(9).float().detach().requires_grad_(), _x(9).float().detach().requires_grad_()
    planned = _planned(model, x, _checkpointed_every_block(4, "CA"))
    plain = _planned(reference, x_ref, _checkpointed_every_block(4, "CF"))
    for module, inp in ((planned, x), (plain, x_ref)):
        scaler = torch.amp.GradScaler("cpu")
        torch.manual_seed(2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (module(inp) * weights).sum()
        scaler.scale(loss).backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        assert got.grad.dtype == torch.float32
        assert max_rel_err(got.grad, want.grad) <= 1e-6
    assert max_rel_err(x.grad, x_ref.grad) <= 1e-6


def test_the_planner_keeps_caches_within_the_budget_and_the_step_peaks_where_it_says():
    """Long sequences, where attention dominates a block's recomputation: at budgets between the smallest and the
    plain schedule's peak the plan keeps caches, is at least as fast as the plan without them on the same chain,
    and the cost model is as exact about its step as about the plan without caches: the measured eager peak
    (parameters and gradients aside) is below the planned one by the same bytes in both."""
    model = _model(6, seed=1)
    x = torch.randn(2, 256, WIDTH, dtype=torch.float64, requires_grad=True)

    def step(m: nn.Module, inp: torch.Tensor) -> None:
        torch.manual_seed(0)
        m(inp).sum().backward()

    planned = revlib.Checkpointable(model)
    measured = planned.measure(x)
    assert all(c is not None and c.fw <= f and c.bytes > 0 for c, f in zip(measured.caches, measured.fw))
    # Which caches pay follows times: priced here (a cache halves a block's forward), so the plan is the same on
    # every machine; the sizes are the measured ones.
    chain = measured.replace(
        caches=[StageCache(c.bytes, f / 2, c.cbw, c.fwd_tmp) for c, f in zip(measured.caches, measured.fw)]
    )
    bare = chain.replace(caches=None)
    low, high = min_memory(chain), no_checkpoint_memory(chain)
    used = 0
    for fraction in (0.15, 0.3, 0.5):
        budget = low + fraction * (high - low)
        margins = []
        for c in (chain, bare):
            schedule = solve(c, budget)
            assert schedule.peak_memory <= budget
            planned.chain, planned.sequence = c, schedule
            step(planned, x)
            peak = eager_peak(step, planned, x, zero_grad=False)
            margins.append(planned.get_expected_memory() - (peak.total - peak.parameters - peak.gradients))
            if c is chain:
                used += schedule.counts().get("CA", 0)
                makespan = schedule.makespan
        assert makespan <= schedule.makespan
        assert margins[0] == margins[1] and 0 <= margins[0] <= 4 * x.numel() * 8, (fraction, margins)
    assert used


def test_a_model_without_fused_attention_has_no_cache_and_a_schedule_asking_for_one_is_refused():
    """An MLP stage measures no cache; a schedule with ``CA`` on it is refused by the cost model, naming the
    operation."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)]).double()
    checkpointed = revlib.Checkpointable(model)
    chain = checkpointed.measure(torch.randn(4, 8, dtype=torch.float64))
    assert chain.caches == (None,) * chain.length
    n = chain.length
    ops = [Op("CA", 0)] + [Op("Fe", i) for i in range(1, n)] + [Op("L", n)]
    ops += [Op("B", i) for i in reversed(range(1, n))] + [Op("Fe", 0), Op("B", 0)]
    with pytest.raises(ValueError, match="CA_0: the stage has no attention cache"):
        simulate(chain, ops)
    assert OpKind("CA") is OpKind.CA
    off = revlib.Checkpointable(_model(2), attention_cache=False)
    assert off.measure(_x().detach()).caches == (None, None)


def test_the_cached_forward_time_is_a_share_of_the_forward_that_a_changing_load_does_not_move(monkeypatch):
    """The planner prices a forward reading the cache as a share of the forward, from interleaved runs: a load that
    changes between runs (here, doubling from each run to the next) moves both times of a pair alike, and the share
    stays the kernels' own (here, one half). Medians of runs timed apart followed the load."""
    from revlib_xla.planner import measure

    runs = []

    def seconds(fn, device):
        fn()
        runs.append(fn.__name__)
        load = 2.0 ** ((len(runs) - 1) // 2)  # the same within a pair, doubled at the next
        return load * (0.5 if fn.__name__ == "replayed" else 1.0)

    monkeypatch.setattr(measure, "_seconds", seconds)
    stage = Block(p=0.0)
    x = torch.randn(2, SEQ, WIDTH)
    size, cached_fw, _, _ = measure._cache_costs(stage, x, torch.device("cpu"), 3, 0.25, 0, 0)
    timed = [name for name in runs if name in ("computed", "replayed")]
    assert timed == ["computed", "replayed"] * 3  # interleaved, after an untimed first replay
    assert size > 0 and cached_fw == pytest.approx(0.125)


class Rebuilt(nn.Module):
    """A stage that can rebuild its input (an additive coupling on the two halves of the width)."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(WIDTH // 2, WIDTH // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, -1)
        return torch.cat([a, b + self.f(a)], -1)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        a, c = y.chunk(2, -1)
        return torch.cat([a, c - self.f(a)], -1)


@pytest.mark.parametrize("beside", ["reversible", "offload"])
def test_caches_are_not_measured_where_the_solver_would_not_plan_them(beside):
    """With a reversible stage in the chain, or offload, the solver plans no cache; measuring them would only add
    kernel runs to the first step: none is measured, and the attention stages' kernels run fewer times."""
    torch.manual_seed(0)
    stages = [Block(p=0.0), Rebuilt(), Block(p=0.0)] if beside == "reversible" else [Block(p=0.0), Block(p=0.0)]
    model = nn.Sequential(*stages).double()
    kwargs = {"offload_bandwidth": 1e9} if beside == "offload" else {}
    runs = {}
    for cache in (True, False):
        with KernelRuns() as counted:
            chain = revlib.Checkpointable(model, attention_cache=cache, **kwargs).measure(_x().detach())
        assert chain.caches == (None,) * chain.length
        runs[cache] = counted.runs
    assert runs[True] == runs[False] > 0
    # the same attention stages alone measure their caches (more kernel runs)
    alone = nn.Sequential(Block(p=0.0), Block(p=0.0)).double()
    with KernelRuns() as counted:
        chain = revlib.Checkpointable(alone).measure(_x().detach())
    assert all(c is not None for c in chain.caches) and counted.runs > runs[True]
