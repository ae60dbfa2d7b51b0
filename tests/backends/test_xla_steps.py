"""Training steps on XLA compile once, and dropout is replayed exactly in the reversible backward.

* Static shapes (requirement 8): after warm-up, further reversible training steps (forward, loss, backward, AdamW)
  on the XLA device compile nothing new, with and without dropout, ending each step with ``torch_xla.sync()`` or
  running it under ``torch_xla.compile``. The per-layer RNG capture/replay must not turn seeds into graph constants.
* RNG replay (requirement 3): with ``Dropout(0.5)`` blocks, the reversible gradients equal the ``no_savings``
  gradients drawn from the same random state on the same device, over two consecutive steps whose masks differ
  (the replay must neither freeze nor shift the random stream). Without replay they do not match (the test's
  control).
* No hidden device read per step: after the first step, the reversible and planned Llama's steps and a converted
  transformers Llama's read nothing from the device but the rebuild check's first verdict.
"""

import copy

import pytest
import torch
from conftest import max_rel_err, to_host
from torch import nn

import revlib_xla as revlib
from revlib_xla import backends

WIDTH = 16  # features per stream
BATCH = 8
DEPTH = 4  # reversible layers


def _block(width: int, p: float) -> nn.Module:
    """A small transformer-MLP-like block; two dropouts so each layer draws from the RNG more than once."""
    return nn.Sequential(
        nn.LayerNorm(width),
        nn.Linear(width, 2 * width),
        nn.GELU(),
        nn.Dropout(p),
        nn.Linear(2 * width, width),
        nn.Dropout(p),
    )


def _model(p: float, memory_mode=revlib.MemoryModes.autograd_function, preserve_rng_state=True, seed=0, exact=None):
    torch.manual_seed(seed)
    # scan=False: these tests compare the unrolled walk's outputs bit for bit with no_savings
    # (tests/reversible/test_scan.py compares the scanned walk, which XLA fuses differently, with the unrolled one)
    return revlib.ReversibleSequential(
        *[_block(WIDTH, p) for _ in range(DEPTH)],
        memory_mode=memory_mode,
        preserve_rng_state=preserve_rng_state,
        scan=False,
        exact=exact,
    )


def _seed_all(device: torch.device, seed: int) -> None:
    torch.manual_seed(seed)
    if device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed, str(device))


# ---------------------------------------------------------------------------------------------------------------
# Requirement 8: no compilation after warm-up.


def _xla_or_skip():
    if not backends.xla_available():
        pytest.skip("torch_xla is not installed (pip install 'revlib_xla[xla]')")
    import torch_xla
    import torch_xla.debug.metrics as met

    return torch_xla, met


def _compiles_since_clear(met) -> int:
    data = met.metric_data("CompileTime")  # None when nothing compiled since clear_all()
    return 0 if data is None else data[0]


@pytest.mark.parametrize("p", [0.0, 0.5], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("runner", ["sync", "compile"])
@pytest.mark.slow
def test_xla_training_step_compiles_once(p, runner):
    torch_xla, met = _xla_or_skip()
    dev = backends.device_for("xla")
    model = _model(p).to(dev)
    before = [t.detach().cpu().clone() for t in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(x, target):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        return loss

    if runner == "compile":
        step = torch_xla.compile(step, full_graph=True, name=f"rev_step_{runner}_{p}")

    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(BATCH, 2 * WIDTH, generator=gen), torch.randn(BATCH, 2 * WIDTH, generator=gen)) for _ in range(6)
    ]  # made on the host with fixed shapes
    losses = []  # kept alive in warm-up too: a live loss is a graph output, and the output set is part of the graph
    for x, target in batches[:2]:  # warm-up: step 0 has no optimizer state yet, step 1 has
        losses.append(step(x.to(dev), target.to(dev)))
        torch_xla.sync()
    met.clear_all()
    for x, target in batches[2:]:
        losses.append(step(x.to(dev), target.to(dev)))
        torch_xla.sync()
    report = met.short_metrics_report()
    assert _compiles_since_clear(met) == 0, report
    assert met.counter_value("UncachedCompile") is None, report
    assert met.counter_value("CachedCompile") == len(batches) - 2, report
    assert all(torch.isfinite(loss.detach().cpu()) for loss in losses)
    after = [t.detach().cpu() for t in model.parameters()]
    assert all(not torch.equal(b, a) for b, a in zip(before, after)), "the optimizer did not update every parameter"


def test_xla_rng_seed_is_graph_data_not_constant():
    """Replaying a seed must feed it to the graph as data: two different seeds (including the values 0 and 1, which
    torch_xla bakes in as constants for ordinary scalars) give different masks from one compiled graph."""
    torch_xla, met = _xla_or_skip()
    import torch_xla.core.xla_model as xm

    dev = backends.device_for("xla")
    ones = torch.ones(256).to(dev)
    torch_xla.sync()
    masks = []
    for i, seed in enumerate([12345, 0, 1, 2**63 + 5]):
        if i == 1:
            met.clear_all()
        xm.set_rng_state(seed, str(dev))
        masks.append(nn.functional.dropout(ones, 0.5))
        torch_xla.sync()
    assert _compiles_since_clear(met) == 0, met.short_metrics_report()
    masks = [m.cpu() for m in masks]
    assert all(not torch.equal(a, b) for i, a in enumerate(masks) for b in masks[i + 1 :])


# ---------------------------------------------------------------------------------------------------------------
# Requirement 3: dropout replay gives exactly the no_savings gradients, on every device.


def _data():
    gen = torch.Generator().manual_seed(2)
    return torch.randn(BATCH, 2 * WIDTH, generator=gen), torch.randn(BATCH, 2 * WIDTH, generator=gen)


def _pair(device, preserve_rng_state=True):
    """A no_savings reference and a reversible copy. On XLA with floating-point streams: with exact streams the
    compiler fuses the LayerNorm's reduction of the step's graph differently from the reference's, so outputs and
    gradients differ in their last bits (see tests/reversible/test_exact_streams.py), which would hide what these
    tests look for, a different dropout mask; float streams compile to the same bits."""
    exact = False if device.type == "xla" else None
    reference = _model(0.5, memory_mode=revlib.MemoryModes.no_savings, exact=exact)
    reversible = _model(0.5, preserve_rng_state=preserve_rng_state, exact=exact)
    reversible.load_state_dict(copy.deepcopy(reference.state_dict()))
    return reference, reversible


def _fwd_bwd(model: nn.Module, device: torch.device, x_host: torch.Tensor, w_host: torch.Tensor):
    """One forward/backward on the same input; returns the output and the gradients (input first), on the host."""
    model.zero_grad(set_to_none=True)
    x = x_host.to(device, copy=True).requires_grad_()  # a new leaf each call (`.to` is a no-op on cpu)
    out = model(x)
    (out * w_host.to(device)).sum().backward()
    backends.sync(device)
    grads = [x.grad] + [p.grad for p in model.parameters()]
    return to_host(out).clone(), [to_host(g).clone() for g in grads]


def _assert_same(got, expected, what: str):
    (rev_out, rev_grads), (ref_out, ref_grads) = got, expected
    assert torch.equal(rev_out, ref_out), f"{what}: the forward drew different dropout masks"
    assert len(rev_grads) == len(ref_grads)
    for k, (g, r) in enumerate(zip(rev_grads, ref_grads)):
        assert g is not None and r is not None, f"{what}: gradient {k} is missing"
        err = max_rel_err(g, r)
        assert err < 1e-5, f"{what}, gradient {k} (0 = input): rel err {err:.3g}"


@pytest.mark.slow
def test_dropout_replay_matches_no_savings(device):
    """Two consecutive reversible steps (the random stream runs on between them), each compared with a no_savings
    step run from the random state that step started from."""
    reference, reversible = (m.to(device) for m in _pair(device))
    x_host, w_host = _data()
    _seed_all(device, 1234)
    states, got = [], []
    for _ in range(2):
        states.append(backends.RngState.capture(device))  # after a sync: the whole state (base seed too, on XLA)
        got.append(_fwd_bwd(reversible, device, x_host, w_host))
    for step, state in enumerate(states):
        state.restore()
        _assert_same(got[step], _fwd_bwd(reference, device, x_host, w_host), f"step {step}")
    # The two steps drew different masks: the replay did not freeze the random stream.
    (out0, grads0), (out1, grads1) = got
    assert not torch.equal(out0, out1)
    assert max_rel_err(grads0[0], grads1[0]) > 0.1


def test_dropout_stream_matches_no_savings_across_steps(device):
    """A run of steps from one seed draws the same masks whatever the memory mode: the replay leaves the random
    stream where no_savings leaves it (both modes run each layer under the same per-layer seed)."""
    reference, reversible = (m.to(device) for m in _pair(device))
    x_host, w_host = _data()
    runs = []
    for model in (reference, reversible):
        _seed_all(device, 1234)
        runs.append([_fwd_bwd(model, device, x_host, w_host) for _ in range(3)])
    for step in range(3):
        _assert_same(runs[1][step], runs[0][step], f"step {step}")


@pytest.mark.slow
def test_dropout_without_replay_differs(device):
    """Control: the comparison above detects a missing replay (the recomputation then draws other masks). Unchecked:
    by default the backward's measure of its rebuilt input refuses these gradients
    (tests/reversible/test_rebuild_check.py)."""
    reference, reversible = (m.to(device) for m in _pair(device, preserve_rng_state=False))
    reversible.verify_inverse = False
    x_host, w_host = _data()
    _seed_all(device, 1234)
    _, ref_grads = _fwd_bwd(reference, device, x_host, w_host)
    _seed_all(device, 1234)
    _, rev_grads = _fwd_bwd(reversible, device, x_host, w_host)
    assert max_rel_err(rev_grads[0], ref_grads[0]) > 0.1


# -- no hidden device read per step ------------------------------------------------------------------------------------
# No hidden device read per step on XLA: after the first step, the training steps of the reversible and planned Llama
# (``strategy=reversible``/``plan``) and of a transformers Llama converted by ``revlib_xla.hf.memory_efficient``
# (``plan``, ``reversible``; called without an attention mask) bring nothing from the device to the host, except the
# rebuild check's verdict of the first step, read once (already computed) at the second step's forward. A read in the
# middle of a step runs the graph there: two graphs per step instead of one.
needs_xla = pytest.mark.skipif(not backends.xla_available(), reason="torch_xla is not installed")

STEPS = 4
CASES = {"reversible": 1, "plan": 0, "hf-plan": 0, "hf-reversible": 1}  # the transfers over steps 2..4


def _llama_step(strategy, device):
    from revlib_xla.train.config import load_config
    from revlib_xla.train.strategy import build_model, build_optimizer, make_step

    cfg = load_config(
        None,
        [
            "model.overrides={vocab_size: 256, dim: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, ffn_dim: 64}",
            "data.seq_len=12",
            "data.batch_size=4",
            "train.device=xla",
            f"strategy={strategy}",
        ],
    )
    model = build_model(cfg, device)
    return make_step(cfg, model, build_optimizer(cfg, model))


def _hf_model(strategy):
    from revlib_xla.hf import memory_efficient
    from revlib_xla.hf.configs import model_from_config

    torch.manual_seed(0)
    return memory_efficient(model_from_config("llama-tiny", num_hidden_layers=2), strategy)


def _hf_step(strategy, device):
    model = _hf_model(strategy).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(tokens):
        out = model(input_ids=tokens.to(device), labels=tokens.to(device), use_cache=False)  # no attention mask
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out.loss.detach()

    return step


@pytest.fixture(scope="module")
def transfers():
    pytest.importorskip("transformers")
    import torch_xla.debug.metrics as met

    device = backends.device_for("xla")
    tokens = torch.randint(0, 256, (STEPS, 4, 12), generator=torch.Generator().manual_seed(0))
    counted, first_losses = {}, {}
    for case in CASES:
        step = _hf_step(case[3:], device) if case.startswith("hf-") else _llama_step(case, device)
        losses = [step(tokens[0])]
        backends.sync(device)
        met.clear_all()
        for batch in tokens[1:]:
            losses.append(step(batch))  # kept alive, not read
            backends.sync(device)
        data = met.metric_data("TransferFromDeviceTime")
        counted[case] = (0 if data is None else data[0], met.counter_value("xla::_to_cpu") or 0)
        first_losses[case] = float(losses[0])
    return counted, first_losses, tokens


@needs_xla
@pytest.mark.slow  # eight small XLA compilations
def test_steps_after_the_first_read_nothing_from_the_device(transfers):
    """Before: the transformers model read its position ids from the device at every step (3 reads, and 7 graph
    executions for 3 steps)."""
    counted, _, _ = transfers
    assert counted == {case: (n, n) for case, n in CASES.items()}


@needs_xla
@pytest.mark.slow
def test_the_causal_mask_given_on_xla_is_the_one_transformers_builds(transfers):
    """The first step's loss on XLA (mask given by the conversion) equals transformers' own on the CPU (mask built
    by transformers), to float32 rounding across two backends."""
    _, first_losses, tokens = transfers
    model = _hf_model("plan")
    with torch.no_grad():
        expected = model(input_ids=tokens[0], labels=tokens[0], use_cache=False).loss
    assert first_losses["hf-plan"] == pytest.approx(float(expected), rel=1e-5)


@needs_xla
@pytest.mark.slow  # four small XLA compilations
def test_first_step_learns_which_buffers_change_without_running_the_graph():
    """BatchNorm on XLA updates its running statistics without bumping their version counters, so the recompute
    engine compares values at the first run; before, that compare (torch.equal) ran the graph in the middle of the
    first step. Now nothing runs before the step's sync, and the reversible model's gradients and running
    statistics after two steps equal plain autograd's (no_savings) on the same device."""
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    from torch import nn

    import revlib_xla as revlib

    device = backends.device_for("xla")
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(4, 4, bias=False), nn.BatchNorm1d(4), nn.Tanh()) for _ in range(3)]
    model = revlib.ReversibleSequential(*blocks, split_dim=-1, scan=False)
    reference = revlib.ReversibleSequential(
        *[nn.Sequential(*(copy_of(m) for m in b)) for b in blocks],
        split_dim=-1,
        scan=False,
        memory_mode=revlib.MemoryModes.no_savings,
    )
    model, reference = model.to(device), reference.to(device)
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))
    results = []
    for net in (model, reference):
        backends.sync(device)
        xm.wait_device_ops()  # the executions are asynchronous: counted once done
        executed = met.metric_data("ExecuteTime")
        before = 0 if executed is None else executed[0]
        for i in range(2):
            net(x[i].to(device)).square().sum().backward()
            if i == 0 and net is model:
                executed = met.metric_data("ExecuteTime")
                assert (0 if executed is None else executed[0]) == before  # nothing ran inside the first step
            backends.sync(device)
        results.append([t.detach().cpu() for t in (*[p.grad for p in net.parameters()], *net.buffers())])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def copy_of(module):
    import copy

    return copy.deepcopy(module)
