"""Cast and/or offload every tensor autograd saves for backward: RevLib's ``memory_efficient_intermediates``.

Inside ``with memory_efficient_intermediates(storage_dtype=torch.bfloat16, storage_device="cpu"):`` each saved
floating-point activation is stored in ``storage_dtype`` and/or in host memory, and restored (to its own dtype and
device) when the backward pass needs it. The forward computes exactly as without it; gradients change only by the
rounding of the stored activations.

* eager (cpu, cuda): ``torch.autograd.graph.saved_tensors_hooks``. On cuda the host copies go to pinned memory on
  a side stream, and the backward prefetches the next two activations it will need while it uses one. A tensor
  saved twice (a ``tanh`` output that the next ``Linear`` saves as its input) is stored once.
* xla: the same hooks put casts and ``place_to_host``/``place_to_device`` annotations into the graph; the TPU
  compiler turns them into transfers. PJRT CPU cannot execute the annotations, so there they are left out
  (identity) unless :func:`revlib_xla.backends.host_annotations` asks for them (to inspect or compile the HLO).

A storage dtype with a smaller range than the tensor's (float16 for float32 or bfloat16 activations, whose values
above 65504 would become inf) is scaled per tensor by a power of two that puts the tensor's largest magnitude in
the storage dtype's top binade: the multiplication and the division on restore are exact, so the stored values
keep float16's 11 significant bits whatever their size, and the gradients stay finite and within float16's
rounding. The scale (one 0-d tensor, computed on the device, no host sync) is kept with the stored tensor. A tensor
that holds inf or NaN is stored unscaled (those stay inf and NaN).

Not converted: parameters and other leaf tensors that require grad (they stay alive in the model anyway: a copy
would only add memory), and tensors ``tensor_filter`` rejects (default: floating-point ones are converted).

Nothing outlives the autograd graph that saved it, so the context may wrap a whole training loop (RevLib's may
not).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import backends

Tensor = torch.Tensor

__all__ = ["memory_efficient_intermediates", "MemoryEfficientIntermediates"]

_PREFETCH_AHEAD = 2


def _is_float(tensor: Tensor) -> bool:
    return tensor.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _held_elsewhere(tensor: Tensor) -> bool:
    """Parameters (and views of them, ``weight.t()``) and other leaves that require grad."""
    base = tensor._base if tensor._base is not None else tensor
    return base.is_leaf and base.requires_grad


def _narrower_range(storage: torch.dtype, source: torch.dtype) -> bool:
    """Whether ``storage`` cannot hold the magnitudes ``source`` can (by more than a binade: bfloat16 holds
    float32's range, float16 does not)."""
    return torch.finfo(storage).max < torch.finfo(source).max / 2


def _range_scale(value: Tensor, storage: torch.dtype) -> Tensor:
    """The power of two s (a 0-d tensor in ``value``'s precision, at least float32) that puts ``value``'s largest
    finite magnitude in ``storage``'s top binade; 1 when ``value`` holds inf or NaN, or is empty or all zero."""
    opmath = torch.promote_types(value.dtype, torch.float32)
    if value.numel() == 0:
        return torch.ones((), dtype=opmath, device=value.device)
    largest = torch.linalg.vector_norm(value, float("inf")).to(opmath)  # one pass, no |value| temporary
    exponent = torch.floor(torch.log2(torch.finfo(storage).max / largest))
    limit = -math.log2(torch.finfo(opmath).smallest_normal) - 2
    exponent = exponent.clamp(-limit, limit)  # largest = 0 gives +inf: keep 2**exponent finite and normal
    usable = torch.isfinite(largest) & (largest > 0)
    return torch.where(usable, torch.exp2(exponent), torch.ones_like(largest))


class _Stored:
    __slots__ = ("__weakref__", "dtype", "offloaded", "restored", "scale", "value")

    def __init__(self, value: Any, dtype: torch.dtype, offloaded: bool, scale: Tensor | None = None) -> None:
        self.value, self.dtype, self.offloaded, self.scale = value, dtype, offloaded, scale
        self.restored: Tensor | None = None  # XLA: one place_to_device per stored tensor, however often used


class MemoryEfficientIntermediates(torch.autograd.graph.saved_tensors_hooks):
    """The context manager :func:`memory_efficient_intermediates` returns."""

    def __init__(
        self,
        storage_dtype: torch.dtype | None = None,
        storage_device: str | torch.device | None = None,
        tensor_filter: Callable[[Tensor], bool] = _is_float,
    ) -> None:
        if storage_dtype is not None and (
            not isinstance(storage_dtype, torch.dtype) or not storage_dtype.is_floating_point
        ):
            raise TypeError(f"storage_dtype must be a floating-point torch.dtype, got {storage_dtype!r}")
        if storage_device is not None and not backends.is_host_memory(storage_device):
            raise ValueError(f"storage_device must be 'cpu' (host memory) or None, got {storage_device!r}")
        if not callable(tensor_filter):
            raise TypeError("tensor_filter must be a function of a tensor returning a bool")
        self.storage_dtype = storage_dtype
        self.offload = storage_device is not None
        self.tensor_filter = tensor_filter
        # (storage address, view geometry, version) -> (the storage, what was stored), both weakly held: a storage
        # freed and reallocated at the same address is a different tensor.
        self._same: dict[tuple, tuple[weakref.ReferenceType[Any], weakref.ReferenceType[_Stored]]] = {}
        self._pending: list[weakref.ReferenceType[_Stored]] = []
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> MemoryEfficientIntermediates:  # type: ignore[override]  # torch's stub says None
        super().__enter__()
        return self

    @staticmethod
    def _identity(tensor: Tensor) -> tuple[tuple, Any]:
        """A key for "the same tensor" and the object whose lifetime it is valid for."""
        if backends.is_tracing_lazily(tensor):  # no addressable storage: the same tensor object
            return (id(tensor), tensor._version), tensor
        storage = tensor.untyped_storage()
        return (
            storage.data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
            tensor.device,
            tensor._version,
        ), storage

    def _pack(self, tensor: Tensor) -> Any:
        if not self.tensor_filter(tensor) or _held_elsewhere(tensor):
            return tensor
        key, owner = self._identity(tensor)
        entry = self._same.get(key)
        if entry is not None and entry[0]() is owner and entry[1]() is not None:
            return entry[1]()
        value = tensor.detach()
        scale = None
        if self.storage_dtype is not None and value.dtype != self.storage_dtype:
            if value.is_floating_point() and _narrower_range(self.storage_dtype, value.dtype):
                scale = _range_scale(value, self.storage_dtype)
                value = value * scale
            value = value.to(self.storage_dtype)
        offloaded = self.offload and not backends.is_host_memory(value.device)
        if offloaded:
            self._pending = [ref for ref in self._pending if ref() is not None]
            stored = _Stored(backends.to_host(value), tensor.dtype, True, scale)
            self._pending.append(weakref.ref(stored))
        else:
            stored = _Stored(value, tensor.dtype, False, scale)
        if len(self._same) > 1024:
            self._same = {k: e for k, e in self._same.items() if e[0]() is not None and e[1]() is not None}
        self._same[key] = (weakref.ref(owner), weakref.ref(stored))
        return stored

    def _unpack(self, stored: Any) -> Tensor:
        if not isinstance(stored, _Stored):
            return stored
        if stored.restored is not None:
            value = stored.restored
        elif stored.offloaded:
            self._prefetch_after(stored)
            value = backends.to_device(stored.value)
            if backends.is_tracing_lazily(value):  # a graph node, not memory: reusing it costs nothing
                stored.restored = value
        else:
            value = stored.value
        value = value.to(stored.dtype)
        return value if stored.scale is None else value / stored.scale.to(stored.dtype)

    def _prefetch_after(self, stored: _Stored) -> None:
        # The backward uses saved tensors roughly in the reverse order of the forward: start moving the ones saved
        # just before this one.
        pending = [ref() for ref in self._pending]
        try:
            at = pending.index(stored)
        except ValueError:
            return
        for other in pending[max(0, at - _PREFETCH_AHEAD) : at]:
            if other is not None:
                backends.prefetch_to_device(other.value)


def memory_efficient_intermediates(
    storage_dtype: torch.dtype | None = None,
    storage_device: str | torch.device | None = None,
    tensor_filter: Callable[[Tensor], bool] = _is_float,
) -> MemoryEfficientIntermediates:
    """Store what autograd saves for backward in ``storage_dtype`` and/or on ``storage_device='cpu'`` (see the
    module docstring). ``tensor_filter(tensor)`` picks the tensors to convert (default: floating-point ones)."""
    return MemoryEfficientIntermediates(storage_dtype, storage_device, tensor_filter)
