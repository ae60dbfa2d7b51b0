"""Pure-PyTorch reference of the few-bit backward's three steps: code, pack, and unpack-and-lookup.

These run on every device (cpu, cuda, xla) and define the results the Pallas and Triton kernels must reproduce bit
for bit:

* **code**: element x gets code k = number of borders b with ``x > b`` (interval ``(b_{k-1}, b_k]``), the
  comparison done in float32 (float64 for float64 input; bfloat16 and float16 convert to float32 exactly); NaN gets
  code 0, or the top code with ``nan_high`` (each border then counts where ``not x <= b``: the same for every other
  x). A *band* code is 1 where ``lo < x < hi`` (or ``lo <= x <= hi`` when closed), else 0; NaN is inside the band
  with ``nan_inside``. Where NaN goes is where PyTorch's backward kernel of the activation sends it.
* **pack**: codes of ``bits`` bits are packed in groups of ``GROUP[bits]`` codes (8 for 1 and 3 bits, 4 for 2 bits,
  2 for 4 bits), laid out in planes so that every step is an elementwise operation on long vectors (what TPUs and
  coalesced GPU loads want; a (groups, 8) layout is padded to 128 lanes on a TPU): the n codes, padded with zeros
  to G * GROUP (G = ceil(n / GROUP)), form GROUP planes of G codes (code e is lane e // G of group e % G); group g
  is the integer ``sum_j code[j * G + g] << (bits * j)``, and its byte i is stored at ``i * G + g``. n codes take
  ``bits * G * GROUP / 8`` bytes: exactly ``bits`` bits per element, plus at most one group of padding.
* **lookup**: ``grad_in = (grad.to(opmath) * levels[code]).to(grad.dtype)`` with opmath float32 (float64 for
  float64 gradients): one rounding, as the kernels do. With ``select_zero``, a level of exactly 0 gives 0 whatever
  the gradient (an inf or NaN gradient included), as PyTorch's piecewise-linear backward kernels select rather than
  multiply. NaN results are NaN; their sign and payload are not specified.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def stepwise_codes(x: torch.Tensor, borders: Sequence[float], nan_high: bool = False) -> torch.Tensor:
    """uint8 codes, flat: the number of borders each element is above (NaN: none, or all with ``nan_high``)."""
    flat = x.reshape(-1).to(opmath_dtype(x.dtype))
    codes = torch.zeros(flat.shape, dtype=torch.uint8, device=x.device)
    for border in borders:
        codes += (flat <= border).logical_not_() if nan_high else flat > border
    return codes


def band_codes(
    x: torch.Tensor, lo: float | None, hi: float | None, closed: bool, nan_inside: bool = False
) -> torch.Tensor:
    """uint8 codes, flat: 1 inside the band (``lo``/``hi`` None for no bound), else 0; NaN inside with
    ``nan_inside``."""
    flat = x.reshape(-1).to(opmath_dtype(x.dtype))
    inside = torch.ones(flat.shape, dtype=torch.bool, device=x.device)
    if lo is not None:
        inside &= (flat >= lo) if closed else (flat > lo)
    if hi is not None:
        inside &= (flat <= hi) if closed else (flat < hi)
    if nan_inside:
        inside |= flat.isnan()
    return inside.to(torch.uint8)


def _planes(numel: int, bits: int) -> tuple[int, int, int]:
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


def lookup(
    codes: torch.Tensor, grad: torch.Tensor, levels: torch.Tensor, gather: bool = True, select_zero: bool = False
) -> torch.Tensor:
    """``grad * levels[codes]`` in opmath precision, rounded once to the gradient's dtype; the gradient's shape.

    ``gather=False`` looks the levels up with a chain of selects instead of a gather (the same values; what a TPU
    does well: ``2**bits`` fused elementwise passes rather than a gather). ``select_zero``: a zero level gives 0, not
    ``grad * 0`` (which is NaN for an infinite or NaN gradient).
    """
    if gather:
        level = levels.index_select(0, codes)
    else:
        level = levels[0].expand(codes.shape)
        for k in range(1, levels.numel()):
            level = torch.where(codes == k, levels[k], level)
    level = level.view(grad.shape)
    product = grad.to(levels.dtype) * level
    if select_zero:
        product = product.masked_fill_(level == 0, 0)
    return product.to(grad.dtype)
