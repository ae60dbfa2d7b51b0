"""A recomputation that stops at the last tensor its backward needs.

A unit (a planned stage) whose forward is recomputed just before its backward usually computes more than that
backward reads: the operations after the last one that saves a tensor for autograd (a Llama layer's ``down_proj``
and residual add; most layers' output projection) produce only the unit's output, which the backward does not
need. On an eager device those are wasted work. :class:`DeferredSaves` avoids them, as torch's non-reentrant
checkpoint does, in two parts:

* The unit's first run builds its autograd graph with every saved tensor replaced by an empty slot
  (``saved_tensors_hooks``): the graph, its parameters' gradient edges and the output's gradient edges exist, but
  no activation is kept.
* When the backward first reads a slot, the unit runs again (:attr:`DeferredSaves.recompute`, which the engine
  sets to a function that replays the first run's random numbers and buffers), filling the slots in the order the
  first run saved them, and is stopped by an exception as soon as the last slot is filled.

The slots are weakly held here: each lives as long as the graph node that saved it, so the backward frees the
recomputed tensors node by node. A recomputation that saves tensors of another shape, dtype or device than the
first run, or fewer of them, raises :class:`RecomputationMismatch` instead of computing a wrong gradient.

On a lazily traced device (XLA) this is not used: the compiler already drops the operations whose results nothing
reads, and the recomputation must keep one graph shape.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch

__all__ = ["DeferredSaves", "RecomputationMismatch"]


class RecomputationMismatch(RuntimeError):
    """A recomputed forward saved other tensors for its backward than its first run: the unit does not compute the
    same thing twice (data-dependent control flow, or state the engine does not replay)."""


class _Stop(Exception):
    """Raised from the recomputation's last save: everything the backward needs is there."""


class _Slot:
    __slots__ = ("__weakref__", "meta", "value")

    def __init__(self, meta: tuple[torch.Size, torch.dtype, torch.device]) -> None:
        self.meta = meta
        self.value: torch.Tensor | None = None


def _meta(t: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.device]:
    return t.shape, t.dtype, t.device


class DeferredSaves:
    """The saved tensors of one unit's graph, recomputed on first use (see the module docstring).

    ``where`` names the unit in errors. Run the unit's first forward within :meth:`recording`; set
    :attr:`recompute` before its backward to a function that runs the unit again with autograd on (its result is
    not used); run the backward from the first run's outputs."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.slots: list[weakref.ref[_Slot]] = []
        self.recompute: Callable[[], object] | None = None
        self.ran = False

    @property
    def count(self) -> int:
        """How many tensors the first run saved for its backward."""
        return len(self.slots)

    def recording(self) -> contextlib.AbstractContextManager[None]:
        """Around the unit's first run: its saved tensors become empty slots."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> _Slot:
        slot = _Slot(_meta(t))
        self.slots.append(weakref.ref(slot))
        return slot

    def _unpack(self, slot: _Slot) -> torch.Tensor:
        if slot.value is None:
            if self.ran:
                raise RecomputationMismatch(
                    f"{self.where}: its backward read a saved tensor its recomputation did not fill; the forward "
                    f"does not compute the same thing twice. Keep this stage's activations instead of recomputing "
                    f"it (e.g. a schedule that runs it with Fe in the forward phase)"
                )
            self.fill()
        value = slot.value
        assert value is not None
        return value

    def fill(self) -> None:
        """Run the recomputation, filling the slots, up to the last one: what the backward's first read of a
        slot does (called directly, it times that recomputation)."""
        if self.recompute is None:
            raise RuntimeError(
                f"{self.where}: its backward ran before the engine set up its recomputation (an internal error); "
                f"please report it"
            )
        self.ran = True
        k = 0
        total = len(self.slots)

        def pack(t: torch.Tensor) -> None:  # the recomputation's pack hook; _Stop at the last slot
            nonlocal k
            slot = self.slots[k]()
            if slot is not None:
                if slot.meta != _meta(t):
                    raise RecomputationMismatch(
                        f"{self.where}: saved tensor {k} of its recomputation is {_describe(_meta(t))}, its first "
                        f"run's was {_describe(slot.meta)}; the forward does not compute the same thing twice"
                    )
                slot.value = t.detach()
            k += 1
            if k == total:
                raise _Stop

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked)
        with contextlib.suppress(_Stop), hooks, torch.enable_grad():
            self.recompute()
            raise RecomputationMismatch(
                f"{self.where}: its recomputation saved {k} tensors for the backward, its first run {total}; "
                f"the forward does not compute the same thing twice"
            )


def _never_unpacked(_: None) -> torch.Tensor:  # pragma: no cover - the recomputation's own graph is never run
    raise RuntimeError("a recomputation's own graph has no saved tensors")


def _describe(meta: tuple[torch.Size, torch.dtype, torch.device]) -> str:
    shape, dtype, device = meta
    return f"{tuple(shape)} {str(dtype).removeprefix('torch.')} on {device}"
