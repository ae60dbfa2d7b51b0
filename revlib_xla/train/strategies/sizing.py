"""What a run's model and chips are, before anything is built: the model's config and parameter count, the device,
the chip's HBM and peak FLOP/s (from :mod:`revlib_xla.chips`), the bytes each parameter holds on a chip under the
strategy, the planner's ``auto`` budget, and the processes FSDP2 shards over."""

from __future__ import annotations

import math
import os
from typing import Any, cast

import torch
from torch import nn

from ... import backends
from ...chips import CHIPS, GPU_CHIPS, TPU_CHIPS
from ..config import RunConfig
from .base import StrategyError

__all__ = [
    "resolve_device",
    "model_config",
    "hf_call",
    "chip_spec",
    "peak_flops",
    "weight_bytes_per_param",
    "optimizer_bytes_per_param",
    "state_bytes_per_param",
    "plan_budget",
    "param_count",
    "world_from_env",
    "fsdp2_world",
    "fsdp2_gathered_params",
    "params_per_chip",
    "flops_per_token",
]


def resolve_device(cfg: RunConfig) -> torch.device:
    """``train.device``: ``auto`` = a TPU through torch_xla if there is one, else a GPU, else the CPU."""
    kind = cfg.train.device
    if kind == "auto":
        return backends.default_device()
    if not backends.device_available(kind):
        raise StrategyError(f"train.device={kind!r}: this machine has no {kind} device; use train.device=auto or cpu")
    return backends.device_for(kind)


def hf_call(cfg: RunConfig, name: str, *args: Any, **kwargs: Any) -> Any:
    """``revlib_xla.hf.train.<name>(cfg, ...)`` (``model.hf_config``), its errors as :class:`StrategyError`. (The
    ``hf`` extra is imported only for a run that names a transformers model.)"""
    from ...hf import train as hf_train
    from ...hf.layers import HFConversionError

    try:
        return getattr(hf_train, name)(cfg, *args, **kwargs)
    except HFConversionError as exc:
        raise StrategyError(str(exc)) from None


def model_config(cfg: RunConfig) -> Any:
    """The ``LlamaConfig`` of ``model.name`` with ``model.overrides`` applied; with ``model.hf_config``, the
    transformers model's :class:`revlib_xla.hf.train.HFSpec` (vocabulary, parameters, FLOPs per token)."""
    if cfg.model.hf_config is not None:
        return hf_call(cfg, "hf_spec")
    from ...models.llama import llama_config

    return llama_config(cfg.model.name, **cfg.model.overrides)


def chip_spec(name: str) -> tuple[int, float]:
    """``(HBM bytes per chip, peak bf16 FLOP/s per chip)`` of the chip ``chip.name`` names."""
    chip = CHIPS.get(name)
    if chip is None:
        raise StrategyError(f"chip.name={name!r} is not a known chip; choose one of {', '.join(CHIPS)}")
    return int(chip.hbm_bytes), float(chip.peak_bf16_flops)


def peak_flops(cfg: RunConfig, device: torch.device) -> float | None:
    """The peak dense bf16 FLOP/s the run's MFU is measured against, of the chips it runs on: a TPU's from its
    runtime (``chip.name`` is what a run sizes for, not what it runs on), times ``chip.chips``; a GPU's from
    ``chip.name`` when that names a GPU, else from the device's own name; ``None`` (no MFU) on the CPU, XLA on the
    CPU or a device whose peak is not known."""
    generation = backends.tpu_generation(device)
    if generation is not None:
        tpu = TPU_CHIPS.get(generation)
        return None if tpu is None else float(tpu.peak_bf16_flops) * cfg.chip.chips
    identity = backends.device_name(device)
    if identity is None:  # the CPU, or a device that does not say what it is
        return None
    named = GPU_CHIPS.get(cfg.chip.name)
    if named is None:
        label, memory = identity[0].lower(), identity[1]
        big = memory > 48 * 2**30
        found = [c for key, c in GPU_CHIPS.items() if key.split("-")[0] in label.replace("-", " ").split()]
        named = next((c for c in found if len(found) == 1 or ("80gb" in c.name) == big), None)
    return None if named is None else float(named.peak_bf16_flops)


def weight_bytes_per_param(cfg: RunConfig) -> int:
    """Device bytes of a weight (and of its gradient): float32, or bfloat16 with ``param_dtype=bf16``."""
    return 2 if cfg.strategy.param_dtype == "bf16" else 4


def optimizer_bytes_per_param(cfg: RunConfig) -> int:
    """Device bytes of AdamW's two float32 moments per parameter; none when the optimizer state is offloaded."""
    return 0 if cfg.strategy.offload.optimizer else 8


def state_bytes_per_param(cfg: RunConfig) -> int:
    """Device bytes per parameter outside the activations: weight and gradient, and the optimizer state."""
    return 2 * weight_bytes_per_param(cfg) + optimizer_bytes_per_param(cfg)


def plan_budget(cfg: RunConfig) -> int:
    """The planner's budget in bytes per chip: ``strategy.budget``, or for ``auto`` the HBM of ``chip.name`` less
    the parameters, their gradients and the optimizer state (:func:`state_bytes_per_param`) one chip holds: over
    ``chip.chips > 1`` chips, each parameter's share of the config's mesh; under torchrun with FSDP2, its shard
    (:func:`params_per_chip`), and the whole weights FSDP2 gathers at once (:func:`fsdp2_gathered_params`)."""
    given = cfg.strategy.budget_bytes()
    if given is not None:
        return given
    hbm, _ = chip_spec(cfg.chip.name)
    held = params_per_chip(cfg) * state_bytes_per_param(cfg) + fsdp2_gathered_params(cfg) * weight_bytes_per_param(cfg)
    if held >= hbm:
        raise StrategyError(
            f"strategy.budget=auto: the parameters, gradients and optimizer state of {cfg.model.name} "
            f"({held / 2**30:.1f} GiB per chip) leave nothing of chip.name={cfg.chip.name}'s {hbm / 2**30:.1f} GiB for "
            f"activations; offload the optimizer state (strategy.offload.optimizer=true), a smaller model, or give "
            f"strategy.budget in bytes"
        )
    return hbm - held


def param_count(cfg: RunConfig) -> int:
    """The parameter count of ``cfg``'s model (tied weights once)."""
    spec = model_config(cfg)
    if cfg.model.hf_config is not None:
        return int(spec.num_params)
    from ...models.llama import num_params

    return num_params(spec)


def world_from_env() -> int:
    """The number of processes torchrun started (``WORLD_SIZE``; 1 outside torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise StrategyError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number of processes") from None


def fsdp2_world(cfg: RunConfig) -> int:
    """The processes FSDP2 shards the weights over: torchrun's ``WORLD_SIZE`` with ``strategy.data_parallel=fsdp2``
    (a model of ``revlib_xla.models``; transformers models are refused there), else 1."""
    if cfg.strategy.data_parallel != "fsdp2" or cfg.model.hf_config is not None:
        return 1
    return max(1, world_from_env())


def _meta_llama(cfg: RunConfig) -> nn.Module:
    from ...models.llama import build_llama

    with torch.device("meta"):
        return build_llama(model_config(cfg), "plain")


def fsdp2_gathered_params(cfg: RunConfig) -> int:
    """The parameters FSDP2 holds whole on each process at once, beyond its shards (0 without FSDP2): the root's
    (embedding, final norm, head: gathered for the forward and kept for the backward) and three blocks' worth (the
    block running, the next one prefetched, and a block's whole gradients before they are reduce-scattered)."""
    if fsdp2_world(cfg) == 1:
        return 0
    lm = _meta_llama(cfg)
    blocks = [sum(p.numel() for p in block.parameters()) for block in cast(nn.ModuleList, lm.layers)]
    return param_count(cfg) - sum(blocks) + 3 * max(blocks)


def params_per_chip(cfg: RunConfig) -> int:
    """The parameters one chip holds: all of them on one chip; over ``chip.chips > 1`` chips (SPMD over the
    config's ``mesh``), each parameter's share as :func:`revlib_xla.sharding.parameter_spec` splits it (a weight of
    the whole model's count split over fsdp x tensor is 1/(fsdp*tensor) per chip; what nothing divides stays
    whole); under torchrun with FSDP2 over ``W`` processes, each parameter's shard (``ceil(rows / W)`` of its
    first dimension, as FSDP2 pads it)."""
    world = fsdp2_world(cfg)
    if world > 1:
        return sum(-(-p.shape[0] // world) * (p.numel() // max(p.shape[0], 1)) for p in _meta_llama(cfg).parameters())
    if cfg.chip.chips == 1 or cfg.model.hf_config is not None:  # a transformers model is not split over a mesh
        return param_count(cfg)
    from ...sharding import parameter_spec, resolve_mesh

    mesh = resolve_mesh(cfg.mesh.axes(), cfg.chip.chips)
    lm = _meta_llama(cfg)
    return sum(
        p.numel() // math.prod(mesh.ways(entry) for entry in parameter_spec(name, p.shape, mesh))
        for name, p in lm.named_parameters()
    )


def flops_per_token(cfg: RunConfig) -> float:
    """Training FLOPs per token of ``cfg``'s model at ``data.seq_len`` (for MFU)."""
    spec = model_config(cfg)
    if cfg.model.hf_config is not None:
        return float(spec.train_flops_per_token(cfg.data.seq_len))
    from ...models.llama import train_flops_per_token

    return train_flops_per_token(spec, cfg.data.seq_len)
