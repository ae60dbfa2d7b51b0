"""Pure-PyTorch reference of the few-bit backward's three steps: code, pack, and unpack-and-lookup.

These run on every device (cpu, cuda, xla) and define the results the Pallas and Triton kernels must reproduce bit
for bit:

* **code**: element x gets code k = number of borders b with ``x > b`` (interval ``(b_{k-1}, b_k]``), the
  comparison done in float32 (float64 for float64 input; bfloat16 and float16 convert to float32 exactly); NaN gets
  code 0. A *band* code is 1 where ``lo < x < hi`` (or ``lo <= x <= hi`` when closed), else 0.
* **pack**: codes of ``bits`` bits are packed in groups of ``GROUP[bits]`` codes (8 for 1 and 3 bits, 4 for 2 bits,
  2 for 4 bits), laid out in planes so that every step is an elementwise operation on long vectors (what TPUs and
  coalesced GPU loads want; a (groups, 8) layout is padded to 128 lanes on a TPU): the n codes, padded with zeros
  to G * GROUP (G = ceil(n / GROUP)), form GROUP planes of G codes (code e is lane e // G of group e % G); group g
  is the integer ``sum_j code[j * G + g] << (bits * j)``, and its byte i is stored at ``i * G + g``. n codes take
  ``bits * G * GROUP / 8`` bytes: exactly ``bits`` bits per element, plus at most one group of padding.
* **lookup**: ``grad_in = (grad.to(opmath) * levels[code]).to(grad.dtype)`` with opmath float32 (float64 for
  float64 gradients): one rounding, as the kernels do.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

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


def _planes(numel: int, bits: int) -> Tuple[int, int, int]:
    """(codes per group, bytes per group, number of groups G) for ``numel`` codes."""
    group = GROUP[bits]
    return group, bits * group // 8, -(-numel // group)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Flat uint8 codes (each < 2**bits) -> packed uint8 bytes (see the module docstring for the layout)."""
    group, per_group, groups = _planes(codes.numel(), bits)
    pad = groups * group - codes.numel()
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    planes = codes.view(group, groups).to(torch.int32)
    value = planes[0]
    for j in range(1, group):
        value = value | (planes[j] << (bits * j))
    if per_group == 1:
        return value.to(torch.uint8)
    return torch.cat([((value >> (8 * i)) & 255).to(torch.uint8) for i in range(per_group)])


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Packed bytes -> the first ``numel`` codes, as int32 indices."""
    group, per_group, groups = _planes(numel, bits)
    planes = packed.view(per_group, groups).to(torch.int32)
    value = planes[0]
    for i in range(1, per_group):
        value = value | (planes[i] << (8 * i))
    mask = (1 << bits) - 1
    codes = torch.cat([(value >> (bits * j)) & mask for j in range(group)])
    return codes[:numel]


def lookup(codes: torch.Tensor, grad: torch.Tensor, levels: torch.Tensor, gather: bool = True) -> torch.Tensor:
    """``grad * levels[codes]`` in opmath precision, rounded once to the gradient's dtype; the gradient's shape.

    ``gather=False`` looks the levels up with a chain of selects instead of a gather (the same values; what a TPU
    does well: ``2**bits`` fused elementwise passes rather than a gather).
    """
    if gather:
        level = levels.index_select(0, codes)
    else:
        level = levels[0].expand(codes.shape)
        for k in range(1, levels.numel()):
            level = torch.where(codes == k, levels[k], level)
    return (grad.to(levels.dtype) * level.view(grad.shape)).to(grad.dtype)
