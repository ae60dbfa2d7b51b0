"""The capability interface every device family implements (:class:`Backend`), and the defaults of an eager device.

Features never ask which device they run on; they ask a backend what it can do: whether it traces lazily and needs
a step cut, how host offload works there, whether a compiled program's text can be read, how its random numbers are
captured and restored, which autocast device type it uses, what its allocator reports, how an optimization barrier
is placed. A device family is one subclass of :class:`Backend` registered for its ``torch.device.type``
(:func:`revlib_xla.backends.register`).

The defaults here are those of an eager device that executes op by op and copies synchronously; a family overrides
what differs.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["Backend", "DeviceCopier", "HostCopy", "HostOffload", "Transfer", "generation_from_device_kind"]


class HostOffload(enum.Enum):
    """How a device keeps a tensor in host memory between the forward and the backward pass."""

    #: The device's memory is host memory: the tensor is kept as it is (cpu).
    ALREADY_HOST = "already host"
    #: An asynchronous copy into pinned host memory on a side stream, ordered by events (cuda).
    STREAM_COPY = "stream copy"
    #: An annotation in the traced graph places the tensor in host memory; the compiler schedules both transfers
    #: (xla: ``place_to_host``/``place_to_device``).
    MEMORY_SPACE_ANNOTATION = "memory-space annotation"
    #: A copy into pinned host memory that completes before it returns, and one back when asked (TorchTPU eager).
    BLOCKING_COPY = "blocking copy"


class HostCopy:
    """A tensor kept in host memory for later use on ``device`` (see :meth:`Backend.to_host`).

    ``tensor`` is what is kept (the tensor itself, a pinned host buffer, or an annotated graph value); ``event``
    marks the end of an asynchronous copy to the host; ``on_device`` and ``ready`` hold a copy back that was started
    ahead of its use (:meth:`Backend.prefetch_to_device`).
    """

    __slots__ = ("__weakref__", "device", "event", "on_device", "ready", "tensor")

    def __init__(self, tensor: torch.Tensor, device: torch.device, event: Any = None) -> None:
        self.tensor, self.device, self.event = tensor, device, event
        self.on_device: torch.Tensor | None = None
        self.ready: Any = None


class Transfer:
    """A started host-to-device copy: ``tensors`` may be used on the compute stream after :meth:`DeviceCopier.wait`."""

    def __init__(self, tensors: list[torch.Tensor], event: Any = None) -> None:
        self.tensors = tensors
        self.event = event


class DeviceCopier:
    """Copies host tensors to ``device`` ahead of their use, and says when the compute stream is done with a copy.

    This one copies synchronously (the copy is complete, or is graph data, when :meth:`start` returns), so
    :meth:`wait` and :meth:`done_with` have nothing to order. A family with asynchronous copies subclasses it.
    """

    asynchronous = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(
        self, host: Sequence[torch.Tensor], into: Sequence[torch.Tensor] | None = None, after: Any = None
    ) -> Transfer:
        """Start copying ``host`` to the device, into the tensors ``into`` when given (persistent buffers), after
        the event ``after`` (the compute stream's last use of ``into``) when given."""
        return Transfer([h.detach().to(self.device, copy=True) for h in host])

    def wait(self, transfer: Transfer, host_too: bool = False) -> list[torch.Tensor]:
        """The copied tensors, once the compute stream may read them. ``host_too``: also block the host until the
        copy is done, so the host tensors it reads from may be changed (an optimizer step) right after."""
        return transfer.tensors

    def done_with(self) -> Any:
        """An event marking the compute stream's progress now (``None`` where copies are synchronous)."""
        return None


_GENERATIONS = (  # (pattern over a lower-cased device kind or accelerator type, generation for sizing)
    (re.compile(r"v5 ?lite|v5e|v5litepod"), "v5e"),
    (re.compile(r"v6 ?lite|v6e"), "v6e"),
    (re.compile(r"v5p|v5$"), "v5p"),
)


def generation_from_device_kind(kind: str | None) -> str | None:
    """The TPU generation that :data:`revlib_xla.memory.TPU_GENERATIONS` sizes for, from a runtime's description of
    its chip (PJRT's device kind, e.g. ``'TPU v5 lite'``, or an accelerator type such as ``'v5litepod-8'``);
    ``None`` for a chip it has no topology for, or for no description."""
    text = (kind or "").strip().lower()
    if "tpu" not in text and not text.startswith("v"):
        return None
    text = text.removeprefix("tpu").strip().split("-")[0]
    return next((generation for pattern, generation in _GENERATIONS if pattern.search(text)), None)


class Backend:
    """What a device family can do, as the features ask it. Subclass it for a family and register an instance.

    Class attributes are the family's fixed capabilities; methods take the concrete ``torch.device`` (or tensors)
    they act on. The defaults describe an eager device without random-state or allocator statistics of its own.
    """

    #: The ``torch.device.type`` this backend serves.
    device_type: str = ""
    #: Operations are recorded into a graph that runs when the step is cut (:meth:`cut_step`); the compiler, not
    #: Python lifetimes, decides what lives when, and tensors have no addressable storage.
    lazy: bool = False
    #: How :meth:`to_host` keeps a tensor in host memory.
    host_offload: HostOffload = HostOffload.BLOCKING_COPY
    #: Whether :meth:`program_text` can return the text of the program that computes pending tensors.
    program_text_available: bool = False
    #: Whether random operators on the device take a ``generator=`` object (else they draw from a per-device seed
    #: inside the graph, which :meth:`manual_seed` sets).
    takes_generators: bool = True
    #: Whether tensors of the family hold values that can be read (not so for ``meta``).
    holds_data: bool = True
    #: The device type ``torch.autocast`` takes for the family, or ``None`` where autocast does not apply.
    autocast_device_type: str | None = None
    #: Whether the device's memory is host memory (nothing to offload; the profiler's memory events see it).
    memory_is_host: bool = False
    #: Whether :meth:`checkpoint` works inside a backward pass that names its inputs (``torch.autograd.grad``,
    #: ``backward(inputs=...)``, as the reversible core's per-layer backward does); a reentrant checkpoint refuses.
    checkpoint_in_partial_backward: bool = True
    #: What :meth:`max_memory_allocated` reads, as :class:`revlib_xla.memory.AllocatorPeak` names its source.
    statistics_source: str = "torch.accelerator.max_memory_allocated"
    #: Bytes the allocator rounds each allocation up to a multiple of (cuda's caching allocator: 512), as tensor
    #: storage counts (:class:`revlib_xla.memory.StorageTracker`) count them.
    allocation_granularity: int = 1
    #: Whether AdamW's step runs best as torch's fused kernel on the family (one kernel per weight, no temporaries;
    #: torch's own default there, ``foreach``, makes temporaries the size of every gradient): what
    #: ``optim.implementation=auto`` picks.
    fused_adamw: bool = False
    #: Order in which :func:`revlib_xla.backends.default_device` prefers families that have hardware here.
    preference: int = 0
    #: The ``torch.distributed`` backend that reduces the family's tensors across processes (``gloo`` on the host,
    #: ``nccl`` on CUDA), or ``None`` where the family does not train with several processes (XLA: one process
    #: drives every chip through SPMD).
    process_group_backend: str | None = None

    # -- presence --------------------------------------------------------------------------------------------
    def available(self, device: torch.device) -> bool:
        """Whether this machine has ``device``."""
        return False

    def concrete(self, device: torch.device) -> torch.device:
        """A concrete device for ``device`` (the index filled in where the family has a current device)."""
        return device

    def hardware_present(self) -> bool:
        """Whether :meth:`hardware_device` finds hardware, asked without starting the family's runtime (a runtime
        that drives several devices as one must be told so before it starts: :meth:`enable_spmd`)."""
        return self.hardware_device() is not None

    def hardware_device(self) -> torch.device | None:
        """The family's device when this machine has real hardware for it (a run should go there by default),
        else ``None``."""
        return None

    def process_device(self, device: torch.device, local_rank: int) -> torch.device:
        """The device the process of ``local_rank`` (its index among the processes on this machine) trains on,
        made current for it: one device per process where the family has several (CUDA), else ``device``."""
        return device

    # -- steps -----------------------------------------------------------------------------------------------
    def cut_step(self, device: torch.device) -> None:
        """End the pending lazy graph here and run it; nothing on an eager device."""

    def synchronize(self, device: torch.device | None) -> None:
        """End a step and wait for the device's queued work (``None``: every device of the family in use)."""

    # -- random numbers --------------------------------------------------------------------------------------
    def default_generator(self, device: torch.device) -> torch.Generator | None:
        """The process-global generator random operators on ``device`` draw from when handed none, or ``None``."""
        return None

    def new_generator(self, device: torch.device) -> torch.Generator | None:
        """A new generator random operators on ``device`` can be handed (``None`` where they take none)."""
        return torch.Generator(device=device) if self.takes_generators else None

    def get_rng_state(self, device: torch.device) -> Any:
        """The device's own global random state (``None`` where the CPU generator serves it)."""
        return None

    def set_rng_state(self, device: torch.device, state: Any) -> None:
        """Put back what :meth:`get_rng_state` returned."""

    def manual_seed(self, device: torch.device, seed: int) -> None:
        """Seed the device's own global random state (the CPU generator is seeded by the caller)."""

    # -- ordering and recomputation --------------------------------------------------------------------------
    def optimization_barrier(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` behind an optimization barrier: the compiler may not move work across it or merge what comes
        after with identical work before it. Out of place: use the returned tensors. An eager device executes op by
        op, so there is nothing to protect and the tensors come back unchanged."""
        return list(tensors)

    def after(self, value: Any, token: torch.Tensor) -> Any:
        """``value`` made to depend on ``token`` as data, where a compiler could otherwise hoist work reading it
        (see :func:`revlib_xla.backends.after`); ``value`` itself on an eager device."""
        return value

    def checkpoint(self, function: Callable[..., Any], *args: Any, preserve_rng_state: bool = True) -> Any:
        """Activation checkpointing of ``function(*args)``: ``torch.utils.checkpoint``, non-reentrant."""
        from torch.utils.checkpoint import checkpoint as torch_checkpoint

        return torch_checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)

    def program_text(self, tensors: Sequence[torch.Tensor]) -> str:
        """The text of the pending program computing ``tensors`` (see :attr:`program_text_available`)."""
        raise NotImplementedError(
            f"the {self.device_type!r} backend cannot show a compiled program's text; trace the step on an XLA "
            f"device (revlib_xla.memory.step_stablehlo) to read its StableHLO"
        )

    def value_ready(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s value can be read without running pending work first: always on an eager device
        (a GPU waits for its queue, nothing more); on a lazy one, only once a step cut has computed it (reading it
        earlier would run its graph, a device sync in the middle of a step)."""
        return True

    # -- tracing for sizing (revlib_xla.fit) ----------------------------------------------------------------
    def zero_copy_device_tensor(self, host_tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A tensor on ``device`` that uses ``host_tensor``'s memory, without copying it (for tracing a step at
        full size: the memory of a ``torch.empty`` host tensor is never touched). Where the device's memory is
        host memory, ``host_tensor`` itself; elsewhere this family cannot share host memory and raises."""
        if self.memory_is_host:
            return host_tensor
        raise NotImplementedError(
            f"the {self.device_type!r} backend cannot give host memory to a device tensor without copying; trace "
            f"for sizing on an XLA device (revlib_xla.fit.trace_step)"
        )

    def program_arguments(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        """The pending program computing ``tensors``: the :meth:`data_identity` of each of its arguments, in the
        order of the program's parameters (see :attr:`program_text_available`)."""
        raise NotImplementedError(f"the {self.device_type!r} backend traces no program with arguments")

    def data_identity(self, tensor: torch.Tensor) -> int:
        """For a tensor that holds plain device data (no pending computation): the number the program arguments
        made from that data carry in :meth:`program_arguments`."""
        raise NotImplementedError(f"the {self.device_type!r} backend traces no program with arguments")

    @contextlib.contextmanager
    def execution_forbidden(self) -> Iterator[None]:
        """Within the block, running the pending program raises instead of executing it (a step traced for sizing
        at full size must never run). An eager device runs every operation as it is called: nothing to forbid."""
        yield

    # -- memory ----------------------------------------------------------------------------------------------
    def allocator_statistics(self, device: torch.device) -> bool:
        """Whether :meth:`memory_allocated`, :meth:`max_memory_allocated` and :meth:`reset_peak_memory_stats` work:
        by default where ``torch.accelerator`` (torch >= 2.6) serves this family as the current accelerator."""
        return _accelerator_serves(device) and hasattr(torch.accelerator, "max_memory_allocated")

    def memory_allocated(self, device: torch.device) -> int:
        """Bytes the family's allocator has handed out on ``device`` now."""
        return int(torch.accelerator.memory_allocated(_index(device)))

    def max_memory_allocated(self, device: torch.device) -> int:
        """The most bytes handed out on ``device`` since the last :meth:`reset_peak_memory_stats`."""
        return int(torch.accelerator.max_memory_allocated(_index(device)))

    def max_memory_reserved(self, device: torch.device) -> int | None:
        """The most bytes the family's allocator held from the device (handed out or cached) since the last
        :meth:`reset_peak_memory_stats`, or ``None`` where it does not report them."""
        reserved = getattr(torch.accelerator, "max_memory_reserved", None)
        return None if reserved is None else int(reserved(_index(device)))

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        """Start a new peak (and wait for queued work, so that it is not counted in the next peak)."""
        self.synchronize(device)
        torch.accelerator.reset_peak_memory_stats(_index(device))

    def device_name(self, device: torch.device) -> tuple[str, int] | None:
        """The accelerator's product name and its total memory in bytes (a GPU's, for its peak FLOP/s), or
        ``None`` where the family does not say (the default)."""
        return None

    def free_memory(self, device: torch.device) -> int | None:
        """Bytes the device has free now, or ``None`` where the family cannot tell."""
        return None

    # -- host offload ----------------------------------------------------------------------------------------
    def pin_for_copies(self, tensor: torch.Tensor) -> None:
        """Move a host tensor's data to page-locked memory in place, where copies to this family then run
        asynchronously; nothing elsewhere."""

    def device_copier(self, device: torch.device) -> DeviceCopier:
        """A :class:`DeviceCopier` for parameter streaming to ``device``."""
        return DeviceCopier(device)

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        """Start keeping ``tensor`` in host memory (see :attr:`host_offload`). Default: a blocking copy into pinned
        host memory."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor)
        return HostCopy(host, tensor.device)

    def prefetch_to_device(self, copy: HostCopy) -> None:
        """Start moving a :class:`HostCopy` back to its device where that is asynchronous; else nothing."""

    def to_device(self, copy: HostCopy) -> torch.Tensor:
        """The tensor of a :class:`HostCopy`, back on its device and usable on the current stream."""
        return copy.tensor.to(copy.device)

    def place_on_host(self, tensor: torch.Tensor, annotate: bool | None) -> torch.Tensor:
        """``tensor`` annotated to live in host memory inside a traced graph; unchanged where there is no graph."""
        return tensor

    def place_on_device(self, tensor: torch.Tensor, annotate: bool | None) -> torch.Tensor:
        """The counterpart of :meth:`place_on_host`."""
        return tensor

    # -- several devices in one process (SPMD) -------------------------------------------------------------
    def spmd_device_count(self, device: torch.device) -> int:
        """How many devices one process drives as one through the SPMD partitioner (tensors annotated with
        shardings over a mesh of them, the compiler inserting the collectives): 1 where the family has no SPMD,
        where a run over several devices is several processes (DDP, FSDP2 under ``torchrun``)."""
        return 1

    def enable_spmd(self) -> None:
        """Switch this process to SPMD before any tensor of the family is created (see :meth:`spmd_device_count`)."""
        raise NotImplementedError(
            f"the {self.device_type!r} backend has no SPMD partitioner: one process drives one device; run several "
            f"processes with FSDP2 or DDP under torchrun instead"
        )

    def spmd_mesh(self, shape: Sequence[int], axis_names: Sequence[str]) -> Any:
        """A mesh of all the SPMD devices with ``shape`` and named axes, for :meth:`mark_sharding`."""
        self.enable_spmd()  # raises: no SPMD here

    def mark_sharding(self, tensor: torch.Tensor, mesh: Any, spec: Sequence[str | tuple[str, ...] | None]) -> None:
        """Annotate ``tensor`` in place: dimension ``i`` split over the mesh axes ``spec[i]`` (``None``: whole on
        every device; axes not named: replicated over them)."""
        self.enable_spmd()

    def shard_shapes(self, tensor: torch.Tensor) -> list[tuple[int, ...]]:
        """The shape of the piece of ``tensor`` each device holds (one entry per device)."""
        return [tuple(tensor.shape)]

    def from_host_pieces(
        self, pieces: Sequence[torch.Tensor], mesh: Any, spec: Sequence[str | tuple[str, ...] | None]
    ) -> torch.Tensor:
        """One tensor split over ``mesh`` as ``spec`` says (as :meth:`mark_sharding` would split it), made from
        the host tensors ``pieces``, the piece of each device in the mesh's device order: each device receives
        its own piece only, never the whole tensor (how a model larger than one device is initialised)."""
        self.enable_spmd()
        raise AssertionError("unreachable: enable_spmd raises")

    # -- kernels and sizing ----------------------------------------------------------------------------------
    def kernel_platform(self, tensor: torch.Tensor) -> str:
        """Which hand-written kernels serve ``tensor``: ``'triton'``, ``'pallas'`` or ``'reference'``."""
        return "reference"

    def tpu_generation(self, device: torch.device) -> str | None:
        """The TPU generation of the chip ``device`` is, from the runtime; ``None`` when it is not a TPU or the
        runtime does not say."""
        return None

    def sizing_generation(self, device: torch.device, requested: str | None) -> str | None:
        """The TPU generation whose deviceless compile sizes programs traced on ``device``, or ``None``: do not size
        with the TPU compiler. Only a lazy family traces programs; ``requested`` is the user's choice."""
        return None

    def compilations(self) -> int | None:
        """How many programs the family has compiled in this process so far (a training loop checks that the count
        stops growing after the first steps: one compiled graph per step), or ``None`` for an eager family."""
        return None

    def scan_loop(self) -> Callable[..., Any] | None:
        """A loop ``loop(fn, init, xs, reverse=False) -> (carry, ys)`` that traces ``fn(carry, x) -> (carry, y)``
        once and runs it over the leading dimension of the tensors in ``xs`` as one compiled loop, without
        autograd (:mod:`revlib_xla.scan`); the loop gives each iteration its own seed, drawn as
        ``torch.randint(0, 2**62, (iterations,), dtype=torch.int64)``. ``None`` where the family compiles no loops
        (an eager device runs the iterations as they come)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} for {self.device_type!r}>"


def _index(device: torch.device) -> int | None:
    return device.index


def _accelerator_serves(device: torch.device) -> bool:
    """Whether ``torch.accelerator`` (torch >= 2.6) has this device's family as the current accelerator."""
    current = getattr(getattr(torch, "accelerator", None), "current_accelerator", None)
    if current is None:
        return False
    accelerator = current()
    return accelerator is not None and accelerator.type == device.type


def triton_installed() -> bool:
    """Whether the Triton kernels can be compiled here."""
    return importlib.util.find_spec("triton") is not None


def kernels_forced_reference() -> bool:
    """``REVLIB_XLA_KERNELS=reference`` forces the pure-PyTorch reference kernels everywhere."""
    return os.environ.get("REVLIB_XLA_KERNELS", "auto") == "reference"
