"""``Checkpointable``: run a sequential model with the fastest schedule that fits a memory budget.

rotor's API (``Checkpointable(model, input=None, mem_limit=None, mem_slots=500, verbosity=0,
preserve_rng_state=True)``, ``.measure()``, ``.compute_sequence()``, ``.get_expected_memory()``,
``.get_expected_makespan()``), on cpu, cuda and xla, with the planner's extra options: stages that have an
``inverse`` (e.g. :class:`revlib_xla.ReversibleModule`) may be run reversibly, and checkpoints may be offloaded to
host memory when a bandwidth is given.

**The budget** is rotor's: the bytes of activations, their gradients and temporaries of the chain, the model's
input included; parameters, their gradients and optimizer state are not counted. Unlike rotor, it also counts the
model's output and its gradient for the whole backward pass (the caller holds the one, autograd the other), so
the measured peak stays within the budget; on XLA, where lifetimes follow the compiled program's dataflow, it
counts them only while the program needs them. ``mem_limit=None`` means the
fastest plan (no recomputation) on cpu and xla, and 90 % of the free memory on cuda, as rotor does.

``mem_limit`` is a number of bytes or text with a unit (``"1GB"`` = 10**9 bytes, ``"512MiB"`` = 512 * 2**20:
:func:`revlib_xla.units.parse_bytes`).

In training mode (and with autograd on) the forward runs the schedule inside one ``autograd.Function``: the
forward phase stores the planned checkpoints and the backward phase recomputes the rest. Stage inputs and outputs
may be tensors or tuples, lists, dicts and named tuples of them (walked with ``torch.utils._pytree``). The backward
gives what plain autograd gives for ``backward()`` (parameter gradients accumulated into ``.grad`` stage by stage),
``backward(inputs=...)`` and ``torch.autograd.grad`` (of inputs or parameters; nothing else is computed or stored),
a second ``backward()`` through a graph kept with ``retain_graph=True`` (the forward phase runs again, with the
first run's random numbers), and ``create_graph=True`` (double backward: the whole model runs again with autograd,
so that one backward holds what the plain model holds). Each stage runs with the random numbers, autocast state
and buffer values of its first run (:mod:`revlib_xla.recompute`). In eval mode, or under ``torch.no_grad()``, it is
the plain model.

The class is a composition of the planner's parts, each usable on its own: :func:`~revlib_xla.planner.measure_chain`
(sizing: the model's stages measured into a chain of costs), :func:`~revlib_xla.planner.plan` (the pure planning
step: a chain in, a schedule out) and :func:`~revlib_xla.planner.run_schedule` (execution of a schedule;
:class:`~revlib_xla.planner.ScheduleExecutor` runs a given schedule on a model).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .. import backends
from ..recompute import CallReplay, RecomputeState
from ..reversible.repeat import ScanUnsupported
from ..units import parse_bytes
from .chain import Chain
from .execute import check_schedule, run_schedule
from .measure import StageMeasurement, detached, tensor_leaves, value_bytes
from .scanned import scan_runs, stack_stages
from .schedule import OpKind, Schedule
from .sizing import Sizing, fit_budget, measure_chain
from .solver import min_memory, no_checkpoint_memory, plan
from .stages import atomic, check_one_input, flatten_sequential

__all__ = ["Checkpointable", "SavedAs", "atomic", "flatten_sequential"]

logger = logging.getLogger("revlib_xla.checkpointable")  # its name before it moved under planner/


Signature = tuple[tuple[tuple[int, ...], torch.dtype, str], ...]


def _signature(x: Any) -> Signature:
    return tuple((tuple(t.shape), t.dtype, t.device.type) for t in tensor_leaves(x))


def _covers(big: Signature, small: Signature) -> bool:
    """Whether every tensor of an input of signature ``small`` is, dimension by dimension, at most the size of the
    same tensor in ``big`` (same dtypes and devices): whatever a schedule holds for ``big`` bounds what it holds
    for ``small``."""
    return len(big) == len(small) and all(
        b[1:] == s[1:] and len(b[0]) == len(s[0]) and all(x >= y for x, y in zip(b[0], s[0]))
        for b, s in zip(big, small)
    )


def _elements(signature: Signature) -> int:
    total = 0
    for shape, _, _ in signature:
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


class SavedAs(nn.Module):
    """``module`` run with what autograd saves stored in ``dtype`` (see
    :func:`revlib_xla.utils.memory_efficient_intermediates`): a lossy, smaller way to run a stage with autograd."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, x: Any) -> Any:
        from ..intermediates import memory_efficient_intermediates

        with memory_efficient_intermediates(storage_dtype=self.dtype):
            return self.module(x)


class Checkpointable(nn.Module):
    """Run ``model`` (an ``nn.Sequential``) with the fastest schedule that fits ``mem_limit`` bytes.

    Args:
        model: the network, an ``nn.Sequential`` (nested ones are flattened; see :func:`atomic`).
        input: a sample input; if given, the model is measured now, else at the first training forward.
        mem_limit: the budget (rotor's meaning; see the module docstring): a number of bytes, or a string with a
            unit, ``"1GB"`` (10**9 bytes) or ``"512MiB"`` (512 * 2**20 bytes); see
            :func:`revlib_xla.units.parse_bytes`.
        mem_slots: resolution of the budget in the dynamic program (sizes are rounded up to mem_limit/mem_slots).
        verbosity: 1 logs the plan, 2 also the measurements.
        preserve_rng_state: each stage draws its random numbers (dropout) from generators of its own, seeded from
            one seed drawn per forward from torch's global generator, and its recomputations draw the same ones,
            also while other threads draw from the global generators (see :mod:`revlib_xla.recompute`). The
            masks differ from those the plain model draws from the global generator; each is a valid draw, and the
            gradients are the plain model's for the masks drawn. ``False``: stages draw from the global generators
            and recomputations draw other numbers.
        reversible: let stages with an ``inverse`` method drop their input and rebuild it (``Fr``/``Br``).
        offload_bandwidth: bytes/second between device and host memory; given, checkpoints may be offloaded.
        loss_tmp_memory_usage: transient memory of the loss computed on the output (rotor's parameter).
        options: per-stage alternatives for running with autograd, ``{stage index: [(name, module), ...]}``; each
            module computes the same function as the stage and shares its parameters, e.g. with compressed saved
            activations. The planner measures them and picks per stage.
        scan: run every run of two or more consecutive stages identical in structure as one stage with
            rematerialisation inside (:class:`revlib_xla.scan.ScannedStages`): on XLA, one layer compiled in two
            while loops, whatever the run's length. The planner then decides for the run as a whole (keep the
            layers' inputs, or checkpoint the run's input and recompute the run's forward in the backward), never
            per layer inside it; each layer inside is recomputed once in the backward. Raises ``ValueError`` when
            no run can be scanned (naming why), or with ``options``/``saved_dtypes`` (they name stages by index).
            :func:`revlib_xla.scan.stack_layers` on the Checkpointable then stores each run's parameters stacked, so
            the step holds them and their gradients once (call it before building the optimizer).
        attention_cache: stages whose attention runs as one fused kernel (``scaled_dot_product_attention`` on
            eager devices) may keep what it returned from their first run until their backward, and their
            recomputations read it instead of running attention again (selective recomputation, operation ``CA``;
            :mod:`revlib_xla.planner.attention_cache`). The planner measures each stage's cache and uses it where the
            budget holds it and it saves time. Gradients are the same either way. Not combined with reversible
            stages or offload (the plan then keeps no cache).
    """

    def __init__(
        self,
        model: nn.Module,
        input: Any = None,
        mem_limit: float | str | None = None,
        mem_slots: int = 500,
        verbosity: int = 0,
        preserve_rng_state: bool = True,
        reversible: bool = True,
        offload_bandwidth: float | None = None,
        loss_tmp_memory_usage: int = 0,
        options: Mapping[int, Sequence[tuple[str, nn.Module]]] | None = None,
        saved_dtypes: Sequence[torch.dtype] = (),
        tpu_generation: str | None = "v5e",
        scan: bool = False,
        attention_cache: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        self.stages = flatten_sequential(model)
        self.scan = scan
        if scan:
            self.stages = _scanned(self.stages, options, saved_dtypes)
        for index, stage in enumerate(self.stages):
            check_one_input(index, stage)
        self.mem_limit = None if mem_limit is None else parse_bytes(mem_limit, "Checkpointable: mem_limit")
        self.mem_slots = mem_slots
        self.verbosity = verbosity
        self.preserve_rng_state = preserve_rng_state
        self.reversible = reversible
        self.offload_bandwidth = offload_bandwidth
        self.loss_tmp_memory_usage = loss_tmp_memory_usage
        self.tpu_generation = tpu_generation
        self.attention_cache = attention_cache
        self.stage_options = {int(k): list(v) for k, v in (options or {}).items()}
        for dtype in saved_dtypes:
            for index, stage in enumerate(self.stages):
                self.stage_options.setdefault(index, []).append(
                    (f"saved as {dtype}".replace("torch.", ""), SavedAs(stage, dtype))
                )
        for index in self.stage_options:
            if not 0 <= index < len(self.stages):
                raise ValueError(
                    f"Checkpointable: options given for stage {index}; the model has stages 0..{len(self.stages) - 1}"
                )
        self._option_modules = nn.ModuleList([m for opts in self.stage_options.values() for _, m in opts])
        self.chain: Chain | None = None
        self.sequence: Schedule | None = None
        self.measurements: list[StageMeasurement] = []
        self.tpu_hbm_bytes: int | None = None
        self._signature: Signature | None = None
        self._sample: Any = None
        self._runnable: Schedule | None = None  # the last schedule checked against the chain
        # the plans made for each input signature met (see _plan_for), and the signature each was measured at
        self._plans: dict[Signature, dict[str, Any]] = {}
        if input is not None:
            self.measure(input)
            self.compute_sequence()

    # -- sizing ------------------------------------------------------------------------------------------------
    def sizing(self) -> Sizing:
        """How :meth:`measure` measures the stages, from this module's settings."""
        return Sizing(
            reversible=self.reversible,
            offload_bandwidth=self.offload_bandwidth,
            loss_tmp_memory_usage=self.loss_tmp_memory_usage,
            tpu_generation=self.tpu_generation,
            verbosity=self.verbosity,
            attention_cache=getattr(self, "attention_cache", True),  # (modules pickled before it existed)
        )

    def measure(self, sample_input: Any) -> Chain:
        """Measure every stage on ``sample_input`` (times on the device, sizes in bytes) and build the chain
        (:func:`~revlib_xla.planner.measure_chain`). Invalidates the current schedule.

        Under several processes (torch.distributed initialized) every process plans from the first process's chain
        (:func:`agreed_chain`): measured times differ from process to process, and two processes whose schedules
        recompute in different orders issue FSDP2's collectives in different orders and wait for each other for
        ever. Every process must then measure together (the same input shape at the same step)."""
        measured = measure_chain(self.stages, sample_input, self.stage_options, self.sizing())
        self.measurements = measured.measurements
        self.chain = agreed_chain(measured.chain)
        self._signature = _signature(sample_input)
        self._sample = detached(sample_input) if measured.lazy else None  # XLA device data: what fit_to_tpu traces
        self.sequence = None
        return self.chain

    # -- planning ----------------------------------------------------------------------------------------------
    def _need_chain(self, caller: str) -> Chain:
        if self.chain is None:
            raise RuntimeError(
                f"Checkpointable.{caller}: call measure(sample_input) first (or pass input= to the constructor)"
            )
        return self.chain

    def compute_sequence(self, mem_limit: float | str | None = None, mem_slots: int | None = None) -> Schedule:
        """Solve for the fastest schedule within ``mem_limit`` (bytes, or a string such as ``"1GB"``; default: the
        one given at construction, else the fastest plan: see the module docstring)."""
        chain = self._need_chain("compute_sequence")
        if mem_limit is not None:
            limit = parse_bytes(mem_limit, "Checkpointable.compute_sequence: mem_limit")
        else:
            limit = self.mem_limit if self.mem_limit is not None else self._default_limit()
        self.sequence = plan(chain, limit, mem_slots or self.mem_slots, held=self.held_during_backward())
        if self.verbosity >= 1:
            logger.info("%s", self.sequence.describe())
        return self.sequence

    def held_during_backward(self) -> float:
        """Bytes outside the chain's model that stay alive through the backward phase.

        Eager (cpu, cuda): the model's output (the caller holds it) and its gradient (autograd holds it until the
        whole backward returns), and on the CPU each stage's captured random state (the plain model's random
        numbers: :meth:`~revlib_xla.recompute.CallReplay.held_bytes`). Measured on XLA: 0. There lifetimes follow
        the compiled program's dataflow: the output dies once the loss's gradient has been computed from it and
        that gradient once the last stage's backward has consumed it, both already counted by the chain (its ``L``
        and ``B`` operations). A step that also returns the output keeps it for the whole program, outside this
        count."""
        chain = self._need_chain("held_during_backward")
        return 0.0 if self._sample is not None else 2 * chain.cw[-1] + self.random_state_bytes()

    def random_state_bytes(self) -> int:
        """Bytes of the device's memory a call holds for its stages' random numbers to replay
        (:meth:`~revlib_xla.recompute.CallReplay.held_bytes`: 5,056 per stage on the CPU, none elsewhere)."""
        device = next((t.device for t in self.parameters()), torch.device("cpu"))
        return CallReplay.held_bytes(device, len(self.stages), self.preserve_rng_state)

    def min_memory(self) -> float:
        """The smallest mem_limit any schedule fits in (bytes)."""
        return min_memory(self._need_chain("min_memory")) + self.held_during_backward()

    def no_checkpoint_memory(self) -> float:
        """The mem_limit at which nothing is recomputed (bytes)."""
        return no_checkpoint_memory(self._need_chain("no_checkpoint_memory")) + self.held_during_backward()

    def _default_limit(self) -> float:
        plain = self.no_checkpoint_memory()
        device = next((t.device for t in self.parameters()), torch.device("cpu"))
        free = backends.free_memory(device)
        return plain if free is None else min(plain, 0.9 * free)

    # -- sizing with the TPU compiler --------------------------------------------------------------------------
    def fit_to_tpu(
        self, hbm_bytes: float | str, loss_fn: Any | None = None, generation: str | None = None, probes: int = 6
    ) -> Schedule:
        """Plan for a TPU without one: the fastest schedule found whose training step, compiled deviceless for
        the TPU ``generation`` (default: ``tpu_generation``), fits ``hbm_bytes`` of HBM as the TPU compiler counts
        it (parameters, gradients, activations, temporaries and code: the whole step).

        Per-stage sizes do not add up exactly under XLA's whole-program optimization, so this closes the loop: a
        binary search over the planner's budget, between the smallest one and the no-checkpoint peak, compiling
        the step at each probe (``probes`` compiles after the two ends: :func:`~revlib_xla.planner.fit_budget`).
        ``loss_fn(output)`` makes the step's loss (default: the sum of the output). The model must have been
        measured on an XLA input. Sets and returns :attr:`sequence`; :attr:`tpu_hbm_bytes` is the compiled peak of
        that schedule.
        """
        from ..compiled.memory import tpu_memory

        self._require_xla_sample("fit_to_tpu")
        limit = parse_bytes(hbm_bytes, "Checkpointable.fit_to_tpu: hbm_bytes")
        chosen = generation or self.tpu_generation or "v5e"
        loss = loss_fn or (lambda out: sum(t.sum() for t in tensor_leaves(out)))

        def compiled_peak(budget: float) -> tuple[Schedule, int]:
            schedule = self.compute_sequence(budget)
            return schedule, tpu_memory(self._step_stablehlo(loss), chosen).hbm_peak_bytes

        budget, _, peak = fit_budget(
            compiled_peak, self.min_memory() * 1.02, self.no_checkpoint_memory(), limit, probes, chosen
        )
        self.sequence = self.compute_sequence(budget)
        self.tpu_hbm_bytes = peak
        return self.sequence

    def tpu_activation_memory(self, loss_fn: Any | None = None, generation: str | None = None) -> int:
        """What the current schedule's training step keeps, as the TPU compiler plans it (deviceless compile of the
        whole step, no TPU): the peak of the live values other than the step's arguments and outputs (liveness over
        the compiled program, every buffer in HBM: ``tpu_memory(..., hbm_only=True, liveness=True)``) plus the
        model's input. The same quantity as :meth:`get_expected_memory`, measured instead of planned.

        ``loss_fn(output)`` makes the step's loss (default: the mean of the squared outputs, whose gradient depends
        on the output as a real loss's does; ``sum()`` would let the compiler fold the seed gradient into a
        constant). The model must have been measured on an XLA input.
        """
        from ..compiled.memory import tpu_memory

        self._require_xla_sample("tpu_activation_memory")
        self._need_sequence()
        loss = loss_fn or (
            lambda out: sum(t.float().pow(2).mean() for t in tensor_leaves(out) if t.is_floating_point())
        )
        compiled = tpu_memory(
            self._step_stablehlo(loss), generation or self.tpu_generation or "v5e", hbm_only=True, liveness=True
        )
        live = compiled.live_peak_bytes
        if live is None:
            raise RuntimeError("Checkpointable.tpu_activation_memory: the TPU compiler gave no liveness")
        return live + value_bytes(self._sample)

    def _require_xla_sample(self, caller: str) -> None:
        if self._sample is None or self.chain is None:
            raise RuntimeError(
                f"Checkpointable.{caller}: measure the model on an XLA input first "
                "(Checkpointable(model.to(xla_device), input=x_on_xla))"
            )

    def _step_stablehlo(self, loss: Any) -> str:
        """The StableHLO of one training step of the current schedule on the measured XLA sample."""
        from ..compiled.stablehlo import step_stablehlo

        return step_stablehlo(lambda m, x: loss(self(x)).backward(), self.model, self._sample)

    # -- the plan ----------------------------------------------------------------------------------------------
    def get_expected_memory(self) -> float:
        """Peak bytes the schedule needs (activations, their gradients, temporaries; the input, the output and its
        gradient included)."""
        return self._need_sequence().peak_memory + self.held_during_backward()

    def get_expected_makespan(self) -> float:
        """The schedule's total time (seconds, or FLOPs for a chain measured on XLA)."""
        return self._need_sequence().makespan

    def _need_sequence(self) -> Schedule:
        if self.sequence is None:
            raise RuntimeError("Checkpointable: no schedule yet; call measure() and compute_sequence() first")
        return self.sequence

    def display(self) -> str:
        """A readable description of the schedule."""
        return self._need_sequence().describe()

    # -- running -----------------------------------------------------------------------------------------------
    def recompute_state(self) -> RecomputeState:
        """What the recompute engine learns about the stages across calls (:mod:`revlib_xla.recompute`)."""
        return RecomputeState.of(self)

    def forward(self, x: Any, *more: Any) -> Any:
        if more:
            raise TypeError(
                f"Checkpointable takes the model's input as one argument, as nn.Sequential does; got "
                f"{1 + len(more)}. Pass several tensors as one tuple, checkpointed((a, b)): the first "
                f"stage receives the tuple as its one argument"
            )
        if not (self.training and torch.is_grad_enabled()):
            if getattr(self.model, "_stage_stacks", None) is None:
                return self.model(x)
            for stage in self.stages:  # stacked storage (scan.stack_layers): the scanned runs read the stacks
                x = stage(x)
            return x
        if self._signature is not None and _signature(x) != self._signature:
            self._plan_for(_signature(x))
        if self.chain is None:
            self.measure(x)
        if self.sequence is None:
            self.compute_sequence()
        sequence = self._checked_sequence()
        if _recomputes_nothing(sequence) and not _shared_parameters(self.stages):
            # Every stage kept whole, nothing recomputed, offloaded or compressed: autograd's own run, which holds
            # only what the stages save (the executor would also keep each stage's input as its own leaf). Each
            # stage draws the random numbers it draws under the executor (its own seed, derived as there). Not
            # where stages share a parameter (a tied embedding and LM head): autograd would hold one stage's
            # gradient of it until the other's backward (a whole vocabulary-sized gradient through the backward),
            # where the executor accumulates each stage's gradient as that stage's backward ends.
            replay = CallReplay(next(iter(tensor_leaves(x))).device, self.preserve_rng_state)
            with self.recompute_state().python_random_check(type(self).__name__):
                for i, stage in enumerate(self.stages):
                    with replay.first_run(i):
                        x = stage(x)
            return x
        return run_schedule(self, sequence, x)

    #: what a plan for one input signature consists of (a subclass that measures more adds its attributes)
    plan_state: tuple[str, ...] = ("chain", "measurements", "sequence", "_signature", "_sample", "_runnable")

    def _plan_for(self, signature: Signature) -> None:
        """Make the plan for inputs of ``signature`` the current one: the one made for it before; else that of the
        smallest input met whose every tensor is at least as large (:func:`_covers`: its schedule holds no more for
        this one, so the budget is kept, without measuring again: a padding collator's batch lengths); else none,
        and the forward measures and plans this shape (a larger one than any met). The current plan is kept for its
        own signature."""
        if self._signature is not None and self.chain is not None:
            self._plans[self._signature] = {name: getattr(self, name) for name in self.plan_state}
        entry = self._plans.get(signature)
        if entry is None:
            covering = [sig for sig in self._plans if _covers(sig, signature)]
            if covering:
                source = min(covering, key=_elements)
                entry = dict(self._plans[source], _signature=signature)
                self._plans[signature] = entry
                logger.info("Checkpointable: input %s runs the plan made for %s", signature, source)
        if entry is None:
            logger.info(
                "Checkpointable: input %s is larger than those planned for; measuring and planning it", signature
            )
            self.chain = None
            self.sequence = None
            return
        for name, value in entry.items():
            setattr(self, name, value)

    def _stack_layers(self) -> Checkpointable:
        """What :func:`revlib_xla.reversible.stacking.stack_layers` does for a Checkpointable: its scanned runs'
        parameters stored stacked (:func:`~revlib_xla.planner.scanned.stack_stages`)."""
        stack_stages(self.model, self.stages)
        return self

    def _checked_sequence(self) -> Schedule:
        """:attr:`sequence`, checked once to run on this chain (it may have been set by hand)."""
        schedule = self._need_sequence()
        if schedule is not self._runnable:
            check_schedule(schedule, self._need_chain("forward"))
            self._runnable = schedule
        return schedule


def _scanned(stages: list[nn.Module], options: Any, saved_dtypes: Sequence[torch.dtype]) -> list[nn.Module]:
    """``Checkpointable(scan=True)``'s stages: runs of identical stages as
    :class:`~revlib_xla.planner.scanned.ScannedStages`."""
    if options or saved_dtypes:
        raise ValueError(
            "Checkpointable(scan=True): options and saved_dtypes name stages by index, which scanning regroups; "
            "pass scan=False to use them"
        )
    try:
        return scan_runs(stages)
    except ScanUnsupported as why:
        raise ValueError(f"Checkpointable(scan=True): {why}. Pass scan=False to run the stages one by one") from None


def agreed_chain(chain: Chain) -> Chain:
    """``chain`` as the first process measured it, where torch.distributed runs several processes (a broadcast of
    the measured costs; the solver is deterministic, so every process then plans the same schedule); ``chain``
    itself otherwise."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return chain
    box = [chain if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    agreed = box[0]
    assert isinstance(agreed, Chain)
    return agreed


def _recomputes_nothing(schedule: Schedule) -> bool:
    """Whether ``schedule`` runs each stage once, plainly with autograd (``Fe`` with its first option), and
    nothing else but the loss and the backwards."""
    plain = (OpKind.FE, OpKind.L, OpKind.B)
    return all(op.kind in plain and op.option == 0 for op in schedule.ops)


def _shared_parameters(stages: Sequence[nn.Module]) -> bool:
    """Whether a parameter belongs to more than one of ``stages``."""
    seen: set[int] = set()
    for stage in stages:
        own = {id(p) for p in stage.parameters()}
        if own & seen:
            return True
        seen |= own
    return False
