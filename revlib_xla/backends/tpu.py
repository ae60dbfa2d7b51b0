"""TorchTPU (Google's ``torch_tpu``, device ``"tpu"``): **experimental, never run here** (it needs a TPU).

TorchTPU registers ``"tpu"`` as a PrivateUse1 device when it finds a TPU. It is eager by default, so this backend
is an eager one: recomputation through ``torch.utils.checkpoint`` (non-reentrant), host offload by pinned host
copies, memory statistics through ``torch.accelerator``, and its optimization barrier
``torch.tpu.ops.optimization_barrier``, which returns new tensors.

Two rules from the package's behaviour (see ``notes/torchtpu.md``):

* Detect it only through ``torch.accelerator.current_accelerator()``: ``torch.tpu.is_available()`` and other
  legacy device calls raise when called from user code.
* Another vendor (Sophgo) ships a package with the same import name ``torch_tpu``: before using ``torch.tpu`` this
  backend checks that the distribution providing ``torch_tpu`` is Google's (:func:`torch_tpu_distribution`).
"""

from __future__ import annotations

import functools
import importlib.metadata
from collections.abc import Sequence
from typing import Any

import torch

from .base import Backend, HostOffload

__all__ = ["NotGooglesTorchTpu", "TpuBackend", "is_googles", "torch_tpu_detected", "torch_tpu_distribution"]

#: Words in a distribution's home page, project URLs, author or maintainer fields that mark Google's package.
_GOOGLE_MARKS = ("google-pytorch", "google")


class NotGooglesTorchTpu(RuntimeError):
    """The ``torch_tpu`` installed is not Google's TorchTPU (another vendor uses the same import name)."""


def _distributions_of_import_name(name: str) -> list[str]:
    return list(importlib.metadata.packages_distributions().get(name, []))


def is_googles(dist: importlib.metadata.Distribution) -> bool:
    """Whether a distribution's metadata points at Google: its home page or project URLs at
    ``github.com/google-pytorch``, or Google as its author or maintainer."""
    keys = ("Home-page", "Project-URL", "Author", "Author-email", "Maintainer", "Maintainer-email")
    text = " ".join(value for key in keys for value in dist.metadata.get_all(key) or []).lower()
    return any(mark in text for mark in _GOOGLE_MARKS)


def torch_tpu_distribution() -> importlib.metadata.Distribution | None:
    """The installed distribution that provides the ``torch_tpu`` import name, or ``None`` if none does.

    Raises :class:`NotGooglesTorchTpu` when it is not Google's ``torch-tpu``.
    """
    names = _distributions_of_import_name("torch_tpu")
    if not names:
        return None
    for name in names:
        dist = importlib.metadata.distribution(name)
        if dist.metadata["Name"].lower().replace("_", "-") == "torch-tpu" and is_googles(dist):
            return dist
    described = ", ".join(
        f"{n} (home page {(importlib.metadata.distribution(n).metadata.get_all('Home-page') or [None])[0]!r})"
        for n in names
    )
    raise NotGooglesTorchTpu(
        f"the installed torch_tpu comes from {described}, not Google's TorchTPU (distribution 'torch-tpu', "
        f"github.com/google-pytorch/torch_tpu). revlib_xla's 'tpu' backend is written for Google's: install it with "
        f"pip install 'revlib_xla[torchtpu]', or use Cloud TPUs through torch_xla (pip install 'revlib_xla[xla]')"
    )


def torch_tpu_detected() -> bool:
    """Whether torch's current accelerator is a TPU served by Google's TorchTPU (torch >= 2.6's
    ``torch.accelerator``; never ``torch.tpu.is_available()``, which refuses user code). A ``"tpu"`` accelerator from
    another vendor's ``torch_tpu`` raises :class:`NotGooglesTorchTpu`."""
    current = getattr(getattr(torch, "accelerator", None), "current_accelerator", None)
    accelerator = current() if current is not None else None
    if accelerator is None or accelerator.type != "tpu":
        return False
    return _verified()


@functools.cache
def _verified() -> bool:
    return torch_tpu_distribution() is not None


def _tpu_module() -> Any:
    """``torch.tpu``, once the installed package is known to be Google's."""
    if not _verified():
        raise NotGooglesTorchTpu("a 'tpu' device is in use but no torch-tpu distribution provides torch_tpu")
    return torch.tpu  # type: ignore[attr-defined]  # registered by torch_tpu at import


def _autocast_available(device_type: str) -> bool:
    """Whether this torch has autocast for ``device_type`` (a device type torch does not know has none)."""
    is_available = getattr(torch.amp, "is_autocast_available", None)  # torch >= 2.4
    try:
        return bool(is_available(device_type)) if is_available is not None else False
    except RuntimeError:  # "tpu" is not registered: TorchTPU is not loaded
        return False


class TpuBackend(Backend):
    """Google's TorchTPU, eager (its default mode). Experimental: written from the package's documented behaviour
    and tested with fakes; no TPU has run it."""

    host_offload = HostOffload.BLOCKING_COPY
    preference = 40  # asked before torch_xla (which it replaces): detection is one torch.accelerator call

    def __init__(self) -> None:
        self.autocast_device_type = "tpu" if _autocast_available("tpu") else None

    def available(self, device: torch.device) -> bool:
        return torch_tpu_detected()

    def concrete(self, device: torch.device) -> torch.device:
        if device.index is not None:
            return device
        return torch.device("tpu", torch.accelerator.current_device_index())

    def hardware_device(self) -> torch.device | None:
        return self.concrete(torch.device("tpu")) if torch_tpu_detected() else None

    def synchronize(self, device: torch.device | None) -> None:
        if torch_tpu_detected():
            torch.accelerator.synchronize(device)

    def default_generator(self, device: torch.device) -> torch.Generator | None:
        generators = getattr(_tpu_module(), "default_generators", None)
        return generators[device.index or 0] if generators else None

    def get_rng_state(self, device: torch.device) -> Any:
        generator = self.default_generator(device)
        if generator is None:
            raise RuntimeError(
                f"TorchTPU (experimental): this torch_tpu exposes no default generator to read {device}'s random "
                f"state from (torch.tpu.get_rng_state refuses user code); recomputed blocks draw from generators "
                f"revlib_xla owns (revlib_xla.recompute), which needs torch's dispatcher mode"
            )
        return generator.get_state()

    def set_rng_state(self, device: torch.device, state: Any) -> None:
        generator = self.default_generator(device)
        if generator is None:
            raise RuntimeError(f"TorchTPU (experimental): no default generator to restore {device}'s random state")
        generator.set_state(state)

    def manual_seed(self, device: torch.device, seed: int) -> None:
        generator = self.default_generator(device)
        if generator is not None:
            generator.manual_seed(seed)
        else:
            _tpu_module().manual_seed(seed)

    def optimization_barrier(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``torch.tpu.ops.optimization_barrier``: new tensors, behind the barrier."""
        return list(_tpu_module().ops.optimization_barrier(list(tensors)))

    def free_memory(self, device: torch.device) -> int | None:
        get_memory_info = getattr(torch.accelerator, "get_memory_info", None)  # torch >= 2.10
        if get_memory_info is None:
            return None
        free, _ = get_memory_info(device.index)
        return int(free)
