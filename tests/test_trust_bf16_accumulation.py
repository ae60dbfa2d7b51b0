"""Gradient accumulation with bfloat16 device gradients (``optim.grad_accum_steps > 1`` with
``strategy.param_dtype=bf16``): the micro-batches' gradients are summed in float32 (on the host, beside the float32
masters, as ZeRO-Offload does), not in bfloat16 on the device, where each addition would round the running sum to 8
bits again."""

import torch

from revlib_xla import backend
from revlib_xla.train.config import load_config
from revlib_xla.train.strategy import HostOptimizerState, build_model, build_optimizer, lm_loss, lr_at, make_step

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
        backend.sync(device)
    got = dict((id(p), h) for p, h in opt.master_weights())
    for p, m in zip(params, masters):
        master = got[id(p)].double()
        limit = 1e-5 * o.lr + 4 * 2**-24 * m.detach().abs()
        excess = ((master - m.detach()).abs() - limit).max().item()
        assert excess <= 0, f"{tuple(p.shape)}: a master is off the float64 reference by {excess:.3g} beyond the limit"
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
