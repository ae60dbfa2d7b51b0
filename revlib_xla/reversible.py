"""Reversible sequences: activation memory that does not grow with depth.

A reversible layer maps two streams ``(x0, x1)`` to ``(x1, coupling_forward(x0, f(x1)))`` ("half residual and
swap"); a RevNet block with functions F and G is two such layers. Because ``x0 = coupling_inverse(y1, f(y0))``,
the backward pass rebuilds every layer's input from its output, so nothing but the final output has to be kept.
With additive couplings the streams are exact by default (:mod:`revlib_xla.fixed_point`): integers on a fixed grid,
so the rebuild is bit for bit; the autograd nodes carry the streams' decoded values (for their gradients) and the
plan the integers (``_Plan.fixed_streams``).

Design (what differs from RevLib and why):

* No activation is saved: each layer is one autograd node that keeps only its parameters and tensor arguments,
  and the last one keeps the final two streams. Under XLA, lifetimes are decided by graph dataflow, and saving each
  layer's output would keep it alive until its backward (O(depth)). The backward of the last layer rebuilds its
  input from the saved output and hands it to the previous layer's backward, and so on down the sequence.
* A node per layer lets autograd accumulate each layer's parameter gradients through the parameters' own
  ``AccumulateGrad`` as soon as that layer is done (hooks, DDP and micro-batched accumulation see ordinary
  parameters, and only one layer's gradients are in flight); the engine says which gradients a backward uses
  (:mod:`revlib_xla._grad_destination`), so an input-gradient-only request computes no weight gradient and a fused
  optimizer steps only in a training backward.
* Before each layer's recomputation the backward places an optimization barrier over what it reads, so XLA cannot
  merge the recomputation with the forward (which would keep the forward's activations alive).
* Parameters and tensor arguments are explicit inputs of each layer's node, so they get gradients whether or not the
  input requires grad, and gradients of the other stream come from the coupling's own vector-Jacobian product.
  Gradients of gradients (``create_graph=True``) raise: the rebuilt inputs carry no autograd history.
* Each layer runs under a seed derived from one seed drawn per forward, with generators of its own (cpu, cuda; xla
  seeds the device), and the recomputation reuses it; the autocast state is captured at forward time and replayed;
  buffers a layer changes in its forward are given their earlier values for the recomputation (see
  :mod:`revlib_xla.recompute`). Only integers are kept per layer, plus those buffers, so nothing else grows with
  depth.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, cast

import torch
from torch import nn

from . import _rebuild_check, _tree, backend, fsdp
from . import fixed_point as _fixed
from . import scan as _scan
from ._grad_destination import GradDestination, node_destination
from .coupling import (
    COUPLING,
    CouplingPair,
    additive_coupling_forward,
    additive_coupling_inverse,
    first_tensor,
    is_additive_forward,
    is_additive_inverse,
    optional_detach,
    pick,
)
from .errors import ReversibleError
from .fused_optimizer import FusedOptimizer, FusedOptimizerError
from .offload import ParameterStreamer, offload_tensor
from .recompute import CallReplay, RecomputeState, SavedBuffers, owned_buffers, preserved, rewind, rng_scope

Tensor = torch.Tensor
DUAL_OR_QUAD_TENSOR = tuple[Tensor, Tensor, Tensor, Tensor] | tuple[Tensor, Tensor]
FUSED_OPTIMIZER = Callable[[Iterable], torch.optim.Optimizer] | None
LAYERWISE_ARGS_KWARGS = list[tuple[list[Any], dict[str, Any]]] | None

__all__ = [
    "MemoryModes",
    "ReversibleModule",
    "ReversibleSequential",
    "ReversibleModuleCache",
    "ReversibleError",
    "check_invertible",
    "InvertibilityReport",
    "offload_tensor",
    "DUAL_OR_QUAD_TENSOR",
    "FUSED_OPTIMIZER",
]


class MemoryModes(enum.IntEnum):
    """RevLib's memory modes. ``checkpoint`` and ``autograd_graph`` run as ``autograd_function`` (see
    :class:`ReversibleSequential`): RevLib's cache modes peak above ``no_savings``."""

    no_savings = 0
    checkpoint = 1
    autograd_graph = 2
    autograd_function = 3


def _describe_coupling(coupling: COUPLING | None) -> str:
    return getattr(coupling, "__qualname__", None) or repr(coupling)


def _check_pair(
    forward: COUPLING | None, inverse: COUPLING | None, where: str, forward_name: str, inverse_name: str
) -> None:
    """Refuse a coupling without its inverse, or an inverse without its coupling (``None`` means additive): RevLib
    pairs a lone ``coupling_forward`` with the additive inverse, which rebuilds the wrong input and gives wrong
    gradients.

    A pair given explicitly on both sides cannot be judged here; :func:`check_invertible`, which runs at the first
    training forward for every pair that is not additive (``verify_inverse``), measures it."""
    if inverse is None and not is_additive_forward(forward):
        problem = (
            f"{forward_name} is {_describe_coupling(forward)}, but {inverse_name} is None: the additive "
            f"inverse does not undo it"
        )
        fix = f"pass its inverse as {inverse_name}"
    elif forward is None and not is_additive_inverse(inverse):
        problem = (
            f"{inverse_name} is {_describe_coupling(inverse)}, but {forward_name} is None (additive): it is "
            f"not the inverse of the additive coupling"
        )
        fix = f"pass the coupling it inverts as {forward_name}"
    else:
        return
    raise ReversibleError(
        f"{where}: {problem}. The backward rebuilds each layer's input with the inverse, so a mismatched pair gives "
        f"wrong gradients; {fix} (e.g. pair = revlib_xla.momentum_coupling(0.9); coupling_forward=[pair.forward], "
        f"coupling_inverse=[pair.inverse])."
    )


def _coupling_list(value: Any, name: str) -> list[COUPLING | None]:
    """``coupling_forward``/``coupling_inverse`` as a list (a single callable is a list of one)."""
    if value is None:
        return []
    if isinstance(value, CouplingPair):
        raise ReversibleError(
            f"ReversibleSequential: {name} is a CouplingPair; pass coupling_forward=[pair.forward] and "
            f"coupling_inverse=[pair.inverse]"
        )
    if callable(value):
        return [value]
    if not isinstance(value, (list, tuple)):
        raise ReversibleError(
            f"ReversibleSequential: {name} must be a list of couplings (callables; None means "
            f"additive), got {type(value).__name__}"
        )
    for j, coupling in enumerate(value):
        if coupling is not None and not callable(coupling):
            hint = (
                ": pass pair.forward in coupling_forward and pair.inverse in coupling_inverse"
                if isinstance(coupling, CouplingPair)
                else ""
            )
            raise ReversibleError(
                f"ReversibleSequential: {name}[{j}] is a {type(coupling).__name__}, expected a "
                f"callable (or None for additive){hint}"
            )
    return list(value)


def _check_couplings(coupling_forward: Any, coupling_inverse: Any) -> None:
    """Both lists are cycled over the layers, so entry ``j`` of one must invert entry ``j`` of the other."""
    forwards = _coupling_list(coupling_forward, "coupling_forward")
    inverses = _coupling_list(coupling_inverse, "coupling_inverse")
    if forwards and inverses and len(forwards) != len(inverses):
        raise ReversibleError(
            f"ReversibleSequential: coupling_forward has {len(forwards)} entries but coupling_inverse has "
            f"{len(inverses)}. Both lists are cycled over the layers, so entry j of coupling_inverse must undo entry "
            f"j of coupling_forward: give them the same length (None for an additive layer)."
        )
    for j in range(max(len(forwards), len(inverses))):
        _check_pair(
            forwards[j] if forwards else None,
            inverses[j] if inverses else None,
            "ReversibleSequential",
            f"coupling_forward[{j}]" if forwards else "coupling_forward",
            f"coupling_inverse[{j}]" if inverses else "coupling_inverse",
        )


def _not_yet(feature: str, issue: str) -> NotImplementedError:
    return NotImplementedError(
        f"{feature} is not implemented yet in revlib_xla (it is delivered by the issue '{issue}'); "
        f"leave it at its default for now"
    )


class ReversibleModuleCache:
    """Kept so RevLib code that builds one still runs. revlib_xla's reversible backward needs no cache: every
    memory mode that saves memory runs the reversible backward walk, whose peak does not grow with depth."""

    def __init__(self) -> None:
        self.x0: Tensor | None = None
        self.x1: Tensor | None = None

    def __call__(self, x0: Tensor, x1: Tensor) -> None:
        self.x0, self.x1 = x0.detach(), x1.detach()


class ReversibleWrapper(nn.Module):
    """Holds the user's block and its coupling pair; computes one half-residual step."""

    def __init__(
        self,
        wrapped_module: nn.Module,
        coupling_forward: COUPLING | None = None,
        coupling_inverse: COUPLING | None = None,
    ):
        super().__init__()
        _check_pair(coupling_forward, coupling_inverse, "ReversibleModule", "coupling_forward", "coupling_inverse")
        self.wrapped_module = wrapped_module
        self.coupling_forward = coupling_forward or additive_coupling_forward
        self.coupling_inverse = coupling_inverse or additive_coupling_inverse

    def fn(self, x1: Tensor, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None):
        return self.wrapped_module(x1, *args, **(kwargs or {}))

    def couple(self, x0: Tensor, fn_out) -> Tensor:
        return first_tensor(self.coupling_forward(x0, fn_out))

    def uncouple(self, y1: Tensor, fn_out) -> Tensor:
        return first_tensor(self.coupling_inverse(y1, fn_out))

    def forward(self, x0: Tensor, x1: Tensor, *args, **kwargs) -> Tensor:
        return self.couple(x0, self.fn(x1, args, kwargs))

    def inverse(self, y0: Tensor, y1: Tensor, *args, **kwargs) -> Tensor:
        return self.uncouple(y1, self.fn(y0, args, kwargs))


class ReversibleModule(nn.Module):
    """One reversible layer: ``(x0, x1) -> (x1, coupling_forward(x0, wrapped_module(x1)))``.

    Standalone, it runs with plain autograd (RevLib-compatible signature; a 4-tuple input passes its last two
    entries through). Inside a :class:`ReversibleSequential` it is run by the sequence-level reversible backward.
    The user's block is reachable as ``.wrapped_module.wrapped_module`` (RevLib's state-dict layout).
    """

    def __init__(
        self,
        wrapped_module: nn.Module,
        coupling_forward: COUPLING | None = None,
        coupling_inverse: COUPLING | None = None,
        memory_savings: bool = True,
        cache: ReversibleModuleCache | None = None,
        target_device: str = "",
        fused_optimizer: FUSED_OPTIMIZER = None,
    ):
        super().__init__()
        if target_device or fused_optimizer is not None:
            raise ReversibleError(
                "ReversibleModule: target_device and fused_optimizer are options of the ReversibleSequential that runs "
                "the layers (ReversibleSequential(*blocks, target_device=..., fused_optimizer=...)); a standalone "
                "layer runs with plain autograd and has no backward walk to offload or fuse into"
            )
        self.wrapped_module = ReversibleWrapper(wrapped_module, coupling_forward, coupling_inverse)
        self.memory_savings = memory_savings
        self.cache = cache

    @property
    def block(self) -> nn.Module:
        return self.wrapped_module.wrapped_module

    def forward(self, inp: DUAL_OR_QUAD_TENSOR, *args, **kwargs) -> DUAL_OR_QUAD_TENSOR:
        if not isinstance(inp, (tuple, list)) or len(inp) not in (2, 4):
            raise ReversibleError("ReversibleModule expects a tuple of 2 streams (x0, x1) (or RevLib's 4-tuple)")
        x0, x1 = inp[0], inp[1]
        y1 = self.wrapped_module(x0, x1, *args, **kwargs)
        return cast(DUAL_OR_QUAD_TENSOR, (x1, y1, *inp[2:]))

    def inverse(self, out: tuple[Tensor, Tensor], *args, **kwargs) -> tuple[Tensor, Tensor]:
        y0, y1 = out[0], out[1]
        return self.wrapped_module.inverse(y0, y1, *args, **kwargs), y0

    def extra_repr(self) -> str:
        wrapper = self.wrapped_module
        return (
            f"coupling_forward={getattr(wrapper.coupling_forward, '__name__', wrapper.coupling_forward)}, "
            f"coupling_inverse={getattr(wrapper.coupling_inverse, '__name__', wrapper.coupling_inverse)}"
        )


def _dtype_mismatch(
    label: str, param_dtypes: set, blocks_see: torch.dtype, from_compute_dtype: bool
) -> ReversibleError:
    names = sorted(str(d) for d in param_dtypes)
    params = names[0]
    source = "compute_dtype" if from_compute_dtype else "the input's dtype"
    return ReversibleError(
        f"{label}: its parameters are {' and '.join(names)}, but it would compute on "
        f"{blocks_see} ({source}); without autocast that fails or silently computes in {blocks_see} (on XLA). Cast "
        f"the input (x.to({params})) or the model (model.to({blocks_see})), pass compute_dtype={params}, or run under "
        f"torch.autocast."
    )


def _refuse_kv_caches(args: Sequence[Any], kwargs: dict[str, Any], layerwise: LAYERWISE_ARGS_KWARGS) -> None:
    """Refuse a transformers KV cache among the arguments of a forward whose backward rebuilds: every block
    appends its keys and values to it in the forward, and the recomputation would append (and attend to) them a
    second time. Found without importing transformers: only a loaded ``transformers.cache_utils`` can have made one."""
    cache_type = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    if cache_type is None:
        return
    named = [(f"positional argument {j + 1} after the input", a) for j, a in enumerate(args)]
    named += [(f"keyword argument '{k}'", v) for k, v in kwargs.items()]
    named += [(f"layerwise_args_kwargs[{i}]", entry) for i, entry in enumerate(layerwise or ())]
    for where, value in named:
        cache = next((leaf for leaf in _tree.tree_leaves(value) if isinstance(leaf, cache_type)), None)
        if cache is not None:
            raise ReversibleError(
                f"ReversibleSequential: {where} is a transformers {type(cache).__name__} (use_cache=True, the default "
                f"of most decoder configs). Every block writes its keys and values into it in the forward, and the "
                f"reversible backward, which runs each block again, would write and attend to them a second time: "
                f"wrong gradients. Train with use_cache=False (model(..., use_cache=False), or "
                f"model.config.use_cache = False); generation under torch.no_grad() may keep the cache."
            )


def _available_device(target_device: str | torch.device) -> torch.device:
    """``target_device`` as a device this machine has, or a :class:`ReversibleError` saying which it has."""
    try:
        device = torch.device(target_device)
    except (RuntimeError, TypeError) as err:
        raise ReversibleError(
            f"ReversibleSequential: target_device={target_device!r} is not a device ({err})"
        ) from None
    if not backend.device_available(device):
        raise ReversibleError(
            f"ReversibleSequential: target_device={target_device!r}, but this machine has no such device (it has "
            f"{', '.join(backend.available_kinds())}). Pass one of those, or leave target_device empty to run each "
            f"layer where its parameters are."
        )
    return device


# ----------------------------------------------------------------------------------------------------------------
# Arguments: tensors inside args/kwargs become explicit inputs of the layers' autograd nodes (so they get gradients
# and their in-place modification is detected); everything else is passed through unchanged.


@dataclasses.dataclass(frozen=True)
class _Slot:
    index: int


def _filled(flat: tuple[list[Any], Any], tensors: Sequence[Tensor] | dict[int, Tensor]) -> Any:
    """A value flattened by :func:`_tree.tree_flatten` with its :class:`_Slot` leaves replaced by ``tensors``."""
    leaves, spec = flat
    return _tree.tree_unflatten([tensors[x.index] if isinstance(x, _Slot) else x for x in leaves], spec)


@dataclasses.dataclass
class _Plan:
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
    offload: _LayerOffload | None = None
    fused: FusedOptimizer | None = None
    fused_done: list[list[int]] | None = None  # per layer: positions (in layer_params) of the fused-stepped ones
    walk: tuple[Tensor, Tensor, Any] | None = None  # the backward walk: the streams the next layer's backward
    # rebuilt, and what it finished (see _layer_backward)
    fsdp_units: list[fsdp.LayerUnits | None] | None = None  # per layer: the FSDP2 units inside its block
    stacked: Callable[[int], dict[str, Tensor]] | None = None  # stacked parameters (scan.stack_layers): layer i's
    # parameters as views of the stacks, for the paths that call the blocks one by one
    rebuild: _rebuild_check.RebuildCheck | None = None  # verify_inverse's default: the backward measures its rebuild
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
        return _layer_label(i, self.names[i], self.layers[i])

    def describe_stream(self, i: int) -> str:
        """Where a value entering an exact stream came from: layer ``i``'s block, or (-1) the input."""
        return "the input" if i < 0 else self.describe(i)

    def offloaded(self) -> _LayerOffload:
        """The offload of a plan with ``target_device`` (a caller that holds device copies knows it has one)."""
        if self.offload is None:
            raise RuntimeError("ReversibleSequential: internal error: device copies without target_device")
        return self.offload


def _layer_label(i: int, name: str, layer: ReversibleModule) -> str:
    return f"layer {i} ('{name}': {type(layer.block).__name__})"


@dataclasses.dataclass
class _LayerOffload:
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


def _call_block(plan: _Plan, i: int, x: Tensor, args, kwargs, tensors: dict[str, Tensor] | None):
    """The block of layer ``i`` on ``x``: with its own parameters, or with ``tensors`` (name -> device copy)."""
    wrapper = plan.wrappers[i]
    if tensors is None:
        return wrapper.fn(x, args, kwargs)
    return torch.func.functional_call(wrapper.wrapped_module, tensors, (x, *args), dict(kwargs or {}))


def _to_streams(plan: _Plan, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
    if plan.stream_dtype is None:
        return x0, x1
    return x0.to(plan.stream_dtype), x1.to(plan.stream_dtype)


def _to_compute(x: Tensor, plan: _Plan) -> Tensor:
    return x if plan.compute_dtype is None else x.to(plan.compute_dtype)


def _block_output(plan: _Plan, i: int, x1: Tensor, args, kwargs, tensors: dict[str, Tensor] | None) -> Any:
    """Layer ``i``'s block on the stream value ``x1``, with the in-place and return-type checks."""
    version = x1._version
    fn_out = _call_block(plan, i, _to_compute(x1, plan), args, kwargs, tensors)
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


def _grouped(x: Tensor) -> Tensor:
    """``x`` as the input of a block under plain autograd: through a node of its own (a view), so that the block's
    gradient contributions are summed before they meet the stream's others, as the reversible backward sums them
    (autograd adds a tensor's contributions in the order they arrive, and floating-point addition does not
    associate): the same function's gradients, to the bit."""
    return x.view_as(x) if x.requires_grad and torch.is_grad_enabled() else x


def _forward_fixed(
    plan: _Plan,
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
    f = first_tensor(_block_output(plan, i, _grouped(x1), args, kwargs, tensors))
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
    return _fixed.couple(fixed, s0, f, dtype, guard, i, x0)


def _forward_layer(
    plan: _Plan, i: int, x0: Tensor, x1: Tensor, args, kwargs, tensors: dict[str, Tensor] | None = None
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


_INPLACE_HINT = "modified by an inplace operation"
_UNUSED, _ACCUMULATE = GradDestination.UNUSED, GradDestination.ACCUMULATE


def _streams_of(plan: _Plan, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
    """The streams whose values ``(x0, x1)`` are: themselves, or (exact streams) the fixed-point ones."""
    if plan.fixed is None:
        return x0, x1
    assert plan.fixed_streams is not None
    return plan.fixed_streams


def _run_layers(plan: _Plan, x0: Tensor, x1: Tensor, arg_tensors: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """The reversible forward: each layer runs without autograd as its own :class:`_ReversibleLayerFn` node, which
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
                x0, x1 = _ReversibleLayerFn.apply(plan, i, None, x0, x1, *plan.own_params[i], *own_args)
                if watch is not None:
                    plan.saved_buffers[i] = plan.state.changed(watch, plan.describe(i))
                if check is not None and check.first == i and not x1.requires_grad:
                    check.keep(i + 1, *_streams_of(plan, x0, x1))  # no autograd node (a frozen layer): the backward
                    # stops above it
                continue
            copies = off.streamer.fetch(i, prefetch=i + 1)
            tensors = off.mapping(i, copies)
            watch = plan.watch_buffers(i, tensors)
            x0, x1 = _ReversibleLayerFn.apply(plan, i, tensors, x0, x1, *plan.own_params[i], *own_args)
            if watch is not None:
                plan.saved_buffers[i] = plan.state.changed(watch, plan.describe(i))
            if check is not None and check.first == i and not x1.requires_grad:
                check.keep(i + 1, *_streams_of(plan, x0, x1))
            del tensors
            backend.cut_graph(device)
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


class _ReversibleLayerFn(torch.autograd.Function):
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
    def forward(ctx, plan: _Plan, i: int, tensors: dict[str, Tensor] | None, x0: Tensor, x1: Tensor, *flat: Tensor):
        ctx.plan, ctx.i = plan, i
        n_params = len(plan.layer_params[i])
        args, kwargs = plan.args_for(i, dict(zip(plan.layer_arg_slots[i], flat[n_params:])))
        ctx.save_for_backward(*flat)
        if plan.fixed is not None:  # the streams are plan.fixed_streams, the values x0 and x1
            assert plan.fixed_streams is not None
            s0, s1 = plan.fixed_streams
            y1, y1_stream = _forward_fixed(plan, i, s0, x1, args, kwargs, tensors, guard=plan.guard)
            plan.fixed_streams = (s1, y1_stream)
            if i == len(plan.layers) - 1:
                ctx.streams = [s1, y1_stream]
                ctx.stream_versions = (s1._version, y1_stream._version)
            return x1.detach(), y1
        y1 = _forward_layer(plan, i, x0, x1, args, kwargs, tensors)
        if i == len(plan.layers) - 1:
            # The output streams are kept as detached aliases rather than saved tensors, so the backward can drop
            # them as soon as it has rebuilt the last layer's input (saved tensors live until the graph is freed);
            # their version is checked by hand, as save_for_backward would.
            ctx.streams = [x1.detach(), y1.detach()]
            ctx.stream_versions = (x1._version, y1._version)
        return x1.detach(), y1

    @staticmethod
    def backward(ctx, dy0: Tensor, dy1: Tensor):
        plan: _Plan = ctx.plan
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
            if _INPLACE_HINT not in str(err):
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


def _wanted(ctx, plan: _Plan, i: int) -> _Wanted:
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
    plan: _Plan,
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

    This runs once per layer in every backward, so per-layer bookkeeping is kept out of it (see ``_Plan``): on
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
    y0, y1, dy0, dy1 = backend.optimization_barrier([y0, y1, dy0, dy1, *layer_params, *_finished(later)])[:4]
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
                fn_out = _call_block(plan, i, _to_compute(x1, plan), args, kwargs, tensors)
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
            grads = list(_vjp(out, inputs, grad_out)) if inputs else []
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
        backend.cut_graph(x0)  # xla: this layer's recomputation and gradients as one graph, run now
    param_grads: list[Tensor | None] = [None] * len(want.params)
    for j in used:
        g = grads.pop()
        if g is not None and off is not None:
            g = backend.to_host_blocking(g, plan.params[plan.layer_params[i][j]].device)
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
    if backend.is_tracing_lazily(x0):  # eager: nothing to order, and no reference kept to a returned gradient
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


def _vjp(out: Tensor, inputs: Sequence[Tensor], grad: Tensor) -> tuple[Tensor | None, ...]:
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


class ReversibleSequential(nn.Sequential):
    """A sequence of reversible layers whose activation memory does not grow with depth.

    Drop-in for RevLib's ``ReversibleSequential``: each module becomes one reversible layer ``(x0, x1) ->
    (x1, coupling_forward(x0, module(x1)))``; ``coupling_forward``/``coupling_inverse`` lists are cycled per layer
    (``None`` = additive); children are named ``'0-0', '0-1', '1-0', ...`` so state-dict keys read
    ``'0-1.wrapped_module.wrapped_module.weight'`` (stable, documented).

    Args:
        split_dim: the dimension along which the input is split into the two streams (and the output
            concatenated). ``None`` replicates the input into both streams and returns the mean of the two output
            streams. A ``(x0, x1)`` tuple input skips the split and returns a ``(y0, y1)`` tuple.
        memory_mode: ``autograd_function`` (default) keeps only the final output; ``no_savings`` runs plain
            autograd (the reference). ``checkpoint`` and ``autograd_graph`` run as ``autograd_function`` with a
            warning: RevLib's cache modes peak above ``no_savings``, this mode never does.
        exact: the streams' arithmetic. ``None`` (the default): exact (fixed-point) streams where every coupling is
            additive and the input is float32 or narrower, else floating-point streams. ``True``: exact streams, or
            raise naming the layer whose coupling is not additive. ``False``: floating-point streams (RevLib's
            arithmetic, checked by ``verify_inverse``). Exact streams (:mod:`revlib_xla.fixed_point`) are integers
            counting 2**-32: each block's output is rounded once to that grid and added exactly, so the backward
            subtracts the same integers and rebuilds every layer's input bit for bit, at any width, depth and
            precision, and the memory-saving gradients equal ``no_savings``' on the same model (rounding
            differentiated straight through). The blocks see the stream decoded to at least float32 (cast to the
            input's dtype when that is narrower), and the output is returned in the input's dtype. Cost: 8 bytes
            per stream element (two streams, whatever the depth), a few element-wise passes per layer, and a range
            check per layer (a value beyond 2**31 / (layers + 1), NaN or infinity raises
            :class:`revlib_xla.fixed_point.FixedStreamError` naming the layer, read once per forward; on XLA and
            in a data-parallel group nothing is read and the outputs become NaN instead, see
            :func:`stream_range_error`). Float64 inputs keep floating-point
            streams by default (they rebuild to ~1e-16). On XLA the recomputation is compiled with the backward and
            may round a reduction (normalization, softmax) differently from the forward in its last bits; the
            backward's rebuild check stays armed there.
        stream_dtype: keep both residual streams in this dtype (e.g. ``torch.float32``) while the blocks compute in
            the input's dtype (e.g. bfloat16): bounds the reconstruction drift of deep low-precision stacks on
            floating-point streams (giving it selects them, unless ``exact=True``, which refuses it). The output is
            returned in the input's dtype.
        compute_dtype: the dtype the blocks see (default: the input's dtype); useful with a two-stream input
            already in ``stream_dtype``.
        preserve_rng_state: run each layer under its own seed, derived from one seed drawn per forward from
            torch's global generator, with generators of its own, so the recomputation draws the forward's random
            numbers (dropout) on cpu, cuda and xla, also while other threads draw from the global generators (see
            :mod:`revlib_xla.recompute`). Both memory modes seed the same way, so ``no_savings`` gives the same
            masks. Costs a few microseconds per layer.
        verify_inverse: at the first forward whose backward rebuilds (a memory-saving mode, gradients on), per
            pair of stream and compute dtypes, make sure the backward rebuilds the input, and raise otherwise.
            ``True``: run :func:`check_invertible` on the real input (every block replays, every coupling pair
            inverts, the input rebuilt through all layers matches; it names the layer, and costs three block
            evaluations per layer without autograd). ``"rebuild"``: the backward compares the input it rebuilt with
            the forward's (one subtraction and one maximum, no block evaluation; the forward keeps its input until
            then) and raises from the backward where they differ by more than :func:`check_invertible`'s tolerance;
            on a lazy device (XLA) the error is a lazy value of the step, read at the next forward once the step has
            run (a step cut), never forcing it. ``None`` (the default): ``True`` when some coupling is not additive
            (momentum, affine, user pairs: their inverses can amplify rounding errors with depth), else
            ``"rebuild"`` (an additive coupling inverts exactly only in exact arithmetic: eight bfloat16 MLP blocks
            with large weights gave gradients off by more than 100 %). On a lazy device the check's output makes the
            first step's graph differ from the next ones': one more compilation where the first two steps would
            otherwise share a graph (SGD, or optimizer state restored from a checkpoint). ``False``: never.
        target_device: keep the parameters (and buffers, and so the optimizer state) where they are, normally on
            the host, and run each layer on copies streamed to this device one layer ahead (forward and
            recomputation); gradients accumulate on the host parameters. At most two layers' tensors are on the
            device at once (see :mod:`revlib_xla.offload`).
        fused_optimizer: ``params -> torch.optim.Optimizer``; one optimizer per layer is built at the first forward
            and stepped inside the backward as soon as the layer's gradients are complete, which are then freed
            (see :mod:`revlib_xla.fused_optimizer`; ``model.fused_optimizer`` is the optimizer object).
        scan: on a device that traces lazily (XLA), run the forward and the backward as two loops over the layers
            (:mod:`revlib_xla.scan`), so the step compiles one layer (or one repeating group of layers) whatever
            the depth. ``False`` (the default): unrolled, because the loops hold a stacked copy of the layers'
            weights and their stacked gradients (about 4x the parameter bytes per layer in TPU HBM, where the
            unrolled walk needs 2.3x: compile time is traded for memory); ``None``: scan when the layers repeat in
            structure and nothing rules it out (``target_device``, ``fused_optimizer``, a group of several layers
            drawing random numbers), else unrolled; ``True``: scan, or raise naming what rules it out (the first
            layer that differs, and how). Gradients, dropout masks and autocast are those of the unrolled walk.
            With the layers' parameters stacked (:func:`revlib_xla.scan.stack_layers`, which sets ``scan=None``),
            the loops read the stacks without copying them and the step holds parameters and gradients once (TPU
            HBM per layer as the unrolled walk's with bfloat16 weights, ``bench/results/scan_compile-xla-cpu.md``).
    """

    def __init__(
        self,
        *modules: nn.Module,
        split_dim: int | None = 1,
        coupling_forward: list[COUPLING | None] | None = None,
        coupling_inverse: list[COUPLING | None] | None = None,
        memory_mode: MemoryModes = MemoryModes.autograd_function,
        target_device: str | torch.device = "",
        fused_optimizer: FUSED_OPTIMIZER = None,
        stream_dtype: torch.dtype | None = None,
        compute_dtype: torch.dtype | None = None,
        preserve_rng_state: bool = True,
        verify_inverse: bool | Literal["rebuild"] | None = None,
        scan: bool | None = False,
        exact: bool | None = None,
    ):
        if not modules:
            raise ReversibleError("ReversibleSequential needs at least one module")
        if verify_inverse not in (None, True, False, "rebuild"):
            raise ReversibleError(
                f"ReversibleSequential: verify_inverse={verify_inverse!r}; pass None (the default), True "
                f"(check_invertible at the first training forward), 'rebuild' (the backward measures its rebuilt "
                f"input) or False"
            )
        _check_couplings(coupling_forward, coupling_inverse)
        if exact not in (None, True, False):
            raise ReversibleError(
                f"ReversibleSequential: exact={exact!r}; pass None (the default: exact streams where every coupling is "
                f"additive and the input is float32 or narrower), True or False"
            )
        if exact and stream_dtype is not None:
            raise ReversibleError(
                f"ReversibleSequential: exact=True keeps the streams as fixed-point integers, so "
                f"stream_dtype={stream_dtype} does not apply; drop stream_dtype, or pass exact=False for "
                f"floating-point streams in stream_dtype"
            )
        for name, dtype in (("stream_dtype", stream_dtype), ("compute_dtype", compute_dtype)):
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ReversibleError(
                    f"ReversibleSequential: {name}={dtype!r}, but the streams and the blocks compute in floating "
                    f"point: pass a floating dtype (torch.float32, torch.bfloat16, ...) or None (the input's dtype)"
                )
        memory_mode = MemoryModes(memory_mode)
        if memory_mode in (MemoryModes.checkpoint, MemoryModes.autograd_graph):
            warnings.warn(
                f"MemoryModes.{memory_mode.name} runs as MemoryModes.autograd_function in revlib_xla: RevLib's cache "
                f"modes keep every recomputed tensor until the next forward (a higher peak than no_savings); "
                f"autograd_function gives the same gradients with a peak that does not grow with depth.",
                stacklevel=2,
            )
        layers: collections.OrderedDict[str, nn.Module] = collections.OrderedDict()
        for i, module in enumerate(modules):
            if not isinstance(module, nn.Module):
                raise ReversibleError(
                    f"ReversibleSequential: argument {i} is a {type(module).__name__}, expected a torch.nn.Module"
                )
            if not isinstance(module, ReversibleModule):
                module = ReversibleModule(
                    module,
                    pick(coupling_forward, i),
                    pick(coupling_inverse, i),
                    memory_savings=memory_mode != MemoryModes.no_savings,
                )
            layers[f"{i // 2}-{i % 2}"] = module
        super().__init__(layers)
        self.split_dim = split_dim
        self.memory_mode = memory_mode
        self.stream_dtype = stream_dtype
        self.compute_dtype = compute_dtype
        self.preserve_rng_state = preserve_rng_state
        self.verify_inverse = verify_inverse
        self.scan = scan
        self.exact = exact
        self._verified: set = set()  # (stream dtype, compute dtype) pairs checked by verify_inverse
        self._rebuild_pending: list[_rebuild_check.Verdict] = []  # measured on a lazy device, read when computed
        self.target_device: torch.device | None = _available_device(target_device) if target_device else None
        if fused_optimizer is not None and not callable(fused_optimizer):
            raise FusedOptimizerError(
                f"ReversibleSequential: fused_optimizer must be a callable params -> "
                f"torch.optim.Optimizer, got {type(fused_optimizer).__name__}"
            )
        if fused_optimizer is not None and memory_mode == MemoryModes.no_savings:
            raise FusedOptimizerError(
                "ReversibleSequential: fused_optimizer needs a memory-saving mode (the "
                "reversible backward walk steps each layer); no_savings runs plain autograd"
            )
        if scan and memory_mode == MemoryModes.no_savings:
            raise ReversibleError(
                "ReversibleSequential: scan=True needs a memory-saving mode (the scanned backward rebuilds each "
                "layer); no_savings runs plain autograd, unrolled. Drop scan=True or the memory_mode."
            )
        self.fused_optimizer_factory = fused_optimizer
        self._own_fused: FusedOptimizer | None = None
        self._attached_fused_optimizer: FusedOptimizer | None = None  # see attach_fused_optimizer
        self._streamer: tuple[tuple[int, ...], ParameterStreamer] | None = None  # (tensor ids, streamer)

    # -- streams --------------------------------------------------------------------------------------------------
    def _split(self, inp) -> tuple[Tensor, Tensor, bool]:
        if isinstance(inp, (tuple, list)):
            if len(inp) != 2 or not all(isinstance(t, torch.Tensor) for t in inp):
                raise ReversibleError(
                    f"ReversibleSequential: a tuple input must be two stream tensors (x0, x1), got "
                    f"{[type(t).__name__ for t in inp]}"
                )
            x0, x1 = inp
            if x0.shape != x1.shape or x0.dtype != x1.dtype:
                raise ReversibleError(
                    f"ReversibleSequential: the two input streams must match in shape and dtype, got "
                    f"{tuple(x0.shape)} {x0.dtype} and {tuple(x1.shape)} {x1.dtype}"
                )
            return x0, x1, True
        if not isinstance(inp, torch.Tensor):
            raise ReversibleError(
                f"ReversibleSequential expects a tensor (or a (x0, x1) tuple of streams), got {type(inp).__name__}"
            )
        if self.split_dim is None:
            return inp, inp, False
        dim = self.split_dim
        if not -inp.dim() <= dim < inp.dim():
            raise ReversibleError(
                f"ReversibleSequential: split_dim={dim} is out of range for an input of shape {tuple(inp.shape)}"
            )
        if inp.shape[dim] % 2:
            raise ReversibleError(
                f"ReversibleSequential: the input has size {inp.shape[dim]} along split_dim={dim} (shape "
                f"{tuple(inp.shape)}), which cannot be split into two equal streams; make it even (e.g. double the "
                f"features before the reversible part)"
            )
        x0, x1 = inp.chunk(2, dim)
        return x0, x1, False

    def _merge(self, y0: Tensor, y1: Tensor, two_stream: bool):
        if two_stream:
            return y0, y1
        if self.split_dim is None:
            return (y0 + y1) / 2
        return torch.cat([y0, y1], self.split_dim)

    # -- arguments ------------------------------------------------------------------------------------------------
    def _plan(
        self, x0: Tensor, args, kwargs, layerwise_args_kwargs: LAYERWISE_ARGS_KWARGS
    ) -> tuple[_Plan, list[Tensor]]:
        """Deduplicated parameters and tensor arguments of every layer, and the stream and compute dtypes."""
        layers = cast(list[ReversibleModule], list(self._modules.values()))  # __init__ wraps every module
        names = list(self._modules.keys())
        if not (x0.dtype.is_floating_point or x0.dtype.is_complex):
            dtypes = sorted({str(p.dtype) for p in layers[0].parameters() if p.is_floating_point()}) or ["float"]
            raise ReversibleError(
                f"ReversibleSequential: the input is {x0.dtype}, but the reversible streams are floating point: "
                f"{_layer_label(0, names[0], layers[0])} computes in {' and '.join(dtypes)} and its output is added "
                f"to them. Embed or cast the input first (nn.Embedding, or x.to({dtypes[0]}))."
            )
        if layerwise_args_kwargs is not None:
            if len(layerwise_args_kwargs) != len(layers):
                raise ReversibleError(
                    f"ReversibleSequential: layerwise_args_kwargs has {len(layerwise_args_kwargs)} entries but the "
                    f"model has {len(layers)} layers; give one (args, kwargs) pair per layer"
                )
        arg_tensors: list[Tensor] = []
        seen: dict[int, int] = {}

        def slot(t: Tensor) -> _Slot:
            if id(t) not in seen:
                seen[id(t)] = len(arg_tensors)
                arg_tensors.append(t)
            return _Slot(seen[id(t)])

        shared_args = _tree.map_tensors(slot, tuple(args))
        shared_kwargs = _tree.map_tensors(slot, dict(kwargs))
        layer_args = []
        for i in range(len(layers)):
            if layerwise_args_kwargs is None:
                layer_args.append((shared_args, shared_kwargs))
                continue
            entry = layerwise_args_kwargs[i]
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[1], dict)):
                raise ReversibleError(
                    f"ReversibleSequential: layerwise_args_kwargs[{i}] must be an (args, kwargs) "
                    f"pair with kwargs a dict, got {entry!r}"
                )
            own_args = _tree.map_tensors(slot, tuple(entry[0]))
            own_kwargs = _tree.map_tensors(slot, dict(entry[1]))
            layer_args.append((shared_args + own_args, {**shared_kwargs, **own_kwargs}))

        params: list[nn.Parameter] = []
        index: dict[int, int] = {}
        layer_params, layer_buffers, param_slots = [], [], []
        blocks_see = self.compute_dtype or x0.dtype
        check_dtypes = not backend.AutocastState.capture(x0.device).differs_from_now()  # autocast casts for them
        stacked = {p.dtype for p in self._parameters.values() if p is not None and p.is_floating_point()}  # scan
        for i, layer in enumerate(layers):
            own, slots, float_dtypes, modules = [], [], set(stacked), list(layer.modules())
            for module in modules:
                for name, p in module._parameters.items():
                    if p is not None and p.is_floating_point():
                        float_dtypes.add(p.dtype)
                    if p is None or not p.requires_grad:
                        continue
                    if id(p) not in index:
                        index[id(p)] = len(params)
                        params.append(p)
                    if index[id(p)] not in own:
                        own.append(index[id(p)])
                    slots.append((module, name, own.index(index[id(p)])))
            layer_params.append(own)
            layer_buffers.append(owned_buffers(modules))
            param_slots.append(slots)
            if check_dtypes and float_dtypes and blocks_see not in float_dtypes:
                raise _dtype_mismatch(
                    _layer_label(i, names[i], layer), float_dtypes, blocks_see, self.compute_dtype is not None
                )
        stream_dtype = self.stream_dtype if self.stream_dtype not in (None, x0.dtype) else None
        compute_dtype = blocks_see if blocks_see != (stream_dtype or x0.dtype) else None
        fixed = self._fixed_format(x0.dtype, layers, names)
        value_dtype = None
        if fixed is not None:  # the streams are integers; their values are decoded to at least float32
            value_dtype = torch.promote_types(x0.dtype, torch.float32)
            compute_dtype = blocks_see if blocks_see != value_dtype else None
        plan = _Plan(
            layers,
            names,
            layer_args,
            [sorted({x.index for x in _tree.tree_leaves(a) if isinstance(x, _Slot)}) for a in layer_args],
            params,
            layer_params,
            layer_buffers,
            CallReplay(x0.device, self.preserve_rng_state),
            stream_dtype,
            compute_dtype,
            RecomputeState.of(self),
            param_slots=param_slots,
            fixed=fixed,
            value_dtype=value_dtype,
        )
        plan.stacked = _scan.stacked_views(self)
        if self.target_device is not None:
            plan.offload = self._layer_offload(plan)
        # The fused optimizer built from fused_optimizer= is stepped by the backward walk, one layer at a time;
        # one attached by fuse_optimizer steps each parameter from its post-accumulate-grad hook, which the engine
        # runs as soon as the layer's backward has returned the gradient, as for any module.
        fused = self.fused_optimizer
        if fused is not None and self.memory_mode != MemoryModes.no_savings:
            fused.record_forward(x0.device)
            if fused is not self._attached_fused_optimizer:
                plan.fused, plan.fused_done = fused, self._fused_schedule(plan, fused)
        return plan, arg_tensors

    def _fixed_format(
        self, dtype: torch.dtype, layers: list[ReversibleModule], names: list[str]
    ) -> _fixed.FixedPoint | None:
        """The exact streams' format for an input of ``dtype``, or ``None`` for floating-point streams (``exact``)."""
        exact = self.__dict__.get("exact")  # models pickled before the argument existed: None
        if exact is False:
            return None
        additive = [
            is_additive_forward(layer.wrapped_module.coupling_forward)
            and is_additive_inverse(layer.wrapped_module.coupling_inverse)
            for layer in layers
        ]
        if exact is None:
            wide = dtype.is_complex or dtype.itemsize > 4  # float64 streams invert to ~1e-16 without a grid
            return None if wide or self.stream_dtype is not None or not all(additive) else _fixed.GRID
        if dtype.is_complex:
            raise ReversibleError(
                f"ReversibleSequential(exact=True): the input is {dtype}; exact streams hold real values. Pass "
                f"exact=False for complex streams."
            )
        if not all(additive):
            i = additive.index(False)
            raise ReversibleError(
                f"ReversibleSequential(exact=True): {_layer_label(i, names[i], layers[i])} has a coupling that is not "
                f"additive ({_describe_coupling(layers[i].wrapped_module.coupling_forward)}); exact (fixed-point) "
                f"streams invert additive couplings only. Pass exact=None (exact where possible, else the backward's "
                f"rebuild check) or exact=False."
            )
        return _fixed.GRID

    # -- parameter offload and fused optimizer --------------------------------------------------------------------
    def _layer_offload(self, plan: _Plan) -> _LayerOffload:
        """Each layer's block tensors (parameters, buffers) as one streamed unit; the streamer (and on cuda its
        two persistent device buffers) is reused across calls while the tensors stay the same objects."""
        index = {id(p): k for k, p in enumerate(plan.params)}
        units, names, param_pos, buffer_pos = [], [], [], []
        for layer in plan.layers:
            unit: list[Tensor] = []
            unit_names: list[list[str]] = []
            pos: dict[int, int] = {}
            own_params, own_buffers = {}, []
            block = layer.block
            for kind, items in (
                ("param", block.named_parameters(remove_duplicate=False)),
                ("buffer", block.named_buffers(remove_duplicate=False)),
            ):
                for name, t in items:
                    if id(t) not in pos:
                        pos[id(t)] = len(unit)
                        unit.append(t)
                        unit_names.append([])
                        if kind == "buffer":
                            own_buffers.append(pos[id(t)])
                        elif id(t) in index:
                            own_params[index[id(t)]] = pos[id(t)]
                    unit_names[pos[id(t)]].append(name)
            units.append(unit)
            names.append(unit_names)
            param_pos.append(own_params)
            buffer_pos.append(own_buffers)
        key = tuple(id(t) for unit in units for t in unit)
        if self._streamer is None or self._streamer[0] != key:
            self._streamer = (key, ParameterStreamer(units, self.target_device))
        for i in range(len(plan.layers)):
            missing = [k for k in plan.layer_params[i] if k not in param_pos[i]]
            if missing:
                raise ReversibleError(
                    f"{plan.describe(i)}: target_device streams the block's own parameters, but this layer also "
                    f"uses a parameter outside its block (in its coupling); move it into the block"
                )
        return _LayerOffload(self._streamer[1], names, param_pos, buffer_pos)

    def __getstate__(self):
        """Copies and pickles leave the streamer behind (device buffers, cuda streams); it is rebuilt on use."""
        state = super().__getstate__()
        state["_streamer"] = None
        state["_rebuild_pending"] = []  # lazy values of this process's steps
        state["_last_guard"] = None
        return state

    @property
    def streamer(self) -> ParameterStreamer | None:
        """With ``target_device``: the :class:`ParameterStreamer` of the last call (its ``max_resident`` and
        ``transfers`` say how many layers were on the device at once and how many were copied), else ``None``."""
        return None if self._streamer is None else self._streamer[1]

    def attach_fused_optimizer(self, optimizer: FusedOptimizer) -> None:
        """Step ``optimizer``, fused into a model containing this sequence by :func:`revlib_xla.fuse_optimizer`
        (part of :class:`revlib_xla.fused_optimizer.StepsInBackward`)."""
        self._attached_fused_optimizer = optimizer

    def detach_fused_optimizer(self, optimizer: FusedOptimizer) -> None:
        """Forget ``optimizer`` if it is the attached one (its fusion was removed)."""
        if self._attached_fused_optimizer is optimizer:
            self._attached_fused_optimizer = None

    @property
    def fused_optimizer(self) -> FusedOptimizer | None:
        """The optimizer stepped inside the backward pass (built from ``fused_optimizer=`` at the first forward,
        or attached by :func:`revlib_xla.fuse_optimizer`), or ``None``."""
        if self._attached_fused_optimizer is not None:
            return self._attached_fused_optimizer
        if self.fused_optimizer_factory is None:
            return None
        layers = list(self._modules.items())
        groups, names = [], []
        for name, layer in layers:
            trainable = [p for p in layer.parameters() if p.requires_grad]
            if trainable:
                groups.append(trainable)
                names.append(f"layer '{name}'")
        own = self._own_fused  # a copy of the model (deepcopy, pickle) holds a copy bound to its own parameters
        if own is None:
            self._own_fused = FusedOptimizer(groups, self.fused_optimizer_factory, names)
        elif [id(p) for p in own.params] != [id(p) for g in groups for p in g]:
            try:  # new tensors, e.g. from .to(device) across tensor types: state and learning rates follow them
                own.rebind(groups)
            except FusedOptimizerError:
                if any(opt.state for opt in own.optimizers):
                    raise
                self._own_fused = FusedOptimizer(groups, self.fused_optimizer_factory, names)  # layers changed
        return self._own_fused

    def _fused_schedule(self, plan: _Plan, fused: FusedOptimizer) -> list[list[int]]:
        users: dict[int, list[int]] = {}
        for i, own in enumerate(plan.layer_params):
            for k in own:
                users.setdefault(k, []).append(i)
        for k, layers in users.items():
            if len(layers) > 1 and fused.covers(plan.params[k]):
                raise FusedOptimizerError(
                    f"ReversibleSequential: a fused optimizer cannot step a parameter shared by layers "
                    f"{', '.join(plan.describe(i) for i in layers)}: its gradient arrives in parts, one per layer, "
                    f"and the first layers' recomputation still reads it. Untie the weights or use an unfused "
                    f"optimizer"
                )
        return [[j for j, k in enumerate(own) if fused.covers(plan.params[k])] for own in plan.layer_params]

    # -- forward / inverse ----------------------------------------------------------------------------------------
    def forward(  # type: ignore[override]  # RevLib's signature: streams, then the blocks' arguments
        self, inp: Tensor | tuple[Tensor, Tensor], *args, layerwise_args_kwargs: LAYERWISE_ARGS_KWARGS = None, **kwargs
    ):
        pending = self.__dict__.get("_rebuild_pending")
        if pending:  # an earlier step's rebuild, measured on a lazy device: read it once computed
            _rebuild_check.settle(pending)
        x0, x1, two_stream = self._split(inp)
        out_dtype = x0.dtype
        plan, arg_tensors = self._plan(x0, args, kwargs, layerwise_args_kwargs)
        x0, x1 = _to_streams(plan, x0, x1)
        s0 = s1 = None
        inputs = (x0, x1)  # (exact streams: what the rebuild check keeps, and encodes when it compares)
        if plan.fixed is not None:  # the values x0, x1 carry the gradients, the streams s0, s1 the exact bits
            assert plan.value_dtype is not None
            if backend.holds_data(x0):  # (fake tensors, sizing a model under FakeTensorMode, have no values)
                plan.guard = _fixed.StreamGuard(plan.fixed, len(plan.layers), plan.describe_stream)
            shared = x1 is x0  # one stream's value twice (split_dim=None, or a pair of one tensor): encoded once
            x0, s0 = _fixed.encode_input(plan.fixed, x0, plan.value_dtype, plan.guard)
            x1, s1 = (_grouped(x0), s0) if shared else _fixed.encode_input(plan.fixed, x1, plan.value_dtype, plan.guard)

        if self.memory_mode == MemoryModes.no_savings or not torch.is_grad_enabled():
            with plan.call.scope() as reseed:
                for i in range(len(plan.layers)):
                    a, k = plan.args_for(i, arg_tensors)
                    reseed(plan.seed_of(i))
                    copies = self._plain_offload(plan, i)
                    tensors = _plain_copies(plan, i) if copies is None else plan.offloaded().mapping(i, copies)
                    if s0 is not None:
                        y1, y1_stream = _forward_fixed(plan, i, s0, x1, a, k, tensors, x0, plan.guard)
                        x0, x1, s0, s1 = x1, y1, s1, y1_stream
                    else:
                        x0, x1 = x1, _forward_layer(plan, i, x0, x1, a, k, tensors)
                    if copies is not None:
                        plan.offloaded().write_back_buffers(i, copies)
        else:  # the backward will rebuild every layer's input from the output
            _refuse_kv_caches(args, kwargs, layerwise_args_kwargs)
            plan.fsdp_units = self._fsdp_units(plan)
            if s0 is not None and s1 is not None:
                plan.fixed_streams = (s0, s1)
            self._verify(plan, x0, x1, arg_tensors, inputs)
            with plan.state.python_random_check("ReversibleSequential"):
                scanned = _scan.scanned_forward(self, plan, x0, x1, arg_tensors)
                x0, x1 = scanned if scanned is not None else _run_layers(plan, x0, x1, arg_tensors)
            plan.fixed_streams = None
        if plan.guard is not None:
            x0, x1 = self._judge(plan, plan.guard, x0, x1)
            plan.guard = None
        x0, x1 = x0.to(out_dtype), x1.to(out_dtype)
        return self._merge(x0, x1, two_stream)

    def exact_format(self, dtype: torch.dtype) -> _fixed.FixedPoint | None:
        """The fixed-point format of the streams for an input of ``dtype`` (see ``exact``), or ``None`` where they
        are floating point."""
        layers = cast(list[ReversibleModule], list(self._modules.values()))
        return self._fixed_format(dtype, layers, list(self._modules.keys()))

    def layer_walk(self, x0: Tensor, x1: Tensor) -> LayerWalk:
        """The layers one at a time with plain autograd (or none), from the streams ``(x0, x1)``: the function this
        sequence computes, exact streams included, for callers that act between layers (transformers' generation
        with its KV cache, per-layer hooks); see :class:`LayerWalk`."""
        return LayerWalk(self, x0, x1)

    def _judge(self, plan: _Plan, guard: _fixed.StreamGuard, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
        """The forward's stream range check: read now and raised (an eager device outside data parallelism), or,
        where a read would cost the step (a lazy device) or leave the other processes of the group that decides
        together waiting (:func:`revlib_xla._rebuild_check.agreeing_group`), the outputs made NaN if it failed (no
        read; the guard is kept for :func:`stream_range_error`)."""
        guard.close()
        poison = guard.poison()
        if poison is None:
            return x0, x1
        if not (backend.is_tracing_lazily(x0) or _rebuild_check.agreeing_group(plan.params) is not None):
            guard.judge()
            return x0, x1
        self.__dict__["_last_guard"] = guard
        return x0 + poison.to(x0.dtype), x1 + poison.to(x1.dtype)

    def _fsdp_units(self, plan: _Plan) -> list[fsdp.LayerUnits | None] | None:
        """The FSDP2 units inside the blocks, per layer (see :mod:`revlib_xla.fsdp`), refusing the layouts the
        reversible backward cannot run exactly."""
        try:
            units = fsdp.layer_units(
                plan.layers, [w.wrapped_module for w in plan.wrappers], plan.names, plan.param_slots
            )
        except fsdp.FSDPLayoutError as err:
            raise ReversibleError(str(err)) from None
        if units is not None and self.fused_optimizer_factory is not None:
            raise FusedOptimizerError(
                "ReversibleSequential: fused_optimizer steps each layer from the gradients its backward computes, but "
                "some blocks are FSDP2 units (fully_shard), whose gradients FSDP2 reduce-scatters across processes "
                "after the layer's backward: build the sequence without fused_optimizer and step an unfused optimizer."
            )
        if units is not None and plan.offload is not None:
            raise ReversibleError(
                "ReversibleSequential: target_device streams each block's parameters to the device, but some blocks "
                "are FSDP2 units (fully_shard), which hold their parameters sharded across processes: use one or the "
                "other (FSDP2's CPUOffloadPolicy offloads sharded parameters)."
            )
        return units

    def _verify(
        self, plan: _Plan, x0: Tensor, x1: Tensor, arg_tensors: Sequence[Tensor], inputs: tuple[Tensor, Tensor]
    ) -> None:
        """``verify_inverse`` at a forward whose backward rebuilds, once per pair of stream and compute dtypes:
        :func:`check_invertible` now, or (the default for additive couplings) the backward's own rebuild of the
        input measured against it (:mod:`revlib_xla._rebuild_check`), armed on the plan."""
        key = (x0.dtype, plan.compute_dtype)
        verify = self.verify_inverse
        if verify is False or key in self._verified or not backend.holds_data(x0):
            return  # fake tensors (sizing a model under FakeTensorMode) have no values to check
        if verify is True or (
            verify is None
            and not all(
                is_additive_forward(w.coupling_forward) and is_additive_inverse(w.coupling_inverse)
                for w in plan.wrappers
            )
        ):
            self._verified.add(key)
            _check_plan(plan, x0, x1, arg_tensors)
        # Also on a lazy device (XLA): the first step's graph gets one more output than the next steps', which
        # costs one more compilation where the first two steps' graphs are otherwise the same (SGD, or optimizer
        # state restored from a checkpoint); a silently wrong gradient costs more. verify_inverse=False skips it.
        elif _rebuild_check.armed():
            autocast = plan.call.autocast  # the blocks compute in its dtype: the tolerance of the coarsest
            cast = [
                d for on, d in ((autocast.enabled, autocast.dtype), (autocast.cpu_enabled, autocast.cpu_dtype)) if on
            ]
            plan.rebuild = _rebuild_check.RebuildCheck(
                key,
                max(_rebuild_check.tolerance(x0.dtype, d) for d in [plan.compute_dtype, *cast]),
                len(plan.layers),
                self._verified,
                self.__dict__.setdefault("_rebuild_pending", []),  # models pickled before it existed: created here
                fused=self.fused_optimizer is not None,
                replays_random=plan.call.seed is not None,
                autocast=cast[0] if cast else None,
                group=_rebuild_check.agreeing_group(plan.params),  # data parallel: the processes decide together
            )
            if plan.fixed is None:
                plan.rebuild.keep(0, x0, x1)
            else:  # the input itself (an alias, no memory); its streams are encoded when compared
                plan.rebuild.keep(0, *inputs, plan.fixed)

    def _plain_offload(self, plan: _Plan, i: int) -> list[Tensor] | None:
        """``target_device`` under plain autograd (``no_savings``, or no gradients): each tensor is copied
        differentiably (:func:`offload_tensor`), so the graph keeps what it saves; memory is saved only by the
        reversible modes."""
        if plan.offload is None:
            return None
        return [offload_tensor(t, plan.offload.streamer.device) for t in plan.offload.streamer.units[i]]

    def inverse(
        self,
        output: Tensor | tuple[Tensor, Tensor],
        *args,
        layerwise_args_kwargs: LAYERWISE_ARGS_KWARGS = None,
        **kwargs,
    ):
        """Reconstruct the input from the output (same ``args``/``kwargs`` as the forward).

        A tensor output is split along ``split_dim`` and the reconstructed input concatenated; a ``(y0, y1)``
        tuple gives back ``(x0, x1)``. With ``split_dim=None`` the output is a mean of two streams, which cannot
        be inverted: pass the two streams instead. Blocks with dropout reconstruct exactly only in eval mode.
        """
        if self.split_dim is None and isinstance(output, torch.Tensor):
            raise ReversibleError(
                "ReversibleSequential.inverse: with split_dim=None the output averages the two "
                "streams and cannot be inverted; run forward and inverse on (x0, x1) tuples"
            )
        y0, y1, two_stream = self._split(output)
        out_dtype = y0.dtype
        plan, arg_tensors = self._plan(y0, args, kwargs, layerwise_args_kwargs)
        y0, y1 = _to_streams(plan, y0, y1)
        if plan.fixed is not None:  # the output's values on the grid (exact from the streams, not from rounded values)
            y0, y1 = plan.fixed.encode(y0), plan.fixed.encode(y1)
        for i in reversed(range(len(plan.layers))):
            a, k = plan.args_for(i, arg_tensors)
            y0, y1 = _inverse_layer(plan, i, y0, y1, a, k, _plain_copies(plan, i)), y0
        if plan.fixed is not None:
            y0, y1 = (plan.fixed.decode(y, cast(torch.dtype, plan.value_dtype)) for y in (y0, y1))
        y0, y1 = y0.to(out_dtype), y1.to(out_dtype)
        return (y0, y1) if two_stream else torch.cat([y0, y1], self.split_dim)


class LayerWalk:
    """A :class:`ReversibleSequential`'s layers run one at a time (:meth:`layer`) with plain autograd from two
    streams; :meth:`streams` gives their current values in the input's dtype. The same function as the sequence's
    forward: on exact streams each block's output is added on the fixed-point grid. Random numbers are the
    caller's (no per-layer seeds)."""

    def __init__(self, net: ReversibleSequential, x0: Tensor, x1: Tensor) -> None:
        self.blocks = cast(list[ReversibleModule], list(net._modules.values()))
        self.dtype = x0.dtype
        self.grid = net.exact_format(x0.dtype)
        self.value_dtype = torch.promote_types(x0.dtype, torch.float32)
        self.x0, self.x1 = x0, x1
        self.s0: Tensor | None = None
        self.s1: Tensor | None = None
        if self.grid is not None:
            self.x0, self.s0 = _fixed.encode_input(self.grid, x0, self.value_dtype, None)
            self.x1, self.s1 = (
                (_grouped(self.x0), self.s0) if x1 is x0 else _fixed.encode_input(self.grid, x1, self.value_dtype, None)
            )

    def layer(self, i: int, *args: Any, **kwargs: Any) -> None:
        block = self.blocks[i]
        if self.grid is None or self.s0 is None:
            self.x0, self.x1 = cast(tuple[Tensor, Tensor], block((self.x0, self.x1), *args, **kwargs))
            return
        x1 = _grouped(self.x1)
        f = first_tensor(
            block.wrapped_module.fn(x1 if self.value_dtype == self.dtype else x1.to(self.dtype), args, kwargs)
        )
        value, stream = _fixed.couple(self.grid, self.s0, f, self.value_dtype, None, i, self.x0)
        self.x0, self.s0, self.x1, self.s1 = self.x1, self.s1, value, stream

    def streams(self) -> tuple[Tensor, Tensor]:
        return self.x0.to(self.dtype), self.x1.to(self.dtype)


def stream_range_error(module: nn.Module) -> _fixed.FixedStreamError | None:
    """Why the outputs of ``module``'s last forward are NaN, if its exact streams overflowed there: the
    :class:`FixedStreamError` naming the first layer at fault, for each :class:`ReversibleSequential` in
    ``module``, read now (on XLA and in a data-parallel group the range check reads nothing during the step and
    makes the outputs NaN instead; a training loop that sees a non-finite loss asks this). ``None`` if none
    overflowed."""
    for sub in module.modules():
        guard = sub.__dict__.get("_last_guard") if isinstance(sub, ReversibleSequential) else None
        if guard is None:
            continue
        try:
            guard.judge(previous=True)
        except _fixed.FixedStreamError as exc:
            return exc
    return None


def _plain_copies(plan: _Plan, i: int) -> dict[str, Tensor] | None:
    """With ``target_device``: layer ``i``'s tensors copied to the device (no streaming), for the inverse and the
    invertibility check; with stacked parameters, views of them."""
    if plan.offload is None:
        return None if plan.stacked is None else plan.stacked(i)
    device = plan.offload.streamer.device
    return plan.offload.mapping(i, [offload_tensor(t, device) for t in plan.offload.streamer.units[i]])


def _inverse_layer(
    plan: _Plan, i: int, y0: Tensor, y1: Tensor, args, kwargs, tensors: dict[str, Tensor] | None = None
) -> Tensor:
    wrapper = plan.layers[i].wrapped_module
    if plan.fixed is not None:  # streams: y0's value is what the block saw
        value = plan.fixed.decode(y0, cast(torch.dtype, plan.value_dtype))
        return _fixed.uncouple(
            plan.fixed, y1, first_tensor(_call_block(plan, i, _to_compute(value, plan), args, kwargs, tensors))
        )
    x0 = wrapper.uncouple(y1, _call_block(plan, i, _to_compute(y0, plan), args, kwargs, tensors))
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


def check_invertible(
    model: ReversibleSequential,
    sample: Tensor | tuple[Tensor, Tensor],
    *args,
    tolerance: float | None = None,
    layerwise_args_kwargs: LAYERWISE_ARGS_KWARGS = None,
    **kwargs,
) -> InvertibilityReport:
    """Check on ``sample`` that the backward will rebuild each layer's input, and raise otherwise.

    Three measurements, with each layer run under the random seed the backward uses, and nothing of the model's
    state (buffers, random state) changed:

    * each block gives the same output when run again (else it keeps state between calls, e.g. a KV cache);
    * each layer's ``coupling_inverse`` undoes its ``coupling_forward``;
    * the input rebuilt from the output through all layers matches the input (errors amplified over depth).

    Raises :class:`ReversibleError` naming the first layer (or the depth) whose relative error exceeds
    ``tolerance``: by default 1e-4 in float32, 1e-9 in float64, 3e-2 in bfloat16, 1e-2 in float16 (of the streams,
    or of the blocks if they compute in a coarser dtype). Costs three block evaluations per layer, without autograd.
    """
    if not isinstance(model, ReversibleSequential):
        raise ReversibleError(f"check_invertible expects a ReversibleSequential, got {type(model).__name__}")
    x0, x1, _ = model._split(sample)
    plan, arg_tensors = model._plan(x0, args, kwargs, layerwise_args_kwargs)
    x0, x1 = _to_streams(plan, x0, x1)
    if plan.fixed is not None:
        plan.fixed_streams = (plan.fixed.encode(x0), plan.fixed.encode(x1))
    return _check_plan(plan, x0, x1, arg_tensors, tolerance)


@torch.no_grad()
@backend.autocast_cache_off()
def _check_plan(
    plan: _Plan, x0: Tensor, x1: Tensor, arg_tensors: Sequence[Tensor], tolerance: float | None = None
) -> InvertibilityReport:
    """:func:`check_invertible` on prepared streams; every error is read back at once (one device sync). It runs
    the layers without autograd and without autocast's weight-cast cache, which would keep their casts for a
    training step in the same autocast region."""
    n = len(plan.layers)
    tol = tolerance if tolerance is not None else _rebuild_check.tolerance(x0.dtype, plan.compute_dtype)
    replays: list[Any] = []  # relative errors: tensors, then (read back at once) floats
    locals_: list[Any] = []
    active, device = plan.call.seed is not None, x0.device
    generators: dict[Any, Any] = {}

    @contextlib.contextmanager
    def as_in_the_forward(i: int, copies: dict[str, Tensor] | None, replay: bool = True) -> Iterator[None]:
        """Layer ``i``'s random numbers, own generators and buffers as its forward met them (the buffers left as
        they were after), as the backward's recomputation has them."""
        with preserved(plan.buffers_of(i, copies)), rng_scope(device, active, generators, replay) as reseed:
            reseed(plan.seed_of(i))
            yield

    fixed = plan.fixed
    if fixed is not None:  # exact streams: every comparison is of the integers
        assert plan.fixed_streams is not None
        x0, x1 = plan.fixed_streams
    try:
        a0, a1 = x0, x1
        for i in range(n):
            args, kwargs = plan.args_for(i, arg_tensors)
            copies = _plain_copies(plan, i)
            if fixed is not None:
                value = fixed.decode(a1, cast(torch.dtype, plan.value_dtype))
                with as_in_the_forward(i, copies, replay=False):
                    y1 = _forward_fixed(plan, i, a0, value, args, kwargs, copies)[1]
                with as_in_the_forward(i, copies):
                    f = first_tensor(_call_block(plan, i, _to_compute(value, plan), args, kwargs, copies))
                scale = _rebuild_check.magnitude(a0, y1)
                replays.append(_rebuild_check.relative_error(a0 + fixed.encode(f), y1, scale))
                locals_.append(_rebuild_check.relative_error(_fixed.uncouple(fixed, y1, f), a0, scale))
                a0, a1 = a1, y1
                continue
            with as_in_the_forward(i, copies, replay=False):
                y1 = _forward_layer(plan, i, a0, a1, args, kwargs, copies)
            with as_in_the_forward(i, copies):  # the replay starts from the forward's state, as the backward's
                fn_out = _call_block(plan, i, _to_compute(a1, plan), args, kwargs, copies)
            wrapper = plan.wrappers[i]
            scale = _rebuild_check.magnitude(a0, y1)
            replays.append(_rebuild_check.relative_error(wrapper.couple(a0, fn_out).to(y1.dtype), y1, scale))
            locals_.append(_rebuild_check.relative_error(wrapper.uncouple(y1, fn_out).to(a0.dtype), a0, scale))
            a0, a1 = a1, y1
        for i in reversed(range(n)):  # as the backward does: from the output alone, through every layer
            args, kwargs = plan.args_for(i, arg_tensors)
            copies = _plain_copies(plan, i)
            with as_in_the_forward(i, copies):
                a0, a1 = _inverse_layer(plan, i, a0, a1, args, kwargs, copies), a0
        end = _rebuild_check.rebuild_error(a0, a1, x0, x1)
    finally:
        rewind(generators)  # the blocks' own generators as they were
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
                + (" With random ops (dropout), keep preserve_rng_state=True." if plan.call.seed is None else "")
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
