"""verify_inverse's default: the reversible backward measures the input it rebuilt against the forward's input, so
an additive stack that cannot rebuild its input is refused instead of training on wrong gradients; it costs no block
evaluation, and one input-sized tensor in the first step only; its state (and the recompute engine's) is per thread."""

import threading

import pytest
import torch
from conftest import max_rel_err
from torch import nn

import revlib_xla as revlib
from revlib_xla import MemoryModes, ReversibleSequential, backends
from revlib_xla.reversible import invertibility
from revlib_xla.reversible import rebuild_check as _rebuild_check

REFUSED = r"does not rebuild its input"


def mlp_blocks(depth, std=None, width=16):
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(depth)]
    if std is not None:
        for p in (p for b in blocks for p in b.parameters()):
            nn.init.normal_(p, std=std)
    return blocks


def bad_stack(**kw):
    """Eight bfloat16 MLP blocks with large weights: the additive inverse loses the input (relative error ~100) in
    floating-point streams (exact=False; with exact streams, the default, it rebuilds its input bit for bit)."""
    kw.setdefault("exact", False)
    return ReversibleSequential(*mlp_blocks(8, std=0.3), split_dim=-1, **kw).bfloat16()


BAD_INPUT = torch.randn(4, 32, generator=torch.Generator().manual_seed(1)).bfloat16()


def good_stack(**kw):
    return ReversibleSequential(*mlp_blocks(3), split_dim=-1, **kw).double()


def good_input():
    return torch.randn(5, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def flat_grads(model):
    return torch.cat([p.grad.float().flatten() for p in model.parameters()])


class Measured:
    """Counts the rebuilds measured (``rebuild_error`` is called once per measurement)."""

    def __init__(self, monkeypatch):
        self.count = 0
        original = _rebuild_check.rebuild_error

        def counted(*args):
            self.count += 1
            return original(*args)

        monkeypatch.setattr(_rebuild_check, "rebuild_error", counted)


@pytest.fixture
def measured(monkeypatch):
    return Measured(monkeypatch)


# ---------------------------------------------------------------------------------------------------------------
# What it catches, what it lets through


def test_default_refuses_the_stack_whose_gradients_are_wrong(measured):
    """The unchecked gradients are measured wrong against no_savings (by more than 100 %); the default refuses them
    in the first backward, naming the error, the tolerance, the dtype and what to do."""
    grads = []
    for kw in ({"verify_inverse": False}, {"memory_mode": MemoryModes.no_savings}):
        model = bad_stack(**kw)
        model(BAD_INPUT).float().square().mean().backward()
        grads.append(flat_grads(model))
    assert float((grads[0] - grads[1]).norm() / grads[1].norm()) > 1.0  # what the check prevents
    assert measured.count == 0  # verify_inverse=False measures nothing
    model = bad_stack()
    loss = model(BAD_INPUT).float().square().mean()  # the forward does not raise: the backward measures
    with pytest.raises(
        revlib.ReversibleError,
        match=REFUSED + r": This backward .* through all its layers \(8 in all; bfloat16 streams\) with a relative "
        r"error of [\d.e+]+ .*tolerance 0\.03.*gradients it computed are wrong.*stream_dtype=torch\.float32.*"
        r"MemoryModes\.no_savings.*verify_inverse=True.*verify_inverse=False accepts",
    ):
        loss.backward()
    assert measured.count == 1


def test_exact_streams_rebuild_the_same_stack_and_the_check_measures_zero(monkeypatch):
    """The stack whose float streams are refused, with exact (fixed-point) streams, the default: the check still
    runs, measures a rebuild error of exactly 0, and the gradients are no_savings' to the bit."""
    errors = []
    original = _rebuild_check.rebuild_error

    def recorded(*args):
        errors.append(original(*args))
        return errors[-1]

    monkeypatch.setattr(_rebuild_check, "rebuild_error", recorded)
    grads = []
    for kw in ({}, {"memory_mode": MemoryModes.no_savings}):
        model = bad_stack(exact=None, **kw)
        x = BAD_INPUT.clone().requires_grad_()
        model(x).float().square().mean().backward()
        grads.append((flat_grads(model), x.grad))
    assert [float(e) for e in errors] == [0.0]
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_float32_streams_pass_with_no_savings_gradients(measured):
    """The advice holds: the same blocks with float32 streams rebuild their input (checked, silently) and give
    no_savings' gradients (with float32 streams too)."""
    grads = []
    for kw in ({}, {"memory_mode": MemoryModes.no_savings}):
        model = bad_stack(stream_dtype=torch.float32, **kw)
        model(BAD_INPUT).float().square().mean().backward()
        grads.append(flat_grads(model))
    assert measured.count == 1
    assert max_rel_err(grads[0], grads[1]) <= 1e-2


def test_well_conditioned_stack_is_checked_once_per_dtype_pair(measured):
    x = good_input()
    model, reference = good_stack(), good_stack(memory_mode=MemoryModes.no_savings)
    for _ in range(2):
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
            (m(x) * x).sum().backward()
        for p, r in zip(model.parameters(), reference.parameters()):
            assert max_rel_err(p.grad, r.grad) <= 1e-10
    assert measured.count == 1 and model._verified == {(torch.float64, None)}
    model.float()
    for _ in range(2):
        model(x.float()).sum().backward()
    assert measured.count == 2 and model._verified == {(torch.float64, None), (torch.float32, None)}


def test_the_check_runs_no_block(monkeypatch):
    """No block evaluation beyond the backward's own recomputation: each block runs twice per step."""
    model = good_stack()
    calls = []
    for layer in model.children():
        layer.block.register_forward_pre_hook(lambda *_: calls.append(1))
    model(good_input()).sum().backward()
    assert model._verified and len(calls) == 2 * len(model)


# ---------------------------------------------------------------------------------------------------------------
# How it composes


def test_autograd_grad_and_scaled_losses(measured):
    """torch.autograd.grad (not .backward()) and a GradScaler-style scaled loss are checked alike."""
    with pytest.raises(revlib.ReversibleError, match=REFUSED):
        model = bad_stack()
        torch.autograd.grad(model(BAD_INPUT).float().sum(), list(model.parameters()))
    with pytest.raises(revlib.ReversibleError, match=REFUSED):
        (bad_stack()(BAD_INPUT).float().sum() * 2.0**16).backward()
    x = good_input()
    model, reference = good_stack(), good_stack(memory_mode=MemoryModes.no_savings)
    got = torch.autograd.grad(model(x).sum() * 2.0**16, list(model.parameters()))
    want = torch.autograd.grad(reference(x).sum(), list(reference.parameters()))
    assert measured.count == 3
    for g, w in zip(got, want):
        assert max_rel_err(g / 2.0**16, w) <= 1e-10


def test_gradient_of_gradient_keeps_its_own_error():
    """create_graph=True is refused by the last layer's backward, before anything is rebuilt."""
    model = bad_stack()
    out = model(BAD_INPUT).float().sum()
    with pytest.raises(revlib.ReversibleError, match="a gradient of a gradient"):
        torch.autograd.grad(out, list(model.parameters()), create_graph=True)


def test_threads_each_with_its_own_stack(measured):
    results = {}

    def run(name, model, x):
        try:
            model(x).float().sum().backward()
            results[name] = flat_grads(model)
        except revlib.ReversibleError as err:
            results[name] = err

    # Built here, not in the threads: both draw their weights from the one global generator after manual_seed(0),
    # and two threads drawing at once would interleave the draws (the good stack then differs from its reference).
    threads = [
        threading.Thread(target=run, args=("bad", bad_stack(), BAD_INPUT)),
        threading.Thread(target=run, args=("good", good_stack(), good_input())),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(results["bad"], revlib.ReversibleError) and REFUSED in str(results["bad"])
    reference = good_stack(memory_mode=MemoryModes.no_savings)
    reference(good_input()).sum().backward()
    assert max_rel_err(results["good"], flat_grads(reference)) <= 1e-6  # flat_grads: float32
    assert measured.count == 2


def test_verify_inverse_true_runs_the_full_check_instead(monkeypatch, measured):
    full = []
    monkeypatch.setattr(invertibility, "check_plan", lambda *a, **k: full.append(a))
    model = good_stack(verify_inverse=True)
    for _ in range(2):
        model(good_input()).sum().backward()
    assert len(full) == 1 and measured.count == 0


def test_frozen_first_layers_are_measured_above_them(measured):
    """The backward stops at the first layer with something to differentiate: its input is the one kept."""
    model = bad_stack()
    for layer in list(model)[:2]:
        layer.requires_grad_(False)
    with pytest.raises(revlib.ReversibleError, match=REFUSED + r".*input of layer 2, through the layers above"):
        model(BAD_INPUT).float().sum().backward()
    model = good_stack()
    model[0].requires_grad_(False)
    model(good_input()).sum().backward()
    assert measured.count == 2


def test_a_partial_backward_leaves_the_check_to_the_next_step(measured):
    """A gradient of the last layer's parameters only does not rebuild the first layers: nothing is measured, and
    the next step keeps its input again."""
    model = good_stack()
    torch.autograd.grad(model(good_input()).sum(), list(list(model)[-1].parameters()))
    assert measured.count == 0 and not model._verified
    model(good_input()).sum().backward()
    assert measured.count == 1 and model._verified


def test_dropout_without_replay_is_refused():
    """preserve_rng_state=False with dropout: the recomputation draws other masks and rebuilds another input."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5)) for _ in range(2)]
    model = ReversibleSequential(*blocks, split_dim=-1, preserve_rng_state=False).double()
    with pytest.raises(revlib.ReversibleError, match=REFUSED + r".*keep preserve_rng_state=True"):
        model(good_input()).sum().backward()


def test_a_non_finite_input_is_measured_again_next_step(measured):
    model = good_stack()
    x = good_input()
    x[0, 0] = float("inf")
    model(x).sum().backward()  # nothing to compare with: not refused, not counted as checked
    assert measured.count == 1 and not model._verified
    model(good_input()).sum().backward()
    assert measured.count == 2 and model._verified


def test_an_empty_batch_trains_without_a_check():
    """A batch of size 0 (the last, empty shard of a split): nothing to compare; the check runs at the next step."""
    model, ref = good_stack(), good_stack(memory_mode=MemoryModes.no_savings)
    for m in (model, ref):
        m(good_input()[:0]).sum().backward()
    assert not model._verified
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    model(good_input()).sum().backward()
    assert model._verified


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_reported_as_such_not_as_rounding(bad):
    model = good_stack()
    with torch.no_grad():
        next(model.parameters())[0, 0] = bad
    with pytest.raises(
        revlib.ReversibleError, match="rebuilt the finite input .* as NaN or inf: a layer computed"
    ) as e:
        model(good_input()).sum().backward()
    assert "stream_dtype=" not in str(e.value) and "rounding" not in str(e.value)  # not the advice for rounding


def test_verify_inverse_values():
    with pytest.raises(revlib.ReversibleError, match=r"verify_inverse='yes'.*'rebuild'"):
        ReversibleSequential(nn.Linear(2, 2), verify_inverse="yes")


# ---------------------------------------------------------------------------------------------------------------
# Memory: one input-sized tensor in the first step only


def test_the_first_step_keeps_one_input_and_the_next_ones_nothing():
    """The stack's input is a computed tensor here (no caller holds it): the check keeps it until the end of the
    first backward, exactly its bytes; the second step peaks where an unchecked step does."""
    from revlib_xla import memory

    def make(verify):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 32), ReversibleSequential(*mlp_blocks(3), split_dim=-1, **verify)).double()

    def step(model, x):
        model(x).square().mean().backward()

    x = torch.randn(64, 32, dtype=torch.float64)
    peaks = {}
    for name, verify in (("checked", {}), ("unchecked", {"verify_inverse": False})):
        model = make(verify)
        peaks[name] = [memory.eager_peak(step, model, x).total for _ in range(2)]
    assert peaks["checked"][0] - peaks["unchecked"][0] == x.numel() * x.element_size()
    assert peaks["checked"][1] == peaks["unchecked"][1]


# ---------------------------------------------------------------------------------------------------------------
# XLA: read once the step has run, never forcing it


def test_value_ready_capability():
    assert backends.value_ready(torch.ones(2))
    if not backends.xla_available():
        return
    device = backends.device_for("xla")
    x = torch.ones(3, device=device)
    backends.sync(device)
    pending = (x * 2).max()
    assert backends.value_ready(x) and not backends.value_ready(pending)
    backends.sync(device)
    assert backends.value_ready(pending) and float(pending) == 2.0


@pytest.fixture(scope="module")
def xla():
    if not backends.xla_available():
        pytest.skip("torch_xla is not installed (pip install 'revlib_xla[xla]')")
    return backends.device_for("xla")


def _compiles(device, run):
    before = backends.compilations(device)
    run()
    backends.sync(device)
    return backends.compilations(device) - before


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
def test_xla_refuses_at_the_next_forward_after_the_step_ran(xla, scan):
    """No value is read inside the step: a micro-batch's forward before the sync waits (nothing runs), and the
    first forward after it raises for the previous step."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)) for _ in range(4)]
    for p in (p for b in blocks for p in b.parameters()):
        nn.init.normal_(p, std=1.0)
    model = ReversibleSequential(*blocks, split_dim=-1, verify_inverse="rebuild", scan=scan, exact=False)
    model = model.bfloat16().to(xla)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    import torch_xla.debug.metrics as met

    backends.sync(xla)
    executed = met.metric_data("ExecuteTime")
    before = 0 if executed is None else executed[0]
    model(x.to(xla)).float().square().mean().backward()
    model(x.to(xla)).float().square().mean().backward()  # the second micro-batch: its value is not computed yet
    executed = met.metric_data("ExecuteTime")
    assert (0 if executed is None else executed[0]) == before  # nothing ran inside the steps
    assert len(model._rebuild_pending) == 1
    backends.sync(xla)
    with pytest.raises(revlib.ReversibleError, match=REFUSED + r": The previous training step's backward"):
        model(x.to(xla))
    assert not model._rebuild_pending


def test_xla_checks_by_default_at_the_cost_of_one_graph(xla):
    """SGD (no optimizer state): by default the first step's graph gets the check's output, so the second step's
    graph is new (one more compilation) and the third compiles nothing; verify_inverse=False costs none."""

    def run(verify, batch):  # a batch size of its own: no graph cached from the other run
        torch.manual_seed(0)
        model = ReversibleSequential(*mlp_blocks(2, width=4), split_dim=-1, **verify).to(xla)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(4)).to(xla)

        def step():
            opt.zero_grad(set_to_none=True)
            (model(x) - x).square().mean().backward()
            opt.step()

        return [_compiles(xla, step) for _ in range(3)], model

    counts, model = run({"verify_inverse": False}, 5)
    assert counts[0] >= 1 and counts[1:] == [0, 0] and not model._verified
    for verify, batch in (({}, 7), ({"verify_inverse": "rebuild"}, 9)):
        counts, model = run(verify, batch)
        assert counts[0] >= 1 and counts[1:] == [1, 0] and model._verified and not model._rebuild_pending


def test_traced_steps_have_the_program_of_an_unchecked_step(xla):
    """memory.step_stablehlo traces without running: nothing is armed, and the program is the unchecked one."""
    from revlib_xla import memory

    texts = []
    for verify in ("rebuild", False):
        torch.manual_seed(0)
        model = ReversibleSequential(*mlp_blocks(2, width=4), split_dim=-1, verify_inverse=verify)
        texts.append(memory.step_stablehlo(lambda m, x: m(x).sum().backward(), model, torch.randn(2, 8)))
        assert not model._verified and not model._rebuild_pending
    assert texts[0] == texts[1]


def test_under_autocast_the_blocks_dtype_sets_the_tolerance(monkeypatch):
    """Float32 streams with blocks computing in bfloat16 under autocast: bfloat16's tolerance, as for
    compute_dtype=torch.bfloat16 (the tolerance check_invertible applies to the coarser of the two)."""
    armed = []
    keep = _rebuild_check.RebuildCheck.keep
    monkeypatch.setattr(_rebuild_check.RebuildCheck, "keep", lambda self, *a: (armed.append(self), keep(self, *a)))
    x = good_input().float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = good_stack().float()(x).float().sum()
    loss.backward()
    plain = good_stack().float()
    plain(x).sum().backward()
    assert [c.tolerance for c in armed] == [3e-2, 1e-4] and armed[0].autocast is torch.bfloat16


# -- two threads at once -----------------------------------------------------------------------------------------------
# Two threads training two reversible models at once: the rebuild check's and the recompute engine's state is per
# thread (``threading.local``), so each thread's gradients are those of the same steps run one after the other
# (float64; the CPU's autograd engine runs a backward on the thread that calls it). No dropout: both threads would
# draw from torch's one global generator in an order the scheduler picks, so no sequential run has their masks.
STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def _train(seed: int, out: list, together: threading.Barrier | None = None) -> None:
    """STEPS steps of SGD on one model, recording each step's gradients; weights and data from a generator of its
    own (the global one is shared by the threads). ``together``: both threads run each forward, then each backward,
    at the same time (each forward leaves the rebuild check's first verdict and the engine's state pending while
    the other thread runs)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [Block() for _ in range(3)]
    with torch.no_grad():
        for p in (p for b in blocks for p in b.parameters()):
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    model = ReversibleSequential(*blocks, split_dim=-1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        x = torch.randn(16, 8, dtype=torch.float64, generator=g)
        if together is not None:
            together.wait()
        loss = model(x).square().mean()
        if together is not None:
            together.wait()
        loss.backward()
        out.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()


def test_two_threads_train_as_one_after_the_other():
    sequential: dict[int, list] = {0: [], 1: []}
    for seed in (0, 1):
        _train(seed, sequential[seed])
    concurrent: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []
    together = threading.Barrier(2, timeout=60)

    def run(seed: int) -> None:
        try:
            _train(seed, concurrent[seed], together)
        except BaseException as exc:  # reported below: a thread's exception is otherwise only printed
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for seed in (0, 1):
        assert len(concurrent[seed]) == STEPS
        for got_step, want_step in zip(concurrent[seed], sequential[seed]):
            for got, want in zip(got_step, want_step):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
