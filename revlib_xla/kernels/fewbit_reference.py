"""Pure-PyTorch reference of the few-bit backward's three steps: code, pack, and unpack-and-lookup.

These run on every device (cpu, cuda, xla) and define the results the Pallas and Triton kernels must reproduce bit
for bit:

* **code**: element x gets code k = number of borders b with ``x > b`` (interval ``(b_{k-1}, b_k]``), the
  comparison done in float32 (float64 for float64 input; bfloat16 and float16 convert to float32 exactly); NaN gets
  code 0. A *band* code is 1 where ``lo < x < hi`` (or ``lo <= x <= hi`` when closed), else 0.
* **pack**: codes of ``bits`` bits are packed in groups: a group of ``GROUP[bits]`` codes (8 for 1 and 3 bits, 4
  for 2 bits, 2 for 4 bits) is the little-endian integer ``sum(code_j << (bits * j))``, stored as
  ``bits * GROUP[bits] / 8`` little-endian bytes. n codes take ``bits * ceil(n / GROUP) * GROUP / 8`` bytes:
  exactly ``bits`` bits per element, plus at most one group of padding.
* **lookup**: ``grad_in = (grad.to(opmath) * levels[code]).to(grad.dtype)`` with opmath float32 (float64 for
  float64 gradients): one rounding, as the kernels do.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["GROUP", "packed_bytes", "stepwise_codes", "band_codes", "pack", "unpack", "lookup", "opmath_dtype"]

#: codes per packing group, by bit width (a group fills whole bytes)
GROUP = {1: 8, 2: 4, 3: 8, 4: 2}


def opmath_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision comparisons and products are done in: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def packed_bytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits take when packed."""
    group = GROUP[bits]
    return -(-numel // group) * group * bits // 8


def stepwise_codes(x: torch.Tensor, borders: Sequence[float]) -> torch.Tensor:
    """uint8 codes, flat: the number of borders each element is above."""
    flat = x.reshape(-1).to(opmath_dtype(x.dtype))
    codes = torch.zeros(flat.shape, dtype=torch.uint8, device=x.device)
    for border in borders:
        codes += flat > border
    return codes


def band_codes(x: torch.Tensor, lo: Optional[float], hi: Optional[float], closed: bool) -> torch.Tensor:
    """uint8 codes, flat: 1 inside the band (``lo``/``hi`` None for no bound), else 0."""
    flat = x.reshape(-1).to(opmath_dtype(x.dtype))
    inside = torch.ones(flat.shape, dtype=torch.bool, device=x.device)
    if lo is not None:
        inside &= (flat >= lo) if closed else (flat > lo)
    if hi is not None:
        inside &= (flat <= hi) if closed else (flat < hi)
    return inside.to(torch.uint8)


def _powers(base_bits: int, count: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([1 << (base_bits * j) for j in range(count)], dtype=torch.int32, device=device)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Flat uint8 codes (each < 2**bits) -> packed uint8 bytes (see the module docstring for the layout)."""
    group = GROUP[bits]
    per_group = bits * group // 8
    pad = (-codes.numel()) % group
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    value = (codes.view(-1, group).to(torch.int32) * _powers(bits, group, codes.device)).sum(1, dtype=torch.int32)
    if per_group == 1:
        return value.to(torch.uint8)
    shifts = torch.arange(0, 8 * per_group, 8, dtype=torch.int32, device=codes.device)
    return (torch.bitwise_right_shift(value.unsqueeze(1), shifts) & 255).to(torch.uint8).reshape(-1)


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Packed bytes -> the first ``numel`` codes, as int64 indices."""
    group = GROUP[bits]
    per_group = bits * group // 8
    value = (packed.view(-1, per_group).to(torch.int32) * _powers(8, per_group, packed.device)).sum(
        1, dtype=torch.int32)
    shifts = torch.arange(0, bits * group, bits, dtype=torch.int32, device=packed.device)
    codes = torch.bitwise_right_shift(value.unsqueeze(1), shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:numel].to(torch.int64)


def lookup(codes: torch.Tensor, grad: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """``grad * levels[codes]`` in opmath precision, rounded once to the gradient's dtype; the gradient's shape."""
    level = levels.index_select(0, codes).view(grad.shape)
    return (grad.to(levels.dtype) * level).to(grad.dtype)
