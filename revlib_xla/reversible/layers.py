"""One reversible layer (:class:`ReversibleModule`: a block and its coupling pair), RevLib's memory modes, and
the checks of what a sequence is built from and called with (coupling pairs, dtypes, KV caches, devices)."""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

from .. import _tree, backends
from ..errors import ReversibleError
from .coupling import (
    COUPLING,
    CouplingPair,
    additive_coupling_forward,
    additive_coupling_inverse,
    first_tensor,
    is_additive_forward,
    is_additive_inverse,
)

Tensor = torch.Tensor
DUAL_OR_QUAD_TENSOR = tuple[Tensor, Tensor, Tensor, Tensor] | tuple[Tensor, Tensor]
FUSED_OPTIMIZER = Callable[[Iterable], torch.optim.Optimizer] | None
LAYERWISE_ARGS_KWARGS = list[tuple[list[Any], dict[str, Any]]] | None


class MemoryModes(enum.IntEnum):
    """RevLib's memory modes. ``checkpoint`` and ``autograd_graph`` run as ``autograd_function`` (see
    :class:`ReversibleSequential`): RevLib's cache modes peak above ``no_savings``."""

    no_savings = 0
    checkpoint = 1
    autograd_graph = 2
    autograd_function = 3


def describe_coupling(coupling: COUPLING | None) -> str:
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
            f"{forward_name} is {describe_coupling(forward)}, but {inverse_name} is None: the additive "
            f"inverse does not undo it"
        )
        fix = f"pass its inverse as {inverse_name}"
    elif forward is None and not is_additive_inverse(inverse):
        problem = (
            f"{inverse_name} is {describe_coupling(inverse)}, but {forward_name} is None (additive): it is "
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


def check_couplings(coupling_forward: Any, coupling_inverse: Any) -> None:
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


def dtype_mismatch(label: str, param_dtypes: set, blocks_see: torch.dtype, from_compute_dtype: bool) -> ReversibleError:
    names = sorted(str(d) for d in param_dtypes)
    params = names[0]
    source = "compute_dtype" if from_compute_dtype else "the input's dtype"
    return ReversibleError(
        f"{label}: its parameters are {' and '.join(names)}, but it would compute on "
        f"{blocks_see} ({source}); without autocast that fails or silently computes in {blocks_see} (on XLA). Cast "
        f"the input (x.to({params})) or the model (model.to({blocks_see})), pass compute_dtype={params}, or run under "
        f"torch.autocast."
    )


def refuse_kv_caches(args: Sequence[Any], kwargs: dict[str, Any], layerwise: LAYERWISE_ARGS_KWARGS) -> None:
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


def available_device(target_device: str | torch.device) -> torch.device:
    """``target_device`` as a device this machine has, or a :class:`ReversibleError` saying which it has."""
    try:
        device = torch.device(target_device)
    except (RuntimeError, TypeError) as err:
        raise ReversibleError(
            f"ReversibleSequential: target_device={target_device!r} is not a device ({err})"
        ) from None
    if not backends.device_available(device):
        raise ReversibleError(
            f"ReversibleSequential: target_device={target_device!r}, but this machine has no such device (it has "
            f"{', '.join(backends.available_kinds())}). Pass one of those, or leave target_device empty to run each "
            f"layer where its parameters are."
        )
    return device
