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
:func:`revlib_xla.memory.parse_bytes`).

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
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import backend
from ._tree import map_tensors
from .grad_destination import GradDestination, grad_destination
from .memory import parse_bytes
from .planner import Chain, InfeasibleBudget, Schedule, ScheduleError, min_memory, no_checkpoint_memory, simulate, solve
from .planner.chain import StageOption
from .planner.measure import (
    InPlaceInput,
    StageMeasurement,
    StagePrograms,
    detached,
    grad_leaves,
    measure_stage,
    stage_programs,
    tensor_leaves,
    value_bytes,
)
from .planner.schedule import Op
from .recompute import CallReplay, RecomputeState, SavedBuffers, owned_buffers, probe

__all__ = ["Checkpointable", "SavedAs", "atomic", "flatten_sequential"]

logger = logging.getLogger(__name__)


def atomic(module: nn.Module) -> nn.Module:
    """Mark an ``nn.Sequential`` as one stage (the planner will not split it). Returns the module."""
    module._revlib_atomic = True
    return module


def _is_atomic(module: nn.Module) -> bool:
    return getattr(module, "_revlib_atomic", False) or getattr(module, "not_really_sequential", False)


def flatten_sequential(model: nn.Module) -> list[nn.Module]:
    """The stages of ``model``: nested ``nn.Sequential`` containers are flattened (unless marked with
    :func:`atomic`), and a module that starts with an in-place operation on its input (``ReLU(inplace=True)``)
    is merged into the stage before it, so that no stage overwrites its own input, which may be a checkpoint."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"Checkpointable needs an nn.Sequential, got {type(model).__name__}. Write the model as "
            f"nn.Sequential(stage_0, stage_1, ...) where each stage takes the previous stage's output (a tensor or a "
            f"tuple of tensors); revlib_xla.models has ResNets and a GPT written this way."
        )
    flat: list[nn.Module] = []

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


def _signature(x: Any) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device.type) for t in tensor_leaves(x))


def _input_grads(x: Any) -> tuple[torch.Tensor | None, ...]:
    """The gradients of a stage's input leaves, taken off the leaves: autograd's graph may keep a leaf alive (its
    AccumulateGrad node) after the leaf is dropped, and the gradient must not live as long."""
    grads = []
    for t in tensor_leaves(x):
        grads.append(t.grad if t.requires_grad else None)
        if t.requires_grad:
            t.grad = None
    return tuple(grads)


class _Structure:
    """Where the tensors of a nested value sit (``torch.utils._pytree``'s flattening; other leaves are kept), to
    build the same value around other tensors."""

    def __init__(self, value: Any) -> None:
        tensor_leaves(value)  # refuses containers whose tensors pytree would miss
        leaves, self.spec = pytree.tree_flatten(value)
        self.leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.slots = [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        leaves = list(self.leaves)
        for k, t in zip(self.slots, tensors):
            leaves[k] = t
        return pytree.tree_unflatten(leaves, self.spec)


class _Run:
    """One execution of a schedule: the live tensors between its forward phase and its backward phase."""

    def __init__(
        self, owner: Checkpointable, schedule: Schedule, device: torch.device, input_structure: _Structure
    ) -> None:
        self.owner = owner
        self.stages = owner.stages
        self.schedule = schedule
        self.loss_at = next(k for k, op in enumerate(schedule.ops) if op.kind == "L")
        self.device = device
        self.input_structure = input_structure
        self.out_structure: _Structure | None = None
        self.input_needs_grad: list[bool] = []
        self.x: dict[int, Any] = {}
        self.xbar: dict[int, tuple[Any, Any]] = {}
        self.grad: dict[int, tuple[torch.Tensor | None, ...]] = {}
        self.host: dict[int, Any] = {}
        self.held: set = set()
        self.replay = CallReplay(device, owner.preserve_rng_state)
        self.buffers = [owned_buffers(stage.modules()) for stage in self.stages]
        self.saved: dict[int, SavedBuffers | None] = {}  # per stage: the buffers its first run changed
        self.to_put_back: dict[int, list[torch.Tensor]] = {}  # per stage: their values to restore after its backward
        self.replaying = False  # the forward phase run again, for a second backward: every stage is a recomputation
        self.used = False  # its backward phase has run
        # Where the running backward sends parameter gradients (see route()).
        self.accumulate: list[torch.Tensor] | None = None
        self.capture: list[torch.Tensor] = []
        self.captured: list[torch.Tensor | None] = []

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

    def _put_back_all(self) -> None:
        for i in list(self.to_put_back):
            self._put_back(i)

    def _barrier(self, i: int, *extra: Any) -> Any:
        """Before a recomputation on XLA: stop the compiler from merging it with the forward (CSE), and from
        starting it before the gradient it waits for exists. Returns x_i behind the barrier, the input to recompute
        from.

        x_i is either a checkpoint (``self.x``, barriered in place) or the output of stage i-1 run with autograd
        (``self.xbar``, e.g. kept since the forward phase): that one is an output of a graph autograd still needs,
        so a detached alias of it goes behind the barrier. Without it the recomputation reads the very tensor the
        forward read, and the compiler merges the two and keeps the forward's intermediates until the backward."""
        x = self.x[i] if i in self.x else detached(self._input(i))
        tensors = [t for obj in (x, *extra) for t in tensor_leaves(obj)]
        fenced = iter(backend.optimization_barrier(tensors))
        x = map_tensors(lambda _: next(fenced), x)
        if i == 0:
            # x_0 is the model's input, normally an argument of the step: see backend.after.
            x = backend.after(x, next(iter(tensor_leaves(extra)), None))
        return x

    def _free_input(self, i: int) -> None:
        if i != 0 and i not in self.held:
            self.x.pop(i, None)

    def _input(self, i: int) -> Any:
        if i in self.x:
            return self.x[i]
        if i in self.xbar:
            return self.xbar[i][1]
        raise RuntimeError(
            f"Checkpointable: the schedule runs stage {i} but its input x_{i} is neither stored nor "
            f"kept at that point, so this schedule cannot run this model; check it with "
            f"revlib_xla.planner.simulate(checkpointable.chain, schedule.ops), or set "
            f"checkpointable.sequence = None to plan again"
        )

    def run(self, ops: Sequence[Op], backward: bool) -> None:
        recompute = backward or self.replaying
        for op in ops:
            i = op.index
            if op.kind in ("Fn", "CF", "Fr"):
                x = self._barrier(i, self.grad.get(self._pending_grad())) if backward else self._input(i)
                with torch.no_grad():
                    out = self._call(i, x, recompute=recompute)
                del x
                self.x[i + 1] = out
                if op.kind == "Fr":
                    self.held.add(i + 1)
                    self.x.pop(i, None)
                elif op.kind == "Fn":
                    self._free_input(i)
            elif op.kind == "Fe":
                x = self._barrier(i, self.grad.get(self._pending_grad())) if backward else self._input(i)
                # The model's input needs a gradient only where the caller's tensor does.
                inp = grad_leaves(x, self.input_needs_grad if i == 0 else None)
                del x
                with torch.enable_grad():
                    out = self._call(i, inp, recompute=recompute, option=op.option)
                self.xbar[i + 1] = (inp, out)
            elif op.kind == "B":
                inp, out = self.xbar.pop(i + 1)
                self._backward(out, self.grad.pop(i + 1), inp)
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
                self._backward(out, self.grad.pop(i + 1), inp)
                self._put_back(i)
                self.grad[i] = _input_grads(inp)
                del out
                if i in self.held:
                    self.x[i] = detached(rebuilt)
                del inp, rebuilt
            elif op.kind == "WM":
                x = self.x.pop(i)
                self.host[i] = (_Structure(x), [backend.to_host(t) for t in tensor_leaves(x)])
                del x
            elif op.kind == "RM":
                structure, copies = self.host.pop(i)
                self.x[i] = structure.rebuild([backend.to_device(c) for c in copies])
            elif op.kind == "L":
                pass

    def _pending_grad(self) -> int:
        return min(self.grad) if self.grad else -1

    def _backward(self, out: Any, grads: tuple[torch.Tensor | None, ...], inp: Any) -> None:
        """The backward of one stage: the gradients of its input leaves (left on them for _input_grads) and of the
        parameters, sent where the running backward wants them (see :meth:`route`)."""
        pairs = [(o, g) for o, g in zip(tensor_leaves(out), grads) if o.requires_grad and g is not None]
        if not pairs:
            return
        # The backward starts from an alias, not from the stage's output itself: autograd never completes a
        # multi-tensor gradient hook (torch.autograd.graph.register_multi_grad_hook, as trackers and sharding
        # wrappers put on module outputs) whose tensor is a root of the backward, and such a hook holds the
        # gradient it was given until Python's cyclic garbage collector runs. Through the alias, the output's hooks
        # see its gradient as in the plain model.
        with torch.enable_grad():
            roots = [o.view_as(o) for o, _ in pairs]
        seeds = [g for _, g in pairs]
        leaves = [t for t in tensor_leaves(inp) if t.requires_grad]
        if self.capture:
            got = torch.autograd.grad(roots, leaves + self.capture, seeds, allow_unused=True)
            for leaf, g in zip(leaves, got):
                leaf.grad = g
            for k, g in enumerate(got[len(leaves) :]):
                if g is not None:
                    self.captured[k] = g if self.captured[k] is None else self.captured[k] + g
        elif self.accumulate is None:
            torch.autograd.backward(roots, seeds)
        elif leaves or self.accumulate:
            torch.autograd.backward(roots, seeds, inputs=leaves + self.accumulate)

    # -- the phases ----------------------------------------------------------------------------------------------
    def forward_phase(self, inputs: Sequence[torch.Tensor]) -> Any:
        """Run the schedule up to the loss from the model's input tensors; returns the model's output."""
        self.x[0] = self.input_structure.rebuild(inputs)
        self.input_needs_grad = [t.requires_grad for t in inputs]
        self.run(self.schedule.ops[: self.loss_at], backward=False)
        return self._input(len(self.stages))

    def route(self, params: Sequence[torch.Tensor]) -> None:
        """Where the running backward sends each parameter's gradient (:func:`~revlib_xla.grad_destination`). A
        ``backward()`` accumulates every one into ``.grad``: the stages' backwards accumulate into every leaf they
        reach, as autograd does. ``backward(inputs=...)`` accumulates some and leaves the rest alone.
        ``torch.autograd.grad`` captures the ones it asks for: they are summed over the stages and returned."""
        where = [grad_destination(p) for p in params]
        self.capture = [p for p, d in zip(params, where) if d is GradDestination.CAPTURE]
        self.captured = [None] * len(self.capture)
        everything = all(d is GradDestination.ACCUMULATE for d in where)
        self.accumulate = None if everything else [p for p, d in zip(params, where) if d is GradDestination.ACCUMULATE]

    def backward_phase(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
    ) -> tuple[tuple[torch.Tensor | None, ...], list[torch.Tensor | None]]:
        """Run the schedule after the loss; returns the gradients of the model's input tensors and those of
        ``params`` the backward captures (None for the others, which went to ``.grad`` or nowhere)."""
        self.route(params)
        self.grad[len(self.stages)] = tuple(grads)
        try:
            self.run(self.schedule.ops[self.loss_at + 1 :], backward=True)
        finally:
            self._put_back_all()
        self.used = True
        input_grads = self.grad.pop(0)
        self.x.clear()
        captured = dict(zip(map(id, self.capture), self.captured))
        return input_grads, [captured.get(id(p)) for p in params]

    def again(self, inputs: Sequence[torch.Tensor]) -> _Run:
        """A run for another backward through the same forward (``retain_graph=True``): the forward phase runs
        again from the model's input, every stage as a recomputation (the first run's random numbers, running
        statistics untouched)."""
        fresh = copy.copy(self)
        fresh.x, fresh.xbar, fresh.grad, fresh.host, fresh.held = {}, {}, {}, {}, set()
        fresh.to_put_back = {}
        fresh.replaying, fresh.used = True, False
        fresh.forward_phase(inputs)
        return fresh

    def differentiable_backward(
        self, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """The backward with ``create_graph=True`` (double backward, gradient penalties): the gradients must be
        functions of the inputs and parameters that autograd can differentiate again, so the whole model runs
        again with autograd from its input (the first run's random numbers, running statistics untouched), as the
        plain model would, and its backward builds the graph. Exact, but this one backward holds what the plain
        model holds: the memory plan does not apply to it."""
        warnings.warn(
            "Checkpointable: a backward with create_graph=True (double backward) runs the whole model "
            "with autograd, holding what the plain model holds: the gradients are exact, the memory plan "
            "does not apply to that backward",
            stacklevel=3,
        )
        for stored in (self.x, self.xbar, self.host):
            stored.clear()
        self.used = True
        x = self.input_structure.rebuild(inputs)
        wanted = [p for p in params if grad_destination(p) is not GradDestination.UNUSED]
        try:
            with torch.enable_grad():
                for i in range(len(self.stages)):
                    x = self._call(i, x, recompute=True)
                pairs = [(o, g) for o, g in zip(tensor_leaves(x), grads) if o.requires_grad and g is not None]
                wrt = [t for t in inputs if t.requires_grad] + wanted
                got = (
                    list(
                        torch.autograd.grad(
                            [o for o, _ in pairs], wrt, [g for _, g in pairs], create_graph=True, allow_unused=True
                        )
                    )
                    if pairs and wrt
                    else [None] * len(wrt)
                )
        finally:
            self._put_back_all()
        by_input = iter(got)
        input_grads = [next(by_input) if t.requires_grad else None for t in inputs]
        by_param = dict(zip(map(id, wanted), by_input))
        return input_grads, [by_param.get(id(p)) for p in params]


class _Schedule(torch.autograd.Function):
    """Forward phase of the schedule in ``forward``, backward phase in ``backward``. The trainable parameters are
    inputs, so that autograd knows the output depends on them (``torch.autograd.grad(loss, params)``); a training
    backward accumulates their gradients into ``.grad`` from inside the stage graphs, stage by stage, as autograd
    would, and only captured ones are returned. ``dummy`` makes the output require grad even when nothing else
    does."""

    @staticmethod
    def forward(ctx, run: _Run, dummy: torch.Tensor, count: int, *args: torch.Tensor):
        inputs, params = args[:count], args[count:]
        ctx.save_for_backward(*inputs)
        ctx.run, ctx.params = run, params
        out = run.forward_phase(inputs)
        run.out_structure = _Structure(out)
        flat = [t.detach() for t in tensor_leaves(out)]
        ctx.mark_non_differentiable(*[t for t in flat if not (t.is_floating_point() or t.is_complex())])
        return tuple(flat)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        inputs = ctx.saved_tensors  # torch's own error for a second backward through a graph already freed
        run: _Run = ctx.run
        if torch.is_grad_enabled():
            input_grads, param_grads = run.differentiable_backward(inputs, ctx.params, grads)
        else:
            if run.used:
                run = run.again(inputs)
            input_grads, param_grads = run.backward_phase(ctx.params, grads)
        return (None, None, None) + tuple(input_grads) + tuple(param_grads)


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
        mem_limit: the budget (rotor's meaning; see the module docstring): a number of bytes, or a string with a
            unit, ``"1GB"`` (10**9 bytes) or ``"512MiB"`` (512 * 2**20 bytes); see
            :func:`revlib_xla.memory.parse_bytes`.
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
        options: dict[int, Sequence[tuple[str, nn.Module]]] | None = None,
        saved_dtypes: Sequence[torch.dtype] = (),
        tpu_generation: str | None = "v5e",
    ) -> None:
        super().__init__()
        self.model = model
        self.stages = flatten_sequential(model)
        for index, stage in enumerate(self.stages):
            _check_one_input(index, stage)
        self.mem_limit = None if mem_limit is None else parse_bytes(mem_limit, "Checkpointable: mem_limit")
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
        self._signature: tuple | None = None
        self._sample: Any = None
        self._runnable: Schedule | None = None  # the last schedule checked against the chain
        if input is not None:
            self.measure(input)
            self.compute_sequence()

    # -- planning ----------------------------------------------------------------------------------------------
    def measure(self, sample_input: Any) -> Chain:
        """Measure every stage on ``sample_input`` (times on the device, sizes in bytes) and build the chain.
        Invalidates the current schedule."""
        x = detached(sample_input)
        measured: list[StageMeasurement] = []
        options: list[list[StageOption]] = []
        progress = _progress(len(self.stages), "measuring stages", self.verbosity)
        lazy = any(backend.is_tracing_lazily(t) for t in tensor_leaves(x))
        # The TPU generation to size compiled stages for: the runtime's chip, or the user's where tracing for a TPU.
        generation = backend.sizing_generation(tensor_leaves(x)[0].device, self.tpu_generation) if lazy else None
        programs: list[list[StagePrograms]] = []  # per stage: the plain stage, then its options
        out_bytes: list[int] = []
        for i, stage in enumerate(self.stages):
            if generation:
                backend.sync(tensor_leaves(x)[0].device)  # the stage's input as device data
                programs.append(
                    [stage_programs(s, x) for s in [stage] + [module for _, module in self.stage_options.get(i, [])]]
                )
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
                        f"stage before it in revlib_xla.atomic(nn.Sequential(...))"
                    ) from None
                except ValueError:
                    raise
                except Exception as exc:
                    raise type(exc)(
                        f"Checkpointable: measuring stage {i} ({type(stage).__name__}) failed: {exc}"
                    ) from exc
                for name, module in self.stage_options.get(i, []):
                    alt, _ = measure_stage(module, x)
                    stage_opts.append(
                        StageOption(name, alt.fw, alt.bw, max(alt.cbw, value_bytes(out)), alt.fwd_tmp, alt.bwd_tmp)
                    )
            options.append(stage_opts)
            measured.append(m)
            out_bytes.append(value_bytes(out))
            if self.verbosity >= 2:
                logger.info("stage %d %s: %s", i, type(stage).__name__, m)
            x = out
            progress.update()
        progress.close()
        if programs:
            measured, options = self._with_compiled_sizes(measured, options, programs, out_bytes, generation)
        self.measurements = measured
        n = len(measured)
        names = [f"{type(s).__name__}" for s in self.stages]
        rev = [m.inverse_time is not None for m in measured]
        self.chain = Chain(
            fw=[m.fw for m in measured],
            bw=[m.bw for m in measured] + [0.0],
            cw=[m.cw for m in measured] + [value_bytes(x)],
            cbw=[0] + [max(m.cbw, measured[i + 1].cw if i + 1 < n else value_bytes(x)) for i, m in enumerate(measured)],
            fwd_tmp=[m.fwd_tmp for m in measured],
            bwd_tmp=[m.bwd_tmp for m in measured] + [self.loss_tmp_memory_usage],
            reversible=rev,
            inverse_time=[m.inverse_time if m.inverse_time is not None else m.fw for m in measured],
            options=options,
            names=names,
        )
        if self.offload_bandwidth:
            self.chain = self.chain.with_bandwidth(self.offload_bandwidth, stages=range(1, n))
        self._signature = _signature(sample_input)
        self._sample = detached(sample_input) if lazy else None  # XLA device data: what fit_to_tpu traces with
        self.sequence = None
        return self.chain

    def _with_compiled_sizes(
        self,
        measured: list[StageMeasurement],
        options: list[list[StageOption]],
        programs: list[list[StagePrograms]],
        out_bytes: list[int],
        generation: str | None,
    ) -> tuple[list[StageMeasurement], list[list[StageOption]]]:
        """What each stage (and each option) keeps and its transient memory, from its programs compiled deviceless
        for ``generation`` with every buffer in HBM (see :class:`~revlib_xla.planner.measure.StagePrograms`),
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
            compiled = tpu_memory_many(
                [text for p in flat for text in (p.forward, p.backward)],
                generation,
                hbm_only=True,
                liveness=True,
            )
        except MissingDependencyError as exc:
            warnings.warn(
                f"Checkpointable: {exc}; planning with what autograd saves and temporaries taken as 0", stacklevel=3
            )
            return measured, options

        def sizes(k: int, y: int, cw: int) -> tuple[int, int, int]:
            forward, backward, program = compiled[2 * k], compiled[2 * k + 1], flat[k]
            if not program.gradient_arguments:
                return y, forward.live_peak_bytes, 0
            outputs = range(program.output_count)
            split = forward_backward_split(
                backward.buffer_assignment,
                backward.optimized_hlo,
                program.gradient_arguments,
                counted_outputs=range(program.output_count, program.output_count + program.input_gradient_count),
                read_outputs=outputs,
            )
            held_y = y if any(split.outputs_read) else 0
            return (
                split.across + y,
                max(forward.live_peak_bytes, split.before - split.across),
                max(0, split.after_with_outputs + held_y - split.across - y - cw),
            )

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

    def compute_sequence(self, mem_limit: float | str | None = None, mem_slots: int | None = None) -> Schedule:
        """Solve for the fastest schedule within ``mem_limit`` (bytes, or a string such as ``"1GB"``; default: the
        one given at construction, else the fastest plan: see the module docstring)."""
        if self.chain is None:
            raise RuntimeError(
                "Checkpointable.compute_sequence: call measure(sample_input) first (or pass input= to the constructor)"
            )
        if mem_limit is not None:
            limit = parse_bytes(mem_limit, "Checkpointable.compute_sequence: mem_limit")
        else:
            limit = self.mem_limit if self.mem_limit is not None else self._default_limit()
        held = self.held_during_backward()
        if limit <= held:
            raise InfeasibleBudget(
                f"Checkpointable: mem_limit {limit:.6g} does not even hold the model's output and "
                f"its gradient ({held:.6g} bytes)",
                held + min_memory(self.chain),
            )
        try:
            self.sequence = solve(self.chain, limit - held, mem_slots or self.mem_slots)
        except InfeasibleBudget as exc:
            smallest = exc.minimum + held
            if exc.unit is None:
                why = f"the smallest budget for this model and input is {smallest:.6g} bytes"
            else:
                why = (
                    f"it is above the smallest budget for this model and input ({smallest:.6g} bytes), but the "
                    f"planner rounds sizes up to multiples of {exc.unit:.6g} bytes and the rounded plan does not "
                    f"fit"
                )
            raise InfeasibleBudget(
                f"Checkpointable: no schedule fits in mem_limit {limit:.6g} bytes: {why} "
                f"(budgets include {held:.6g} bytes for the output and its gradient); pass a "
                f"larger mem_limit",
                smallest,
                exc.unit,
            ) from None
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
        free = backend.free_memory(device)
        return plain if free is None else min(plain, 0.9 * free)

    def fit_to_tpu(
        self, hbm_bytes: float | str, loss_fn: Any | None = None, generation: str | None = None, probes: int = 6
    ) -> Schedule:
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
        hbm_bytes = parse_bytes(hbm_bytes, "Checkpointable.fit_to_tpu: hbm_bytes")
        generation = generation or self.tpu_generation or "v5e"
        loss = loss_fn or (lambda out: sum(t.sum() for t in tensor_leaves(out)))

        def compiled_peak(budget: float) -> tuple[Schedule, int]:
            schedule = self.compute_sequence(budget)
            return schedule, tpu_memory(self._step_stablehlo(loss), generation).hbm_peak_bytes

        low, high = self.min_memory() * 1.02, self.no_checkpoint_memory()
        schedule, peak = compiled_peak(high)
        if peak <= hbm_bytes:
            self.tpu_hbm_bytes = peak
            return schedule
        schedule, peak = compiled_peak(low)
        if peak > hbm_bytes:
            raise InfeasibleBudget(
                f"Checkpointable.fit_to_tpu: even the smallest plan needs {peak:.6g} bytes of "
                f"TPU {generation} HBM (compiled deviceless), more than {hbm_bytes:.6g}",
                float(peak),
            )
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

    def tpu_activation_memory(self, loss_fn: Any | None = None, generation: str | None = None) -> int:
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
        loss = loss_fn or (
            lambda out: sum(t.float().pow(2).mean() for t in tensor_leaves(out) if t.is_floating_point())
        )
        compiled = tpu_memory(
            self._step_stablehlo(loss), generation or self.tpu_generation or "v5e", hbm_only=True, liveness=True
        )
        return compiled.live_peak_bytes + value_bytes(self._sample)

    def _require_xla_sample(self, caller: str) -> None:
        if self._sample is None or self.chain is None:
            raise RuntimeError(
                f"Checkpointable.{caller}: measure the model on an XLA input first "
                "(Checkpointable(model.to(xla_device), input=x_on_xla))"
            )

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
    def forward(self, x: Any, *more: Any) -> Any:
        if more:
            raise TypeError(
                f"Checkpointable takes the model's input as one argument, as nn.Sequential does; got "
                f"{1 + len(more)}. Pass several tensors as one tuple, checkpointed((a, b)): the first "
                f"stage receives the tuple as its one argument"
            )
        if not (self.training and torch.is_grad_enabled()):
            return self.model(x)
        if self._signature is not None and _signature(x) != self._signature:
            warnings.warn(
                f"Checkpointable: input {_signature(x)} differs from the measured "
                f"{self._signature}; measuring and planning again",
                stacklevel=2,
            )
            self.chain = None
        if self.chain is None:
            self.measure(x)
        if self.sequence is None:
            self.compute_sequence()
        schedule = self._checked_sequence()
        structure = _Structure(x)
        tensors = tensor_leaves(x)
        device = tensors[0].device
        run = _Run(self, schedule, device, structure)
        dummy = torch.empty(0, device=device, requires_grad=True)
        params = [p for p in self.parameters() if p.requires_grad]
        with RecomputeState.of(self).python_random_check("Checkpointable"):
            flat = _Schedule.apply(run, dummy, len(tensors), *tensors, *params)
        return run.out_structure.rebuild(flat)

    def _checked_sequence(self) -> Schedule:
        """:attr:`sequence`, checked once to run on this chain (it may have been set by hand)."""
        schedule = self.sequence
        if schedule is not self._runnable:
            try:
                simulate(self.chain, schedule.ops)
            except ScheduleError as exc:
                raise ValueError(
                    f"Checkpointable: the schedule in .sequence cannot run this model: {exc}. Set "
                    f".sequence = None (or call compute_sequence()) to plan again"
                ) from None
            self._runnable = schedule
        return schedule


def _check_one_input(index: int, stage: nn.Module) -> None:
    """Refuse a stage whose forward needs more than one argument: stages are called as nn.Sequential calls them."""
    try:
        parameters = inspect.signature(stage.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): left to the call
        return
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty]
    if len(names) > 1:
        raise TypeError(
            f"Checkpointable: stage {index} ({type(stage).__name__}) takes {len(names)} inputs ({', '.join(names)}); "
            f"each stage is called with one argument, the previous stage's output (a tensor, or a tuple, list or "
            f"dict of tensors), as nn.Sequential calls it. Give its forward one argument and unpack it "
            f"(def forward(self, inputs): {', '.join(names)} = inputs), or let the stage before return that tuple"
        )


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
