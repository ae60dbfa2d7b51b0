"""Selective recomputation of attention: keep what a fused attention kernel returned, and let later runs of the
same unit read it instead of running the kernel again.

A transformer layer's recomputation spends much of its time in attention, while attention's output is small (one
hidden state, plus a log-sum-exp per head and token). Megatron-LM's *selective activation recomputation* keeps it.
Here a unit's first run *captures* the outputs of every fused attention kernel it calls
(``aten::_scaled_dot_product_flash_attention_for_cpu``, ``..._flash_attention``, ``..._efficient_attention``,
``..._cudnn_attention``: whichever ``scaled_dot_product_attention`` picks), in call order, and its later runs
*replay* them: the kernel is not run, its captured outputs are returned in its place, below autograd, so autograd
records the kernel's own backward node as usual, saving the query, key and value of the recomputation and the
captured output and log-sum-exp. Gradients are those of the plain layer: the backward of attention reads only these.

How: a rule for ``aten::scaled_dot_product_attention`` at the dispatch key the recompute engine already uses
(:mod:`revlib_xla.recompute`, above autograd, included only within a :class:`AttentionCache` scope of the running
thread), which runs the call under a dispatch mode (below autograd) that sees only that call's operators. Nothing
else is intercepted: other operators pay nothing.

A call whose operator or input shapes differ from the first run's is computed, not replayed. Devices whose
attention is not one fused kernel (XLA decomposes it) capture nothing: :attr:`AttentionCache.bytes` is 0 there,
and the planner offers no cache.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import recompute
from .._tree import detached, tensor_leaves

__all__ = ["AttentionCache", "is_fused_attention"]

_local = threading.local()
_installed: list[Any] = []
_lock = threading.Lock()


def is_fused_attention(func: Any) -> bool:
    """Whether ``func`` (an aten operator overload) is one of the fused kernels ``scaled_dot_product_attention``
    dispatches to (their backward kernels excluded)."""
    name = func.__name__ if hasattr(func, "__name__") else str(func)
    base = name.split(".")[0]
    return base.startswith("_scaled_dot_product_") and not base.endswith("_backward") and "attention" in base


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device)
    return value if isinstance(value, (int, float, bool, str, type(None))) else type(value)


class _Mode(TorchDispatchMode):
    """Below autograd, during one ``scaled_dot_product_attention`` call of a unit: captures or replays the fused
    kernel's outputs."""

    def __init__(self, cache: AttentionCache) -> None:
        super().__init__()
        self.cache = cache

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not is_fused_attention(func):
            return func(*args, **kwargs)
        cache = self.cache
        key = (func, tuple(_meta(a) for a in args), tuple((k, _meta(v)) for k, v in sorted(kwargs.items())))
        position = cache._position
        cache._position += 1
        if cache._capturing:
            out = func(*args, **kwargs)
            cache._entries.append((key, detached(out)))
            return out
        if position < len(cache._entries) and cache._entries[position][0] == key:
            cache.replayed += 1
            # fresh aliases: autograd sets the history of what this returns, and the cache must keep none
            return detached(cache._entries[position][1])
        cache.missed += 1
        return func(*args, **kwargs)


def _rule(key: Any) -> Any:
    op = torch.ops.aten.scaled_dot_product_attention.default

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        cache = getattr(_local, "cache", None)
        if cache is None or cache._busy:
            return recompute.redispatch_below(op, keyset, key, args, kwargs)
        cache._busy = True
        try:
            with _Mode(cache):
                return op(*args, **kwargs)
        finally:
            cache._busy = False

    return kernel


def _install() -> Any:
    """The dispatch key of the rule (registered once per process), or None where this torch cannot."""
    if _installed:
        return _installed[0]
    with _lock:
        if not _installed:
            key = recompute.dispatch_key()
            if key is None:
                _installed[:] = [None, None]
            else:
                library = torch.library.Library("aten", "IMPL")
                library.impl(
                    torch.ops.aten.scaled_dot_product_attention.default,
                    _rule(key),
                    recompute.DISPATCH_KEY_NAME,
                    with_keyset=True,
                )
                _installed[:] = [key, library]
    return _installed[0]


class AttentionCache:
    """The fused attention outputs of one unit's first run, in call order (see the module docstring).

    ``with cache.capturing():`` around the first run, ``with cache.replaying():`` around later ones;
    :attr:`bytes` is what it holds. Scopes are per thread and do not nest across caches (the innermost wins)."""

    def __init__(self) -> None:
        self._entries: list[tuple[Any, Any]] = []
        self._position = 0
        self._capturing = False
        self._busy = False
        self.replayed = 0  # calls answered from the cache
        self.missed = 0  # calls that did not match the first run's and were computed

    def tensors(self) -> list[torch.Tensor]:
        """The captured tensors."""
        return [t for _, out in self._entries for t in tensor_leaves(out)]

    @property
    def bytes(self) -> int:
        """Bytes of the captured tensors, each storage once."""
        seen = {(t.untyped_storage().data_ptr(), t.device): t.untyped_storage().nbytes() for t in self.tensors()}
        return sum(seen.values())

    @property
    def calls(self) -> int:
        return len(self._entries)

    @contextlib.contextmanager
    def _scope(self, capturing: bool) -> Iterator[AttentionCache]:
        key = _install()
        previous = getattr(_local, "cache", None)
        self._position, self._capturing = 0, capturing
        _local.cache = self
        try:
            if key is None:
                yield self
            else:
                with torch._C._IncludeDispatchKeyGuard(key):
                    yield self
        finally:
            _local.cache = previous
            self._capturing = False

    def capturing(self) -> contextlib.AbstractContextManager[AttentionCache]:
        """Run the unit's first run within this: its fused attention outputs are kept (replacing any kept before)."""
        self._entries = []
        return self._scope(True)

    def replaying(self) -> contextlib.AbstractContextManager[AttentionCache]:
        """Run a later run of the unit within this: its fused attention calls return the first run's outputs."""
        return self._scope(False)
