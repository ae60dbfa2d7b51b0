"""The memory strategy of a training run: the model, the optimizer and the step that ``strategy.*`` asks for.

* ``activations``: ``none`` (plain autograd), ``checkpoint`` (each block under
  :func:`revlib_xla.backend.checkpoint`: ``torch.utils.checkpoint`` on eager devices, torch_xla's on XLA),
  ``reversible`` / ``momentum`` (the LM's two-stream reversible and MomentumNet forms, activations rebuilt in the
  backward pass), ``plan`` (:class:`revlib_xla.Checkpointable` over the LM's stages with the fastest schedule that
  fits ``budget`` bytes; ``auto`` = the chip's HBM less the parameters, gradients and optimizer state).
* ``exact`` (``reversible`` and ``momentum``): the two residual streams as fixed-point integers, so the backward
  rebuilds every layer's input bit for bit (true, the default: :mod:`revlib_xla.fixed_point`, 8 bytes per stream
  element), or as floating-point numbers checked by the backward's rebuild check (false: the bytes of the
  activations' dtype, and a refusal where the rebuilt input is off).
* ``fewbit``: the MLP activation's derivative stored in that many bits (:mod:`revlib_xla.fewbit`).
* ``offload.params``: parameters (and their gradients) live in host memory and are streamed to the device layer by
  layer (:class:`revlib_xla.OffloadModel`); ``offload.optimizer``: the optimizer state in host memory (see
  :class:`HostOptimizerState`); ``offload.activations``: what autograd saves for the backward pass is kept in host
  memory (:func:`revlib_xla.memory_efficient_intermediates`).
* ``fused_optimizer``: each parameter updated inside the backward pass as soon as its gradient is complete
  (:func:`revlib_xla.fuse_optimizer`).
* ``precision: bf16``: autocast to bfloat16 for the computation, float32 weights, gradients and optimizer state.
* ``param_dtype: bf16`` (with ``precision: bf16`` and ``offload.optimizer``): the device holds bfloat16 weights
  and gets bfloat16 gradients; float32 master weights and AdamW's state live in host memory, where the update
  runs, and the rounded weights go back (mixed precision as in ZeRO-Offload). Checkpoints hold the float32 masters.
* ``loss_chunk``: the LM head and cross entropy run over chunks of that many positions, each chunk's logits
  recomputed in the backward pass, so no whole ``(batch, seq, vocab)`` logits tensor is ever alive
  (:func:`revlib_xla.models.llama.chunked_next_token_loss`); ``auto``: on (:data:`AUTO_LOSS_CHUNK`) for the
  reversible and momentum forms on one chip, off for the torch_xla baselines (``none``, ``checkpoint``), over a
  mesh of several chips, and where the logits come out of a wrapper (``plan``, ``offload.params``,
  ``model.hf_config``), which refuse an explicit value.

Combinations the library cannot run correctly raise :class:`StrategyError` naming the keys and what to use instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Collection, Iterator
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn

from .. import backend
from ..reversible import ReversibleError
from .config import RunConfig

__all__ = [
    "StrategyError",
    "PlannedLM",
    "OffloadedLM",
    "HostOptimizerState",
    "resolve_device",
    "model_config",
    "build_model",
    "language_model",
    "compute_device",
    "build_optimizer",
    "layer_ndims",
    "make_step",
    "StepReport",
    "lr_at",
    "set_lr",
    "LanguageModel",
    "lm_loss",
    "state_bytes_per_param",
    "weight_bytes_per_param",
    "optimizer_bytes_per_param",
    "plan_budget",
    "param_count",
    "params_per_chip",
    "flops_per_token",
    "loss_chunk",
    "AUTO_LOSS_CHUNK",
]

AUTO_LOSS_CHUNK = 256
"""Positions per chunk of ``strategy.loss_chunk=auto`` where it is on: at Llama's vocabulary (128256) a chunk's
float32 logits are 125 MiB per sequence, against 1 GiB for 2048 positions; 2048 positions make 8 chunks whatever the
batch, so the traced graph does not grow with the batch."""

# Chips the run may target, until revlib_xla.fit.chips is merged: (HBM bytes per chip, peak dense bf16 FLOP/s).
_CHIPS: dict[str, tuple[int, float]] = {
    "v4": (32 * 2**30, 275e12),
    "v5e": (16 * 10**9, 197e12),
    "v5p": (95 * 2**30, 459e12),
    "v6e": (32 * 10**9, 918e12),
    "h100": (80 * 10**9, 989e12),
    "a100-40gb": (40 * 10**9, 312e12),
    "a100-80gb": (80 * 10**9, 312e12),
    "l4": (24 * 10**9, 121e12),
    "t4": (16 * 10**9, 65e12),
}


class LanguageModel(Protocol):
    """What the loop needs of a model: the next-token loss of a ``(B, T)`` token batch."""

    def loss(self, tokens: Tensor) -> Tensor: ...


def lm_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """``model.loss(tokens)``: the LMs and the wrappers here all have it."""
    return cast(LanguageModel, model).loss(tokens)


class StrategyError(ValueError):
    """A combination of ``strategy.*`` (or model) settings the library cannot run correctly; the message names the
    keys and what to use instead."""


def chip_spec(name: str) -> tuple[int, float]:
    """``(HBM bytes per chip, peak bf16 FLOP/s per chip)`` of the chip ``chip.name`` names."""
    try:
        from ..fit.chips import CHIPS  # type: ignore[import-not-found,unused-ignore]

        chip = CHIPS[name]
        return int(chip.hbm_bytes), float(chip.peak_bf16_flops)
    except (ImportError, KeyError):
        pass
    if name not in _CHIPS:
        raise StrategyError(f"chip.name={name!r} is not a known chip; choose one of {', '.join(_CHIPS)}")
    return _CHIPS[name]


def peak_flops(cfg: RunConfig, device: torch.device) -> float | None:
    """The peak dense bf16 FLOP/s the run's MFU is measured against, of the chips it runs on: a TPU's from its
    runtime (``chip.name`` is what a run sizes for, not what it runs on), times ``chip.chips``; a GPU's from
    ``chip.name`` when that names a GPU, else from the device's own name; ``None`` (no MFU) on the CPU, XLA on the
    CPU or a device whose peak is not known."""
    try:
        from ..fit.chips import GPU_CHIPS, TPU_CHIPS  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    generation = backend.tpu_generation(device)
    if generation is not None:
        tpu = TPU_CHIPS.get(generation)
        return None if tpu is None else float(tpu.peak_bf16_flops) * cfg.chip.chips
    identity = backend.device_name(device)
    if identity is None:  # the CPU, or a device that does not say what it is
        return None
    named = GPU_CHIPS.get(cfg.chip.name)
    if named is None:
        label, memory = identity[0].lower(), identity[1]
        big = memory > 48 * 2**30
        found = [c for key, c in GPU_CHIPS.items() if key.split("-")[0] in label.replace("-", " ").split()]
        named = next((c for c in found if len(found) == 1 or ("80gb" in c.name) == big), None)
    return None if named is None else float(named.peak_bf16_flops)


def resolve_device(cfg: RunConfig) -> torch.device:
    """``train.device``: ``auto`` = a TPU through torch_xla if there is one, else a GPU, else the CPU."""
    kind = cfg.train.device
    if kind == "auto":
        return backend.default_device()
    if not backend.device_available(kind):
        raise StrategyError(f"train.device={kind!r}: this machine has no {kind} device; use train.device=auto or cpu")
    return backend.device_for(kind)


def model_config(cfg: RunConfig) -> Any:
    """The ``LlamaConfig`` of ``model.name`` with ``model.overrides`` applied; with ``model.hf_config``, the
    transformers model's :class:`revlib_xla.hf.train.HFSpec` (vocabulary, parameters, FLOPs per token)."""
    if cfg.model.hf_config is not None:
        return _hf_call(cfg, "hf_spec")
    from ..models.llama import llama_config

    return llama_config(cfg.model.name, **cfg.model.overrides)


def check_strategy(cfg: RunConfig) -> None:
    """Raise :class:`StrategyError` for a combination that cannot run correctly."""
    s = cfg.strategy
    lm = model_config(cfg)
    if cfg.model.hf_config is not None:
        _hf_call(cfg, "check_hf_strategy")
    if s.offload.params and s.activations not in ("none", "checkpoint"):
        raise StrategyError(
            f"strategy.offload.params=true streams the plain model's layers from host memory (OffloadModel) and "
            f"cannot be combined with strategy.activations={s.activations}; use activations none or checkpoint with "
            f"it, or keep the parameters on the device (strategy.offload.params=false)"
        )
    if cfg.model.hf_config is not None and s.param_dtype == "bf16":
        raise StrategyError(
            f"strategy.param_dtype=bf16 is not supported for a transformers model (model.hf_config="
            f"{cfg.model.hf_config}); use strategy.param_dtype=fp32 (with strategy.precision=bf16 for bf16 compute)"
        )
    if isinstance(s.loss_chunk, int) and s.loss_chunk > 0:
        wrapped = [
            key
            for key, on in (
                ("strategy.activations=plan", s.activations == "plan"),
                ("strategy.offload.params=true", s.offload.params),
                (f"model.hf_config={cfg.model.hf_config}", cfg.model.hf_config is not None),
            )
            if on
        ]
        if wrapped:
            raise StrategyError(
                f"strategy.loss_chunk={s.loss_chunk}: with {wrapped[0]} the logits come out of the wrapped model "
                f"whole, so the loss cannot be chunked; set strategy.loss_chunk=0 (or auto), or use "
                f"strategy.activations=reversible, momentum, checkpoint or none"
            )
    if s.fused_optimizer:
        if lm.tie_embeddings:
            raise StrategyError(
                f"strategy.fused_optimizer=true cannot step the tied embedding of {cfg.model.name} (its gradient "
                f"arrives in two parts); set model.overrides.tie_embeddings=false, or strategy.fused_optimizer=false"
            )
        for key, on in (
            ("strategy.offload.optimizer", s.offload.optimizer),
            ("strategy.offload.params", s.offload.params),
        ):
            if on:
                raise StrategyError(
                    f"strategy.fused_optimizer=true steps each parameter on the device inside the backward pass; it "
                    f"cannot be combined with {key}=true. Use one or the other"
                )


# ----------------------------------------------------------------------------------------------------------------
# Models


class PlannedLM(nn.Module):
    """The LM run by the planner (:class:`revlib_xla.Checkpointable` over ``lm.as_sequential()``), measured and
    planned on a sample batch when built (else at the first training step); ``lm`` holds the weights (shared)."""

    def __init__(
        self,
        lm: nn.Module,
        budget: int,
        tpu_generation: str | None,
        sample: Tensor | None = None,
        autocast: str | None = None,
    ) -> None:
        super().__init__()
        from ..planner.checkpointable import Checkpointable

        self.lm = lm
        self.planned = Checkpointable(cast(Any, lm).as_sequential(), mem_limit=budget, tpu_generation=tpu_generation)
        self.autocast = autocast
        self._loss_sized: tuple[tuple[int, ...], torch.dtype | None] | None = None  # what loss_transient sized
        if sample is not None:
            self.plan(sample)

    def plan(self, sample: Tensor) -> None:
        """Measure the stages on ``sample`` (a token batch of the step's shape) and plan now, before an optimizer is
        fused into the backward (the measurement's backward passes would step it); under autocast to bfloat16 on
        the ``autocast`` device type where the step runs so (``strategy.precision=bf16``): the activations the step
        keeps are bfloat16, half what a float32 measurement finds."""
        from ..planner.solver import InfeasibleBudget

        try:
            with torch.autocast(device_type=self.autocast or "cpu", dtype=torch.bfloat16, enabled=bool(self.autocast)):
                self.planned.loss_tmp_memory_usage = self.loss_transient(sample)
                self._loss_sized = (tuple(sample.shape), self._autocast_now())
                self.planned.measure(sample)
            self.planned.compute_sequence()
        except InfeasibleBudget as exc:
            raise StrategyError(f"{exc.naming('strategy.budget')}, or use strategy.budget=auto") from None
        for p in self.parameters():
            p.grad = None

    def loss_transient(self, sample: Tensor) -> int:
        """The transient memory of :meth:`loss` on the logits of ``sample`` (a token batch of the step's shape), the
        chain's loss stage (rotor's ``loss_tmp_memory_usage``): what the cross entropy's forward and backward hold at
        their peak besides the logits and their gradient, which the plan counts already. At Llama's vocabulary this
        is several times the logits (their float32 copy and log-probabilities, and those gradients); a plan that took
        it as 0 peaked above its budget there. Measured on an eager device (:class:`revlib_xla.memory.StorageTracker`);
        0 on XLA, where the compiled stages' sizes stand for it."""
        from ..memory import StorageTracker
        from ..models.llama import next_token_loss

        if backend.is_tracing_lazily(sample):
            return 0
        head = cast(Any, self.lm).config
        dtype = self._autocast_now()
        weight = next(self.lm.parameters())
        logits = torch.zeros(
            (*sample.shape, head.vocab_size), dtype=dtype or weight.dtype, device=sample.device, requires_grad=True
        )
        tracker = StorageTracker()
        tracker.track(logits, sample)
        with tracker, torch.enable_grad():
            start = tracker.current(sample.device)
            next_token_loss(logits, sample).backward()
            peak = tracker.peak(sample.device)
        return max(0, peak - start - logits.numel() * logits.element_size())

    def forward(self, tokens: Tensor) -> Tensor:
        sized = (tuple(tokens.shape), self._autocast_now())
        if self.training and torch.is_grad_enabled() and self._loss_sized != sized:
            # measured at this call (built on meta, or another batch shape): the loss stage is sized first
            self.planned.loss_tmp_memory_usage = self.loss_transient(tokens)
            self._loss_sized = sized
        return self.planned(tokens)

    def _autocast_now(self) -> torch.dtype | None:
        """The dtype autocast computes in on the LM's device now, or None where it is off."""
        kind = backend.backend_for(next(self.lm.parameters()).device).autocast_device_type
        return torch.get_autocast_dtype(kind) if kind and torch.is_autocast_enabled(kind) else None

    def loss(self, tokens: Tensor) -> Tensor:
        from ..models.llama import next_token_loss

        return next_token_loss(self(tokens), tokens)


class OffloadedLM(nn.Module):
    """The LM with its parameters in host memory, streamed to ``device`` one layer at a time
    (:class:`revlib_xla.OffloadModel` over ``lm.as_sequential()``); ``lm`` holds the weights (shared)."""

    def __init__(self, lm: nn.Module, device: torch.device, checkpoint: bool) -> None:
        super().__init__()
        from ..offload_model import OffloadModel

        self.lm = lm
        stages = cast(Any, lm).as_sequential()
        self.offloaded = OffloadModel(stages, device, "cpu", num_slices=len(stages), checkpoint_activation=checkpoint)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.offloaded(tokens)

    def loss(self, tokens: Tensor) -> Tensor:
        from ..models.llama import next_token_loss

        return next_token_loss(self(tokens), tokens)


def language_model(model: nn.Module) -> nn.Module:
    """The LM inside ``model`` (the module whose weights a checkpoint saves): a wrapper's ``lm``, else ``model``."""
    inner = getattr(model, "lm", None)
    return inner if isinstance(inner, nn.Module) else model


def compute_device(model: nn.Module) -> torch.device:
    """Where ``model``'s step computes (for an offloaded model, not where its parameters are)."""
    if isinstance(model, OffloadedLM):
        return model.offloaded.device
    return next(model.parameters()).device


def weight_bytes_per_param(cfg: RunConfig) -> int:
    """Device bytes of a weight (and of its gradient): float32, or bfloat16 with ``param_dtype=bf16``."""
    return 2 if cfg.strategy.param_dtype == "bf16" else 4


def optimizer_bytes_per_param(cfg: RunConfig) -> int:
    """Device bytes of AdamW's two float32 moments per parameter; none when the optimizer state is offloaded."""
    return 0 if cfg.strategy.offload.optimizer else 8


def state_bytes_per_param(cfg: RunConfig) -> int:
    """Device bytes per parameter outside the activations: weight and gradient, and the optimizer state."""
    return 2 * weight_bytes_per_param(cfg) + optimizer_bytes_per_param(cfg)


def loss_chunk(cfg: RunConfig, sharded: bool = False) -> int:
    """Positions per chunk of the LM's loss (``strategy.loss_chunk``; 0 = the whole logits tensor at once).
    ``auto`` stays off for a step split over several chips (``chip.chips > 1`` or ``sharded``: an active mesh),
    where chunking has not been measured yet; an explicit value applies there too."""
    s = cfg.strategy
    if s.loss_chunk != "auto":
        return int(s.loss_chunk)
    chunked = s.activations in ("reversible", "momentum") and not s.offload.params and cfg.model.hf_config is None
    return AUTO_LOSS_CHUNK if chunked and cfg.chip.chips == 1 and not sharded else 0


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


def _hf_call(cfg: RunConfig, name: str, *args: Any, **kwargs: Any) -> Any:
    """``revlib_xla.hf.train.<name>(cfg, ...)`` (``model.hf_config``), its errors as :class:`StrategyError`."""
    from ..hf import train as hf_train
    from ..hf.layers import HFConversionError

    try:
        return getattr(hf_train, name)(cfg, *args, **kwargs)
    except HFConversionError as exc:
        raise StrategyError(str(exc)) from None


def param_count(cfg: RunConfig) -> int:
    """The parameter count of ``cfg``'s model (tied weights once)."""
    spec = model_config(cfg)
    if cfg.model.hf_config is not None:
        return int(spec.num_params)
    from ..models.llama import num_params

    return num_params(spec)


def fsdp2_world(cfg: RunConfig) -> int:
    """The processes FSDP2 shards the weights over: torchrun's ``WORLD_SIZE`` with ``strategy.data_parallel=fsdp2``
    (a model of ``revlib_xla.models``; transformers models are refused there), else 1."""
    if cfg.strategy.data_parallel != "fsdp2" or cfg.model.hf_config is not None:
        return 1
    from .distributed import world_from_env

    return max(1, world_from_env())


def _meta_llama(cfg: RunConfig) -> nn.Module:
    from ..models.llama import build_llama

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
    from ..sharding import parameter_spec, resolve_mesh

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
    from ..models.llama import train_flops_per_token

    return train_flops_per_token(spec, cfg.data.seq_len)


def _shard_under_mesh(lm: nn.Module, device: torch.device, placed: Collection[int] = ()) -> None:
    """Under a mesh over ``device`` (:func:`revlib_xla.sharding.apply_mesh`), split the parameters over it, once
    their values are written: initialization and a dtype change give the parameters new tensors, which drops an
    earlier split (torch_xla). ``placed``: parameters initialised split already."""
    from ..sharding import active_mesh, shard_model

    mesh = active_mesh(device)
    if mesh is not None:
        shard_model(lm, mesh, placed)


def build_model(
    cfg: RunConfig, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """The LM of ``cfg.model`` with the activation strategy and few-bit activations applied, on ``device`` (default
    :func:`resolve_device`; parameters stay in host memory with ``offload.params``). It is built on the meta device
    and materialised where it runs, with weights drawn from ``train.seed`` on the host, so every device starts from
    the same weights; ``"meta"`` builds it without allocating anything (any size). The result has
    ``forward(tokens) -> logits`` and ``loss(tokens)``. ``dtype``: the weights' dtype (default float32; float64 to
    check a strategy's gradients exactly)."""
    from ..models.llama import build_llama

    check_strategy(cfg)
    s = cfg.strategy
    target = backend.as_device(device) if device is not None else resolve_device(cfg)
    form = s.activations if s.activations in ("reversible", "momentum") else "plain"
    checkpoint = s.activations == "checkpoint" and not s.offload.params
    on_meta = not backend.backend_for(target).holds_data
    budget = plan_budget(cfg) if s.activations == "plan" else 0  # refused before anything is allocated
    if cfg.model.hf_config is not None:
        from ..sharding import active_mesh

        if active_mesh(target) is not None:
            raise StrategyError(
                f"model.hf_config={cfg.model.hf_config}: a transformers model is not split over a mesh (the sharding "
                f"rules know the models of revlib_xla.models); train it on one device (mesh all 1), or use "
                f"model.name=llama-*"
            )
        return cast(nn.Module, _hf_call(cfg, "build_hf_lm", target, budget=budget, dtype=dtype, on_meta=on_meta))
    from ..sharding import ShardedWriter, active_mesh, planning_budget

    chunk = loss_chunk(cfg, sharded=active_mesh(target) is not None)
    with torch.device("meta"):  # built without allocating, then materialised where it runs
        stack: dict[str, Any] = {"scan": None} if cfg.model.scan else {}  # None: an XLA loop, else layer by layer
        if form != "plain":  # exact: None, the library's fixed-point streams (float64 weights keep float64 ones)
            stack["exact"] = None if s.exact else False
        try:
            lm = build_llama(model_config(cfg), form, checkpoint=checkpoint, beta=s.beta, loss_chunk=chunk, **stack)
        except ReversibleError as exc:
            if not cfg.model.scan:
                raise
            raise StrategyError(
                f"model.scan=true: {exc}. With this config: model.overrides.n_layers=2 or more, or model.scan=false"
            ) from None
    write: ShardedWriter | None = None
    if not on_meta:
        lm.to_empty(device="cpu" if s.offload.params else target)
        mesh = active_mesh(target)  # under a mesh, each device receives only its piece of each weight
        final = dtype or (torch.bfloat16 if s.param_dtype == "bf16" else None)
        write = None if mesh is None or s.offload.params else ShardedWriter(lm, mesh, final)
        lm.init_weights(cfg.train.seed, write)  # drawn on the host from the seed: the same weights on every device
    if dtype is not None:
        lm.to(dtype)
    elif s.param_dtype == "bf16":  # the weights only: the rotary tables stay float32
        for p in lm.parameters():
            p.data = p.data.to(torch.bfloat16)
    _shard_under_mesh(lm, target, () if write is None else write.placed)
    if s.fewbit:
        from ..fewbit import convert_activation
        from ..fewbit.conversion import map_module

        map_module(lm, lambda m: convert_activation(m, bits=s.fewbit) if isinstance(m, nn.SiLU) else m)
    if s.offload.params:
        return OffloadedLM(lm, target, checkpoint=s.activations == "checkpoint")
    if s.activations == "plan":
        from ..compiled.worker import TPU_GENERATIONS

        generation = cfg.chip.name if cfg.chip.name in TPU_GENERATIONS else None
        micro_batch = cfg.data.batch_size // cfg.optim.grad_accum_steps
        sample = torch.zeros(micro_batch, cfg.data.seq_len, dtype=torch.long, device=target)
        budget = planning_budget(budget, active_mesh(target))  # measured on the whole batch: see there
        autocast = backend.backend_for(target).autocast_device_type if s.precision == "bf16" else None
        return PlannedLM(lm, budget, generation, sample=None if on_meta else sample, autocast=autocast)
    return lm


# ----------------------------------------------------------------------------------------------------------------
# Optimizer


def layer_ndims(model: nn.Module) -> dict[int, int]:
    """``id(parameter)`` -> the dimensions of what one layer holds of it: a stacked parameter
    (:func:`revlib_xla.scan.stack_layers`, ``[layers, ...]``) has one fewer per layer than it has, any other its
    own. What the weight-decay rule looks at, so a stacked norm scale (``[layers, dim]``) is not taken for a
    matrix."""
    from ..reversible import layer_shape

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


def _adamw(cfg: RunConfig, params: list[nn.Parameter], ndims: list[int] | None = None) -> torch.optim.Optimizer:
    """AdamW of ``optim.*`` over ``params`` (``ndims``: their dimensions per layer; default their own)."""
    o = cfg.optim
    ndims = [p.ndim for p in params] if ndims is None else ndims
    return torch.optim.AdamW(_groups(params, o.weight_decay, ndims), lr=o.lr, betas=o.betas, eps=o.eps)


class HostOptimizerState(torch.optim.Optimizer):
    """AdamW whose state (and float32 master weights) live in host memory (``strategy.offload.optimizer``).

    Two ways to keep the state in host memory:

    * host step (what :func:`build_optimizer` uses on every device, as ZeRO-Offload does): the optimizer runs on the
      CPU over host master copies of the parameters (page-locked where the backend can copy from them
      asynchronously); each step brings the gradients to the host and the updated weights back, one weight at a
      time. The state never occupies device memory. On a lazy device (XLA) the step first runs the pending graph
      (forward and backward, :func:`revlib_xla.backend.sync`), so the device program is the forward and backward
      producing gradients, and the weights come back as new device data.
    * ``annotate`` (XLA, by request only): the state stays a graph value annotated to live in host memory between
      steps (:func:`revlib_xla.backend.place_on_host`). The TPU compiler rejects such a step (an output moved to
      host is returned without a host layout), and torch_xla has no host-resident graph arguments, so the state
      would come back into HBM as an argument anyway; kept to show the annotations.

    :meth:`device_part_only` runs the device part of the host step alone (how :func:`revlib_xla.fit.trace_step`
    sizes it without running anything); :meth:`host_state_bytes` is the host memory the state and master copies
    take.
    """

    def __init__(
        self, cfg: RunConfig, params: list[nn.Parameter], annotate: bool, ndims: list[int] | None = None
    ) -> None:
        self.device_params = params
        self.annotate = annotate
        self._deferred: list[list[Tensor]] = []
        self._sums: list[Tensor | None] = [None] * len(params)  # float32 sums of micro-batch gradients (host)
        if annotate:
            self.inner = _adamw(cfg, params, ndims)
        else:
            # Filled from the device weights at the first step (or by load_state_dict): nothing is copied when the
            # step is only traced for sizing, and weights loaded after the optimizer was built are the ones used.
            self.host = [nn.Parameter(torch.empty(p.shape, dtype=_master_dtype(p.dtype))) for p in params]
            self._filled = False
            for h, p in zip(self.host, params):
                backend.pin_host_tensor_(h, p.device)
            self.inner = _adamw(cfg, self.host, [p.ndim for p in params] if ndims is None else ndims)
        self.defaults = self.inner.defaults
        self.param_groups = self.inner.param_groups  # schedulers and set_lr reach the inner groups
        self.state = self.inner.state
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    def _move_state(self, move: Callable[[Tensor], Tensor]) -> None:
        for state in self.inner.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor) and key != "step":
                    state[key] = move(value)

    @contextlib.contextmanager
    def device_part_only(self) -> Iterator[list[Tensor]]:
        """Within the block, :meth:`step` of the host step does only its device part: the gradients it would
        bring to the host are appended to the yielded list (still pending on the device), and nothing is run,
        copied or updated. (``annotate``: the whole step is the device's; nothing is sent.)"""
        sent: list[Tensor] = []
        self._deferred.append(sent)
        try:
            yield sent
        finally:
            self._deferred.pop()

    def host_state_bytes(self) -> int:
        """Host bytes of the master weights and the optimizer state (AdamW: two moments per weight, four with
        amsgrad's maximum), whether or not a step has created the state yet. The step adds one weight's gradient
        in the master's dtype at a time (the largest: :meth:`host_step_bytes`)."""
        if self.annotate:
            return 0
        moments = 3 if self.defaults.get("amsgrad") else 2
        return sum(h.numel() * h.element_size() * (1 + moments) for h in self.host)

    def host_step_bytes(self) -> int:
        """Host bytes the step needs beside :meth:`host_state_bytes`: the largest weight's gradient, brought to the
        host in the master's dtype (the weights are stepped one at a time)."""
        return max((h.numel() * h.element_size() for h in getattr(self, "host", [])), default=0)

    @property
    def accumulates_on_host(self) -> bool:
        """Whether micro-batch gradients are summed on the host (:meth:`accumulate`): the device gradients are
        narrower than the masters (bfloat16), and a sum in their dtype would round at every addition."""
        return not self.annotate and any(h.dtype != p.dtype for h, p in zip(self.host, self.device_params))

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add the device gradients to their float32 sums on the host and free them (after each micro-batch's
        backward; :meth:`step` steps with the sums). Traced for sizing (:meth:`device_part_only`): nothing."""
        if self._deferred:
            return
        grads = [p.grad for p in self.device_params]
        if self.device_params and backend.backend_for(self.device_params[0].device).lazy:
            backend.sync(self.device_params[0].device)
        for i, (h, p, g) in enumerate(zip(self.host, self.device_params, grads)):
            if g is not None:
                grad = backend.to_host_blocking(g.detach(), "cpu").to(h.dtype)
                total = self._sums[i]
                self._sums[i] = grad if total is None else total.add_(grad)
                p.grad = None

    def clip_grad_norm_(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        """Clip by the global norm the gradients :meth:`step` will use: the host sums where :meth:`accumulate`
        made them, else ``params``' device gradients. Returns the norm before clipping."""
        if not any(s is not None for s in self._sums):
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        for h, total in zip(self.host, self._sums):
            h.grad = total
        try:
            return torch.nn.utils.clip_grad_norm_(self.host, max_norm)  # scales the sums in place
        finally:
            for h in self.host:
                h.grad = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.annotate:
            self._move_state(lambda t: backend.place_on_device(t))
            out = self.inner.step(closure)
            self._move_state(lambda t: backend.place_on_host(t))
            return out
        grads = [p.grad for p in self.device_params]
        if self._deferred:
            self._deferred[-1].extend(g for g in grads if g is not None)
            return None
        if self.device_params and backend.backend_for(self.device_params[0].device).lazy:
            backend.sync(self.device_params[0].device)  # one program: forward and backward (and the loss)
        if not self._filled:
            self._copy_from_device()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # One weight at a time: AdamW steps only the weights that have a gradient, so the host holds one float32
        # gradient beside the masters and state (llama-3b: 1.5 GiB for the embedding, not 12 GiB for all).
        for i, (h, p, g) in enumerate(zip(self.host, self.device_params, grads)):
            total, self._sums[i] = self._sums[i], None
            if g is None and total is None:
                continue
            grad = None if g is None else backend.to_host_blocking(g.detach(), "cpu").to(h.dtype)
            h.grad = total if grad is None else grad if total is None else total.add_(grad)
            self.inner.step()
            h.grad = None
            p.copy_(h, non_blocking=False)
        return loss

    def _copy_from_device(self) -> None:
        with torch.no_grad():
            for h, p in zip(self.host, self.device_params):
                h.copy_(p)
        self._filled = True

    def master_weights(self) -> list[tuple[Tensor, Tensor]]:
        """``(device parameter, host master weight)`` pairs whose master is more precise than the device weight
        (float32 masters of bfloat16 weights), once the masters hold the weights (after the first step or a
        restore): what a checkpoint saves instead of the rounded device weights."""
        if self.annotate or not self._filled:
            return []
        return [(p, h) for p, h in zip(self.device_params, self.host) if h.dtype != p.dtype]

    def load_master_weights(self, values: dict[int, Tensor]) -> None:
        """Set the masters of the device parameters in ``values`` (``id(parameter)`` -> the saved float32
        weight) exactly, and the device weights to their rounding; other masters are copied from the device."""
        if self.annotate:
            return
        if not self._filled:
            self._copy_from_device()
        with torch.no_grad():
            for h, p in zip(self.host, self.device_params):
                if id(p) in values and h.dtype != p.dtype:
                    h.copy_(values[id(p)])
                    p.copy_(h)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.device_params:
            p.grad = None
        self._sums = [None] * len(self.device_params)
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        # torch replaces the groups and the state: what set_lr and the tracer reach must be the new ones
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        if not self.annotate:  # the master copies follow the restored weights
            self._copy_from_device()


def _master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a host master weight: float32 for a half-precision device weight, else the weight's own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def build_optimizer(cfg: RunConfig, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters (weight decay on matrices only), fused into the backward pass
    with ``strategy.fused_optimizer``, with its state in host memory with ``strategy.offload.optimizer``."""
    params = [p for p in model.parameters() if p.requires_grad]
    per_layer = layer_ndims(model)
    ndims = [per_layer[id(p)] for p in params]
    if cfg.strategy.fused_optimizer:
        from ..fused_optimizer import fuse_optimizer

        # Fused into the LM itself: a wrapper's second path to the same weights (the planner's stages) is not a tie.
        return fuse_optimizer(language_model(model), lambda ps: _adamw(cfg, list(ps)))
    if cfg.strategy.offload.optimizer:
        if backend.is_host_memory(params[0].device) and cfg.strategy.param_dtype == "fp32":
            return _adamw(cfg, params, ndims)  # the state is in host memory already (bf16 weights still need masters)
        return HostOptimizerState(cfg, params, annotate=False, ndims=ndims)
    return _adamw(cfg, params, ndims)


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


# ----------------------------------------------------------------------------------------------------------------
# The step


@dataclasses.dataclass
class StepReport:
    """What the last call of a :func:`make_step` step reports beside its loss."""

    grad_norm: Tensor | None = None
    """The global gradient norm before clipping (0-d, on the device), where the step computed one: with
    ``optim.grad_clip`` or ``train.nonfinite=skip``; else ``None``."""
    skipped: bool = False
    """``train.nonfinite=skip``: the loss or the gradient norm was NaN or inf, and the update was not applied."""


def make_step(
    cfg: RunConfig, model: nn.Module, optimizer: torch.optim.Optimizer, report: StepReport | None = None
) -> Callable[[Tensor], Tensor]:
    """One training step on a ``(B, T)`` token batch: forward and backward (over ``optim.grad_accum_steps``
    micro-batches), gradient clipping by the global norm (``optim.grad_clip``), the optimizer step, gradients
    freed; returns the mean loss (a 0-d tensor on the device). bf16 precision runs under autocast. On XLA it does not
    sync: the caller cuts the step (:func:`revlib_xla.backend.sync`). With ``train.nonfinite=skip`` the step reads
    the loss and the gradient norm on the host before the update (a sync) and drops the gradients instead of
    stepping when either is NaN or inf. ``report`` (if given) receives the gradient norm and whether the update was
    skipped."""
    from ..sharding import shard_batch

    s = cfg.strategy
    device = compute_device(model)
    autocast_type = backend.backend_for(device).autocast_device_type
    if s.precision == "bf16" and autocast_type is None:
        raise StrategyError(f"strategy.precision=bf16: the {device.type} device has no autocast; use fp32")
    params = [p for p in model.parameters() if p.requires_grad]
    accum = cfg.optim.grad_accum_steps
    clip = cfg.optim.grad_clip
    skip = cfg.train.nonfinite == "skip"  # (refused with strategy.fused_optimizer by the config)
    report = report if report is not None else StepReport()
    # bfloat16 device gradients are summed over micro-batches in float32 on the host, not rounded at each addition
    host = optimizer if isinstance(optimizer, HostOptimizerState) and optimizer.accumulates_on_host else None

    def scope() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if s.precision == "bf16":
            stack.enter_context(torch.autocast(device_type=str(autocast_type), dtype=torch.bfloat16))
        if s.offload.activations:
            from ..intermediates import memory_efficient_intermediates

            stack.enter_context(memory_efficient_intermediates(storage_device="cpu"))
        return stack

    # DDP: one all-reduce per step, of the micro-batches' sum; not where the host takes each micro-batch's gradients
    no_sync = getattr(model, "no_sync", None) if host is None else None

    def step(tokens: Tensor) -> Tensor:
        tokens = shard_batch(tokens.to(device))  # split over the mesh's data x fsdp, if there is one
        total: Tensor | None = None
        for index, micro in enumerate(tokens.chunk(accum)):
            with no_sync() if no_sync is not None and index < accum - 1 else contextlib.nullcontext():
                with scope():
                    loss = lm_loss(model, micro) / accum
                loss.backward()
            if host is not None and accum > 1:
                host.accumulate()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        norm: Tensor | None = None
        limit = clip if clip > 0 else math.inf  # skip needs the norm: clipping to inf scales by 1 (exactly)
        if (clip > 0 or skip) and host is not None:
            norm = host.clip_grad_norm_(params, limit)
        elif clip > 0 or skip:
            norm = torch.nn.utils.clip_grad_norm_(params, limit)
        full = getattr(norm, "full_tensor", None)  # FSDP2's gradients are DTensors, and so is their norm
        report.grad_norm = full() if callable(full) else norm
        report.skipped = False
        if skip and not bool(torch.isfinite(total) & torch.isfinite(cast(Tensor, report.grad_norm))):
            report.skipped = True
            optimizer.zero_grad(set_to_none=True)
            return total
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step
