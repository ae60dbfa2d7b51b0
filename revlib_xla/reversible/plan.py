"""One call of a reversible sequence as its autograd nodes see it (:class:`Plan`: the layers, their arguments with
tensors replaced by slots, their parameters, dtypes, seeds and exact-stream format), and one layer's forward on it
(:func:`forward_layer`, :func:`forward_fixed`) with the checks of what a block returns."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import _tree, fsdp
from ..errors import ReversibleError
from ..fused_optimizer import FusedOptimizer
from ..offload import ParameterStreamer
from ..recompute import CallReplay, RecomputeState, SavedBuffers
from . import fixed_point as _fixed
from . import rebuild_check
from .coupling import (
    additive_coupling_forward,
    additive_coupling_inverse,
    first_tensor,
)
from .layers import ReversibleModule, ReversibleWrapper

Tensor = torch.Tensor


# ----------------------------------------------------------------------------------------------------------------
# Arguments: tensors inside args/kwargs become explicit inputs of the layers' autograd nodes (so they get gradients
# and their in-place modification is detected); everything else is passed through unchanged.


@dataclasses.dataclass(frozen=True)
class Slot:
    index: int


def _filled(flat: tuple[list[Any], Any], tensors: Sequence[Tensor] | dict[int, Tensor]) -> Any:
    """A value flattened by :func:`_tree.tree_flatten` with its :class:`Slot` leaves replaced by ``tensors``."""
    leaves, spec = flat
    return _tree.tree_unflatten([tensors[x.index] if isinstance(x, Slot) else x for x in leaves], spec)


@dataclasses.dataclass
class Plan:
    """What the layers' autograd nodes need besides tensors: the layers, their arguments with tensors replaced by
    slots, and which (deduplicated) parameters each layer uses."""

    layers: list[ReversibleModule]
    names: list[str]
    layer_args: list[tuple[Any, Any]]
    layer_arg_slots: list[list[int]]
    params: list[nn.Parameter]
    layer_params: list[list[int]]
    layer_buffers: list[list[tuple[nn.Module, Tensor]]]  # per layer: its buffers, each once, with their modules
    call: CallReplay  # the call's seed, autocast state and the user's generators met in each layer
    stream_dtype: torch.dtype | None
    compute_dtype: torch.dtype | None
    state: RecomputeState  # the model's: which buffers its layers change in their forward
    param_slots: list[list[tuple[nn.Module, str, int]]] = dataclasses.field(default_factory=list)  # per layer:
    # where its parameters sit in its modules (module, name, position in layer_params)
    offload: LayerOffload | None = None
    fused: FusedOptimizer | None = None
    fused_done: list[list[int]] | None = None  # per layer: positions (in layer_params) of the fused-stepped ones
    walk: tuple[Tensor, Tensor, Any] | None = None  # the backward walk: the streams the next layer's backward
    # rebuilt, and what it finished (see _layer_backward)
    fsdp_units: list[fsdp.LayerUnits | None] | None = None  # per layer: the FSDP2 units inside its block
    stacked: Callable[[int], dict[str, Tensor]] | None = None  # stacked parameters (scan.stack_layers): layer i's
    # parameters as views of the stacks, for the paths that call the blocks one by one
    rebuild: rebuild_check.RebuildCheck | None = None  # verify_inverse's default: the backward measures its rebuild
    # Exact (fixed-point) streams, see revlib_xla.fixed_point: the streams' format (None: floating-point streams), the
    # floating dtype their values are decoded to (and their gradients flow in), the forward's range check, and the
    # streams a layer's forward reads and leaves for the next (the autograd nodes carry the decoded values).
    fixed: _fixed.FixedPoint | None = None
    value_dtype: torch.dtype | None = None
    guard: _fixed.StreamGuard | None = None
    fixed_streams: tuple[Tensor, Tensor] | None = None
    # Derived once per call rather than once per layer and pass (see _layer_backward):
    wrappers: list[ReversibleWrapper] = dataclasses.field(init=False)
    adds: list[bool] = dataclasses.field(init=False)  # per layer: coupling_forward is additive
    subtracts: list[bool] = dataclasses.field(init=False)  # per layer: coupling_inverse is its additive inverse
    additive: list[bool] = dataclasses.field(init=False)  # adds, and streams and blocks share one dtype
    seeds: list[int | None] = dataclasses.field(init=False)
    own_params: list[list[nn.Parameter]] = dataclasses.field(init=False)
    # What the forward leaves for the recomputations besides ``call``: the values each layer's changed buffers had
    # before its forward.
    saved_buffers: list[SavedBuffers | None] = dataclasses.field(init=False)
    flat_args: list[tuple[list[Any], Any] | None] = dataclasses.field(init=False)  # per layer with tensor arguments:
    # its (args, kwargs) flattened once, for args_for to fill in

    def __post_init__(self) -> None:
        self.wrappers = [layer.wrapped_module for layer in self.layers]
        self.adds = [w.coupling_forward is additive_coupling_forward for w in self.wrappers]
        self.subtracts = [w.coupling_inverse is additive_coupling_inverse for w in self.wrappers]
        one_dtype = self.stream_dtype is None and self.compute_dtype is None
        self.additive = [one_dtype and add for add in self.adds]
        self.seeds = [self.call.unit_seed(i) for i in range(len(self.layers))]
        self.own_params = [[self.params[k] for k in ks] for ks in self.layer_params]
        self.saved_buffers = [None] * len(self.layers)
        self.flat_args = [
            _tree.tree_flatten(a) if slots else None for a, slots in zip(self.layer_args, self.layer_arg_slots)
        ]

    def args_for(self, i: int, arg_tensors: Sequence[Tensor] | dict[int, Tensor]) -> tuple[Any, Any]:
        flat = self.flat_args[i]
        if flat is None:  # no tensors inside: nothing to fill in (the common case, and per layer)
            return self.layer_args[i]
        return _filled(flat, arg_tensors)

    def seed_of(self, i: int) -> int | None:
        return self.seeds[i]

    def buffers_of(self, i: int, tensors: dict[str, Tensor] | None) -> list[Tensor]:
        """The tensors standing for layer ``i``'s buffers: its own, or (``target_device``) their device copies in
        ``tensors``, in the order of ``layer_buffers``."""
        if tensors is None:
            return [b for _, b in self.layer_buffers[i]]
        return [tensors[self.offloaded().buffer_names[i][id(b)]] for _, b in self.layer_buffers[i]]

    def watch_buffers(self, i: int, tensors: dict[str, Tensor] | None = None):
        """Before layer ``i``'s forward (see :meth:`RecomputeState.watch`); ``None`` for a layer without buffers."""
        if not self.layer_buffers[i]:
            return None
        return self.state.watch(self.layer_buffers[i], None if tensors is None else self.buffers_of(i, tensors))

    def describe(self, i: int) -> str:
        return layer_label(i, self.names[i], self.layers[i])

    def describe_stream(self, i: int) -> str:
        """Where a value entering an exact stream came from: layer ``i``'s block, or (-1) the input."""
        return "the input" if i < 0 else self.describe(i)

    def offloaded(self) -> LayerOffload:
        """The offload of a plan with ``target_device`` (a caller that holds device copies knows it has one)."""
        if self.offload is None:
            raise RuntimeError("ReversibleSequential: internal error: device copies without target_device")
        return self.offload


def layer_label(i: int, name: str, layer: ReversibleModule) -> str:
    return f"layer {i} ('{name}': {type(layer.block).__name__})"


@dataclasses.dataclass
class LayerOffload:
    """``target_device``: each layer's block runs on device copies of its parameters and buffers, streamed from
    where they live (the host) by a :class:`ParameterStreamer`, one layer ahead."""

    streamer: ParameterStreamer
    names: list[list[list[str]]]  # per layer, per streamed tensor: its names inside the block
    param_pos: list[dict[int, int]]  # per layer: index in plan.params -> position among the streamed tensors
    buffer_pos: list[list[int]]  # per layer: positions of buffers (written back after the forward)

    buffer_names: list[dict[int, str]] = dataclasses.field(init=False)  # per layer: id(host buffer) -> a name

    def __post_init__(self) -> None:
        self.buffer_names = [
            {id(units[p]): names[p][0] for p in positions}
            for units, names, positions in zip(self.streamer.units, self.names, self.buffer_pos)
        ]

    def mapping(self, i: int, tensors: Sequence[Tensor]) -> dict[str, Tensor]:
        return {name: t for names, t in zip(self.names[i], tensors) for name in names}

    def write_back_buffers(self, i: int, copies: Sequence[Tensor]) -> None:
        """Running statistics updated on the device copy in the forward go back to the host buffers."""
        unit = self.streamer.units[i]
        with torch.no_grad():
            for pos in self.buffer_pos[i]:
                unit[pos].copy_(copies[pos])


def call_block(plan: Plan, i: int, x: Tensor, args, kwargs, tensors: dict[str, Tensor] | None):
    """The block of layer ``i`` on ``x``: with its own parameters, or with ``tensors`` (name -> device copy)."""
    wrapper = plan.wrappers[i]
    if tensors is None:
        return wrapper.fn(x, args, kwargs)
    return torch.func.functional_call(wrapper.wrapped_module, tensors, (x, *args), dict(kwargs or {}))


def to_streams(plan: Plan, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
    if plan.stream_dtype is None:
        return x0, x1
    return x0.to(plan.stream_dtype), x1.to(plan.stream_dtype)


def to_compute(x: Tensor, plan: Plan) -> Tensor:
    return x if plan.compute_dtype is None else x.to(plan.compute_dtype)


def _block_output(plan: Plan, i: int, x1: Tensor, args, kwargs, tensors: dict[str, Tensor] | None) -> Any:
    """Layer ``i``'s block on the stream value ``x1``, with the in-place and return-type checks."""
    version = x1._version
    fn_out = call_block(plan, i, to_compute(x1, plan), args, kwargs, tensors)
    if x1._version != version:
        raise ReversibleError(
            f"{plan.describe(i)} modified its input in place (for example ReLU(inplace=True) or `x += ...` as its "
            f"first operation); a reversible block must not change its input stream. Use the out-of-place form."
        )
    if not isinstance(fn_out, torch.Tensor) and not (
        isinstance(fn_out, (list, tuple)) and fn_out and isinstance(fn_out[0], torch.Tensor)
    ):
        raise ReversibleError(
            f"{plan.describe(i)} returned {_type_of(fn_out)}: a reversible block must return a tensor (its branch "
            f"f(x), which the coupling merges into the other stream), or a list/tuple whose first element is one. "
            f"Does its forward end with `return ...`?"
        )
    return fn_out


def grouped(x: Tensor) -> Tensor:
    """``x`` as the input of a block under plain autograd: through a node of its own (a view), so that the block's
    gradient contributions are summed before they meet the stream's others, as the reversible backward sums them
    (autograd adds a tensor's contributions in the order they arrive, and floating-point addition does not
    associate): the same function's gradients, to the bit."""
    return x.view_as(x) if x.requires_grad and torch.is_grad_enabled() else x


def forward_fixed(
    plan: Plan,
    i: int,
    s0: Tensor,
    x1: Tensor,
    args,
    kwargs,
    tensors: dict[str, Tensor] | None = None,
    x0: Tensor | None = None,
    guard: _fixed.StreamGuard | None = None,
) -> tuple[Tensor, Tensor]:
    """One layer on exact streams: ``(value, stream)`` of ``x0 + f(x1)`` on the grid, from ``x0``'s stream ``s0``
    and ``x1``'s value. ``x0`` (``s0``'s value) carries its gradient under plain autograd; ``guard``: the range
    check that records what the layer adds (``None``: none)."""
    fixed, dtype = plan.fixed, plan.value_dtype
    assert fixed is not None and dtype is not None
    f = first_tensor(_block_output(plan, i, grouped(x1), args, kwargs, tensors))
    if f.shape != s0.shape:
        try:
            broadcast = torch.broadcast_shapes(f.shape, s0.shape) == s0.shape
        except RuntimeError:
            broadcast = False
        if not broadcast:
            raise ReversibleError(
                f"{plan.describe(i)}: coupling its output {tuple(f.shape)} with the other stream {tuple(s0.shape)} "
                f"failed (the sum would not have the stream's shape). A reversible block must return a tensor the "
                f"coupling can merge with its input stream, normally of the same shape."
            )
    if not f.dtype.is_floating_point:
        raise ReversibleError(f"{plan.describe(i)} returned a {f.dtype} tensor; a block must return floating point")
    if f.device != s0.device:
        raise ReversibleError(
            f"{plan.describe(i)}: coupling its output (on {f.device}) with the other stream (on {s0.device}) "
            f"failed: a reversible block must return its output on its input's device"
        )
    return _fixed.couple(fixed, s0, f, dtype, guard, i, x0)


def forward_layer(
    plan: Plan, i: int, x0: Tensor, x1: Tensor, args, kwargs, tensors: dict[str, Tensor] | None = None
) -> Tensor:
    """One layer's ``coupling_forward(x0, f(x1))`` with the shape, dtype and in-place checks."""
    wrapper = plan.wrappers[i]
    fn_out = _block_output(plan, i, x1, args, kwargs, tensors)
    try:
        y1 = x0 + fn_out if plan.adds[i] and isinstance(fn_out, torch.Tensor) else wrapper.couple(x0, fn_out)
    except RuntimeError as err:
        raise ReversibleError(
            f"{plan.describe(i)}: coupling its output {_shape_of(fn_out)} with the other stream "
            f"{tuple(x0.shape)} failed ({err}). A reversible block must return a tensor the coupling can merge "
            f"with its input stream, normally of the same shape."
        ) from None
    if not isinstance(y1, torch.Tensor):
        raise ReversibleError(f"{plan.describe(i)}: the coupling returned {type(y1).__name__}, expected a tensor")
    if y1.shape != x0.shape:
        raise ReversibleError(
            f"{plan.describe(i)} changed its stream's shape: the stream is {tuple(x0.shape)} but the coupled output "
            f"is {tuple(y1.shape)}. A reversible block must return a tensor of its input's shape (the block's output "
            f"was {tuple(first_tensor(fn_out).shape)})."
        )
    if plan.stream_dtype is not None and y1.dtype != plan.stream_dtype:
        y1 = y1.to(plan.stream_dtype)
    if y1.dtype != x0.dtype:
        raise ReversibleError(
            f"{plan.describe(i)} changed its stream's dtype from {x0.dtype} to {y1.dtype}. Return the input's dtype, "
            f"or pass stream_dtype=... to keep both streams in one dtype while blocks compute in another."
        )
    return y1


def _type_of(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {[type(v).__name__ for v in value]}"
    return "None" if value is None else f"a {type(value).__name__}"


def _shape_of(value) -> str:
    t = first_tensor(value)
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def streams_of(plan: Plan, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
    """The streams whose values ``(x0, x1)`` are: themselves, or (exact streams) the fixed-point ones."""
    if plan.fixed is None:
        return x0, x1
    assert plan.fixed_streams is not None
    return plan.fixed_streams
