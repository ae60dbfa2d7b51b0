"""The eager peak of a step, split into what it is made of (parameters, gradients, activations, temporaries,
optimizer state, buffers, inputs): :func:`eager_peak` under PyTorch's ``MemTracker`` (on fake tensors too), and
:class:`StorageTracker`, which follows tensor storages. Re-exported by :mod:`revlib_xla.memory`."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeGuard

import torch

from .. import backends
from .._tree import map_tensors, tensor_leaves
from ..units import format_bytes

logger = logging.getLogger("revlib_xla.memory")


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
        self._phase: dict[str, int] | None = None  # the current phase's peaks, per device kind
        self._phases: dict[str, dict[str, int]] = {}

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
            if self._phase is not None and level > self._phase.get(kind, 0):
                self._phase[kind] = level

    def phase(self, name: str | None) -> None:
        """From now on (until the next call) the levels reached also count towards phase ``name``'s peak (a phase
        entered again keeps its largest: each micro-batch's forward, say); ``None``: no phase."""
        if name is None:
            self._phase = None
            return
        self._phase = self._phases.setdefault(name, {})
        self._update_peak()

    def phase_peaks(self, device: backends.DeviceLike = "cpu") -> dict[str, int]:
        """Each phase's peak on devices of ``device``'s kind (bytes), in the order the phases were first entered."""
        kind = backends.as_device(device).type
        return {name: peaks.get(kind, 0) for name, peaks in self._phases.items()}

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
