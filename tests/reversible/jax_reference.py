"""An independent pure-JAX reference for revlib_xla's ReversibleSequential.

The network is computed the straightforward way: a plain forward over the layers and ``jax.value_and_grad``
(which stores every activation; no reversibility, no recomputation). It shares no code with revlib_xla; the only
bridge is :func:`from_torch`, which walks a torch ``ReversibleSequential``, describes each block as a static spec
and copies its ``state_dict`` into a JAX pytree.

Layer semantics (RevLib's): the input is split into two streams ``(x0, x1)`` along ``split_dim``; layer ``i`` maps
``(x0, x1) -> (x1, couple_i(x0, block_i(x1)))``; the output is ``concat(y0, y1)`` along ``split_dim``.

Supported blocks: ``nn.Sequential`` of ``nn.Linear``, ``nn.Conv2d`` (NCHW, zero padding, any stride/dilation/
groups), ``nn.LayerNorm``, activations (ReLU, GELU exact or tanh, Tanh, SiLU, Sigmoid, Identity), and pre-LN
self-attention modules: any module with ``norm`` (LayerNorm), ``attn`` (``nn.MultiheadAttention``, self-attention,
``batch_first=True``) and ``causal`` (bool) attributes computing ``attn(LN(x))``.

Couplings are described explicitly (a torch coupling is a closure whose constants cannot be read back):
``"additive"`` (or ``None``), ``("momentum", beta)``, ``("affine", dim, scale_offset, eps)``; a list is cycled
per layer, as in revlib_xla.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

# The reference runs on the host CPU; never let JAX claim an accelerator that torch (or torch_xla) is using.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

Params = Any  # a pytree of arrays

# ---------------------------------------------------------------------------------------------------------------
# Blocks. A spec is a hashable tuple (static), params a pytree mirroring the torch module's children.


def linear(p, x):
    y = jnp.matmul(x, p["weight"].T)
    return y if p.get("bias") is None else y + p["bias"]


def conv2d(p, x, stride, padding, dilation, groups):
    y = jax.lax.conv_general_dilated(
        x,
        p["weight"],
        window_strides=stride,
        padding=padding,
        rhs_dilation=dilation,
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
        feature_group_count=groups,
    )
    return y if p.get("bias") is None else y + p["bias"][None, :, None, None]


def layer_norm(p, x, eps, ndim):
    axes = tuple(range(-ndim, 0))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=axes, keepdims=True)  # biased, as torch
    y = (x - mean) / jnp.sqrt(var + eps)
    if p.get("weight") is not None:
        y = y * p["weight"]
    if p.get("bias") is not None:
        y = y + p["bias"]
    return y


ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # torch's default: exact, with erf
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "tanh": jnp.tanh,
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "identity": lambda x: x,
}


def self_attention(p, x, heads, causal):
    """Multi-head self-attention on (batch, seq, dim), as ``nn.MultiheadAttention(batch_first=True)``."""
    batch, seq, dim = x.shape
    head_dim = dim // heads
    q, k, v = jnp.split(linear({"weight": p["in_proj_weight"], "bias": p.get("in_proj_bias")}, x), 3, axis=-1)

    def heads_first(t):  # (batch, seq, dim) -> (batch, heads, seq, head_dim)
        return t.reshape(batch, seq, heads, head_dim).transpose(0, 2, 1, 3)

    q, k, v = heads_first(q), heads_first(k), heads_first(v)
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.sqrt(head_dim)
    if causal:
        allowed = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(allowed, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bhkd->bhqd", weights, v).transpose(0, 2, 1, 3).reshape(batch, seq, dim)
    return linear(p["out_proj"], out)


def apply_block(spec, p, x):
    kind = spec[0]
    if kind == "sequential":
        for name, child in spec[1]:
            x = apply_block(child, p[name], x)
        return x
    if kind == "linear":
        return linear(p, x)
    if kind == "conv2d":
        return conv2d(p, x, *spec[1:])
    if kind == "layer_norm":
        return layer_norm(p, x, *spec[1:])
    if kind == "act":
        return ACTIVATIONS[spec[1]](x)
    if kind == "pre_ln_attention":
        _, heads, causal, eps = spec
        return self_attention(p["attn"], layer_norm(p["norm"], x, eps, 1), heads, causal)
    raise ValueError(f"unknown block spec {spec!r}")


# ---------------------------------------------------------------------------------------------------------------
# Couplings: couple(other_stream, f) -> new stream.


def couple(spec, other, f):
    if spec is None or spec == "additive":
        return other + f
    if spec[0] == "momentum":
        beta = spec[1]
        return other * beta + f * (1 - beta)
    if spec[0] == "affine":
        _, dim, scale_offset, eps = spec
        log_scale, shift = jnp.split(f, 2, axis=dim)
        return other * (jax.nn.sigmoid(log_scale + scale_offset) + eps) + shift
    raise ValueError(f"unknown coupling spec {spec!r}")


# ---------------------------------------------------------------------------------------------------------------
# The network.


@dataclasses.dataclass(frozen=True)
class ReversibleNet:
    """Static description of a reversible sequence: layer names, block specs, coupling per layer, split axis."""

    names: tuple[str, ...]
    blocks: tuple[Any, ...]
    couplings: tuple[Any, ...]
    split_dim: int

    def __call__(self, params: Params, x):
        x0, x1 = jnp.split(x, 2, axis=self.split_dim)
        for name, block, coupling in zip(self.names, self.blocks, self.couplings):
            x0, x1 = x1, couple(coupling, x0, apply_block(block, params[name], x1))
        return jnp.concatenate([x0, x1], axis=self.split_dim)

    def value_and_grad(self, params: Params, x, loss_fn):
        """``loss_fn(output)`` and its gradients with respect to ``params`` and ``x``, with float32 matmuls and
        convolutions at full precision. (``jax.jit`` only compiles the plain forward and its ``jax.grad`` as one
        program, which is much faster than running them op by op.)"""
        with jax.default_matmul_precision("highest"):
            fn = jax.value_and_grad(lambda p, inp: loss_fn(self(p, inp)), argnums=(0, 1))
            return jax.jit(fn)(params, x)


def torch_names(net: ReversibleNet, tree: Params, prefix: str = "wrapped_module.wrapped_module") -> dict[str, Any]:
    """Flatten a params-shaped pytree (e.g. gradients) to the torch ``state_dict`` names
    (``'0-1.wrapped_module.wrapped_module.0.weight'``)."""
    out = {}
    for name in net.names:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree[name])[0]:
            keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
            out[".".join([name, prefix, *keys])] = leaf
    return out


# ---------------------------------------------------------------------------------------------------------------
# torch -> JAX


def _torch_activation(module) -> str:
    from torch import nn

    if isinstance(module, nn.GELU):
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    table = {nn.ReLU: "relu", nn.Tanh: "tanh", nn.SiLU: "silu", nn.Sigmoid: "sigmoid", nn.Identity: "identity"}
    for cls, name in table.items():
        if isinstance(module, cls):
            return name
    raise NotImplementedError(f"jax_reference: no JAX version of {type(module).__name__}")


def _conv_padding(module) -> tuple[tuple[int, int], ...]:
    if module.padding_mode != "zeros":
        raise NotImplementedError(f"jax_reference: Conv2d padding_mode={module.padding_mode!r}")
    if module.padding == "valid":
        return ((0, 0), (0, 0))
    if module.padding == "same":  # torch puts the extra element of an odd total on the right/bottom
        pads = []
        for k, d in zip(module.kernel_size, module.dilation):
            total = d * (k - 1)
            pads.append((total // 2, total - total // 2))
        return tuple(pads)
    return tuple((p, p) for p in module.padding)


def _block_spec(module, state: dict[str, np.ndarray], prefix: str):
    """(spec, params) of one torch module; params are read from ``state`` under ``prefix``."""
    from torch import nn

    def get(name, required=True):
        key = prefix + name
        if key not in state:
            if required:
                raise KeyError(f"jax_reference: {key} not in the state dict")
            return None
        return jnp.asarray(state[key])

    if isinstance(module, nn.Sequential):
        specs, params = [], {}
        for name, child in module.named_children():
            spec, p = _block_spec(child, state, f"{prefix}{name}.")
            specs.append((name, spec))
            params[name] = p
        return ("sequential", tuple(specs)), params
    if isinstance(module, nn.Linear):
        return ("linear",), {"weight": get("weight"), "bias": get("bias", False)}
    if isinstance(module, nn.Conv2d):
        spec = ("conv2d", tuple(module.stride), _conv_padding(module), tuple(module.dilation), module.groups)
        return spec, {"weight": get("weight"), "bias": get("bias", False)}
    if isinstance(module, nn.LayerNorm):
        spec = ("layer_norm", module.eps, len(module.normalized_shape))
        return spec, {"weight": get("weight", False), "bias": get("bias", False)}
    attn = getattr(module, "attn", None)
    norm = getattr(module, "norm", None)
    if isinstance(attn, nn.MultiheadAttention) and isinstance(norm, nn.LayerNorm):
        if not (attn.batch_first and attn._qkv_same_embed_dim and attn.bias_k is None and not attn.add_zero_attn):
            raise NotImplementedError("jax_reference: only batch_first self-attention with a packed in-projection")
        if len(norm.normalized_shape) != 1:
            raise NotImplementedError("jax_reference: attention's LayerNorm must normalize the last dim only")
        p = {
            "norm": {"weight": get("norm.weight", False), "bias": get("norm.bias", False)},
            "attn": {
                "in_proj_weight": get("attn.in_proj_weight"),
                "in_proj_bias": get("attn.in_proj_bias", False),
                "out_proj": {"weight": get("attn.out_proj.weight"), "bias": get("attn.out_proj.bias", False)},
            },
        }
        return ("pre_ln_attention", attn.num_heads, bool(module.causal), norm.eps), p
    return ("act", _torch_activation(module)), {}


def _drop_none(tree):
    if isinstance(tree, dict):
        return {k: _drop_none(v) for k, v in tree.items() if v is not None}
    return tree


def from_torch(model, couplings: Sequence[Any] = ("additive",)) -> tuple[ReversibleNet, Params]:
    """Describe a torch ``ReversibleSequential`` and copy its weights (from its ``state_dict``, any device) into a
    JAX pytree ``{layer_name: block_params}``; ``couplings`` is cycled over the layers (see the module docstring)."""
    import revlib_xla

    if model.split_dim is None:
        raise NotImplementedError("jax_reference: split_dim=None (replicated streams) is not modelled")
    state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    names, blocks, coupling_specs, params = [], [], [], {}
    for i, (name, layer) in enumerate(model.named_children()):
        spec, p = _block_spec(layer.wrapped_module.wrapped_module, state, f"{name}.wrapped_module.wrapped_module.")
        coupling = couplings[i % len(couplings)]
        is_additive = layer.wrapped_module.coupling_forward is revlib_xla.additive_coupling_forward
        if (coupling in (None, "additive")) != is_additive:
            raise ValueError(
                f"jax_reference: layer {name} coupling spec {coupling!r} does not match the torch "
                f"model's coupling {layer.wrapped_module.coupling_forward!r}"
            )
        names.append(name)
        blocks.append(spec)
        coupling_specs.append(coupling)
        params[name] = _drop_none(p)
    return ReversibleNet(tuple(names), tuple(blocks), tuple(coupling_specs), model.split_dim), params
