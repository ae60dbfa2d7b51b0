"""``stack_layers``: a reversible sequence's repeating layers turned into stacked parameter storage
(:mod:`revlib_xla.reversible.stacks`). A model that stacks its layers its own way (a
:class:`revlib_xla.Checkpointable` with scanned runs of stages) says so with a ``_stack_layers()`` method, which
``stack_layers`` calls."""

from __future__ import annotations

from typing import TypeVar, cast

import torch
from torch import nn

from .. import fsdp
from .._replaced_params import mark_replaced
from ..errors import ReversibleError
from .layers import ReversibleModule
from .repeat import ScanUnsupported, repeat_period
from .scan import stacking_refused
from .sequential import ReversibleSequential
from .stacks import Stacks, load_into_stacks, stacked_state_dict, stacks_of

Tensor = torch.Tensor


Model = TypeVar("Model", bound=nn.Module)


def stack_layers(model: Model, scan: bool | None = None) -> Model:
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
    (:class:`~revlib_xla.planner.scanned.ScannedStages`) gets its parameters stored stacked in the same way,
    registered on the Checkpointable's ``model`` (``stacked_<first layer's path>_<parameter path>``, dots as
    underscores), so that its compiled loops read the stacks and write the stacks' gradients: the step holds the
    parameters and their gradients once. The same keys in ``state_dict()`` (of the Checkpointable and of the model),
    the same gradients; ``scan`` is not used. The model then runs through the Checkpointable only (in eval mode
    too); calling the model itself raises; its layers hold their parameters only inside :func:`layer_parameters` of
    the model (writes go to the stacks). Raises ``ValueError`` without a scanned run, when stacked already or with
    hooks on a parameter.
    """
    own = getattr(model, "_stack_layers", None)  # a Checkpointable: its scanned runs' stacks (planner.scanned)
    if callable(own):
        return cast(Model, own())
    if not isinstance(model, ReversibleSequential):
        raise ReversibleError(f"stack_layers expects a ReversibleSequential, got {type(model).__name__}")
    if stacks_of(model) is not None:
        raise ReversibleError("stack_layers: the model's layers are stacked already")
    why = stacking_refused(model)
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
    vars(model)["_stacks"] = Stacks(period, iterations, entries, keys, block_path)  # plain state: copied, pickled
    model.scan = scan
    model._register_state_dict_hook(stacked_state_dict)
    model._register_load_state_dict_pre_hook(load_into_stacks, with_module=True)
    return model
