"""The CPU, and the ``meta`` device (shapes without data): eager, host memory, the CPU generator."""

from __future__ import annotations

import torch

from .base import Backend, HostCopy, HostOffload

__all__ = ["CpuBackend", "MetaBackend"]


class CpuBackend(Backend):
    """Eager, op by op, in host memory. Random operators draw from ``torch.default_generator``, whose state the
    caller captures itself, so the device has no random state of its own."""

    host_offload = HostOffload.ALREADY_HOST
    autocast_device_type: str | None = "cpu"
    memory_is_host = True
    process_group_backend: str | None = "gloo"

    def available(self, device: torch.device) -> bool:
        return True

    def default_generator(self, device: torch.device) -> torch.Generator | None:
        return torch.default_generator

    def allocator_statistics(self, device: torch.device) -> bool:
        return False  # the profiler's memory events measure host memory (revlib_xla.memory.allocator_peak)

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        return HostCopy(tensor, tensor.device)

    def to_device(self, copy: HostCopy) -> torch.Tensor:
        return copy.tensor


class MetaBackend(CpuBackend):
    """Tensors with shapes and dtypes but no data (model construction, sizing): nothing to read, nothing to
    measure, no random state."""

    holds_data = False
    takes_generators = False
    autocast_device_type = None
    memory_is_host = False
    process_group_backend = None

    def default_generator(self, device: torch.device) -> torch.Generator | None:
        return None
