"""Gradients of the reversible backward against plain autograd, elementwise, on every device present."""

import pytest
import torch
from conftest import max_rel_err, to_host
from torch import nn

import revlib_xla as revlib
from revlib_xla import MemoryModes, ReversibleSequential, backends

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


# ---------------------------------------------------------------------------------------------------------------
# blocks and couplings


class Attention(nn.Module):
    """Pre-LN multi-head self-attention, optionally with a mask argument."""

    def __init__(self, width, heads=2, out=None):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.proj = nn.Linear(width, out or width)

    def forward(self, x, mask=None):
        h = self.norm(x)
        y, _ = self.attn(h, h, h, need_weights=False, attn_mask=mask)
        return self.proj(y)


def linear_block(width, out=None):
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, out or width))


def conv_block(channels, out=None):
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=1), nn.Tanh(), nn.Conv2d(channels, out or channels, 3, padding=1)
    )


def scaled_sin_forward(other, f):
    return other * 2 + torch.sin(f)


def scaled_sin_inverse(out, f):
    return (out - torch.sin(f)) / 2


COUPLINGS = {
    "additive": (None, None, 1),
    "momentum": (lambda: revlib.momentum_coupling(0.9), None, 1),
    "affine": (lambda: revlib.affine_coupling(dim=-1), None, 2),
    "user": (lambda: revlib.CouplingPair(scaled_sin_forward, scaled_sin_inverse), None, 1),
    "cycled": (lambda: [revlib.momentum_coupling(0.5), revlib.CouplingPair(None, None)], None, 1),
}


def make_blocks(kind, width, depth, out_mult):
    torch.manual_seed(0)
    if kind == "linear":
        return [linear_block(width, width * out_mult) for _ in range(depth)]
    if kind == "conv":
        return [conv_block(width, width * out_mult) for _ in range(depth)]
    return [Attention(width, out=width * out_mult) for _ in range(depth)]


def make_input(kind, width, dtype):
    g = torch.Generator().manual_seed(1)
    if kind == "conv":
        return torch.randn(2, 2 * width, 6, 6, generator=g, dtype=dtype)
    return torch.randn(3, 5, 2 * width, generator=g, dtype=dtype)


def build_pair(blocks, coupling, split_dim, **kw):
    make, _, _ = COUPLINGS[coupling]
    cf = ci = None
    if make is not None:
        pairs = make()
        pairs = pairs if isinstance(pairs, list) else [pairs]
        cf = [p.forward for p in pairs]
        ci = [p.inverse for p in pairs]
    rev = ReversibleSequential(*blocks, split_dim=split_dim, coupling_forward=cf, coupling_inverse=ci, **kw)
    ref = ReversibleSequential(
        *blocks, split_dim=split_dim, coupling_forward=cf, coupling_inverse=ci, memory_mode=MemoryModes.no_savings, **kw
    )
    return rev, ref


def grads_of(model, x, loss_fn, *args, **kwargs):
    """Loss, input grad and parameter grads (on the host) of one forward+backward."""
    model.zero_grad(set_to_none=True)
    if x.grad is not None:
        x.grad = None
    out = model(x, *args, **kwargs)
    loss = loss_fn(out)
    loss.backward()
    backends.sync(loss.device)  # one XLA graph for the whole step, not one per tensor read back
    params = {n: to_host(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return to_host(loss), to_host(x.grad) if x.grad is not None else None, params


def weighted_loss(out):
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape).to(out.device)
    return (out * w).sum() + out.square().mean()


def assert_same_grads(got, ref, tol):
    loss_a, gx_a, pa = got
    loss_b, gx_b, pb = ref
    assert max_rel_err(loss_a, loss_b) <= tol
    if gx_b is not None:
        assert max_rel_err(gx_a, gx_b) <= tol, "input gradient"
    assert pa.keys() == pb.keys() and pa, "the same parameters must get gradients"
    worst = {n: max_rel_err(pa[n], pb[n]) for n in pb}
    assert max(worst.values()) <= tol, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


# ---------------------------------------------------------------------------------------------------------------
# 1. correct gradients for any invertible coupling pair


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("kind", ["linear", "conv", "attention"])
@pytest.mark.parametrize("coupling", list(COUPLINGS))
def test_gradients_match_no_savings(device, kind, coupling, dtype):
    if device.type == "xla" and kind != "linear" and (dtype != torch.float32 or coupling not in ("additive", "user")):
        pytest.skip(
            "XLA compiles every case (seconds each): conv/attention run additive and a non-additive "
            "coupling in float32; every coupling and dtype runs on Linear blocks"
        )
    if kind == "conv" and coupling == "affine":
        split_dim, width = 1, 3
    else:
        split_dim, width = (1 if kind == "conv" else -1), 4
    out_mult = COUPLINGS[coupling][2]
    if kind == "conv" and coupling == "affine":
        pytest.skip("affine coupling on conv streams is covered by the channel-dim variant below")
    blocks = make_blocks(kind, width, 4, out_mult)
    rev, ref = build_pair(blocks, coupling, split_dim)
    rev.to(device=device, dtype=dtype)
    x = make_input(kind, width, dtype).to(device).requires_grad_()
    assert_same_grads(grads_of(rev, x, weighted_loss), grads_of(ref, x, weighted_loss), TOL[dtype])


@pytest.mark.slow
def test_affine_coupling_on_channels(device):
    torch.manual_seed(0)
    blocks = [conv_block(3, 6) for _ in range(3)]
    pair = revlib.affine_coupling(dim=1)
    rev = ReversibleSequential(*blocks, coupling_forward=[pair.forward], coupling_inverse=[pair.inverse])
    ref = ReversibleSequential(
        *blocks, coupling_forward=[pair.forward], coupling_inverse=[pair.inverse], memory_mode=MemoryModes.no_savings
    )
    rev.to(device=device, dtype=torch.float64)
    x = make_input("conv", 3, torch.float64).to(device).requires_grad_()
    assert_same_grads(grads_of(rev, x, weighted_loss), grads_of(ref, x, weighted_loss), TOL[torch.float64])


@pytest.mark.slow
def test_non_additive_input_gradient_is_not_assumed_additive(device):
    """RevLib returned dy1 as the other stream's gradient: 13.9% off for the momentum coupling. Check ours
    against autograd on an explicitly unrolled computation."""
    torch.manual_seed(0)
    beta = 0.9
    blocks = [linear_block(4) for _ in range(4)]
    pair = revlib.momentum_coupling(beta)
    rev = ReversibleSequential(
        *blocks, split_dim=-1, coupling_forward=[pair.forward], coupling_inverse=[pair.inverse]
    ).to(device=device, dtype=torch.float64)
    x = make_input("linear", 4, torch.float64).to(device).requires_grad_()
    got = grads_of(rev, x, weighted_loss)

    x.grad = None
    for b in blocks:
        b.zero_grad(set_to_none=True)
    a, c = x.chunk(2, -1)
    for b in blocks:
        a, c = c, a * beta + b(c) * (1 - beta)
    weighted_loss(torch.cat([a, c], -1)).backward()
    assert max_rel_err(got[1], x.grad) <= 1e-10
    for n, p in rev.named_parameters():
        assert max_rel_err(got[2][n], p.grad) <= 1e-10, n


# ---------------------------------------------------------------------------------------------------------------
# 2. parameters without input grad, tensor args, layerwise args, split_dim=None


def test_params_get_grads_when_input_needs_none(device):
    blocks = make_blocks("linear", 4, 3, 1)
    rev, ref = build_pair(blocks, "additive", -1)
    rev.to(device=device, dtype=torch.float64)
    x = make_input("linear", 4, torch.float64).to(device)  # no requires_grad
    got, want = grads_of(rev, x, weighted_loss), grads_of(ref, x, weighted_loss)
    assert got[1] is None
    assert_same_grads(got, want, TOL[torch.float64])


class TakesArgs(nn.Module):
    """A block using a positional mask, a cross-attention-like memory kwarg and a learned scale kwarg."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.mem = nn.Linear(width, width)

    def forward(self, x, mask, memory=None, scale=None):
        h = torch.tanh(self.lin(x)) * mask
        if memory is not None:
            h = h + torch.softmax(h @ memory.transpose(-1, -2), -1) @ self.mem(memory)
        if scale is not None:
            h = h * scale
        return h


@pytest.mark.slow
def test_tensor_args_and_kwargs_get_gradients(device):
    torch.manual_seed(0)
    width = 4
    blocks = [TakesArgs(width) for _ in range(4)]
    rev, ref = build_pair(blocks, "momentum", -1)
    rev.to(device=device, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 2 * width, generator=g, dtype=torch.float64).to(device).requires_grad_()
    mask = (torch.rand(2, 5, width, generator=g) > 0.3).to(torch.float64).to(device)
    memory_leaf = torch.randn(2, 3, width, generator=g, dtype=torch.float64).requires_grad_()
    scale = nn.Parameter(torch.tensor(1.3, dtype=torch.float64).to(device))

    results = []
    for model in (rev, ref):
        memory_leaf.grad = None
        scale.grad = None
        memory = (memory_leaf * 2).to(device)  # a non-leaf argument, as a cross-attention memory would be
        res = grads_of(model, x, weighted_loss, mask, memory=memory, scale=scale)
        results.append((res, to_host(memory_leaf.grad), to_host(scale.grad)))
    (got, mem_a, scale_a), (want, mem_b, scale_b) = results
    assert_same_grads(got, want, TOL[torch.float64])
    assert mem_b is not None and scale_b is not None
    assert max_rel_err(mem_a, mem_b) <= 1e-10
    assert max_rel_err(scale_a, scale_b) <= 1e-10


def test_layerwise_args_kwargs(device):
    torch.manual_seed(0)
    width = 4
    blocks = [TakesArgs(width) for _ in range(3)]
    rev, ref = build_pair(blocks, "additive", -1)
    rev.to(device=device, dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 2 * width, generator=g, dtype=torch.float64).to(device).requires_grad_()
    mask = torch.ones(2, 5, width, dtype=torch.float64).to(device)
    scales = [nn.Parameter(torch.tensor(s, dtype=torch.float64).to(device)) for s in (0.5, 1.5, 2.5)]
    layerwise = [([], {"scale": s}) for s in scales]
    outs = []
    for model in (rev, ref):
        for s in scales:
            s.grad = None
        res = grads_of(model, x, weighted_loss, mask, layerwise_args_kwargs=layerwise)
        outs.append((res, [to_host(s.grad) for s in scales]))
    assert_same_grads(outs[0][0], outs[1][0], TOL[torch.float64])
    for a, b in zip(outs[0][1], outs[1][1]):
        assert max_rel_err(a, b) <= 1e-10
    # the per-layer values are really used: a different layerwise list changes the output
    with torch.no_grad():
        y1 = rev(x, mask, layerwise_args_kwargs=layerwise)
        y2 = rev(x, mask, layerwise_args_kwargs=list(reversed(layerwise)))
    assert max_rel_err(y1, y2) > 1e-3


def test_split_dim_none_replicates_and_averages(device):
    blocks = make_blocks("linear", 4, 4, 1)
    rev, ref = build_pair(blocks, "additive", None)
    rev.to(device=device, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64).to(device).requires_grad_()
    assert_same_grads(grads_of(rev, x, weighted_loss), grads_of(ref, x, weighted_loss), TOL[torch.float64])
    with torch.no_grad():
        a, c = x, x
        for b in blocks:
            a, c = c, a + b(c)
        assert max_rel_err(rev(x), (a + c) / 2) <= 1e-12


def test_weight_sharing_accumulates(device):
    """RevLib's README builds its depth demo from one block repeated: shared weights get the summed gradient."""
    torch.manual_seed(0)
    block = linear_block(4)
    rev, ref = build_pair([block] * 6, "additive", -1)
    rev.to(device=device, dtype=torch.float64)
    x = make_input("linear", 4, torch.float64).to(device).requires_grad_()
    assert_same_grads(grads_of(rev, x, weighted_loss), grads_of(ref, x, weighted_loss), TOL[torch.float64])


class BroadcastBlock(nn.Module):
    """Returns a (features,) tensor that the additive coupling broadcasts over the batch."""

    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return torch.tanh(self.scale) * x.mean()


def test_block_output_broadcast_by_the_coupling(device):
    torch.manual_seed(0)
    rev, ref = build_pair([BroadcastBlock(4), linear_block(4), BroadcastBlock(4)], "additive", -1)
    rev.to(device=device, dtype=torch.float64)
    x = make_input("linear", 4, torch.float64).to(device).requires_grad_()
    assert_same_grads(grads_of(rev, x, weighted_loss), grads_of(ref, x, weighted_loss), TOL[torch.float64])


@pytest.mark.slow
def test_two_backward_passes_with_retain_graph(device):
    blocks = make_blocks("linear", 4, 3, 1)
    rev, _ = build_pair(blocks, "additive", -1)
    rev.to(device=device, dtype=torch.float64)
    x = make_input("linear", 4, torch.float64).to(device).requires_grad_()
    loss = weighted_loss(rev(x))
    loss.backward(retain_graph=True)
    first = {n: to_host(p.grad).clone() for n, p in rev.named_parameters()}
    loss.backward()
    for n, p in rev.named_parameters():
        assert max_rel_err(to_host(p.grad), 2 * first[n]) <= 1e-12


@pytest.mark.slow
def test_batchnorm_running_stats_updated_once(device):
    """The recomputation must not update normalization statistics a second time (MemCNN #12)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)) for _ in range(3)]
    rev, _ = build_pair(blocks, "additive", 1)
    x = make_input("conv", 3, torch.float64)
    rev.to(device=device, dtype=torch.float64)
    xd = x.to(device).requires_grad_()
    weighted_loss(rev(xd)).backward()
    after_rev = {k: to_host(v).clone() for k, v in rev.state_dict().items() if "running" in k or "num_batches" in k}
    torch.manual_seed(0)
    blocks2 = [nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3)) for _ in range(3)]
    ref2 = ReversibleSequential(*blocks2, memory_mode=MemoryModes.no_savings).to(device=device, dtype=torch.float64)
    weighted_loss(ref2(x.to(device).requires_grad_())).backward()
    after_ref = {k: to_host(v) for k, v in ref2.state_dict().items() if k in after_rev}
    assert after_rev.keys() == after_ref.keys() and after_rev
    for k in after_rev:
        assert max_rel_err(after_rev[k], after_ref[k]) <= 1e-12, k


# ---------------------------------------------------------------------------------------------------------------
# 4. autocast replay


def _autocast_cases(kind):
    if kind == "cpu":
        return [torch.bfloat16]
    if kind == "xla":
        return [torch.bfloat16]
    return [torch.float16, torch.bfloat16]


def test_autocast_replayed_in_recomputation(device):
    for amp_dtype in _autocast_cases(device.type):
        blocks = make_blocks("linear", 8, 4, 1)
        rev, ref = build_pair(blocks, "additive", -1)
        rev.to(device)
        x = make_input("linear", 8, torch.float32).to(device).requires_grad_()
        results = []
        for model in (rev, ref):
            with torch.autocast(device.type, dtype=amp_dtype):
                results.append(grads_of(model, x, lambda o: o.float().square().mean()))
        # computed in the same precision as the forward, the recomputation gives the no_savings gradients up to
        # the float32 rounding of the rebuilt streams; without replay the error is of the order of bf16's eps
        assert_same_grads(results[0], results[1], 1e-5)


def test_autocast_off_in_backward_when_off_in_forward():
    """A backward run inside an autocast region must recompute in the forward's (full) precision. (The backward
    kernels themselves run under the ambient autocast in plain autograd too, so both models do that.)"""
    blocks = make_blocks("linear", 8, 3, 1)
    rev, ref = build_pair(blocks, "additive", -1)
    x = make_input("linear", 8, torch.float32).requires_grad_()
    results = []
    for model in (rev, ref):
        model.zero_grad(set_to_none=True)
        x.grad = None
        loss = weighted_loss(model(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss.backward()
        results.append((to_host(loss), to_host(x.grad), {n: to_host(p.grad) for n, p in model.named_parameters()}))
    assert_same_grads(results[0], results[1], 1e-5)


# ---------------------------------------------------------------------------------------------------------------
# 6. explicit inverse, two-stream input/output


@pytest.mark.slow
def test_inverse_reconstructs_input(device):
    blocks = make_blocks("conv", 3, 5, 1)
    for b in blocks:
        b.eval()
    model = ReversibleSequential(*blocks).to(device=device, dtype=torch.float64)
    x = make_input("conv", 3, torch.float64).to(device)
    with torch.no_grad():
        y = model(x)
        assert max_rel_err(model.inverse(y), x) <= 1e-12
        x0, x1 = x.chunk(2, 1)
        y0, y1 = model((x0, x1))
        assert max_rel_err(torch.cat([y0, y1], 1), y) <= 1e-14
        r0, r1 = model.inverse((y0, y1))
        assert max_rel_err(r0, x0) <= 1e-12 and max_rel_err(r1, x1) <= 1e-12


def test_two_stream_io_gradients(device):
    blocks = make_blocks("linear", 4, 4, 1)
    rev, ref = build_pair(blocks, "momentum", -1)
    rev.to(device=device, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    a = torch.randn(3, 4, generator=g, dtype=torch.float64).to(device).requires_grad_()
    b = torch.randn(3, 4, generator=g, dtype=torch.float64).to(device).requires_grad_()
    grads = []
    for model in (rev, ref):
        a.grad = b.grad = None
        y0, y1 = model((a, b))
        (y0.square().sum() + (y1 * 3).sin().sum()).backward()
        grads.append((to_host(a.grad), to_host(b.grad)))
    assert max_rel_err(grads[0][0], grads[1][0]) <= 1e-10
    assert max_rel_err(grads[0][1], grads[1][1]) <= 1e-10


def test_irevnet_style_invertible_model():
    """iRevNet: stem + reversible core + head, fully invertible core (README example, small)."""
    torch.manual_seed(0)
    channels = 4

    def block():
        return nn.Sequential(
            nn.Conv2d(channels, channels * 2, 3, padding=1),
            nn.BatchNorm2d(channels * 2),
            nn.ReLU(),
            nn.Conv2d(channels * 2, channels, 3, padding=1),
        )

    core = ReversibleSequential(*[block() for _ in range(3)])
    model = nn.Sequential(nn.Conv2d(3, 2 * channels, 3, padding=1), core, nn.Conv2d(2 * channels, 10, 1))
    out = model(torch.randn(2, 3, 8, 8))
    out.mean().backward()
    assert out.shape == (2, 10, 8, 8)
    core.eval()
    with torch.no_grad():
        h = torch.randn(2, 2 * channels, 8, 8)
        assert max_rel_err(core.inverse(core(h)), h) <= 1e-5


# ---------------------------------------------------------------------------------------------------------------
# 5. low-precision drift


class NormalizedBlock(nn.Module):
    """Pre-LN transformer-style branch: LN -> MLP (or LN -> attention), output scaled like a residual branch."""

    def __init__(self, width, attention):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attention = attention
        if attention:
            self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        else:
            self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        h = self.norm(x)
        if self.attention:
            return self.attn(h, h, h, need_weights=False)[0]
        return self.mlp(h)


def drift_errors(depth, mode, width=16, seed=0):
    """Reconstruction and gradient error of the reversible backward at ``depth`` for one precision mode:
    'f32', 'bf16+f32 streams', 'bf16' (floating-point streams) or 'exact bf16' (fixed-point streams, bf16 blocks).
    Gradients are compared with no_savings in the same precision."""
    torch.manual_seed(seed)
    blocks = [NormalizedBlock(width, attention=i % 2 == 0) for i in range(depth)]
    dtype = torch.float32 if mode == "f32" else torch.bfloat16
    stream_dtype = torch.float32 if mode == "bf16+f32 streams" else None
    exact = mode.startswith("exact")
    kw = dict(split_dim=-1, stream_dtype=stream_dtype, compute_dtype=dtype, exact=exact)
    rev = ReversibleSequential(*blocks, verify_inverse=False, **kw).to(dtype)  # the drift itself is measured
    ref = ReversibleSequential(*blocks, memory_mode=MemoryModes.no_savings, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 8, 2 * width, generator=g).to(dtype)
    if exact:  # the input rebuilt through every layer, as the backward rebuilds it: its integers
        rec_err = revlib.check_invertible(rev, x).end_to_end
    else:
        with torch.no_grad():
            streams = tuple(h.float().to(stream_dtype or dtype) for h in (x[..., :width], x[..., width:]))
            recon = rev.inverse(rev(streams))
            rec_err = max(max_rel_err(recon[0], streams[0]), max_rel_err(recon[1], streams[1]))
    grads = []
    for model in (rev, ref):
        model.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    grad_err = float((grads[0] - grads[1]).norm() / grads[1].norm())
    return rec_err, grad_err


@pytest.mark.slow
def test_low_precision_drift_table(capsys):
    rows = []
    for depth in (8, 32, 128):
        row = {mode: drift_errors(depth, mode) for mode in ("f32", "bf16+f32 streams", "bf16", "exact bf16")}
        rows.append((depth, row))
    with capsys.disabled():
        print("\nreconstruction / relative gradient error of the reversible backward vs no_savings (same precision)")
        print(f"{'depth':>6} | {'f32':>21} | {'bf16 + f32 streams':>21} | {'bf16':>21} | {'exact, bf16':>21}")
        for depth, row in rows:
            print(f"{depth:>6} | " + " | ".join(f"{r:9.2e} / {g:9.2e}" for r, g in row.values()))
    at_128 = dict(rows)[128]
    assert at_128["bf16+f32 streams"][1] < 1e-2
    assert at_128["f32"][1] < 1e-4
    # the float32 streams are what keeps deep bf16 stacks usable: pure bf16 drifts far more
    assert at_128["bf16"][0] > 10 * at_128["bf16+f32 streams"][0]
    # exact streams rebuild every input bit for bit: no_savings' gradients at every depth
    assert all(row["exact bf16"] == (0.0, 0.0) for _, row in rows)


# ---------------------------------------------------------------------------------------------------------------
# 10. bad input


def test_odd_split_size_names_the_problem():
    model = ReversibleSequential(nn.Linear(2, 2))
    with pytest.raises(revlib.ReversibleError, match=r"size 5 along split_dim=1"):
        model(torch.randn(3, 5))


def test_block_changing_shape_names_the_layer():
    model = ReversibleSequential(
        nn.Linear(4, 4),
        nn.Linear(4, 8),
        split_dim=-1,
        coupling_forward=[None, lambda a, f: f[..., :2].repeat(1, 1)],
        coupling_inverse=[None, lambda y, f: y],
    )
    with pytest.raises(revlib.ReversibleError, match=r"layer 1 \('0-1': Linear\) changed its stream's shape"):
        model(torch.randn(2, 8))


def test_block_output_the_coupling_cannot_merge():
    model = ReversibleSequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3), split_dim=-1)
    with pytest.raises(revlib.ReversibleError, match=r"layer 2 \('1-0': Linear\): coupling its output \(2, 3\)"):
        model(torch.randn(2, 8, requires_grad=True))


class ToDouble(nn.Module):
    def forward(self, x):
        return x.double()


def test_block_changing_dtype_names_the_layer():
    """Floating-point streams must keep their dtype; an exact stream takes any floating block output (rounded to
    its grid), and its gradient comes back in the block's dtype."""
    model = ReversibleSequential(nn.Identity(), ToDouble(), split_dim=-1, exact=False)
    with pytest.raises(revlib.ReversibleError, match=r"layer 1 \('0-1': ToDouble\) changed its stream's dtype"):
        model(torch.randn(2, 8))
    x = torch.randn(2, 8, requires_grad=True)
    y = ReversibleSequential(nn.Identity(), ToDouble(), split_dim=-1)(x)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32


def test_non_tensor_input():
    model = ReversibleSequential(nn.Linear(2, 2))
    with pytest.raises(revlib.ReversibleError, match="expects a tensor"):
        model("abcd")
    with pytest.raises(revlib.ReversibleError, match="a tuple input must be two stream tensors"):
        model([[1.0, 2.0, 3.0, 4.0]])
    with pytest.raises(revlib.ReversibleError, match="argument 1 is a int"):
        ReversibleSequential(nn.Linear(2, 2), 3)


def bad_inverse(out, f):
    return out + f  # not the inverse of additive_coupling_forward


def test_check_invertible_names_the_bad_layer():
    model = ReversibleSequential(
        *[nn.Linear(4, 4) for _ in range(4)],
        split_dim=-1,
        coupling_forward=[None, None, revlib.additive_coupling_forward],
        coupling_inverse=[None, None, bad_inverse],
    )
    with pytest.raises(revlib.ReversibleError, match=r"layer 2 \('1-0': Linear\): coupling_inverse does not undo"):
        revlib.check_invertible(model, torch.randn(3, 8))
    good = ReversibleSequential(*[nn.Linear(4, 4) for _ in range(4)], split_dim=-1)
    report = revlib.check_invertible(good, torch.randn(3, 8))
    assert len(report.errors) == 4 and report.worst <= 1e-5


def test_verify_inverse_at_first_forward():
    model = ReversibleSequential(
        nn.Linear(4, 4),
        nn.Linear(4, 4),
        split_dim=-1,
        coupling_forward=[revlib.additive_coupling_forward],
        coupling_inverse=[bad_inverse],
        verify_inverse=True,
    )
    with pytest.raises(revlib.ReversibleError, match=r"layer 0 .*does not undo"):
        model(torch.randn(3, 8))


def test_inplace_first_op_in_block():
    model = ReversibleSequential(nn.Linear(4, 4), nn.ReLU(inplace=True), split_dim=-1)
    with pytest.raises(revlib.ReversibleError, match=r"layer 1 .*modified its input in place"):
        model(torch.randn(3, 8, requires_grad=True))


class _OnAnotherDevice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).to("meta")


@pytest.mark.parametrize("exact", [True, False])
def test_a_block_returning_its_output_on_another_device_is_named(exact):
    """Issue 39, case 6: with exact streams such a block gave a bare RuntimeError from the next layer ('Tensor on
    device cpu is not on the expected device meta!'), naming no layer; the floating-point streams named it."""
    model = ReversibleSequential(_OnAnotherDevice(), nn.Linear(4, 4), split_dim=-1, exact=exact)
    with pytest.raises(revlib.ReversibleError, match=r"layer 0 \('0-0': _OnAnotherDevice\): coupling its output"):
        model(torch.randn(3, 8))


def test_inplace_change_of_saved_output_or_argument():
    model = ReversibleSequential(*[TakesArgs(4) for _ in range(2)], split_dim=-1)
    x = torch.randn(2, 3, 8, requires_grad=True)
    mask = torch.ones(2, 3, 4)
    loss = model(x, mask).sum()
    mask.mul_(0)
    with pytest.raises(revlib.ReversibleError, match="modified in place after the forward"):
        loss.backward()
    float_streams = ReversibleSequential(*[TakesArgs(4) for _ in range(2)], split_dim=-1, exact=False)
    y0, y1 = float_streams((x[..., :4], x[..., 4:]), torch.ones(2, 3, 4))
    y1.add_(1)  # the float streams' output is the storage the backward rebuilds from
    with pytest.raises(revlib.ReversibleError, match="modified in place after the forward"):
        (y0.sum() + y1.sum()).backward()
    # exact streams rebuild from their own integers: changing the returned values does not change the gradients
    grads = []
    for change in (False, True):
        x.grad = None
        y0, y1 = model((x[..., :4], x[..., 4:]), torch.ones(2, 3, 4))
        if change:
            y1.add_(1)
        (y0.sum() + y1.sum()).backward()
        grads.append(x.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_layerwise_length_mismatch():
    model = ReversibleSequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(revlib.ReversibleError, match="has 1 entries but the model has 2 layers"):
        model(torch.randn(1, 4), layerwise_args_kwargs=[([], {})])


class ReturnsNothing(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        self.lin(x)  # no return


def test_bad_input_dtypes_and_outputs_name_the_layer_on_every_device(device):
    """Issue 15 §2.9 / §3: on XLA an int64 (or float16) input to a float32 model ran and returned a truncated
    int64 (float16) output; on the CPU the same inputs, and a block returning None, raised torch's internal errors."""
    torch.manual_seed(0)
    model = ReversibleSequential(linear_block(4), linear_block(4), split_dim=-1).to(device)
    x = torch.randn(3, 8)
    with pytest.raises(
        revlib.ReversibleError,
        match=r"the input is torch.int64, but the reversible streams are "
        r"floating point: layer 0 \('0-0': Sequential\) computes in "
        r"torch.float32.*x.to\(torch.float32\)",
    ):
        model((x * 10).long().to(device))
    with pytest.raises(
        revlib.ReversibleError,
        match=r"layer 0 \('0-0': Sequential\): its parameters are "
        r"torch.float32, but it would compute on torch.float16 "
        r"\(the input's dtype\)",
    ):
        model(x.half().to(device))
    none_model = ReversibleSequential(linear_block(4), ReturnsNothing(4), split_dim=-1).to(device)
    with pytest.raises(revlib.ReversibleError, match=r"layer 1 \('0-1': ReturnsNothing\) returned None.*`return"):
        none_model(x.to(device).requires_grad_())
    with pytest.raises(revlib.ReversibleError, match=r"layer 1 \('0-1': ReturnsNothing\) returned None"):
        with torch.no_grad():
            none_model(x.to(device))
    # what these errors must not refuse: compute_dtype makes the blocks see their own dtype, autocast casts for them
    model_f64 = ReversibleSequential(linear_block(4), split_dim=-1, compute_dtype=torch.float32).to(device)
    assert model_f64(x.double().to(device)).dtype == torch.float64
    if device.type == "cpu":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model(x.bfloat16()).shape == x.shape


def test_bad_constructor_arguments_name_the_argument():
    with pytest.raises(revlib.ReversibleError, match=r"stream_dtype=torch.int32.*floating"):
        ReversibleSequential(nn.Linear(2, 2), stream_dtype=torch.int32)
    with pytest.raises(revlib.ReversibleError, match=r"compute_dtype='float32'.*floating"):
        ReversibleSequential(nn.Linear(2, 2), compute_dtype="float32")
    with pytest.raises(revlib.ReversibleError, match=r"target_device='gpu' is not a device"):
        ReversibleSequential(nn.Linear(2, 2), target_device="gpu")


@pytest.mark.skipif(backends.cuda_available(), reason="this machine has CUDA: target_device='cuda' is valid here")
def test_target_device_missing_on_this_machine():
    """Issue 15 §3: target_device='cuda' without CUDA failed at the first forward with torch's AssertionError."""
    with pytest.raises(
        revlib.ReversibleError,
        match=r"target_device='cuda', but this machine has no such device "
        r"\(it has cpu",
    ):
        ReversibleSequential(nn.Linear(2, 2), target_device="cuda")


# ---------------------------------------------------------------------------------------------------------------
# 11. coupling pairs: refused when mismatched, measured when given, picklable


def test_mismatched_coupling_pairs_are_refused():
    """Issue 15 §2.5: a coupling_forward without its coupling_inverse, or lists of different lengths, got the
    additive inverse (gradients 26-51 % off) with no error."""
    pair = revlib.momentum_coupling(0.5)
    blocks = [nn.Linear(2, 2) for _ in range(3)]
    with pytest.raises(
        revlib.ReversibleError,
        match=r"coupling_forward\[0\] is MomentumForward\(beta=0.5\), but "
        r"coupling_inverse is None",
    ):
        ReversibleSequential(*blocks, coupling_forward=[pair.forward])
    with pytest.raises(revlib.ReversibleError, match=r"coupling_forward has 2 entries but coupling_inverse has 1"):
        ReversibleSequential(*blocks, coupling_forward=[pair.forward, None], coupling_inverse=[pair.inverse])
    with pytest.raises(
        revlib.ReversibleError,
        match=r"coupling_inverse\[0\] is MomentumInverse\(beta=0.5\), but "
        r"coupling_forward\[0\] is None",
    ):
        ReversibleSequential(*blocks, coupling_forward=[None, pair.forward], coupling_inverse=[pair.inverse, None])
    with pytest.raises(
        revlib.ReversibleError,
        match=r"coupling_forward\[0\] is scaled_sin_forward, but "
        r"coupling_inverse\[0\] is None",
    ):
        ReversibleSequential(*blocks, coupling_forward=[scaled_sin_forward], coupling_inverse=[None])
    with pytest.raises(revlib.ReversibleError, match=r"coupling_forward is a CouplingPair"):
        ReversibleSequential(*blocks, coupling_forward=pair)
    with pytest.raises(revlib.ReversibleError, match=r"ReversibleModule: coupling_forward is MomentumForward"):
        revlib.ReversibleModule(nn.Linear(2, 2), coupling_forward=pair.forward)
    # what stays accepted: additive on both sides in any spelling, and full pairs
    from revlib_xla import utils

    ReversibleSequential(*blocks, coupling_forward=[utils.detached_additive_coupling_forward])
    ReversibleSequential(*blocks, coupling_forward=[pair.forward, None], coupling_inverse=[pair.inverse, None])


def wrong_sin_inverse(out, f):
    return (out - torch.sin(f)) / 3  # scaled_sin_forward multiplies by 2


def count_calls(blocks):
    calls = [0]

    def hook(*_):
        calls[0] += 1

    for b in blocks:
        b.register_forward_hook(hook)
    return calls


def test_given_pairs_are_measured_at_the_first_training_forward_only():
    """A pair given on both sides is checked on the real input at the first training forward (verify_inverse's
    default for couplings that are not additive); additive models pay nothing; later steps pay nothing."""
    torch.manual_seed(0)
    x = torch.randn(3, 8, requires_grad=True)
    bad = ReversibleSequential(
        *[nn.Linear(4, 4) for _ in range(3)],
        split_dim=-1,
        coupling_forward=[scaled_sin_forward],
        coupling_inverse=[wrong_sin_inverse],
    )
    with torch.no_grad():
        bad(x)  # inference rebuilds nothing: nothing to check
    with pytest.raises(revlib.ReversibleError, match=r"layer 0 \('0-0': Linear\): coupling_inverse does not undo"):
        bad(x)
    for coupling, checked in (("additive", False), ("user", True)):
        blocks = [nn.Linear(4, 4) for _ in range(3)]
        calls = count_calls(blocks)
        model, _ = build_pair(blocks, coupling, -1)
        for step in range(2):
            calls[0] = 0
            model(x).sum().backward()
            # forward + recomputation, plus three evaluations per layer for the check at the first step
            assert calls[0] == 2 * 3 + (3 * 3 if checked and step == 0 else 0), (coupling, step)


class NoisyBatchNorm(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(self.lin(self.norm(x)))


def test_the_check_changes_nothing():
    """verify_inverse runs every block three more times: running statistics, the random stream and so the
    gradients stay those of no_savings (before: BatchNorm statistics were updated by the check too)."""
    torch.manual_seed(0)
    blocks = [NoisyBatchNorm(4) for _ in range(3)]
    rev, ref = build_pair(blocks, "momentum", -1)
    rev.verify_inverse = True  # the check runs for rev only (no_savings rebuilds nothing)
    rev.double()
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    results = []
    for model in (rev, ref):
        torch.manual_seed(1)
        for b in blocks:
            b.norm.reset_running_stats()
        got = grads_of(model, x, weighted_loss)
        stats = [
            torch.cat([b.norm.running_mean, b.norm.running_var, b.norm.num_batches_tracked[None].double()])
            for b in blocks
        ]
        results.append((got, stats, torch.rand(3)))
    (got, stats_a, rand_a), (want, stats_b, rand_b) = results
    assert_same_grads(got, want, TOL[torch.float64])
    for a, b in zip(stats_a, stats_b):
        assert max_rel_err(a, b) <= 1e-12
    assert torch.equal(rand_a, rand_b)


def test_the_check_neither_runs_on_fake_tensors_nor_raises_the_peak():
    """Sizing a momentum model under FakeTensorMode skips the check (fake tensors have no values to compare); on
    real tensors the first step, check included, peaks where the fake step does."""
    import dataclasses

    from revlib_xla import memory

    def make():
        torch.manual_seed(0)
        return build_pair([linear_block(16) for _ in range(4)], "momentum", -1)[0]

    def step(model, x):
        loss = model(x).square().mean()
        loss.backward()
        return loss

    fake = memory.eager_peak(step, make, lambda: torch.randn(32, 32), fake=True)
    model = make()
    real = memory.eager_peak(step, model, torch.randn(32, 32))
    assert model._verified  # the real step was checked
    assert dataclasses.replace(fake, fake=False) == real


class AppendsToCache(nn.Module):
    """Attends to everything it has seen since its cache was cleared: a KV cache kept outside the block's tensors."""

    def __init__(self, width, cache):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.cache = cache

    def forward(self, x):
        self.cache.append(x)
        return torch.tanh(self.lin(torch.stack(self.cache).sum(0)))


def test_block_with_a_cache_of_its_own_is_refused():
    """A block that appends to a cache in forward sees a longer cache in the recomputation: its gradients are wrong.
    The check at the first training forward finds it (on by default for non-additive couplings and momentum
    nets; verify_inverse=True for additive ones)."""
    from revlib_xla import utils

    torch.manual_seed(0)
    x = torch.randn(3, 8, requires_grad=True)
    for make in (
        lambda blocks: ReversibleSequential(*blocks, split_dim=-1, verify_inverse=True),
        lambda blocks: utils.momentum_net(*blocks, split_dim=-1),
    ):
        cache = []
        model = make([AppendsToCache(4, cache) for _ in range(2)])
        with pytest.raises(
            revlib.ReversibleError,
            match=r"layer 0 \('0-0': \w+\) gave a different output when run "
            r"again.*keeps state between calls",
        ):
            model(x)


def test_additive_stack_that_cannot_rebuild_its_input_is_refused_with_verify_inverse():
    """An additive coupling on floating-point streams (exact=False) inverts exactly only in exact arithmetic: eight
    bfloat16 MLP blocks with large weights rebuild their input so badly that the reversible backward's gradients are
    off by more than 100 %. verify_inverse=True refuses at the first training forward, naming the depth. The same
    stack on exact (fixed-point) streams, the default, has no_savings' gradients to the bit."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(8)]
    for p in (p for b in blocks for p in b.parameters()):
        nn.init.normal_(p, std=0.3)
    x = torch.randn(4, 32).bfloat16()

    def grads(**kw):
        model = ReversibleSequential(*blocks, split_dim=-1, **kw).bfloat16()
        model.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        return torch.cat([p.grad.float().flatten() for p in model.parameters()])

    unchecked = grads(verify_inverse=False, exact=False)
    reference = grads(memory_mode=MemoryModes.no_savings, exact=False)
    assert float((unchecked - reference).norm() / reference.norm()) > 1.0  # what the check prevents
    with pytest.raises(revlib.ReversibleError, match=r"rebuilt from the output through all 8 layers"):
        ReversibleSequential(*blocks, split_dim=-1, verify_inverse=True, exact=False).bfloat16()(x)
    assert torch.equal(grads(verify_inverse=False), grads(memory_mode=MemoryModes.no_savings))


@pytest.mark.parametrize("construction", ["momentum_coupling", "momentum_net"])
@pytest.mark.slow
def test_small_beta_never_trains_on_wrong_gradients(construction):
    """Issue 15 §2.14: beta=0.1 in float32 lost the gradients with depth (the inverse divides by beta at every
    layer), silently. Now the first training forward measures the input rebuilt through all layers and refuses where
    it is off by more than 1e-4; what it accepts has no_savings' gradients (within 1e-3). The error without the check
    (verify_inverse=False) is measured too, so the test knows which depths must be refused."""
    from revlib_xla import utils

    width, beta = 8, 0.1
    x = torch.randn(4, 2 * width, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def build(depth, **kw):
        torch.manual_seed(0)
        blocks = [linear_block(width) for _ in range(depth)]
        if construction == "momentum_net":  # float streams (exact streams: see the test below)
            return (
                utils.momentum_net(*blocks, beta=beta, split_dim=-1, exact=False, **kw),
                utils.momentum_net(
                    *blocks, beta=beta, split_dim=-1, memory_mode=MemoryModes.no_savings, exact=False, **kw
                ),
            )
        return _momentum_pair(blocks, beta, **kw)

    def refused_depths(depths, **kw):
        refused = {}
        for depth in depths:
            unchecked, ref = build(depth, verify_inverse=False, **kw)
            want = grads_of(ref, x, weighted_loss)
            silent = max(max_rel_err(g, want[2][n]) for n, g in grads_of(unchecked, x, weighted_loss)[2].items())
            rev, _ = build(depth, **kw)
            try:
                got = grads_of(rev, x, weighted_loss)
            except revlib.ReversibleError as err:
                assert f"through all {len(rev)} layers" in str(err) and "stream_dtype=torch.float64" in str(err)
                refused[depth] = silent
                continue
            # accepted: the reconstruction is within 1e-4, and the gradient error follows it (measured: 0.5 to 3
            # times the reconstruction error)
            assert silent <= 1e-3, (depth, silent)
            assert_same_grads(got, want, 1e-3)
        return refused

    # unchecked at 12 and 24 layers: 4e-3 and 1.5e5 (coupling), 7e4 and inf (net)
    assert refused_depths((4, 8, 12, 24)).keys() >= {12, 24}
    if construction == "momentum_coupling":  # float64 streams go deeper: 12 layers accepted, 32 refused
        refused = refused_depths((12, 24, 32), stream_dtype=torch.float64)
        assert 12 not in refused and 32 in refused


@pytest.mark.slow
def test_momentum_net_on_exact_streams_is_exact_until_its_range_and_then_refused():
    """RevLib's MomentumNet (additive couplings, beta folded into the blocks: one stream grows by 1/beta per module)
    on exact streams: no rounding is lost, so beta=0.1 trains on no_savings' gradients (to the bit) as deep as the
    stream fits its grid (float32 streams: refused from 12 layers); deeper, the forward refuses naming the layer
    whose output left the range, before any backward."""
    from revlib_xla import utils
    from revlib_xla.reversible.fixed_point import FixedStreamError

    width, beta = 8, 0.1
    x = torch.randn(4, 2 * width, generator=torch.Generator().manual_seed(0), requires_grad=True)
    for depth in (4, 6):
        torch.manual_seed(0)
        blocks = [linear_block(width) for _ in range(depth)]
        got = grads_of(utils.momentum_net(*blocks, beta=beta, split_dim=-1), x, weighted_loss)
        want = grads_of(
            utils.momentum_net(*blocks, beta=beta, split_dim=-1, memory_mode=MemoryModes.no_savings), x, weighted_loss
        )
        assert all(torch.equal(g, want[2][n]) for n, g in got[2].items()), depth
        assert torch.equal(got[1], want[1])
    torch.manual_seed(0)
    deep = utils.momentum_net(*[linear_block(width) for _ in range(12)], beta=beta, split_dim=-1)
    with pytest.raises(FixedStreamError, match=r"layer \d+ \('\d+-1': MomentumNetSide\) produced a value of magnitude"):
        deep(x)


def _momentum_pair(blocks, beta, **kw):
    pair = revlib.momentum_coupling(beta)
    return tuple(
        ReversibleSequential(
            *blocks,
            split_dim=-1,
            coupling_forward=[pair.forward],
            coupling_inverse=[pair.inverse],
            memory_mode=mode,
            **kw,
        )
        for mode in (MemoryModes.autograd_function, MemoryModes.no_savings)
    )


@pytest.mark.parametrize("coupling", ["momentum", "affine"])
def test_models_with_couplings_pickle_and_copy(tmp_path, coupling):
    """Issue 15 §3: a model using momentum_coupling could not be pickled (the coupling was a closure)."""
    import copy

    blocks = [linear_block(4, 4 * COUPLINGS[coupling][2]) for _ in range(3)]
    model, _ = build_pair(blocks, coupling, -1)
    additive, _ = build_pair(blocks, "additive", -1)
    x = torch.randn(2, 8)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for other in (loaded, copied):
            assert torch.equal(other(x), model(x))
            assert list(other.state_dict()) == list(model.state_dict()) == list(additive.state_dict())
    assert loaded[0].wrapped_module.coupling_forward == model[0].wrapped_module.coupling_forward
    assert copied[1].wrapped_module.coupling_inverse == model[1].wrapped_module.coupling_inverse
