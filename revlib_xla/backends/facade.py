"""The function facade over the device backends: functions that find the backend of a device (or tensor) in the
registry and ask it. Each is importable from :mod:`revlib_xla.backends` (``backends.sync(device)``).

Everything device-specific that the features need goes through these functions or through ``backend_for(x)``:
whether a device traces lazily and needs a step cut, how to capture and replay its random-number state and its
autocast state, how to stop a compiler from merging a recomputation with the forward (optimization barriers), how to
keep a tensor in host memory, what its allocator reports. Features never branch on device kinds themselves.

torch_xla is optional: it is imported lazily, only when an XLA tensor or device is seen or asked for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _tree
from . import registry as _registry
from .base import DeviceCopier, HostCopy, HostOffload, Transfer, kernels_forced_reference
from .registry import DeviceLike, as_device, backend_for
from .state import AutocastState, DeviceSeed, RngState, autocast_cache_off, autocast_off
from .tracing import execution_forbidden
from .xla import host_annotations, host_placement_executes, runtime_type, xla_available

__all__ = [
    "host_memory_available",
    "DeviceLike",
    "as_device",
    "backend_for",
    "device_kind",
    "xla_available",
    "cuda_available",
    "device_available",
    "available_kinds",
    "default_device",
    "default_device_type",
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
    "autocast_cache_off",
    "autocast_off",
    "optimization_barrier",
    "after",
    "sync",
    "holds_data",
    "is_tracing_lazily",
    "value_ready",
    "is_host_memory",
    "checkpoint",
    "lazy_stablehlo",
    "zero_copy_device_tensor",
    "program_arguments",
    "data_identity",
    "execution_forbidden",
    "tensors_in",
    "pin_host_tensor_",
    "Transfer",
    "DeviceCopier",
    "device_copier",
    "to_host_blocking",
    "cut_graph",
    "host_placement_executes",
    "place_on_host",
    "place_on_device",
    "kernel_platform",
    "xla_runtime_type",
    "tpu_generation",
    "sizing_generation",
    "device_name",
    "free_memory",
    "compilations",
    "scan_loop",
    "HostCopy",
    "HostOffload",
    "to_host",
    "prefetch_to_device",
    "to_device",
    "host_annotations",
]

xla_runtime_type = runtime_type


def device_kind(device: DeviceLike) -> str:
    """The device's family: ``torch.device.type`` (``'cpu'``, ``'cuda'``, ``'xla'``, ...). For display and for
    naming a device; features ask :func:`backend_for` what a device can do instead of comparing this."""
    return as_device(device).type


def cuda_available() -> bool:
    """Whether this machine has a CUDA GPU."""
    return backend_for("cuda").available(torch.device("cuda"))


def device_available(device: DeviceLike) -> bool:
    """Whether this machine has ``device``: the CPU always; cuda when a GPU (with that index) is present; xla when
    torch_xla imports; tpu when TorchTPU is torch's current accelerator; an unregistered family when its
    ``torch.<kind>.is_available()`` says so."""
    dev = as_device(device)
    found = _registry.registered().get(dev.type)
    if found is not None:
        return found.available(dev)
    is_available = getattr(getattr(torch, dev.type, None), "is_available", None)
    return bool(is_available()) if callable(is_available) else False


def available_kinds() -> list[str]:
    """Device families with data present on this machine, in the order tests run them (cpu, xla, cuda, tpu)."""
    return [kind for kind, found in _registry.registered().items() if found.holds_data and _present(kind)]


def _present(kind: str) -> bool:
    try:
        dev = torch.device(kind)
    except RuntimeError:  # a family torch has not registered in this process (TorchTPU without a TPU)
        return False
    return backend_for(dev).available(dev)


def device_for(kind: str) -> torch.device:
    """A concrete device of the given kind (the default XLA device for ``'xla'``)."""
    dev = torch.device(kind)
    return backend_for(dev).concrete(dev)


def default_device() -> torch.device:
    """Where a user's run goes by default: a TPU if torch_xla (or TorchTPU) finds one, else a GPU, else the CPU."""
    families = sorted(_registry.registered().values(), key=lambda b: -b.preference)
    for found in families:
        dev = found.hardware_device()
        if dev is not None:
            return dev
    return torch.device("cpu")


def default_device_type() -> str:
    """The type of :func:`default_device`, found without starting that family's runtime (so that it can still be
    switched to SPMD, :mod:`revlib_xla.sharding`)."""
    families = sorted(_registry.registered().values(), key=lambda b: -b.preference)
    return next((found.device_type for found in families if found.hardware_present()), "cpu")


def sync(device: DeviceLike = None) -> None:
    """End a step: on XLA, cut the lazy graph and run it (``torch_xla.sync()``); on a GPU, wait for its stream.
    With no device, every family in use."""
    if device is not None:
        dev = as_device(device)
        backend_for(dev).synchronize(dev)
        return
    for found in _registry.registered().values():
        found.synchronize(None)


def holds_data(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values exist to be read: not for a fake tensor (``FakeTensorMode``, tracing) or a
    meta tensor."""
    if not backend_for(tensor).holds_data:
        return False
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - very old torch
        return True
    return not is_fake(tensor)


def is_tracing_lazily(tensor: torch.Tensor) -> bool:
    """True for lazy (XLA) tensors, whose memory is decided by the compiled graph rather than by Python lifetimes
    (and which have no addressable storage)."""
    return backend_for(tensor).lazy


def value_ready(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s value can be read without running pending work first (see
    :meth:`~revlib_xla.backends.base.Backend.value_ready`): on XLA, only after the step cut that computed it."""
    return backend_for(tensor).value_ready(tensor)


def is_host_memory(device: DeviceLike) -> bool:
    """Whether ``device``'s memory is the host's (the CPU): a tensor there is already offloaded. ``False`` for a
    family no backend is registered for."""
    found = _registry.registered().get(as_device(device).type)
    return found is not None and found.memory_is_host


def optimization_barrier(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` behind an optimization barrier: the compiler may not move work across it or merge it with
    identical work before it. Out of place: use the tensors returned (torch_xla's in-place barrier returns the same
    objects; TorchTPU's returns new ones).

    On XLA, a recomputation in the backward pass computes exactly what the forward computed; without a barrier,
    XLA's common-subexpression elimination merges the two and keeps the forward's activations alive, which undoes
    the memory saving (and can use more memory than no saving at all). Eager devices execute op by op, so there is
    nothing to protect and the tensors come back as they are.
    """
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    if first is None:
        return list(tensors)
    return backend_for(first).optimization_barrier(tensors)


def after(x: Any, token: torch.Tensor | None) -> Any:
    """``x`` (tensors nested in containers) made to depend on ``token`` as data, on XLA: each XLA tensor ``t``
    becomes ``t + 0 * sum(token)`` (exactly ``t`` for a finite token; the compiler does not fold ``0 * y`` in
    floating point). On eager devices, ``x`` itself.

    Why: the TPU compiler drops optimization barriers after scheduling, and then rewrites the instructions that
    read a barrier's output of a program *argument* to read the argument itself; the rewritten instructions are put
    back in the schedule as early as their operands allow, i.e. at the start of the program. A recomputation from
    the model's input (an argument of the step) then runs at the start and its result is held until the backward
    needs it. Reading the input through a value computed from the incoming gradient keeps the recomputation where
    the schedule put it. A non-finite gradient makes the recomputed values NaN: the step's gradients are
    non-finite either way, so a loss scaler still finds them and skips the step.
    """
    if token is None or not isinstance(token, torch.Tensor):
        return x
    return backend_for(token).after(x, token)


def checkpoint(function: Callable[..., Any], *args: Any, preserve_rng_state: bool = True) -> Any:
    """Activation checkpointing of ``function(*args)`` on the device its tensor arguments live on: keep only the
    inputs, recompute the rest in the backward pass.

    Eager devices use ``torch.utils.checkpoint`` (non-reentrant). XLA tensors use ``torch_xla.utils.checkpoint``:
    ``torch.utils.checkpoint`` crashes on them in torch 2.9, and torch_xla's version puts optimization barriers before
    the recomputation so the compiler cannot merge it back into the forward. That version is reentrant: parameters
    used by ``function`` get gradients only when one of ``args`` requires grad.
    """
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return backend_for(first).checkpoint(function, *args, preserve_rng_state=preserve_rng_state)


# ----------------------------------------------------------------------------------------------------------------
# Random numbers

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


def _real_tensors() -> contextlib.AbstractContextManager[Any]:
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - very old torch
        return contextlib.nullcontext()
    return unset_fake_temporarily()


def derive_seed(base: int, index: int) -> int:
    """A well-spread seed for item ``index`` of a sequence seeded with ``base``."""
    return (base + _GOLDEN * (index + 1)) % _SEED_RANGE


def manual_seed(device: DeviceLike, seed: int) -> None:
    """Seed the CPU generator and that of ``device`` (cuda, xla, ...) with ``seed``."""
    dev = as_device(device)
    torch.default_generator.manual_seed(seed)
    backend_for(dev).manual_seed(dev, seed)


def takes_generators(device: DeviceLike) -> bool:
    """Whether random ops on ``device`` can be handed a generator object (``generator=``): cpu and cuda. On xla they
    draw from the device's seed inside the graph (:func:`manual_seed` sets it), and cannot."""
    return backend_for(device).takes_generators


def owned_generator(device: DeviceLike) -> torch.Generator | None:
    """A new generator for ``device`` that random ops on it can be handed, so that a computation draws from a
    stream it owns instead of the process-global one (see :mod:`revlib_xla.recompute`); ``None`` where
    :func:`takes_generators` says no."""
    dev = as_device(device)
    return backend_for(dev).new_generator(dev)


def default_generator(device: DeviceLike) -> torch.Generator | None:
    """The process-global generator that random ops on ``device`` draw from when handed none (cpu, cuda), else
    ``None``."""
    dev = as_device(device)
    return backend_for(dev).default_generator(dev)


# ----------------------------------------------------------------------------------------------------------------
# Containers and programs


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested containers (see :mod:`revlib_xla._tree`)."""
    return _tree.tensor_leaves(obj)


def zero_copy_device_tensor(host_tensor: torch.Tensor, device: DeviceLike) -> torch.Tensor:
    """A tensor on ``device`` over ``host_tensor``'s memory, nothing copied (see
    :meth:`~revlib_xla.backends.base.Backend.zero_copy_device_tensor`): give a model traced for sizing real
    storage without allocating it."""
    dev = as_device(device)
    return backend_for(dev).zero_copy_device_tensor(host_tensor, dev)


def program_arguments(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The :func:`data_identity` of each argument of the pending program computing ``tensors``, in order."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("program_arguments needs at least one tensor")
    return backend_for(tensors[0]).program_arguments(tensors)


def data_identity(tensor: torch.Tensor) -> int:
    """For a lazy tensor holding plain device data: the number its data carries as a program argument
    (:func:`program_arguments`)."""
    return backend_for(tensor).data_identity(tensor)


def lazy_stablehlo(tensors: Sequence[torch.Tensor]) -> str:
    """The StableHLO text of the pending XLA graph that computes ``tensors`` (nothing is compiled or run).

    Call it before the step is synced: after ``torch_xla.sync()`` the tensors are plain device data and the graph is
    gone. Tensors already on the device when the step began (parameters, inputs) appear as graph arguments.
    """
    tensors = list(tensors)
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    found = backend_for(first) if first is not None else None
    if found is None or not found.program_text_available:
        raise ValueError("lazy_stablehlo needs XLA tensors (and only XLA tensors)")
    return found.program_text(tensors)


# ----------------------------------------------------------------------------------------------------------------
# Host <-> device transfers (parameter offload). On cuda a copy runs on a side stream into pinned host memory's
# counterpart on the device and is ordered against the compute stream by events; elsewhere a copy is synchronous
# (cpu), or a host-to-device upload that becomes graph data (xla), so there is nothing to order.


def pin_host_tensor_(tensor: torch.Tensor, target: DeviceLike) -> None:
    """Move ``tensor``'s data (a parameter or buffer on the cpu) to page-locked memory when copies from it to
    ``target`` can then run asynchronously (cuda). In place (the Python object, and so an optimizer's reference to
    it, is kept); does nothing for other targets or when the data is already pinned."""
    backend_for(target).pin_for_copies(tensor)


def device_copier(device: DeviceLike) -> DeviceCopier:
    """A :class:`DeviceCopier` for ``device``: asynchronous side-stream copies on cuda, synchronous elsewhere."""
    dev = as_device(device)
    return backend_for(dev).device_copier(dev)


def to_host_blocking(tensor: torch.Tensor, host: DeviceLike) -> torch.Tensor:
    """Bring a device tensor (a gradient) to ``host``. Blocking: the result is complete when this returns (on xla
    this executes the pending graph up to ``tensor``)."""
    return tensor.to(as_device(host))


def cut_graph(device: DeviceLike) -> None:
    """End the pending lazy graph here and run it (xla); a no-op on eager devices.

    Used between layers when parameters are streamed to an XLA device: each layer then runs as its own graph, whose
    structure is the same for every layer of the same shape (compiled once, reused), and the layer's uploaded
    parameters are released once that graph has run instead of staying referenced by one graph over all layers.
    """
    dev = as_device(device)
    backend_for(dev).cut_step(dev)


def place_on_host(tensor: torch.Tensor, annotate: bool | None = None) -> torch.Tensor:
    """XLA: ``tensor`` annotated to live in pinned host memory inside the graph (``place_to_host``), e.g. an
    activation saved for the backward. Other devices, and XLA where the annotation cannot execute (PJRT CPU), get
    ``tensor`` unchanged unless ``annotate=True`` (to inspect the HLO or compile it for TPU without running it)."""
    return backend_for(tensor).place_on_host(tensor, annotate)


def place_on_device(tensor: torch.Tensor, annotate: bool | None = None) -> torch.Tensor:
    """The counterpart of :func:`place_on_host` (``place_to_device``): bring an annotated tensor back to HBM."""
    return backend_for(tensor).place_on_device(tensor, annotate)


def kernel_platform(tensor: torch.Tensor) -> str:
    """Which hand-written kernels serve this tensor: ``'triton'`` (cuda, triton installed), ``'pallas'`` (xla on a
    TPU) or ``'reference'`` (everything else: cpu, xla on the CPU). ``REVLIB_XLA_KERNELS=reference`` forces the
    pure-PyTorch reference everywhere."""
    if kernels_forced_reference():
        return "reference"
    return backend_for(tensor).kernel_platform(tensor)


def tpu_generation(device: DeviceLike) -> str | None:
    """The TPU generation (``'v5e'``, ``'v6e'``, ``'v5p'``) of the chip ``device`` is, as its runtime describes it;
    ``None`` when it is not a TPU (torch_xla on a GPU or the CPU included) or the runtime does not say."""
    dev = as_device(device)
    return backend_for(dev).tpu_generation(dev)


def sizing_generation(device: DeviceLike, requested: str | None) -> str | None:
    """The TPU generation whose deviceless compile sizes the programs of a step traced on ``device``: on a TPU its
    own, on PJRT CPU (tracing for a TPU) ``requested``, elsewhere ``None`` (do not size with the TPU compiler:
    an eager device is measured, and a torch_xla GPU's programs are not a TPU's)."""
    dev = as_device(device)
    return backend_for(dev).sizing_generation(dev, requested)


def device_name(device: DeviceLike) -> tuple[str, int] | None:
    """``(product name, total memory in bytes)`` of the accelerator ``device`` (a GPU), or ``None`` where its
    backend does not say."""
    dev = as_device(device)
    return backend_for(dev).device_name(dev)


def host_memory_available() -> int | None:
    """Bytes of host memory available to a new allocation now (Linux: ``MemAvailable`` of /proc/meminfo; else the
    free physical pages), or ``None`` where the system does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def free_memory(device: DeviceLike) -> int | None:
    """Bytes ``device`` has free now (cuda: ``mem_get_info``), or ``None`` where its backend cannot tell."""
    dev = as_device(device)
    return backend_for(dev).free_memory(dev)


def compilations(device: DeviceLike) -> int | None:
    """How many programs ``device``'s family has compiled in this process so far (XLA: torch_xla's
    ``CompileTime`` count), or ``None`` on an eager device. A step that compiles once keeps it constant."""
    return backend_for(as_device(device)).compilations()


def scan_loop(device: DeviceLike) -> Callable[..., Any] | None:
    """The compiled loop of ``device``'s family (see :meth:`Backend.scan_loop`), or ``None`` on an eager device."""
    return backend_for(as_device(device)).scan_loop()


# ---------------------------------------------------------------------------------------------------------------
# Keeping tensors in host memory between the forward and the backward pass (activation offload).


def to_host(tensor: torch.Tensor) -> HostCopy:
    """Start keeping ``tensor`` in host memory (see :class:`HostCopy` and :class:`HostOffload`): cpu, the tensor
    itself; cuda, a pinned host buffer filled on a side stream; xla, the tensor annotated for host memory."""
    return backend_for(tensor).to_host(tensor)


def prefetch_to_device(copy: HostCopy) -> None:
    """Start moving a :class:`HostCopy` back to its device, if that is asynchronous there (cuda); else nothing."""
    backend_for(copy.device).prefetch_to_device(copy)


def to_device(copy: HostCopy) -> torch.Tensor:
    """The tensor of a :class:`HostCopy`, back on its device and usable on the current stream."""
    return backend_for(copy.device).to_device(copy)
