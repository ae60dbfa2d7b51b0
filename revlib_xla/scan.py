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
gradient: :func:`revlib_xla.backend.after`). The TPU compiler runs float32 matrix products on bfloat16 operands; a
body that only slices its weights out of the stacks let it convert the whole stacks once, outside both loops, and
keep that bfloat16 copy through the step (half the float32 parameter bytes, growing with depth).

:class:`ScannedStages` is the same idea for :class:`revlib_xla.Checkpointable` (``scan=True``): a run of identical
stages as one stage whose forward keeps each layer's input and whose backward recomputes one layer at a time; with
:func:`stack_layers` on the Checkpointable its parameters are stored stacked as well (held by the wrapped model).

Why a group of several layers cannot draw per-layer random numbers in the loop (torch_xla 2.9): each reseed in a
traced body makes a seed parameter of its own, and the loop replaces only the first one it finds with the
iteration's seed; the others stay constants of the trace. A layer's seed would have to be set from a traced value
(the iteration's seed plus the layer's offset), which torch_xla's RNG does not take.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast, overload

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import _tree, backend, fsdp
from . import fixed_point as _fixed
from ._grad_destination import GradDestination, node_destination
from ._replaced_params import ReplacedParameterError, mark_replaced
from .coupling import first_tensor

if TYPE_CHECKING:
    from .checkpointable import Checkpointable
    from .reversible import ReversibleModule, ReversibleSequential, _Plan

Tensor = torch.Tensor

__all__ = [
    "ReplacedParameterError",
    "ScanUnsupported",
    "layer_parameters",
    "layer_shape",
    "repeat_period",
    "stack_layers",
]

_SCAN_SEED_HIGH = 2**62  # the bound torch_xla's scan draws its per-iteration seeds below


class ScanUnsupported(Exception):
    """Why a call cannot run as a scan (internal: the caller falls back, or raises under ``scan=True``)."""


# ----------------------------------------------------------------------------------------------------------------
# Structure: which layers repeat


def _signature(layer: ReversibleModule) -> list[tuple[str, str, Any]]:
    """What must match between two layers for one traced body to run both: submodule types, settings and hooks,
    parameter and buffer names, shapes, dtypes and ties, and the coupling pair. ``(kind, name, value)`` entries."""
    wrapper = layer.wrapped_module
    return [
        ("coupling_forward", "", wrapper.coupling_forward),
        ("coupling_inverse", "", wrapper.coupling_inverse),
        *_module_signature(layer.block),
    ]


def _module_signature(block: nn.Module) -> list[tuple[str, str, Any]]:
    """What must match between two modules for one traced body to run both (see :func:`_signature`)."""
    sig: list[tuple[str, str, Any]] = []
    for name, module in block.named_modules(remove_duplicate=False):
        sig.append(("module", name, (type(module).__qualname__, module.extra_repr(), module.training)))
        for key, value in vars(module).items():
            if not key.startswith("_") and key != "training" and isinstance(value, (bool, int, float, str, type(None))):
                sig.append(("attribute", f"{name}.{key}".lstrip("."), value))
    for kind, items in (
        ("parameter", block.named_parameters(remove_duplicate=False)),
        ("buffer", block.named_buffers(remove_duplicate=False)),
    ):
        first: dict[int, str] = {}
        for name, t in items:
            tied = first.setdefault(id(t), name)
            sig.append((kind, name, (tuple(t.shape), t.dtype, t.requires_grad, tied)))
    return sig


def _difference(a: list[tuple[str, str, Any]], b: list[tuple[str, str, Any]]) -> str | None:
    """How signature ``b`` differs from ``a`` (the first difference), or ``None``."""
    for (kind_a, name_a, value_a), (kind_b, name_b, value_b) in zip(a, b):
        if (kind_a, name_a) != (kind_b, name_b):
            return f"it has {kind_b} '{name_b}' where the other has {kind_a} '{name_a}'"
        if value_a != value_b:
            return f"its {kind_b}{f' {name_b!r}' if name_b else ''} is {_show(value_b)}, not {_show(value_a)}"
    if len(a) != len(b):
        return f"it has {len(b)} modules, parameters and buffers, the other {len(a)}"
    return None


def _show(value: Any) -> str:
    if callable(value):
        return getattr(value, "__qualname__", None) or repr(value)
    if isinstance(value, tuple) and len(value) == 4 and isinstance(value[1], torch.dtype):
        shape, dtype, requires_grad, tied = value
        return f"{shape} {dtype}{'' if requires_grad else ' frozen'}{f' (tied to {tied})' if tied else ''}"
    if isinstance(value, tuple) and len(value) == 3:
        kind, settings, training = value
        return f"{kind}({settings}){'' if training else ' in eval mode'}"
    return repr(value)


def repeat_period(layers: Sequence[ReversibleModule], describe: Callable[[int], str]) -> int:
    """The smallest ``period`` such that every layer is identical in structure to layer ``i % period`` (dividing the
    number of layers), or :class:`ScanUnsupported` naming the first layer that differs (for the period that repeats
    longest) and how."""
    sigs = [_signature(layer) for layer in layers]
    n = len(layers)
    best: tuple[int, int, str] | None = None  # (first differing layer, period, how)
    for period in range(1, n // 2 + 1):
        if n % period:
            continue
        for i in range(period, n):
            how = _difference(sigs[i % period], sigs[i])
            if how is not None:
                if best is None or i > best[0]:
                    best = (i, period, how)
                break
        else:
            return period
    if best is None:
        return n  # a single layer: nothing repeats, one iteration
    i, period, how = best
    if n < 4:  # no group of layers can repeat: e.g. one transformer block, an attention layer and an MLP layer
        raise ScanUnsupported(
            f"{n} layers make no repeating group: a scan stacks identical layers, or identical groups of layers "
            f"(e.g. blocks of an attention and an MLP layer), at least two of them; here {describe(i)} differs "
            f"from {describe(i % period)} ({how}). Scan a deeper model, or run this one unscanned"
        )
    raise ScanUnsupported(
        f"the layers are not identical in structure: {describe(i)} differs from {describe(i % period)} ({how})"
    )


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _refuse_hooks(plan: _Plan) -> None:
    """Module hooks run where the block is called: once per trace of the scan's body, not once per layer."""
    from torch.nn.modules import module as module_globals

    if any(getattr(module_globals, f"_global{h}", None) for h in _MODULE_HOOKS):
        raise ScanUnsupported("global module hooks are registered (they would run once for all layers)")
    for i, layer in enumerate(plan.layers):
        for name, module in layer.block.named_modules():
            if any(getattr(module, h, None) for h in _MODULE_HOOKS):
                raise ScanUnsupported(
                    f"{plan.describe(i)} has hooks on its module {name or 'itself'!r} (they would run once for all "
                    f"layers)"
                )


def _refuse_state(plan: _Plan) -> None:
    """Buffers a module updates in its forward would be updated in the trace's slices only (and the stacked
    layers' walk does not put them back for the recomputation)."""
    for i, layer in enumerate(plan.layers):
        for name, module in layer.block.named_modules():
            if module.training and any(
                b is not None and key not in module._non_persistent_buffers_set for key, b in module._buffers.items()
            ):
                # Kernels such as batch norm's update running statistics without bumping the version counter that
                # the body checks, so a module that may update its state is not scanned.
                raise ScanUnsupported(
                    f"{plan.describe(i)}: its module {name or 'itself'!r} is in training mode with buffers (running "
                    f"statistics), which the scan would not update per layer; call .eval() on it or pass scan=False"
                )


# ----------------------------------------------------------------------------------------------------------------
# Stacked parameter storage: the repeated layers' parameters as one [iterations, ...] tensor per name


@dataclasses.dataclass
class _Stacks:
    """How :func:`stack_layers` stores a sequence's parameters: every ``period``-th layer's block from position
    ``j`` has its parameters in stacks registered on the sequence, one per parameter (``entries[j]``: the
    attribute, and the names the parameter has in the block, tied names together); ``keys[j]``: the state-dict keys
    of such a layer before stacking, in order (relative to the layer); ``block``: the block's path in its layer."""

    period: int
    iterations: int
    entries: list[list[tuple[str, tuple[str, ...]]]]
    keys: list[list[str]]
    block: str

    def layer_keys(self, j: int) -> dict[str, str]:
        """Position ``j``'s parameter keys (relative to the layer; tied names each) -> the stack's attribute."""
        return {f"{self.block}.{name}": attr for attr, names in self.entries[j] for name in names}


class _Views:
    """Each layer's parameters as views of the stacks (``unbind``: one autograd node per stack, whose backward
    stacks the layers' gradients once), taken at first use: for the paths that call the blocks one by one without
    the reversible walk (plain autograd, no gradients, the inverse, the invertibility check)."""

    def __init__(self, model: nn.Module, stacks: _Stacks) -> None:
        self.model, self.stacks = model, stacks
        self.unbound: dict[str, tuple[Tensor, ...]] | None = None

    def __call__(self, i: int) -> dict[str, Tensor]:
        stacks = self.stacks
        if self.unbound is None:
            self.unbound = {attr: getattr(self.model, attr).unbind(0) for es in stacks.entries for attr, _ in es}
        j, t = i % stacks.period, i // stacks.period
        return {name: self.unbound[attr][t] for attr, names in stacks.entries[j] for name in names}


def stacks_of(model: nn.Module) -> _Stacks | None:
    """The stacked storage of a sequence (:func:`stack_layers`), or ``None``."""
    return getattr(model, "_stacks", None)  # models pickled before stacked storage existed have none


def layer_shape(param: Tensor, model: nn.Module) -> torch.Size:
    """The shape ``param`` has in one layer: a stack of :func:`stack_layers` (a sequence anywhere in ``model``)
    without its leading layer dimension, any other parameter its own shape. For rules by rank, such as weight decay
    on matrices only: a stacked norm scale is 2-D, one layer's is 1-D (``len(layer_shape(p, model)) >= 2``)."""
    for module in model.modules():
        keys = _key_map(module)
        if keys is not None and any(getattr(module, attr) is param for attr in keys.stacks):
            return param.shape[1:]
    return param.shape


def stacked_views(model: nn.Module) -> Callable[[int], dict[str, Tensor]] | None:
    """``i -> layer i's parameters`` (views of the stacks) for a sequence with stacked storage, else ``None``."""
    stacks = stacks_of(model)
    return None if stacks is None else _Views(model, stacks)


@overload
def stack_layers(model: ReversibleSequential, scan: bool | None = None) -> ReversibleSequential: ...
@overload
def stack_layers(model: Checkpointable, scan: bool | None = None) -> Checkpointable: ...
def stack_layers(
    model: ReversibleSequential | Checkpointable, scan: bool | None = None
) -> ReversibleSequential | Checkpointable:
    """Store the parameters of ``model``'s repeating layers stacked: one ``[iterations, ...]`` parameter per
    parameter name (and per position in a repeating group of layers), registered on ``model``; returns ``model``,
    whose ``scan`` becomes ``scan`` (default ``None``: scanned on XLA when nothing rules it out, which is why one
    stacks; ``False``: the layers one by one, on views of the stacks).

    Call it before building the optimizer (as FSDP2's ``fully_shard``): the layers' own parameters are replaced by
    the stacks, so an optimizer built before would hold the old ones (its ``step()`` then raises
    ``ReplacedParameterError`` naming one, rather than never updating them). What it gives: the scanned forward and
    backward (``scan=None`` or ``True`` on XLA) read the stacks directly and write one stacked gradient per name,
    so the step holds the parameters and their gradients once (no stacked copy per pass, no unstacking); without
    the scan (``scan=False``, cpu, cuda) the layers run one by one on views of the stacks, with the same gradients.

    What stays as it was: ``state_dict()`` keys, shapes and order are the unstacked model's (each layer's
    parameters are views of the stacks: clone them for writers that refuse shared storage, such as
    ``safetensors.torch.save_file``), and ``load_state_dict`` takes an unstacked checkpoint (or a stacked model's);
    optimizers, gradient clipping, ``GradScaler``, ``zero_grad``, ``.to()``, ``deepcopy`` and pickling see ordinary
    parameters. What differs: ``model.parameters()`` yields the stacks (an optimizer's weight-decay rule by
    ``p.ndim`` sees one more dimension; choose by name instead), a block's parameters exist only inside the
    sequence's forward (use :func:`layer_parameters` to initialise or load them layer by layer).

    Raises :class:`revlib_xla.ReversibleError` when the layers do not repeat in structure (naming the first that
    differs), with ``target_device`` or ``fused_optimizer``, FSDP2 units inside the layers, a parameter shared by
    two layers or used outside its block, hooks on a parameter, or a model stacked already.

    A :class:`revlib_xla.Checkpointable` built with ``scan=True``: every scanned run of stages
    (:class:`ScannedStages`) gets its parameters stored stacked in the same way, registered on the Checkpointable's
    ``model`` (``stacked_<first layer's path>_<parameter path>``, dots as underscores), so that its compiled loops
    read the stacks and write the stacks' gradients: the step holds the parameters and their gradients once. The
    same keys in ``state_dict()`` (of the Checkpointable and of the model), the same gradients; ``scan`` is not
    used. The model then runs through the Checkpointable only (in eval mode too); calling the model itself raises;
    its layers hold their parameters only inside :func:`layer_parameters` of the model (writes go to the stacks).
    Raises ``ValueError`` without a scanned run, when stacked already or with hooks on a parameter.
    """
    from .checkpointable import Checkpointable
    from .reversible import ReversibleError, ReversibleSequential

    if isinstance(model, Checkpointable):
        return _stack_stages(model)
    if not isinstance(model, ReversibleSequential):
        raise ReversibleError(f"stack_layers expects a ReversibleSequential, got {type(model).__name__}")
    if stacks_of(model) is not None:
        raise ReversibleError("stack_layers: the model's layers are stacked already")
    why = _stacking_refused(model)
    if why:
        raise ReversibleError(f"stack_layers: {why}")
    layers = cast("list[ReversibleModule]", list(model._modules.values()))
    names = list(model._modules)

    def describe(i: int) -> str:
        return f"layer {i} ('{names[i]}': {type(layers[i].block).__name__})"

    try:
        period = repeat_period(layers, describe)
    except ScanUnsupported as err:
        raise ReversibleError(f"stack_layers: {err}; only layers that repeat in structure can be stacked") from None
    owner: dict[int, int] = {}
    fsdp_type = fsdp.fsdp_module_type()
    for i, layer in enumerate(layers):
        block_params = {id(p) for p in layer.block.parameters()}
        for name, p in layer.named_parameters():
            if id(p) not in block_params:
                raise ReversibleError(f"stack_layers: {describe(i)} has parameter '{name}' outside its block")
            if owner.setdefault(id(p), i) != i:
                raise ReversibleError(
                    f"stack_layers: {describe(i)} shares parameter '{name}' with {describe(owner[id(p)])}; a stack "
                    f"holds each layer's own parameters: untie them or leave the layers unstacked"
                )
            if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
                raise ReversibleError(
                    f"stack_layers: {describe(i)}'s parameter '{name}' has hooks, which the stack replacing it would "
                    f"not have; register them on the stack (model.parameters()) after stack_layers"
                )
        if fsdp_type is not None and any(isinstance(m, fsdp_type) for m in layer.modules()):
            raise ReversibleError(
                f"stack_layers: {describe(i)} holds FSDP2 units (fully_shard): stack first, then shard the sequence"
            )
    iterations = len(layers) // period
    block_path = next(n for n, m in layers[0].named_modules() if m is layers[0].block)
    entries: list[list[tuple[str, tuple[str, ...]]]] = []
    keys: list[list[str]] = []
    for j in range(period):
        block = layers[j].block
        keys.append(list(layers[j].state_dict(keep_vars=True)))
        tied: dict[int, list[str]] = {}
        for name, p in block.named_parameters(remove_duplicate=False):
            tied.setdefault(id(p), []).append(name)
        own = []
        for aliases in tied.values():
            attr = f"stacked_{names[j]}_{aliases[0]}".replace(".", "_").replace("-", "_")
            if hasattr(model, attr):
                raise ReversibleError(f"stack_layers: the sequence has an attribute '{attr}' already")
            found = [layers[t * period + j].block.get_parameter(aliases[0]) for t in range(iterations)]
            with torch.no_grad():
                stack = nn.Parameter(torch.stack([p.detach() for p in found]), requires_grad=found[0].requires_grad)
            model.register_parameter(attr, stack)
            own.append((attr, tuple(aliases)))
        entries.append(own)
    for i, layer in enumerate(layers):
        for name, p in list(layer.block.named_parameters(remove_duplicate=False)):
            module_name, _, leaf = name.rpartition(".")
            delattr(layer.block.get_submodule(module_name), leaf)
            mark_replaced(p, f"{names[i]}.{block_path}.{name}")
    vars(model)["_stacks"] = _Stacks(period, iterations, entries, keys, block_path)  # plain state: copied, pickled
    model.scan = scan
    model._register_state_dict_hook(_stacked_state_dict)
    model._register_load_state_dict_pre_hook(_load_into_stacks, with_module=True)
    return model


def _stack_stages(checkpointed: Checkpointable) -> Checkpointable:
    """:func:`stack_layers` for a ``Checkpointable(scan=True)``: each scanned run's parameters stacked, held by the
    model, with the model's state-dict keys kept (:class:`_KeyMap`)."""
    owner = checkpointed.model
    runs = [stage for stage in checkpointed.stages if isinstance(stage, ScannedStages)]
    if not runs:
        raise ValueError("stack_layers: the Checkpointable has no scanned run of stages; build it with scan=True")
    if getattr(owner, "_stage_stacks", None) is not None or any(run._stacks is not None for run in runs):
        raise ValueError("stack_layers: the Checkpointable's scanned runs are stacked already")
    paths = {id(m): name for name, m in owner.named_modules()}
    keys = _KeyMap({}, list(owner.state_dict(keep_vars=True)))
    planned: list[tuple[ScannedStages, list[tuple[str, tuple[str, ...]]]]] = []
    for run in runs:
        layer_paths = [paths[id(layer)] for layer in run.layers]
        tied: dict[int, list[str]] = {}
        for name, p in run.layers[0].named_parameters(remove_duplicate=False):
            tied.setdefault(id(p), []).append(name)
        entries = []
        for aliases in tied.values():
            attr = f"stacked_{layer_paths[0]}_{aliases[0]}".replace(".", "_").replace("-", "_")
            if hasattr(owner, attr) or attr in keys.stacks:
                raise ValueError(f"stack_layers: the model has an attribute '{attr}' already")
            found = [layer.get_parameter(aliases[0]) for layer in run.layers]
            for path, p in zip(layer_paths, found):
                if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
                    raise ValueError(
                        f"stack_layers: the parameter '{path}.{aliases[0]}' has hooks, which the stack replacing it "
                        f"would not have; register them on the stack (model.parameters()) after stack_layers"
                    )
            keys.stacks[attr] = [tuple(f"{path}.{a}" for a in aliases) for path in layer_paths]
            entries.append((attr, tuple(aliases)))
        planned.append((run, entries))
    for run, entries in planned:
        for attr, names in entries:
            found = [layer.get_parameter(names[0]) for layer in run.layers]
            with torch.no_grad():
                stack = nn.Parameter(torch.stack([p.detach() for p in found]), requires_grad=found[0].requires_grad)
            owner.register_parameter(attr, stack)
        for layer in run.layers:
            for name, p in list(layer.named_parameters(remove_duplicate=False)):
                module_name, _, leaf = name.rpartition(".")
                delattr(layer.get_submodule(module_name), leaf)
                mark_replaced(p, f"{paths[id(layer)]}.{name}")
        run._stacks = entries
        object.__setattr__(run, "_owner", owner)  # a plain reference: the model is no submodule of its stage
    vars(owner)["_stage_stacks"] = keys  # plain state: copied, pickled
    owner._register_state_dict_hook(_stacked_state_dict)
    owner._register_load_state_dict_pre_hook(_load_into_stacks, with_module=True)
    owner.register_forward_pre_hook(_refuse_stacked_call)
    return checkpointed


def _refuse_stacked_call(model: nn.Module, args: Any) -> None:
    raise RuntimeError(
        f"{type(model).__name__}: its scanned layers' parameters are stacked (stack_layers on the Checkpointable "
        f"that wraps it): call the Checkpointable, which runs the model in training and in eval mode"
    )


def _stacking_refused(model: ReversibleSequential) -> str | None:
    """What keeps stacked parameters from running (checked by stack_layers and at every forward)."""
    if model.target_device is not None:
        return "target_device streams each layer's own parameters to the device; stacked layers have none"
    if model.fused_optimizer_factory is not None or model._attached_fused_optimizer is not None:
        return "fused_optimizer steps each layer's parameters inside the backward; stacked layers have none"
    return None


@dataclasses.dataclass
class _KeyMap:
    """How a module's stacked parameters map to the unstacked state-dict keys (relative to the module): ``stacks``:
    per stack attribute, per layer its keys (tied names together); ``order``: the unstacked keys in order."""

    stacks: dict[str, list[tuple[str, ...]]]
    order: list[str]

    def save(self, destination: dict[str, Any], prefix: str) -> None:
        """The stacks' entries replaced by each layer's parameters (views), in the unstacked order."""
        slots = {
            key: (attr, t)
            for attr, per_layer in self.stacks.items()
            for t, keys in enumerate(per_layer)
            for key in keys
        }
        own = {k: destination.pop(k) for k in [k for k in destination if k.startswith(prefix)]}
        for key in self.order:
            if key in slots:
                attr, t = slots[key]
                destination[prefix + key] = own[prefix + attr][t]
            elif prefix + key in own:
                destination[prefix + key] = own.pop(prefix + key)
        for attr in self.stacks:
            own.pop(prefix + attr, None)
        destination.update(own)  # anything else (added after stacking) as it came

    def load(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, missing_keys: list[str], error_msgs: list[str]
    ) -> None:
        """Each layer's entries stacked into the stack's entry (a stacked module's own entries, if present, load as
        they are); missing layers keep their values and are reported by their unstacked keys."""
        for attr, per_layer in self.stacks.items():
            if prefix + attr in state_dict:
                continue
            stack = getattr(module, attr)
            slices: dict[int, Any] = {}
            for t, aliases in enumerate(per_layer):
                keys = [prefix + a for a in aliases]
                values = [state_dict.pop(k) for k in keys if k in state_dict]
                if not values:
                    missing_keys.append(keys[0])
                elif tuple(values[0].shape) != tuple(stack.shape[1:]):
                    error_msgs.append(
                        f"size mismatch for {keys[0]}: copying a param with shape {tuple(values[0].shape)} from "
                        f"checkpoint, the shape in current model is {tuple(stack.shape[1:])}."
                    )
                else:
                    slices[t] = values[0]
            if len(slices) == len(per_layer):
                state_dict[prefix + attr] = torch.stack([slices[t].to(stack.device) for t in range(len(slices))])
                continue
            with torch.no_grad():
                value = stack.detach().clone()
                for t, v in slices.items():
                    value[t].copy_(v)
            state_dict[prefix + attr] = value


def _key_map(model: nn.Module) -> _KeyMap | None:
    """The key map of a module holding stacks: a sequence of :func:`stack_layers`, or the model of a stacked
    ``Checkpointable``."""
    found = getattr(model, "_stage_stacks", None)
    if found is not None:
        return cast(_KeyMap, found)
    stacks = stacks_of(model)
    if stacks is None:
        return None
    names = list(model._modules)
    order = [f"{name}.{key}" for i, name in enumerate(names) for key in stacks.keys[i % stacks.period]]
    per_stack = {
        attr: [
            tuple(f"{names[t * stacks.period + j]}.{stacks.block}.{a}" for a in aliases)
            for t in range(stacks.iterations)
        ]
        for j, entries in enumerate(stacks.entries)
        for attr, aliases in entries
    }
    return _KeyMap(per_stack, order)


def _stacked_state_dict(model: nn.Module, destination: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """The stacks' entries replaced by each layer's parameters (views), in the unstacked model's order."""
    keys = _key_map(model)
    if keys is not None:
        keys.save(destination, prefix)


def _load_into_stacks(
    model: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Each layer's parameter entries stacked into the stack's entry (:meth:`_KeyMap.load`)."""
    keys = _key_map(model)
    if keys is not None:
        keys.load(model, state_dict, prefix, missing_keys, error_msgs)


@contextlib.contextmanager
def layer_parameters(model: nn.Module) -> Iterator[nn.Module]:
    """Inside: each stacked layer's block holds its parameters again, as parameters sharing storage with the stacks,
    so code that initialises or loads weights layer by layer (``block.weight.normal_()``, ``copy_``) writes into
    the stacks. Outside, the blocks hold none again. For writes only: a forward inside runs on the stacks. Nests;
    a model without stacked layers (any module) is left as it is. ``model``: a stacked ``ReversibleSequential``, or
    the model a stacked ``Checkpointable`` wraps (its ``model``)."""
    keys = _key_map(model)
    placed: list[tuple[nn.Module, str]] = []
    try:
        for attr, per_layer in ({} if keys is None else keys.stacks).items():
            stack = getattr(model, attr)
            for t, aliases in enumerate(per_layer):
                view = nn.Parameter(stack.data[t], requires_grad=stack.requires_grad)
                for key in aliases:
                    module_name, _, leaf = key.rpartition(".")
                    module = model.get_submodule(module_name)
                    if leaf not in module._parameters:  # else placed by an enclosing context
                        module.register_parameter(leaf, view)
                        placed.append((module, leaf))
        yield model
    finally:
        for module, leaf in placed:
            delattr(module, leaf)


# ----------------------------------------------------------------------------------------------------------------
# Layout: what each iteration of the scan gets


@dataclasses.dataclass
class _Layout:
    """The sequence as ``iterations`` repeats of ``period`` layers: per position ``j`` in the group, the names of
    the block's parameters and buffers, and for each iteration the index of each parameter in ``plan.params``
    (``None``: not trained); the arguments, shared by every layer or stacked per iteration."""

    period: int
    iterations: int
    param_names: list[list[str]]
    buffer_names: list[list[str]]
    param_index: list[dict[str, list[int | None]]]
    arg_specs: list[Any]  # per position: the (args, kwargs) tree spec
    arg_leaves: list[list[Any]]  # per position: each leaf is a constant, a _Shared slot or a _Stacked slot list

    def tensors(self, plan: _Plan, j: int) -> dict[str, Tensor]:
        """Position ``j``'s parameters and buffers stacked over the iterations (a copy)."""
        blocks = [plan.layers[t * self.period + j].block for t in range(self.iterations)]
        found = [dict(b.named_parameters()) | dict(b.named_buffers()) for b in blocks]
        with torch.no_grad():
            return {n: torch.stack([f[n] for f in found]) for n in self.param_names[j] + self.buffer_names[j]}

    def stacked_args(self, j: int, arg_tensors: Sequence[Tensor]) -> list[Tensor]:
        return [
            torch.stack([arg_tensors[k] for k in leaf.slots])
            for leaf in self.arg_leaves[j]
            if isinstance(leaf, _Stacked)
        ]

    def args(self, j: int, arg_tensors: Sequence[Tensor], stacked: Sequence[Tensor]) -> tuple[Any, Any]:
        """Position ``j``'s ``(args, kwargs)`` inside the body: shared tensors as they are, stacked ones sliced."""
        slices = iter(stacked)
        leaves = [
            arg_tensors[leaf.slot]
            if isinstance(leaf, _Shared)
            else next(slices)
            if isinstance(leaf, _Stacked)
            else leaf
            for leaf in self.arg_leaves[j]
        ]
        return _tree.tree_unflatten(leaves, self.arg_specs[j])


@dataclasses.dataclass(frozen=True)
class _Shared:
    slot: int


@dataclasses.dataclass(frozen=True)
class _Stacked:
    slots: tuple[int, ...]


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # objects whose == is not a truth value
        return False


def _layout(plan: _Plan, period: int, arg_tensors: Sequence[Tensor]) -> _Layout:
    from .reversible import _Slot

    n = len(plan.layers)
    iterations = n // period
    index = {id(p): k for k, p in enumerate(plan.params)}
    param_names, buffer_names, param_index, specs, leaves_of = [], [], [], [], []
    for i, layer in enumerate(plan.layers):
        block_params = {id(p) for p in layer.block.parameters()}
        if any(id(plan.params[k]) not in block_params for k in plan.layer_params[i]):
            raise ScanUnsupported(f"{plan.describe(i)} trains a parameter outside its block (in its coupling)")
    for j in range(period):
        block = plan.layers[j].block
        param_names.append([name for name, _ in block.named_parameters()])
        buffer_names.append([name for name, _ in block.named_buffers()])
        per_name: dict[str, list[int | None]] = {name: [] for name in param_names[j]}
        for t in range(iterations):
            for name, p in plan.layers[t * period + j].block.named_parameters():
                per_name[name].append(index.get(id(p)))
        param_index.append(per_name)
        flats = [_tree.tree_flatten(plan.layer_args[t * period + j]) for t in range(iterations)]
        spec = flats[0][1]
        leaves: list[Any] = []
        for pos, leaf in enumerate(flats[0][0]):
            column = [f[0][pos] if f[1] == spec and len(f[0]) == len(flats[0][0]) else None for f in flats]
            where = f"the arguments of {plan.describe(j)} and {plan.describe((iterations - 1) * period + j)}"
            if not isinstance(leaf, _Slot):
                if not all(_same(leaf, other) for other in column):
                    raise ScanUnsupported(f"{where} differ in structure or in a value that is not a tensor")
                leaves.append(leaf)
                continue
            if not all(isinstance(other, _Slot) for other in column):
                raise ScanUnsupported(f"{where} differ in structure (a tensor in one, not in the other)")
            slots = tuple(other.index for other in column if isinstance(other, _Slot))
            tensors = [arg_tensors[k] for k in slots]
            if any(t.requires_grad for t in tensors):
                raise ScanUnsupported(f"{where} include a tensor that requires grad (its gradient is not scanned)")
            if len(set(slots)) == 1:
                leaves.append(_Shared(slots[0]))
            elif all(t.shape == tensors[0].shape and t.dtype == tensors[0].dtype for t in tensors):
                leaves.append(_Stacked(slots))
            else:
                raise ScanUnsupported(f"{where} include tensors of different shapes or dtypes")
        specs.append(spec)
        leaves_of.append(leaves)
    return _Layout(period, iterations, param_names, buffer_names, param_index, specs, leaves_of)


# ----------------------------------------------------------------------------------------------------------------
# Choosing the scan


def scanned_forward(
    model: ReversibleSequential, plan: _Plan, x0: Tensor, x1: Tensor, arg_tensors: Sequence[Tensor]
) -> tuple[Tensor, Tensor] | None:
    """The reversible forward as a scan (its backward a reverse scan), or ``None`` where the layers run unrolled:
    ``scan=False``, a device that does not trace lazily, or (with ``scan=None``) anything the scan cannot run.
    With ``scan=True``, what the scan cannot run raises a :class:`revlib_xla.ReversibleError` naming it. Layers with
    stacked parameters (:func:`stack_layers`) always run here: scanned, or one by one on views of the stacks."""
    from .reversible import ReversibleError

    wanted = getattr(model, "scan", False)  # models pickled before the argument existed: its default
    stacks = stacks_of(model)
    if stacks is None and (wanted is False or (wanted is None and not backend.is_tracing_lazily(x0))):
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


def _check_stacked(model: ReversibleSequential, stacks: _Stacks, plan: _Plan, arg_tensors: Sequence[Tensor]) -> None:
    """What stacked layers cannot run, as an error naming it (there is no unstacked walk to fall back to)."""
    from .reversible import ReversibleError

    why = _stacking_refused(model)
    if why is None and len(plan.layers) != stacks.period * stacks.iterations:
        why = f"the sequence has {len(plan.layers)} layers, its stacks {stacks.period * stacks.iterations}"
    if why is None:
        try:
            _refuse_state(plan)
        except ScanUnsupported as err:
            why = str(err)
    if why is None and any(t.requires_grad for t in arg_tensors):
        why = "a tensor argument requires grad (the stacked layers' walk does not differentiate their arguments)"
    if why is None and plan.fsdp_units is not None:
        why = "some blocks are FSDP2 units (fully_shard); shard the sequence as a whole instead"
    if why is not None:
        raise ReversibleError(f"ReversibleSequential with stacked layers (stack_layers): {why}")


def _stack_positions(model: nn.Module, stacks: _Stacks) -> list[list[tuple[Tensor, tuple[str, ...]]]]:
    return [[(getattr(model, attr), names) for attr, names in entries] for entries in stacks.entries]


def _prepare(
    model: ReversibleSequential, plan: _Plan, x0: Tensor, arg_tensors: Sequence[Tensor], stacks: _Stacks | None
) -> _Run | None:
    if model.fused_optimizer is not None:
        raise ScanUnsupported("fused_optimizer steps each layer inside the backward walk, which the scan does not run")
    if plan.offload is not None:
        raise ScanUnsupported("target_device streams each layer's parameters, which the scan stacks instead")
    _refuse_hooks(plan)
    _refuse_state(plan)
    period = repeat_period(plan.layers, plan.describe) if stacks is None else stacks.period
    layout = _layout(plan, period, arg_tensors)
    if not backend.is_tracing_lazily(x0):
        return None  # eager devices: the unrolled walk is the same computation, without a compiler to save
    loop = backend.scan_loop(x0.device)
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
        plan: _Plan,
        layout: _Layout | None,
        arg_tensors: list[Tensor],
        loop: Callable[..., Any] | None,
        stacks: list[list[tuple[Tensor, tuple[str, ...]]]] | None = None,
    ) -> None:
        self.plan, self.layout, self.arg_tensors, self.loop, self.stacks = plan, layout, arg_tensors, loop, stacks
        self.inputs: list[Tensor] = list(plan.params) if stacks is None else [s for es in stacks for s, _ in es]
        self.draws = False  # whether the body draws random numbers (found while tracing the forward)

    def _xs(self, layout: _Layout) -> list[tuple[dict[str, Tensor], list[Tensor]]]:
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
        iteration, :func:`revlib_xla.backend.after`). Why: the TPU compiler runs float32 matrix multiplies on bfloat16
        operands (DEFAULT precision), and hoists the conversion of a weight the loop only slices out of the loop:
        a bfloat16 copy of every layer's weights, live through both loops (half the parameter bytes, growing with
        depth). Read through a value of the iteration, the weight is converted one layer at a time, as the unrolled
        walk does."""
        assert self.layout is not None
        buffers = set(self.layout.buffer_names[j])
        return tensors | _params_after({n: t for n, t in tensors.items() if n not in buffers}, token)

    def _positions(self, j: int) -> Iterator[tuple[int, Tensor, tuple[str, ...]]]:
        """Position ``j``'s stacks with their index in ``inputs``."""
        assert self.stacks is not None
        k = sum(len(es) for es in self.stacks[:j])
        for n, (stack, names) in enumerate(self.stacks[j]):
            yield k + n, stack, names

    @contextlib.contextmanager
    def _seeded(self, layout: _Layout, replay: bool) -> Iterator[_Seeds | None]:
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
        from .reversible import _forward_fixed, _forward_layer

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
                before = backend.RngState.capture(device).accel
                if fixed is not None:
                    value = fixed.decode(a1, cast(torch.dtype, plan.value_dtype))
                    y1 = _forward_fixed(plan, j, a0, value, args, kwargs, self._named(j, tensors), guard=guard)[1]
                    a0, a1 = a1, y1
                else:
                    a0, a1 = a1, _forward_layer(plan, j, a0, a1, args, kwargs, self._named(j, tensors))
                if backend.RngState.capture(device).accel != before:
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
            plan.guard.record_many(range(len(plan.layers)), extremes.reshape(-1, 2))
        return y0, y1

    def _slices(self, i: int) -> dict[str, Tensor]:
        """Layer ``i``'s parameters: views of the stacks."""
        assert self.stacks is not None
        j, t = i % len(self.stacks), i // len(self.stacks)
        return {name: stack[t] for stack, names in self.stacks[j] for name in names}

    def _walk_forward(self, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
        """Stacked layers one by one, each on its slices of the stacks and its own block (hooks and buffers)."""
        from .reversible import ReversibleError, _forward_fixed, _forward_layer

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
                    y1 = _forward_fixed(plan, i, x0, value, args, kwargs, self._slices(i), guard=plan.guard)[1]
                    x0, x1 = x1, y1
                else:
                    x0, x1 = x1, _forward_layer(plan, i, x0, x1, args, kwargs, self._slices(i))
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
                b0, b1, g0, g1 = backend.optimization_barrier([b0, b1, g0, g1, *tensors.values()])[:4]
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
                y0, y1, dy0, dy1 = backend.optimization_barrier([y0, y1, dy0, dy1, *written])[:4]
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
    plan: _Plan,
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
    from .reversible import _call_block, _to_compute, _vjp

    wrapper = plan.wrappers[j]
    fixed = plan.fixed
    if fixed is not None:  # exact streams: y0, y1 are integers; straight through the rounding, as the unrolled walk
        with torch.enable_grad(), layer_autocast():
            x1 = fixed.decode(y0, cast(torch.dtype, plan.value_dtype)).requires_grad_()
            out = first_tensor(_call_block(plan, j, _to_compute(x1, plan), args, kwargs, tensors))
            x0 = _fixed.uncouple(fixed, y1, out)
        found = list(_vjp(out, [x1, *(tensors[n] for n in wanted)], _fixed.branch_gradient(dy1, out.shape, out.dtype)))
        dx1 = dy0 if found[0] is None else dy0 + found[0]
        return x0, dy1, dx1, dict(zip(wanted, found[1:]))
    with torch.enable_grad(), layer_autocast():
        x1 = y0.detach().requires_grad_()
        fn_out = _call_block(plan, j, _to_compute(x1, plan), args, kwargs, tensors)
        x0 = wrapper.uncouple(y1, _tree.detached(fn_out))
        x0 = x0.detach()
        if plan.stream_dtype is not None:
            x0 = x0.to(plan.stream_dtype)
        x0_leaf = x0.requires_grad_()
        out = wrapper.couple(x0_leaf, fn_out)
        if plan.stream_dtype is not None:
            out = out.to(plan.stream_dtype)
    inputs = [x0_leaf, x1, *(tensors[n] for n in wanted)]
    found = list(_vjp(out, inputs, dy1))
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
        from .reversible import _INPLACE_HINT, ReversibleError

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
            if _INPLACE_HINT not in str(err):
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


# ----------------------------------------------------------------------------------------------------------------
# Checkpointable: a run of identical stages as one scanned stage


def _stage_refusal(stage: nn.Module) -> str | None:
    """What keeps a stage from running inside a scan's body (traced once for every layer), or ``None``."""
    for name, module in stage.named_modules():
        where = f"its module {name or 'itself'!r}"
        if any(getattr(module, h, None) for h in _MODULE_HOOKS):
            return f"{where} has hooks (they would run once for all layers)"
        if module.training and any(
            b is not None and key not in module._non_persistent_buffers_set for key, b in module._buffers.items()
        ):
            return f"{where} is in training mode with buffers (running statistics, which the scan would not update)"
    return None


def scan_runs(stages: Sequence[nn.Module]) -> list[nn.Module]:
    """``stages`` with every run of two or more consecutive stages identical in structure (module types, settings,
    parameter and buffer names, shapes and dtypes) replaced by one :class:`ScannedStages`; stages that cannot run
    in a scan's body (hooks, training-mode running statistics, a parameter shared with another stage) stay as they
    are. Raises :class:`ScanUnsupported` naming why when no run is found."""
    sigs = [_module_signature(stage) for stage in stages]
    owners: dict[int, int] = {}
    shared: set[int] = set()
    for i, stage in enumerate(stages):
        for p in stage.parameters():
            if owners.setdefault(id(p), i) != i:
                shared |= {i, owners[id(p)]}
    refused = {i: why for i, stage in enumerate(stages) if (why := _stage_refusal(stage)) is not None}
    out: list[nn.Module] = []
    why_not: list[str] = []
    i = 0
    while i < len(stages):
        end = i + 1
        if i not in refused and i not in shared:
            while end < len(stages) and end not in refused and end not in shared and sigs[end] == sigs[i]:
                end += 1
        if end - i >= 2:
            out.append(ScannedStages(stages[i:end]))
        else:
            out.append(stages[i])
            if i in refused:
                why_not.append(f"stage {i} ({type(stages[i]).__name__}): {refused[i]}")
            elif i in shared:
                why_not.append(f"stage {i} ({type(stages[i]).__name__}) shares a parameter with another stage")
            elif end < len(stages) and (how := _difference(sigs[i], sigs[end])) is not None:
                why_not.append(f"stage {end} ({type(stages[end]).__name__}) differs from stage {i} ({how})")
        i = end
    if not any(isinstance(stage, ScannedStages) for stage in out):
        raise ScanUnsupported(
            "no two consecutive stages are identical in structure and scannable"
            + (f": {why_not[0]}" if why_not else "")
        )
    return out


class ScannedStages(nn.Module):
    """A run of stages identical in structure, run as one stage with rematerialisation inside (what torch_xla's
    ``scan_layers`` does with a full-remat partition, on this package's own loops): with autograd, the forward keeps
    only each layer's input and the backward recomputes one layer at a time with autograd, in reverse, taking its
    vector-Jacobian product. On XLA both are while loops over the layers' parameters and buffers stacked along a
    new leading dimension (one layer compiled, whatever the run's length; the stacks are transient copies, unless
    :func:`stack_layers` stored the parameters stacked: then the loops read the stacks and write their gradients);
    on eager devices (cpu, cuda) the same steps run layer by layer, on the layers' own parameters or on slices of
    the stacks.

    Each layer maps a tensor to a tensor of the same shape and dtype. Not supported (a clear error at the call):
    layers that draw random numbers (dropout: one trace would draw the same numbers for every layer), layers that
    change their buffers. Built by :class:`revlib_xla.Checkpointable` with ``scan=True`` (see :func:`scan_runs`)."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        # With stacked storage (stack_layers): per parameter of a layer, the stack's attribute on the owner and the
        # parameter's names in a layer (tied names together); the owner holds the stacks, as registered parameters.
        self._stacks: list[tuple[str, tuple[str, ...]]] | None = None
        self._owner: nn.Module | None = None

    def extra_repr(self) -> str:
        return f"{len(self.layers)} x {type(self.layers[0]).__name__}, scanned{', stacked' if self._stacks else ''}"

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The layers' parameters, or with stacked storage the stacks (held by the model: ``stack_layers``)."""
        if self._stacks is None or self._owner is None:
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
            return
        for attr, _ in self._stacks:
            yield prefix + attr, getattr(self._owner, attr)

    def _stacked_params(self) -> dict[str, Tensor]:
        """With stacked storage: each stack by its first name in a layer."""
        assert self._stacks is not None and self._owner is not None
        return {names[0]: getattr(self._owner, attr) for attr, names in self._stacks}

    def _aliased(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """``tensors`` (by a parameter's first name) with the tied names added: a stacked layer has no parameters to
        tie them by itself."""
        if self._stacks is None:
            return tensors
        return tensors | {name: tensors[names[0]] for _, names in self._stacks for name in names[1:]}

    def _layer(self, t: int, x: Tensor, params: dict[str, Tensor] | None = None) -> Any:
        """Layer ``t`` on ``x``: with its own parameters, or (stacked) with ``params`` (default: its slices)."""
        if self._stacks is None:
            return self.layers[t](x)
        if params is None:
            params = {name: stack[t] for name, stack in self._stacked_params().items()}
        return torch.func.functional_call(self.layers[t], self._aliased(params), (x,))

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"ScannedStages ({self.extra_repr()}): the layers' input must be one tensor (the loop's carry), got "
                f"{type(x).__name__}; pass scan=False to Checkpointable"
            )
        for index, layer in enumerate(self.layers):  # what may have changed since scan_runs took the layers
            if (why := _stage_refusal(layer)) is not None:  # e.g. model.train() after wrapping an eval-mode model
                raise ScanUnsupported(
                    f"ScannedStages ({self.extra_repr()}): layer {index} ({type(layer).__name__}): {why}; its "
                    f"forward runs again in the backward. Pass scan=False to Checkpointable, or wrap the model in the "
                    f"mode it runs in"
                )
        params = list(self.parameters())
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            return cast(Tensor, _ScannedStagesFn.apply(self, x, *params))
        return self._run_forward(x, keep=False)[0]

    # -- the loops ------------------------------------------------------------------------------------------------
    def _stacked(self) -> dict[str, Tensor]:
        """Every layer's parameters and buffers stacked by name, for the compiled loops: a copy, except the stacks of
        stacked storage, which are read as they are."""
        found = [dict(layer.named_parameters()) | dict(layer.named_buffers()) for layer in self.layers]
        with torch.no_grad():
            stacked = {n: torch.stack([f[n] for f in found]) for n in found[0]}
        return stacked if self._stacks is None else self._stacked_params() | stacked

    def _check_carry(self, x: Tensor, y: Any) -> Tensor:
        if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
            got = f"{tuple(y.shape)} {y.dtype}" if isinstance(y, torch.Tensor) else type(y).__name__
            raise ScanUnsupported(
                f"ScannedStages ({self.extra_repr()}): a layer maps {tuple(x.shape)} {x.dtype} to {got}; a scanned "
                f"layer must return a tensor of its input's shape and dtype. Pass scan=False to Checkpointable"
            )
        return y

    def _refuse_random(self, drawn: bool, before: backend.RngState, device: torch.device) -> None:
        """Raise if the layers drew random numbers: ``drawn`` (seen operator by operator), or the device's or the
        CPU's generator moved since ``before``."""
        after = backend.RngState.capture(device)
        moved = before.accel != after.accel or (
            before.cpu is not None and after.cpu is not None and not torch.equal(before.cpu, after.cpu)
        )
        if drawn or moved:
            raise ScanUnsupported(
                f"ScannedStages ({self.extra_repr()}): the layers draw random numbers (dropout), which a scanned run "
                f"of Checkpointable stages does not replay per layer; pass scan=False to Checkpointable (or use "
                f"dropout outside the repeated stages)"
            )

    def _run_forward(self, x: Tensor, keep: bool) -> tuple[Tensor, Any]:
        """The layers without autograd: the output, and with ``keep`` each layer's input (stacked on XLA)."""
        device = x.device
        before = backend.RngState.capture(device)
        loop = backend.scan_loop(device) if backend.is_tracing_lazily(x) else None
        if loop is None:
            inputs = []
            with _RandomOps() as seen:  # the stage may draw from generators of its own (Checkpointable's replay)
                for t in range(len(self.layers)):
                    if keep:
                        inputs.append(x)
                    x = self._check_carry(x, self._layer(t, x))
            self._refuse_random(seen.drawn, before, device)
            return x, inputs
        template = self.layers[0]

        def body(carry: Tensor, tensors: dict[str, Tensor]) -> tuple[Tensor, Any]:
            tensors = _params_after(tensors, carry)
            y = self._check_carry(carry, torch.func.functional_call(template, self._aliased(tensors), (carry,)))
            return y, (carry if keep else ())

        y, inputs = loop(body, x, self._stacked())
        self._refuse_random(False, before, device)
        return y, inputs

    def _run_backward(
        self, inputs: Any, dy: Tensor, trained: list[bool], autocast: backend.AutocastState
    ) -> tuple[Tensor | None, list[Tensor | None]]:
        """The input's gradient and the gradient of each layer's parameters (in ``parameters()`` order; ``None``
        where not ``trained``), recomputing one layer at a time from its kept input."""
        from .reversible import _vjp

        if self._stacks is None:  # per layer, its parameters' names; trained[t * count + k]: layer t's k-th
            names = [n for n, _ in self.layers[0].named_parameters()]
            count = len(names)
            need = [any(trained[t * count + k] for t in range(len(self.layers))) for k in range(count)]
        else:  # per stack, its first name; trained[k] (count 0): the k-th stack
            names = list(self._stacked_params())
            count, need = 0, trained
        wanted_names = [n for n, wanted in zip(names, need) if wanted]
        loop = backend.scan_loop(dy.device) if backend.is_tracing_lazily(dy) else None
        grads: list[Tensor | None] = [None] * len(trained)
        if loop is None:
            per_layer: dict[str, list[Tensor]] = {n: [] for n in wanted_names}  # stacked: in reverse
            for t in reversed(range(len(self.layers))):
                leaf = inputs[t].detach().requires_grad_()
                params: dict[str, Tensor]
                if self._stacks is None:
                    params = dict(self.layers[t].named_parameters())
                else:
                    params = {n: s[t].detach().requires_grad_() for n, s in self._stacked_params().items()}
                with torch.enable_grad(), autocast.replay():
                    out = self._layer(t, _non_leaf(leaf), params)
                wanted = [(k, n) for k, n in enumerate(names) if trained[t * count + k]]
                found = _vjp(out, [leaf, *(params[n] for _, n in wanted)], dy)
                dy = found[0] if found[0] is not None else torch.zeros_like(leaf)
                for (k, n), g in zip(wanted, found[1:]):
                    g = g if g is not None else torch.zeros_like(params[n])
                    if self._stacks is None:
                        grads[t * count + k] = g
                    else:
                        per_layer[n].append(g)
            if self._stacks is not None:  # each stack's gradient: its layers' gradients stacked
                return dy, [torch.stack(per_layer[n][::-1]) if need else None for n, need in zip(names, trained)]
            return dy, grads
        template = self.layers[0]

        def body(carry: Tensor, xs: tuple[Tensor, dict[str, Tensor]]) -> tuple[Tensor, dict[str, Tensor]]:
            x, tensors = xs
            fenced = backend.optimization_barrier([carry, x, *tensors.values()])
            g, x = fenced[0], fenced[1]
            tensors = _params_after(dict(zip(tensors, fenced[2:])), g)
            leaves = {n: t.detach().requires_grad_() if n in wanted_names else t for n, t in tensors.items()}
            leaf = x.detach().requires_grad_()
            with torch.enable_grad(), autocast.replay():
                out = torch.func.functional_call(template, self._aliased(leaves), (_non_leaf(leaf),))
            found = _vjp(out, [leaf, *(leaves[n] for n in wanted_names)], g)
            dx = found[0] if found[0] is not None else torch.zeros_like(leaf)
            return dx, {n: f if f is not None else torch.zeros_like(leaves[n]) for n, f in zip(wanted_names, found[1:])}

        with torch.no_grad():
            dx, stacked = loop(body, dy, (inputs, self._stacked()), reverse=True)
        if self._stacks is not None:  # the loop's stacked gradients are the stacks' gradients
            return dx, [stacked[n] if need else None for n, need in zip(names, trained)]
        for t in range(len(self.layers)):
            for k, name in enumerate(names):
                if trained[t * count + k]:
                    grads[t * count + k] = stacked[name][t]
        return dx, grads


def _non_leaf(leaf: Tensor) -> Tensor:
    """``leaf`` as a view, the input a layer gets in a backward body: module trackers (``MemTracker``, FSDP) put
    multi-tensor gradient hooks on a module's inputs, which fail on a leaf inside ``torch.autograd.grad``."""
    with torch.enable_grad():
        return leaf.view_as(leaf)


class _RandomOps(TorchDispatchMode):
    """Whether an operator that draws random numbers ran (``torch.Tag.nondeterministic_seeded``)."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.drawn = True
        return func(*args, **(kwargs or {}))


def _params_after(tensors: dict[str, Tensor], token: Tensor) -> dict[str, Tensor]:
    """A loop body's floating-point tensors read through ``token``, a value of the iteration (see
    :meth:`_Run._read_after`: no hoisted bfloat16 copy of every layer's weights on TPU); the others as they are."""
    floating = {n: t for n, t in tensors.items() if t.is_floating_point()}
    return tensors | backend.after(floating, token)


class _ScannedStagesFn(torch.autograd.Function):
    """A :class:`ScannedStages` run with autograd: the forward keeps each layer's input, the backward recomputes."""

    @staticmethod
    def forward(ctx, owner: ScannedStages, x: Tensor, *params: Tensor):  # type: ignore[override]
        ctx.owner = owner
        ctx.autocast = backend.AutocastState.capture(x.device)
        with torch.no_grad():
            y, inputs = owner._run_forward(x, keep=True)
        ctx.inputs = inputs
        ctx.save_for_backward(x, *params)  # torch's own error if one is changed in place before the backward
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        owner: ScannedStages = ctx.owner
        x, *params = ctx.saved_tensors
        trained = list(ctx.needs_input_grad[2:])
        if torch.is_grad_enabled():  # create_graph=True: the layers again with autograd, differentiable
            with torch.enable_grad(), ctx.autocast.replay():
                out = x
                for t in range(len(owner.layers)):
                    out = owner._layer(t, out)
            wants_x = ctx.needs_input_grad[1]
            wrt = [x] * wants_x + [p for p, need in zip(params, trained) if need]
            found = iter(torch.autograd.grad(out, wrt, dy, create_graph=True, allow_unused=True))
            dx = next(found) if wants_x else None
            return (None, dx, *(next(found) if need else None for need in trained))
        if ctx.inputs is None:
            raise RuntimeError(
                f"ScannedStages ({owner.extra_repr()}): a second backward through the same forward; its layers' inputs "
                f"were freed by the first (Checkpointable runs its forward phase again for a retained graph)"
            )
        dx, grads = owner._run_backward(ctx.inputs, dy, trained, ctx.autocast)
        ctx.inputs = None  # the layers' inputs: freed with the backward, as autograd frees saved tensors
        return (None, dx, *grads)
