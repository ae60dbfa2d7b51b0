"""The one module that knows about devices.

Everything device-specific that the features need goes through here: which kind of device a tensor lives on
(``cpu``, ``cuda``, ``xla``), how to capture and replay its random-number state, how to capture and replay the
autocast state, how to stop XLA from merging a recomputation with the forward (optimization barriers), and how to
end a step (``torch_xla.sync()``). Features call these functions and never branch on devices themselves.

torch_xla is optional: it is imported lazily, only when an XLA tensor or device is seen or asked for.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

DeviceLike = str | torch.device | torch.Tensor | None

__all__ = [
    "DeviceLike",
    "device_kind",
    "xla_available",
    "cuda_available",
    "device_available",
    "available_kinds",
    "default_device",
    "device_for",
    "RngState",
    "draw_seed",
    "derive_seed",
    "manual_seed",
    "takes_generators",
    "owned_generator",
    "default_generator",
    "DeviceSeed",
    "AutocastState",
    "optimization_barrier_",
    "sync",
    "holds_data",
    "is_tracing_lazily",
    "checkpoint",
    "pin_host_tensor_",
    "Transfer",
    "DeviceCopier",
    "to_host_blocking",
    "cut_graph",
    "host_placement_executes",
    "place_on_host",
    "place_on_device",
    "kernel_platform",
    "xla_runtime_type",
    "HostCopy",
    "to_host",
    "prefetch_to_device",
    "to_device",
    "host_annotations",
]


def _as_device(device: DeviceLike) -> torch.device:
    if isinstance(device, torch.Tensor):
        return device.device
    if device is None:
        return torch.device("cpu")
    return torch.device(device)


def device_kind(device: DeviceLike) -> str:
    """``'cpu'``, ``'cuda'``, ``'xla'`` or the raw ``torch.device.type`` for anything else."""
    return _as_device(device).type


@functools.cache
def xla_available() -> bool:
    """True when torch_xla is installed and imports (it needs torch 2.9.x)."""
    if importlib.util.find_spec("torch_xla") is None:
        return False
    try:
        _xla()
    except Exception:  # a torch_xla built for another torch raises on import
        return False
    return True


def cuda_available() -> bool:
    return torch.cuda.is_available()


def device_available(device: DeviceLike) -> bool:
    """Whether this machine has ``device``: the CPU always; cuda when a GPU (with that index) is present; xla when
    torch_xla imports; other kinds when their ``torch.<kind>.is_available()`` says so."""
    dev = _as_device(device)
    if dev.type in ("cpu", "meta"):
        return True
    if dev.type == "cuda":
        return cuda_available() and (dev.index is None or dev.index < torch.cuda.device_count())
    if dev.type == "xla":
        return xla_available()
    is_available = getattr(getattr(torch, dev.type, None), "is_available", None)
    return bool(is_available()) if callable(is_available) else False


def _xla():
    os.environ.setdefault("PJRT_DEVICE", "CPU" if not os.environ.get("TPU_NAME") else "TPU")
    import torch_xla  # noqa: F401
    import torch_xla.core.xla_model as xm

    return xm


def available_kinds() -> list[str]:
    """Device kinds present on this machine, in the order tests run them."""
    kinds = ["cpu"]
    if xla_available():
        kinds.append("xla")
    if cuda_available():
        kinds.append("cuda")
    return kinds


def device_for(kind: str) -> torch.device:
    """A concrete device of the given kind (the default XLA device for ``'xla'``)."""
    if kind == "xla":
        _xla()
        import torch_xla

        return torch_xla.device()
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def default_device() -> torch.device:
    """Where a user's run goes by default: a TPU if torch_xla finds one, else a GPU, else the CPU."""
    if xla_available():
        import torch_xla.runtime as xr

        if xr.device_type() not in (None, "CPU"):
            return device_for("xla")
    if cuda_available():
        return device_for("cuda")
    return torch.device("cpu")


def sync(device: DeviceLike = None) -> None:
    """End a step: on XLA, cut the lazy graph and run it (``torch_xla.sync()``); on cuda, synchronize the stream."""
    kind = device_kind(device) if device is not None else None
    if kind in (None, "xla") and xla_available() and (kind == "xla" or "torch_xla" in _loaded_modules()):
        import torch_xla

        torch_xla.sync()
    if kind in (None, "cuda") and cuda_available():
        torch.cuda.synchronize()


def _loaded_modules():
    import sys

    return sys.modules


def holds_data(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values exist to be read: not for a fake tensor (``FakeTensorMode``, tracing) or a
    meta tensor."""
    if tensor.device.type == "meta":
        return False
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - very old torch
        return True
    return not is_fake(tensor)


def is_tracing_lazily(tensor: torch.Tensor) -> bool:
    """True for lazy (XLA) tensors, whose memory is decided by the compiled graph rather than by Python lifetimes."""
    return device_kind(tensor) == "xla"


def optimization_barrier_(tensors: Sequence[torch.Tensor]) -> None:
    """Stop the compiler from moving work across this point or merging it with identical work before it.

    On XLA, a recomputation in the backward pass computes exactly what the forward computed; without a barrier,
    XLA's common-subexpression elimination merges the two and keeps the forward's activations alive, which undoes
    the memory saving (and can use more memory than no saving at all). Eager devices execute op by op, so there is
    nothing to protect and this is a no-op.
    """
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    if first is None or first.device.type != "xla":
        return  # called once per layer: an eager step (all its tensors on one eager device) leaves at once
    xla_tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "xla"]
    if xla_tensors:
        _xla().optimization_barrier_(xla_tensors)


def after(x: Any, token: torch.Tensor | None) -> Any:
    """``x`` (a tensor, or tensors nested in lists and tuples) made to depend on ``token`` as data, on XLA: each XLA
    tensor ``t`` becomes ``t + 0 * sum(token)`` (exactly ``t`` for a finite token; the compiler does not fold
    ``0 * y`` in floating point). On eager devices, ``x`` itself.

    Why: the TPU compiler drops optimization barriers after scheduling, and then rewrites the instructions that
    read a barrier's output of a program *argument* to read the argument itself; the rewritten instructions are put
    back in the schedule as early as their operands allow, i.e. at the start of the program. A recomputation from
    the model's input (an argument of the step) then runs at the start and its result is held until the backward
    needs it. Reading the input through a value computed from the incoming gradient keeps the recomputation where
    the schedule put it. A non-finite gradient makes the recomputed values NaN: the step's gradients are
    non-finite either way, so a loss scaler still finds them and skips the step.
    """
    if token is None or not isinstance(token, torch.Tensor) or token.device.type != "xla":
        return x
    zero = token.detach().sum() * 0
    if isinstance(x, torch.Tensor):
        return x + zero.to(x.dtype) if x.device.type == "xla" else x
    if isinstance(x, (list, tuple)):
        return type(x)(after(item, token) for item in x)
    return x


def checkpoint(function, *args: Any, preserve_rng_state: bool = True) -> Any:
    """Activation checkpointing of ``function(*args)`` on the device its tensor arguments live on: keep only the
    inputs, recompute the rest in the backward pass.

    Eager devices use ``torch.utils.checkpoint`` (non-reentrant). XLA tensors use ``torch_xla.utils.checkpoint``:
    ``torch.utils.checkpoint`` crashes on them in torch 2.9, and torch_xla's version puts optimization barriers before
    the recomputation so the compiler cannot merge it back into the forward. That version is reentrant: parameters
    used by ``function`` get gradients only when one of ``args`` requires grad.
    """
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if tensors and device_kind(tensors[0]) == "xla":
        _xla()
        from torch_xla.utils.checkpoint import checkpoint as xla_checkpoint

        return xla_checkpoint(function, *args, use_reentrant=True, preserve_rng_state=preserve_rng_state)
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    return torch_checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)


@dataclasses.dataclass
class RngState:
    """The random-number state of one device (and of the CPU generator), to put back later."""

    device: torch.device
    cpu: torch.Tensor | None
    accel: Any

    @classmethod
    def capture(cls, device: DeviceLike) -> RngState:
        dev = _as_device(device)
        accel = None
        if dev.type == "cuda":
            accel = torch.cuda.get_rng_state(dev)
        elif dev.type == "xla":
            accel = _xla().get_rng_state(str(dev))
        return cls(dev, torch.get_rng_state(), accel)

    def restore(self) -> None:
        if self.cpu is not None:
            torch.set_rng_state(self.cpu)
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(self.accel, self.device)
        elif self.device.type == "xla":
            _xla().set_rng_state(self.accel, str(self.device))


_SEED_RANGE = 2**62
_GOLDEN = 0x9E3779B97F4A7C15


def draw_seed() -> int:
    """One fresh seed from the CPU generator (host-only: no device sync). Advances the global random state, so
    consecutive steps get different seeds, and ``torch.manual_seed`` makes the sequence reproducible.

    Drawn outside any ``FakeTensorMode``: a fake step (sizing a model with :func:`revlib_xla.memory.eager_peak`)
    still needs a real integer.
    """
    with _real_tensors():
        return int(torch.randint(0, _SEED_RANGE, (1,), device="cpu").item())


def _real_tensors():
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - very old torch
        return contextlib.nullcontext()
    return unset_fake_temporarily()


def derive_seed(base: int, index: int) -> int:
    """A well-spread seed for item ``index`` of a sequence seeded with ``base``."""
    return (base + _GOLDEN * (index + 1)) % _SEED_RANGE


def manual_seed(device: DeviceLike, seed: int) -> None:
    """Seed the CPU generator and that of ``device`` (cuda or xla) with ``seed``."""
    dev = _as_device(device)
    torch.default_generator.manual_seed(seed)
    if dev.type == "cuda":
        torch.cuda.default_generators[dev.index if dev.index is not None else torch.cuda.current_device()].manual_seed(
            seed
        )
    elif dev.type == "xla":
        _xla().set_rng_state(seed, str(dev))


def takes_generators(device: DeviceLike) -> bool:
    """Whether random ops on ``device`` can be handed a generator object (``generator=``): cpu and cuda. On xla they
    draw from the device's seed inside the graph (:func:`manual_seed` sets it), and cannot."""
    return device_kind(device) in ("cpu", "cuda")


def owned_generator(device: DeviceLike) -> torch.Generator | None:
    """A new generator for ``device`` that random ops on it can be handed, so that a computation draws from a
    stream it owns instead of the process-global one (see :mod:`revlib_xla.recompute`); ``None`` where
    :func:`takes_generators` says no."""
    return torch.Generator(device=_as_device(device)) if takes_generators(device) else None


def default_generator(device: DeviceLike) -> torch.Generator | None:
    """The process-global generator that random ops on ``device`` draw from when handed none (cpu, cuda), else
    ``None``."""
    dev = _as_device(device)
    if dev.type == "cpu":
        return torch.default_generator
    if dev.type == "cuda":
        return torch.cuda.default_generators[dev.index if dev.index is not None else torch.cuda.current_device()]
    return None


@dataclasses.dataclass
class DeviceSeed:
    """The random state of a device whose random ops cannot be handed a generator (xla: one seed per device, which
    reaches the graph as data), kept while a computation seeds the device per unit, and put back by
    :meth:`restore`. That state is process-global: two threads seeding one such device race."""

    device: torch.device
    state: Any

    @classmethod
    def capture(cls, device: DeviceLike) -> DeviceSeed | None:
        """The device's state, or ``None`` for a device whose random ops can be handed a generator."""
        dev = _as_device(device)
        if dev.type != "xla":
            return None
        return cls(dev, _xla().get_rng_state(str(dev)))

    def seed(self, seed: int) -> None:
        _xla().set_rng_state(seed, str(self.device))

    def restore(self) -> None:
        _xla().set_rng_state(self.state, str(self.device))


@dataclasses.dataclass(frozen=True)
class AutocastState:
    """Whether autocast was on, and with which dtype, for one device type (and for the CPU) at forward time."""

    device_type: str
    enabled: bool
    dtype: torch.dtype | None
    cpu_enabled: bool
    cpu_dtype: torch.dtype | None
    cache_enabled: bool

    @classmethod
    def capture(cls, device: DeviceLike) -> AutocastState:
        kind = device_kind(device)
        enabled, dtype = _autocast_of(kind)
        cpu_enabled, cpu_dtype = _autocast_of("cpu")
        return cls(kind, enabled, dtype, cpu_enabled, cpu_dtype, torch.is_autocast_cache_enabled())

    def differs_from_now(self) -> bool:
        """Whether :meth:`replay` has anything to do: autocast was on at capture, or is on now."""
        return bool(self.enabled or self.cpu_enabled or _autocast_of(self.device_type)[0] or _autocast_of("cpu")[0])

    @contextlib.contextmanager
    def replay(self, cache_enabled: bool | None = False) -> Iterator[None]:
        """Enter exactly this autocast state (switching autocast off if it was off at forward time).

        The weight-cast cache is off by default: casts made under ``no_grad`` in a forward would otherwise be cached
        without their autograd history and reused by the recomputation, and the parameters would get no gradient.
        """
        if not self.differs_from_now():
            yield  # off then and off now: nothing to enter (and no weight-cast cache to worry about)
            return
        cache = self.cache_enabled if cache_enabled is None else cache_enabled
        with contextlib.ExitStack() as stack:
            if self.device_type != "cpu" and _autocast_supported(self.device_type):
                stack.enter_context(
                    torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled, cache_enabled=cache)
                )
            stack.enter_context(
                torch.autocast("cpu", dtype=self.cpu_dtype, enabled=self.cpu_enabled, cache_enabled=cache)
            )
            yield


def _autocast_supported(kind: str) -> bool:
    return kind in ("cuda", "xla", "cpu")


def _autocast_of(kind: str):
    if not _autocast_supported(kind):
        return False, None
    return torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


def tensors_in(obj: Any) -> Iterable[torch.Tensor]:
    """Every tensor inside nested lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)


def lazy_stablehlo(tensors: Sequence[torch.Tensor]) -> str:
    """The StableHLO text of the pending XLA graph that computes ``tensors`` (nothing is compiled or run).

    Call it before the step is synced: after ``torch_xla.sync()`` the tensors are plain device data and the graph is
    gone. Tensors already on the device when the step began (parameters, inputs) appear as graph arguments.
    """
    tensors = list(tensors)
    xla_tensors = [t for t in tensors if isinstance(t, torch.Tensor) and device_kind(t) == "xla"]
    if not xla_tensors or len(xla_tensors) != len(tensors):
        raise ValueError("lazy_stablehlo needs XLA tensors (and only XLA tensors)")
    return _xla().get_stablehlo(xla_tensors)


# ----------------------------------------------------------------------------------------------------------------
# Host <-> device transfers (parameter offload). On cuda a copy runs on a side stream into pinned host memory's
# counterpart on the device and is ordered against the compute stream by events; elsewhere a copy is synchronous
# (cpu), or a host-to-device upload that becomes graph data (xla), so there is nothing to order.


def pin_host_tensor_(tensor: torch.Tensor, target: DeviceLike) -> None:
    """Move ``tensor``'s data (a parameter or buffer on the cpu) to page-locked memory when ``target`` is a cuda
    device, so copies to it can run asynchronously. In place (the Python object, and so an optimizer's reference to
    it, is kept); does nothing for other targets or when the data is already pinned."""
    if device_kind(target) != "cuda" or tensor.device.type != "cpu" or tensor.is_pinned():
        return
    tensor.data = tensor.data.pin_memory()


class Transfer:
    """A started host-to-device copy: ``tensors`` may be used on the compute stream after :meth:`DeviceCopier.wait`."""

    def __init__(self, tensors: list[torch.Tensor], event: Any = None):
        self.tensors = tensors
        self.event = event


class DeviceCopier:
    """Copies host tensors to ``device`` ahead of their use, and says when the compute stream is done with a copy.

    cuda: copies run on a side stream (``non_blocking`` from pinned memory) and end with an event; :meth:`wait`
    makes the current (compute) stream wait for that event, and :meth:`done_with` records an event on the compute
    stream after the last use of a destination, which the next copy into the same destination waits for. That is
    what makes reusing persistent device buffers safe. Other devices copy synchronously (xla: a transfer to the
    device whose result is graph data, not a constant), so both calls are no-ops there.
    """

    def __init__(self, device: DeviceLike):
        self.device = _as_device(device)
        self.asynchronous = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self.asynchronous else None

    def start(
        self, host: Sequence[torch.Tensor], into: Sequence[torch.Tensor] | None = None, after: Any = None
    ) -> Transfer:
        """Start copying ``host`` to the device, into the tensors ``into`` when given (persistent buffers), after
        the event ``after`` (the compute stream's last use of ``into``) when given."""
        if not self.asynchronous:
            return Transfer([h.detach().to(self.device, copy=True) for h in host])
        with torch.cuda.stream(self._stream):
            if after is not None:
                self._stream.wait_event(after)
            if into is None:
                out = [h.detach().to(self.device, non_blocking=True, copy=True) for h in host]
            else:
                out = list(into)
                for dst, src in zip(out, host):
                    dst.copy_(src.detach(), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        if into is None:  # allocated on the side stream, used on the compute stream
            for t in out:
                t.record_stream(torch.cuda.current_stream(self.device))
        return Transfer(out, event)

    def wait(self, transfer: Transfer, host_too: bool = False) -> list[torch.Tensor]:
        """The copied tensors, once the compute stream may read them. ``host_too``: also block the host until the
        copy is done, so the host tensors it reads from may be changed (an optimizer step) right after."""
        if transfer.event is not None:
            torch.cuda.current_stream(self.device).wait_event(transfer.event)
            if host_too:
                transfer.event.synchronize()
            transfer.event = None
        return transfer.tensors

    def done_with(self) -> Any:
        """An event marking the compute stream's progress now (``None`` where copies are synchronous)."""
        if not self.asynchronous:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


def to_host_blocking(tensor: torch.Tensor, host: DeviceLike) -> torch.Tensor:
    """Bring a device tensor (a gradient) to ``host``. Blocking: the result is complete when this returns (on xla
    this executes the pending graph up to ``tensor``)."""
    return tensor.to(_as_device(host))


def cut_graph(device: DeviceLike) -> None:
    """End the pending lazy graph here and run it (xla); a no-op on eager devices.

    Used between layers when parameters are streamed to an XLA device: each layer then runs as its own graph, whose
    structure is the same for every layer of the same shape (compiled once, reused), and the layer's uploaded
    parameters are released once that graph has run instead of staying referenced by one graph over all layers.
    """
    if device_kind(device) == "xla":
        import torch_xla

        torch_xla.sync()


def host_placement_executes() -> bool:
    """Whether XLA graphs with host-memory placement annotations can run here: on TPU (and GPU) PJRT, not on PJRT
    CPU, whose runtime has no handler for them (the graph compiles, and fails when executed)."""
    return xla_runtime_type() not in (None, "CPU")


def place_on_host(tensor: torch.Tensor, annotate: bool | None = None) -> torch.Tensor:
    """XLA: ``tensor`` annotated to live in pinned host memory inside the graph (``place_to_host``), e.g. an
    activation saved for the backward. Other devices, and XLA where the annotation cannot execute (PJRT CPU), get
    ``tensor`` unchanged unless ``annotate=True`` (to inspect the HLO or compile it for TPU without running it)."""
    if device_kind(tensor) != "xla" or not (_annotate_on_xla() if annotate is None else annotate):
        return tensor
    from torch_xla.experimental.stablehlo_custom_call import place_to_host

    return place_to_host(tensor)


def place_on_device(tensor: torch.Tensor, annotate: bool | None = None) -> torch.Tensor:
    """The counterpart of :func:`place_on_host` (``place_to_device``): bring an annotated tensor back to HBM."""
    if device_kind(tensor) != "xla" or not (_annotate_on_xla() if annotate is None else annotate):
        return tensor
    from torch_xla.experimental.stablehlo_custom_call import place_to_device

    return place_to_device(tensor)


def xla_runtime_type() -> str | None:
    """The PJRT device type torch_xla runs on (``'TPU'``, ``'CPU'``, ...), or None without torch_xla."""
    if not xla_available():
        return None
    import torch_xla.runtime as xr

    return xr.device_type()


def kernel_platform(tensor: torch.Tensor) -> str:
    """Which hand-written kernels serve this tensor: ``'triton'`` (cuda, triton installed), ``'pallas'`` (xla on a
    TPU) or ``'reference'`` (everything else: cpu, xla on the CPU). ``REVLIB_XLA_KERNELS=reference`` forces the
    pure-PyTorch reference everywhere."""
    if os.environ.get("REVLIB_XLA_KERNELS", "auto") == "reference":
        return "reference"
    kind = device_kind(tensor)
    if kind == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    if kind == "xla" and xla_runtime_type() == "TPU":
        return "pallas"
    return "reference"


# ---------------------------------------------------------------------------------------------------------------
# Keeping tensors in host memory between the forward and the backward pass (activation offload).

_FORCE_HOST_ANNOTATIONS: list[bool | None] = [None]


@contextlib.contextmanager
def host_annotations(enabled: bool = True) -> Iterator[None]:
    """Within the block, XLA offloads emit ``place_to_host``/``place_to_device`` annotations even on a runtime that
    cannot execute them (PJRT CPU), so that the HLO can be inspected or compiled for a TPU without running it."""
    _FORCE_HOST_ANNOTATIONS.append(enabled)
    try:
        yield
    finally:
        _FORCE_HOST_ANNOTATIONS.pop()


def _annotate_on_xla() -> bool:
    forced = _FORCE_HOST_ANNOTATIONS[-1]
    if forced is not None:
        return forced
    return host_placement_executes()


class HostCopy:
    """A tensor kept in host memory for later use on ``device``: ``to_host`` makes one, ``to_device`` ends it.

    cpu: the tensor itself. cuda: a pinned host buffer filled by an asynchronous copy on a side stream (the
    device tensor's memory is released for reuse once the copy is done: ``record_stream``); ``prefetch_to_device``
    starts the copy back on the side stream, ``to_device`` waits for it. xla: the tensor annotated for host
    memory (``place_to_host``), placed back with ``place_to_device``; the TPU compiler schedules both transfers.
    """

    __slots__ = ("__weakref__", "device", "event", "on_device", "ready", "tensor")

    def __init__(self, tensor: torch.Tensor, device: torch.device, event: Any = None) -> None:
        self.tensor, self.device, self.event = tensor, device, event
        self.on_device: torch.Tensor | None = None
        self.ready: Any = None


_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def to_host(tensor: torch.Tensor) -> HostCopy:
    """Start keeping ``tensor`` in host memory (see :class:`HostCopy`)."""
    kind = device_kind(tensor)
    if kind == "cuda":
        stream = _side_stream(tensor.device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            event = stream.record_event()
        tensor.record_stream(stream)
        return HostCopy(host, tensor.device, event)
    if kind == "xla":
        return HostCopy(place_on_host(tensor), tensor.device)
    return HostCopy(tensor, tensor.device)


def prefetch_to_device(copy: HostCopy) -> None:
    """Start moving a :class:`HostCopy` back to its device, if that is asynchronous there (cuda); else nothing."""
    if copy.device.type != "cuda" or copy.on_device is not None:
        return
    stream = _side_stream(copy.device)
    with torch.cuda.stream(stream):
        stream.wait_event(copy.event)
        copy.on_device = copy.tensor.to(copy.device, non_blocking=True)
        copy.ready = stream.record_event()


def to_device(copy: HostCopy) -> torch.Tensor:
    """The tensor of a :class:`HostCopy`, back on its device and usable on the current stream."""
    if copy.device.type == "cuda":
        prefetch_to_device(copy)
        current = torch.cuda.current_stream(copy.device)
        current.wait_event(copy.ready)
        tensor, copy.on_device = copy.on_device, None
        tensor.record_stream(current)
        return tensor
    if copy.device.type == "xla":
        return place_on_device(copy.tensor)
    return copy.tensor
