"""Device kernels, each tested bit for bit against its pure-PyTorch reference, picked by device.

The few-bit backward has two fused steps:

* :func:`encode_stepwise` - code each element by the borders it is above and pack the codes (forward pass);
* :func:`stepwise_grad` - unpack the codes, look up their levels and multiply the incoming gradient (backward).

Which implementation runs is decided by :func:`revlib_xla.backends.kernel_platform`: the Triton kernels
(``fewbit_triton``) for CUDA tensors when triton is installed, the Pallas kernels (``fewbit_pallas``, JAX) for XLA
tensors on a TPU, and the reference (``fewbit_reference``) everywhere else (cpu, XLA on the CPU, or when
``REVLIB_XLA_KERNELS=reference``). The reference defines the results.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import backends
from . import fewbit_reference as reference

__all__ = ["encode_stepwise", "encode_band", "stepwise_grad", "implementation_for", "levels_tensor", "reference"]


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def implementation_for(tensor: torch.Tensor) -> str:
    """``'triton'``, ``'pallas'`` or ``'reference'``: what the few-bit kernels run as for this tensor (float64
    always uses the reference)."""
    if tensor.dtype not in _KERNEL_DTYPES:
        return "reference"
    return backends.kernel_platform(tensor)


_LEVELS: dict[tuple[tuple[float, ...], torch.device, torch.dtype], torch.Tensor] = {}


def levels_tensor(levels: Sequence[float], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The levels as a tensor on ``device`` in the opmath precision of ``dtype`` (made once, then cached)."""
    key = (tuple(levels), device, reference.opmath_dtype(dtype))
    hit = _LEVELS.get(key)
    if hit is None:
        hit = _LEVELS[key] = torch.tensor(list(levels), dtype=key[2]).to(device)
    return hit


def encode_stepwise(x: torch.Tensor, borders: Sequence[float], bits: int, nan_high: bool = False) -> torch.Tensor:
    """Packed ``bits``-bit codes of ``x`` (flat uint8, :func:`reference.packed_bytes` long); NaN gets the top code
    with ``nan_high``, else code 0."""
    impl = implementation_for(x)
    if impl == "triton":
        from . import fewbit_triton

        return fewbit_triton.encode_stepwise(x, borders, bits, nan_high)
    if impl == "pallas":
        from . import fewbit_pallas

        return fewbit_pallas.encode_stepwise_torch_xla(x, borders, bits, nan_high)
    return reference.pack(reference.stepwise_codes(x, borders, nan_high), bits)


def encode_band(
    x: torch.Tensor, lo: float | None, hi: float | None, closed: bool, nan_inside: bool = False
) -> torch.Tensor:
    """Packed 1-bit band codes of ``x`` (reference implementation on every device: two comparisons and a pack)."""
    return reference.pack(reference.band_codes(x, lo, hi, closed, nan_inside), 1)


def _levels_with_nan_ends(
    levels: Sequence[float], device: torch.device, dtype: torch.dtype, nan_ends: torch.Tensor | None
) -> torch.Tensor:
    """:func:`levels_tensor`, with the lowest / highest level made NaN where ``nan_ends`` (bool, 2 elements on
    ``device``) says so: no host sync, so this works inside a lazily traced XLA graph."""
    table = levels_tensor(levels, device, dtype)
    if nan_ends is None:
        return table
    mask = torch.cat([nan_ends[:1], nan_ends.new_zeros(table.numel() - 2), nan_ends[1:]])
    return torch.where(mask, torch.full_like(table, float("nan")), table)


def stepwise_grad(
    packed: torch.Tensor,
    grad: torch.Tensor,
    levels: Sequence[float],
    bits: int,
    select_zero: bool = False,
    nan_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """``grad * levels[code]`` for the packed codes of ``grad.numel()`` elements, shaped like ``grad``.

    ``select_zero``: a zero level gives 0 even for an inf or NaN gradient (see :mod:`.fewbit_reference`);
    ``nan_ends``: a 2-element bool tensor; where set, the lowest / highest level is NaN for this call.
    """
    impl = implementation_for(grad)
    select_zero = select_zero and 0.0 in tuple(levels)
    table = _levels_with_nan_ends(levels, grad.device, grad.dtype, nan_ends)
    if impl == "triton":
        from . import fewbit_triton

        return fewbit_triton.stepwise_grad(packed, grad, table, bits, select_zero)
    if impl == "pallas":
        from . import fewbit_pallas

        return fewbit_pallas.stepwise_grad_torch_xla(packed, grad, table, bits, select_zero)
    return reference.lookup(
        reference.unpack(packed, bits, grad.numel()),
        grad,
        table,
        gather=not backends.is_tracing_lazily(grad),
        select_zero=select_zero,
    )
