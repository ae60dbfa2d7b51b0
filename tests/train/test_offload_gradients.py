"""strategy.offload.gradients: each gradient goes to the host as the backward produces it, AdamW steps the float32
masters there (each weight as soon as its gradient is whole where nothing needs them all first). The masters after
several steps equal, bit for bit, plain float32 AdamW's stepped with the float32 gradients of the same bfloat16
forward and backward, with torch's global-norm clipping and gradient accumulation; the device never holds a full
set of gradients; bad combinations are refused by name."""

import pytest
import torch

from revlib_xla.optim.gradient_stream import GradientStream
from revlib_xla.train.config import ConfigError, load_config
from revlib_xla.train.strategy import StrategyError, build_model, build_optimizer, lr_at, make_step

TINY = [
    "model.overrides={vocab_size: 256, dim: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, ffn_dim: 64, "
    "tie_embeddings: false}",
    "data.seq_len=12",
    "data.batch_size=4",
    "optim.lr=1e-2",
    "optim.warmup_steps=1",
    "strategy=reversible",
    "strategy.loss_chunk=4",
    "strategy.param_dtype=bf16",
    "strategy.precision=bf16",
    "strategy.offload.optimizer=true",
]
STREAM = ["strategy.offload.gradients=true"]
STEPS = 4


def _batches(n=STEPS):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (4, 12), generator=g) for _ in range(n)]


def _reference(cfg):
    """Plain float32 AdamW over float32 masters: the bfloat16 model (the masters rounded) computes each
    micro-batch's loss and gradients under bf16 autocast; each gradient, widened to float32, is summed over the
    micro-batches in float32 and clipped with torch's clip_grad_norm_."""
    model = build_model(load_config(None, [*TINY, *_not_streamed(cfg)]), "cpu")
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_() for p in params]
    o = cfg.optim
    groups = [
        {"params": [m for m in masters if m.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [m for m in masters if m.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)
    accum = o.grad_accum_steps
    losses = []
    for i, batch in enumerate(_batches()):
        total = None
        for micro in batch.chunk(accum):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model.loss(micro) / accum
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()  # as make_step sums them
            for p, m in zip(params, masters):
                g = p.grad.detach().float()
                m.grad = g if m.grad is None else m.grad.add_(g)
                p.grad = None
        losses.append(float(total))
        if o.grad_clip > 0:  # torch's clip_grad_norm_ in its two parts (torch_xla replaces the whole function)
            norm = torch.nn.utils.get_total_norm([m.grad for m in masters], 2.0)
            torch.nn.utils.clip_grads_with_norm_(masters, o.grad_clip, norm)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, i)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return masters, losses


def _not_streamed(cfg):
    return [f"optim.grad_clip={cfg.optim.grad_clip}", f"optim.grad_accum_steps={cfg.optim.grad_accum_steps}"]


def _built(overrides, watch=None):
    """The streamed run's model, optimizer and step; ``watch(param)`` runs as autograd accumulates each gradient,
    before the stream takes it (its hook is registered first)."""
    cfg = load_config(None, [*TINY, *STREAM, *overrides])
    model = build_model(cfg, "cpu")
    if watch is not None:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(watch)
    opt = build_optimizer(cfg, model)
    assert isinstance(opt.stream, GradientStream)
    return cfg, model, opt, make_step(cfg, model, opt)


def _streamed(overrides, overlap=False):
    held = []
    params = []

    def watch(param):  # the gradients the device holds as each one arrives
        held.append(sum(p.grad is not None for p in params))

    cfg, model, opt, step = _built(overrides, watch)
    opt.stream.overlap = overlap  # a host thread takes the gradients (cuda's default), or the hook itself (cpu's)
    params.extend(model.parameters())
    losses = []
    for i, batch in enumerate(_batches()):
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, i)
        losses.append(float(step(batch)))
    return cfg, model, opt, losses, held


@pytest.mark.parametrize(
    "overrides",
    [["optim.grad_clip=0"], ["optim.grad_clip=1.0"], ["optim.grad_clip=0.05", "optim.grad_accum_steps=2"]],
    ids=["unclipped", "clipped", "clipped-accumulated"],
)
@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "host-thread"])
def test_streamed_gradients_step_the_masters_as_plain_fp32_adamw_bit_for_bit(overrides, overlap):
    """clip 0.05 is below the gradients' norm here: the clipping factor is applied at every step."""
    cfg, model, opt, losses, held = _streamed(overrides, overlap)
    expected, expected_losses = _reference(cfg)
    assert losses == pytest.approx(expected_losses, rel=0, abs=0)
    pairs = opt.master_weights()
    assert [p for p, _ in pairs] == list(model.parameters())
    for (p, master), ref in zip(pairs, expected):
        assert torch.equal(master, ref.detach()), (master - ref).abs().max()
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
    # the device never held every gradient at once: each was taken as autograd accumulated it
    assert held and max(held) <= 1
    assert all(p.grad is None for p in model.parameters())


def _stepped_before_the_embeddings_gradient(overrides):
    """Per step, whether the head's weight (the first gradient of the backward) had been stepped when the
    embedding's gradient (the last) arrived, and the host steps made by then."""
    seen = []
    state = {}

    def watch(param):
        if param is state.get("embedding"):
            seen.append((not torch.equal(state["head"].detach(), state["before"]), len(state["steps"])))

    _, model, opt, step = _built(overrides, watch)
    state.update(embedding=model.embed.weight, head=model.head.weight, steps=[])
    inner_step = opt.inner.step

    def counting():
        state["steps"].append(1)
        return inner_step()

    opt.inner.step = counting
    for batch in _batches(3):
        state["before"] = model.head.weight.detach().clone()
        state["steps"].clear()
        step(batch)
    return seen, len(list(model.parameters()))


def test_streamed_gradients_are_stepped_during_the_backward_when_nothing_needs_them_all():
    """Unclipped, one micro-batch: each weight is stepped on the host as soon as its gradient arrives, while the
    backward of the layers before it still runs: every weight but the embedding is stepped before the
    embedding's gradient exists."""
    seen, count = _stepped_before_the_embeddings_gradient(["optim.grad_clip=0"])
    assert seen == [(True, count - 1)] * 3


def test_streamed_gradients_wait_for_the_whole_backward_where_the_step_needs_them_all():
    """Global-norm clipping needs every gradient before the first weight moves: nothing is stepped before the last
    gradient has arrived."""
    seen, _ = _stepped_before_the_embeddings_gradient(["optim.grad_clip=1.0"])
    assert seen == [(False, 0)] * 3


def test_accumulated_streamed_gradients_are_stepped_during_the_last_micro_batchs_backward():
    """Unclipped, two micro-batches: the first micro-batch's gradients are only part of the step's (nothing moves
    in its backward); in the last one's each weight is stepped as its sum is whole."""
    seen, count = _stepped_before_the_embeddings_gradient(["optim.grad_clip=0", "optim.grad_accum_steps=2"])
    assert seen == [(False, 0), (True, count - 1)] * 3


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["strategy.offload.gradients=true"], r"offload.gradients=true .*offload.optimizer=true"),
    ],
)
def test_offload_gradients_refuses_without_the_host_optimizer(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, ["strategy=reversible", *overrides])


def test_offload_gradients_refuses_several_processes(monkeypatch):
    import torch.distributed as dist

    cfg = load_config(None, [*TINY, *STREAM])
    model = build_model(cfg, "cpu")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(StrategyError, match=r"offload.gradients=true .*torchrun"):
        build_optimizer(cfg, model)


def test_a_host_without_the_memory_is_refused_before_anything_is_allocated(monkeypatch):
    """The host optimizer says what it needs of the host (float32 masters, AdamW's two moments, the gradients it
    keeps there at once) before it allocates them, where the host lacks it; with just enough it is built."""
    from revlib_xla import backends
    from revlib_xla.optim.host import HostMemoryError, HostOptimizer

    cfg = load_config(None, [*TINY, *STREAM])  # clipping: every bfloat16 gradient waits on the host
    model = build_model(cfg, "cpu")
    params = list(model.parameters())
    weights = sum(p.numel() for p in params)
    largest = max(p.numel() for p in params)
    needed = weights * 4 * 3 + weights * 2 + largest * 4
    monkeypatch.setattr(backends, "host_memory_available", lambda: needed - 1)
    with pytest.raises(StrategyError, match=r"needs .* of host memory \(float32 master weights .*available.*"):
        build_optimizer(cfg, model)
    with pytest.raises(HostMemoryError) as raised:
        HostOptimizer(params, lambda ps: torch.optim.AdamW(ps), stream_gradients=True)
    assert raised.value.needed == needed and raised.value.available == needed - 1
    monkeypatch.setattr(backends, "host_memory_available", lambda: needed)
    opt = build_optimizer(cfg, model)
    assert opt.host_state_bytes() + opt.host_step_bytes() == needed
