"""A device family for tests, built on the CPU: what adding a family takes is this one module and a registry entry.

:class:`RecordingFamily` computes on the CPU but answers like a family whose random operators cannot be handed
generators (as on XLA: one per-device seed, set per recomputed unit and put back after it), and records every
capability a feature asks of it, so a test can check that a feature went through the backend and not around it.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from revlib_xla import backends


class RecordingFamily(backends.CpuBackend):
    """The CPU, with random state seeded per device instead of generators, and a count of each capability used."""

    takes_generators = False

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()

    def default_generator(self, device: torch.device) -> torch.Generator | None:
        self.calls["default_generator"] += 1
        return None

    def get_rng_state(self, device: torch.device) -> Any:
        self.calls["get_rng_state"] += 1
        return torch.get_rng_state()

    def set_rng_state(self, device: torch.device, state: Any) -> None:
        self.calls["set_rng_state"] += 1
        torch.set_rng_state(state)

    def manual_seed(self, device: torch.device, seed: int) -> None:
        self.calls["manual_seed"] += 1
        torch.default_generator.manual_seed(seed)

    def optimization_barrier(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.calls["optimization_barrier"] += 1
        return list(tensors)

    def after(self, value: Any, token: torch.Tensor) -> Any:
        self.calls["after"] += 1
        return value


@contextlib.contextmanager
def serving(device_type: str, family: backends.Backend) -> Iterator[backends.Backend]:
    """``family`` registered for ``device_type`` within the block; the previous backend is put back after it."""
    previous = backends.registered().get(device_type)
    backends.register(device_type, family)
    try:
        yield family
    finally:
        if previous is not None:
            backends.register(device_type, previous)
        else:
            backends.unregister(device_type)
