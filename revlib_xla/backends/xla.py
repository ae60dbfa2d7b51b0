"""torch_xla (lazy XLA tensors on a TPU, a GPU or the CPU through PJRT).

Operations are traced into a graph that runs at a step cut (``torch_xla.sync()``); the compiler decides what lives
when, merges identical work unless an optimization barrier stops it, and places tensors in host memory where the
graph is annotated so. torch_xla is imported only when an XLA device is used or asked about. Being XLA says nothing
about the chip: the PJRT runtime says whether it is a TPU and which one (:meth:`XlaBackend.tpu_generation`).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .. import _tree
from .base import Backend, HostCopy, HostOffload, generation_from_device_kind

__all__ = [
    "XlaBackend",
    "host_annotations",
    "host_placement_executes",
    "runtime_type",
    "tpu_attached",
    "xla_available",
    "xla_requested",
    "xla_model",
]


def tpu_attached() -> bool:
    """Whether this machine has Cloud TPU chips, seen without importing torch_xla: libtpu installed and a TPU device
    file present (``/dev/accel<N>`` on v4 and v5e, ``/dev/vfio/<N>`` on v5p and v6e), or ``TPU_NAME`` set."""
    if os.environ.get("TPU_NAME"):
        return True
    if importlib.util.find_spec("libtpu") is None:
        return False
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def xla_requested() -> bool:
    """Whether this process uses or asked for XLA, answered without importing torch_xla: torch_xla already
    imported, ``PJRT_DEVICE`` set (to any device), or a TPU attached (:func:`tpu_attached`)."""
    return "torch_xla" in sys.modules or "PJRT_DEVICE" in os.environ or tpu_attached()


def xla_model() -> Any:
    """``torch_xla.core.xla_model``, importing torch_xla: PJRT on the device ``PJRT_DEVICE`` names, by default the
    TPU where one is attached (:func:`tpu_attached`), else the CPU."""
    os.environ.setdefault("PJRT_DEVICE", "TPU" if tpu_attached() else "CPU")
    import torch_xla  # noqa: F401
    import torch_xla.core.xla_model as xm

    return xm


@functools.cache
def xla_available() -> bool:
    """True when torch_xla is installed and imports (it needs torch 2.9.x)."""
    if importlib.util.find_spec("torch_xla") is None:
        return False
    try:
        xla_model()
    except Exception:  # a torch_xla built for another torch raises on import
        return False
    return True


def runtime_type() -> str | None:
    """The PJRT device type torch_xla runs on (``'TPU'``, ``'CPU'``, ``'CUDA'`` ...), or None without torch_xla."""
    if not xla_available():
        return None
    import torch_xla.runtime as xr

    return xr.device_type()


def _xla_sync() -> None:
    import torch_xla

    torch_xla.sync()


def host_placement_executes() -> bool:
    """Whether XLA graphs with host-memory placement annotations can run here: on TPU (and GPU) PJRT, not on PJRT
    CPU, whose runtime has no handler for them (the graph compiles, and fails when executed)."""
    return runtime_type() not in (None, "CPU")


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


class XlaBackend(Backend):
    """Lazy XLA through torch_xla: a per-device seed inside the graph instead of generators, in-place optimization
    barriers (wrapped to look out of place), host offload by memory-space annotations, StableHLO text of pending
    graphs, Pallas kernels on a TPU."""

    lazy = True
    host_offload = HostOffload.MEMORY_SPACE_ANNOTATION
    program_text_available = True
    takes_generators = False
    checkpoint_in_partial_backward = False  # torch_xla's checkpoint is reentrant
    autocast_device_type: str | None = "xla"
    preference = 30

    def available(self, device: torch.device) -> bool:
        return xla_available()

    def concrete(self, device: torch.device) -> torch.device:
        xla_model()
        import torch_xla

        return torch_xla.device() if device.index is None else device

    def hardware_present(self) -> bool:
        # Answered without importing torch_xla (seconds) where PJRT would run on the CPU anyway.
        if "torch_xla" not in sys.modules and (os.environ.get("PJRT_DEVICE") == "CPU" or not xla_requested()):
            return False
        return runtime_type() not in (None, "CPU")

    def hardware_device(self) -> torch.device | None:
        return self.concrete(torch.device("xla")) if self.hardware_present() else None

    def cut_step(self, device: torch.device) -> None:
        _xla_sync()

    def synchronize(self, device: torch.device | None) -> None:
        # With no device named, only when torch_xla is already in use: a sync must not start its runtime.
        if xla_available() and (device is not None or "torch_xla" in sys.modules):
            _xla_sync()

    def get_rng_state(self, device: torch.device) -> Any:
        return xla_model().get_rng_state(str(device))

    def set_rng_state(self, device: torch.device, state: Any) -> None:
        xla_model().set_rng_state(state, str(device))

    def manual_seed(self, device: torch.device, seed: int) -> None:
        xla_model().set_rng_state(seed, str(device))

    def optimization_barrier(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """torch_xla's barrier is in place (``optimization_barrier_``): the same tensor objects come back, now
        behind the barrier. Tensors on other devices pass through."""
        tensors = list(tensors)
        xla_tensors = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "xla"]
        if xla_tensors:
            xla_model().optimization_barrier_(xla_tensors)
        return tensors

    def after(self, value: Any, token: torch.Tensor) -> Any:
        """Each XLA tensor ``t`` in ``value`` becomes ``t + 0 * sum(token)``: exactly ``t`` for a finite token (the
        compiler does not fold ``0 * y`` in floating point), computed after ``token``."""
        zero = token.detach().sum() * 0
        return _tree.map_tensors(lambda t: t + zero.to(t.dtype) if t.device.type == "xla" else t, value)

    def checkpoint(self, function: Callable[..., Any], *args: Any, preserve_rng_state: bool = True) -> Any:
        """``torch_xla.utils.checkpoint``: ``torch.utils.checkpoint`` crashes on XLA tensors in torch 2.9, and
        torch_xla's version puts optimization barriers before the recomputation. It is reentrant: parameters used
        by ``function`` get gradients only when one of ``args`` requires grad."""
        xla_model()
        from torch_xla.utils.checkpoint import checkpoint as xla_checkpoint

        return xla_checkpoint(function, *args, use_reentrant=True, preserve_rng_state=preserve_rng_state)

    def program_text(self, tensors: Sequence[torch.Tensor]) -> str:
        tensors = list(tensors)
        if not tensors or any(not isinstance(t, torch.Tensor) or t.device.type != "xla" for t in tensors):
            raise ValueError("lazy_stablehlo needs XLA tensors (and only XLA tensors)")
        return str(xla_model().get_stablehlo(tensors))

    def value_ready(self, tensor: torch.Tensor) -> bool:
        """Whether the tensor holds device data (its graph has run at a step cut), asked of torch_xla
        (``_check_tensor_need_materialization``, private; a torch_xla without it: never ready, so nothing is read
        early)."""
        import torch_xla

        pending = getattr(torch_xla._XLAC, "_check_tensor_need_materialization", None)
        return pending is not None and not pending([tensor])[0]

    def zero_copy_device_tensor(self, host_tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """XLA device data over the host tensor's memory through DLPack (PJRT keeps a reference, nothing is copied
        or read): in a traced program it is an argument like any parameter moved to the device."""
        xla_model()
        from torch_xla.utils.dlpack import from_dlpack

        tensor = from_dlpack(host_tensor.detach())
        return tensor if device.index is None or tensor.device == device else tensor.to(device)

    def program_arguments(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        import torch_xla

        ids, _ = torch_xla._XLAC._get_tensors_xla_device_data_node(list(tensors))
        return [int(i) for i in ids]

    def data_identity(self, tensor: torch.Tensor) -> int:
        """torch_xla's tensor id, which the device data of a tensor that holds plain data carries into a traced
        program as its argument's id."""
        import torch_xla

        return int(torch_xla._XLAC._xla_get_tensor_id(tensor))

    @contextlib.contextmanager
    def execution_forbidden(self) -> Iterator[None]:
        """torch_xla's own guard of ``torch_xla.compile(full_graph=True)``: a value read or a sync raises
        ``RuntimeError('Unexpected execution ...')``."""
        xla_model()
        import torch_xla

        allowed = torch_xla._XLAC._get_allow_execution()
        torch_xla._XLAC._set_allow_execution(False)
        try:
            yield
        finally:
            torch_xla._XLAC._set_allow_execution(allowed)

    def _annotate(self, annotate: bool | None) -> bool:
        if annotate is not None:
            return annotate
        forced = _FORCE_HOST_ANNOTATIONS[-1]
        return forced if forced is not None else host_placement_executes()

    def place_on_host(self, tensor: torch.Tensor, annotate: bool | None) -> torch.Tensor:
        if not self._annotate(annotate):
            return tensor
        from torch_xla.experimental.stablehlo_custom_call import place_to_host

        return place_to_host(tensor)

    def place_on_device(self, tensor: torch.Tensor, annotate: bool | None) -> torch.Tensor:
        if not self._annotate(annotate):
            return tensor
        from torch_xla.experimental.stablehlo_custom_call import place_to_device

        return place_to_device(tensor)

    def to_host(self, tensor: torch.Tensor) -> HostCopy:
        return HostCopy(self.place_on_host(tensor, None), tensor.device)

    def to_device(self, copy: HostCopy) -> torch.Tensor:
        return self.place_on_device(copy.tensor, None)

    def kernel_platform(self, tensor: torch.Tensor) -> str:
        return "pallas" if runtime_type() == "TPU" else "reference"

    def compilations(self) -> int | None:
        """torch_xla's ``CompileTime`` metric: the number of graphs compiled in this process (0 before any)."""
        if "torch_xla" not in sys.modules:
            return 0
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return 0 if data is None else int(data[0])

    def scan_loop(self) -> Callable[..., Any] | None:
        """torch_xla's scan loop without autograd (private: ``torch_xla.experimental.scan._scan_impl_pytree``;
        ``None`` if this torch_xla lacks it). Its public ``scan`` saves the body's activations for its own backward,
        which a reversible walk must not."""
        try:
            from torch_xla.experimental import scan as xla_scan
        except ImportError:
            return None
        return getattr(xla_scan, "_scan_impl_pytree", None)

    def spmd_device_count(self, device: torch.device) -> int:
        """Every device of the PJRT runtime (the chips of a TPU VM; ``CPU_NUM_DEVICES`` on the CPU)."""
        xla_model()
        import torch_xla.runtime as xr

        return int(xr.global_runtime_device_count())

    def enable_spmd(self) -> None:
        """``torch_xla.runtime.use_spmd()``: from here on one virtual device stands for all of them. It must come
        before the runtime hands out its first device (torch_xla would replicate what exists, and on PJRT CPU the
        gradients of such a run crash the process when read): later, this raises instead."""
        xla_model()
        import torch_xla
        import torch_xla.runtime as xr

        if xr.is_spmd():
            return
        if torch_xla._XLAC._xla_get_spmd_config_is_locked():
            raise RuntimeError(
                "SPMD (a mesh over several XLA devices) must be switched on before the first XLA device or tensor "
                "of the process: call revlib_xla.sharding.apply_mesh / make_mesh before anything touches torch_xla"
            )
        xr.use_spmd()

    def spmd_mesh(self, shape: Sequence[int], axis_names: Sequence[str]) -> Any:
        import numpy as np
        import torch_xla.distributed.spmd as xs

        self.enable_spmd()
        count = self.spmd_device_count(torch.device("xla"))
        return xs.Mesh(np.arange(count), tuple(shape), tuple(axis_names))

    def mark_sharding(self, tensor: torch.Tensor, mesh: Any, spec: Sequence[str | tuple[str, ...] | None]) -> None:
        import torch_xla.distributed.spmd as xs

        xs.mark_sharding(tensor, mesh, tuple(spec))

    def from_host_pieces(
        self, pieces: Sequence[torch.Tensor], mesh: Any, spec: Sequence[str | tuple[str, ...] | None]
    ) -> torch.Tensor:
        """From ``torch_xla._XLAC._global_tensor_from_cpu_shards``: each piece goes to its device only."""
        import torch_xla

        return torch_xla._XLAC._global_tensor_from_cpu_shards(list(pieces), mesh.get_op_sharding(tuple(spec)))

    def shard_shapes(self, tensor: torch.Tensor) -> list[tuple[int, ...]]:
        """From ``torch_xla._XLAC._get_local_shards``: the device data of each shard."""
        import torch_xla

        shards = torch_xla._XLAC._get_local_shards([tensor])[0]
        return [tuple(shard.shape) for shard, _ in shards]

    def tpu_generation(self, device: torch.device) -> str | None:
        """From PJRT's device kind (``'TPU v5 lite'`` -> ``'v5e'``) when the runtime is a TPU."""
        if runtime_type() != "TPU":
            return None
        return generation_from_device_kind(xla_model().xla_device_kind(str(device)))

    def sizing_generation(self, device: torch.device, requested: str | None) -> str | None:
        """On a TPU, its own generation (the requested one where the runtime's is not one the compiler is set up
        for); on PJRT CPU, which traces the programs a TPU would run, the requested one; on any other chip
        (a GPU through PJRT) none: its programs are not a TPU's. Under SPMD none either: torch_xla 2.9's export of
        the programs (``get_stablehlo``) crashes the process there (the planner then sizes stages from shapes)."""
        import torch_xla.runtime as xr

        if xr.is_spmd():
            return None
        kind = runtime_type()
        if kind == "TPU":
            return self.tpu_generation(device) or requested
        if kind == "CPU":
            return requested
        return None
