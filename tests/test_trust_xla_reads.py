"""No hidden device read per step on XLA: after the first step, the training steps of the reversible and planned
Llama (``strategy=reversible``/``plan``) and of a transformers Llama converted by ``revlib_xla.hf.memory_efficient``
(``plan``, ``reversible``; called without an attention mask) bring nothing from the device to the host, except the
rebuild check's verdict of the first step, read once (already computed) at the second step's forward. A read in
the middle of a step runs the graph there: two graphs per step instead of one."""

import pytest
import torch

from revlib_xla import backend

pytestmark = pytest.mark.skipif(not backend.xla_available(), reason="torch_xla is not installed")

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

    device = backend.device_for("xla")
    tokens = torch.randint(0, 256, (STEPS, 4, 12), generator=torch.Generator().manual_seed(0))
    counted, first_losses = {}, {}
    for case in CASES:
        step = _hf_step(case[3:], device) if case.startswith("hf-") else _llama_step(case, device)
        losses = [step(tokens[0])]
        backend.sync(device)
        met.clear_all()
        for batch in tokens[1:]:
            losses.append(step(batch))  # kept alive, not read
            backend.sync(device)
        data = met.metric_data("TransferFromDeviceTime")
        counted[case] = (0 if data is None else data[0], met.counter_value("xla::_to_cpu") or 0)
        first_losses[case] = float(losses[0])
    return counted, first_losses, tokens


@pytest.mark.slow  # eight small XLA compilations
def test_steps_after_the_first_read_nothing_from_the_device(transfers):
    """Before: the transformers model read its position ids from the device at every step (3 reads, and 7 graph
    executions for 3 steps)."""
    counted, _, _ = transfers
    assert counted == {case: (n, n) for case, n in CASES.items()}


@pytest.mark.slow
def test_the_causal_mask_given_on_xla_is_the_one_transformers_builds(transfers):
    """The first step's loss on XLA (mask given by the conversion) equals transformers' own on the CPU (mask built
    by transformers), to float32 rounding across two backends."""
    _, first_losses, tokens = transfers
    model = _hf_model("plan")
    with torch.no_grad():
        expected = model(input_ids=tokens[0], labels=tokens[0], use_cache=False).loss
    assert first_losses["hf-plan"] == pytest.approx(float(expected), rel=1e-5)


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

    device = backend.device_for("xla")
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
        backend.sync(device)
        xm.wait_device_ops()  # the executions are asynchronous: counted once done
        executed = met.metric_data("ExecuteTime")
        before = 0 if executed is None else executed[0]
        for i in range(2):
            net(x[i].to(device)).square().sum().backward()
            if i == 0 and net is model:
                executed = met.metric_data("ExecuteTime")
                assert (0 if executed is None else executed[0]) == before  # nothing ran inside the first step
            backend.sync(device)
        results.append([t.detach().cpu() for t in (*[p.grad for p in net.parameters()], *net.buffers())])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def copy_of(module):
    import copy

    return copy.deepcopy(module)
