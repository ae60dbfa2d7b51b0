"""Pallas (JAX) kernels of the few-bit backward for TPU: code-and-pack, and unpack-lookup-multiply.

Bit for bit what :mod:`.fewbit_reference` computes (layout documented there). The kernels work on the codes laid
out as rows of one packing group: the input as a (groups, GROUP) array, the packed bytes as (groups, BYTES). Levels
are looked up with a chain of selects (TPUs have no cheap gather), borders and levels are compile-time constants.

* :func:`encode_stepwise` / :func:`stepwise_grad`: JAX functions (``interpret=True`` runs them on the CPU; the tests
  compare them with the torch reference on the same data through numpy).
* :func:`encode_stepwise_torch_xla` / :func:`stepwise_grad_torch_xla`: the same kernels called from torch_xla on a
  TPU through ``torch_xla.experimental.custom_kernel.make_kernel_from_pallas``. **Not run in this project's tests**:
  no TPU was available, and torch_xla's Pallas bridge needs the TPU (Mosaic) compiler.

Importing this module does not import JAX.
"""
from __future__ import annotations

import functools
from typing import Sequence, Tuple

from .fewbit_reference import GROUP

__all__ = ["encode_stepwise", "stepwise_grad", "encode_stepwise_torch_xla", "stepwise_grad_torch_xla"]

_BLOCK_GROUPS = 512


def _padded_groups(n: int, bits: int) -> Tuple[int, int]:
    groups = -(-n // GROUP[bits])
    blocks = -(-groups // _BLOCK_GROUPS)
    return groups, blocks


@functools.lru_cache(maxsize=None)
def _encode_call(borders: Tuple[float, ...], bits: int, n: int, groups_padded: int, dtype_name: str,
                 interpret: bool):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    group, per_group = GROUP[bits], bits * GROUP[bits] // 8
    block = min(_BLOCK_GROUPS, groups_padded)

    def kernel(x_ref, out_ref):
        x = x_ref[...].astype(jnp.float32)
        code = jnp.zeros(x.shape, jnp.int32)
        for border in borders:
            code = code + (x > jnp.float32(border)).astype(jnp.int32)
        row = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) + pl.program_id(0) * block
        index = row * group + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
        code = jnp.where(index < n, code, 0)  # padding codes are 0, as in the reference
        shifts = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) * bits
        value = jnp.sum(jnp.left_shift(code, shifts), axis=1, keepdims=True)
        lanes = jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], per_group), 1) * 8
        out_ref[...] = (jnp.right_shift(value, lanes) & 255).astype(jnp.uint8)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((groups_padded, per_group), jnp.uint8),
        grid=(groups_padded // block,),
        in_specs=[pl.BlockSpec((block, group), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((block, per_group), lambda i: (i, 0)),
        interpret=interpret,
    )


@functools.lru_cache(maxsize=None)
def _grad_call(levels: Tuple[float, ...], bits: int, groups_padded: int, dtype_name: str, interpret: bool):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    group, per_group = GROUP[bits], bits * GROUP[bits] // 8
    block = min(_BLOCK_GROUPS, groups_padded)

    def kernel(packed_ref, grad_ref, out_ref):
        packed = packed_ref[...].astype(jnp.int32)
        value = jnp.zeros((packed.shape[0], 1), jnp.int32)
        for i in range(per_group):
            value = value | jnp.left_shift(packed[:, i:i + 1], 8 * i)
        shifts = jax.lax.broadcasted_iota(jnp.int32, (packed.shape[0], group), 1) * bits
        code = jnp.right_shift(value, shifts) & ((1 << bits) - 1)
        level = jnp.zeros(code.shape, jnp.float32)
        for k, lv in enumerate(levels):
            level = jnp.where(code == k, jnp.float32(lv), level)
        out_ref[...] = (grad_ref[...].astype(jnp.float32) * level).astype(out_ref.dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((groups_padded, group), jnp.dtype(dtype_name)),
        grid=(groups_padded // block,),
        in_specs=[pl.BlockSpec((block, per_group), lambda i: (i, 0)), pl.BlockSpec((block, group), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((block, group), lambda i: (i, 0)),
        interpret=interpret,
    )


def _blocked(n: int, bits: int) -> int:
    groups = -(-n // GROUP[bits])
    block = min(_BLOCK_GROUPS, groups)
    return -(-groups // block) * block


def encode_stepwise(x, borders: Sequence[float], bits: int, interpret: bool = False):
    """Packed codes (flat uint8 JAX array, the reference's length) of the JAX array ``x``."""
    import jax.numpy as jnp

    n = x.size
    groups_padded = _blocked(n, bits)
    flat = jnp.pad(x.reshape(-1), (0, groups_padded * GROUP[bits] - n))
    out = _encode_call(tuple(float(b) for b in borders), bits, n, groups_padded, str(x.dtype), interpret)(
        flat.reshape(groups_padded, GROUP[bits]))
    per_group = bits * GROUP[bits] // 8
    return out.reshape(-1)[:-(-n // GROUP[bits]) * per_group]


def stepwise_grad(packed, grad, levels: Sequence[float], bits: int, interpret: bool = False):
    """``grad * levels[code]`` (JAX arrays; float32 product rounded once to ``grad``'s dtype)."""
    import jax.numpy as jnp

    n = grad.size
    groups_padded = _blocked(n, bits)
    per_group = bits * GROUP[bits] // 8
    packed = jnp.pad(packed.reshape(-1), (0, groups_padded * per_group - packed.size))
    flat = jnp.pad(grad.reshape(-1), (0, groups_padded * GROUP[bits] - n))
    out = _grad_call(tuple(float(v) for v in levels), bits, groups_padded, str(grad.dtype), interpret)(
        packed.reshape(groups_padded, per_group), flat.reshape(groups_padded, GROUP[bits]))
    return out.reshape(-1)[:n].reshape(grad.shape)


def encode_stepwise_torch_xla(x, borders: Sequence[float], bits: int):
    """:func:`encode_stepwise` on a torch_xla tensor on a TPU (untested here: see the module docstring)."""
    import torch
    from torch_xla.experimental.custom_kernel import make_kernel_from_pallas

    n = x.numel()
    groups_padded = _blocked(n, bits)
    per_group = bits * GROUP[bits] // 8
    flat = torch.nn.functional.pad(x.reshape(-1), (0, groups_padded * GROUP[bits] - n))
    call = _encode_call(tuple(float(b) for b in borders), bits, n, groups_padded, _jax_dtype_name(x.dtype), False)
    kernel = make_kernel_from_pallas(call, lambda *_: [((groups_padded, per_group), torch.uint8)])
    return kernel(flat.view(groups_padded, GROUP[bits])).reshape(-1)[:-(-n // GROUP[bits]) * per_group]


def stepwise_grad_torch_xla(packed, grad, levels, bits: int):
    """:func:`stepwise_grad` on torch_xla tensors on a TPU (untested here: see the module docstring)."""
    import torch
    from torch_xla.experimental.custom_kernel import make_kernel_from_pallas

    n = grad.numel()
    groups_padded = _blocked(n, bits)
    per_group = bits * GROUP[bits] // 8
    packed = torch.nn.functional.pad(packed.reshape(-1), (0, groups_padded * per_group - packed.numel()))
    flat = torch.nn.functional.pad(grad.reshape(-1), (0, groups_padded * GROUP[bits] - n))
    call = _grad_call(tuple(float(v) for v in levels), bits, groups_padded, _jax_dtype_name(grad.dtype), False)
    kernel = make_kernel_from_pallas(call, lambda *_: [((groups_padded, GROUP[bits]), grad.dtype)])
    out = kernel(packed.view(groups_padded, per_group), flat.view(groups_padded, GROUP[bits]))
    return out.reshape(-1)[:n].view(grad.shape)


def _jax_dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")
