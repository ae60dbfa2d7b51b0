"""Which backend serves which device: a registry keyed by ``torch.device.type``."""

from __future__ import annotations

import torch

from .base import Backend

__all__ = ["DeviceLike", "UnknownDeviceError", "as_device", "backend_for", "register", "registered", "unregister"]

DeviceLike = str | torch.device | torch.Tensor | None

_BACKENDS: dict[str, Backend] = {}


class UnknownDeviceError(LookupError):
    """No backend is registered for a device's family."""


def as_device(device: DeviceLike) -> torch.device:
    """``device`` as a ``torch.device``: a tensor's device, the CPU for ``None``."""
    if isinstance(device, torch.Tensor):
        return device.device
    if device is None:
        return torch.device("cpu")
    return torch.device(device)


def register(device_type: str, backend: Backend) -> None:
    """Serve devices whose ``torch.device.type`` is ``device_type`` with ``backend`` (replacing any backend
    registered for it before)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register({device_type!r}, ...): a backend is a revlib_xla.backends.Backend, not {backend!r}")
    backend.device_type = device_type
    _BACKENDS[device_type] = backend


def unregister(device_type: str) -> Backend | None:
    """Remove the backend registered for ``device_type`` (returned, or ``None`` if there was none)."""
    return _BACKENDS.pop(device_type, None)


def registered() -> dict[str, Backend]:
    """The registered backends by device type, in registration order."""
    return dict(_BACKENDS)


def backend_for(device: DeviceLike) -> Backend:
    """The backend of ``device`` (a device, a device string, a tensor; ``None`` means the CPU)."""
    dev = as_device(device)
    found = _BACKENDS.get(dev.type)
    if found is None:
        raise UnknownDeviceError(
            f"revlib_xla has no backend for device {str(dev)!r} (device type {dev.type!r}); registered device "
            f"families: {', '.join(sorted(_BACKENDS))}. Run on one of those, or add one: subclass "
            f"revlib_xla.backends.Backend and call revlib_xla.backends.register({dev.type!r}, YourBackend())"
        )
    return found
