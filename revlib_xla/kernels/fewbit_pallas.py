"""Pallas (JAX) kernels of the few-bit backward for TPU: code-and-pack, and unpack-lookup-multiply.

Bit for bit what :mod:`.fewbit_reference` computes (layout documented there). The kernels work on the planes of
that layout: the input as a (GROUP, G) array, the packed bytes as (BYTES, G), G padded to blocks of 1024 groups, so
the long axis is the TPU's lane axis. Levels are looked up with a chain of selects (TPUs have no cheap gather);
borders are compile-time constants, levels a small array in SMEM (a call may make its end levels NaN, see
:func:`revlib_xla.kernels.stepwise_grad`).

* :func:`encode_stepwise` / :func:`stepwise_grad`: JAX functions (``interpret=True`` runs them on the CPU; the tests
  compare them with the torch reference on the same data through numpy).
* :func:`encode_stepwise_torch_xla` / :func:`stepwise_grad_torch_xla`: the same kernels called from torch_xla on a
  TPU through ``torch_xla.experimental.custom_kernel.make_kernel_from_pallas``. **Not run in this project's tests**:
  no TPU was available, and torch_xla's Pallas bridge needs the TPU (Mosaic) compiler.

Importing this module does not import JAX.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from .fewbit_reference import GROUP

__all__ = ["encode_stepwise", "stepwise_grad", "encode_stepwise_torch_xla", "stepwise_grad_torch_xla"]

_BLOCK_GROUPS = 1024  # groups per program: a multiple of the TPU's 128 lanes


def _layout(n: int, bits: int) -> tuple[int, int, int, int]:
    """(codes per group, bytes per group, groups G of the reference layout, G padded to whole blocks)."""
    group, per_group = GROUP[bits], bits * GROUP[bits] // 8
    groups = -(-n // group)
    block = min(_BLOCK_GROUPS, -(-groups // 128) * 128)
    return group, per_group, groups, -(-groups // block) * block


@functools.cache
def _encode_call(
    borders: tuple[float, ...], bits: int, n: int, dtype_name: str, interpret: bool, nan_high: bool = False
):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    group, per_group, groups, padded = _layout(n, bits)
    block = min(_BLOCK_GROUPS, padded)

    def kernel(x_ref, out_ref):
        x = x_ref[...].astype(jnp.float32)  # (GROUP, block): plane j, groups g
        code = jnp.zeros(x.shape, jnp.int32)
        for border in borders:
            above = jnp.logical_not(x <= jnp.float32(border)) if nan_high else x > jnp.float32(border)
            code = code + above.astype(jnp.int32)
        g = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) + pl.program_id(0) * block
        j = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
        code = jnp.where((j * groups + g < n) & (g < groups), code, 0)  # padding codes are 0, as in the reference
        value = jnp.zeros((1, x.shape[1]), jnp.int32)
        for lane in range(group):
            value = value | jnp.left_shift(code[lane : lane + 1, :], bits * lane)
        out_ref[...] = jnp.concatenate([jnp.right_shift(value, 8 * i) & 255 for i in range(per_group)], axis=0).astype(
            jnp.uint8
        )

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((per_group, padded), jnp.uint8),
        grid=(padded // block,),
        in_specs=[pl.BlockSpec((group, block), lambda i: (0, i))],
        out_specs=pl.BlockSpec((per_group, block), lambda i: (0, i)),
        interpret=interpret,
    )


@functools.cache
def _grad_call(num_levels: int, bits: int, n: int, dtype_name: str, interpret: bool, select_zero: bool = False):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    group, per_group, _, padded = _layout(n, bits)
    block = min(_BLOCK_GROUPS, padded)

    def kernel(levels_ref, packed_ref, grad_ref, out_ref):
        packed = packed_ref[...].astype(jnp.int32)  # (BYTES, block)
        value = jnp.zeros((1, packed.shape[1]), jnp.int32)
        for i in range(per_group):
            value = value | jnp.left_shift(packed[i : i + 1, :], 8 * i)
        shifts = jax.lax.broadcasted_iota(jnp.int32, (group, packed.shape[1]), 0) * bits
        code = jnp.right_shift(value, shifts) & ((1 << bits) - 1)  # (GROUP, block)
        level = jnp.zeros(code.shape, jnp.float32)
        for k in range(num_levels):
            level = jnp.where(code == k, levels_ref[k], level)
        product = grad_ref[...].astype(jnp.float32) * level
        if select_zero:
            product = jnp.where(level == 0, jnp.float32(0), product)
        out_ref[...] = product.astype(out_ref.dtype)

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((group, padded), jnp.dtype(dtype_name)),
        grid=(padded // block,),
        in_specs=[
            pl.BlockSpec(memory_space=pltpu.SMEM),
            pl.BlockSpec((per_group, block), lambda i: (0, i)),
            pl.BlockSpec((group, block), lambda i: (0, i)),
        ],
        out_specs=pl.BlockSpec((group, block), lambda i: (0, i)),
        interpret=interpret,
    )


def encode_stepwise(x, borders: Sequence[float], bits: int, interpret: bool = False, nan_high: bool = False):
    """Packed codes (flat uint8 JAX array, laid out as the reference's) of the JAX array ``x``."""
    import jax.numpy as jnp

    n = x.size
    group, _, groups, padded = _layout(n, bits)
    planes = jnp.pad(
        jnp.pad(x.reshape(-1), (0, groups * group - n)).reshape(group, groups), ((0, 0), (0, padded - groups))
    )
    out = _encode_call(tuple(float(b) for b in borders), bits, n, str(x.dtype), interpret, nan_high)(planes)
    return out[:, :groups].reshape(-1)


def stepwise_grad(packed, grad, levels, bits: int, interpret: bool = False, select_zero: bool = False):
    """``grad * levels[code]`` (JAX arrays; ``levels`` float32; the product rounded once to ``grad``'s dtype)."""
    import jax.numpy as jnp

    n = grad.size
    group, per_group, groups, padded = _layout(n, bits)
    packed = jnp.pad(packed.reshape(per_group, groups), ((0, 0), (0, padded - groups)))
    planes = jnp.pad(
        jnp.pad(grad.reshape(-1), (0, groups * group - n)).reshape(group, groups), ((0, 0), (0, padded - groups))
    )
    levels = jnp.asarray(levels, dtype=jnp.float32)
    out = _grad_call(levels.shape[0], bits, n, str(grad.dtype), interpret, select_zero)(levels, packed, planes)
    return out[:, :groups].reshape(-1)[:n].reshape(grad.shape)


def encode_stepwise_torch_xla(x, borders: Sequence[float], bits: int, nan_high: bool = False):
    """:func:`encode_stepwise` on a torch_xla tensor on a TPU (untested here: see the module docstring)."""
    import torch
    from torch.nn.functional import pad
    from torch_xla.experimental.custom_kernel import make_kernel_from_pallas

    n = x.numel()
    group, per_group, groups, padded = _layout(n, bits)
    planes = pad(pad(x.reshape(-1), (0, groups * group - n)).view(group, groups), (0, padded - groups))
    call = _encode_call(tuple(float(b) for b in borders), bits, n, _jax_dtype_name(x.dtype), False, nan_high)
    kernel = make_kernel_from_pallas(call, lambda *_: [((per_group, padded), torch.uint8)])
    return kernel(planes)[:, :groups].reshape(-1)


def stepwise_grad_torch_xla(packed, grad, levels, bits: int, select_zero: bool = False):
    """:func:`stepwise_grad` on torch_xla tensors on a TPU, ``levels`` a float32 tensor (untested here: see the
    module docstring)."""
    from torch.nn.functional import pad
    from torch_xla.experimental.custom_kernel import make_kernel_from_pallas

    n = grad.numel()
    group, per_group, groups, padded = _layout(n, bits)
    packed = pad(packed.view(per_group, groups), (0, padded - groups))
    planes = pad(pad(grad.reshape(-1), (0, groups * group - n)).view(group, groups), (0, padded - groups))
    call = _grad_call(levels.numel(), bits, n, _jax_dtype_name(grad.dtype), False, select_zero)
    kernel = make_kernel_from_pallas(call, lambda *_: [((group, padded), grad.dtype)])
    return kernel(levels, packed, planes)[:, :groups].reshape(-1)[:n].view(grad.shape)


def _jax_dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")
