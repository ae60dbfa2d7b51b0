"""The allocator's own view of a call: :func:`cuda_peak` (the CUDA caching allocator's ``max_memory_allocated``) and
:func:`allocator_peak` (how far the allocator's bytes rose, on cpu from the profiler's memory events). Re-exported by
:mod:`revlib_xla.memory`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .. import backends
from ..units import format_bytes


@dataclasses.dataclass(frozen=True)
class CudaPeak:
    """The CUDA caching allocator's view of a call: ``torch.cuda.memory_allocated`` before and after it, and
    ``torch.cuda.max_memory_allocated`` during it (peak statistics are reset first). All in bytes."""

    peak: int
    before: int
    after: int
    device: str

    @property
    def increase(self) -> int:
        """How far the peak rose above what was allocated before the call."""
        return self.peak - self.before

    def __str__(self) -> str:
        return (
            f"cuda peak on {self.device}: {format_bytes(self.peak)} (+{format_bytes(self.increase)} over "
            f"{format_bytes(self.before)} before; {format_bytes(self.after)} after)"
        )


def cuda_peak(fn: Callable[..., Any], *args: Any, device: backends.DeviceLike = None, **kwargs: Any) -> CudaPeak:
    """Run ``fn(*args, **kwargs)`` and report the CUDA allocator's peak (``max_memory_allocated``) during it.

    This is what the GPU really had to hold, allocator block rounding included; unlike :func:`eager_peak` it also
    sees memory allocated outside PyTorch tensors' storages (cuBLAS workspaces are excluded by the allocator
    statistics, as always). The function's result is dropped before ``after`` is read.
    """
    if not backends.cuda_available():
        raise RuntimeError("cuda_peak needs a CUDA GPU; use eager_peak for a device-independent count")
    dev = backends.as_device(device) if device is not None else backends.device_for("cuda")
    return _statistics_peak(fn, dev, *args, **kwargs)


def _statistics_peak(fn: Callable[..., Any], dev: torch.device, *args: Any, **kwargs: Any) -> CudaPeak:
    """The peak of a call from the allocator statistics of ``dev``'s backend (queued work waited for)."""
    family = backends.backend_for(dev)
    family.reset_peak_memory_stats(dev)
    before = family.memory_allocated(dev)
    result = fn(*args, **kwargs)
    family.synchronize(dev)
    del result
    return CudaPeak(
        peak=family.max_memory_allocated(dev), before=before, after=family.memory_allocated(dev), device=str(dev)
    )


@dataclasses.dataclass(frozen=True)
class AllocatorPeak:
    """How far the bytes allocated through PyTorch's allocator on ``device`` rose during a call above their level
    just before it (``increase``, bytes); ``source`` names the counter the figure comes from. ``retained``: the
    bytes the call allocated that are still allocated once it has returned and its result is dropped (what it
    leaves behind: a model and optimizer it built, or what a step keeps alive from one step to the next)."""

    increase: int
    device: str
    source: str
    retained: int = 0

    def __str__(self) -> str:
        return (
            f"allocator peak on {self.device}: +{format_bytes(self.increase)} during the call, "
            f"{format_bytes(self.retained)} left allocated after it ({self.source})"
        )


def allocator_peak(
    fn: Callable[..., Any], *args: Any, device: backends.DeviceLike = "cpu", **kwargs: Any
) -> AllocatorPeak:
    """Run ``fn(*args, **kwargs)`` and report how far the bytes allocated on ``device`` rose above their level
    before the call.

    Unlike :func:`eager_peak`, which follows tensor storages through Python dispatch, this counts what the
    allocator hands out, so it also sees memory that compiled code allocates (``torch.compile``/inductor kernels
    and their buffers never pass through Python dispatch; ``MemTracker`` reads the same peak whatever inductor
    does). For an eager step both agree (the benchmark's GPT step: within 0.02 %), which makes this the common
    yardstick for eager and compiled steps.

    * ``cpu``: the PyTorch profiler's memory events (``profile_memory=True``): every allocation and free of the
      CPU allocator, in order; the peak is the maximum of their running sum. Only allocations made through
      PyTorch's CPU allocator on the calling thread are seen (not those of libraries that ``malloc`` on their own,
      e.g. oneDNN scratch space); the profiler slows the call, so do not time it.
      The profiler does not see frees of memory allocated before it started (it warns "Memory block of unknown
      size"), so the figure is exact for a call that frees nothing allocated before it (a training step that
      accumulates into existing ``.grad`` tensors, or starts from ``.grad = None``) and an upper bound otherwise;
      the same holds for ``retained`` (exact for a call that builds the model it trains).
    * ``cuda``: the caching allocator's ``max_memory_allocated`` (:func:`cuda_peak`); allocator block rounding
      included, cached-but-free blocks excluded. Other devices whose backend has allocator statistics (TorchTPU,
      experimental): ``torch.accelerator.max_memory_allocated``.

    The function's result is dropped inside the measurement.
    """
    dev = backends.as_device(device)
    family = backends.backend_for(dev)
    if family.allocator_statistics(dev):
        peak = _statistics_peak(fn, dev, *args, **kwargs)
        return AllocatorPeak(
            increase=peak.peak - peak.before,
            device=peak.device,
            source=family.statistics_source,
            retained=peak.after - peak.before,
        )
    if not family.memory_is_host:
        raise ValueError(
            f"allocator_peak measures cpu and cuda, not {dev.type}; on XLA the compiler decides what "
            f"lives when: use step_stablehlo() with tpu_memory() or xla_cpu_memory()"
        )
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn(*args, **kwargs)
        del result
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None or not hasattr(results, "events"):
        raise RuntimeError(
            f"allocator_peak needs the kineto profiler's events (torch >= 2.5; written against "
            f"torch 2.9); this is torch {torch.__version__}"
        )
    events = sorted(
        (
            (e.start_ns(), e.nbytes())
            for e in results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        ),
        key=lambda item: item[0],
    )
    level = increase = 0
    for _, nbytes in events:
        level += nbytes
        increase = max(increase, level)
    return AllocatorPeak(increase=increase, device=str(dev), source="torch.profiler memory events", retained=level)
