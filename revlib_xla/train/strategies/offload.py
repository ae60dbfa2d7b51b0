"""What lives in host memory instead of on the device, as pieces.

* ``offload.params``: parameters (and their gradients) live in host memory and are streamed to the device layer by
  layer (:class:`revlib_xla.OffloadModel`, as :class:`OffloadedLM`).
* ``offload.optimizer``: the optimizer state (and float32 master weights) in host memory, the update run there
  (:class:`revlib_xla.optim.HostOptimizer`, as :class:`~revlib_xla.train.strategies.optimizer.HostOptimizerState`);
  with ``offload.gradients`` each gradient goes to the host as the backward produces it, and each weight is
  stepped there as soon as its gradient is whole where the step allows it
  (:class:`revlib_xla.optim.gradient_stream.GradientStream`).
* ``offload.activations``: what autograd saves for the backward pass is kept in host memory
  (:func:`revlib_xla.memory_efficient_intermediates`).
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
from torch import Tensor, nn

from ... import backends
from ...losses import next_token_loss
from ...optim.fused import _shared_parameters
from ...optim.host import HostMemoryError
from ..config import RunConfig
from .base import Options, Piece, Refusal, ScopeFactory, StrategyError, Target, language_model, register
from .optimizer import HostOptimizerState, adamw

__all__ = ["OffloadedLM", "compute_device", "PARAMS", "OPTIMIZER", "ACTIVATIONS"]


class OffloadedLM(nn.Module):
    """The LM with its parameters in host memory, streamed to ``device`` one layer at a time
    (:class:`revlib_xla.OffloadModel` over ``lm.as_sequential()``); ``lm`` holds the weights (shared)."""

    def __init__(self, lm: nn.Module, device: torch.device, checkpoint: bool) -> None:
        super().__init__()
        from ...offload_model import OffloadModel

        self.lm = lm
        stages = cast(Any, lm).as_sequential()
        self.offloaded = OffloadModel(stages, device, "cpu", num_slices=len(stages), checkpoint_activation=checkpoint)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.offloaded(tokens)

    def loss(self, tokens: Tensor) -> Tensor:
        return next_token_loss(self(tokens), tokens)


def compute_device(model: nn.Module) -> torch.device:
    """Where ``model``'s step computes (for an offloaded model, not where its parameters are)."""
    if isinstance(model, OffloadedLM):
        return model.offloaded.device
    return next(model.parameters()).device


def _params_refused(cfg: RunConfig) -> str | None:
    s = cfg.strategy
    if s.activations in ("none", "checkpoint"):
        return None
    return (
        f"strategy.offload.params=true streams the plain model's layers from host memory (OffloadModel) and "
        f"cannot be combined with strategy.activations={s.activations}; use activations none or checkpoint with "
        f"it, or keep the parameters on the device (strategy.offload.params=false)"
    )


def _params_options(cfg: RunConfig, options: Options, target: Target) -> None:
    options["checkpoint"] = False  # OffloadModel checkpoints the streamed stages itself


def _stream(cfg: RunConfig, lm: nn.Module, target: Target) -> nn.Module:
    return OffloadedLM(lm, target.device, checkpoint=cfg.strategy.activations == "checkpoint")


def _host_optimizer(
    cfg: RunConfig, model: nn.Module, params: list[nn.Parameter], ndims: list[int]
) -> torch.optim.Optimizer:
    streamed = cfg.strategy.offload.gradients
    if backends.is_host_memory(params[0].device) and cfg.strategy.param_dtype == "fp32" and not streamed:
        return adamw(cfg, params, ndims)  # the state is in host memory already (bf16 weights still need masters)
    if streamed and backends.backend_for(params[0].device).lazy:
        raise StrategyError(
            f"strategy.offload.gradients=true takes each gradient when autograd accumulates it, which on "
            f"{params[0].device.type} happens while the step is traced, before any value exists; remove "
            f"strategy.offload.gradients (strategy.offload.optimizer=true alone brings the gradients to the host "
            f"after the backward)"
        )
    if streamed and _processes() > 1:
        raise StrategyError(
            "strategy.offload.gradients=true steps each gradient as this process's backward produces it, before "
            "data parallelism averages it across processes; remove strategy.offload.gradients under torchrun"
        )
    shared = _shared_parameters(language_model(model)) if streamed else {}
    try:
        return HostOptimizerState(cfg, params, annotate=False, ndims=ndims, shared=shared)
    except HostMemoryError as exc:
        raise StrategyError(
            f"strategy.offload.optimizer=true: {exc}. Use a host with more memory, a smaller model, or "
            f"strategy.offload.optimizer=false if the device holds the optimizer state"
            + (
                "; with strategy.offload.gradients=true and optim.grad_clip>0 every gradient waits on the host "
                "for the global norm: optim.grad_clip=0 steps each as it arrives"
                if streamed
                else ""
            )
        ) from None


def _processes() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _saved_on_host(cfg: RunConfig, device: torch.device) -> ScopeFactory:
    from ...intermediates import memory_efficient_intermediates

    def scope() -> contextlib.AbstractContextManager[Any]:
        return memory_efficient_intermediates(storage_device="cpu")

    return scope


PARAMS = register(
    Piece(
        "offload.params",
        lambda cfg: cfg.strategy.offload.params,
        refuses=(Refusal("strategy.activations", _params_refused),),
        weights_on_host=True,
        options=_params_options,
        convert=_stream,
    )
)
OPTIMIZER = register(Piece("offload.optimizer", lambda cfg: cfg.strategy.offload.optimizer, optimizer=_host_optimizer))
ACTIVATIONS = register(
    Piece("offload.activations", lambda cfg: cfg.strategy.offload.activations, step_scope=_saved_on_host)
)
