"""RevLib's ``revlib.utils``: MomentumNet and conversions of ordinary stacks into reversible ones.

``from revlib_xla.utils import momentum_net`` works as ``from revlib.utils import momentum_net`` does, and the names
RevLib's utils takes from its core (``MergeCalls``, ``ReversibleSequential``, ...) are found here too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .core import MergeCalls, SingleBranchReversibleModule, get_key, split_tensor_list
from .intermediates import memory_efficient_intermediates
from .reversible import FUSED_OPTIMIZER, MemoryModes, ReversibleSequential
from .reversible.coupling import (
    COUPLING,
    detached_additive_coupling_forward,
    detached_additive_coupling_inverse,
    optional_detach,
)

Tensor = torch.Tensor

__all__ = [
    "MomentumNetStem",
    "MomentumNetSide",
    "ResidualToPlain",
    "momentum_net",
    "residual_to_plain",
    "maybe_residual_to_plain",
    "sequential_to_revnet",
    "sequential_to_momentum_net",
    "module_list_to_momentum_net",
    "ReversibleStack",
    "optional_detach",
    "is_float",
    "detached_additive_coupling_forward",
    "detached_additive_coupling_inverse",
    "memory_efficient_intermediates",
    # what RevLib's utils takes from its core, so that code reaching it through utils finds it
    "FUSED_OPTIMIZER",
    "MemoryModes",
    "ReversibleSequential",
    "MergeCalls",
    "SingleBranchReversibleModule",
    "get_key",
    "split_tensor_list",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_float(inp: Any) -> bool:
    """True for floating-point tensors of the four usual dtypes."""
    return isinstance(inp, torch.Tensor) and inp.dtype in _FLOATS


class MomentumNetSide(nn.Module):
    """Scales the stream by a constant: the 'side' layer of RevLib's MomentumNet."""

    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = alpha

    def forward(self, inp: Tensor, *args, **kwargs) -> Tensor:
        return inp * self.alpha

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}"


class MomentumNetStem(nn.Module):
    """Runs the wrapped block on the stream scaled by ``gamma``: the 'stem' layer of RevLib's MomentumNet."""

    def __init__(self, wrapped_module: nn.Module, gamma: float):
        super().__init__()
        self.wrapped_module = wrapped_module
        self.gamma = gamma

    def forward(self, inp: Tensor, *args, **kwargs):
        return self.wrapped_module(inp * self.gamma, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"gamma={self.gamma}"


class ResidualToPlain(nn.Module):
    """Turns a residual block ``x -> x + f(x)`` into its branch ``x -> f(x)`` (list outputs: element 0)."""

    def __init__(self, wrapped_module: nn.Module):
        super().__init__()
        self.wrapped_module = wrapped_module

    def forward(self, inp: Tensor, *args, **kwargs):
        out = self.wrapped_module(inp, *args, **kwargs)
        if isinstance(out, (list, tuple)):
            return [out[0] - inp] + list(out[1:])
        return out - inp


def residual_to_plain(*modules: nn.Module) -> list[ResidualToPlain]:
    return [ResidualToPlain(m) for m in modules]


def maybe_residual_to_plain(modules: Iterable[nn.Module], residual: bool = False) -> list[nn.Module]:
    modules = list(modules)
    return [*residual_to_plain(*modules)] if residual else modules


def _check_beta(beta: float) -> None:
    if not 0.0 < beta < 1.0:
        raise ValueError(f"momentum_net: beta must be in (0, 1), got {beta!r}")


def momentum_net(
    *modules: nn.Module,
    split_dim: int | None = 1,
    coupling_forward: list[COUPLING | None] | None = None,
    coupling_inverse: list[COUPLING | None] | None = None,
    memory_mode: MemoryModes = MemoryModes.autograd_function,
    target_device: str = "",
    fused_optimizer: FUSED_OPTIMIZER = None,
    beta: float = 0.9,
    **kwargs,
) -> ReversibleSequential:
    """A MomentumNet as a reversible sequence.

    Module k becomes two layers, ``MomentumNetStem(module, beta**k)`` and ``MomentumNetSide((1-beta)/beta**(k+1))``,
    with additive couplings (RevLib's construction): ``beta`` is folded into the blocks. With streams ``(p, q)`` it
    computes ``p <- p + f_k(beta**k q)``, ``q <- q + (1-beta)/beta**(k+1) p``, i.e. ``x_k = beta**k q_k`` is an
    exponential moving average of the running residual sum ``p``.

    Invertible in exact arithmetic only: ``q`` grows by ``1/beta`` per module, so rebuilding it loses about
    ``log10(1/beta)`` digits per module (``beta=0.1`` in float32: wrong gradients from 4 modules on). Unless
    ``verify_inverse=False`` is passed, the first training forward therefore measures how exactly the input is rebuilt
    (:func:`revlib_xla.check_invertible`) and raises where the gradients would be wrong.
    """
    _check_beta(beta)
    kwargs.setdefault("verify_inverse", True)
    layers: list[nn.Module] = []
    for idx, module in enumerate(modules):
        layers.append(MomentumNetStem(module, beta**idx))
        layers.append(MomentumNetSide((1 - beta) / beta ** (idx + 1)))
    return ReversibleSequential(
        *layers,
        split_dim=split_dim,
        coupling_forward=coupling_forward,
        coupling_inverse=coupling_inverse,
        memory_mode=memory_mode,
        target_device=target_device,
        fused_optimizer=fused_optimizer,
        **kwargs,
    )


def sequential_to_revnet(
    module: nn.Sequential,
    split_dim: int | None = 1,
    coupling_forward: list[COUPLING | None] | None = None,
    coupling_inverse: list[COUPLING | None] | None = None,
    memory_mode: MemoryModes = MemoryModes.autograd_function,
    target_device: str = "",
    fused_optimizer: FUSED_OPTIMIZER = None,
    residual: bool = False,
    **kwargs,
) -> ReversibleSequential:
    """Every child of ``module`` becomes one reversible layer (``residual=True``: children are residual blocks
    ``x + f(x)`` and only their branch ``f`` is used)."""
    return ReversibleSequential(
        *maybe_residual_to_plain(module, residual),
        split_dim=split_dim,
        coupling_forward=coupling_forward,
        coupling_inverse=coupling_inverse,
        memory_mode=memory_mode,
        target_device=target_device,
        fused_optimizer=fused_optimizer,
        **kwargs,
    )


def sequential_to_momentum_net(
    module: nn.Sequential,
    split_dim: int | None = 1,
    coupling_forward: list[COUPLING | None] | None = None,
    coupling_inverse: list[COUPLING | None] | None = None,
    memory_mode: MemoryModes = MemoryModes.autograd_function,
    target_device: str = "",
    fused_optimizer: FUSED_OPTIMIZER = None,
    residual: bool = False,
    beta: float = 0.9,
    **kwargs,
) -> ReversibleSequential:
    """:func:`momentum_net` over the children of ``module``."""
    return momentum_net(
        *maybe_residual_to_plain(module, residual),
        split_dim=split_dim,
        coupling_forward=coupling_forward,
        coupling_inverse=coupling_inverse,
        memory_mode=memory_mode,
        target_device=target_device,
        fused_optimizer=fused_optimizer,
        beta=beta,
        **kwargs,
    )


class ReversibleStack(nn.Module):
    """A whole MomentumNet run as one layer of a ``ModuleList`` that code calls one layer at a time.

    Both streams start as the hidden state ``x`` (RevLib seeded the second with zeros, which drops the input's skip
    path); the output is the position stream ``beta**K q_K``. As ``beta -> 0`` the stack tends to the original
    residual network ``x <- x + f_k(x)``, so a pretrained stack keeps (approximately) its function. Extra arguments
    are passed to every block.
    """

    def __init__(self, net: ReversibleSequential, beta: float, depth: int):
        super().__init__()
        self.net = net
        self.beta = beta
        self.depth = depth

    def forward(self, hidden: Tensor, *args, **kwargs) -> Tensor:
        _, q = self.net((hidden, hidden), *args, **kwargs)
        return q * self.beta**self.depth


def module_list_to_momentum_net(
    module: nn.ModuleList,
    split_dim: int | None = 1,
    coupling_forward: list[COUPLING | None] | None = None,
    coupling_inverse: list[COUPLING | None] | None = None,
    memory_mode: MemoryModes = MemoryModes.autograd_function,
    target_device: str = "",
    fused_optimizer: FUSED_OPTIMIZER = None,
    residual: bool = False,
    beta: float = 0.9,
    **kwargs,
) -> nn.ModuleList:
    """Replace a ``ModuleList`` of (residual) layers with a one-element ``ModuleList`` running them as a
    memory-saving MomentumNet (see :class:`ReversibleStack`). A loop ``for layer in layers: x = layer(x)`` keeps
    working; the activation memory of the whole stack no longer grows with its depth.

    ``split_dim`` is accepted for RevLib compatibility and unused: the hidden state feeds both streams whole.

    HuggingFace stacks train with ``use_cache=False``: a KV cache passed to a training forward is refused, since the
    backward runs every layer again and would write its keys and values into the cache a second time.
    """
    _check_beta(beta)
    blocks = maybe_residual_to_plain(module, residual)
    net = momentum_net(
        *blocks,
        split_dim=None,
        coupling_forward=coupling_forward,
        coupling_inverse=coupling_inverse,
        memory_mode=memory_mode,
        target_device=target_device,
        fused_optimizer=fused_optimizer,
        beta=beta,
        **kwargs,
    )
    return nn.ModuleList([ReversibleStack(net, beta, len(blocks))])
