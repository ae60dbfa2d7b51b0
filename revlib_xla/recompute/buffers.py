"""Buffers a forward changes, for the engines that recompute it (see :mod:`revlib_xla.recompute`): which buffers
a unit's forward changes (:class:`RecomputeState`, which also reports a unit that draws from Python's ``random``),
their values from before it (:class:`SavedBuffers`), and the buffers a module owns (:func:`owned_buffers`).
Re-exported by :mod:`revlib_xla.recompute`."""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from .. import backends

Tensor = torch.Tensor
_NOTHING = contextlib.nullcontext()


class SavedBuffers:
    """The buffers of a unit that its forward changed, by position in the unit's buffer list, with their values
    from before that forward."""

    __slots__ = ("before", "positions")

    def __init__(self, positions: list[int], before: list[Tensor]) -> None:
        self.positions, self.before = positions, before

    def swap_in(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Give ``tensors`` (the unit's buffers, or the device copies standing for them) their values from before
        the forward; returns their current values, for :meth:`put_back`."""
        current = []
        with torch.no_grad():
            for k, before in zip(self.positions, self.before):
                current.append(tensors[k].clone())
                tensors[k].copy_(before)
        return current

    def put_back(self, tensors: Sequence[Tensor], current: Sequence[Tensor]) -> None:
        with torch.no_grad():
            for k, value in zip(self.positions, current):
                tensors[k].copy_(value)

    @contextlib.contextmanager
    def replayed(self, tensors: Sequence[Tensor]) -> Iterator[None]:
        """Within the block, ``tensors`` hold their values from before the forward; at exit, their current ones
        again. Exit only after the gradient of what was computed within (see the module docstring)."""
        current = self.swap_in(tensors)
        try:
            yield
        finally:
            self.put_back(tensors, current)

    @contextlib.contextmanager
    def on_copies(self, buffers: Sequence[tuple[torch.nn.Module, Tensor]]) -> Iterator[None]:
        """Within the block, each changed buffer of the unit (``buffers``: its ``(owner, buffer)`` pairs, see
        :func:`owned_buffers`) is replaced in its module by a copy holding its value from before the forward; at
        exit the buffers are back in place, holding what the forward left. Nothing is written into a buffer, so a
        graph built within (which may save the copies) stays valid whatever runs afterwards: another unit sharing
        the buffer recomputed before this one's backward, or a second backward (``create_graph=True``)."""
        restore = []
        try:
            with torch.no_grad():
                for k, before in zip(self.positions, self.before):
                    owner, tensor = buffers[k]
                    name = next(n for n, b in owner._buffers.items() if b is tensor)
                    owner._buffers[name] = before.clone()
                    restore.append((owner, name, tensor))
            yield
        finally:
            for owner, name, tensor in restore:
                owner._buffers[name] = tensor


class _Watch:
    __slots__ = ("copies", "fresh", "keys", "tensors", "versions")

    def __init__(
        self, keys: list[Any], tensors: Sequence[Tensor], copies: list[Tensor | None], fresh: list[bool]
    ) -> None:
        self.keys, self.tensors, self.copies, self.fresh = keys, tensors, copies, fresh
        self.versions = [t._version for t in tensors]


def owned_buffers(modules: Iterable[torch.nn.Module]) -> list[tuple[torch.nn.Module, Tensor]]:
    """Each buffer of ``modules`` (e.g. ``unit.modules()``) once, with the module that owns it."""
    seen: dict[int, tuple[torch.nn.Module, Tensor]] = {}
    for owner in modules:
        for b in owner._buffers.values():
            if b is not None and id(b) not in seen:
                seen[id(b)] = (owner, b)
    return list(seen.values())


class RecomputeState:
    """What an engine learns about its units across calls: which buffers their forward changes, and whether they
    draw from Python's ``random``.

    A buffer is known by the buffer object and whether its module is in training mode. The first forward that meets
    it copies it and afterwards compares (its version counter, and its values: kernels such as batch norm's update
    their running statistics without bumping the counter); from then on only the buffers known to change are
    copied, and the others are watched through their version counter. A buffer that starts changing in place later
    cannot be given back to that call's recomputation: that is reported with a warning, and it is copied from the
    next call on."""

    def __init__(self) -> None:
        self._changing: set = set()
        self._seen: set = set()
        self._unsure: list[tuple[Any, Tensor]] = []  # (key, lazy "kept its value"): taken as changing until read
        self._random_checked = False

    @classmethod
    def of(cls, engine: torch.nn.Module) -> RecomputeState:
        """The state of ``engine`` (an engine module), made at its first use (so also for models pickled before
        it existed)."""
        state = engine.__dict__.get("_recompute")
        if state is None:
            state = engine.__dict__["_recompute"] = cls()
        return state

    def watch(
        self, buffers: Sequence[tuple[torch.nn.Module, Tensor]], tensors: Sequence[Tensor] | None = None
    ) -> _Watch | None:
        """Before a unit's first run: note the state of its ``buffers`` (``(owner, buffer)`` pairs, see
        :func:`owned_buffers`), or of the device copies ``tensors`` standing for them. ``None`` when it has none."""
        if not buffers:
            return None
        if self._unsure:
            self._settle()
        tensors = [b for _, b in buffers] if tensors is None else tensors
        keys = [(id(b), owner.training) for owner, b in buffers]
        fresh = [k not in self._seen for k in keys]
        with torch.no_grad():
            copies = [t.clone() if new or k in self._changing else None for k, t, new in zip(keys, tensors, fresh)]
        return _Watch(keys, tensors, copies, fresh)

    def changed(self, watch: _Watch | None, where: str) -> SavedBuffers | None:
        """After the unit's first run: the buffers it changed, with their values from before (``None``: none)."""
        if watch is None:
            return None
        saved: list[int] = []
        before: list[Tensor] = []
        missing = 0
        for k, t in enumerate(watch.tensors):
            key, copy = watch.keys[k], watch.copies[k]
            if watch.fresh[k]:
                self._seen.add(key)
                if t._version == watch.versions[k] and copy is not None and self._kept(key, t, copy):
                    continue
                self._changing.add(key)
            elif key not in self._changing:
                if t._version == watch.versions[k]:
                    continue
                self._changing.add(key)
                missing += 1
                continue
            if copy is None:  # known to change only since watch() (a unit sharing the buffer ran meanwhile)
                missing += 1
                continue
            saved.append(k)
            before.append(copy)
        if missing:
            warnings.warn(
                f"{where} changed {missing} buffer(s) in place in its forward for the first time; their "
                f"earlier values were not kept, so this call's recomputation starts from the changed values "
                f"(its gradients may differ from the plain model's). They are kept from the next call on.",
                RuntimeWarning,
                stacklevel=4,
            )
        return SavedBuffers(saved, before) if saved else None

    def _kept(self, key: Any, tensor: Tensor, before: Tensor) -> bool:
        """Whether a buffer whose version did not move kept its value through the unit's first run, without running
        pending work: compared where the values are ready (eager devices). On a lazy device (XLA) a buffer that
        still holds device data was not written (a write makes it a pending value); one that is pending is taken
        as changing, and compared once the step has run (:meth:`_settle`, at a later call). A fake tensor (a step
        sized under ``FakeTensorMode``) has no value: its unmoved version counter is all there is to go by."""
        if not (backends.holds_data(tensor) and backends.holds_data(before)):
            return True
        if backends.value_ready(tensor) and backends.value_ready(before):
            return torch.equal(tensor, before)
        if backends.value_ready(tensor):
            return True
        if tensor.shape == before.shape:
            with torch.no_grad():
                self._unsure.append((key, torch.eq(tensor, before).all()))
        return False

    def _settle(self) -> None:
        """Read the lazy comparisons of :meth:`_kept` that are computed: a buffer that kept its value is no longer
        copied."""
        ready = [(key, same) for key, same in self._unsure if backends.value_ready(same)]
        self._unsure = [(key, same) for key, same in self._unsure if not backends.value_ready(same)]
        for key, same in ready:
            if bool(same):
                self._changing.discard(key)

    def python_random_check(self, where: str) -> Any:
        """A context for an engine's training call: at the first one, report a block that draws from Python's
        ``random`` (its recomputation would draw other numbers; neither threads nor this library can replay
        it)."""
        if self._random_checked:
            return _NOTHING
        self._random_checked = True
        return _python_random_guard(where)


@contextlib.contextmanager
def _python_random_guard(where: str) -> Iterator[None]:
    before = random.getstate()
    yield
    if random.getstate() != before:
        warnings.warn(
            f"{where}: a block drew from Python's random module during the forward. Its recomputation in "
            f"the backward draws the next numbers, not the same ones, so the gradients are not those of "
            f"the forward that was run. Draw with torch (torch.rand, or a torch.Generator the block owns), "
            f"which is replayed. (If another thread used random meanwhile, this is a false alarm.)",
            RuntimeWarning,
            stacklevel=4,
        )
