"""Device families: one :class:`Backend` per family, chosen by a registry keyed by ``torch.device.type``.

This package is the only place that knows device kinds. Features ask a backend what it can do
(``backend_for(tensor).lazy``, ``.host_offload``, ``.optimization_barrier(tensors)`` ...) or call the function facade
:mod:`revlib_xla.backend`, which dispatches here. Registered: ``cpu``, ``meta``, ``cuda``, ``xla`` (torch_xla) and
``tpu`` (Google's TorchTPU, **experimental**). Adding a family is one module with a :class:`Backend` subclass and a
:func:`register` call.
"""

from __future__ import annotations

from .base import Backend, DeviceCopier, HostCopy, HostOffload, Transfer, generation_from_device_kind
from .cpu import CpuBackend, MetaBackend
from .cuda import CudaBackend
from .registry import DeviceLike, UnknownDeviceError, as_device, backend_for, register, registered, unregister
from .state import AutocastState, DeviceSeed, RngState, autocast_cache_off, autocast_off
from .tpu import NotGooglesTorchTpu, TpuBackend
from .xla import XlaBackend

__all__ = [
    "AutocastState",
    "autocast_cache_off",
    "autocast_off",
    "Backend",
    "CpuBackend",
    "CudaBackend",
    "DeviceCopier",
    "DeviceLike",
    "DeviceSeed",
    "HostCopy",
    "HostOffload",
    "MetaBackend",
    "NotGooglesTorchTpu",
    "RngState",
    "TpuBackend",
    "Transfer",
    "UnknownDeviceError",
    "XlaBackend",
    "as_device",
    "backend_for",
    "generation_from_device_kind",
    "register",
    "registered",
    "unregister",
]

register("cpu", CpuBackend())
register("xla", XlaBackend())
register("cuda", CudaBackend())
register("meta", MetaBackend())
register("tpu", TpuBackend())
