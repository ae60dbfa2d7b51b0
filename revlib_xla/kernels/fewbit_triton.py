"""Triton kernels of the few-bit backward (CUDA): code-and-pack, and unpack-lookup-multiply, in one pass each.

Bit for bit what :mod:`.fewbit_reference` computes (the layout is documented there); tested on the CPU with
``TRITON_INTERPRET=1`` (``tests/fewbit/test_kernels.py``). The kernels are defined on first use, so that a test can set
``TRITON_INTERPRET`` before (the @triton.jit functions live in ``_fewbit_triton_jit``, imported on first use);
importing this module does not import triton.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .fewbit_reference import GROUP

__all__ = ["encode_stepwise", "stepwise_grad", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_GROUPS = 256


def _kernels():
    from . import _fewbit_triton_jit as jit

    return jit.encode_kernel, jit.grad_kernel


_BORDERS: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}


def _check(tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the Triton few-bit kernels take {SUPPORTED_DTYPES}, got {tensor.dtype}")


def _grid(groups: int) -> tuple[int]:
    return (-(-groups // _BLOCK_GROUPS),)


def encode_stepwise(x: torch.Tensor, borders: Sequence[float], bits: int, nan_high: bool = False) -> torch.Tensor:
    """Packed codes of ``x`` (as :func:`fewbit_reference.pack` of :func:`fewbit_reference.stepwise_codes`)."""
    _check(x)
    encode_kernel, _ = _kernels()
    flat = x.contiguous().view(-1)
    group, n = GROUP[bits], flat.numel()
    groups, per_group = -(-n // group), bits * GROUP[bits] // 8
    key = (tuple(borders), x.device)
    borders_t = _BORDERS.get(key)
    if borders_t is None:
        borders_t = _BORDERS[key] = torch.tensor(list(borders), dtype=torch.float32, device=x.device)
    out = torch.empty(groups * per_group, dtype=torch.uint8, device=x.device)
    encode_kernel[_grid(groups)](
        flat,
        borders_t,
        out,
        n,
        groups,
        NUM_BORDERS=len(borders),
        BITS=bits,
        GROUP_SIZE=group,
        BYTES=per_group,
        BLOCK_GROUPS=_BLOCK_GROUPS,
        NAN_HIGH=nan_high,
    )
    return out


def stepwise_grad(
    packed: torch.Tensor, grad: torch.Tensor, levels: torch.Tensor, bits: int, select_zero: bool = False
) -> torch.Tensor:
    """``grad * levels[code]`` (as :func:`fewbit_reference.lookup` of :func:`fewbit_reference.unpack`)."""
    _check(grad)
    if levels.dtype != torch.float32:
        raise TypeError(f"the Triton few-bit kernels take float32 levels, got {levels.dtype}")
    _, grad_kernel = _kernels()
    flat = grad.contiguous().view(-1)
    group, n = GROUP[bits], flat.numel()
    groups, per_group = -(-n // group), bits * GROUP[bits] // 8
    out = torch.empty_like(flat)
    bf16 = flat.dtype == torch.bfloat16
    grad_kernel[_grid(groups)](
        packed,
        flat,
        levels,
        out.view(torch.int16) if bf16 else out,
        n,
        groups,
        BITS=bits,
        GROUP_SIZE=group,
        BYTES=per_group,
        BLOCK_GROUPS=_BLOCK_GROUPS,
        BF16_BITS=bf16,
        SELECT_ZERO=select_zero,
    )
    return out.view(grad.shape)
