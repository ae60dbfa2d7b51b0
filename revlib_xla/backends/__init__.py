"""Device families: one :class:`Backend` per family, chosen by a registry keyed by ``torch.device.type``.

This package is the only place that knows device kinds. Features ask a backend what it can do
(``backend_for(tensor).lazy``, ``.host_offload``, ``.optimization_barrier(tensors)`` ...) or call the functions of the
facade (:mod:`revlib_xla.backends.facade`, each importable from here: ``backends.sync(device)``), which find the
backend of a device or tensor and ask it. Registered: ``cpu``, ``meta``, ``cuda``, ``xla`` (torch_xla) and
``tpu`` (Google's TorchTPU, **experimental**). Adding a family is one module with a :class:`Backend` subclass and a
:func:`register` call.
"""

from __future__ import annotations

from .base import Backend, DeviceCopier, HostCopy, HostOffload, Transfer, generation_from_device_kind
from .cpu import CpuBackend, MetaBackend
from .cuda import CudaBackend
from .facade import (
    after,
    available_kinds,
    checkpoint,
    compilations,
    cuda_available,
    cut_graph,
    data_identity,
    default_device,
    default_device_type,
    default_generator,
    derive_seed,
    device_available,
    device_copier,
    device_for,
    device_kind,
    device_name,
    draw_seed,
    execution_forbidden,
    free_memory,
    holds_data,
    host_annotations,
    host_placement_executes,
    is_host_memory,
    is_tracing_lazily,
    kernel_platform,
    lazy_stablehlo,
    manual_seed,
    optimization_barrier,
    owned_generator,
    pin_host_tensor_,
    place_on_device,
    place_on_host,
    prefetch_to_device,
    program_arguments,
    scan_loop,
    sizing_generation,
    sync,
    takes_generators,
    tensors_in,
    to_device,
    to_host,
    to_host_blocking,
    tpu_generation,
    value_ready,
    xla_available,
    xla_runtime_type,
    zero_copy_device_tensor,
)
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
    # the function facade (facade.py)
    "device_kind",
    "xla_available",
    "cuda_available",
    "device_available",
    "available_kinds",
    "default_device",
    "default_device_type",
    "device_for",
    "draw_seed",
    "derive_seed",
    "manual_seed",
    "takes_generators",
    "owned_generator",
    "default_generator",
    "optimization_barrier",
    "after",
    "sync",
    "holds_data",
    "is_tracing_lazily",
    "value_ready",
    "is_host_memory",
    "checkpoint",
    "lazy_stablehlo",
    "zero_copy_device_tensor",
    "program_arguments",
    "data_identity",
    "execution_forbidden",
    "tensors_in",
    "pin_host_tensor_",
    "device_copier",
    "to_host_blocking",
    "cut_graph",
    "host_placement_executes",
    "place_on_host",
    "place_on_device",
    "kernel_platform",
    "xla_runtime_type",
    "tpu_generation",
    "sizing_generation",
    "device_name",
    "free_memory",
    "compilations",
    "scan_loop",
    "to_host",
    "prefetch_to_device",
    "to_device",
    "host_annotations",
]

register("cpu", CpuBackend())
register("xla", XlaBackend())
register("cuda", CudaBackend())
register("meta", MetaBackend())
register("tpu", TpuBackend())
