"""Stacked parameter storage (what :func:`~revlib_xla.reversible.stacking.stack_layers` makes): the repeated layers'
parameters held as one ``[iterations, ...]`` parameter per name, read as per-layer views, saved and loaded under the
unstacked state-dict keys (:class:`KeyMap`), and written layer by layer inside :func:`layer_parameters`."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

Tensor = torch.Tensor


@dataclasses.dataclass
class Stacks:
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


class Views:
    """Each layer's parameters as views of the stacks (``unbind``: one autograd node per stack, whose backward
    stacks the layers' gradients once), taken at first use: for the paths that call the blocks one by one without
    the reversible walk (plain autograd, no gradients, the inverse, the invertibility check)."""

    def __init__(self, model: nn.Module, stacks: Stacks) -> None:
        self.model, self.stacks = model, stacks
        self.unbound: dict[str, tuple[Tensor, ...]] | None = None

    def __call__(self, i: int) -> dict[str, Tensor]:
        stacks = self.stacks
        if self.unbound is None:
            self.unbound = {attr: getattr(self.model, attr).unbind(0) for es in stacks.entries for attr, _ in es}
        j, t = i % stacks.period, i // stacks.period
        return {name: self.unbound[attr][t] for attr, names in stacks.entries[j] for name in names}


def stacks_of(model: nn.Module) -> Stacks | None:
    """The stacked storage of a sequence (:func:`stack_layers`), or ``None``."""
    return getattr(model, "_stacks", None)  # models pickled before stacked storage existed have none


def layer_shape(param: Tensor, model: nn.Module) -> torch.Size:
    """The shape ``param`` has in one layer: a stack of :func:`stack_layers` (a sequence anywhere in ``model``)
    without its leading layer dimension, any other parameter its own shape. For rules by rank, such as weight decay
    on matrices only: a stacked norm scale is 2-D, one layer's is 1-D (``len(layer_shape(p, model)) >= 2``)."""
    for module in model.modules():
        keys = key_map(module)
        if keys is not None and any(getattr(module, attr) is param for attr in keys.stacks):
            return param.shape[1:]
    return param.shape


def stacked_views(model: nn.Module) -> Callable[[int], dict[str, Tensor]] | None:
    """``i -> layer i's parameters`` (views of the stacks) for a sequence with stacked storage, else ``None``."""
    stacks = stacks_of(model)
    return None if stacks is None else Views(model, stacks)


@dataclasses.dataclass
class KeyMap:
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


def key_map(model: nn.Module) -> KeyMap | None:
    """The key map of a module holding stacks: a sequence of :func:`stack_layers`, or the model of a stacked
    ``Checkpointable``."""
    found = getattr(model, "_stage_stacks", None)
    if found is not None:
        return cast(KeyMap, found)
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
    return KeyMap(per_stack, order)


def stacked_state_dict(model: nn.Module, destination: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """The stacks' entries replaced by each layer's parameters (views), in the unstacked model's order."""
    keys = key_map(model)
    if keys is not None:
        keys.save(destination, prefix)


def load_into_stacks(
    model: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Each layer's parameter entries stacked into the stack's entry (:meth:`KeyMap.load`)."""
    keys = key_map(model)
    if keys is not None:
        keys.load(model, state_dict, prefix, missing_keys, error_msgs)


@contextlib.contextmanager
def layer_parameters(model: nn.Module) -> Iterator[nn.Module]:
    """Inside: each stacked layer's block holds its parameters again, as parameters sharing storage with the stacks,
    so code that initialises or loads weights layer by layer (``block.weight.normal_()``, ``copy_``) writes into
    the stacks. Outside, the blocks hold none again. For writes only: a forward inside runs on the stacks. Nests;
    a model without stacked layers (any module) is left as it is. ``model``: a stacked ``ReversibleSequential``, or
    the model a stacked ``Checkpointable`` wraps (its ``model``)."""
    keys = key_map(model)
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
