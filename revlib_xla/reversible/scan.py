"""Reversible sequences run as scans: one layer (or one repeating group of layers) compiled, whatever the depth.

On XLA an unrolled reversible step traces every layer into the graph, so compile time grows with depth (about 1 s
per layer on XLA:CPU, bench/results/xla_compile_time-xla-cpu.md). When the layers repeat (every layer like the
first, or every group of ``period`` layers like the first group: a RevNet block's F and G, Llama's attention and
MLP branches), :class:`revlib_xla.ReversibleSequential` runs them as two XLA while loops instead:

* forward: a scan, without autograd, over the layers' parameters and buffers stacked along a new leading
  dimension, carrying the two streams; one node over the whole sequence keeps only the final streams (memory O(1)
  in depth, as the unrolled walk);
* backward: a scan in reverse carrying ``(y0, y1, dy0, dy1)``; its body puts an optimization barrier over what it
  reads (no merging with the forward), rebuilds each layer's input, recomputes the layer with autograd and takes its
  vector-Jacobian product; the per-layer parameter gradients are the scan's outputs, unstacked into each parameter's
  gradient.

Stacking copies the parameters (and buffers) once per pass: a transient copy of the repeated layers' weights, as
torch_xla's ``scan_layers`` makes, and the stacked gradients are unstacked into each parameter's gradient. Both copies
go with stacked parameter storage (:func:`stack_layers`, what MaxText's and torchprime's scanned layers hold): the
repeated layers' parameters live as one ``[iterations, ...]`` parameter per name, which the loops read as they are
and whose gradient is the backward loop's stacked output, so the step holds the parameters and their gradients
once. State dicts keep the unstacked keys (hooks translate both ways); without the loops (``scan=False``, cpu,
cuda) the layers run one by one on views of the stacks, as one autograd node with the same gradients.

What was tried (torch 2.9, torch_xla 2.9): torch_xla's public ``scan`` traces its body with AOTAutograd and saves
the body's activations per iteration for its own backward (O(depth), and no custom inversion); its forward loop
``_scan_impl_pytree`` traces the body lazily, so a body may call ``torch.autograd.grad`` and place barriers, and its
gradients equal plain autograd's to the last bits in float64. That private function is what runs here (the xla
backend's ``scan_loop``; without it the layers run unrolled). Random numbers: the scan gives each iteration its own
device seed (one int64 per iteration, drawn with ``torch.randint``); handing it the seeds the unrolled walk gives
each layer makes the scan draw exactly the unrolled walk's dropout masks, and the backward scan the same again. With
a group of several layers per iteration, the layers of a group would share one seed: such groups run scanned only
when their layers draw no random numbers (else unrolled; with ``scan=True`` a clear error).

Also unrolled: module hooks (the body is traced once, so they would run once for all layers), modules in training
mode with persistent buffers (batch norm's kernels update running statistics without a version bump that the body
could see), other buffers changed in place (seen by their version counters while tracing), tensor arguments that
require grad, ``target_device`` and ``fused_optimizer`` (both work per layer inside the unrolled walk). With the
scan, parameter gradients reach autograd together at the end of the sequence's backward (one node), not layer by
layer.

Devices that do not trace lazily (cpu, cuda) run the layers unrolled, which is the same computation.

Both loops read each layer's floating-point parameters through a value of the iteration (the stream, or the incoming
gradient: :func:`revlib_xla.backends.after`). The TPU compiler runs float32 matrix products on bfloat16 operands; a
body that only slices its weights out of the stacks let it convert the whole stacks once, outside both loops, and
keep that bfloat16 copy through the step (half the float32 parameter bytes, growing with depth).

:class:`~revlib_xla.planner.scanned.ScannedStages` is the same idea for :class:`revlib_xla.Checkpointable`
(``scan=True``).

Why a group of several layers cannot draw per-layer random numbers in the loop (torch_xla 2.9): each reseed in a
traced body makes a seed parameter of its own, and the loop replaces only the first one it finds with the
iteration's seed; the others stay constants of the trace. A layer's seed would have to be set from a traced value
(the iteration's seed plus the layer's offset), which torch_xla's RNG does not take.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .. import _tree, backends
from .._grad_destination import GradDestination, node_destination
from ..errors import ReversibleError
from . import fixed_point as _fixed
from .coupling import (
    first_tensor,
)
from .engine import INPLACE_HINT, vjp
from .layout import Layout, layout_of
from .plan import Plan, call_block, forward_fixed, forward_layer, to_compute
from .planning import PlannedSequence
from .repeat import ScanUnsupported, refuse_hooks, refuse_state, repeat_period
from .stacks import Stacks, stacks_of

Tensor = torch.Tensor


_SCAN_SEED_HIGH = 2**62  # the bound torch_xla's scan draws its per-iteration seeds below


def stacking_refused(model: PlannedSequence) -> str | None:
    """What keeps stacked parameters from running (checked by stack_layers and at every forward)."""
    if model.target_device is not None:
        return "target_device streams each layer's own parameters to the device; stacked layers have none"
    if model.fused_optimizer_factory is not None or model._attached_fused_optimizer is not None:
        return "fused_optimizer steps each layer's parameters inside the backward; stacked layers have none"
    return None


# ----------------------------------------------------------------------------------------------------------------
# Choosing the scan


def scanned_forward(
    model: PlannedSequence, plan: Plan, x0: Tensor, x1: Tensor, arg_tensors: Sequence[Tensor]
) -> tuple[Tensor, Tensor] | None:
    """The reversible forward as a scan (its backward a reverse scan), or ``None`` where the layers run unrolled:
    ``scan=False``, a device that does not trace lazily, or (with ``scan=None``) anything the scan cannot run.
    With ``scan=True``, what the scan cannot run raises a :class:`revlib_xla.ReversibleError` naming it. Layers with
    stacked parameters (:func:`stack_layers`) always run here: scanned, or one by one on views of the stacks."""
    wanted = getattr(model, "scan", False)  # models pickled before the argument existed: its default
    stacks = stacks_of(model)
    if stacks is None and (wanted is False or (wanted is None and not backends.is_tracing_lazily(x0))):
        return None  # nothing to compile: the unrolled walk, without checking anything per call
    if stacks is not None:
        _check_stacked(model, stacks, plan, arg_tensors)
    try:
        run = None if wanted is False else _prepare(model, plan, x0, arg_tensors, stacks)
        if run is not None:
            return _ScannedLayers.apply(run, x0, x1, *run.inputs)  # type: ignore[no-any-return]
    except ScanUnsupported as why:
        if wanted:
            raise ReversibleError(
                f"ReversibleSequential(scan=True): {why}. Make the layers identical in structure (the same module "
                f"types, settings, parameter shapes and dtypes, couplings and argument structure), or pass "
                f"scan=None (scan when possible) or scan=False (run the layers unrolled)."
            ) from None
    if stacks is None:
        return None
    run = _Run(plan, None, list(arg_tensors), None, _stack_positions(model, stacks))
    return _ScannedLayers.apply(run, x0, x1, *run.inputs)  # type: ignore[no-any-return]


def _check_stacked(model: PlannedSequence, stacks: Stacks, plan: Plan, arg_tensors: Sequence[Tensor]) -> None:
    """What stacked layers cannot run, as an error naming it (there is no unstacked walk to fall back to)."""
    why = stacking_refused(model)
    if why is None and len(plan.layers) != stacks.period * stacks.iterations:
        why = f"the sequence has {len(plan.layers)} layers, its stacks {stacks.period * stacks.iterations}"
    if why is None:
        try:
            refuse_state(plan)
        except ScanUnsupported as err:
            why = str(err)
    if why is None and any(t.requires_grad for t in arg_tensors):
        why = "a tensor argument requires grad (the stacked layers' walk does not differentiate their arguments)"
    if why is None and plan.fsdp_units is not None:
        why = "some blocks are FSDP2 units (fully_shard); shard the sequence as a whole instead"
    if why is not None:
        raise ReversibleError(f"ReversibleSequential with stacked layers (stack_layers): {why}")


def _stack_positions(model: nn.Module, stacks: Stacks) -> list[list[tuple[Tensor, tuple[str, ...]]]]:
    return [[(getattr(model, attr), names) for attr, names in entries] for entries in stacks.entries]


def _prepare(
    model: PlannedSequence, plan: Plan, x0: Tensor, arg_tensors: Sequence[Tensor], stacks: Stacks | None
) -> _Run | None:
    if model.fused_optimizer is not None:
        raise ScanUnsupported("fused_optimizer steps each layer inside the backward walk, which the scan does not run")
    if plan.offload is not None:
        raise ScanUnsupported("target_device streams each layer's parameters, which the scan stacks instead")
    refuse_hooks(plan)
    refuse_state(plan)
    period = repeat_period(plan.layers, plan.describe) if stacks is None else stacks.period
    layout = layout_of(plan, period, arg_tensors)
    if not backends.is_tracing_lazily(x0):
        return None  # eager devices: the unrolled walk is the same computation, without a compiler to save
    loop = backends.scan_loop(x0.device)
    if loop is None:
        raise ScanUnsupported(f"the {x0.device.type} backend has no compiled loop (Backend.scan_loop)")
    return _Run(plan, layout, list(arg_tensors), loop, None if stacks is None else _stack_positions(model, stacks))


# ----------------------------------------------------------------------------------------------------------------
# The scans


class _Seeds(TorchFunctionMode):
    """Hands torch_xla's scan the per-iteration seeds the unrolled walk would give each layer, in place of the
    random ones it draws (``torch.randint(0, 2**62, (iterations,), dtype=torch.int64)``)."""

    def __init__(self, seeds: list[int]) -> None:
        super().__init__()
        self.seeds, self.used = seeds, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func is torch.randint
            and not self.used
            and len(args) == 3
            and args[:2] == (0, _SCAN_SEED_HIGH)
            and tuple(args[2]) == (len(self.seeds),)
            and kwargs.get("dtype") == torch.int64
        ):
            self.used = True
            return torch.tensor(self.seeds, dtype=torch.int64).to(kwargs.get("device", "xla"))
        return func(*args, **kwargs)


class _Run:
    """One call's layers as one autograd node: as two compiled loops (``loop``, with the ``layout`` of what each
    iteration gets), or, for stacked layers without a loop, one layer after the other on views of the stacks.

    ``stacks``: with stacked storage, per position in the group, each stack and the parameter's names in the block;
    ``inputs``: the parameters the node differentiates (the stacks, or ``plan.params``)."""

    def __init__(
        self,
        plan: Plan,
        layout: Layout | None,
        arg_tensors: list[Tensor],
        loop: Callable[..., Any] | None,
        stacks: list[list[tuple[Tensor, tuple[str, ...]]]] | None = None,
    ) -> None:
        self.plan, self.layout, self.arg_tensors, self.loop, self.stacks = plan, layout, arg_tensors, loop, stacks
        self.inputs: list[Tensor] = list(plan.params) if stacks is None else [s for es in stacks for s, _ in es]
        self.draws = False  # whether the body draws random numbers (found while tracing the forward)

    def _xs(self, layout: Layout) -> list[tuple[dict[str, Tensor], list[Tensor]]]:
        xs = []
        for j in range(layout.period):
            tensors = layout.tensors(self.plan, j)
            if self.stacks is not None:  # the stacks themselves: no copy
                tensors |= {names[0]: stack for stack, names in self.stacks[j]}
            xs.append((tensors, layout.stacked_args(j, self.arg_tensors)))
        return xs

    def _named(self, j: int, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """``tensors`` with tied names added (a stacked block has no parameters to tie them by itself)."""
        if self.stacks is None:
            return tensors
        return tensors | {name: tensors[names[0]] for _, names in self.stacks[j] for name in names[1:]}

    def _read_after(self, j: int, tensors: dict[str, Tensor], token: Tensor) -> dict[str, Tensor]:
        """Position ``j``'s floating-point parameters in a loop body, read through ``token`` (a value of this
        iteration, :func:`revlib_xla.backends.after`). Why: the TPU compiler runs float32 matrix multiplies on bfloat16
        operands (DEFAULT precision), and hoists the conversion of a weight the loop only slices out of the loop:
        a bfloat16 copy of every layer's weights, live through both loops (half the parameter bytes, growing with
        depth). Read through a value of the iteration, the weight is converted one layer at a time, as the unrolled
        walk does."""
        assert self.layout is not None
        buffers = set(self.layout.buffer_names[j])
        return tensors | params_after({n: t for n, t in tensors.items() if n not in buffers}, token)

    def _positions(self, j: int) -> Iterator[tuple[int, Tensor, tuple[str, ...]]]:
        """Position ``j``'s stacks with their index in ``inputs``."""
        assert self.stacks is not None
        k = sum(len(es) for es in self.stacks[:j])
        for n, (stack, names) in enumerate(self.stacks[j]):
            yield k + n, stack, names

    @contextlib.contextmanager
    def _seeded(self, layout: Layout, replay: bool) -> Iterator[_Seeds | None]:
        """The layers' seeds for the loop: a fresh device seed for the trace, then one seed per iteration."""
        plan = self.plan
        with plan.call.scope(replay=replay) as reseed:
            reseed(plan.seed_of(0))
            if plan.call.seed is None or layout.period > 1:
                yield None
                return
            seeds = [plan.seed_of(t) for t in range(layout.iterations)]
            with _Seeds([s for s in seeds if s is not None]) as mode:
                yield mode

    def forward(self, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
        """The final streams (exact streams: the integers, from ``plan.fixed_streams``; ``x0``, ``x1`` are their
        values)."""
        plan, layout = self.plan, self.layout
        fixed = plan.fixed
        if fixed is not None:
            assert plan.fixed_streams is not None
            x0, x1 = plan.fixed_streams
        if layout is None:
            return self._walk_forward(x0, x1)
        device = x0.device

        def body(carry, xs):
            a0, a1 = carry
            guard = None if fixed is None else _fixed.StreamGuard(fixed, len(plan.layers), plan.describe_stream)
            for j, (tensors, stacked) in enumerate(xs):
                tensors = self._read_after(j, tensors, a1)
                args, kwargs = layout.args(j, self.arg_tensors, stacked)
                buffers = [tensors[n] for n in layout.buffer_names[j]]
                versions = [b._version for b in buffers]
                before = backends.RngState.capture(device).accel
                if fixed is not None:
                    value = fixed.decode(a1, cast(torch.dtype, plan.value_dtype))
                    y1 = forward_fixed(plan, j, a0, value, args, kwargs, self._named(j, tensors), guard=guard)[1]
                    a0, a1 = a1, y1
                else:
                    a0, a1 = a1, forward_layer(plan, j, a0, a1, args, kwargs, self._named(j, tensors))
                if backends.RngState.capture(device).accel != before:
                    self.draws = True
                if [b._version for b in buffers] != versions:
                    raise ScanUnsupported(f"{plan.describe(j)} changes a buffer in its forward (running statistics)")
            if self.draws and layout.period > 1:
                raise ScanUnsupported(
                    f"the layers repeat in groups of {layout.period} and draw random numbers (dropout): the layers of "
                    f"a group would share one seed per iteration"
                )
            if guard is not None and guard.extremes:  # each iteration's extremes, (period, 2): the loop's outputs
                return (a0, a1), torch.stack(guard.extremes)
            return (a0, a1), ()

        assert self.loop is not None
        with torch.no_grad(), plan.call.autocast.replay(), self._seeded(layout, replay=False) as seeds:
            (y0, y1), extremes = self.loop(body, (x0, x1), self._xs(layout))
        _check_seeded(seeds, self.draws)
        if fixed is not None and plan.guard is not None and isinstance(extremes, torch.Tensor):
            # per layer two rows: what it added, and the stream it left
            plan.guard.record_many([i for i in range(len(plan.layers)) for _ in range(2)], extremes.reshape(-1, 2))
        return y0, y1

    def _slices(self, i: int) -> dict[str, Tensor]:
        """Layer ``i``'s parameters: views of the stacks."""
        assert self.stacks is not None
        j, t = i % len(self.stacks), i // len(self.stacks)
        return {name: stack[t] for stack, names in self.stacks[j] for name in names}

    def _walk_forward(self, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
        """Stacked layers one by one, each on its slices of the stacks and its own block (hooks and buffers)."""
        plan = self.plan
        fixed = plan.fixed
        with torch.no_grad(), plan.call.autocast.replay(), plan.call.scope() as reseed:
            for i in range(len(plan.layers)):
                reseed(plan.seed_of(i))
                args, kwargs = plan.args_for(i, self.arg_tensors)
                buffers = plan.buffers_of(i, None)
                versions = [b._version for b in buffers]
                if fixed is not None:  # x0, x1: the streams
                    value = fixed.decode(x1, cast(torch.dtype, plan.value_dtype))
                    y1 = forward_fixed(plan, i, x0, value, args, kwargs, self._slices(i), guard=plan.guard)[1]
                    x0, x1 = x1, y1
                else:
                    x0, x1 = x1, forward_layer(plan, i, x0, x1, args, kwargs, self._slices(i))
                if [b._version for b in buffers] != versions:
                    raise ReversibleError(
                        f"ReversibleSequential with stacked layers: {plan.describe(i)} changes a buffer in its "
                        f"forward, which the recomputation would change again"
                    )
        return x0, x1

    def backward(
        self, y0: Tensor, y1: Tensor, dy0: Tensor, dy1: Tensor, trained: list[bool]
    ) -> tuple[Tensor, Tensor, list[Tensor | None]]:
        """The input gradients, and the gradient of each of ``inputs`` (``None`` where not ``trained``)."""
        plan, layout = self.plan, self.layout
        autocast = plan.call.autocast
        layer_autocast = autocast.replay if autocast.differs_from_now() else contextlib.nullcontext
        if layout is None:
            return self._walk_backward(y0, y1, dy0, dy1, trained, layer_autocast)
        if self.stacks is None:
            wanted = [
                [
                    n
                    for n in layout.param_names[j]
                    if any(k is not None and trained[k] for k in layout.param_index[j][n])
                ]
                for j in range(layout.period)
            ]
        else:
            wanted = [[names[0] for k, _, names in self._positions(j) if trained[k]] for j in range(layout.period)]

        def body(carry, xs):
            b0, b1, g0, g1 = carry
            grads: list[dict[str, Tensor]] = [{} for _ in xs]
            for j in reversed(range(len(xs))):
                tensors, stacked = xs[j]
                args, kwargs = layout.args(j, self.arg_tensors, stacked)
                b0, b1, g0, g1 = backends.optimization_barrier([b0, b1, g0, g1, *tensors.values()])[:4]
                tensors = self._read_after(j, tensors, g1)
                leaves = {n: t.detach().requires_grad_() if n in wanted[j] else t for n, t in tensors.items()}
                x0, g0, g1, found = _recompute_vjp(
                    plan, j, b0, b1, g0, g1, args, kwargs, self._named(j, leaves), wanted[j], layer_autocast
                )
                grads[j] = {n: found[n] if found[n] is not None else torch.zeros_like(leaves[n]) for n in wanted[j]}
                b0, b1 = x0, b0
            return (b0, b1, g0, g1), grads

        assert self.loop is not None
        with torch.no_grad(), self._seeded(layout, replay=True) as seeds:
            (x0, x1, dx0, dx1), stacked_grads = self.loop(body, (y0, y1, dy0, dy1), self._xs(layout), reverse=True)
        _check_seeded(seeds, self.draws)
        if plan.rebuild is not None:  # verify_inverse: the sequence's input, rebuilt
            plan.rebuild.compare(0, x0, x1)
        grads: list[Tensor | None] = [None] * len(self.inputs)
        for j in range(layout.period):
            if self.stacks is not None:  # the stacked gradients are the stacks' gradients
                for k, _, names in self._positions(j):
                    if trained[k]:
                        grads[k] = stacked_grads[j][names[0]]
                continue
            for name, stack in stacked_grads[j].items():
                for t, index in enumerate(layout.param_index[j][name]):
                    if index is not None and trained[index]:
                        before = grads[index]
                        grads[index] = stack[t] if before is None else before + stack[t]
        return dx0, dx1, grads

    def _walk_backward(
        self,
        y0: Tensor,
        y1: Tensor,
        dy0: Tensor,
        dy1: Tensor,
        trained: list[bool],
        layer_autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> tuple[Tensor, Tensor, list[Tensor | None]]:
        """Stacked layers one by one in reverse, each layer's gradients written into its slice of the stacked ones;
        a barrier keeps XLA from computing every layer's gradients after the whole walk."""
        plan = self.plan
        assert self.stacks is not None
        grads: list[Tensor | None] = [torch.empty_like(s) if need else None for s, need in zip(self.inputs, trained)]
        written = [g for g in grads if g is not None]
        with torch.no_grad(), plan.call.scope(replay=True) as reseed:
            for i in reversed(range(len(plan.layers))):
                j, t = i % len(self.stacks), i // len(self.stacks)
                y0, y1, dy0, dy1 = backends.optimization_barrier([y0, y1, dy0, dy1, *written])[:4]
                reseed(plan.seed_of(i))
                args, kwargs = plan.args_for(i, self.arg_tensors)
                tensors: dict[str, Tensor] = {}
                wanted: dict[str, int] = {}
                for k, stack, names in self._positions(j):
                    leaf = stack[t].detach().requires_grad_() if trained[k] else stack[t]
                    tensors |= {name: leaf for name in names}
                    if trained[k]:
                        wanted[names[0]] = k
                x0, dy0, dy1, found = _recompute_vjp(
                    plan, i, y0, y1, dy0, dy1, args, kwargs, tensors, list(wanted), layer_autocast
                )
                for name, k in wanted.items():
                    g, target = found[name], grads[k]
                    assert target is not None
                    if g is None:
                        target[t].zero_()
                    else:
                        target[t].copy_(g)
                y0, y1 = x0, y0
        if plan.rebuild is not None:  # verify_inverse: the sequence's input, rebuilt
            plan.rebuild.compare(0, y0, y1)
        return dy0, dy1, grads


def _check_seeded(seeds: _Seeds | None, draws: bool) -> None:
    if seeds is not None and draws and not seeds.used:
        raise RuntimeError(
            "ReversibleSequential: torch_xla's scan no longer draws its per-iteration seeds as this version of "
            "revlib_xla expects, so the recomputation would draw other dropout masks; pass scan=False"
        )


def _recompute_vjp(
    plan: Plan,
    j: int,
    y0: Tensor,
    y1: Tensor,
    dy0: Tensor,
    dy1: Tensor,
    args: Any,
    kwargs: Any,
    tensors: dict[str, Tensor],
    wanted: list[str],
    layer_autocast: Callable[[], contextlib.AbstractContextManager[Any]],
) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor | None]]:
    """Layer ``j`` of the group inside the backward body: its input ``x0`` rebuilt from ``(y0, y1)``, the gradients
    of its two input streams, and those of its ``wanted`` parameters."""
    wrapper = plan.wrappers[j]
    fixed = plan.fixed
    if fixed is not None:  # exact streams: y0, y1 are integers; straight through the rounding, as the unrolled walk
        with torch.enable_grad(), layer_autocast():
            x1 = fixed.decode(y0, cast(torch.dtype, plan.value_dtype)).requires_grad_()
            out = first_tensor(call_block(plan, j, to_compute(x1, plan), args, kwargs, tensors))
            x0 = _fixed.uncouple(fixed, y1, out)
        found = list(vjp(out, [x1, *(tensors[n] for n in wanted)], _fixed.branch_gradient(dy1, out.shape, out.dtype)))
        dx1 = dy0 if found[0] is None else dy0 + found[0]
        return x0, dy1, dx1, dict(zip(wanted, found[1:]))
    with torch.enable_grad(), layer_autocast():
        x1 = y0.detach().requires_grad_()
        fn_out = call_block(plan, j, to_compute(x1, plan), args, kwargs, tensors)
        x0 = wrapper.uncouple(y1, _tree.detached(fn_out))
        x0 = x0.detach()
        if plan.stream_dtype is not None:
            x0 = x0.to(plan.stream_dtype)
        x0_leaf = x0.requires_grad_()
        out = wrapper.couple(x0_leaf, fn_out)
        if plan.stream_dtype is not None:
            out = out.to(plan.stream_dtype)
    inputs = [x0_leaf, x1, *(tensors[n] for n in wanted)]
    found = list(vjp(out, inputs, dy1))
    dx0 = found[0] if found[0] is not None else torch.zeros_like(x0)
    dx1 = dy0 if found[1] is None else dy0 + found[1]
    return x0.detach(), dx0, dx1, dict(zip(wanted, found[2:]))


_UNUSED = GradDestination.UNUSED


class _ScannedLayers(torch.autograd.Function):
    """The whole sequence as one autograd node: the forward scan keeps only the final streams (and the parameters,
    for the in-place check); the backward scan rebuilds every layer and returns every parameter's gradient."""

    @staticmethod
    def forward(ctx, run: _Run, x0: Tensor, x1: Tensor, *params: Tensor):  # type: ignore[override]
        ctx.run = run
        y0, y1 = run.forward(x0, x1)
        ctx.save_for_backward(*params, *run.arg_tensors)
        ctx.streams = [y0.detach(), y1.detach()]
        ctx.stream_versions = (y0._version, y1._version)
        fixed = run.plan.fixed
        if fixed is not None:  # the streams are kept; their values are the outputs
            dtype = cast(torch.dtype, run.plan.value_dtype)
            return fixed.decode(y0, dtype), fixed.decode(y1, dtype)
        return y0, y1

    @staticmethod
    def backward(ctx, dy0: Tensor, dy1: Tensor):  # type: ignore[override]
        run: _Run = ctx.run
        if torch.is_grad_enabled():
            raise ReversibleError(
                "ReversibleSequential (scanned): a gradient of a gradient (create_graph=True) cannot be taken through "
                "the reversible backward: it rebuilds each layer's input without autograd history. Use "
                "memory_mode=MemoryModes.no_savings for this model."
            )
        try:
            ctx.saved_tensors  # noqa: B018  # raises if a parameter or argument was changed in place
        except RuntimeError as err:
            if INPLACE_HINT not in str(err):
                raise
            raise ReversibleError(
                "a tensor the reversible backward needs was modified in place after the forward: a parameter or a "
                "tensor argument of the (scanned) layers. Clone it before changing it, or change it only after "
                "backward()."
            ) from None
        y0, y1 = ctx.streams
        if (y0._version, y1._version) != ctx.stream_versions:
            raise ReversibleError(
                "a tensor the reversible backward needs was modified in place after the forward: the sequence's "
                "output. Clone it before changing it, or change it only after backward()."
            )
        edges = [node for node, _ in ctx.next_functions][2:]  # x0, x1, then the parameters
        trained = [node_destination(node) is not _UNUSED for node in edges]
        dx0, dx1, grads = run.backward(y0, y1, dy0, dy1, trained)
        return (None, dx0, dx1, *grads)


def params_after(tensors: dict[str, Tensor], token: Tensor) -> dict[str, Tensor]:
    """A loop body's floating-point tensors read through ``token``, a value of the iteration (see
    :meth:`_Run._read_after`: no hoisted bfloat16 copy of every layer's weights on TPU); the others as they are."""
    floating = {n: t for n, t in tensors.items() if t.is_floating_point()}
    return tensors | backends.after(floating, token)
