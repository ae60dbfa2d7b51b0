"""The invertibility check: each layer's inverse, and the whole sequence's, measured on a sample before the backward
relies on them (:func:`check_plan`, what :func:`revlib_xla.check_invertible` runs), and the layers' inverse
(:func:`inverse_layer`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch

from .. import backends
from ..errors import ReversibleError
from ..offload import offload_tensor
from ..recompute import preserved, rewind, rng_scope
from . import fixed_point as _fixed
from . import rebuild_check
from .coupling import (
    first_tensor,
)
from .plan import Plan, call_block, forward_fixed, forward_layer, to_compute

Tensor = torch.Tensor


def plain_copies(plan: Plan, i: int) -> dict[str, Tensor] | None:
    """With ``target_device``: layer ``i``'s tensors copied to the device (no streaming), for the inverse and the
    invertibility check; with stacked parameters, views of them."""
    if plan.offload is None:
        return None if plan.stacked is None else plan.stacked(i)
    device = plan.offload.streamer.device
    return plan.offload.mapping(i, [offload_tensor(t, device) for t in plan.offload.streamer.units[i]])


def inverse_layer(
    plan: Plan, i: int, y0: Tensor, y1: Tensor, args, kwargs, tensors: dict[str, Tensor] | None = None
) -> Tensor:
    wrapper = plan.layers[i].wrapped_module
    if plan.fixed is not None:  # streams: y0's value is what the block saw
        value = plan.fixed.decode(y0, cast(torch.dtype, plan.value_dtype))
        return _fixed.uncouple(
            plan.fixed, y1, first_tensor(call_block(plan, i, to_compute(value, plan), args, kwargs, tensors))
        )
    x0 = wrapper.uncouple(y1, call_block(plan, i, to_compute(y0, plan), args, kwargs, tensors))
    if plan.stream_dtype is not None:
        x0 = x0.to(plan.stream_dtype)
    return x0


# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class InvertibilityReport:
    """What :func:`check_invertible` measured, as relative errors (max abs error / max abs value).

    ``errors``: per layer, the layer's input rebuilt from its output by that layer alone. ``end_to_end``: the
    sequence's input rebuilt from its output through every layer, as the reversible backward rebuilds it; rounding
    errors that the inverses amplify (a momentum coupling divides by ``beta``) show here and not in ``errors``."""

    errors: list[float]
    tolerance: float
    end_to_end: float = 0.0

    @property
    def worst(self) -> float:
        return max(self.errors + [self.end_to_end])


@torch.no_grad()
@backends.autocast_cache_off()
def check_plan(
    plan: Plan, x0: Tensor, x1: Tensor, arg_tensors: Sequence[Tensor], tolerance: float | None = None
) -> InvertibilityReport:
    """:func:`check_invertible` on prepared streams; every error is read back at once (one device sync). It runs
    the layers without autograd and without autocast's weight-cast cache, which would keep their casts for a
    training step in the same autocast region."""
    n = len(plan.layers)
    tol = tolerance if tolerance is not None else rebuild_check.tolerance(x0.dtype, plan.compute_dtype)
    replays: list[Any] = []  # relative errors: tensors, then (read back at once) floats
    locals_: list[Any] = []
    active, device = plan.call.seed is not None, x0.device
    generators: dict[Any, Any] = {}
    plain = plan.call.plain  # the plain model's random numbers: each layer's state captured here, put back after
    start = backends.RngState.capture(device) if plain else None
    states: dict[int, backends.RngState] = {}

    @contextlib.contextmanager
    def as_in_the_forward(i: int, copies: dict[str, Tensor] | None, replay: bool = True) -> Iterator[None]:
        """Layer ``i``'s random numbers, own generators and buffers as its forward met them (the buffers left as
        they were after), as the backward's recomputation has them."""
        with preserved(plan.buffers_of(i, copies)), rng_scope(device, active or plain, generators, replay, plain) as r:
            r(plan.seed_of(i))
            if plain and i not in states:
                states[i] = backends.RngState.capture(device)
            elif plain:
                states[i].restore()
            yield

    fixed = plan.fixed
    if fixed is not None:  # exact streams: every comparison is of the integers
        assert plan.fixed_streams is not None
        x0, x1 = plan.fixed_streams
    try:
        a0, a1 = x0, x1
        for i in range(n):
            args, kwargs = plan.args_for(i, arg_tensors)
            copies = plain_copies(plan, i)
            if fixed is not None:
                value = fixed.decode(a1, cast(torch.dtype, plan.value_dtype))
                with as_in_the_forward(i, copies, replay=False):
                    y1 = forward_fixed(plan, i, a0, value, args, kwargs, copies)[1]
                with as_in_the_forward(i, copies):
                    f = first_tensor(call_block(plan, i, to_compute(value, plan), args, kwargs, copies))
                scale = rebuild_check.magnitude(a0, y1)
                replays.append(rebuild_check.relative_error(a0 + fixed.encode(f), y1, scale))
                locals_.append(rebuild_check.relative_error(_fixed.uncouple(fixed, y1, f), a0, scale))
                a0, a1 = a1, y1
                continue
            with as_in_the_forward(i, copies, replay=False):
                y1 = forward_layer(plan, i, a0, a1, args, kwargs, copies)
            with as_in_the_forward(i, copies):  # the replay starts from the forward's state, as the backward's
                fn_out = call_block(plan, i, to_compute(a1, plan), args, kwargs, copies)
            wrapper = plan.wrappers[i]
            scale = rebuild_check.magnitude(a0, y1)
            replays.append(rebuild_check.relative_error(wrapper.couple(a0, fn_out).to(y1.dtype), y1, scale))
            locals_.append(rebuild_check.relative_error(wrapper.uncouple(y1, fn_out).to(a0.dtype), a0, scale))
            a0, a1 = a1, y1
        for i in reversed(range(n)):  # as the backward does: from the output alone, through every layer
            args, kwargs = plan.args_for(i, arg_tensors)
            copies = plain_copies(plan, i)
            with as_in_the_forward(i, copies):
                a0, a1 = inverse_layer(plan, i, a0, a1, args, kwargs, copies), a0
        end = rebuild_check.rebuild_error(a0, a1, x0, x1)
    finally:
        rewind(generators)  # the blocks' own generators as they were
        if start is not None:
            start.restore()  # torch's generators too: the check draws nothing the plain model would not
    values = torch.stack([*replays, *locals_, end]).cpu().tolist()
    replays, locals_, end = values[:n], values[n : 2 * n], values[-1]
    for i in range(n):
        if not replays[i] <= tol:
            raise ReversibleError(
                f"{plan.describe(i)} gave a different output when run again on the same input, arguments and random "
                f"seed (relative difference {replays[i]:.3g}; tolerance {tol:.1g}), so the backward, which runs every "
                f"block again, would not rebuild the forward's activations. The block keeps state between calls: a "
                f"cache it appends to (a transformers KV cache: pass use_cache=False when training) or Python's "
                f"random. Make its output depend only on its input, arguments, parameters, buffers and torch's random "
                f"numbers (a torch.Generator of its own included), or use memory_mode=MemoryModes.no_savings."
                + ("" if plan.call.preserves else " With random ops (dropout), keep preserve_rng_state=True.")
            )
        if not locals_[i] <= tol:
            raise ReversibleError(
                f"{plan.describe(i)}: coupling_inverse does not undo coupling_forward: the rebuilt input stream "
                f"differs from the real one by {locals_[i]:.3g} (relative; tolerance {tol:.1g}). Check that "
                f"coupling_inverse(coupling_forward(x, f), f) == x for this layer's pair."
            )
    if not end <= tol:
        raise ReversibleError(
            f"ReversibleSequential: the input rebuilt from the output through all {n} layers, as the backward "
            f"rebuilds it, differs from the real input by {end:.3g} (relative; tolerance {tol:.1g}), although each "
            f"layer alone inverts within {max(locals_):.1g}: the layers' inverses amplify rounding errors (a momentum "
            f"coupling, or a MomentumNet, divides by beta at every layer). The gradients would be about as far off. "
            f"Use a larger beta, fewer layers per reversible sequence, or float64 streams (stream_dtype=torch.float64"
            f"; revlib_xla.check_invertible(model, x) measures the result), or memory_mode=MemoryModes.no_savings. "
            f"For inference only, run under torch.no_grad(): nothing is rebuilt then."
        )
    return InvertibilityReport(locals_, tol, end)
