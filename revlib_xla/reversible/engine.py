"""The reversible backward, one autograd node per layer (:class:`ReversibleLayerFn`): the forward keeps nothing but
each layer's parameters and tensor arguments; the backward rebuilds each layer's input from its output, recomputes
the block with autograd behind an optimization barrier and takes its vector-Jacobian product (:func:`vjp`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from .. import backends
from .._grad_destination import GradDestination, node_destination
from ..errors import ReversibleError
from . import fixed_point as _fixed
from .coupling import (
    first_tensor,
    optional_detach,
)
from .plan import Plan, call_block, forward_fixed, forward_layer, streams_of, to_compute

Tensor = torch.Tensor


INPLACE_HINT = "modified by an inplace operation"
_UNUSED, _ACCUMULATE = GradDestination.UNUSED, GradDestination.ACCUMULATE


def run_layers(plan: Plan, x0: Tensor, x1: Tensor, arg_tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """The reversible forward: each layer runs without autograd as its own :class:`ReversibleLayerFn` node, which
    keeps nothing but its parameters and tensor arguments (the last one also keeps the final two streams). With exact
    streams, ``(x0, x1)`` are their values and ``plan.fixed_streams`` the streams, which each layer replaces."""
    device = x0.device
    off = plan.offload
    check = plan.rebuild
    with plan.call.autocast.replay(), plan.call.scope() as reseed:
        for i in range(len(plan.layers)):
            reseed(plan.seed_of(i))
            own_args = [arg_tensors[k] for k in plan.layer_arg_slots[i]]
            if off is None:
                watch = plan.watch_buffers(i)
                x0, x1 = ReversibleLayerFn.apply(plan, i, None, x0, x1, *plan.own_params[i], *own_args)
                if watch is not None:
                    plan.saved_buffers[i] = plan.state.changed(watch, plan.describe(i))
                if check is not None and check.first == i and not x1.requires_grad:
                    check.keep(i + 1, *streams_of(plan, x0, x1))  # no autograd node (a frozen layer): the backward
                    # stops above it
                continue
            copies = off.streamer.fetch(i, prefetch=i + 1)
            tensors = off.mapping(i, copies)
            watch = plan.watch_buffers(i, tensors)
            x0, x1 = ReversibleLayerFn.apply(plan, i, tensors, x0, x1, *plan.own_params[i], *own_args)
            if watch is not None:
                plan.saved_buffers[i] = plan.state.changed(watch, plan.describe(i))
            if check is not None and check.first == i and not x1.requires_grad:
                check.keep(i + 1, *streams_of(plan, x0, x1))
            del tensors
            backends.cut_graph(device)
            off.write_back_buffers(i, copies)
            del copies
            off.streamer.release(i)
    if off is not None:
        off.streamer.release_all()
    return x0, x1


@dataclasses.dataclass
class _Wanted:
    """Which gradients of one layer the running backward uses (read from the engine, per input edge)."""

    x0: bool
    x1: bool
    params: list[GradDestination]  # aligned with plan.layer_params[i]
    args: list[bool]  # aligned with plan.layer_arg_slots[i]
    previous: bool  # the previous layer's backward runs next (the walk goes on)


class ReversibleLayerFn(torch.autograd.Function):
    """One reversible layer as one autograd node that saves no activation.

    The forward runs the layer without autograd; only the last layer keeps the final two streams. The backward of
    the last layer rebuilds its input from them, recomputes the layer with autograd, takes its vector-Jacobian
    product, and hands the rebuilt input to the previous layer's backward (through the plan); the engine runs the
    layers' backwards in reverse order, since each layer's outputs feed only the next layer.

    A node per layer (rather than one over the sequence) lets the engine accumulate each layer's parameter
    gradients as soon as that layer is done, through the parameters' own ``AccumulateGrad`` (hooks, DDP,
    post-accumulate-grad hooks and ``torch.autograd.grad`` all see an ordinary parameter). Activation memory is the
    same: under XLA, lifetimes follow what is saved, and no node saves an intermediate stream.
    """

    @staticmethod
    def forward(ctx, plan: Plan, i: int, tensors: dict[str, Tensor] | None, x0: Tensor, x1: Tensor, *flat: Tensor):
        ctx.plan, ctx.i = plan, i
        n_params = len(plan.layer_params[i])
        args, kwargs = plan.args_for(i, dict(zip(plan.layer_arg_slots[i], flat[n_params:])))
        ctx.save_for_backward(*flat)
        if plan.fixed is not None:  # the streams are plan.fixed_streams, the values x0 and x1
            assert plan.fixed_streams is not None
            s0, s1 = plan.fixed_streams
            y1, y1_stream = forward_fixed(plan, i, s0, x1, args, kwargs, tensors, guard=plan.guard)
            plan.fixed_streams = (s1, y1_stream)
            if i == len(plan.layers) - 1:
                ctx.streams = [s1, y1_stream]
                ctx.stream_versions = (s1._version, y1_stream._version)
            return x1.detach(), y1
        y1 = forward_layer(plan, i, x0, x1, args, kwargs, tensors)
        if i == len(plan.layers) - 1:
            # The output streams are kept as detached aliases rather than saved tensors, so the backward can drop
            # them as soon as it has rebuilt the last layer's input (saved tensors live until the graph is freed);
            # their version is checked by hand, as save_for_backward would.
            ctx.streams = [x1.detach(), y1.detach()]
            ctx.stream_versions = (x1._version, y1._version)
        return x1.detach(), y1

    @staticmethod
    def backward(ctx, dy0: Tensor, dy1: Tensor):
        plan: Plan = ctx.plan
        i = ctx.i
        if torch.is_grad_enabled():
            raise ReversibleError(
                f"ReversibleSequential ({plan.describe(i)}): a gradient of a gradient (create_graph=True, e.g. a "
                f"gradient penalty or a Hessian-vector product) cannot be taken through the reversible backward: it "
                f"rebuilds each layer's input from the output without autograd history, so the second-order "
                f"gradients would be wrong. Use memory_mode=MemoryModes.no_savings for this model."
            )
        try:
            saved = ctx.saved_tensors
        except RuntimeError as err:
            if INPLACE_HINT not in str(err):
                raise
            raise ReversibleError(
                f"a tensor the reversible backward needs was modified in place after the forward: a parameter or a "
                f"tensor argument (mask, memory, ...) of {plan.describe(i)}. Clone it before changing it, or change "
                f"it only after backward()."
            ) from None
        if i == len(plan.layers) - 1:  # the walk starts from the saved output
            streams = ctx.streams
            if (streams[0]._version, streams[1]._version) != ctx.stream_versions:
                raise ReversibleError(
                    "a tensor the reversible backward needs was modified in place after the forward: the "
                    "sequence's output. Clone it before changing it, or change it only after backward()."
                )
            if not _keeps_graph():
                ctx.streams = None  # the last references: the streams are freed once the last layer is rebuilt
            y0, y1 = streams
            later = ()
        else:
            walk = plan.walk  # left by the next layer's backward, which the engine ran before this one
            if walk is None:
                raise RuntimeError(f"ReversibleSequential ({plan.describe(i)}): internal error: no rebuilt streams")
            y0, y1, later = walk
        plan.walk = streams = walk = None
        want = _wanted(ctx, plan, i)
        # Each recomputation replays the forward's autocast state; gradients are taken in the ambient one, as plain
        # autograd does. Off then and off now (the usual case), there is nothing to enter.
        autocast = plan.call.autocast
        ctx.layer_autocast = autocast.replay if autocast.differs_from_now() else _nothing
        with plan.call.scope(replay=True) as reseed:
            x0, y0, dx0, dx1, grads, finished = _layer_backward(
                ctx, plan, i, y0, y1, dy0, dy1, reseed, saved[len(plan.layer_params[i]) :], want, later
            )
        if plan.rebuild is not None:
            plan.rebuild.compare(i, x0, y0)  # the layer's input, rebuilt: the check measures the first one
        if want.previous:
            plan.walk = (x0, y0, finished)
        elif plan.offload is not None:
            plan.offload.streamer.release_all()
        return (None, None, None, dx0, dx1, *grads)


def _wanted(ctx, plan: Plan, i: int) -> _Wanted:
    """Which of layer ``i``'s input gradients the running backward will use: a parameter's gradient may be
    accumulated (``backward()``), captured (``torch.autograd.grad(loss, params)``) or unused (an input gradient
    only), and only what is used is computed (and only accumulated gradients may be stepped by a fused optimizer)."""
    edges = [node for node, _ in ctx.next_functions]  # x0, x1, then the layer's parameters and tensor arguments
    n_params = len(plan.layer_params[i])
    x0, x1 = (node_destination(node) is not _UNUSED for node in edges[:2])
    return _Wanted(
        x0,
        x1,
        [node_destination(node) for node in edges[2 : 2 + n_params]],
        [node_destination(node) is not _UNUSED for node in edges[2 + n_params :]],
        i > 0 and x1,
    )


def _keeps_graph() -> bool:
    """Whether the running backward was asked to keep the graph (``retain_graph=True``): then what the backward
    reads must survive it. Unknown (torch without the query) counts as yes."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if query is None else bool(query())


def _layer_backward(
    ctx,
    plan: Plan,
    i: int,
    y0: Tensor,
    y1: Tensor,
    dy0: Tensor,
    dy1: Tensor,
    reseed,
    own_arg_tensors: Sequence[Tensor],
    want: _Wanted,
    later: Sequence[Tensor],
):
    """Rebuild layer ``i``'s input from its output, recompute it with autograd, and return its input, the
    gradients flowing into its two input streams, those of its parameters and tensor arguments (``None`` for what
    ``want`` says is unused), and what the previous layer's recomputation must wait for (XLA).

    ``later``: what layer ``i + 1`` finished (its parameter and argument gradients, and its parameters after a fused
    step), put behind this layer's barrier: otherwise XLA may schedule every layer's weight-gradient matmuls (and
    fused steps) after the whole walk, keeping every layer's recomputed activations and output gradients alive.

    This runs once per layer in every backward, so per-layer bookkeeping is kept out of it (see ``Plan``): on
    small layers the Python around the block costs as much as the block."""
    wrapper = plan.wrappers[i]
    off = plan.offload
    tensors = None
    used = [j for j, dest in enumerate(want.params) if dest is not _UNUSED]  # positions in plan.layer_params[i]
    units = plan.fsdp_units[i] if plan.fsdp_units is not None else None
    accumulated: list[int] = []  # with FSDP2 units: used positions, whose unsharded parameters FSDP2 reduces
    if units is not None:
        accumulated, used = used, units.split(used)
    layer_params: Sequence[Tensor]
    if off is None:
        layer_params = plan.own_params[i]
    else:  # differentiate against device copies of the host parameters; their gradients go back to the host
        copies = list(off.streamer.fetch(i, prefetch=i - 1 if want.previous else None))
        for j in used:
            pos = off.param_pos[i][plan.layer_params[i][j]]
            copies[pos] = copies[pos].detach().requires_grad_()
        layer_params = [copies[off.param_pos[i][k]] for k in plan.layer_params[i]]
        tensors = off.mapping(i, copies)
        del copies
    recompute_args = {
        k: a.detach().requires_grad_() if need else a
        for k, a, need in zip(plan.layer_arg_slots[i], own_arg_tensors, want.args)
    }
    own_args = [recompute_args[k] for k, need in zip(plan.layer_arg_slots[i], want.args) if need]
    y0, y1, dy0, dy1 = backends.optimization_barrier([y0, y1, dy0, dy1, *layer_params, *_finished(later)])[:4]
    replaced: contextlib.AbstractContextManager[Any] = _NOTHING
    if off is None and used and (units is not None or any(layer_params[j]._backward_hooks for j in used)):
        # The recomputation differentiates aliases of the parameters: a VJP taken against the parameters themselves
        # would run their tensor hooks, which run again when the engine accumulates the gradients returned here.
        # (With FSDP2 units, the gradients of the rest are accumulated where FSDP2 reduces them, see fsdp.LayerUnits.)
        aliases = {j: layer_params[j].detach().requires_grad_() for j in used}
        replaced = _parameters_replaced(plan.param_slots[i], aliases)
        own_params = list(aliases.values())
    else:
        own_params = [layer_params[j] for j in used]
    args, kwargs = plan.args_for(i, recompute_args)
    saved = plan.saved_buffers[i]  # the forward's buffer values; the current ones are put back after the gradient
    with (
        saved.replayed(plan.buffers_of(i, tensors)) if saved is not None else _NOTHING,
        units.recomputing(want.previous) if units is not None else _NOTHING,
    ):
        reseed(plan.seed_of(i))
        grad_out = dy1
        with torch.enable_grad(), ctx.layer_autocast():
            fixed = plan.fixed
            x1 = y0.detach() if fixed is None else fixed.decode(y0, cast(torch.dtype, plan.value_dtype))
            x1.requires_grad_(want.x1)
            with replaced:
                fn_out = call_block(plan, i, to_compute(x1, plan), args, kwargs, tensors)
            if fixed is not None:  # exact: the integers subtracted are the ones the forward added
                out = first_tensor(fn_out)
                x0 = _fixed.uncouple(fixed, y1, out)
                grad_out = _fixed.branch_gradient(dy1, out.shape, out.dtype)
            elif plan.subtracts[i] and isinstance(fn_out, torch.Tensor):
                x0 = y1 - fn_out.detach()
            else:
                x0 = wrapper.uncouple(y1, optional_detach(fn_out))
                if x0.requires_grad:  # a coupling that closes over parameters: its inverse is not differentiated
                    x0 = x0.detach()
            if plan.stream_dtype is not None:
                x0 = x0.to(plan.stream_dtype)
            # With the additive coupling in one dtype, the gradient of the other stream is dy1 itself and the
            # block's output (when it has the stream's shape, i.e. is not broadcast) gets dy1 too, so the coupling
            # need not be differentiated: one graph node and one stream-sized tensor less per layer. Exact streams
            # are differentiated straight through the rounding: the same (grad_out sums a broadcast output's).
            out = first_tensor(fn_out)
            additive = fixed is not None or (
                plan.additive[i] and isinstance(out, torch.Tensor) and out.shape == y1.shape
            )
            x0_leaf = []
            if not additive:
                x0_leaf = [x0.detach().requires_grad_()] if want.x0 else []
                out = wrapper.couple(x0_leaf[0] if x0_leaf else x0, fn_out)
                if plan.stream_dtype is not None:
                    out = out.to(plan.stream_dtype)
        inputs = [*x0_leaf, *([x1] if want.x1 else []), *own_params, *own_args]
        if units is not None:
            grads = units.vjp(out, inputs, grad_out, accumulated)
        else:
            grads = list(vjp(out, inputs, grad_out)) if inputs else []
    del fn_out, out, tensors, own_params, layer_params, inputs, grad_out
    grads.reverse()  # popped in the order of the inputs
    dx0 = None
    if want.x0:
        dx0 = dy1 if additive else grads.pop()
        dx0 = torch.zeros_like(x0) if dx0 is None else dx0
    dx1 = None
    if want.x1:
        g = grads.pop()
        dx1 = dy0 if g is None else dy0 + g
    if off is not None:
        backends.cut_graph(x0)  # xla: this layer's recomputation and gradients as one graph, run now
    param_grads: list[Tensor | None] = [None] * len(want.params)
    for j in used:
        g = grads.pop()
        if g is not None and off is not None:
            g = backends.to_host_blocking(g, plan.params[plan.layer_params[i][j]].device)
        param_grads[j] = g
    arg_grads = [grads.pop() if need else None for need in want.args]
    if off is not None:
        off.streamer.release(i)
    fused_done = plan.fused_done  # set with plan.fused
    if plan.fused is not None and fused_done is not None and fused_done[i]:  # this layer's gradients are complete:
        # step, then free them
        done = [j for j in fused_done[i] if want.params[j] is _ACCUMULATE]  # never on autograd.grad()
        if done:
            plan.fused.step_params([plan.params[plan.layer_params[i][j]] for j in done], [param_grads[j] for j in done])
        for j in done:
            param_grads[j] = None
    finished: tuple[list[Tensor], list[nn.Parameter]] = ([], [])
    if backends.is_tracing_lazily(x0):  # eager: nothing to order, and no reference kept to a returned gradient
        # An accumulated gradient is reached through its parameter's .grad: holding it here would make
        # AccumulateGrad copy it rather than take it over.
        kept = [g for g, dest in zip(param_grads, want.params) if g is not None and dest is not _ACCUMULATE]
        finished = (kept + [g for g in arg_grads if g is not None], plan.own_params[i])
    return x0, y0, dx0, dx1, param_grads + arg_grads, finished


def _finished(later) -> list[Tensor]:
    """The tensors a layer finished (see :func:`_layer_backward`), read once the engine has accumulated its
    gradients: the gradients it returned, its parameters (changed by a fused step) and their ``.grad``."""
    if not later:
        return []
    grads, params = later
    return [*grads, *params, *(p.grad for p in params if p.grad is not None)]


_NOTHING = contextlib.nullcontext()


@contextlib.contextmanager
def _parameters_replaced(slots: Sequence[tuple[nn.Module, str, int]], tensors: dict[int, Tensor]):
    """Run with ``tensors[j]`` in place of the parameter at position ``j`` (``slots``: where each sits), as
    ``torch.func.functional_call`` does, without its per-call cost."""
    swapped = []
    try:
        for module, name, j in slots:
            if j in tensors:
                swapped.append((module, name, module._parameters[name]))
                # a plain tensor stands in for the parameter, as in torch.func.functional_call
                module._parameters[name] = tensors[j]  # type: ignore[assignment]
        yield
    finally:
        for module, name, param in swapped:
            module._parameters[name] = param


def _nothing() -> contextlib.nullcontext:
    return _NOTHING


_ENGINE_BACKWARD = getattr(torch.autograd.graph, "_engine_run_backward", None)


def vjp(out: Tensor, inputs: Sequence[Tensor], grad: Tensor) -> tuple[Tensor | None, ...]:
    """The gradients of ``out`` (weighted by ``grad``) with respect to ``inputs``; ``None`` for an input it does not
    depend on, and for every input when it depends on none.

    ``torch.autograd.grad`` without its argument checks, which cost about 45 us per call and run once per layer:
    here the arguments are built by the caller and are known to be well-formed. The private entry point is called
    with keywords (torch 2.5 to 2.13 name them alike), so a reordering fails loudly instead of passing a flag for
    another; a torch without it gets the public function."""
    if not out.requires_grad:
        return (None,) * len(inputs)
    if _ENGINE_BACKWARD is None:
        return torch.autograd.grad(out, inputs, grad, allow_unused=True)
    return _ENGINE_BACKWARD(
        (out,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=tuple(inputs),
        allow_unreachable=True,
        accumulate_grad=False,
    )
