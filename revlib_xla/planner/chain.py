"""The cost model of a sequential network: what the planner knows about each stage.

Conventions are rotor's. A chain has ``L`` stages ``F_0 .. F_{L-1}`` followed by the loss stage (index ``L``).
``x_i`` is the input of stage ``i`` (``x_L`` is the input of the loss) and ``x̄_{i+1}`` is everything stage ``i``
keeps alive when it runs with autograd (its output included). Sizes are bytes (or any unit, consistently); times
are seconds (or any unit).

=========== ======== =========================================================================================
field       entries  meaning
=========== ======== =========================================================================================
``fw``      L        forward time of stage i
``bw``      L+1      backward time of stage i; ``bw[L]`` is the loss's backward
``cw``      L+1      size of x_i; the gradient of x_i has the same size
``cbw``     L+1      size of x̄_i (``cbw[0]`` is not used): what stays alive after stage i-1 ran with autograd
``fwd_tmp`` L        transient memory of stage i's forward, above its output
``grad_fwd_tmp`` L   transient memory of stage i's forward with autograd, above x̄_{i+1} (default: ``fwd_tmp``)
``bwd_tmp`` L+1      transient memory of stage i's backward, above its input gradient and x̄_{i+1}
``stopped_fw`` L     time of stage i's last recomputation where it stops at its last saved tensor (default:
                     ``fw``; see below)
=========== ======== =========================================================================================

Beyond rotor, a stage may offer more ways to run:

* ``reversible[i]``: stage i can rebuild its input from its output (``inverse_time[i]`` is the price; by default
  one forward), so its input need not be stored: the plan may run it forward, drop its input, and rebuild the
  input in the backward (operations ``Fr`` and ``Br``).
* ``offload_time[i]``: x_i may be kept in host memory while later stages run; each transfer (to the host and back)
  costs that time (``None``: not allowed). :meth:`Chain.with_bandwidth` derives it from a bandwidth.
* ``options[i]``: alternative ways to run stage i with autograd (few-bit or low-precision saved activations),
  each with its own times and sizes; the plan picks per stage.
* ``stopped_fw[i]``: where stage i's input stays stored from a ``CF_i`` to its last recomputation ``Fe_i B_i``,
  the executor stops that recomputation at the last tensor the backward reads (:mod:`revlib_xla.planner.early_stop`: a
  Llama layer's ``down_proj`` is not run again), so that ``Fe_i`` costs ``stopped_fw[i]``, not ``fw[i]``
  (:func:`~revlib_xla.planner.schedule.early_stops` finds those ``Fe``; at most ``fw[i]``).
* ``caches[i]``: stage i may keep what its fused attention kernels returned (:class:`StageCache`: ``bytes``, from
  its first run until its backward; :mod:`revlib_xla.planner.attention_cache`), and its later runs read it instead of
  running attention again (selective recomputation, operation ``CA``): such a forward costs ``fw`` of the
  :class:`StageCache` (a stopped one ``stopped_fw[i]`` less the same saving) with its ``fwd_tmp``, and one with
  autograd keeps its ``cbw`` (autograd's saved attention output is the cached one). Only the plain option reads
  the cache.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["Chain", "StageOption", "StageCache"]


@dataclasses.dataclass(frozen=True)
class StageOption:
    """Another way to run a stage with autograd: its forward and backward times, what it keeps alive (``cbw``: the
    size of its x̄) and its transient memory."""

    name: str
    fw: float
    bw: float
    cbw: float
    fwd_tmp: float = 0.0
    bwd_tmp: float = 0.0


@dataclasses.dataclass(frozen=True)
class StageCache:
    """A stage's attention cache: its size, the stage's forward time when it reads it, what the stage's forward
    with autograd keeps alive then (its x̄, without the cached tensors, which the cache holds: at least the
    stage's x̄ less ``bytes``), and the transient memory of a forward without autograd reading it (None: the
    stage's ``fwd_tmp``; attention's workspace is not needed). A forward with autograd is charged the stage's own
    transient memory (``grad_fwd_tmp``)."""

    bytes: float
    fw: float
    cbw: float
    fwd_tmp: float | None = None


def _floats(name: str, values: Sequence[float], length: int) -> tuple[float, ...]:
    values = tuple(values)
    if len(values) != length:
        raise ValueError(f"Chain: {name} needs {length} entries, got {len(values)}")
    out = []
    for index, value in enumerate(values):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"Chain: {name}[{index}] is {value!r}, not a number") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"Chain: {name}[{index}] = {value} must be finite and >= 0")
        out.append(value)
    return tuple(out)


@dataclasses.dataclass(frozen=True, init=False)
class Chain:
    """Per-stage costs of a chain of ``L`` stages plus the loss (see the module docstring for the fields)."""

    fw: tuple[float, ...]
    bw: tuple[float, ...]
    cw: tuple[float, ...]
    cbw: tuple[float, ...]
    fwd_tmp: tuple[float, ...]
    bwd_tmp: tuple[float, ...]
    reversible: tuple[bool, ...]
    inverse_time: tuple[float, ...]
    offload_time: tuple[float | None, ...]
    options: tuple[tuple[StageOption, ...], ...]
    names: tuple[str, ...]
    #: None: the forward with autograd has ``fwd_tmp`` too (:meth:`stage_options` reads it either way).
    grad_fwd_tmp: tuple[float, ...] | None
    stopped_fw: tuple[float, ...]
    caches: tuple[StageCache | None, ...]

    def __init__(
        self,
        fw: Sequence[float],
        bw: Sequence[float],
        cw: Sequence[float],
        cbw: Sequence[float],
        fwd_tmp: Sequence[float],
        bwd_tmp: Sequence[float],
        *,
        reversible: Sequence[bool] | None = None,
        inverse_time: Sequence[float] | None = None,
        offload_time: Sequence[float | None] | None = None,
        options: Sequence[Sequence[StageOption]] | None = None,
        names: Sequence[str] | None = None,
        grad_fwd_tmp: Sequence[float] | None = None,
        stopped_fw: Sequence[float] | None = None,
        caches: Sequence[StageCache | None] | None = None,
    ) -> None:
        length = len(tuple(fw))
        if length < 1:
            raise ValueError("Chain: needs at least one stage (fw has no entries)")
        fields = dict(
            fw=_floats("fw", fw, length),
            bw=_floats("bw", bw, length + 1),
            cw=_floats("cw", cw, length + 1),
            cbw=_floats("cbw", cbw, length + 1),
            fwd_tmp=_floats("fwd_tmp", fwd_tmp, length),
            bwd_tmp=_floats("bwd_tmp", bwd_tmp, length + 1),
        )
        rev = tuple(bool(r) for r in (reversible if reversible is not None else [False] * length))
        if len(rev) != length:
            raise ValueError(f"Chain: reversible needs {length} entries, got {len(rev)}")
        inv = fields["fw"] if inverse_time is None else _floats("inverse_time", inverse_time, length)
        off: list[float | None] = [None] * length
        if offload_time is not None:
            offload_time = tuple(offload_time)
            if len(offload_time) != length:
                raise ValueError(
                    f"Chain: offload_time needs {length} entries (one per stage input x_0..x_L-1), "
                    f"got {len(offload_time)}"
                )
            off = [None if t is None else _floats("offload_time", [t], 1)[0] for t in offload_time]
        opts = tuple(tuple(o) for o in (options if options is not None else [()] * length))
        if len(opts) != length:
            raise ValueError(f"Chain: options needs {length} entries (a list per stage), got {len(opts)}")
        for i, stage_opts in enumerate(opts):
            for opt in stage_opts:
                if not isinstance(opt, StageOption):
                    raise TypeError(f"Chain: options[{i}] holds {type(opt).__name__}, not StageOption")
                _floats(f"options[{i}] {opt.name!r}", [opt.fw, opt.bw, opt.cbw, opt.fwd_tmp, opt.bwd_tmp], 5)
        stage_names = tuple(names) if names is not None else tuple(f"stage {i}" for i in range(length))
        if len(stage_names) != length:
            raise ValueError(f"Chain: names needs {length} entries, got {len(stage_names)}")
        for key, value in fields.items():
            object.__setattr__(self, key, value)
        object.__setattr__(self, "reversible", rev)
        object.__setattr__(self, "inverse_time", inv)
        object.__setattr__(self, "offload_time", tuple(off))
        object.__setattr__(self, "options", opts)
        object.__setattr__(self, "names", stage_names)
        grad_tmp = None if grad_fwd_tmp is None else _floats("grad_fwd_tmp", grad_fwd_tmp, length)
        object.__setattr__(self, "grad_fwd_tmp", grad_tmp)
        stopped = fields["fw"] if stopped_fw is None else _floats("stopped_fw", stopped_fw, length)
        for i, (s, f) in enumerate(zip(stopped, fields["fw"])):
            if s > f:
                raise ValueError(
                    f"Chain: stopped_fw[{i}] = {s} > fw[{i}] = {f}: a recomputation stopped early runs a part "
                    f"of the forward"
                )
        object.__setattr__(self, "stopped_fw", stopped)
        stage_caches = tuple(caches) if caches is not None else (None,) * length
        if len(stage_caches) != length:
            raise ValueError(f"Chain: caches needs {length} entries (None or a StageCache per stage)")
        for i, cache in enumerate(stage_caches):
            if cache is None:
                continue
            if not isinstance(cache, StageCache):
                raise TypeError(f"Chain: caches[{i}] is {type(cache).__name__}, not StageCache or None")
            _floats(f"caches[{i}]", [cache.bytes, cache.fw, cache.cbw, cache.fwd_tmp or 0.0], 4)
            if cache.fw > fields["fw"][i]:
                raise ValueError(
                    f"Chain: caches[{i}].fw = {cache.fw} > fw[{i}] = {fields['fw'][i]}: reading the cache skips work"
                )
            if cache.cbw < fields["cw"][i + 1]:
                raise ValueError(
                    f"Chain: caches[{i}].cbw = {cache.cbw} < cw[{i + 1}] = {fields['cw'][i + 1]}: what a stage "
                    f"keeps alive with autograd includes its output"
                )
            if cache.cbw + cache.bytes < self.cbw[i + 1]:
                raise ValueError(
                    f"Chain: caches[{i}].cbw = {cache.cbw} + bytes = {cache.bytes} < cbw[{i + 1}] = "
                    f"{self.cbw[i + 1]}: with the cache kept, the stage keeps at most the cached tensors less"
                )
        object.__setattr__(self, "caches", stage_caches)
        for i in range(length):
            if self.cbw[i + 1] < self.cw[i + 1]:
                raise ValueError(
                    f"Chain: cbw[{i + 1}] = {self.cbw[i + 1]} < cw[{i + 1}] = {self.cw[i + 1]}: what "
                    f"stage {i} keeps alive with autograd includes its output"
                )

    @property
    def length(self) -> int:
        """The number of stages, the loss not counted (rotor's L)."""
        return len(self.fw)

    def with_bandwidth(self, bytes_per_second: float, stages: Sequence[int] | None = None) -> Chain:
        """The same chain where x_i of the given stages (default: all) may be offloaded to the host, each transfer
        costing ``cw[i] / bytes_per_second``."""
        if not bytes_per_second > 0:
            raise ValueError(f"with_bandwidth: bytes_per_second must be > 0, got {bytes_per_second}")
        chosen = set(range(self.length) if stages is None else stages)
        off = [self.cw[i] / bytes_per_second if i in chosen else self.offload_time[i] for i in range(self.length)]
        return self.replace(offload_time=off)

    def replace(self, **changes: Any) -> Chain:
        """A copy with some fields changed (same keywords as the constructor). New forward times ``fw`` without
        ``stopped_fw`` reset it to them, and without ``caches`` drop the caches (the old times describe other
        forwards)."""
        fields: dict[str, Any] = dict(
            fw=self.fw,
            bw=self.bw,
            cw=self.cw,
            cbw=self.cbw,
            fwd_tmp=self.fwd_tmp,
            bwd_tmp=self.bwd_tmp,
            reversible=self.reversible,
            inverse_time=self.inverse_time,
            offload_time=self.offload_time,
            options=self.options,
            names=self.names,
            grad_fwd_tmp=self.grad_fwd_tmp,
            stopped_fw=self.stopped_fw,
            caches=self.caches,
        )
        if "fw" in changes and "stopped_fw" not in changes:
            fields["stopped_fw"] = None
        if "fw" in changes and "caches" not in changes:
            fields["caches"] = None
        fields.update(changes)
        return Chain(**fields)

    def stage_options(self, i: int) -> tuple[StageOption, ...]:
        """All ways to run stage ``i`` (0..L, the loss included) with autograd, the plain one first."""
        if i == self.length:
            return (StageOption("", 0.0, self.bw[i], 0.0, 0.0, self.bwd_tmp[i]),)
        plain = StageOption("", self.fw[i], self.bw[i], self.cbw[i + 1], self._grad_fwd_tmp(i), self.bwd_tmp[i])
        return (plain,) + self.options[i]

    def _grad_fwd_tmp(self, i: int) -> float:
        """The transient memory of stage i's plain forward with autograd."""
        return self.fwd_tmp[i] if self.grad_fwd_tmp is None else self.grad_fwd_tmp[i]

    def cached_fwd_tmp(self, i: int, grad: bool) -> float:
        """The transient memory of a forward of stage i that reads its kept cache (with autograd or not)."""
        if grad:
            return self._grad_fwd_tmp(i)
        cache = self.caches[i]
        return cache.fwd_tmp if cache is not None and cache.fwd_tmp is not None else self.fwd_tmp[i]

    def cached_stopped_fw(self, i: int) -> float:
        """The time of stage i's stopped recomputation while its cache is kept (:attr:`caches`)."""
        cache = self.caches[i]
        if cache is None:
            return self.stopped_fw[i]
        return max(0.0, self.stopped_fw[i] - (self.fw[i] - cache.fw))
