"""revlib_xla against an independent JAX implementation of the same reversible network.

The torch model runs in its default memory mode (the reversible backward, which rebuilds every layer's input from
its output); the JAX reference (tests/reversible/jax_reference.py) runs a plain forward and ``jax.value_and_grad``
on weights copied from the torch model. Loss, every parameter gradient and the input gradient must agree elementwise:
max|torch - jax| / max|jax| <= 1e-5 in float32 (and <= 1e-12 in float64, which separates rounding noise from a
semantic difference).
"""

import contextlib

import pytest

jax = pytest.importorskip("jax", reason="the JAX reference needs jax (pip install 'revlib_xla[jax]')")
import jax.numpy as jnp
import numpy as np
import torch
from conftest import max_rel_err
from jax_reference import from_torch, torch_names
from torch import nn

import revlib_xla as revlib
from revlib_xla import backends

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


# ---------------------------------------------------------------------------------------------------------------
# torch blocks


class PreLNSelfAttention(nn.Module):
    """f(x) = MultiheadAttention(LN(x)) on (batch, seq, dim), causal or unmasked."""

    def __init__(self, dim, heads, causal):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.causal = causal

    def forward(self, x):
        h = self.norm(x)
        mask = None
        if self.causal:  # True = may not attend
            seq = x.shape[1]
            mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        return self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]


def mlp(width, hidden, act, out=None):
    return nn.Sequential(nn.Linear(width, hidden), act, nn.Linear(hidden, out or width))


def transformer_mlp(dim):
    return nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))


# ---------------------------------------------------------------------------------------------------------------
# cases: (torch model, JAX coupling specs, input shape)


def case_mlp():
    acts = [nn.ReLU(), nn.GELU(approximate="tanh"), nn.Tanh(), nn.SiLU()]
    model = revlib.ReversibleSequential(*[mlp(8, 16, a) for a in acts], split_dim=1)
    return model, ["additive"], (4, 16)


def case_conv():
    blocks = [
        nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1)),
        # even kernel with padding='same': torch pads one more on the right/bottom
        nn.Sequential(nn.Conv2d(4, 4, (2, 4), padding="same"), nn.GELU(), nn.Conv2d(4, 4, 1, bias=False)),
        nn.Sequential(
            nn.Conv2d(4, 8, 3, padding=2, dilation=2, groups=2), nn.Tanh(), nn.Conv2d(8, 4, 3, padding="same", groups=4)
        ),
        nn.Sequential(nn.Conv2d(4, 4, 5, padding=2), nn.Sigmoid()),
    ]
    return revlib.ReversibleSequential(*blocks, split_dim=1), ["additive"], (2, 8, 6, 6)


def case_transformer():
    dim, heads = 16, 4
    blocks = [
        PreLNSelfAttention(dim, heads, causal=True),
        transformer_mlp(dim),
        PreLNSelfAttention(dim, heads, causal=False),
        transformer_mlp(dim),
    ]
    return revlib.ReversibleSequential(*blocks, split_dim=-1), ["additive"], (2, 6, 2 * dim)


def case_coupled_mlp():
    """Cycled couplings over 5 layers: momentum, affine, additive, momentum, affine."""
    momentum, affine = revlib.momentum_coupling(0.8), revlib.affine_coupling(dim=1)
    pairs = [momentum, affine, revlib.CouplingPair(None, None)]
    specs = [("momentum", 0.8), ("affine", 1, 2.0, 1e-3), "additive"]
    acts = [nn.Tanh(), nn.GELU(), nn.ReLU(), nn.SiLU(), nn.Tanh()]
    blocks = [mlp(8, 16, a, out=16 if i % 3 == 1 else 8) for i, a in enumerate(acts)]
    model = revlib.ReversibleSequential(
        *blocks, split_dim=1, coupling_forward=[p.forward for p in pairs], coupling_inverse=[p.inverse for p in pairs]
    )
    return model, specs, (4, 16)


def case_coupled_conv():
    """Affine coupling along channels and momentum coupling on Conv2d blocks."""
    affine, momentum = revlib.affine_coupling(dim=1, scale_offset=1.0, eps=1e-2), revlib.momentum_coupling(0.5)
    blocks = [
        nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 8, 1)),
        nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 8, 1)),
    ]
    model = revlib.ReversibleSequential(
        *blocks,
        split_dim=1,
        coupling_forward=[affine.forward, momentum.forward],
        coupling_inverse=[affine.inverse, momentum.inverse],
    )
    return model, [("affine", 1, 1.0, 1e-2), ("momentum", 0.5)], (2, 8, 5, 5)


CASES = {
    "mlp": case_mlp,
    "conv": case_conv,
    "transformer": case_transformer,
    "coupled_mlp": case_coupled_mlp,
    "coupled_conv": case_coupled_conv,
}


# ---------------------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture
def full_precision(device):
    """float32 matmuls/convolutions at full precision on every backend (no TF32, no bf16 passes)."""
    matmul, cudnn_tf32 = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    xla_precision = None
    if device.type == "xla":
        import torch_xla.backends

        xla_precision = torch_xla.backends.get_mat_mul_precision()
        torch_xla.backends.set_mat_mul_precision("highest")
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    if xla_precision is not None:
        import torch_xla.backends

        torch_xla.backends.set_mat_mul_precision(xla_precision)


def loss_torch(out, w):
    return (out * w).sum() + (out**2).mean()


def loss_jax(out, w):
    return jnp.sum(out * w) + jnp.mean(out**2)


def ran_reversible_backward(out):
    """True when the graph behind ``out`` contains revlib_xla's reversible layers (their autograd nodes)."""
    stack, seen = [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if "ReversibleLayerFn" in type(fn).__name__:
            return True
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return False


def skip_unsupported_float64(device, dtype):
    """float64 is a diagnostic (it separates rounding noise from a semantic difference): run it where the backend
    computes float64 exactly. torch_xla lowers GELU with float32 precision even for float64 tensors (absolute error
    ~5e-9 against torch's float64 GELU), and TPUs have no native float64."""
    if dtype == torch.float64 and device.type == "xla":
        pytest.skip("float64 diagnostic runs on cpu/cuda only (torch_xla's float64 GELU is float32-accurate)")


_REFERENCE_CACHE = {}


def x64_mode():
    """JAX's 64-bit mode for the arrays created and traced inside: ``jax.enable_x64(True)`` where jax has it (0.8
    and later; 0.9 removed ``jax.experimental.enable_x64``), else ``jax.experimental.enable_x64()`` (jax 0.7)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is not None:
        return enable(True)
    from jax.experimental import enable_x64

    return enable_x64()


def jax_reference(case, dtype, model, coupling_specs, x_host, w_host):
    """Loss, parameter gradients (by torch name) and input gradient from the JAX reference, as numpy arrays.

    Models and inputs are seeded, so the reference depends on (case, dtype) only: it is computed once and shared
    by the device kinds. float64 needs JAX's x64 mode while its arrays are created and traced. The reference runs on
    JAX's CPU device wherever jax has a GPU too (a CUDA jax would otherwise compute it there, float32 matmuls in
    TF32)."""
    key = (case, dtype)
    if key not in _REFERENCE_CACHE:
        x64 = x64_mode() if dtype == torch.float64 else contextlib.nullcontext()
        with x64, jax.default_device(jax.devices("cpu")[0]):
            net, params = from_torch(model, coupling_specs)
            jx, jw = jnp.asarray(x_host.numpy()), jnp.asarray(w_host.numpy())
            loss, (param_grads, x_grad) = net.value_and_grad(params, jx, lambda out: loss_jax(out, jw))
            assert loss.dtype == (jnp.float64 if dtype == torch.float64 else jnp.float32)
            param_grads = {k: np.array(v) for k, v in torch_names(net, param_grads).items()}
            _REFERENCE_CACHE[key] = (np.array(loss), param_grads, np.array(x_grad))
    return _REFERENCE_CACHE[key]


# ---------------------------------------------------------------------------------------------------------------


def test_x64_mode_makes_float64_arrays_inside_only():
    """The x64 switch this jax has (jax >= 0.9 has no jax.experimental.enable_x64) turns 64-bit arrays on inside
    the block and leaves the default (32 bits) outside it."""
    with x64_mode():
        assert jnp.asarray(1.0, dtype=jnp.float64).dtype == jnp.float64
    assert jnp.asarray(1.0).dtype == jnp.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_matches_jax_reference(case, dtype, device, full_precision):
    skip_unsupported_float64(device, dtype)
    torch.manual_seed(0)
    model, coupling_specs, shape = CASES[case]()
    model = model.to(dtype)
    assert model.memory_mode == revlib.MemoryModes.autograd_function  # the default: reversible backward
    gen = torch.Generator().manual_seed(1)
    x_host = torch.randn(shape, generator=gen, dtype=dtype)
    w_host = torch.randn(shape, generator=gen, dtype=dtype)

    ref_loss, ref_param_grads, ref_x_grad = jax_reference(case, dtype, model, coupling_specs, x_host, w_host)

    # revlib_xla on the device
    model = model.to(device)
    x = x_host.to(device).requires_grad_()
    out = model(x)
    assert ran_reversible_backward(out)
    loss = loss_torch(out, w_host.to(device))
    loss.backward()
    backends.sync(device)  # one XLA graph for the loss and all gradients (not one per tensor read)

    errors = {
        "loss": max_rel_err(loss, torch.from_numpy(ref_loss)),
        "input": max_rel_err(x.grad, torch.from_numpy(ref_x_grad)),
    }
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert set(grads) == set(ref_param_grads), "every torch parameter must have a JAX counterpart"
    for name, g in grads.items():
        assert g is not None, f"{name} got no gradient"
        errors[name] = max_rel_err(g, torch.from_numpy(ref_param_grads[name]))
    worst = max(errors, key=errors.get)
    print(f"[{case} {device.type} {str(dtype)[6:]}] worst {worst}: {errors[worst]:.2e}")
    bad = {k: f"{v:.2e}" for k, v in errors.items() if not v <= TOL[dtype]}
    assert not bad, f"{case} on {device.type} ({dtype}): relative errors above {TOL[dtype]:g}: {bad}"
