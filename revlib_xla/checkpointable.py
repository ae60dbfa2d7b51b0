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

In training mode (and with autograd on) the forward runs the schedule inside one ``autograd.Function``: the
forward phase stores the planned checkpoints and the backward phase recomputes the rest, each stage with the
random numbers, autocast state and buffer values of its first run (:mod:`revlib_xla.recompute`). In eval mode, or
under ``torch.no_grad()``, it is the plain model.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import backend
from .coupling import optional_detach
from .recompute import CallReplay, RecomputeState, SavedBuffers, owned_buffers, probe
from .planner import Chain, InfeasibleBudget, Schedule, min_memory, no_checkpoint_memory, solve
from .planner.chain import StageOption
from .memory import tensor_bytes
from .planner.measure import (InPlaceInput, StageMeasurement, StagePrograms, grad_leaves, measure_stage,
                              stage_programs)
from .planner.schedule import Op

__all__ = ["Checkpointable", "SavedAs", "atomic", "flatten_sequential"]

logger = logging.getLogger(__name__)


def atomic(module: nn.Module) -> nn.Module:
    """Mark an ``nn.Sequential`` as one stage (the planner will not split it). Returns the module."""
    module._revlib_atomic = True
    return module


def _is_atomic(module: nn.Module) -> bool:
    return getattr(module, "_revlib_atomic", False) or getattr(module, "not_really_sequential", False)


def flatten_sequential(model: nn.Module) -> List[nn.Module]:
    """The stages of ``model``: nested ``nn.Sequential`` containers are flattened (unless marked with
    :func:`atomic`), and a module that starts with an in-place operation on its input (``ReLU(inplace=True)``)
    is merged into the stage before it, so that no stage overwrites its own input, which may be a checkpoint."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"Checkpointable needs an nn.Sequential, got {type(model).__name__}. Write the model as "
            f"nn.Sequential(stage_0, stage_1, ...) where each stage takes the previous stage's output (a tensor or a "
            f"tuple of tensors); revlib_xla.models has ResNets and a GPT written this way.")
    flat: List[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, nn.Sequential) and not _is_atomic(module):
            for child in module:
                visit(child)
        elif flat and getattr(module, "inplace", False):
            flat[-1] = atomic(nn.Sequential(flat[-1], module))
        else:
            flat.append(module)

    visit(model)
    if not flat:
        raise ValueError("Checkpointable: the model has no stages (an empty nn.Sequential)")
    return flat


def _signature(x: Any) -> Tuple:
    return tuple((tuple(t.shape), t.dtype, t.device.type) for t in backend.tensors_in(x))


def _input_grads(x: Any) -> Tuple[Optional[torch.Tensor], ...]:
    """The gradients of a stage's input leaves, taken off the leaves: autograd's graph may keep a leaf alive (its
    AccumulateGrad node) after the leaf is dropped, and the gradient must not live as long."""
    grads = []
    for t in backend.tensors_in(x):
        grads.append(t.grad if t.requires_grad else None)
        if t.requires_grad:
            t.grad = None
    return tuple(grads)


class _Run:
    """One execution of a schedule: the live tensors between its forward phase and its backward phase."""

    def __init__(self, owner: "Checkpointable", schedule: Schedule, device: torch.device) -> None:
        self.owner = owner
        self.stages = owner.stages
        self.schedule = schedule
        self.loss_at = next(k for k, op in enumerate(schedule.ops) if op.kind == "L")
        self.device = device
        self.x: Dict[int, Any] = {}
        self.xbar: Dict[int, Tuple[Any, Any]] = {}
        self.grad: Dict[int, Tuple[Optional[torch.Tensor], ...]] = {}
        self.host: Dict[int, Any] = {}
        self.held: set = set()
        self.replay = CallReplay(device, owner.preserve_rng_state)
        self.buffers = [owned_buffers(stage.modules()) for stage in self.stages]
        self.saved: Dict[int, Optional[SavedBuffers]] = {}  # per stage: the buffers its first run changed
        self.to_put_back: Dict[int, List[torch.Tensor]] = {}  # per stage: their values to restore after its backward

    # -- running one stage, as its first run did ---------------------------------------------------------------
    def _call(self, i: int, x: Any, recompute: bool, inverse: bool = False, option: int = 0) -> Any:
        stage = self.stages[i] if option == 0 else self.owner.stage_options[i][option - 1][1]
        fn = self.stages[i].inverse if inverse else stage
        state = RecomputeState.of(self.owner)
        if not recompute:
            watch = state.watch(self.buffers[i])
            with self.replay.first_run(i):
                out = fn(x)
            self.saved[i] = state.changed(watch, f"Checkpointable stage {i} ({type(self.stages[i]).__name__})")
            return out
        saved = self.saved.get(i)
        tensors = [b for _, b in self.buffers[i]]
        current = saved.swap_in(tensors) if saved is not None else None
        with self.replay.rerun(i):
            out = fn(x)
        if current is not None:
            if torch.is_grad_enabled():  # the stage's backward may read them: put back after it
                self.to_put_back.setdefault(i, current)
            else:
                saved.put_back(tensors, current)
        return out

    def _put_back(self, i: int) -> None:
        """After stage ``i``'s backward: its buffers get the values its first run left again."""
        current = self.to_put_back.pop(i, None)
        if current is not None:
            self.saved[i].put_back([b for _, b in self.buffers[i]], current)

    def _barrier(self, i: int, *extra: Any) -> Any:
        """Before a recomputation on XLA: stop the compiler from merging it with the forward (CSE), and from
        starting it before the gradient it waits for exists. Returns x_i behind the barrier, the input to recompute
        from.

        x_i is either a checkpoint (``self.x``, barriered in place) or the output of stage i-1 run with autograd
        (``self.xbar``, e.g. kept since the forward phase): that one is an output of a graph autograd still needs,
        so a detached alias of it goes behind the barrier. Without it the recomputation reads the very tensor the
        forward read, and the compiler merges the two and keeps the forward's intermediates until the backward."""
        x = self.x.get(i)
        if x is None and i in self.xbar:
            x = optional_detach(self.xbar[i][1])
        tensors = [t for obj in (x, *extra) for t in backend.tensors_in(obj)]
        backend.optimization_barrier_(tensors)
        if i == 0 and x is not None:
            # x_0 is the model's input, normally an argument of the step: see backend.after.
            x = backend.after(x, next(iter(backend.tensors_in(extra)), None))
        return x if x is not None else self._input(i)

    def _free_input(self, i: int) -> None:
        if i != 0 and i not in self.held:
            self.x.pop(i, None)

    def _input(self, i: int) -> Any:
        if i in self.x:
            return self.x[i]
        return self.xbar[i][1]

    def run(self, ops: Sequence[Op], backward: bool) -> None:
        for op in ops:
            i = op.index
            if op.kind in ("Fn", "CF", "Fr"):
                x = self._barrier(i, self.grad.get(self._pending_grad())) if backward else self._input(i)
                with torch.no_grad():
                    out = self._call(i, x, recompute=backward)
                del x
                self.x[i + 1] = out
                if op.kind == "Fr":
                    self.held.add(i + 1)
                    self.x.pop(i, None)
                elif op.kind == "Fn":
                    self._free_input(i)
            elif op.kind == "Fe":
                x = self._barrier(i, self.grad.get(self._pending_grad())) if backward else self._input(i)
                inp = grad_leaves(x)
                del x
                with torch.enable_grad():
                    out = self._call(i, inp, recompute=backward, option=op.option)
                self.xbar[i + 1] = (inp, out)
            elif op.kind == "B":
                inp, out = self.xbar.pop(i + 1)
                self._backward(out, self.grad.pop(i + 1))
                self._put_back(i)
                self.grad[i] = _input_grads(inp)
                del inp, out
                self._free_input(i)
            elif op.kind == "Br":
                later = self._barrier(i + 1, self.grad.get(i + 1))
                self.x.pop(i + 1, None)
                self.held.discard(i + 1)
                with torch.no_grad():
                    rebuilt = self._call(i, later, recompute=True, inverse=True)
                del later
                inp = grad_leaves(rebuilt)
                with torch.enable_grad():
                    out = self._call(i, inp, recompute=True, option=op.option)
                self._backward(out, self.grad.pop(i + 1))
                self._put_back(i)
                self.grad[i] = _input_grads(inp)
                del out
                if i in self.held:
                    self.x[i] = optional_detach(rebuilt)
                del inp, rebuilt
            elif op.kind == "WM":
                x = self.x.pop(i)
                self.host[i] = (_structure(x), [backend.to_host(t) for t in backend.tensors_in(x)])
                del x
            elif op.kind == "RM":
                structure, copies = self.host.pop(i)
                self.x[i] = _rebuild(structure, [backend.to_device(c) for c in copies])
            elif op.kind == "L":
                pass

    def _pending_grad(self) -> int:
        return min(self.grad) if self.grad else -1

    @staticmethod
    def _backward(out: Any, grads: Tuple[Optional[torch.Tensor], ...]) -> None:
        pairs = [(o, g) for o, g in zip(backend.tensors_in(out), grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


class _Schedule(torch.autograd.Function):
    """Forward phase of the schedule in ``forward``, backward phase in ``backward``; parameters receive their
    gradients from the stage graphs built inside (``dummy`` makes the output require grad even when the input does
    not)."""

    @staticmethod
    def forward(ctx, run: _Run, dummy: torch.Tensor, *inputs: torch.Tensor):
        structure = run.owner._input_structure
        x0 = _rebuild(structure, list(inputs))
        run.x[0] = x0
        run.run(run.schedule.ops[:run.loss_at], backward=False)
        out = run._input(len(run.stages))
        ctx.run = run
        run.out_structure = _structure(out)
        flat = [t.detach() for t in backend.tensors_in(out)]
        ctx.mark_non_differentiable(*[t for t in flat if not (t.is_floating_point() or t.is_complex())])
        return tuple(flat)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        run: _Run = ctx.run
        ctx.run = None
        n = len(run.stages)
        run.grad[n] = tuple(grads)
        try:
            run.run(run.schedule.ops[run.loss_at + 1:], backward=True)
        finally:
            for i in list(run.to_put_back):
                run._put_back(i)
        input_grads = run.grad.pop(0)
        run.x.clear()
        return (None, None) + tuple(input_grads)


def _rebuild(structure: Any, flat: List[torch.Tensor]) -> Any:
    if structure is torch.Tensor:
        return flat.pop(0)
    if isinstance(structure, tuple) and structure and structure[0] == "seq":
        kind, items = structure[1], structure[2]
        return kind(_rebuild(item, flat) for item in items)
    return structure


def _structure(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.Tensor
    if isinstance(x, (tuple, list)):
        return ("seq", type(x), tuple(_structure(item) for item in x))
    return x


class SavedAs(nn.Module):
    """``module`` run with what autograd saves stored in ``dtype`` (see
    :func:`revlib_xla.utils.memory_efficient_intermediates`): a lossy, smaller way to run a stage with autograd."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.dtype = dtype

    def forward(self, x: Any) -> Any:
        from .intermediates import memory_efficient_intermediates

        with memory_efficient_intermediates(storage_dtype=self.dtype):
            return self.module(x)


class Checkpointable(nn.Module):
    """Run ``model`` (an ``nn.Sequential``) with the fastest schedule that fits ``mem_limit`` bytes.

    Args:
        model: the network, an ``nn.Sequential`` (nested ones are flattened; see :func:`atomic`).
        input: a sample input; if given, the model is measured now, else at the first training forward.
        mem_limit: the budget in bytes (rotor's meaning; see the module docstring).
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
    """

    def __init__(self, model: nn.Module, input: Any = None, mem_limit: Optional[float] = None,
                 mem_slots: int = 500, verbosity: int = 0, preserve_rng_state: bool = True,
                 reversible: bool = True, offload_bandwidth: Optional[float] = None,
                 loss_tmp_memory_usage: int = 0,
                 options: Optional[Dict[int, Sequence[Tuple[str, nn.Module]]]] = None,
                 saved_dtypes: Sequence[torch.dtype] = (),
                 tpu_generation: Optional[str] = "v5e") -> None:
        super().__init__()
        self.model = model
        self.stages = flatten_sequential(model)
        self.mem_limit = mem_limit
        self.mem_slots = mem_slots
        self.verbosity = verbosity
        self.preserve_rng_state = preserve_rng_state
        self.reversible = reversible
        self.offload_bandwidth = offload_bandwidth
        self.loss_tmp_memory_usage = loss_tmp_memory_usage
        self.tpu_generation = tpu_generation
        self.stage_options = {int(k): list(v) for k, v in (options or {}).items()}
        for dtype in saved_dtypes:
            for index, stage in enumerate(self.stages):
                self.stage_options.setdefault(index, []).append((f"saved as {dtype}".replace("torch.", ""),
                                                                 SavedAs(stage, dtype)))
        for index in self.stage_options:
            if not 0 <= index < len(self.stages):
                raise ValueError(f"Checkpointable: options given for stage {index}; the model has stages "
                                 f"0..{len(self.stages) - 1}")
        self._option_modules = nn.ModuleList([m for opts in self.stage_options.values() for _, m in opts])
        self.chain: Optional[Chain] = None
        self.sequence: Optional[Schedule] = None
        self.measurements: List[StageMeasurement] = []
        self._signature: Optional[Tuple] = None
        self._sample: Any = None
        self._input_structure: Any = None
        if input is not None:
            self.measure(input)
            self.compute_sequence()

    # -- planning ----------------------------------------------------------------------------------------------
    def measure(self, sample_input: Any) -> Chain:
        """Measure every stage on ``sample_input`` (times on the device, sizes in bytes) and build the chain.
        Invalidates the current schedule."""
        x = optional_detach(sample_input)
        measured: List[StageMeasurement] = []
        options: List[List[StageOption]] = []
        progress = _progress(len(self.stages), "measuring stages", self.verbosity)
        lazy = any(backend.is_tracing_lazily(t) for t in backend.tensors_in(x))
        programs: List[List[StagePrograms]] = []  # per stage: the plain stage, then its options
        out_bytes: List[int] = []
        for i, stage in enumerate(self.stages):
            if lazy and self.tpu_generation:
                backend.sync(next(iter(backend.tensors_in(x))).device)  # the stage's input as device data
                programs.append([stage_programs(s, x) for s in
                                 [stage] + [module for _, module in self.stage_options.get(i, [])]])
            rev = self.reversible and callable(getattr(stage, "inverse", None))
            stage_opts = []
            # Measuring runs the stage (and its options) several times: it must leave no trace (buffers, the
            # stage's own generators, torch's global generators).
            with probe(next(iter(backend.tensors_in(x))).device, list(stage.buffers()), i):
                try:
                    m, out = measure_stage(stage, x, reversible=rev)
                except InPlaceInput:
                    raise ValueError(
                        f"Checkpointable: stage {i} ({type(stage).__name__}) modifies its input in place; its "
                        f"input may be a checkpoint. Make its first operation out of place, or wrap it with the "
                        f"stage before it in revlib_xla.atomic(nn.Sequential(...))") from None
                except ValueError:
                    raise
                except Exception as exc:
                    raise type(exc)(f"Checkpointable: measuring stage {i} ({type(stage).__name__}) failed: "
                                    f"{exc}") from exc
                for name, module in self.stage_options.get(i, []):
                    alt, _ = measure_stage(module, x)
                    stage_opts.append(StageOption(name, alt.fw, alt.bw, max(alt.cbw, tensor_bytes(out)),
                                                  alt.fwd_tmp, alt.bwd_tmp))
            options.append(stage_opts)
            measured.append(m)
            out_bytes.append(tensor_bytes(out))
            if self.verbosity >= 2:
                logger.info("stage %d %s: %s", i, type(stage).__name__, m)
            x = out
            progress.update()
        progress.close()
        if programs:
            measured, options = self._with_compiled_sizes(measured, options, programs, out_bytes)
        self.measurements = measured
        n = len(measured)
        names = [f"{type(s).__name__}" for s in self.stages]
        rev = [m.inverse_time is not None for m in measured]
        self.chain = Chain(
            fw=[m.fw for m in measured], bw=[m.bw for m in measured] + [0.0],
            cw=[m.cw for m in measured] + [tensor_bytes(x)],
            cbw=[0] + [max(m.cbw, measured[i + 1].cw if i + 1 < n else tensor_bytes(x)) for i, m in
                       enumerate(measured)],
            fwd_tmp=[m.fwd_tmp for m in measured], bwd_tmp=[m.bwd_tmp for m in measured] +
            [self.loss_tmp_memory_usage],
            reversible=rev, inverse_time=[m.inverse_time if m.inverse_time is not None else m.fw for m in measured],
            options=options, names=names)
        if self.offload_bandwidth:
            self.chain = self.chain.with_bandwidth(self.offload_bandwidth, stages=range(1, n))
        self._signature = _signature(sample_input)
        self._sample = optional_detach(sample_input) if lazy else None  # XLA device data: what fit_to_tpu traces with
        self._input_structure = _structure(sample_input)
        self.sequence = None
        return self.chain

    def _with_compiled_sizes(self, measured: List[StageMeasurement], options: List[List[StageOption]],
                             programs: List[List[StagePrograms]], out_bytes: List[int]
                             ) -> Tuple[List[StageMeasurement], List[List[StageOption]]]:
        """What each stage (and each option) keeps and its transient memory, from its programs compiled deviceless
        for ``tpu_generation`` with every buffer in HBM (see :class:`~revlib_xla.planner.measure.StagePrograms`),
        in the terms of the chain (rotor's model; ``y`` is the stage's output, x_{i+1}):

        * ``cbw`` (x̄_{i+1}): what the backward program keeps live across the point where its backward starts (not
          its arguments x_i, parameters and the gradient of y, nor y, one of its outputs) + ``y``. The compiled
          stage keeps fusion inputs, not everything autograd saves.
        * ``fwd_tmp``: the larger of the forward program's live peak and the backward program's forward peak above
          what it keeps.
        * ``bwd_tmp``: the backward's live peak, the input gradient counted from when it is computed, above what
          the chain already holds while the stage's backward runs: x̄_{i+1} (of which ``y`` only if the backward
          reads it: the plan holds y, the compiled step may not) and the input gradient (``cw[i]``).
        """
        from .hlo_liveness import forward_backward_split
        from .memory import MissingDependencyError, tpu_memory_many

        flat = [p for stage in programs for p in stage]
        try:
            compiled = tpu_memory_many([text for p in flat for text in (p.forward, p.backward)], self.tpu_generation,
                                       hbm_only=True, liveness=True)
        except MissingDependencyError as exc:
            warnings.warn(f"Checkpointable: {exc}; planning with what autograd saves and temporaries taken as 0",
                          stacklevel=3)
            return measured, options

        def sizes(k: int, y: int, cw: int) -> Tuple[int, int, int]:
            forward, backward, program = compiled[2 * k], compiled[2 * k + 1], flat[k]
            if not program.gradient_arguments:
                return y, forward.live_peak_bytes, 0
            outputs = range(program.output_count)
            split = forward_backward_split(
                backward.buffer_assignment, backward.optimized_hlo, program.gradient_arguments,
                counted_outputs=range(program.output_count, program.output_count + program.input_gradient_count),
                read_outputs=outputs)
            held_y = y if any(split.outputs_read) else 0
            return (split.across + y, max(forward.live_peak_bytes, split.before - split.across),
                    max(0, split.after_with_outputs + held_y - split.across - y - cw))

        new_measured, new_options, k = [], [], 0
        for i, m in enumerate(measured):
            cbw, fwd_tmp, bwd_tmp = sizes(k, out_bytes[i], m.cw)
            new_measured.append(dataclasses.replace(m, cbw=cbw, fwd_tmp=fwd_tmp, bwd_tmp=bwd_tmp))
            k += 1
            stage_opts = []
            for opt in options[i]:
                cbw, fwd_tmp, bwd_tmp = sizes(k, out_bytes[i], m.cw)
                stage_opts.append(dataclasses.replace(opt, cbw=cbw, fwd_tmp=fwd_tmp, bwd_tmp=bwd_tmp))
                k += 1
            new_options.append(stage_opts)
        return new_measured, new_options

    def compute_sequence(self, mem_limit: Optional[float] = None, mem_slots: Optional[int] = None) -> Schedule:
        """Solve for the fastest schedule within ``mem_limit`` (default: the one given at construction)."""
        if self.chain is None:
            raise RuntimeError("Checkpointable.compute_sequence: call measure(sample_input) first (or pass input= "
                               "to the constructor)")
        limit = mem_limit if mem_limit is not None else self.mem_limit
        if limit is None:
            limit = self._default_limit()
        held = self.held_during_backward()
        if limit <= held:
            raise InfeasibleBudget(f"Checkpointable: mem_limit {limit:.6g} does not even hold the model's output and "
                                   f"its gradient ({held:.6g} bytes)", held + min_memory(self.chain))
        try:
            self.sequence = solve(self.chain, limit - held, mem_slots or self.mem_slots)
        except InfeasibleBudget as exc:
            raise InfeasibleBudget(f"Checkpointable: no schedule fits in {limit:.6g} bytes: the smallest budget for "
                                   f"this model and input is {exc.minimum + held:.6g} bytes (including "
                                   f"{held:.6g} for the output and its gradient); pass a larger mem_limit",
                                   exc.minimum + held) from None
        if self.verbosity >= 1:
            logger.info("%s", self.sequence.describe())
        return self.sequence

    def held_during_backward(self) -> float:
        """Bytes outside the chain's model that stay alive through the backward phase.

        Eager (cpu, cuda): the model's output (the caller holds it) and its gradient (autograd holds it until the
        whole backward returns). Measured on XLA: 0. There lifetimes follow the compiled program's dataflow: the
        output dies once the loss's gradient has been computed from it and that gradient once the last stage's
        backward has consumed it, both already counted by the chain (its ``L`` and ``B`` operations). A step that
        also returns the output keeps it for the whole program, outside this count."""
        if self.chain is None:
            raise RuntimeError("Checkpointable.held_during_backward: call measure(sample_input) first")
        return 0.0 if self._sample is not None else 2 * self.chain.cw[-1]

    def min_memory(self) -> float:
        """The smallest mem_limit any schedule fits in (bytes)."""
        return min_memory(self.chain) + self.held_during_backward()

    def no_checkpoint_memory(self) -> float:
        """The mem_limit at which nothing is recomputed (bytes)."""
        return no_checkpoint_memory(self.chain) + self.held_during_backward()

    def _default_limit(self) -> float:
        plain = self.no_checkpoint_memory()
        device = next((t.device for t in self.parameters()), torch.device("cpu"))
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return min(plain, 0.9 * free)
        return plain

    def fit_to_tpu(self, hbm_bytes: float, loss_fn: Optional[Any] = None, generation: Optional[str] = None,
                   probes: int = 6) -> Schedule:
        """Plan for a TPU without one: the fastest schedule found whose training step, compiled deviceless for
        the TPU ``generation`` (default: ``tpu_generation``), fits ``hbm_bytes`` of HBM as the TPU compiler counts
        it (parameters, gradients, activations, temporaries and code: the whole step).

        Per-stage sizes do not add up exactly under XLA's whole-program optimization, so this closes the loop: a
        binary search over the planner's budget, between the smallest one and the no-checkpoint peak, compiling
        the step at each probe (``probes`` compiles after the two ends). ``loss_fn(output)`` makes the step's loss
        (default: the sum of the output). The model must have been measured on an XLA input. Sets and returns
        :attr:`sequence`; :attr:`tpu_hbm_bytes` is the compiled peak of that schedule.
        """
        from .memory import tpu_memory

        self._require_xla_sample("fit_to_tpu")
        generation = generation or self.tpu_generation or "v5e"
        loss = loss_fn or (lambda out: sum(t.sum() for t in backend.tensors_in(out)))

        def compiled_peak(budget: float) -> Tuple[Schedule, int]:
            schedule = self.compute_sequence(budget)
            return schedule, tpu_memory(self._step_stablehlo(loss), generation).hbm_peak_bytes

        low, high = self.min_memory() * 1.02, self.no_checkpoint_memory()
        schedule, peak = compiled_peak(high)
        if peak <= hbm_bytes:
            self.tpu_hbm_bytes = peak
            return schedule
        schedule, peak = compiled_peak(low)
        if peak > hbm_bytes:
            raise InfeasibleBudget(f"Checkpointable.fit_to_tpu: even the smallest plan needs {peak:.6g} bytes of "
                                   f"TPU {generation} HBM (compiled deviceless), more than {hbm_bytes:.6g}",
                                   float(peak))
        best = (low, schedule, peak)
        for _ in range(probes):
            middle = (low + high) / 2
            schedule, peak = compiled_peak(middle)
            if peak <= hbm_bytes:
                low, best = middle, (middle, schedule, peak)
            else:
                high = middle
        self.sequence = self.compute_sequence(best[0])
        self.tpu_hbm_bytes = best[2]
        return self.sequence

    def tpu_activation_memory(self, loss_fn: Optional[Any] = None, generation: Optional[str] = None) -> int:
        """What the current schedule's training step keeps, as the TPU compiler plans it (deviceless compile of the
        whole step, no TPU): the peak of the live values other than the step's arguments and outputs (liveness over
        the compiled program, every buffer in HBM: ``tpu_memory(..., hbm_only=True, liveness=True)``) plus the
        model's input. The same quantity as :meth:`get_expected_memory`, measured instead of planned.

        ``loss_fn(output)`` makes the step's loss (default: the mean of the squared outputs, whose gradient depends
        on the output as a real loss's does; ``sum()`` would let the compiler fold the seed gradient into a
        constant). The model must have been measured on an XLA input.
        """
        from .memory import tpu_memory

        self._require_xla_sample("tpu_activation_memory")
        self._need_sequence()
        loss = loss_fn or (lambda out: sum(t.float().pow(2).mean() for t in backend.tensors_in(out)
                                           if t.is_floating_point()))
        compiled = tpu_memory(self._step_stablehlo(loss), generation or self.tpu_generation or "v5e", hbm_only=True,
                              liveness=True)
        return compiled.live_peak_bytes + tensor_bytes(self._sample)

    def _require_xla_sample(self, caller: str) -> None:
        if self._sample is None or self.chain is None:
            raise RuntimeError(f"Checkpointable.{caller}: measure the model on an XLA input first "
                               "(Checkpointable(model.to(xla_device), input=x_on_xla))")

    def _step_stablehlo(self, loss: Any) -> str:
        """The StableHLO of one training step of the current schedule on the measured XLA sample."""
        from .memory import step_stablehlo

        return step_stablehlo(lambda m, x: loss(self(x)).backward(), self.model, self._sample)

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
    def forward(self, x: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.model(x)
        if self._signature is not None and _signature(x) != self._signature:
            warnings.warn(f"Checkpointable: input {_signature(x)} differs from the measured "
                          f"{self._signature}; measuring and planning again", stacklevel=2)
            self.chain = None
        if self.chain is None:
            self.measure(x)
        if self.sequence is None:
            self.compute_sequence()
        tensors = list(backend.tensors_in(x))
        device = tensors[0].device
        run = _Run(self, self.sequence, device)
        dummy = torch.empty(0, device=device, requires_grad=True)
        with RecomputeState.of(self).python_random_check("Checkpointable"):
            flat = _Schedule.apply(run, dummy, *tensors)
        return _rebuild(run.out_structure, list(flat))


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, what: str, verbosity: int):
    if verbosity < 1:
        return _NoProgress()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoProgress()
    return tqdm(total=total, desc=what, unit="stage")
