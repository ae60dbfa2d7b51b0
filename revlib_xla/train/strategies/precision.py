"""The dtypes a step computes and keeps its weights in, and where the weights are split, as pieces.

* ``precision: bf16``: autocast to bfloat16 for the computation, float32 weights, gradients and optimizer state.
* ``param_dtype: bf16`` (with ``precision: bf16`` and ``offload.optimizer``): the device holds bfloat16 weights
  and gets bfloat16 gradients; float32 master weights and AdamW's state live in host memory, where the update
  runs, and the rounded weights go back (mixed precision as in ZeRO-Offload). Checkpoints hold the float32 masters.
* ``mesh`` (``chip.chips > 1``, an active SPMD mesh): the parameters split over the mesh once their values are
  written (:func:`revlib_xla.sharding.shard_model`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ... import backends
from ..config import RunConfig
from .base import Piece, ScopeFactory, StrategyError, Target, register

__all__ = ["PARAM_DTYPE", "MESH", "PRECISION"]


def _bf16_weights(cfg: RunConfig, lm: nn.Module, target: Target) -> nn.Module:
    if target.dtype is None:  # the weights only: the rotary tables stay float32
        for p in lm.parameters():
            p.data = p.data.to(torch.bfloat16)
    return lm


def _shard(cfg: RunConfig, lm: nn.Module, target: Target) -> nn.Module:
    """Under a mesh, split the parameters over it once their values are written: initialization and a dtype change
    give the parameters new tensors, which drops an earlier split (torch_xla). ``target.placed``: parameters
    initialised split already."""
    if target.mesh is not None:
        from ...sharding import shard_model

        shard_model(lm, target.mesh, target.placed)
    return lm


def _autocast(cfg: RunConfig, device: torch.device) -> ScopeFactory:
    kind = backends.backend_for(device).autocast_device_type
    if kind is None:
        raise StrategyError(f"strategy.precision=bf16: the {device.type} device has no autocast; use fp32")

    def scope() -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(device_type=str(kind), dtype=torch.bfloat16)

    return scope


PARAM_DTYPE = register(
    Piece(
        "param_dtype",
        lambda cfg: cfg.strategy.param_dtype == "bf16",
        weight_dtype=torch.bfloat16,
        convert=_bf16_weights,
    )
)
MESH = register(Piece("mesh", lambda cfg: True, convert=_shard))
PRECISION = register(Piece("precision", lambda cfg: cfg.strategy.precision == "bf16", step_scope=_autocast))
