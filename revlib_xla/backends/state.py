"""Device state a recomputation captures at forward time and replays: random numbers and autocast."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from .registry import DeviceLike, as_device, backend_for

__all__ = ["AutocastState", "DeviceSeed", "RngState"]


@dataclasses.dataclass
class RngState:
    """The random-number state of one device (and of the CPU generator), to put back later."""

    device: torch.device
    cpu: torch.Tensor | None
    accel: Any

    @classmethod
    def capture(cls, device: DeviceLike) -> RngState:
        dev = as_device(device)
        return cls(dev, torch.get_rng_state(), backend_for(dev).get_rng_state(dev))

    def bytes_on(self, device: DeviceLike) -> int:
        """Bytes this state holds in the memory of ``device``'s tensors (the CPU generator's 5,056 on the CPU; on
        an accelerator both states are host tensors: none)."""
        dev = as_device(device)
        held = (t for t in (self.cpu, self.accel) if isinstance(t, torch.Tensor))
        return sum(t.nbytes for t in held if t.device == dev)

    def restore(self) -> None:
        if self.cpu is not None:
            torch.set_rng_state(self.cpu)
        if self.accel is not None:
            backend_for(self.device).set_rng_state(self.device, self.accel)


@dataclasses.dataclass
class DeviceSeed:
    """The random state of a device whose random ops cannot be handed a generator (xla: one seed per device, which
    every random op in the graph derives from), seeded per unit and put back afterwards."""

    device: torch.device
    state: Any

    @classmethod
    def capture(cls, device: DeviceLike) -> DeviceSeed | None:
        """The device's state, or ``None`` for a device whose random ops can be handed a generator (or that has no
        random state of its own)."""
        dev = as_device(device)
        backend = backend_for(dev)
        if backend.takes_generators:
            return None
        state = backend.get_rng_state(dev)
        return None if state is None else cls(dev, state)

    def seed(self, seed: int) -> None:
        backend_for(self.device).manual_seed(self.device, seed)

    def restore(self) -> None:
        backend_for(self.device).set_rng_state(self.device, self.state)


def _autocast_of(device_type: str | None) -> tuple[bool, torch.dtype | None]:
    if device_type is None:
        return False, None
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


_CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """Whether autocast was on, and with which dtype, for one device's autocast type (and for the CPU) at forward
    time. ``device_type`` is the device's autocast type (``None`` where autocast does not apply to it)."""

    device_type: str | None
    enabled: bool
    dtype: torch.dtype | None
    cpu_enabled: bool
    cpu_dtype: torch.dtype | None
    cache_enabled: bool

    @classmethod
    def capture(cls, device: DeviceLike) -> AutocastState:
        kind = backend_for(device).autocast_device_type
        enabled, dtype = _autocast_of(kind)
        cpu_enabled, cpu_dtype = _autocast_of(_cpu_type())
        return cls(kind, enabled, dtype, cpu_enabled, cpu_dtype, torch.is_autocast_cache_enabled())

    def differs_from_now(self) -> bool:
        """Whether :meth:`replay` has anything to do: autocast was on at capture, or is on now."""
        return bool(
            self.enabled or self.cpu_enabled or _autocast_of(self.device_type)[0] or _autocast_of(_cpu_type())[0]
        )

    @contextlib.contextmanager
    def replay(self, cache_enabled: bool | None = False) -> Iterator[None]:
        """Enter exactly this autocast state (switching autocast off if it was off at forward time).

        The weight-cast cache is off by default: casts made under ``no_grad`` in a forward would otherwise be cached
        without their autograd history and reused by the recomputation, and the parameters would get no gradient.
        """
        if not self.differs_from_now():
            yield  # off then and off now: nothing to enter (and no weight-cast cache to worry about)
            return
        cache = self.cache_enabled if cache_enabled is None else cache_enabled
        cpu_type = _cpu_type()
        with contextlib.ExitStack() as stack:
            if self.device_type is not None and self.device_type != cpu_type:
                stack.enter_context(
                    torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled, cache_enabled=cache)
                )
            stack.enter_context(
                torch.autocast(cpu_type, dtype=self.cpu_dtype, enabled=self.cpu_enabled, cache_enabled=cache)
            )
            yield


@contextlib.contextmanager
def autocast_cache_off() -> Iterator[None]:
    """Run without autocast's weight-cast cache (its flag is per thread, for every device type).

    A module run under ``no_grad`` inside an autocast region caches its weights' casts without their autograd
    history, and a later run with autograd in the same region (the stage a plan measured, then runs) reuses them:
    its parameters get no gradient, silently (torch <= 2.9; pytorch/pytorch#158232). Engines run their own first
    runs and measurements under this."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


def autocast_off(device_type: str | None) -> contextlib.AbstractContextManager[Any]:
    """Autocast switched off for ``device_type`` (an autocast device type; None: nothing to switch off), for code
    that runs its products in explicit dtypes."""
    return contextlib.nullcontext() if device_type is None else torch.autocast(device_type, enabled=False)


def _cpu_type() -> str:
    kind = backend_for(_CPU).autocast_device_type
    assert kind is not None  # the CPU backend has autocast
    return kind
