"""Running a schedule on a sequential model's stages: the executor.

:func:`run_schedule` runs a :class:`~revlib_xla.planner.Schedule` in training: one ``autograd.Function`` whose
forward runs the operations up to the loss (storing the planned checkpoints) and whose backward runs the rest
(recomputing what was not stored). Each operation does what its row of
:data:`~revlib_xla.planner.schedule.OPERATIONS` says, through the :class:`~revlib_xla.planner.schedule.Executor`
interface that :class:`_Run` implements, in the terms of the cost model (x_i, x̄_i, gradients). Stage inputs and
outputs may be tensors or tuples, lists, dicts and named tuples of them (``torch.utils._pytree``).

:class:`ScheduleExecutor` runs a given schedule on a model with nothing measured or planned;
``revlib_xla.Checkpointable`` plans the schedule and runs it the same way.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from .. import backends, fsdp
from .._grad_destination import GradDestination, grad_destination
from .._tree import detached, map_tensors, tensor_leaves
from ..recompute import CallReplay, RecomputeState, SavedBuffers, owned_buffers
from .attention_cache import AttentionCache
from .chain import Chain
from .early_stop import DeferredSaves
from .measure import grad_leaves
from .roots import EDGE_ROOTS, stops_early
from .roots import roots as stage_roots
from .run_values import _DEFERRED, _Deferred, _input_grads, _OutputEdges, _stand_in, _Structure
from .schedule import OPERATIONS, OpKind, Schedule, ScheduleError, Value, ValueKind, early_stops, simulate
from .stages import check_one_input, flatten_sequential, inverse_of

__all__ = [
    "ScheduleExecutor",
    "StagesToRun",
    "run_schedule",
    "check_schedule",
    "deferred_runs",
    "deferrable_stages",
    "stops_early",
]

_NO_CONTEXT = contextlib.nullcontext()


class StagesToRun(Protocol):
    """What the executor runs: the stages, each stage's alternative modules (``{stage index: [(name, module),
    ...]}``; option ``k`` of a stage runs its module ``k - 1``), whether random numbers are replayed, the
    parameters, and the state the recompute engine keeps across calls (:class:`~revlib_xla.recompute.RecomputeState`
    of the owning module)."""

    @property
    def stages(self) -> Sequence[nn.Module]: ...

    @property
    def stage_options(self) -> Mapping[int, Sequence[tuple[str, nn.Module]]]: ...

    @property
    def preserve_rng_state(self) -> bool: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def recompute_state(self) -> RecomputeState: ...


def deferred_runs(schedule: Schedule) -> dict[int, int]:
    """The ``CF`` operations that build their stage's graph for a last recomputation that stops early
    (:func:`~revlib_xla.planner.schedule.early_stops`), as {position in ``schedule.ops``: stage}."""
    return {cf: schedule.ops[cf].index for cf in early_stops(schedule.ops).values()}


def deferrable_stages(schedule: Schedule) -> set[int]:
    """The stages whose last recomputation stops early (:func:`deferred_runs`)."""
    return set(deferred_runs(schedule).values())


class _Run:
    """One execution of a schedule: the live values between its forward phase and its backward phase (``x``: stage
    inputs, ``xbar``: what a stage run with autograd keeps, as (input, output) of its graph, ``grad``: gradients of
    stage inputs, ``host``: inputs in host memory, ``held``: inputs kept for a pending ``Br``)."""

    def __init__(
        self, owner: StagesToRun, schedule: Schedule, device: torch.device, input_structure: _Structure
    ) -> None:
        self.owner = owner
        self.stages = owner.stages
        self.schedule = schedule
        self.loss_at = next(k for k, op in enumerate(schedule.ops) if op.kind is OpKind.L)
        self.device = device
        self.input_structure = input_structure
        self.out_structure: _Structure | None = None
        self.input_needs_grad: list[bool] = []
        self.x: dict[int, Any] = {}
        self.xbar: dict[int, tuple[Any, Any]] = {}
        self.grad: dict[int, tuple[torch.Tensor | None, ...]] = {}
        self.host: dict[int, tuple[_Structure, list[backends.HostCopy]]] = {}
        self.held: set[int] = set()
        self.replay = CallReplay(device, owner.preserve_rng_state)
        self.buffers = [owned_buffers(stage.modules()) for stage in self.stages]
        self.saved: dict[int, SavedBuffers | None] = {}  # per stage: the buffers its first run changed
        self.replaying = False  # the forward phase run again, for a second backward: every stage is a recomputation
        self.in_backward = False  # running the operations after the loss
        self.used = False  # its backward phase has run
        # Where the running backward sends parameter gradients (see route()).
        self.accumulate: list[torch.Tensor] | None = None
        self.capture: list[torch.Tensor] = []
        self.captured: list[torch.Tensor | None] = []
        self.out_grads: dict[int, torch.Tensor | None] = {}  # kept by take_output_grads for the backward phase
        # The CF operations that build their stage's graph for a recomputation stopping at the last tensor the
        # backward reads (deferred_runs, by position in the schedule), on
        # devices that run operations eagerly (set by forward_phase); their graphs from the first run.
        self.deferrable = {k: i for k, i in deferred_runs(schedule).items() if stops_early(self.stages[i])}
        self.position = 0  # of the running operation in schedule.ops
        self.stop_early = False
        self.deferred: dict[int, _Deferred] = {}
        self.caches: dict[int, AttentionCache] = {}  # stage -> its attention cache (CA_i to B_i)
        self.capturing: set[int] = set()  # stages whose next run fills their cache

    def live(self) -> set[Value]:
        """The values this run holds, in the cost model's terms (:class:`~revlib_xla.planner.Simulation`)."""
        return (
            {(ValueKind.X, i) for i in self.x}
            | {(ValueKind.XBAR, i) for i in self.xbar}
            | {(ValueKind.GRAD, i) for i in self.grad}
            | {(ValueKind.CACHE, i) for i in self.caches}
        )

    # -- running one stage, as its first run did ---------------------------------------------------------------
    def _call(self, i: int, x: Any, recompute: bool, inverse: bool = False, option: int = 0) -> Any:
        stage = self.stages[i] if option == 0 else self.owner.stage_options[i][option - 1][1]
        fn = inverse_of(self.stages[i]) if inverse else stage
        state = self.owner.recompute_state()
        cache: contextlib.AbstractContextManager[Any] = _NO_CONTEXT
        if i in self.caches and not inverse and option == 0:  # selective recomputation: attention read, not rerun
            if i in self.capturing:
                self.capturing.discard(i)
                cache = self.caches[i].capturing()
            else:
                cache = self.caches[i].replaying()
        if not recompute:
            watch = state.watch(self.buffers[i])
            with self.replay.first_run(i), cache:
                out = fn(x)
            self.saved[i] = state.changed(watch, f"Checkpointable stage {i} ({type(self.stages[i]).__name__})")
            return out
        saved = self.saved.get(i)
        # The buffers the first run changed: the recomputation sees their values from before it, on copies, so
        # that nothing is written into them while a graph that read them waits for its backward.
        with (
            saved.on_copies(self.buffers[i]) if saved is not None else _NO_CONTEXT,
            self.replay.rerun(i),
            fsdp.recomputing(stage) if torch.is_grad_enabled() else _NO_CONTEXT,
            cache,
        ):
            return fn(x)

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
        fenced = iter(backends.optimization_barrier(tensors))
        x = map_tensors(lambda _: next(fenced), x)
        if i == 0:
            # x_0 is the model's input, normally an argument of the step: see backends.after.
            x = backends.after(x, next(iter(tensor_leaves(extra)), None))
        return x

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

    def _source(self, i: int) -> Any:
        """x_i to run stage i from: in the backward phase behind a barrier (see :meth:`_barrier`)."""
        return self._barrier(i, self.grad.get(self._pending_grad())) if self.in_backward else self._input(i)

    def _pending_grad(self) -> int:
        return min(self.grad) if self.grad else -1

    # -- the operations (revlib_xla.planner.schedule.Executor) ---------------------------------------------------
    def forward(self, i: int, *, grad: bool, option: int = 0) -> None:
        recompute = self.in_backward or self.replaying
        x = self._source(i)
        if i in self.deferred and grad and self.in_backward and option == 0:
            self.deferred[i].saves.recompute = functools.partial(self._recompute, i, x)
            self.xbar[i + 1] = (None, _DEFERRED)
            return
        if not grad and self.stop_early and self.deferrable.get(self.position) == i:
            self._first_run_deferred(i, x, recompute)
            return
        if not grad:
            with torch.no_grad():
                out = self._call(i, x, recompute=recompute)
            del x
            self.x[i + 1] = out
            return
        inp = self._leaves(i, x)
        del x
        with torch.enable_grad():
            out = self._call(i, inp, recompute=recompute, option=option)
        self.xbar[i + 1] = (inp, out)

    def _leaves(self, i: int, x: Any) -> Any:
        """x_i as the input of stage i run with autograd; the model's input needs a gradient only where the
        caller's tensor does."""
        return grad_leaves(x, self.input_needs_grad if i == 0 else None)

    def _first_run_deferred(self, i: int, x: Any, recompute: bool) -> None:
        """``CF_i`` before stage i's last recomputation (:func:`deferred_runs`): its graph without activations,
        kept for its backward; x_{i+1} as ``CF_i`` leaves it."""
        inp = self._leaves(i, x)
        del x
        saves = DeferredSaves(f"Checkpointable stage {i} ({type(self.stages[i]).__name__})")
        with torch.enable_grad(), saves.recording():
            out = self._call(i, inp, recompute=recompute)
            edges = [
                torch.autograd.graph.get_gradient_edge(o.view_as(o)) if o.requires_grad else None
                for o in tensor_leaves(out)
            ]
        self.deferred[i] = _Deferred(inp, edges, saves)
        self.x[i + 1] = detached(out)

    def _recompute(self, i: int, x: Any) -> None:
        """Stage i run again from x_i for its deferred graph's slots (stopped at the last one)."""
        self._call(i, self._leaves(i, x), recompute=True)

    def keep_cache(self, i: int) -> None:
        self.caches[i] = AttentionCache()
        self.capturing.add(i)

    def free_input(self, i: int) -> None:
        if i != 0 and i not in self.held:
            self.x.pop(i, None)

    def hold(self, i: int) -> None:
        self.held.add(i)
        self.x.pop(i - 1, None)

    def backward(self, i: int) -> None:
        inp, out = self.xbar.pop(i + 1)
        if isinstance(out, _OutputEdges):
            grads = self.grad.pop(i + 1)
            pairs = [(e, g) for e, g in zip(out.edges, grads) if e is not None and g is not None]
            self._backward([e for e, _ in pairs], [g for _, g in pairs], inp)
            self.grad[i] = _input_grads(inp)
            self.caches.pop(i, None)
            return
        if out is _DEFERRED:
            deferred = self.deferred.pop(i)
            grads = self.grad.pop(i + 1)
            pairs = [(e, g) for e, g in zip(deferred.edges, grads) if e is not None and g is not None]
            self._backward([e for e, _ in pairs], [g for _, g in pairs], deferred.inp)
            self.grad[i] = _input_grads(deferred.inp)
            self.caches.pop(i, None)
            return
        roots, seeds = stage_roots(out, self.grad.pop(i + 1))
        del out  # the backward needs its graph, not the output's values: freed before it runs
        self._backward(roots, seeds, inp)
        self.grad[i] = _input_grads(inp)
        self.caches.pop(i, None)

    def rebuild_backward(self, i: int, option: int) -> None:
        later = self._barrier(i + 1, self.grad.get(i + 1))
        self.x.pop(i + 1, None)
        self.held.discard(i + 1)
        with torch.no_grad():
            rebuilt = self._call(i, later, recompute=True, inverse=True)
        del later
        inp = grad_leaves(rebuilt)
        with torch.enable_grad():
            out = self._call(i, inp, recompute=True, option=option)
        roots, seeds = stage_roots(out, self.grad.pop(i + 1))
        del out
        self._backward(roots, seeds, inp)
        self.grad[i] = _input_grads(inp)
        if i in self.held:
            self.x[i] = detached(rebuilt)

    def to_host(self, i: int) -> None:
        x = self.x.pop(i)
        self.host[i] = (_Structure(x), [backends.to_host(t) for t in tensor_leaves(x)])

    def from_host(self, i: int) -> None:
        structure, copies = self.host.pop(i)
        self.x[i] = structure.rebuild([backends.to_device(c) for c in copies])

    def run(self, start: int, stop: int, backward: bool) -> None:
        """Run ``schedule.ops[start:stop]``."""
        self.in_backward = backward
        for self.position in range(start, stop):
            op = self.schedule.ops[self.position]
            OPERATIONS[op.kind].execute(self, op)

    def _backward(self, roots: list[Any], seeds: list[torch.Tensor], inp: Any) -> None:
        """The backward of one stage from its roots (:func:`~revlib_xla.planner.roots.roots`): the gradients of its
        input leaves (left on them for _input_grads) and of the parameters, sent where the running backward wants
        them (see :meth:`route`)."""
        if not roots:
            return
        leaves = [t for t in tensor_leaves(inp) if t.requires_grad]
        if self.capture:
            got = torch.autograd.grad(roots, leaves + self.capture, seeds, allow_unused=True)
            for leaf, g in zip(leaves, got):
                leaf.grad = g
            for k, g in enumerate(got[len(leaves) :]):
                if g is not None:
                    before = self.captured[k]
                    self.captured[k] = g if before is None else before + g
        elif self.accumulate is None:
            torch.autograd.backward(roots, seeds)
        elif leaves or self.accumulate:
            torch.autograd.backward(roots, seeds, inputs=leaves + self.accumulate)

    def take_output_grads(self, grads: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        """Pre-hook of the schedule's backward node: keeps the gradients of the model's outputs here, for the
        backward phase to consume (the last stage's backward frees them), and hands autograd zero-sized stand-ins
        of the same shapes. The gradients autograd passes to a Function's backward stay alive until that backward
        returns, here the whole backward phase: the outputs' size held to the end for nothing. Node pre-hooks run
        after the outputs' own hooks and ``retain_grad()``, which see the real gradients."""
        self.out_grads = dict(enumerate(grads))
        return tuple(None if g is None else _stand_in(g) for g in grads)

    def output_grads(self, given: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
        """The gradients of the model's outputs: those :meth:`take_output_grads` kept (taken off this run), else
        the ones autograd passed."""
        kept, self.out_grads = self.out_grads, {}
        return tuple(kept.get(k, g) for k, g in enumerate(given))

    # -- the phases ----------------------------------------------------------------------------------------------
    def forward_phase(self, inputs: Sequence[torch.Tensor]) -> Any:
        """Run the schedule up to the loss from the model's input tensors; returns the model's output."""
        self.x[0] = self.input_structure.rebuild(inputs)
        self.input_needs_grad = [t.requires_grad for t in inputs]
        # A lazily traced device's compiler drops the unread operations itself (revlib_xla.planner.early_stop).
        # Fake tensors of an eager device stop as that device's tensors would (sizing a GPU step on fake tensors
        # counts what it runs); meta tensors are no device's.
        self.stop_early = bool(self.deferrable) and all(
            backends.backend_for(t).holds_data and not backends.is_tracing_lazily(t) for t in inputs
        )
        self.run(0, self.loss_at, backward=False)
        n = len(self.stages)
        out = self._input(n)
        self.run(self.loss_at, self.loss_at + 1, backward=False)
        kept = self.xbar.get(n)
        if EDGE_ROOTS and kept is not None and kept[1] is not _DEFERRED:
            self.xbar[n] = (kept[0], _OutputEdges(kept[1]))  # the output's values stay the caller's
        return out

    def route(self, params: Sequence[torch.Tensor]) -> None:
        """Where the running backward sends each parameter's gradient
        (:func:`~revlib_xla._grad_destination.grad_destination`). A ``backward()`` accumulates every one into
        ``.grad``: the stages' backwards accumulate into every leaf they reach, as autograd does.
        ``backward(inputs=...)`` accumulates some and leaves the rest alone. ``torch.autograd.grad`` captures the
        ones it asks for: they are summed over the stages and returned."""
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
        self.grad[len(self.stages)] = self.output_grads(grads)
        self.run(self.loss_at + 1, len(self.schedule.ops), backward=True)
        self.used = True
        input_grads = self.grad.pop(0)
        self.x.clear()
        captured = dict(zip(map(id, self.capture), self.captured))
        if not _graph_kept():
            # No second backward through this run: let go of the input's and output's other parts now (a
            # transformers layer call's mask and rotary tables), not when autograd frees this graph, after the
            # backward of what came before the model (an embedding's: a step's peak at a real vocabulary).
            self.input_structure = self.out_structure = None  # type: ignore[assignment]
            self.xbar.clear()
        return input_grads, [captured.get(id(p)) for p in params]

    def again(self, inputs: Sequence[torch.Tensor]) -> _Run:
        """A run for another backward through the same forward (``retain_graph=True``): the forward phase runs
        again from the model's input, every stage as a recomputation (the first run's random numbers, running
        statistics untouched)."""
        fresh = copy.copy(self)
        fresh.x, fresh.xbar, fresh.grad, fresh.host, fresh.held = {}, {}, {}, {}, set()
        fresh.deferred, fresh.caches, fresh.capturing = {}, {}, set()
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
        self.x.clear()
        self.xbar.clear()
        self.host.clear()
        self.deferred.clear()
        self.used = True
        x = self.input_structure.rebuild(inputs)
        grads = self.output_grads(grads)
        wanted = [p for p in params if grad_destination(p) is not GradDestination.UNUSED]
        got: list[torch.Tensor | None]
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
        by_input = iter(got)
        input_grads = [next(by_input) if t.requires_grad else None for t in inputs]
        by_param = dict(zip(map(id, wanted), by_input))
        return input_grads, [by_param.get(id(p)) for p in params]


class _ScheduleFunction(torch.autograd.Function):
    """Forward phase of the schedule in ``forward``, backward phase in ``backward``. The trainable parameters are
    inputs, so that autograd knows the output depends on them (``torch.autograd.grad(loss, params)``); a training
    backward accumulates their gradients into ``.grad`` from inside the stage graphs, stage by stage, as autograd
    would, and only captured ones are returned. ``dummy`` makes the output require grad even when nothing else
    does."""

    @staticmethod
    def forward(ctx: Any, run: _Run, dummy: torch.Tensor, count: int, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs, params = args[:count], args[count:]
        ctx.save_for_backward(*inputs)
        ctx.run, ctx.params = run, params
        out = run.forward_phase(inputs)
        run.out_structure = _Structure(out)
        flat = [t.detach() for t in tensor_leaves(out)]
        ctx.mark_non_differentiable(*[t for t in flat if not (t.is_floating_point() or t.is_complex())])
        return tuple(flat)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = ctx.saved_tensors  # torch's own error for a second backward through a graph already freed
        run: _Run = ctx.run
        input_grads: Sequence[torch.Tensor | None]
        if torch.is_grad_enabled():
            input_grads, param_grads = run.differentiable_backward(inputs, ctx.params, grads)
        else:
            if run.used:
                run = run.again(inputs)
            input_grads, param_grads = run.backward_phase(ctx.params, grads)
        return (None, None, None) + tuple(input_grads) + tuple(param_grads)


def run_schedule(owner: StagesToRun, schedule: Schedule, x: Any) -> Any:
    """Run ``schedule`` on ``owner``'s stages from the model's input ``x`` with autograd (training); returns the
    model's output, whose backward runs the schedule's backward phase. The schedule is not checked here (see
    :func:`check_schedule`)."""
    structure = _Structure(x)
    tensors = tensor_leaves(x)
    device = tensors[0].device
    run = _Run(owner, schedule, device, structure)
    dummy = torch.empty(0, device=device, requires_grad=True)
    params = [p for p in owner.parameters() if p.requires_grad]
    with owner.recompute_state().python_random_check(type(owner).__name__):
        flat = _ScheduleFunction.apply(run, dummy, len(tensors), *tensors, *params)
    node = next((t.grad_fn for t in flat if t.grad_fn is not None), None)
    if node is not None:
        node.register_prehook(run.take_output_grads)
    assert run.out_structure is not None  # set by the forward phase
    return run.out_structure.rebuild(flat)


def check_schedule(schedule: Schedule, chain: Chain | None = None, where: str = "Checkpointable") -> None:
    """Refuse a schedule that cannot run on ``chain`` (default: its own) with a ValueError naming the first
    operation that cannot run (the cost model's :class:`~revlib_xla.planner.ScheduleError`)."""
    try:
        simulate(schedule.chain if chain is None else chain, schedule.ops)
    except ScheduleError as exc:
        if where == "Checkpointable":
            raise ValueError(
                f"Checkpointable: the schedule in .sequence cannot run this model: {exc}. Set "
                f".sequence = None (or call compute_sequence()) to plan again"
            ) from None
        raise ValueError(f"{where}: the schedule cannot run on its chain: {exc}") from None


class ScheduleExecutor(nn.Module):
    """Run ``model`` (an ``nn.Sequential``, cut into stages as :func:`~revlib_xla.flatten_sequential` cuts it) with
    a given ``schedule`` (e.g. from :func:`~revlib_xla.planner.solve` on a chain of the same stages): no measuring,
    no planning. In training mode with autograd on, the forward runs the schedule (as ``Checkpointable`` does); in
    eval mode, or under ``torch.no_grad()``, it is the plain model.

    ``options``: each stage's alternative modules, ``{stage index: [(name, module), ...]}``, for schedules whose
    ``Fe``/``Br`` operations pick option ``k`` (module ``k - 1``). ``preserve_rng_state``: as ``Checkpointable``'s.
    """

    def __init__(
        self,
        model: nn.Module,
        schedule: Schedule,
        options: Mapping[int, Sequence[tuple[str, nn.Module]]] | None = None,
        preserve_rng_state: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        self._stages = flatten_sequential(model)
        for index, stage in enumerate(self._stages):
            check_one_input(index, stage)
        self._options = {int(k): list(v) for k, v in (options or {}).items()}
        self._option_modules = nn.ModuleList([m for opts in self._options.values() for _, m in opts])
        self._preserve_rng_state = preserve_rng_state
        if schedule.chain.length != len(self._stages):
            raise ValueError(
                f"ScheduleExecutor: the schedule is for a chain of {schedule.chain.length} stages and the model has "
                f"{len(self._stages)}; plan on a chain of this model's stages (revlib_xla.flatten_sequential(model))"
            )
        check_schedule(schedule, where="ScheduleExecutor")
        self.schedule = schedule

    @property
    def stages(self) -> Sequence[nn.Module]:
        return self._stages

    @property
    def stage_options(self) -> Mapping[int, Sequence[tuple[str, nn.Module]]]:
        return self._options

    @property
    def preserve_rng_state(self) -> bool:
        return self._preserve_rng_state

    def recompute_state(self) -> RecomputeState:
        return RecomputeState.of(self)

    def forward(self, x: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self.model(x)
        return run_schedule(self, self.schedule, x)


def _graph_kept() -> bool:
    """Whether the running backward keeps its graph (``retain_graph=True``); True where torch cannot say."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else bool(keep())
