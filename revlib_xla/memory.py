"""Deterministic memory measurement for training steps: what autograd keeps, the eager peak, and compiled XLA memory.

Three questions, three tools, all giving the same bytes when asked twice:

1. **What does autograd keep for the backward pass?** :class:`SavedTensorCounter` / :func:`saved_bytes` count the
   bytes of tensors saved for backward (``torch.autograd.graph.saved_tensors_hooks``), each storage once. This is
   the right number for "this block saves only its output" or "compression halves what is kept" assertions.
2. **What is the eager peak of a step, and what is it made of?** :func:`eager_peak` runs a step under PyTorch's
   ``MemTracker`` and splits the peak into parameters, gradients, activations, temporaries, optimizer state,
   buffers and inputs. It works for CPU and CUDA tensors, and under ``FakeTensorMode`` (``fake=True``) so a model
   that does not fit anywhere can be sized on a laptop. :func:`cuda_peak` gives the CUDA caching allocator's own
   ``max_memory_allocated`` for a call; :func:`allocator_peak` how far the allocator's bytes rose during a call on
   cpu (profiler memory events) or cuda, which also sees what ``torch.compile``'d code allocates.
3. **How much memory does the compiled XLA step need?** On XLA the Python lifetimes above mean nothing: the compiler
   decides what lives when. That part lives in :mod:`revlib_xla.compiled` and is re-exported here:
   :func:`step_stablehlo` traces one training step on the XLA device and returns its
   StableHLO (loss and every parameter gradient); :func:`xla_cpu_memory` compiles it for XLA:CPU in-process and
   :func:`tpu_memory` compiles it for a TPU generation (v5e by default; v5p, v6e) *without a TPU*, with libtpu's
   deviceless compiler in a child process. TPU figures are what the TPU compiler plans for one chip - they come
   from the TPU compiler, not from a TPU run. XLA:CPU numbers are useful for execution-level sanity checks but
   cannot judge rematerialisation, reversible or offload policies (XLA:CPU removes optimization barriers early
   and CSE merges recomputation back into the forward); use the TPU compiler for those.

Compiled results are cached by a hash of the StableHLO text (plus compiler versions and flags): in memory always,
and on disk when asked (``disk_cache=True`` or the ``REVLIB_XLA_CACHE`` environment variable). Byte counts in words
(:func:`format_bytes`, :func:`parse_bytes`) live in :mod:`revlib_xla.units`. Nothing here prints;
progress and timings go to the ``revlib_xla.memory`` logger at DEBUG level.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeGuard

import torch

from . import backends
from ._tree import map_tensors, tensor_leaves
from .compiled.memory import (
    MATMUL_PATTERN,
    TPU_GENERATIONS,
    CompiledMemory,
    MissingDependencyError,
    TpuCompileError,
    clear_compile_cache,
    compile_timeout,  # noqa: F401  (not in __all__, but read as memory.compile_timeout)
    tpu_memory,
    tpu_memory_many,
    tpu_memory_results,
    xla_cpu_memory,
)
from .compiled.stablehlo import stablehlo_of, step_stablehlo
from .units import BYTE_UNITS, format_bytes, parse_bytes  # noqa: F401  (BYTE_UNITS: as memory.BYTE_UNITS)

__all__ = [
    "SavedTensorCounter",
    "saved_bytes",
    "storage_of",
    "tensor_bytes",
    "MemoryBreakdown",
    "EagerPeak",
    "StorageTracker",
    "eager_peak",
    "CudaPeak",
    "cuda_peak",
    "AllocatorPeak",
    "allocator_peak",
    "CompiledMemory",
    "stablehlo_of",
    "step_stablehlo",
    "xla_cpu_memory",
    "tpu_memory",
    "tpu_memory_many",
    "tpu_memory_results",
    "clear_compile_cache",
    "TPU_GENERATIONS",
    "MATMUL_PATTERN",
    "MissingDependencyError",
    "TpuCompileError",
    "format_bytes",
    "parse_bytes",
]

logger = logging.getLogger(__name__)


# =================================================================================================================
# 1. Bytes saved for backward


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


# =================================================================================================================
# 2. Eager peak


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes live at one moment, by what they are (the categories of PyTorch's ``MemTracker``).

    ``activations`` are tensors made in the forward pass (including recomputation), ``temporaries`` those made in
    the backward pass (activation gradients, and parameter gradients until autograd hands them to ``.grad``),
    ``other`` the step's inputs and any other tensor created before the step.
    """

    total: int
    parameters: int
    gradients: int
    activations: int
    temporaries: int
    optimizer: int
    buffers: int
    other: int

    def _parts(self) -> str:
        names = ("parameters", "gradients", "activations", "temporaries", "optimizer", "buffers", "other")
        return ", ".join(f"{name} {format_bytes(getattr(self, name))}" for name in names)

    def __str__(self) -> str:
        return f"{format_bytes(self.total)} ({self._parts()})"


@dataclasses.dataclass(frozen=True)
class EagerPeak(MemoryBreakdown):
    """The peak of an eager step (fields of :class:`MemoryBreakdown`, at the moment of the peak) on ``device``.

    ``end`` is the breakdown once the step is over (gradients and optimizer state are complete there); ``fake``
    tells whether the step ran under ``FakeTensorMode`` (no memory was allocated).
    """

    device: str
    end: MemoryBreakdown
    fake: bool

    def __str__(self) -> str:
        how = ", FakeTensorMode" if self.fake else ""
        return (
            f"eager peak on {self.device}{how}: {format_bytes(self.total)} ({self._parts()}); "
            f"after the step: {format_bytes(self.end.total)}"
        )


_CATEGORIES = {  # MemoryBreakdown field -> _MemRefType member name
    "parameters": "PARAM",
    "gradients": "GRAD",
    "activations": "ACT",
    "temporaries": "TEMP",
    "optimizer": "OPT",
    "buffers": "BUFFER",
    "other": "OTH",
}


def _mem_tracker() -> tuple[type, Any]:
    """``MemTracker`` and ``_MemRefType``, or a clear error naming the torch this needs."""
    hint = (
        f"eager_peak needs torch.distributed._tools.mem_tracker.MemTracker (torch >= 2.5 built with "
        f"distributed support; written against torch 2.9); this is torch {torch.__version__}"
    )
    try:
        from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    except Exception as exc:  # ImportError, or torch.distributed unavailable in this build
        raise RuntimeError(f"{hint}: {type(exc).__name__}: {exc}") from exc
    missing = [name for name in _CATEGORIES.values() if not hasattr(_MemRefType, name)]
    missing += [name for name in ("track_external", "get_tracker_snapshot") if not hasattr(MemTracker, name)]
    if missing:
        raise RuntimeError(f"{hint}, whose MemTracker lacks {', '.join(missing)}")
    return _tracker_for_frozen_parameters(MemTracker), _MemRefType


class _NoHook:
    def remove(self) -> None:
        pass


def _tracker_for_frozen_parameters(tracker: type) -> type:
    """``MemTracker`` that also tracks parameters that do not require grad (frozen layers; the device copies a
    ``target_device`` model hands its blocks): torch's registers a gradient hook on every parameter of every module
    it enters, and such a tensor refuses one ("cannot register a hook on a tensor that doesn't require gradient").
    Marking them as hooked already leaves their bytes counted as parameters; they get no gradient to count."""
    if not hasattr(tracker, "_track_module_params_and_buffers"):
        return tracker

    class Tracker(tracker):  # type: ignore[misc, valid-type]
        def _track_module_params_and_buffers(
            self, module: torch.nn.Module, install_grad_hooks: bool = True
        ) -> tuple[int, int]:
            hooked = getattr(self, "_param_to_grad_hook_handles", None)
            if install_grad_hooks and hooked is not None:
                for param in module.parameters():
                    if not param.requires_grad and hooked.get(param, None) is None:
                        hooked[param] = (_NoHook(), _NoHook())
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _update_and_maybe_create_winfos(self, t: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
            # Autograd runs a parameter's gradient hooks with None when a custom Function (Checkpointable, a
            # reversible layer) accumulated its gradient itself and passes none on: nothing to track.
            return set() if t is None else super()._update_and_maybe_create_winfos(t, *args, **kwargs)

    return Tracker


def _breakdown(
    snapshot: Mapping[torch.device, Mapping[Any, int]], device: torch.device, ref_type: Any
) -> MemoryBreakdown:
    per_device = snapshot.get(device)
    if per_device is None:  # torch.device("cuda") asked for, torch.device("cuda", 0) tracked
        family = backends.backend_for(device)
        per_device = next(
            (
                v
                for k, v in snapshot.items()
                if backends.backend_for(k) is family and (device.index is None or k.index == device.index)
            ),
            {},
        )

    def get(name: str) -> int:
        member = getattr(ref_type, name)
        return int(per_device.get(member, per_device.get(getattr(member, "value", member), 0)))

    parts = {field: get(name) for field, name in _CATEGORIES.items()}
    total = int(per_device.get("Total", sum(parts.values())))
    return MemoryBreakdown(total=total, **parts)


class StorageTracker:
    """Bytes of tensor storages on each kind of device while it is active, and their peak: a
    ``TorchDispatchMode`` that notes the storage of every tensor an operation returns (each storage once, at its
    size; on cuda rounded up to the caching allocator's 512-byte blocks, as ``MemTracker`` counts) and a weak
    reference to it whose callback subtracts its bytes when it is freed. Storages made before it are counted
    where :meth:`track` names them (their frees then lower the level).

    ``MemTracker``'s figures without its module tracking: ``MemTracker`` registers a multi-tensor gradient hook on
    every tensor entering or leaving a module under autograd, and that hook holds the tensors' graph nodes (a leaf's
    gradient accumulator holds the leaf), in a cycle through C++ that Python's garbage collector cannot see: every
    input and every graph never run backward stays alive for good. A planner measuring each stage several times
    leaked that way a whole step's activations (``test_measuring_leaves_nothing_alive``). This tracker hooks
    nothing but storages: a measurement leaves nothing behind. Usable on its own (``with StorageTracker() as t:
    ...; t.peak("cpu")``); it counts what passes through dispatch, as ``MemTracker`` does (not the workspace a
    fused kernel allocates inside itself).
    """

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ReferenceType, int, str]] = {}
        self._current: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._mode: Any = None

    @staticmethod
    def _size(storage: Any, device: torch.device) -> int:
        unit = backends.backend_for(device).allocation_granularity
        return -(-int(storage.nbytes()) // unit) * unit

    def _freed(self, key: int, ref: weakref.ReferenceType) -> None:
        entry = self._seen.get(key)
        if entry is not None and entry[0] is ref:
            del self._seen[key]
            self._current[entry[2]] -= entry[1]

    def _note(self, tensor: torch.Tensor) -> None:
        if backends.is_tracing_lazily(tensor):  # XLA: no storage; the compiler decides what exists
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # wrapper subclasses without one storage
            return
        kind = tensor.device.type
        size = self._size(storage, tensor.device)
        entry = self._seen.get(id(storage))
        if entry is not None and entry[0]() is storage:
            if entry[1] != size:  # resized in place
                self._seen[id(storage)] = (entry[0], size, kind)
                self._current[kind] += size - entry[1]
            return
        ref = weakref.ref(storage, functools.partial(self._freed, id(storage)))
        self._seen[id(storage)] = (ref, size, kind)
        self._current[kind] = self._current.get(kind, 0) + size

    def _update_peak(self) -> None:
        for kind, level in self._current.items():
            if level > self._peak.get(kind, 0):
                self._peak[kind] = level

    def track(self, *objs: Any) -> None:
        """Count the storages of the tensors in ``objs`` (tensors and nested containers of them, with their
        ``.grad``; modules: their parameters, with their ``.grad``, and buffers) as live now, so that their frees
        lower the level. A storage first seen as the output of an operation counts as allocated by it, even where
        the operation wrote into it in place: name what exists before (a gradient accumulated into, say) here."""
        for obj in objs:
            tensors = [*obj.parameters(), *obj.buffers()] if isinstance(obj, torch.nn.Module) else tensor_leaves(obj)
            for tensor in tensors:
                self._note(tensor)
                if tensor.is_leaf and tensor.grad is not None:
                    self._note(tensor.grad)
        self._update_peak()

    def current(self, device: backends.DeviceLike = "cpu") -> int:
        """Bytes live now on devices of ``device``'s kind."""
        return self._current.get(backends.as_device(device).type, 0)

    def peak(self, device: backends.DeviceLike = "cpu") -> int:
        """The most bytes live at once on devices of ``device``'s kind since the tracker was entered."""
        kind = backends.as_device(device).type
        return max(self._peak.get(kind, 0), self._current.get(kind, 0))

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        self._peak = dict(self._current)

    def __enter__(self) -> StorageTracker:
        from torch.utils import _pytree
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                for leaf in _pytree.tree_leaves(out):
                    if isinstance(leaf, torch.Tensor):
                        tracker._note(leaf)
                tracker._update_peak()
                return out

        if self._mode is not None:
            raise RuntimeError("a StorageTracker cannot be entered twice at the same time")
        self.reset_peak()
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc)


def _is_factory(obj: Any) -> TypeGuard[Callable[..., Any]]:
    return callable(obj) and not isinstance(obj, (torch.nn.Module, torch.Tensor, torch.optim.Optimizer))


def _fake_copy(model: torch.nn.Module, fake_mode: Any, keep_grads: bool) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake tensors (no data is copied)."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        fake = torch.nn.Parameter(fake_mode.from_tensor(param.detach()), requires_grad=param.requires_grad)
        if keep_grads and param.grad is not None:
            fake.grad = fake_mode.from_tensor(param.grad)
        memo[id(param)] = fake
    for buf in model.buffers():
        memo[id(buf)] = fake_mode.from_tensor(buf)
    return copy.deepcopy(model, memo)


def eager_peak(
    step_fn: Callable[..., Any],
    model: torch.nn.Module | Callable[[], torch.nn.Module],
    *inputs: Any,
    optimizer: torch.optim.Optimizer | Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
    fake: bool = False,
    device: backends.DeviceLike = None,
    zero_grad: bool = True,
) -> EagerPeak:
    """Peak memory of one eager training step, split by category, measured by tracking tensor storages.

    The measured step is ``step_fn(model, *inputs)`` (forward and backward; its return value is dropped), followed
    by ``optimizer.step()`` when an optimizer is given. Numbers count tensor storages (PyTorch's
    ``torch.distributed._tools.mem_tracker.MemTracker``; on cuda rounded to the allocator's 512-byte blocks), not
    allocator caches or fragmentation, so they are exact and identical from run to run, on any device.

    ``model`` is a module or a zero-argument factory; each input is a tensor (or nested list/tuple/dict of them),
    any other value, or a zero-argument factory; ``optimizer`` is an optimizer or a factory taking the model.

    With ``fake=True`` everything runs under ``FakeTensorMode``: factories are called inside it, so nothing is
    ever allocated and a model far larger than this machine's memory can be sized (fake tensors keep their device,
    so the figures are those of the device the factory builds on). Real modules and tensors passed with
    ``fake=True`` are replaced by fake copies; an optimizer must then be given as a factory.

    ``zero_grad`` (default) sets gradients to ``None`` first, so the step starts from the same state each call and
    gradients are counted as new memory. An optimizer that creates its state lazily (Adam) allocates it in the
    first step; measure twice with the same optimizer to see the steady state.

    ``device``: whose memory to report (default: that of the first parameter, else of the first input tensor).

    Limitation (MemTracker's): the root module may be called once per step.
    """
    MemTracker, ref_type = _mem_tracker()
    fake_mode = None
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode()
        if isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                "with fake=True pass the optimizer as a factory, e.g. lambda m: torch.optim.Adam("
                "m.parameters()), so that it is built on the fake parameters"
            )
    if not isinstance(model, torch.nn.Module) and not _is_factory(model):
        raise TypeError(f"model must be an nn.Module or a factory returning one, not {type(model).__name__}")
    # Real objects become fake outside the mode (copying a real tensor inside it is an error); factories are
    # called inside it, so what they build is fake from the start.
    if fake_mode is not None and isinstance(model, torch.nn.Module):
        model = _fake_copy(model, fake_mode, not zero_grad)
    to_fake = (lambda t: t if _is_fake(t) else fake_mode.from_tensor(t)) if fake_mode is not None else None
    if to_fake is not None:
        inputs = tuple(item if _is_factory(item) else map_tensors(to_fake, item) for item in inputs)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        module: torch.nn.Module
        if isinstance(model, torch.nn.Module):
            module = model
        elif fake_mode is not None:
            module = _build_fake(model)
        else:
            module = model()
        args = [item() if _is_factory(item) else item for item in inputs]
        opt: Any = optimizer(module) if _is_factory(optimizer) else optimizer  # an optimizer, or duck-typed one
        if zero_grad:
            for param in module.parameters():
                param.grad = None
        where = _report_device(device, module, args)
        lazy = [
            t
            for t in list(module.parameters()) + [t for a in args for t in tensor_leaves(a)]
            if backends.is_tracing_lazily(t)
        ]
        if lazy or backends.backend_for(where).lazy:
            raise ValueError(
                "eager_peak measures eager devices (cpu, cuda); an XLA step's memory is decided by the "
                "compiler: use step_stablehlo() with tpu_memory() or xla_cpu_memory()"
            )
        tracker = MemTracker()
        tracker.track_external(
            module, *[t for a in args for t in tensor_leaves(a)], *([opt] if opt is not None else [])
        )
        start = time.perf_counter()
        with tracker:
            step_fn(module, *args)
            if opt is not None:
                opt.step()
        peak = tracker.get_tracker_snapshot("peak")
        end = tracker.get_tracker_snapshot("current")
    logger.debug("eager_peak: step tracked in %.2f s", time.perf_counter() - start)
    at_peak = _breakdown(peak, where, ref_type)
    return EagerPeak(**dataclasses.asdict(at_peak), device=str(where), end=_breakdown(end, where, ref_type), fake=fake)


def _build_fake(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """Call a model factory inside the fake mode, turning torch's failure to move a fake module into advice."""
    try:
        return factory()
    except RuntimeError as err:
        if "Couldn't swap" not in str(err):
            raise
        raise RuntimeError(
            f"eager_peak(fake=True): the model factory moved a module built under FakeTensorMode with .to(...), which "
            f"this torch ({torch.__version__}) cannot do for fake parameters ({err}). Build the model on its device "
            f"instead, e.g. `with torch.device('cuda'): model = make_model()`."
        ) from None


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _report_device(device: backends.DeviceLike, module: torch.nn.Module, args: Sequence[Any]) -> torch.device:
    if device is not None:
        return backends.as_device(device)
    for param in module.parameters():
        return param.device
    for arg in args:
        for tensor in tensor_leaves(arg):
            return tensor.device
    return torch.device("cpu")


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
