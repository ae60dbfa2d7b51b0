"""`import revlib_xla as revlib` runs RevLib 1.7 code: names, signatures, defaults, layout and the README examples."""

import importlib
import inspect

import pytest
import revlib_checkpoint
import torch
from conftest import max_rel_err
from torch import nn

import revlib_xla as revlib
from revlib_xla import utils


def params_of(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_public_names():
    for name in [
        "ReversibleSequential",
        "ReversibleModule",
        "ReversibleModuleCache",
        "MemoryModes",
        "offload_tensor",
        "DUAL_OR_QUAD_TENSOR",
        "additive_coupling_forward",
        "additive_coupling_inverse",
    ]:
        assert hasattr(revlib, name), name
    assert [m.name for m in revlib.MemoryModes] == ["no_savings", "checkpoint", "autograd_graph", "autograd_function"]
    assert [int(m) for m in revlib.MemoryModes] == [0, 1, 2, 3]
    for name in [
        "momentum_net",
        "sequential_to_revnet",
        "sequential_to_momentum_net",
        "module_list_to_momentum_net",
        "MomentumNetStem",
        "MomentumNetSide",
        "ResidualToPlain",
        "residual_to_plain",
        "maybe_residual_to_plain",
        "optional_detach",
        "is_float",
        "memory_efficient_intermediates",
        "detached_additive_coupling_forward",
        "detached_additive_coupling_inverse",
    ]:
        assert hasattr(utils, name), name


def test_signatures_and_defaults_match_revlib():
    rs = params_of(revlib.ReversibleSequential.__init__)
    assert rs[:8] == [
        ("self", inspect.Parameter.empty),
        ("modules", inspect.Parameter.empty),
        ("split_dim", 1),
        ("coupling_forward", None),
        ("coupling_inverse", None),
        ("memory_mode", revlib.MemoryModes.autograd_function),
        ("target_device", ""),
        ("fused_optimizer", None),
    ]
    fw = params_of(revlib.ReversibleSequential.forward)
    assert [n for n, _ in fw] == ["self", "inp", "args", "layerwise_args_kwargs", "kwargs"]
    rm = params_of(revlib.ReversibleModule.__init__)
    assert rm == [
        ("self", inspect.Parameter.empty),
        ("wrapped_module", inspect.Parameter.empty),
        ("coupling_forward", None),
        ("coupling_inverse", None),
        ("memory_savings", True),
        ("cache", None),
        ("target_device", ""),
        ("fused_optimizer", None),
    ]
    mn = dict(params_of(utils.momentum_net))
    assert mn["beta"] == 0.9 and mn["split_dim"] == 1 and mn["memory_mode"] == revlib.MemoryModes.autograd_function
    assert dict(params_of(utils.module_list_to_momentum_net))["residual"] is False


def test_state_dict_layout_and_coupling_cycling():
    pair = revlib.momentum_coupling(0.5)
    cf, ci = [pair.forward, None], [pair.inverse, None]
    model = revlib.ReversibleSequential(*[nn.Linear(2, 2) for _ in range(5)], coupling_forward=cf, coupling_inverse=ci)
    keys = list(model.state_dict())
    assert keys[:4] == [
        "0-0.wrapped_module.wrapped_module.weight",
        "0-0.wrapped_module.wrapped_module.bias",
        "0-1.wrapped_module.wrapped_module.weight",
        "0-1.wrapped_module.wrapped_module.bias",
    ]
    assert keys[-1] == "2-0.wrapped_module.wrapped_module.bias"
    couplings = [m.wrapped_module.coupling_forward for m in model]
    assert couplings[0] is cf[0] and couplings[2] is cf[0] and couplings[4] is cf[0]
    assert couplings[1] is revlib.additive_coupling_forward and couplings[3] is revlib.additive_coupling_forward
    # a state dict saved from one model loads into a fresh one
    fresh = revlib.ReversibleSequential(*[nn.Linear(2, 2) for _ in range(5)], coupling_forward=cf, coupling_inverse=ci)
    fresh.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    assert torch.equal(fresh(x), model(x))


def test_cache_modes_run_as_function_mode_with_warning():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(3, 3), nn.Tanh()) for _ in range(4)]
    x = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    ref = revlib.ReversibleSequential(*blocks, memory_mode=revlib.MemoryModes.no_savings).double()
    ref(x).square().sum().backward()
    want = [p.grad.clone() for p in ref.parameters()]
    for mode in (revlib.MemoryModes.checkpoint, revlib.MemoryModes.autograd_graph):
        with pytest.warns(UserWarning, match="runs as MemoryModes.autograd_function"):
            model = revlib.ReversibleSequential(*blocks, memory_mode=mode)
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        for a, b in zip(model.parameters(), want):
            assert max_rel_err(a.grad, b) <= 1e-12


def test_readme_depth_example_with_weight_sharing():
    depth, batch = 64, 32
    base = [nn.Sequential(nn.Linear(1, 1, bias=False), nn.ReLU(), nn.Linear(1, 1, bias=False))] * depth
    revnet = revlib.ReversibleSequential(*base)
    inp = torch.randn(batch, 2, requires_grad=True)
    out = revnet(inp)
    out.mean().backward()
    assert out.shape == (batch, 2) and base[0][0].weight.grad is not None


def test_readme_coupling_example_momentum_and_identity():
    beta = 0.99

    def momentum_coupling_forward(other_stream, fn_out):
        return other_stream * beta + fn_out * (1 - beta)

    def momentum_coupling_inverse(output, fn_out):
        return (output - fn_out * (1 - beta)) / beta

    channels, depth = 4, 3
    model = revlib.ReversibleSequential(
        *[layer for _ in range(depth) for layer in [nn.Conv2d(channels, channels, (3, 3), padding=1), nn.Identity()]],
        coupling_forward=[momentum_coupling_forward, revlib.additive_coupling_forward],
        coupling_inverse=[momentum_coupling_inverse, revlib.additive_coupling_inverse],
    ).double()
    x = torch.randn(2, channels * 2, 6, 6, dtype=torch.float64, requires_grad=True)
    out = model(x)
    assert out.shape == x.shape
    out.square().mean().backward()
    got = x.grad.clone()
    x.grad = None
    a, c = x.chunk(2, 1)
    for i, layer in enumerate(model):
        f = layer.block(c)
        a, c = c, (momentum_coupling_forward(a, f) if i % 2 == 0 else a + f)
    torch.cat([a, c], 1).square().mean().backward()
    assert max_rel_err(got, x.grad) <= 1e-10  # RevLib: 1.6% off here


def test_reformer_style_split_on_last_dim():
    features, heads = 8, 2

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(features, heads, batch_first=True)

        def forward(self, x):
            return self.attn(x, x, x, need_weights=False)[0]

    core = revlib.ReversibleSequential(
        *[
            nn.Sequential(nn.LayerNorm(features), layer)
            for _ in range(2)
            for layer in [Attn(), nn.Sequential(nn.Linear(features, 16), nn.GELU(), nn.Linear(16, features))]
        ],
        split_dim=-1,
    )
    model = nn.Sequential(nn.Embedding(16, 2 * features), core, nn.LayerNorm(2 * features), nn.Linear(2 * features, 16))
    out = model(torch.randint(0, 16, (3, 10)))
    assert out.shape == (3, 10, 16)
    out.logsumexp(-1).mean().backward()


def test_momentum_net_recurrence():
    """utils.momentum_net: p <- p + f_k(beta^k q), q <- q + (1-beta)/beta^(k+1) p (RevLib's construction)."""
    torch.manual_seed(0)
    beta = 0.7
    blocks = [nn.Sequential(nn.Linear(3, 3), nn.Tanh()) for _ in range(4)]
    model = utils.momentum_net(*blocks, beta=beta, split_dim=-1).double()
    x = torch.randn(2, 6, dtype=torch.float64)
    p, q = x[:, :3], x[:, 3:]
    for k, f in enumerate(blocks):
        p = p + f(q * beta**k)
        q = q + p * (1 - beta) / beta ** (k + 1)
    with torch.no_grad():
        assert max_rel_err(model(x), torch.cat([p, q], -1)) <= 1e-12
    assert len(model) == 8 and isinstance(model[0].block, utils.MomentumNetStem)


def test_sequential_to_revnet_residual():
    torch.manual_seed(0)

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return x + torch.tanh(self.lin(x))

    seq = nn.Sequential(*[Residual() for _ in range(3)])
    rev = utils.sequential_to_revnet(seq, residual=True, split_dim=-1)
    x = torch.randn(2, 6)
    a, c = x[:, :3], x[:, 3:]
    for m in seq:
        a, c = c, a + torch.tanh(m.lin(c))
    with torch.no_grad():
        assert max_rel_err(rev(x), torch.cat([a, c], -1)) <= 1e-6


def test_module_list_to_momentum_net_preserves_function_for_small_beta():
    """RevLib seeded the hidden stream with zeros and was 82-98% off the original stack; ours tends to it."""
    torch.manual_seed(0)

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return x + 0.5 * torch.tanh(self.lin(x))

    layers = nn.ModuleList([Residual() for _ in range(6)]).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    want = x
    for layer in layers:
        want = layer(want)
    errors = []
    for beta in (0.1, 0.01, 0.001):
        converted = utils.module_list_to_momentum_net(layers, residual=True, beta=beta)
        h = x
        with torch.no_grad():  # inference: nothing is rebuilt, any beta works
            for layer in converted:  # the caller's loop is unchanged
                h = layer(h)
        errors.append(max_rel_err(h, want))
    assert errors[0] < 0.1 and errors[2] < 2e-3 and errors[0] > errors[1] > errors[2]
    # it trains with the reversible backward, with the gradients of plain autograd
    grads = []
    for mode in (revlib.MemoryModes.autograd_function, revlib.MemoryModes.no_savings):
        layers.zero_grad(set_to_none=True)
        converted = utils.module_list_to_momentum_net(layers, residual=True, beta=0.5, memory_mode=mode)
        h = x.clone().requires_grad_()
        for layer in converted:
            h = layer(h)
        h.square().sum().backward()
        grads.append([p.grad.clone() for p in layers.parameters()])
    for got, want in zip(*grads):
        assert max_rel_err(got, want) <= 1e-10
    # but not at beta=0.001, where rebuilding the input from the output loses every digit over 6 layers
    converted = utils.module_list_to_momentum_net(layers, residual=True, beta=0.001)
    with pytest.raises(revlib.ReversibleError, match="rebuilt from the output through all 12 layers"):
        converted[0](x.clone().requires_grad_())


def test_standalone_reversible_module():
    torch.manual_seed(0)
    mod = revlib.ReversibleModule(nn.Linear(3, 3))
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    y0, y1 = mod((a, b))
    assert torch.equal(y0, b) and torch.allclose(y1, a + mod.block(b))
    z = torch.zeros(1)
    assert mod((a, b, z, z))[2] is z
    r0, r1 = mod.inverse((y0, y1))
    assert torch.allclose(r0, a, atol=1e-6) and torch.equal(r1, b)


# RevLib 1.7.2's public names, read from the installed package (revlib/__init__.py's __all__; the public names
# defined in or imported into revlib/core.py and revlib/utils.py, modules like torch and typing left out).
REVLIB_1_7_2 = {
    "revlib": [
        "ReversibleSequential",
        "ReversibleModule",
        "ReversibleModuleCache",
        "reverse_and_swap",
        "MemoryModes",
        "offload_tensor",
        "TensorOffload",
        "DUAL_OR_QUAD_TENSOR",
        "replace_grad",
        "additive_coupling_forward",
        "additive_coupling_inverse",
    ],
    "revlib.core": [
        "DUAL_OR_QUAD_TENSOR",
        "TENSOR_OR_LIST",
        "COUPLING",
        "FUSED_OPTIMIZER",
        "MemoryModes",
        "split_tensor_list",
        "take_0th_tensor",
        "ReversibleWrapper",
        "TensorOffload",
        "offload_tensor",
        "replace_grad",
        "reverse_and_swap",
        "additive_coupling_forward",
        "additive_coupling_inverse",
        "ReversibleModuleCache",
        "get_key",
        "ReversibleModule",
        "SingleBranchReversibleModule",
        "MergeCalls",
        "ReversibleSequential",
    ],
    "revlib.utils": [
        "FUSED_OPTIMIZER",
        "MemoryModes",
        "MergeCalls",
        "ReversibleSequential",
        "SingleBranchReversibleModule",
        "get_key",
        "split_tensor_list",
        "MomentumNetSide",
        "MomentumNetStem",
        "ResidualToPlain",
        "optional_detach",
        "detached_additive_coupling_forward",
        "detached_additive_coupling_inverse",
        "momentum_net",
        "residual_to_plain",
        "maybe_residual_to_plain",
        "sequential_to_revnet",
        "sequential_to_momentum_net",
        "module_list_to_momentum_net",
        "is_float",
        "memory_efficient_intermediates",
    ],
}
# Pieces of RevLib's per-layer engine: importable, and raising at use with what to do instead (revlib_xla.core).
UNAVAILABLE = {"reverse_and_swap", "SingleBranchReversibleModule"}


@pytest.mark.parametrize("module", sorted(REVLIB_1_7_2))
def test_every_public_revlib_name_is_found(module):
    ours = importlib.import_module(module.replace("revlib", "revlib_xla", 1))
    missing = [name for name in REVLIB_1_7_2[module] if not hasattr(ours, name)]
    assert not missing, f"{module}: {missing}"
    if hasattr(ours, "__all__"):  # `from revlib_xla.core import *` gives what `from revlib.core import *` gives
        assert set(REVLIB_1_7_2[module]) <= set(ours.__all__) | {n for n in dir(revlib) if not n.startswith("_")}


def test_facade_names_are_the_native_objects():
    """revlib_xla.core and revlib_xla.utils add no second implementation of what the package already has."""
    core = importlib.import_module("revlib_xla.core")
    for name in REVLIB_1_7_2["revlib"]:
        if hasattr(revlib, name) and name not in UNAVAILABLE:
            assert getattr(core, name) is getattr(revlib, name), name
    for name in ("MergeCalls", "get_key", "split_tensor_list", "ReversibleSequential", "MemoryModes"):
        assert getattr(utils, name) is getattr(core, name), name
    for alias in ("DUAL_OR_QUAD_TENSOR", "TENSOR_OR_LIST", "COUPLING", "FUSED_OPTIMIZER"):
        assert getattr(revlib, alias) is getattr(core, alias)


def test_engine_pieces_raise_with_what_to_use():
    from revlib_xla.core import SingleBranchReversibleModule, reverse_and_swap

    with pytest.raises(revlib.ReversibleError, match=r"reverse_and_swap.*ReversibleSequential\(\*blocks\)"):
        reverse_and_swap(torch.zeros(1), torch.zeros(1))
    with pytest.raises(revlib.ReversibleError, match=r"module_list_to_momentum_net\(module_list, beta=...\)"):
        SingleBranchReversibleModule([], nn.Linear(2, 2))


def test_checkpoint_saved_by_revlib_1_7_2_loads_with_its_outputs_and_gradients():
    """tests/reversible/data/revlib_1_7_2_checkpoint.pt was written by the real RevLib 1.7.2
    (tests/reversible/revlib_checkpoint.py): its state dict loads strictly, and revlib_xla computes RevLib's output
    and gradients from it (float64)."""
    saved = torch.load(revlib_checkpoint.PATH)
    assert saved["revlib_version"] == "1.7.2"
    from revlib_xla.core import ReversibleSequential  # RevLib-style import

    model = ReversibleSequential(*revlib_checkpoint.blocks()).double()
    model.load_state_dict(saved["state_dict"], strict=True)
    x = saved["input"].clone().requires_grad_()
    out = model(x)
    assert max_rel_err(out, saved["output"]) <= 1e-13
    out.square().mean().backward()
    assert max_rel_err(x.grad, saved["input_grad"]) <= 1e-12
    grads = dict(model.named_parameters())
    assert grads.keys() == saved["param_grads"].keys()
    for name, want in saved["param_grads"].items():
        assert max_rel_err(grads[name].grad, want) <= 1e-12, name


def test_merge_calls_collates_list_outputs_revlib_style():
    """RevLib's utils.MergeCalls: modules called in turn with the same extra arguments; list outputs pass their
    first element on and are collated at the end."""
    from revlib_xla.utils import MergeCalls

    torch.manual_seed(0)

    class WithExtra(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3).double()

        def forward(self, x, scale):
            y = torch.tanh(self.lin(x)) * scale
            return [y, y.sum()]

    a, b = WithExtra(), WithExtra()
    merged = MergeCalls(a, b, collate_fn=lambda y, outs: [y] + [o[1] for o in outs])
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    y, s0, s1 = merged(x, 0.5)
    ya = torch.tanh(a.lin(x)) * 0.5
    yb = torch.tanh(b.lin(ya)) * 0.5
    assert max_rel_err(y, yb) <= 1e-15 and max_rel_err(s0, ya.sum()) <= 1e-15 and max_rel_err(s1, yb.sum()) <= 1e-15
    got = torch.autograd.grad((y.sum() + s0 + s1), [x, *merged.parameters()])
    want = torch.autograd.grad((yb.sum() + ya.sum() + yb.sum()), [x, *a.parameters(), *b.parameters()])
    for g, w in zip(got, want):
        assert max_rel_err(g, w) <= 1e-14
    plain = MergeCalls(nn.Tanh(), nn.Tanh(), collate_fn=lambda y, outs: 1 / 0)  # no list output: no collate
    assert torch.equal(plain(x), torch.tanh(torch.tanh(x)))


def test_core_helpers():
    from revlib_xla.core import TensorOffload, get_key, offload_tensor, replace_grad, split_tensor_list, take_0th_tensor

    t, u = torch.ones(2), torch.zeros(3)
    assert split_tensor_list(t) is t
    first, rest = split_tensor_list((t, u, 1))
    assert first is t and rest == [u, 1] and take_0th_tensor([u, t]) is u and take_0th_tensor(t) is t
    with pytest.raises(ValueError, match="expected a tensor or an iterable"):
        split_tensor_list(3)
    assert get_key(1, t) != get_key(2, t) != get_key(2, u)
    assert TensorOffload.apply is offload_tensor
    # replace_grad: the values pass through; the carried tensors receive the values as their gradients
    a, b = torch.randn(2, requires_grad=True), torch.randn(2, requires_grad=True)
    ca, cb = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    ra, rb = replace_grad(a, b, ca, cb)
    assert torch.equal(ra, a) and torch.equal(rb, b)
    (ra * 3 + rb * 5).sum().backward()
    assert torch.equal(a.grad, torch.full((2,), 3.0)) and torch.equal(b.grad, torch.full((2,), 5.0))
    assert torch.equal(ca.grad, a.detach()) and torch.equal(cb.grad, b.detach())
