"""The scanned reversible sequence (revlib_xla.scan): on XLA, repeating layers run as two while loops whose results
equal the unrolled walk's (outputs, input and parameter gradients, dropout masks, autocast, layer arguments), the
compiled program does not grow with depth, and what the scan cannot run falls back or (``scan=True``) raises."""

import pytest
import torch
from conftest import max_rel_err
from torch import nn

import revlib_xla as revlib
from revlib_xla import backends
from revlib_xla.reversible import ReplacedParameterError, ReversibleError

WIDTH = 8


class Scaled(nn.Module):
    """``dropout(tanh(linear(x))) * scale``: a block with a tensor argument and random numbers."""

    def __init__(self, width: int = WIDTH, p: float = 0.0, hidden: int | None = None) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, hidden or width), nn.Tanh(), nn.Linear(hidden or width, width))
        self.dropout = nn.Dropout(p)

    def forward(self, x, scale):
        return self.dropout(self.net(x)) * scale


def _xla():
    if not backends.xla_available():
        pytest.skip("torch_xla is not installed (pip install 'revlib_xla[xla]')")
    import torch_xla

    return backends.device_for("xla"), torch_xla


def _whiles(tensors) -> int:
    import torch_xla

    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors)).count(" while(")


def _model(scan, blocks, seed=0, **options):
    torch.manual_seed(seed)
    return revlib.ReversibleSequential(*blocks(), scan=scan, **options)


def _step(model, device, dtype=torch.float64, layerwise=False, autocast=False, params=True):
    """Forward and backward on ``device``; returns (output, input gradient, parameter gradients, while loops)."""
    torch.manual_seed(1)
    x = torch.randn(4, 2 * WIDTH, dtype=dtype).to(device).requires_grad_()
    scale = (torch.rand(WIDTH, dtype=dtype) + 0.5).to(device)
    kwargs: dict = {}
    if layerwise:
        scales = [(torch.rand(WIDTH, dtype=dtype) + 0.5).to(device) for _ in model]
        kwargs["layerwise_args_kwargs"] = [((s,), {}) for s in scales]
    else:
        kwargs["scale"] = scale
    torch.manual_seed(2)
    with torch.autocast("xla", dtype=torch.bfloat16, enabled=autocast):
        y = model(x, **kwargs)
    # The loss weights are made on the host: torch_xla computes a float64 linspace in float32, which XLA:CPU
    # rounds differently from program to program (folded at compile time or fused multiply-add at run time).
    weights = torch.linspace(-1, 1, y.shape[1], dtype=y.dtype).to(device)
    loss = (y.sin() * weights).sum()
    if params:
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        dx = x.grad
    else:
        (dx,) = torch.autograd.grad(loss, [x])
        grads = [p.grad for p in model.parameters()]
    whiles = _whiles([dx, *(g for g in grads if g is not None)])
    return y.detach().cpu(), dx.cpu(), [None if g is None else g.cpu() for g in grads], whiles


def _same_layers(p=0.0):
    return lambda: [Scaled(p=p) for _ in range(3)]


def _two_kinds():
    """Alternating kinds (a RevNet's F and G, Llama's attention and MLP): repeats with period 2."""
    return lambda: [Scaled(hidden=WIDTH if i % 2 == 0 else 2 * WIDTH) for i in range(4)]


CASES = {
    "dropout": (_same_layers(0.5), {}, {}),
    "period2_layerwise": (_two_kinds(), {}, {"layerwise": True}),
    # torch.autograd.grad of the input only: no parameter gradient is computed (one compile less than a case of its
    # own; the bfloat16 blocks replay autocast in the recomputation either way)
    "autocast_bf16_input_grad": (_same_layers(), {}, {"dtype": torch.float32, "autocast": True, "params": False}),
}


@pytest.fixture(scope="module")
def scanned_vs_unrolled():
    """Each case run scanned (``scan=None``: chosen automatically) and unrolled (``scan=False``) on XLA."""
    device, _ = _xla()
    results = {}
    for name, (blocks, options, step) in CASES.items():
        dtype = step.get("dtype", torch.float64)
        runs = []
        for scan in (None, False):
            model = _model(scan, blocks, **options).to(device=device, dtype=dtype)
            runs.append(_step(model, device, **step))
        results[name] = runs
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_scan_equals_unrolled(scanned_vs_unrolled, case):
    (y, dx, grads, whiles), (y_ref, dx_ref, grads_ref, whiles_ref) = scanned_vs_unrolled[case]
    assert whiles == 2 and whiles_ref == 0  # the forward and the backward loop; the unrolled walk has none
    # float64: the same operations in the same order, inside a loop or not (XLA may fuse them differently);
    # float32 with bfloat16 autocast: the blocks round to bfloat16 alike, the streams' sums may round apart.
    tol = 1e-3 if case == "autocast_bf16_input_grad" else 1e-12
    assert max_rel_err(y, y_ref) < tol
    assert max_rel_err(dx, dx_ref) < tol
    assert len(grads) == len(grads_ref) == 4 * (4 if case == "period2_layerwise" else 3)
    for g, g_ref in zip(grads, grads_ref):
        if case == "autocast_bf16_input_grad":
            assert g is None and g_ref is None
        else:
            assert max_rel_err(g, g_ref) < tol


@pytest.mark.slow
def test_dropout_masks_are_the_unrolled_walks(scanned_vs_unrolled):
    """Exact replay: with Dropout(0.5) the same entries are zeroed, so the same parameter-gradient entries vanish."""
    (_, _, grads, _), (_, _, grads_ref, _) = scanned_vs_unrolled["dropout"]
    last_bias, last_bias_ref = grads[-1], grads_ref[-1]
    assert torch.equal(last_bias == 0, last_bias_ref == 0)


def test_program_does_not_grow_with_depth():
    """2 and 6 layers: the same loops and the same matrix products in the compiled program (traced, not run)."""
    device, torch_xla = _xla()
    texts = []
    for depth in (2, 6):
        model = _model(None, lambda: [Scaled() for _ in range(depth)]).to(device)
        x = torch.randn(4, 2 * WIDTH).to(device).requires_grad_()
        model(x, scale=torch.ones(WIDTH).to(device)).sum().backward()
        texts.append(torch_xla._XLAC._get_xla_tensors_hlo([x.grad, *(p.grad for p in model.parameters())]))
    (short, deep) = texts
    assert short.count(" while(") == deep.count(" while(") == 2
    assert short.count(" dot(") == deep.count(" dot(") > 0


def test_random_numbers_in_a_group_fall_back_or_raise():
    """A period-2 group whose layers draw random numbers would share one seed per iteration: unrolled with
    ``scan=None``, an error naming it with ``scan=True``."""
    device, _ = _xla()

    def blocks():
        return [Scaled(p=0.5, hidden=WIDTH if i % 2 == 0 else 2 * WIDTH) for i in range(4)]

    x = torch.randn(2, 2 * WIDTH).to(device).requires_grad_()
    model = _model(None, blocks).to(device)
    model(x, scale=torch.ones(WIDTH).to(device)).sum().backward()
    assert _whiles([x.grad]) == 0
    with pytest.raises(ReversibleError, match=r"scan=True\): the layers repeat in groups of 2 and draw random"):
        _model(True, blocks).to(device)(x, scale=torch.ones(WIDTH).to(device))


def test_scan_loop_is_a_capability_of_compiling_backends():
    assert backends.scan_loop("cpu") is None  # eager: the layers run as they come
    if backends.xla_available():
        assert callable(backends.scan_loop(backends.device_for("xla")))


# ---------------------------------------------------------------------------------------------------------------
# What rules the scan out: checked before any device work, so on the host.


def test_scan_true_names_the_first_differing_layer():
    model = _model(True, lambda: [Scaled(), Scaled(), Scaled(hidden=16), Scaled()])
    with pytest.raises(ReversibleError) as err:
        model(torch.randn(2, 2 * WIDTH), scale=torch.ones(WIDTH))
    message = str(err.value)
    assert "layer 2 ('1-0': Scaled) differs from layer 0 ('0-0': Scaled)" in message
    assert "its module 'net.0' is Linear(in_features=8, out_features=16, bias=True), not Linear(" in message
    assert "scan=False" in message


def test_scan_true_names_a_differing_setting_and_argument():
    model = _model(True, lambda: [Scaled(p=0.1), Scaled(p=0.2)])
    with pytest.raises(ReversibleError, match=r"layer 1 .* differs from layer 0 .*Dropout\(p=0.2"):
        model(torch.randn(2, 2 * WIDTH), scale=torch.ones(WIDTH))
    model = _model(True, lambda: [Scaled(), Scaled()])
    layerwise = [((torch.ones(WIDTH),), {}), ((torch.ones(2, WIDTH),), {})]
    with pytest.raises(ReversibleError, match="tensors of different shapes"):
        model(torch.randn(2, 2 * WIDTH), layerwise_args_kwargs=layerwise)


def test_scan_true_refuses_what_it_cannot_run():
    blocks = _same_layers()
    fused = _model(True, blocks, fused_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(ReversibleError, match="scan=True\\): fused_optimizer"):
        fused(torch.randn(2, 2 * WIDTH), scale=torch.ones(WIDTH))
    with pytest.raises(ReversibleError, match="scan=True needs a memory-saving mode"):
        _model(True, blocks, memory_mode=revlib.MemoryModes.no_savings)
    model = _model(True, blocks)
    model[1].block.net[0].register_forward_pre_hook(lambda *_: None)
    with pytest.raises(ReversibleError, match=r"layer 1 \('0-1': Scaled\) has hooks on its module 'net.0'"):
        model(torch.randn(2, 2 * WIDTH), scale=torch.ones(WIDTH))
    batch_norm = _model(True, lambda: [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH)) for _ in "ab"])
    with pytest.raises(ReversibleError, match="module '1' is in training mode with buffers"):
        batch_norm(torch.randn(2, 2 * WIDTH))
    model = _model(True, blocks)
    grad_scale = torch.ones(WIDTH, requires_grad=True)
    with pytest.raises(ReversibleError, match="tensor that requires grad"):
        model(torch.randn(2, 2 * WIDTH), scale=grad_scale)


def test_scan_true_on_an_eager_device_runs_the_layers_unrolled():
    """Nothing to compile on the host: identical layers run as the unrolled walk, with its gradients."""
    grads = []
    for scan in (True, False):
        model = _model(scan, _same_layers()).double()
        x = torch.randn(2, 2 * WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        model(x, scale=torch.ones(WIDTH, dtype=torch.float64)).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for g, g_ref in zip(*grads):
        assert torch.equal(g, g_ref)


@pytest.mark.slow
def test_llama_reversible_form_scans_and_compiles_once():
    """The Llama reversible form (attention and MLP branches alternate: period 2) takes the scan path by itself
    (scan=None), and
    its training step compiles once: no new compilation after the first step."""
    device, torch_xla = _xla()
    import torch_xla.debug.metrics as met

    from revlib_xla.models.llama import LlamaConfig, build_llama

    config = LlamaConfig(vocab_size=32, dim=16, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=8)
    torch.manual_seed(0)
    model = build_llama(config, "reversible", scan=None).to(device)
    # the first step's rebuild check adds an output to that step's graph only
    # (its cost: tests/reversible/test_rebuild_check.py)
    model.layers.verify_inverse = False
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = [torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    compiles, losses = [], []
    for step, batch in enumerate(tokens):
        met.clear_all()
        opt.zero_grad(set_to_none=True)
        loss = model.loss(batch.to(device))
        loss.backward()
        if step == 0:
            assert _whiles([p.grad for p in model.layers.parameters()]) == 2
        opt.step()
        torch_xla.sync()
        losses.append(float(loss.detach().cpu()))
        data = met.metric_data("CompileTime")
        compiles.append(0 if data is None else data[0])
    assert compiles[0] >= 1 and compiles[1:] == [0, 0], compiles
    assert all(torch.isfinite(torch.tensor(losses)))


# ---------------------------------------------------------------------------------------------------------------
# Stacked parameter storage (scan.stack_layers)


def _stacked_pair(blocks, seed=0, scan=None, **options):
    """The same model twice: unstacked and unrolled (the reference), and stacked (``scan``)."""
    reference = _model(False, blocks, seed, **options)
    stacked = revlib.scan.stack_layers(_model(scan, blocks, seed, **options))
    return reference, stacked


def _per_layer(model, tensors):
    """``tensors`` (one per stack, as ``model.parameters()``) as the unstacked model's parameter names -> tensor."""
    stacks = model._stacks
    attrs = [attr for entries in stacks.entries for attr, _ in entries]
    by_attr = dict(zip(attrs, tensors))
    out = {}
    for i, layer_name in enumerate(model._modules):
        j, t = i % stacks.period, i // stacks.period
        for attr, names in stacks.entries[j]:
            out[f"{layer_name}.{stacks.block}.{names[0]}"] = by_attr[attr][t]
    return out


@pytest.mark.slow
def test_stacked_layers_train_as_the_unstacked_model(device):
    """Three AdamW steps (weight decay, gradient clipping, dropout): every gradient, the clipped norm and every
    weight after each step equal the unstacked model's; on XLA the stacked model runs as the two loops."""
    reference, stacked = _stacked_pair(_same_layers(p=0.3))
    models = [m.to(device=device, dtype=torch.float64) for m in (reference, stacked)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.05, weight_decay=0.1) for m in models]
    x = torch.randn(4, 2 * WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).to(device)
    scale = (torch.rand(WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.5).to(device)
    with torch.no_grad():  # dropout draws: equal gradients mean equal masks
        assert not torch.equal(stacked(x, scale=scale), stacked.eval()(x, scale=scale))
    stacked.train()
    for step in range(3):
        grads, norms = [], []
        for model, opt in zip(models, optimizers):
            opt.zero_grad(set_to_none=step % 2 == 0)
            torch.manual_seed(10 + step)  # the layers' dropout seeds
            model(x, scale=scale).sin().sum().backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            grads.append([p.grad for p in model.parameters()])
            if step == 0 and model is stacked and device.type == "xla":
                assert _whiles(grads[-1]) == 2
            opt.step()
        expected = dict(zip((n for n, _ in reference.named_parameters()), grads[0]))
        found = _per_layer(stacked, grads[1])
        assert list(found) == list(expected)
        for name in expected:
            assert max_rel_err(found[name], expected[name]) < 1e-12, (step, name)
        assert max_rel_err(norms[1], norms[0]) < 1e-12
    states = [m.state_dict() for m in models]
    assert list(states[1]) == list(states[0])
    for key, value in states[0].items():
        assert max_rel_err(states[1][key], value) < 1e-12, key


def test_stacked_layers_keep_the_unstacked_state_dict():
    """Keys, order, shapes and values of the unstacked model; loading either model's state into the other; missing
    and misshapen entries reported by their unstacked keys; copies, pickles, dtype moves and layer-by-layer writes."""
    import copy
    import pickle

    reference, stacked = _stacked_pair(_two_kinds())
    assert [n for n, _ in stacked.named_parameters()][:2] == ["stacked_0_0_net_0_weight", "stacked_0_0_net_0_bias"]
    assert stacked.stacked_0_1_net_0_weight.shape == (2, 2 * WIDTH, WIDTH)  # two kinds alternate: 2 of each
    # one layer's shapes (a weight-decay rule by rank), also from a model holding the sequence
    holder = nn.Sequential(nn.LayerNorm(WIDTH), stacked)
    shapes = [tuple(revlib.scan.layer_shape(p, holder)) for p in holder.parameters()]
    assert shapes == [(WIDTH,), (WIDTH,)] + [tuple(p.shape) for p in reference.parameters()][:8]
    assert sum(p.numel() for p in stacked.parameters()) == sum(p.numel() for p in reference.parameters())
    expected, found = reference.state_dict(), stacked.state_dict()
    assert list(found) == list(expected)
    for key in expected:
        assert torch.equal(found[key], expected[key]), key
    fresh = revlib.scan.stack_layers(_model(None, _two_kinds(), seed=1))
    fresh.load_state_dict(expected)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key])
    back = _model(False, _two_kinds(), seed=2)
    back.load_state_dict(_perturbed(stacked.state_dict()))
    for key, value in back.state_dict().items():
        assert torch.equal(value, expected[key] + 1)
    partial = dict(expected)
    del partial["1-0.wrapped_module.wrapped_module.net.2.weight"]
    partial["0-1.wrapped_module.wrapped_module.net.0.bias"] = torch.zeros(3)
    with pytest.raises(RuntimeError) as err:
        fresh.load_state_dict(partial)
    assert 'Missing key(s) in state_dict: "1-0.wrapped_module.wrapped_module.net.2.weight"' in str(err.value)
    assert "size mismatch for 0-1.wrapped_module.wrapped_module.net.0.bias" in str(err.value)
    del partial["0-1.wrapped_module.wrapped_module.net.0.bias"]
    fresh = revlib.scan.stack_layers(_model(None, _two_kinds(), seed=1))
    missing = ["0-1.wrapped_module.wrapped_module.net.0.bias", "1-0.wrapped_module.wrapped_module.net.2.weight"]
    kept = {key: fresh.state_dict()[key].clone() for key in missing}
    result = fresh.load_state_dict(_perturbed(partial), strict=False)
    assert sorted(result.missing_keys) == missing
    for key, value in fresh.state_dict().items():  # the rest loaded, the missing ones kept
        assert torch.equal(value, kept[key] if key in kept else partial[key] + 1)
    for copied in (copy.deepcopy(stacked), pickle.loads(pickle.dumps(stacked))):
        assert list(copied.state_dict()) == list(expected)
        x = torch.randn(2, 2 * WIDTH)
        assert torch.equal(copied(x, scale=torch.ones(WIDTH)), stacked(x, scale=torch.ones(WIDTH)))
    assert stacked.double().stacked_0_0_net_0_weight.dtype == torch.float64
    with revlib.scan.layer_parameters(stacked) as model, torch.no_grad():
        model[2].block.net[0].weight.fill_(7.0)  # layer 2 is the second of the first kind
    assert stacked[2].block.net[0]._parameters.get("weight") is None
    assert (stacked.stacked_0_0_net_0_weight[1] == 7).all() and (stacked.stacked_0_0_net_0_weight[0] != 7).all()


def test_stacked_layers_compose_with_grad_scaler_and_zero_grad():
    """GradScaler's unscale_ divides the stacked gradients back to the unscaled ones; zero_grad clears them."""
    reference, stacked = _stacked_pair(_two_kinds())
    x = torch.randn(2, 2 * WIDTH, generator=torch.Generator().manual_seed(0))
    reference(x, scale=torch.ones(WIDTH)).sum().backward()
    opt = torch.optim.SGD(stacked.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(stacked(x, scale=torch.ones(WIDTH)).sum()).backward()
    scaler.unscale_(opt)
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for name, grad in _per_layer(stacked, [p.grad for p in stacked.parameters()]).items():
        assert max_rel_err(grad, expected[name]) < 1e-6, name
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in stacked.parameters())


def test_stacked_layers_without_the_reversible_walk():
    """Plain autograd (no_savings), no gradients, the inverse and check_invertible run the blocks on views of the
    stacks: the unstacked model's gradients and outputs."""
    mode = {"memory_mode": revlib.MemoryModes.no_savings}
    reference, stacked = _stacked_pair(_two_kinds(), scan=False, **mode)
    x = torch.randn(2, 2 * WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ones = torch.ones(WIDTH, dtype=torch.float64)
    for model in (reference.double(), stacked.double()):
        model(x, scale=ones).sin().sum().backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    for name, grad in _per_layer(stacked, [p.grad for p in stacked.parameters()]).items():
        assert max_rel_err(grad, expected[name]) < 1e-12, name
    with torch.no_grad():
        y = stacked(x, scale=ones)
        assert max_rel_err(y, reference(x, scale=ones)) < 1e-12
        assert max_rel_err(stacked.inverse(y, scale=ones), x) < 1e-9
    assert revlib.check_invertible(stacked, x, scale=ones).worst < 1e-9


def _perturbed(state):
    return {k: v + 1 for k, v in state.items()}


def test_stacked_layers_refuse_what_they_cannot_run():
    stack = revlib.scan.stack_layers
    with pytest.raises(ReversibleError, match=r"stack_layers: the layers are not identical in structure: layer 2"):
        stack(_model(None, lambda: [Scaled(), Scaled(), Scaled(hidden=16), Scaled()]))
    # Two different layers (one transformer block: attention, MLP) repeat nothing: said so, not only "differs".
    with pytest.raises(ReversibleError, match=r"stack_layers: 2 layers make no repeating group.*layer 1 .* differs"):
        stack(_model(None, lambda: [Scaled(), Scaled(hidden=16)]))
    with pytest.raises(ReversibleError, match="stack_layers: fused_optimizer"):
        stack(_model(None, _same_layers(), fused_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)))
    shared = Scaled()
    with pytest.raises(ReversibleError, match=r"layer 1 \('0-1': Scaled\) shares parameter"):
        stack(_model(None, lambda: [shared, shared]))
    hooked = _model(None, _same_layers())
    hooked[1].block.net[0].weight.register_hook(lambda g: g)
    with pytest.raises(ReversibleError, match=r"layer 1 .*'wrapped_module.wrapped_module.net.0.weight' has hooks"):
        stack(hooked)
    model = stack(_model(None, _same_layers()))
    with pytest.raises(ReversibleError, match="stacked already"):
        stack(model)
    with pytest.raises(ReversibleError, match=r"layer 0 \('0-0': Scaled\): its parameters are torch.float32, but"):
        model(torch.randn(2, 2 * WIDTH, dtype=torch.float64), scale=torch.ones(WIDTH))
    with pytest.raises(ReversibleError, match="a tensor argument requires grad"):
        model(torch.randn(2, 2 * WIDTH), scale=torch.ones(WIDTH, requires_grad=True))
    norm = stack(_model(None, lambda: [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH)) for _ in "ab"]))
    with pytest.raises(ReversibleError, match=r"stacked layers \(stack_layers\): .*training mode with buffers"):
        norm(torch.randn(2, 2 * WIDTH))
    norm.eval()
    norm(torch.randn(2, 2 * WIDTH)).sum().backward()  # eval mode: running statistics are read, not updated


@pytest.mark.slow
def test_stacked_scan_compiles_once_and_does_not_grow_with_depth():
    """Period-2 stacks under the scan: the step compiles once (none after the first), and the program of 4 and 8
    layers is the same program (no per-layer stacking or unstacking: the same number of HLO lines)."""
    device, torch_xla = _xla()
    import torch_xla.debug.metrics as met

    lines = []
    for depth in (4, 8):
        torch.manual_seed(0)
        blocks = [Scaled(hidden=WIDTH if i % 2 == 0 else 2 * WIDTH) for i in range(depth)]
        # unchecked: the first step's rebuild check adds an output to that step's graph only (test_rebuild_check)
        model = revlib.scan.stack_layers(revlib.ReversibleSequential(*blocks, scan=True, verify_inverse=False))
        model = model.to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        compiles = []
        for step in range(3 if depth == 4 else 1):
            met.clear_all()
            opt.zero_grad(set_to_none=True)
            x = torch.randn(4, 2 * WIDTH, generator=torch.Generator().manual_seed(step)).to(device)
            model(x, scale=torch.ones(WIDTH).to(device)).square().mean().backward()
            if step == 0:
                grads = [p.grad for p in model.parameters()]
                hlo = torch_xla._XLAC._get_xla_tensors_hlo(grads)
                assert hlo.count(" while(") == 2
                lines.append(hlo.count("\n"))
            opt.step()
            torch_xla.sync()
            data = met.metric_data("CompileTime")
            compiles.append(0 if data is None else data[0])
        if depth == 4:
            assert compiles[0] >= 1 and compiles[1:] == [0, 0], compiles
    assert lines[0] == lines[1]


def test_llama_with_scan_stacks_its_layers():
    """``build_llama(..., scan=None)`` stacks the reversible layers: the same weights from the same seed, the same
    state-dict keys and HF key map, HF weights loaded layer by layer, and the same loss and gradients (cpu)."""
    from revlib_xla.models.llama import LlamaConfig, build_llama

    config = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=8)
    plain, stacked = (build_llama(config, "reversible", scan=scan).double() for scan in (False, None))
    assert stacked.layers.scan is None and next(stacked.layers.named_parameters())[0].startswith("stacked_")
    for model in (plain, stacked):
        model.init_weights(seed=3)
    assert list(stacked.state_dict()) == list(plain.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(stacked.state_dict()[key], value), key
    assert stacked.hf_key_map() == plain.hf_key_map()
    hf = {theirs: plain.state_dict()[ours] * 2 for ours, theirs in plain.hf_key_map().items()}
    for model in (plain, stacked):
        model.load_hf_state_dict(hf)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    for key, value in plain.state_dict().items():  # the HF weights went into the stacks
        assert torch.equal(stacked.state_dict()[key], value), key
    losses = []
    for model in (plain, stacked):
        loss = model.loss(tokens)
        loss.backward()
        losses.append(loss.detach())
    assert max_rel_err(losses[1], losses[0]) < 1e-12
    found = {
        f"layers.{k}": g for k, g in _per_layer(stacked.layers, [p.grad for p in stacked.layers.parameters()]).items()
    }
    found |= {name: p.grad for name, p in stacked.named_parameters() if not name.startswith("layers.")}
    for name, param in plain.named_parameters():
        assert max_rel_err(found[name], param.grad) < 1e-12, name


# -- an optimizer built before stack_layers ----------------------------------------------------------------------------
# An optimizer built before :func:`revlib_xla.scan.stack_layers` holds the layers' replaced parameters: its step
# raises, naming one, instead of leaving them un-updated forever (the model would silently stop learning).


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.up(torch.tanh(x))


def _reversible() -> revlib.ReversibleSequential:
    torch.manual_seed(0)
    return revlib.ReversibleSequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)], scan=False)


def _checkpointable() -> revlib.Checkpointable:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), *[Block() for _ in range(3)], nn.Linear(WIDTH, 1))
    return revlib.Checkpointable(model, scan=True)


def _loss(module: nn.Module) -> torch.Tensor:
    x = torch.randn(4, 2 * WIDTH if isinstance(module, revlib.ReversibleSequential) else WIDTH)
    return module(x).square().mean()


@pytest.mark.parametrize("build", [_reversible, _checkpointable], ids=["reversible", "checkpointable"])
def test_an_optimizer_built_before_stacking_refuses_to_step(build):
    module = build()
    stale = torch.optim.SGD(module.parameters(), lr=0.1)
    revlib.scan.stack_layers(module)
    _loss(module).backward()
    with pytest.raises(ReplacedParameterError, match="stack_layers replaced.*build the optimizer after stack_layers"):
        stale.step()


@pytest.mark.parametrize("build", [_reversible, _checkpointable], ids=["reversible", "checkpointable"])
def test_an_optimizer_built_after_stacking_steps_every_stack(build):
    module = revlib.scan.stack_layers(build())
    fresh = torch.optim.SGD(module.parameters(), lr=0.1)
    before = [p.detach().clone() for p in module.parameters()]
    _loss(module).backward()
    fresh.step()
    fresh.step()  # the cached check: a second step of the same optimizer
    moved = [not torch.equal(b, p) for b, p in zip(before, module.parameters())]
    assert all(moved), moved
    fresh.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    fresh.step()  # a new group is looked at again, and holds nothing replaced


def test_a_group_added_later_with_a_replaced_parameter_is_refused():
    module = _reversible()
    old = list(module.parameters())
    revlib.scan.stack_layers(module)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    opt.step()
    opt.add_param_group({"params": old[:1]})
    with pytest.raises(ReplacedParameterError, match=r"'0-0\.wrapped_module"):
        opt.step()
