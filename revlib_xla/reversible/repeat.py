"""Which layers repeat: what must match between two layers (or stages) for one traced loop body to run both, the
period with which a sequence's layers repeat, and what rules a layer out of a loop body (hooks, running statistics).
:class:`ScanUnsupported` says why a call cannot run as a scan."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .layers import ReversibleModule
from .plan import Plan

Tensor = torch.Tensor


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
        *module_signature(layer.block),
    ]


def module_signature(block: nn.Module) -> list[tuple[str, str, Any]]:
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


def difference(a: list[tuple[str, str, Any]], b: list[tuple[str, str, Any]]) -> str | None:
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
            how = difference(sigs[i % period], sigs[i])
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


MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def refuse_hooks(plan: Plan) -> None:
    """Module hooks run where the block is called: once per trace of the scan's body, not once per layer."""
    from torch.nn.modules import module as module_globals

    if any(getattr(module_globals, f"_global{h}", None) for h in MODULE_HOOKS):
        raise ScanUnsupported("global module hooks are registered (they would run once for all layers)")
    for i, layer in enumerate(plan.layers):
        for name, module in layer.block.named_modules():
            if any(getattr(module, h, None) for h in MODULE_HOOKS):
                raise ScanUnsupported(
                    f"{plan.describe(i)} has hooks on its module {name or 'itself'!r} (they would run once for all "
                    f"layers)"
                )


def refuse_state(plan: Plan) -> None:
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
