"""The reversible backward checks its own work: the input it rebuilds against the input the forward was given.

An additive coupling (``y1 = x0 + f(x1)``, undone as ``x0 = y1 - f(y0)``) inverts exactly only in exact arithmetic:
in low precision, with large blocks, the rounding of each layer's output is left in the rebuilt input and grows over
the layers, and the gradients computed from rebuilt inputs are as far off (eight bfloat16 MLP blocks with large
weights: off by more than 100 %). :func:`revlib_xla.check_invertible` measures it by running every block three more
times; the backward already rebuilds every layer's input, down to the first layer's, so comparing that with the
input costs one subtraction and one maximum over the input, and no block evaluation.

:class:`RebuildCheck`: at the first memory-saving training forward of a :class:`~revlib_xla.ReversibleSequential`
per pair of stream and compute dtypes that ``check_invertible`` does not run for (``verify_inverse``), the forward
keeps the input of the first layer the backward rebuilds (a detached alias: no copy, and nothing beyond that one
step), and that layer's backward compares what it rebuilt with it, by :func:`rebuild_error` and :func:`tolerance`,
the rule ``check_invertible`` applies. Where the value can be read without running pending work (eager devices), it
is read there and a :class:`~revlib_xla.ReversibleError` raised from the backward; on a lazy device (XLA) reading it
would run the step's graph in the middle of the step, so the error stays a lazy tensor, computed with the step at
the user's step cut, and the model's next forward reads it (:func:`settle`) and raises for the previous step. A
value that is never computed is never read. There its output makes the first step's graph differ from the next
steps': one more compilation where the first two steps would otherwise share a graph (``verify_inverse=False``
skips the check). Code that traces a step without running it switches arming off (:func:`suspended`): the
traced program stays the step's own.

Under data parallelism (the forward runs inside ``DistributedDataParallel``, or the parameters are FSDP2's
``DTensor`` s) the processes decide together (:func:`agreeing_group`): every process's measured error is replaced
by the largest over the group (one all-reduce, in the first step only), so a process whose data cannot be rebuilt
does not raise alone while the others wait in the next gradient all-reduce until the collective's timeout; all
raise the same error. On a lazy device the verdict is read at the next forward, after the step: agreeing there
would need the all-reduce in the step's graph (torch_xla's process group); not done, each process reads its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import backends
from ..backends import tracing
from ..errors import ReversibleError
from .fixed_point import FixedPoint

Tensor = torch.Tensor

__all__ = [
    "RebuildCheck",
    "Verdict",
    "agreeing_group",
    "rebuild_error",
    "relative_error",
    "settle",
    "suspended",
    "tolerance",
]

#: The relative error (max abs error / max abs value) a rebuilt input may have, by the dtype of the streams or the
#: blocks (the coarser counts).
DEFAULT_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def tolerance(stream_dtype: torch.dtype, compute_dtype: torch.dtype | None) -> float:
    """The default tolerance of streams in ``stream_dtype`` fed to blocks computing in ``compute_dtype``
    (``None``: the streams' dtype)."""
    return max(DEFAULT_TOLERANCE.get(d, 1e-4) for d in (stream_dtype, compute_dtype or stream_dtype))


def relative_error(value: Tensor, reference: Tensor, scale: Tensor) -> Tensor:
    if not reference.numel():
        return scale.new_zeros(()).float()
    return ((value - reference).abs().max() / scale).float()


def magnitude(*tensors: Tensor) -> Tensor:
    """The largest absolute value in ``tensors`` (at least the dtype's smallest normal number; exact streams, which
    are integers: as float32, at least 1)."""
    largest = torch.stack([t.abs().max() if t.numel() else t.new_zeros(()) for t in tensors]).max()  # (an empty
    # batch: 0)
    if not largest.dtype.is_floating_point:
        return largest.float().clamp_min(1.0)
    return largest.clamp_min(torch.finfo(largest.dtype).tiny)


def rebuild_error(
    rebuilt0: Tensor,
    rebuilt1: Tensor,
    x0: Tensor,
    x1: Tensor,
    scale: Tensor | None = None,
    grid: FixedPoint | None = None,
) -> Tensor:
    """How far two rebuilt streams are from the real ones ``(x0, x1)``: the larger max abs error, over the largest
    absolute value of the real streams (``scale``, when already computed: :func:`magnitude`; a 0-dim float32
    tensor, computed where the streams are). ``grid``: the rebuilt streams are exact streams, the real ones their
    values, encoded here in pieces of at most a sixteenth (the comparison's temporaries stay small)."""
    scale = magnitude(x0, x1) if scale is None else scale
    if grid is None:
        return torch.maximum(relative_error(rebuilt0, x0, scale), relative_error(rebuilt1, x1, scale))
    largest = torch.stack([_largest_difference(r, x, grid) for r, x in ((rebuilt0, x0), (rebuilt1, x1))]).max()
    return (largest.float() / scale).float()


def _largest_difference(stream: Tensor, value: Tensor, grid: FixedPoint) -> Tensor:
    flat_stream, flat_value = stream.reshape(-1), value.reshape(-1)
    n = flat_value.numel()
    step = max(1024, -(-n // 16))
    parts = []
    for k in range(0, n, step):
        difference = flat_stream[k : k + step] - grid.encode(flat_value[k : k + step])
        parts.append(difference.abs_().max())
    return torch.stack(parts).max() if parts else stream.new_zeros(())


def agreeing_group(params: Sequence[Tensor]) -> Any:
    """The process group whose processes must reach the same verdict, or ``None``: the group of the
    ``DistributedDataParallel`` whose forward is running, or of the device mesh of parameters that are ``DTensor``
    (FSDP2; a mesh of several dimensions: all processes, if it spans them), where it has more than one process.
    Called at the forward (where DDP is known to be running)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group: Any = None
    ddp = getattr(torch.nn.parallel.DistributedDataParallel, "_active_ddp_module", None)  # set in DDP's forward
    if ddp is not None:
        group = ddp.process_group
    else:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # torch < 2.5 keeps it private; FSDP2 needs 2.6
            return None
        mesh = next((p.device_mesh for p in params if isinstance(p, DTensor)), None)
        if mesh is None:
            return None
        if mesh.ndim == 1:
            group = mesh.get_group()
        elif mesh.size() == dist.get_world_size():
            group = dist.group.WORLD
    return group if group is not None and dist.get_world_size(group) > 1 else None


#: Within the block (this thread), no forward keeps its input for the check: for code that traces a step without
#: running it, whose program must be the step's own (:func:`revlib_xla.backends.tracing.checks_suspended`, which this
#: name is; :func:`armed` is :func:`~revlib_xla.backends.tracing.checks_armed`).
suspended = tracing.checks_suspended
armed = tracing.checks_armed


@dataclasses.dataclass
class Verdict:
    """A measured rebuild error, read when its value is ready (see :func:`settle`)."""

    error: Tensor  # 0-dim float32; negative: the input was not finite, nothing measured
    tolerance: float
    what: str  # the streams' and blocks' dtypes, and the layers walked, in words
    key: Any
    verified: set[Any]  # the model's checked dtype pairs: the key leaves it when nothing could be measured
    fused: bool  # a fused optimizer stepped the layers with the gradients before the check
    replays_random: bool  # preserve_rng_state: the recomputation draws the forward's random numbers

    def read(self, previous: bool) -> None:
        """Read the error and raise :class:`~revlib_xla.ReversibleError` if it exceeds the tolerance; ``previous``:
        the backward that measured it belongs to an earlier step (lazy devices)."""
        value = float(self.error)
        if value < 0:  # a non-finite input (the loss says so): measure again at the next training forward
            self.verified.discard(self.key)
            return
        if value <= self.tolerance:
            return
        nonfinite = value != value or value == float("inf")  # a finite input rebuilt as NaN or inf: not rounding
        when = (
            "The previous training step's backward (the first of this model with these dtypes; on a lazy device "
            "the measurement is read once the step has run, at this forward)"
            if previous
            else "This backward (the first of this model with these dtypes)"
        )
        wrong = "that step's gradients were" if previous else "the gradients it computed are"
        stepped = " A fused optimizer has already stepped the layers with them." if self.fused else ""
        if nonfinite:
            raise ReversibleError(
                f"ReversibleSequential: {when} rebuilt the finite input {self.what} as NaN or inf: a layer computed "
                f"NaN or inf (weights holding NaN or inf, or an overflow), which no wider dtype fixes; {wrong} NaN "
                f"or inf as well.{stepped} Check the weights (torch.isfinite) and the loss."
            )
        raise ReversibleError(
            f"ReversibleSequential does not rebuild its input: {when} rebuilt the input {self.what} with a relative "
            f"error of {value:.3g} (max abs error / max abs value; tolerance {self.tolerance:.1g}): an additive "
            f"coupling inverts exactly only in exact arithmetic, and the rounding of the blocks' outputs grew over the "
            f"layers (large blocks or weights, low precision). So {wrong} wrong by about as much: do not step an "
            f"optimizer with them.{stepped} {_wider_streams(self.key[0])}use fewer or smaller layers per reversible "
            f"sequence (or smaller weights), or use memory_mode=MemoryModes.no_savings (or planned checkpointing, "
            f"revlib_xla.Checkpointable). verify_inverse=True runs revlib_xla.check_invertible at the first training "
            f"forward instead, which names the layer (and finds a block that keeps state between calls, e.g. a KV "
            f"cache); verify_inverse=False accepts the error knowingly."
            + ("" if self.replays_random else " With random ops (dropout), keep preserve_rng_state=True.")
        )


def _wider_streams(streams: torch.dtype) -> str:
    """The advice to keep the streams in a wider dtype than ``streams``, if there is one."""
    if streams.itemsize < 4:
        return (
            "Keep the streams in float32 (stream_dtype=torch.float32, the blocks still compute in the input's dtype), "
        )
    if streams.itemsize == 4:
        return "Keep the streams in float64 (stream_dtype=torch.float64), "
    return "Use "


@dataclasses.dataclass
class RebuildCheck:
    """One forward's check: the input of layer ``first`` kept for the backward, which compares its rebuild with it
    (:meth:`compare`) and leaves its :class:`Verdict` in ``pending`` when the value is not ready."""

    key: Any  # (stream dtype, compute dtype)
    tolerance: float
    layers: int
    verified: set[Any]
    pending: list[Verdict]
    fused: bool = False
    replays_random: bool = True
    autocast: torch.dtype | None = None  # the dtype the blocks compute in under autocast
    first: int = 0  # the layer whose input is kept: the first one the backward rebuilds
    streams: tuple[Tensor, Tensor] | None = None
    grid: FixedPoint | None = None
    versions: tuple[int, int] = (0, 0)
    group: Any = None  # the processes that decide together (agreeing_group), or None

    def keep(self, first: int, x0: Tensor, x1: Tensor, grid: FixedPoint | None = None) -> None:
        """Keep ``(x0, x1)``, the input of layer ``first``, as detached aliases (their versions are checked).
        ``grid``: exact streams whose integers are ``grid.encode(x0)``, ``grid.encode(x1)``: the input is kept (no
        memory), and encoded piece by piece when compared."""
        self.first, self.streams, self.grid = first, (x0.detach(), x1.detach()), grid
        self.versions = (x0._version, x1._version)

    def compare(self, layer: int, rebuilt0: Tensor, rebuilt1: Tensor) -> None:
        """Layer ``layer``'s backward rebuilt its input as ``(rebuilt0, rebuilt1)``: measure it against the kept
        input if that is this layer's, and judge it now or when it is ready."""
        if layer != self.first or self.streams is None:
            return
        x0, x1 = self.streams
        self.streams = None  # measured once, also when the graph is kept for another backward
        if not (x0.numel() and x1.numel()):
            return  # an empty batch: nothing to compare (checked next time)
        changed = (x0._version, x1._version) != self.versions  # in place after the forward: nothing to compare with
        if changed and self.group is None:
            return  # (checked next time)
        with torch.no_grad():
            scale = magnitude(x0, x1)
            if self.grid is not None:  # in units of the grid, as the integers
                scale = scale.float() * 2.0**self.grid.fraction_bits
            error = rebuild_error(rebuilt0.detach(), rebuilt1.detach(), x0, x1, scale, self.grid)
            error = torch.where(torch.isfinite(scale), error, torch.full_like(error, -1.0))
            if changed:
                error = torch.full_like(error, -1.0)
        if self.group is not None and backends.value_ready(error):
            # every process raises, or passes, or measures again next step, together (-1: not measured)
            dist.all_reduce(error, op=dist.ReduceOp.MAX, group=self.group)
        through = "through all its layers" if self.first == 0 else f"of layer {self.first}, through the layers above"
        what = f"{through} ({self.layers} in all; {_dtypes(self.key, self.autocast)})"
        verdict = Verdict(error, self.tolerance, what, self.key, self.verified, self.fused, self.replays_random)
        self.verified.add(self.key)
        if backends.value_ready(error):
            verdict.read(previous=False)
        else:
            self.pending.append(verdict)


def _dtypes(key: Any, autocast: torch.dtype | None) -> str:
    stream, compute = key
    words = [f"{_name(stream)} streams"]
    if compute:
        words.append(f"blocks computing in {_name(compute)}")
    if autocast:
        words.append(f"under {_name(autocast)} autocast")
    return ", ".join(words)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def settle(pending: list[Verdict]) -> None:
    """Read the verdicts whose values are ready (computed at a step cut since), raising for a failed one; the rest
    wait. Nothing is run to compute them."""
    ready = [v for v in pending if backends.value_ready(v.error)]
    for verdict in ready:
        pending.remove(verdict)
    for verdict in ready:
        verdict.read(previous=True)
