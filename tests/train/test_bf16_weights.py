"""strategy.param_dtype=bf16: bfloat16 weights and gradients on the device, float32 master weights and AdamW on the
host. The weights after a few steps equal a reference written here (float32 masters stepped by AdamW with the
gradients of a bfloat16-rounded forward and backward), on cpu and xla; gradient accumulation sums the micro-batches'
gradients in float32; bad combinations are refused by name."""

import re

import pytest
import torch

from revlib_xla import backends
from revlib_xla.train.config import ConfigError, load_config
from revlib_xla.train.strategy import (
    HostOptimizerState,
    build_model,
    build_optimizer,
    lm_loss,
    lr_at,
    make_step,
    state_bytes_per_param,
)

TINY = [
    "model.overrides={vocab_size: 256, dim: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, ffn_dim: 64}",
    "data.seq_len=12",
    "data.batch_size=4",
    "optim.lr=1e-2",
    "optim.warmup_steps=1",
    "strategy=reversible",
    "strategy.loss_chunk=4",
]
BF16 = ["strategy.param_dtype=bf16", "strategy.precision=bf16", "strategy.offload.optimizer=true"]
STEPS = 3


def _batches():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (4, 12), generator=g) for _ in range(STEPS)]


def _reference(cfg, device):
    """The mixed-precision step written out: bfloat16 copies of float32 masters compute the loss and gradients
    under bf16 autocast on ``device`` (gradients clipped there as the library does), and torch's AdamW updates the
    float32 masters on the host."""
    model = build_model(load_config(None, TINY), device)  # float32 weights from the same seed
    params = list(model.parameters())
    masters = [p.detach().cpu().to(torch.bfloat16).float().requires_grad_() for p in params]
    decay = [m for m in masters if m.ndim >= 2]
    rest = [m for m in masters if m.ndim < 2]
    o = cfg.optim
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
    )
    autocast_type = backends.backend_for(device).autocast_device_type
    for i, batch in enumerate(_batches()):
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.data = m.detach().to(torch.bfloat16).to(device)
        with torch.autocast(device_type=str(autocast_type), dtype=torch.bfloat16):
            loss = model.loss(batch.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        backends.sync(device)  # one graph for all gradients (on XLA each read would run the backward again)
        for p, m in zip(params, masters):
            m.grad = p.grad.detach().cpu().float()
            p.grad = None
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, i)
        opt.step()
    return masters


@pytest.mark.parametrize("kind", ["cpu", pytest.param("xla", marks=pytest.mark.slow)])
def test_bf16_weights_step_as_fp32_masters_over_a_bf16_forward_and_backward(kind):
    """The masters after three steps equal the reference's to 1e-3 of one step's size (lr): both run the same
    forward and backward and torch's AdamW on the same float32 numbers; on XLA the step's graph holds more (the
    loss, the clipping) and may fuse a reduction differently, which moves a bfloat16 gradient by its last bit and
    the AdamW update by about 1e-5 of lr per step. A step applied in bfloat16 instead would be off by half a bfloat16
    ulp of the weight (~4e-3 lr here), a skipped or doubled step by lr."""
    if not backends.device_available(kind):
        pytest.skip(f"no {kind} device")
    device = backends.device_for(kind)
    cfg = load_config(None, [*TINY, *BF16, f"train.device={device.type}"])
    model = build_model(cfg, device)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers()} == {torch.float32}  # the rotary tables stay float32
    opt = build_optimizer(cfg, model)
    assert isinstance(opt, HostOptimizerState)
    step = make_step(cfg, model, opt)
    inner_step, with_gradients = opt.inner.step, []

    def counting_step():  # the host holds one float32 gradient at a time
        with_gradients.append(sum(h.grad is not None for h in opt.host))
        return inner_step()

    opt.inner.step = counting_step
    for i, batch in enumerate(_batches()):
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, i)
        step(batch)
        backends.sync(device)
    expected = _reference(cfg, device)
    pairs = opt.master_weights()
    assert [p for p, _ in pairs] == list(model.parameters())
    for (p, master), ref in zip(pairs, expected):
        assert master.dtype == torch.float32 and master.device.type == "cpu"
        torch.testing.assert_close(master, ref.detach(), rtol=0, atol=1e-3 * cfg.optim.lr)
        assert torch.equal(p.detach().cpu(), master.to(torch.bfloat16))  # the device holds the masters, rounded
    flat = torch.cat([m.flatten() for _, m in pairs])
    assert (flat != flat.to(torch.bfloat16).float()).float().mean() > 0.9  # the masters keep float32 precision
    hbm_state = sum(p.numel() for p in model.parameters()) * state_bytes_per_param(cfg)
    assert hbm_state == sum(p.numel() * 4 for p in model.parameters())  # bf16 weight + bf16 gradient
    assert opt.host_state_bytes() == 3 * flat.numel() * 4  # float32 master + AdamW's two moments
    assert with_gradients == [1] * (STEPS * len(pairs))
    assert opt.host_step_bytes() == 4 * max(p.numel() for p, _ in pairs)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["strategy.param_dtype=bf16", "strategy.precision=bf16"], r"param_dtype=bf16 .*offload.optimizer=true"),
        (["strategy.param_dtype=bf16", "strategy.offload.optimizer=true"], r"needs strategy.precision=bf16"),
        ([*BF16, "strategy.offload.params=true", "strategy=none"], r"offload.params=false"),
        (["strategy.param_dtype=fp16"], r"strategy.param_dtype.*'fp32', 'bf16'"),
    ],
)
def test_bf16_weights_refuse_what_cannot_keep_fp32_masters(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, [*TINY, *overrides])


@pytest.mark.skipif(not backends.xla_available(), reason="torch_xla is not installed")
def test_bf16_weights_are_sized_as_bf16_weights_and_gradients_in_hbm_and_float32_state_on_the_host():
    """`revlib-xla memory`'s trace of the step (revlib_xla.fit): the program's parameters are the bfloat16 weights
    (2 bytes each), the gradients it sends to the host are bfloat16 outputs, no optimizer state is in it, and the
    host holds the float32 masters and AdamW's two moments (12 bytes per weight)."""
    from revlib_xla.fit.strategies import trace_config
    from revlib_xla.fit.trace import OPTIMIZER, PARAMETERS
    from revlib_xla.models.llama import num_params
    from revlib_xla.train.strategy import model_config

    cfg = load_config(None, [*TINY, *BF16, "data.batch_size=2"])
    traced = trace_config(cfg)
    n = num_params(model_config(cfg))
    assert traced.argument_bytes(PARAMETERS) == 2 * n and traced.argument_bytes(OPTIMIZER) == 0
    assert traced.host_bytes == 12 * n
    gradients = [name for name in traced.outputs if name.startswith("gradient to host")]
    main = traced.stablehlo[traced.stablehlo.index("@main(") :]
    results = main[main.index(") -> (") : main.index(" {\n")]
    types = re.findall(r"tensor<([^>]*)>", results)
    assert len(types) == len(traced.outputs) and len(gradients) == len(list(build_model(cfg, "meta").parameters()))
    sent = [t for t, name in zip(types, traced.outputs) if name in gradients]
    assert all(t.endswith("xbf16") or t == "bf16" for t in sent)  # every gradient sent to the host is bfloat16


# -- gradient accumulation ---------------------------------------------------------------------------------------------
# Gradient accumulation with bfloat16 device gradients (``optim.grad_accum_steps > 1`` with
# ``strategy.param_dtype=bf16``): the micro-batches' gradients are summed in float32 (on the host, beside the float32
# masters, as ZeRO-Offload does), not in bfloat16 on the device, where each addition would round the running sum to 8
# bits again.
ACCUM = 4
CFG = [
    "model.overrides={vocab_size: 256, dim: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, ffn_dim: 64}",
    "data.seq_len=12",
    f"data.batch_size={2 * ACCUM}",
    f"optim.grad_accum_steps={ACCUM}",
    "optim.lr=1e-2",
    "optim.warmup_steps=1",
    "strategy=reversible",
    "strategy.param_dtype=bf16",
    "strategy.precision=bf16",
    "strategy.offload.optimizer=true",
    "train.device=cpu",
]


def test_bf16_gradients_accumulate_in_float32_over_micro_batches():
    """Two steps of four micro-batches; before each, the same bfloat16 weights give the reference its micro-batch
    gradients (the same ops as the step's: bfloat16 numbers, bit for bit on one machine), summed, clipped and
    stepped by AdamW in float64. The library's masters may differ from it by float32 arithmetic only: AdamW's
    update in float32 (a few float32 ulps of lr per step), the masters' own rounding (an ulp of the weight per
    step), the float32 sum of four bfloat16 numbers (exact unless their exponents are 16 apart): over two steps
    well within 1e-5 of lr plus 4 ulps of the weight. Summed in bfloat16 the running sum is rounded to 8 bits at
    each addition (up to 3 * 2**-9 of the gradient at four micro-batches), which moves the second step's AdamW
    update by up to ~1e-3 of lr."""
    cfg = load_config(None, CFG)
    device = torch.device("cpu")
    model = build_model(cfg, device)
    opt = build_optimizer(cfg, model)
    assert isinstance(opt, HostOptimizerState)
    step = make_step(cfg, model, opt)
    params = list(model.parameters())
    masters = [p.detach().double().requires_grad_() for p in params]
    o = cfg.optim
    ref = torch.optim.AdamW(
        [
            {"params": [m for m in masters if m.ndim >= 2], "weight_decay": o.weight_decay},
            {"params": [m for m in masters if m.ndim < 2], "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
    )
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        batch = torch.randint(0, 256, (cfg.data.batch_size, cfg.data.seq_len), generator=g)
        sums = [torch.zeros_like(m) for m in masters]
        for micro in batch.chunk(ACCUM):
            with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
                loss = lm_loss(model, micro) / ACCUM
            loss.backward()
            for s, p in zip(sums, params):
                assert p.grad.dtype == torch.bfloat16
                s += p.grad.double()
                p.grad = None
        for m, s in zip(masters, sums):
            m.grad = s
        torch.nn.utils.clip_grad_norm_(masters, o.grad_clip)
        for group in [*ref.param_groups, *opt.param_groups]:
            group["lr"] = lr_at(cfg, i)
        ref.step()
        step(batch)
        backends.sync(device)
    got = dict((id(p), h) for p, h in opt.master_weights())
    for p, m in zip(params, masters):
        master = got[id(p)].double()
        limit = 1e-5 * o.lr + 4 * 2**-24 * m.detach().abs()
        excess = ((master - m.detach()).abs() - limit).max().item()
        assert excess <= 0, f"{tuple(p.shape)}: a master is off the float64 reference by {excess:.3g} beyond the limit"
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
