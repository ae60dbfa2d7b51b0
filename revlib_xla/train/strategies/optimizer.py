"""The run's optimizer: AdamW of ``optim.*`` (weight decay on matrices only), its learning-rate schedule, and the
``fused_optimizer`` piece (each parameter updated inside the backward pass as soon as its gradient is complete,
:func:`revlib_xla.fuse_optimizer`). With ``offload.optimizer`` the same AdamW steps in host memory
(:class:`HostOptimizerState`, the ``offload.optimizer`` piece of :mod:`.offload`)."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from ... import backends
from ...optim.host import HostOptimizer, master_dtype
from ..config import RunConfig
from .base import Piece, Refusal, language_model, register
from .sizing import model_config

__all__ = [
    "HostOptimizerState",
    "adamw",
    "step_implementation",
    "implementation_flags",
    "layer_ndims",
    "lr_at",
    "set_lr",
    "FUSED",
]


def layer_ndims(model: nn.Module) -> dict[int, int]:
    """``id(parameter)`` -> the dimensions of what one layer holds of it: a stacked parameter
    (:func:`revlib_xla.scan.stack_layers`, ``[layers, ...]``) has one fewer per layer than it has, any other its
    own. What the weight-decay rule looks at, so a stacked norm scale (``[layers, dim]``) is not taken for a
    matrix."""
    from ...reversible import layer_shape

    return {id(p): len(layer_shape(p, model)) for p in model.parameters()}


def _groups(params: list[nn.Parameter], weight_decay: float, ndims: list[int]) -> list[dict[str, Any]]:
    """Weight decay on matrices (and embeddings), none on norms' scales and biases; ``ndims``: each parameter's
    dimensions per layer (:func:`layer_ndims`), so stacked and unstacked layers get the same decay."""
    decay = [p for p, n in zip(params, ndims) if n >= 2]
    rest = [p for p, n in zip(params, ndims) if n < 2]
    return [
        g
        for g in ({"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0})
        if g["params"]
    ]


def adamw(cfg: RunConfig, params: list[nn.Parameter], ndims: list[int] | None = None) -> torch.optim.Optimizer:
    """AdamW of ``optim.*`` over ``params`` (``ndims``: their dimensions per layer; default their own), its step
    run as ``optim.implementation`` says for their device (:func:`step_implementation`)."""
    o = cfg.optim
    ndims = [p.ndim for p in params] if ndims is None else ndims
    device = params[0].device.type if params else "cpu"
    flags = implementation_flags(step_implementation(cfg, device, params))
    return torch.optim.AdamW(_groups(params, o.weight_decay, ndims), lr=o.lr, betas=o.betas, eps=o.eps, **flags)


def step_implementation(cfg: RunConfig, device_type: str, params: list[nn.Parameter] | None = None) -> str:
    """How AdamW's step runs over parameters on ``device_type``: ``optim.implementation``, with ``auto`` resolved:
    torch's fused kernel on cuda (each weight updated in one kernel, no temporaries; torch's own default there,
    ``foreach``, makes temporaries the size of every gradient at once: at llama-8b 30 GiB on top of the state),
    torch's default elsewhere (``default``: one weight at a time on the host; traced into the step on XLA).
    Sharded (DTensor) parameters keep torch's default."""
    chosen = cfg.optim.implementation
    if chosen != "auto":
        return chosen
    if not backends.backend_for(torch.device(device_type)).fused_adamw:
        return "default"
    from torch.distributed.tensor import DTensor

    return "default" if any(isinstance(p, DTensor) for p in params or []) else "fused"


def implementation_flags(implementation: str) -> dict[str, bool]:
    """AdamW's keyword arguments for a :func:`step_implementation`."""
    return {
        "fused": {"fused": True},
        "foreach": {"foreach": True},
        "for-loop": {"foreach": False},
        "default": {},
    }[implementation]


class HostOptimizerState(HostOptimizer):
    """:func:`adamw` of ``cfg`` over ``params`` with its state and float32 master weights in host memory
    (``strategy.offload.optimizer``): :class:`revlib_xla.optim.HostOptimizer` (see there for the host step and
    ``annotate``). ``ndims``: the parameters' dimensions per layer (:func:`layer_ndims`; default their own). With
    ``strategy.offload.gradients`` each gradient goes to the host as the backward produces it (``shared``: the
    tied parameters, whose gradient arrives in parts)."""

    def __init__(
        self,
        cfg: RunConfig,
        params: list[nn.Parameter],
        annotate: bool,
        ndims: list[int] | None = None,
        shared: Collection[int] = (),
    ) -> None:
        o, streamed = cfg.optim, cfg.strategy.offload.gradients
        accumulated = o.grad_accum_steps > 1 and any(p.dtype != master_dtype(p.dtype) for p in params)
        waiting = o.grad_clip > 0 or cfg.train.nonfinite == "skip"  # every gradient, until the global norm
        kept = "sums" if accumulated else "all" if streamed and waiting else "one"
        super().__init__(
            params,
            lambda inner: adamw(cfg, inner, ndims),
            annotate=annotate,
            stream_gradients=streamed,
            shared=shared,
            kept_gradients=kept,
        )


def lr_at(cfg: RunConfig, step: int) -> float:
    """The learning rate of step ``step`` (0-based): linear warmup over ``warmup_steps`` (never exactly 0), then
    cosine decay to ``min_lr_ratio * lr`` at ``train.steps`` (or constant)."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / (o.warmup_steps + 1)
    if o.schedule == "constant":
        return o.lr
    span = max(1, cfg.train.steps - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate (fused optimizers included)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def _tied(cfg: RunConfig) -> str | None:
    if not model_config(cfg).tie_embeddings:
        return None
    return (
        f"strategy.fused_optimizer=true cannot step the tied embedding of {cfg.model.name} (its gradient "
        f"arrives in two parts); set model.overrides.tie_embeddings=false, or strategy.fused_optimizer=false"
    )


def _not_with(key: str) -> Refusal:
    def message(cfg: RunConfig) -> str | None:
        on = cfg.strategy.offload.optimizer if key == "strategy.offload.optimizer" else cfg.strategy.offload.params
        if not on:
            return None
        return (
            f"strategy.fused_optimizer=true steps each parameter on the device inside the backward pass; it "
            f"cannot be combined with {key}=true. Use one or the other"
        )

    return Refusal(key, message)


def _fused(cfg: RunConfig, model: nn.Module, params: list[nn.Parameter], ndims: list[int]) -> torch.optim.Optimizer:
    from ...optim.fused import fuse_optimizer

    # Fused into the LM itself: a wrapper's second path to the same weights (the planner's stages) is not a tie.
    return fuse_optimizer(language_model(model), lambda ps: adamw(cfg, list(ps)))


FUSED = register(
    Piece(
        "fused_optimizer",
        lambda cfg: cfg.strategy.fused_optimizer,
        refuses=(
            Refusal("model.overrides.tie_embeddings", _tied),
            _not_with("strategy.offload.optimizer"),
            _not_with("strategy.offload.params"),
        ),
        optimizer=_fused,
    )
)
