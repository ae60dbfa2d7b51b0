"""Parameters that live off the device: streamed to it one unit (a layer, a slice) at a time.

:class:`ParameterStreamer` is the one mechanism behind ``ReversibleSequential(..., target_device=...)`` and
:class:`revlib_xla.OffloadModel`. The parameters (and buffers) stay where the user put them (the host); a unit's
tensors are copied to the device just before the unit runs, while the next unit's copy is already under way, and
are dropped after it ran. Gradients are computed against the device copies and accumulated on the host
parameters, so the optimizer and its state stay on the host too.

* cuda: host tensors are pinned once, copies run on a side stream into two persistent device buffers (one per
  unit in flight), ordered with events: a copy waits until the compute stream is done with the buffer it
  overwrites, the compute stream waits until the copy it reads has landed
  (:meth:`revlib_xla.backends.Backend.device_copier`).
* xla: each unit is uploaded as device data before its part of the graph (one transfer per unit and pass, no
  recompilation). torch_xla cannot make a graph input live in host memory, so in-graph host placement
  (``place_to_host``) is not an option for parameters; see the README.
* cpu: the same code path with real copies, which is what the tests use to check residency.

Residency is tracked, not assumed: :attr:`ParameterStreamer.max_resident` is the largest number of units whose
device copies were alive at once, counting copies that something else (an autograd graph, a user reference) still
holds after the streamer dropped them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from . import backends

__all__ = ["offload_tensor", "ParameterStreamer"]

Tensor = torch.Tensor
_ALIGN = 256  # bytes: the start of each tensor inside a persistent device buffer


class _ToDevice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp: Tensor, device: torch.device) -> Tensor:
        ctx.source = inp.device
        return inp.to(device, non_blocking=True)

    @staticmethod
    def backward(ctx, grad: Tensor):
        backends.cut_graph(grad)  # xla: run what is pending once, rather than once more in every transfer's graph
        return grad.to(ctx.source), None


def offload_tensor(inp: Tensor, reference: Tensor | torch.device | str) -> Tensor:
    """RevLib's ``offload_tensor``: ``inp`` on ``reference``'s device (a tensor or a device), differentiably.

    The gradient goes back to ``inp``'s device. Call it right before using a host-resident parameter in a custom
    model to control when it reaches the device; a cuda copy from pinned memory is asynchronous and ordered on the
    current stream, so it is safe to use at once.
    """
    if not isinstance(inp, torch.Tensor):
        raise TypeError(f"offload_tensor: inp must be a tensor, got {type(inp).__name__}")
    if isinstance(reference, torch.Tensor):
        device = reference.device
    elif isinstance(reference, (str, torch.device)):
        device = torch.device(reference)
    else:
        raise TypeError(f"offload_tensor: reference must be a tensor or a device, got {type(reference).__name__}")
    if inp.device == device:
        return inp
    return _ToDevice.apply(inp, device)


def _storage_ref(t: Tensor):
    try:
        return weakref.ref(t.untyped_storage())
    except (RuntimeError, NotImplementedError, TypeError):  # tensors without a storage (xla)
        return weakref.ref(t)


class ParameterStreamer:
    """Device copies of host-resident tensor units, at most two units at a time when used in order.

    ``units[i]`` is a list of host tensors (parameters, buffers). ``fetch(i, prefetch=j)`` returns unit ``i``'s
    device copies (copying them now unless a prefetch already did) and starts copying unit ``j``; ``release(i)``
    says the caller is done with unit ``i``. With ``persistent=True`` on cuda the copies live in two reusable
    device buffers; copies that an autograd graph may keep (``fetch(..., persistent=False)``) are fresh tensors.
    """

    def __init__(self, units: Sequence[Sequence[Tensor]], device: backends.DeviceLike, persistent: bool = True):
        self.units = [list(u) for u in units]
        self.device = backends.as_device(device)
        self.copier = backends.device_copier(self.device)
        for unit in self.units:
            for t in unit:
                backends.pin_host_tensor_(t, self.device)
        self.persistent = persistent and self.copier.asynchronous
        self._pending: dict[int, backends.Transfer] = {}
        self._loaded: dict[int, list[Tensor]] = {}
        self._given: dict[int, list[weakref.ref]] = {}
        self._slot_owner: list[int | None] = [None, None]
        self._slot_free: list[object] = [None, None]
        self._slot_buffers: list[Tensor | None] = [None, None]
        self.max_resident = 0
        self.transfers = 0  # units copied to the device so far

    # -- residency --------------------------------------------------------------------------------------------------
    def resident(self) -> set[int]:
        """Units with device copies alive now: loaded or in flight, or given out and still referenced."""
        alive = set(self._loaded) | set(self._pending)
        for i, refs in list(self._given.items()):
            if any(r() is not None for r in refs):
                alive.add(i)
            else:
                del self._given[i]
        return alive

    def _note(self) -> None:
        self.max_resident = max(self.max_resident, len(self.resident()))

    def reset_stats(self) -> None:
        self.max_resident = len(self.resident())
        self.transfers = 0

    # -- copies -----------------------------------------------------------------------------------------------------
    def _slot_views(self, i: int, slot: int) -> list[Tensor]:
        sizes = [(t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN for t in self.units[i]]
        need = max(sum((t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN for t in u) for u in self.units)
        buf = self._slot_buffers[slot]
        if buf is None or buf.numel() < need:
            buf = self._slot_buffers[slot] = torch.empty(need, dtype=torch.uint8, device=self.device)
        views, offset = [], 0
        for t, size in zip(self.units[i], sizes):
            nbytes = t.numel() * t.element_size()
            views.append(buf[offset : offset + nbytes].view(t.dtype).view(t.shape))
            offset += size
        return views

    def _start(self, i: int, persistent: bool) -> None:
        if i in self._pending or i in self._loaded:
            return
        slot = i % 2
        if persistent and self.persistent and self._slot_owner[slot] is None:
            self._slot_owner[slot] = i
            transfer = self.copier.start(self.units[i], into=self._slot_views(i, slot), after=self._slot_free[slot])
        else:
            transfer = self.copier.start(self.units[i])
        self._pending[i] = transfer
        self.transfers += 1
        self._note()

    def prefetch(self, i: int | None, persistent: bool = True) -> None:
        """Start copying unit ``i`` (ignored when ``None`` or out of range)."""
        if i is not None and 0 <= i < len(self.units):
            self._start(i, persistent)

    def fetch(self, i: int, prefetch: int | None = None, persistent: bool = True) -> list[Tensor]:
        """Unit ``i``'s device copies, ready for the compute stream; starts copying unit ``prefetch`` too."""
        if i not in self._loaded:
            self._start(i, persistent)
            self._loaded[i] = self.copier.wait(self._pending.pop(i))
        self.prefetch(prefetch, persistent)
        self._note()
        return self._loaded[i]

    def release(self, i: int) -> None:
        """The caller is done with unit ``i``: drop the streamer's copies (a persistent buffer becomes reusable
        once the compute stream has passed this point)."""
        copies = self._loaded.pop(i, None)
        if copies is None:
            return
        for slot in (0, 1):
            if self._slot_owner[slot] == i:
                self._slot_owner[slot] = None
                self._slot_free[slot] = self.copier.done_with()
                break
        else:
            self._given[i] = [_storage_ref(t) for t in copies]

    def release_all(self) -> None:
        """End of a pass: no copy may still read the host tensors once this returns (the optimizer may step them)."""
        for i in list(self._pending):
            self._loaded[i] = self.copier.wait(self._pending.pop(i), host_too=True)
        for i in list(self._loaded):
            self.release(i)
