"""What autograd keeps for the backward pass: the bytes of the tensors saved for it, each storage once
(:class:`SavedTensorCounter`, :func:`saved_bytes`). Re-exported by :mod:`revlib_xla.memory`."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import backends
from .._tree import tensor_leaves


def storage_of(tensor: torch.Tensor) -> tuple[Any, int]:
    """What holds ``tensor``'s memory and its size in bytes: its storage (a view shares its base's); on XLA, which
    has no addressable storage, the base tensor at its logical size."""
    if backends.is_tracing_lazily(tensor):
        base = tensor._base if tensor._base is not None else tensor  # a view holds its base alive
        return base, base.numel() * base.element_size()
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # wrapper subclasses without one storage
        return tensor, tensor.numel() * tensor.element_size()
    return storage, storage.nbytes()


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (nested tuples/lists/dicts), each storage once (see :func:`storage_of`)."""
    owners: dict[int, Any] = {}  # holding the owners keeps their ids unique while counting
    total = 0
    for tensor in tensor_leaves(obj):
        owner, nbytes = storage_of(tensor)
        if id(owner) not in owners:
            owners[id(owner)] = owner
            total += nbytes
    return total


class SavedTensorCounter:
    """Count the bytes autograd saves for backward inside a ``with`` block, each storage once.

    Every tensor an autograd node saves (``ctx.save_for_backward``, the inputs of ``addmm``, the output of
    ``tanh``, ...) passes through a ``saved_tensors_hooks`` pack hook; the counter adds the size of its *storage*
    unless that storage was already counted. A tensor saved by two nodes (``tanh`` saves its output, the next
    ``Linear`` saves it as its input) and a view of a saved tensor (``weight.t()``) therefore count once, at the
    size of the memory actually held. Storages are recognised through a weak reference, so a storage freed and
    reallocated at the same address is a new one. Nothing is copied or kept alive.

    Attributes: ``bytes`` (deduplicated bytes), ``count`` (distinct storages counted) and ``packed`` (pack-hook
    calls, duplicates included).

    ``exclude`` lists tensors whose storages are never counted, e.g. ``model.parameters()`` to count activations
    only (autograd also saves weights: ``Linear`` keeps its weight to compute the input gradient).

    Device notes: cpu and cuda tensors are deduplicated by storage. XLA tensors have no addressable storage (the
    compiler decides what exists), so they are deduplicated by tensor object - a view by its base tensor - and
    counted at their logical size ``numel * element_size``: the number says what autograd asks to keep, not what
    the compiled graph holds (use :func:`tpu_memory` for that).

    ``torch.compile``: AOTAutograd's compiled function saves what its partitioned forward keeps through
    ``save_for_backward``, so a counter active while a compiled step runs (after its first, compiling call) counts
    exactly what the compiled graph keeps for backward, i.e. what ``activation_memory_budget`` decides
    (``test_saved_bytes_count_what_a_compiled_graph_saves``).

    Pitfall: saved-tensor hooks do not nest. Hooks installed inside the block (``torch.utils.checkpoint`` with
    ``use_reentrant=False``, activation compression or offload hooks) take over for the tensors saved under them, so
    those are not seen here.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.bytes = 0
        self.count = 0
        self.packed = 0
        self._seen: dict[int, tuple[weakref.ReferenceType, int]] = {}
        self._hooks: contextlib.AbstractContextManager | None = None
        for tensor in exclude:
            self._admit(tensor)

    def reset(self) -> None:
        """Forget everything counted so far (excluded storages stay excluded)."""
        self.bytes = self.count = self.packed = 0
        self._seen = {key: entry for key, entry in self._seen.items() if entry[1] < 0}

    _identity = staticmethod(storage_of)

    def _admit(self, tensor: torch.Tensor) -> None:
        # Excluded storages are recorded with a negative size, so reset() can keep them.
        owner, nbytes = self._identity(tensor)
        self._seen[id(owner)] = (weakref.ref(owner), -1 - nbytes)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.packed += 1
        owner, nbytes = self._identity(tensor)
        entry = self._seen.get(id(owner))
        if entry is None or entry[0]() is not owner:
            self._seen[id(owner)] = (weakref.ref(owner), nbytes)
            self.bytes += nbytes
            self.count += 1
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __enter__(self) -> SavedTensorCounter:
        if self._hooks is not None:
            raise RuntimeError("a SavedTensorCounter cannot be entered twice at the same time")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(*exc)

    def __repr__(self) -> str:
        return f"SavedTensorCounter(bytes={self.bytes}, count={self.count}, packed={self.packed})"


def saved_bytes(fn: Callable[..., Any], *args: Any, exclude: Iterable[torch.Tensor] = (), **kwargs: Any) -> int:
    """Bytes saved for backward while ``fn(*args, **kwargs)`` runs, each storage once (see :class:`SavedTensorCounter`).

    ``fn`` is typically a forward pass; its result is dropped afterwards, which frees the saved tensors.
    """
    if not callable(fn):
        raise TypeError(
            f"saved_bytes needs a function to run, e.g. saved_bytes(lambda: model(x)) or "
            f"saved_bytes(model, x); got {type(fn).__name__} {fn!r}"
        )
    with SavedTensorCounter(exclude) as counter:
        fn(*args, **kwargs)
    return counter.bytes
