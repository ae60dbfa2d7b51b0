"""Device families: one :class:`Backend` per family, chosen by a registry keyed by ``torch.device.type``.

This package is the only place that knows device kinds. Features ask a backend what it can do
(``backend_for(tensor).lazy``, ``.host_offload``, ``.optimization_barrier(tensors)`` ...) or call the functions of the
facade (:mod:`revlib_xla.backends.facade`, each importable from here: ``backends.sync(device)``), which find the
backend of a device or tensor and ask it. Registered: ``cpu``, ``meta``, ``cuda``, ``xla`` (torch_xla) and
``tpu`` (Google's TorchTPU, **experimental**). Adding a family is one module with a :class:`Backend` subclass and a
:func:`register` call.
"""

from __future__ import annotations

from . import facade as _facade
from .base import Backend, generation_from_device_kind
from .cpu import CpuBackend, MetaBackend
from .cuda import CudaBackend
from .facade import *  # noqa: F403 (the facade's functions: backends.sync(device), ...)
from .registry import UnknownDeviceError, register, registered, unregister
from .tpu import NotGooglesTorchTpu, TpuBackend
from .xla import XlaBackend

__all__ = [
    "Backend",
    "CpuBackend",
    "CudaBackend",
    "MetaBackend",
    "NotGooglesTorchTpu",
    "TpuBackend",
    "UnknownDeviceError",
    "XlaBackend",
    "generation_from_device_kind",
    "register",
    "registered",
    "unregister",
    *_facade.__all__,  # the function facade
]

register("cpu", CpuBackend())
register("xla", XlaBackend())
register("cuda", CudaBackend())
register("meta", MetaBackend())
register("tpu", TpuBackend())
