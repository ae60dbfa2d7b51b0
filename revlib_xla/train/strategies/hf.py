"""``model.hf_config`` as a piece: a transformers model built by :func:`revlib_xla.hf.train.build_hf_lm` with the
run's strategy instead of the library's Llama, and the strategies it refuses (its own checks, bfloat16 weights,
a mesh)."""

from __future__ import annotations

from typing import cast

from torch import nn

from ..config import RunConfig
from .base import Piece, Refusal, StrategyError, Target, register
from .sizing import hf_call

__all__ = ["HF"]


def _hf_refused(cfg: RunConfig) -> str | None:
    try:
        hf_call(cfg, "check_hf_strategy")
    except StrategyError as exc:
        return str(exc)
    return None


def _bf16_weights(cfg: RunConfig) -> str | None:
    if cfg.strategy.param_dtype != "bf16":
        return None
    return (
        f"strategy.param_dtype=bf16 is not supported for a transformers model (model.hf_config="
        f"{cfg.model.hf_config}); use strategy.param_dtype=fp32 (with strategy.precision=bf16 for bf16 compute)"
    )


def _build(cfg: RunConfig, target: Target) -> nn.Module:
    if target.mesh is not None:
        raise StrategyError(
            f"model.hf_config={cfg.model.hf_config}: a transformers model is not split over a mesh (the sharding "
            f"rules know the models of revlib_xla.models); train it on one device (mesh all 1), or use "
            f"model.name=llama-*"
        )
    built = hf_call(cfg, "build_hf_lm", target.device, budget=target.budget, dtype=target.dtype, on_meta=target.on_meta)
    return cast(nn.Module, built)


HF = register(
    Piece(
        "model.hf_config",
        lambda cfg: cfg.model.hf_config is not None,
        refuses=(Refusal("strategy.*", _hf_refused), Refusal("strategy.param_dtype", _bf16_weights)),
        build=_build,
    )
)
