"""CUDA GPUs: eager on streams; host copies on a side stream ordered by events; the caching allocator's statistics."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .base import Backend, DeviceCopier, HostCopy, HostOffload, Transfer, triton_installed

__all__ = ["CudaBackend", "StreamCopier"]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class CudaBackend(Backend):
    """Eager CUDA: its own generators and random state per GPU, autocast ``'cuda'``, the caching allocator's
    statistics and free memory, asynchronous host copies on side streams, Triton kernels where Triton is
    installed."""

    host_offload = HostOffload.STREAM_COPY
    autocast_device_type: str | None = "cuda"
    preference = 20
    statistics_source = "torch.cuda.max_memory_allocated"
    allocation_granularity = 512
    process_group_backend: str | None = "nccl"
    fused_adamw = True

    def __init__(self) -> None:
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}

    def available(self, device: torch.device) -> bool:
        return torch.cuda.is_available() and (device.index is None or device.index < torch.cuda.device_count())

    def concrete(self, device: torch.device) -> torch.device:
        return torch.device("cuda", _index(device))

    def hardware_device(self) -> torch.device | None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None

    def process_device(self, device: torch.device, local_rank: int) -> torch.device:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)

    def synchronize(self, device: torch.device | None) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize(device)

    def default_generator(self, device: torch.device) -> torch.Generator | None:
        return torch.cuda.default_generators[_index(device)]

    def get_rng_state(self, device: torch.device) -> Any:
        return torch.cuda.get_rng_state(device)

    def set_rng_state(self, device: torch.device, state: Any) -> None:
        torch.cuda.set_rng_state(state, device)

    def manual_seed(self, device: torch.device, seed: int) -> None:
        torch.cuda.default_generators[_index(device)].manual_seed(seed)

    def allocator_statistics(self, device: torch.device) -> bool:
        return torch.cuda.is_available()

    def memory_allocated(self, device: torch.device) -> int:
        return int(torch.cuda.memory_allocated(device))

    def max_memory_allocated(self, device: torch.device) -> int:
        return int(torch.cuda.max_memory_allocated(device))

    def max_memory_reserved(self, device: torch.device) -> int | None:
        return int(torch.cuda.max_memory_reserved(device))

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

    def device_name(self, device: torch.device) -> tuple[str, int] | None:
        return torch.cuda.get_device_name(device), int(torch.cuda.get_device_properties(device).total_memory)

    def free_memory(self, device: torch.device) -> int | None:
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)

    def pin_for_copies(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cpu" and not tensor.is_pinned():
            tensor.data = tensor.data.pin_memory()

    def device_copier(self, device: torch.device) -> DeviceCopier:
        return StreamCopier(device)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._side_streams.get(device)
        if stream is None:
            stream = self._side_streams[device] = torch.cuda.Stream(device)
        return stream

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        """A pinned host buffer filled by an asynchronous copy on a side stream; the device tensor's memory is
        released for reuse once the copy is done (``record_stream``)."""
        stream = self._side_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            event = stream.record_event()
        tensor.record_stream(stream)
        return HostCopy(host, tensor.device, event)

    def prefetch_to_device(self, copy: HostCopy) -> None:
        if copy.on_device is not None:
            return
        stream = self._side_stream(copy.device)
        with torch.cuda.stream(stream):
            stream.wait_event(copy.event)
            copy.on_device = copy.tensor.to(copy.device, non_blocking=True)
            copy.ready = stream.record_event()

    def to_device(self, copy: HostCopy) -> torch.Tensor:
        self.prefetch_to_device(copy)
        current = torch.cuda.current_stream(copy.device)
        current.wait_event(copy.ready)
        tensor, copy.on_device = copy.on_device, None
        assert tensor is not None  # set by prefetch_to_device
        tensor.record_stream(current)
        return tensor

    def kernel_platform(self, tensor: torch.Tensor) -> str:
        return "triton" if triton_installed() else "reference"


class StreamCopier(DeviceCopier):
    """Copies on a side stream (``non_blocking`` from pinned memory), each ending with an event: :meth:`wait` makes
    the compute stream wait for it, and :meth:`done_with` records an event on the compute stream after the last use
    of a destination, which the next copy into the same destination waits for. That is what makes reusing
    persistent device buffers safe."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._stream = torch.cuda.Stream(device=device)

    def start(
        self, host: Sequence[torch.Tensor], into: Sequence[torch.Tensor] | None = None, after: Any = None
    ) -> Transfer:
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            if into is None:
                out = [h.detach().to(self.device, non_blocking=True, copy=True) for h in host]
            else:
                out = list(into)
                for dst, src in zip(out, host):
                    dst.copy_(src.detach(), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        if into is None:  # allocated on the side stream, used on the compute stream
            for t in out:
                t.record_stream(torch.cuda.current_stream(self.device))
        return Transfer(out, event)

    def wait(self, transfer: Transfer, host_too: bool = False) -> list[torch.Tensor]:
        if transfer.event is not None:
            torch.cuda.current_stream(self.device).wait_event(transfer.event)
            if host_too:
                transfer.event.synchronize()
            transfer.event = None
        return transfer.tensors

    def done_with(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event
