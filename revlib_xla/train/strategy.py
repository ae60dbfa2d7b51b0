"""The memory strategy of a training run: the model, the optimizer and the step that ``strategy.*`` asks for,
composed from the pieces of :mod:`revlib_xla.train.strategies` (one per setting, applied in its fixed order).

* ``activations``: ``none`` (plain autograd), ``checkpoint`` (each block under
  :func:`revlib_xla.backends.checkpoint`: ``torch.utils.checkpoint`` on eager devices, torch_xla's on XLA),
  ``reversible`` / ``momentum`` (the LM's two-stream reversible and MomentumNet forms, activations rebuilt in the
  backward pass), ``plan`` (:class:`revlib_xla.Checkpointable` over the LM's stages with the fastest schedule that
  fits ``budget`` bytes; ``auto`` = the chip's HBM less the parameters, gradients and optimizer state).
* ``exact`` (``reversible`` and ``momentum``): the two residual streams as fixed-point integers, so the backward
  rebuilds every layer's input bit for bit (true, the default: :mod:`~revlib_xla.reversible.fixed_point`, 8 bytes per
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
  (:func:`revlib_xla.losses.chunked_next_token_loss`); ``auto``: on (:data:`AUTO_LOSS_CHUNK`) for the
  reversible and momentum forms on one chip, off for the torch_xla baselines (``none``, ``checkpoint``), over a
  mesh of several chips, and where the logits come out of a wrapper (``plan``, ``offload.params``,
  ``model.hf_config``), which refuse an explicit value.

Combinations the library cannot run correctly raise :class:`StrategyError` naming the keys and what to use instead
(the pieces declare them). The names below are re-exported from the modules that define them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor, nn

from .. import backends
from ..optim.host import HostOptimizer
from ..reversible import ReversibleError
from .config import RunConfig
from .strategies.activations import PlannedLM
from .strategies.base import (
    LanguageModel,
    Options,
    StrategyError,
    Target,
    active_pieces,
    language_model,
    lm_loss,
    refuse,
)
from .strategies.loss import AUTO_LOSS_CHUNK, loss_chunk
from .strategies.offload import OffloadedLM, compute_device
from .strategies.optimizer import HostOptimizerState, adamw, layer_ndims, lr_at, set_lr
from .strategies.sizing import (
    chip_spec,
    flops_per_token,
    fsdp2_gathered_params,
    fsdp2_world,
    model_config,
    optimizer_bytes_per_param,
    param_count,
    params_per_chip,
    peak_flops,
    plan_budget,
    resolve_device,
    state_bytes_per_param,
    weight_bytes_per_param,
)

__all__ = [
    "StrategyError",
    "PlannedLM",
    "OffloadedLM",
    "HostOptimizerState",
    "resolve_device",
    "model_config",
    "check_strategy",
    "build_model",
    "language_model",
    "compute_device",
    "build_optimizer",
    "layer_ndims",
    "make_step",
    "StepReport",
    "PHASES",
    "lr_at",
    "set_lr",
    "LanguageModel",
    "lm_loss",
    "chip_spec",
    "peak_flops",
    "state_bytes_per_param",
    "weight_bytes_per_param",
    "optimizer_bytes_per_param",
    "plan_budget",
    "param_count",
    "params_per_chip",
    "fsdp2_world",
    "fsdp2_gathered_params",
    "flops_per_token",
    "loss_chunk",
    "AUTO_LOSS_CHUNK",
]


def check_strategy(cfg: RunConfig) -> None:
    """Raise :class:`StrategyError` for a combination that cannot run correctly: the first refusal of the active
    pieces, in their order (the model's config is read first: a transformers config that cannot be read is said
    before any combination)."""
    model_config(cfg)
    refuse(cfg)


def build_model(
    cfg: RunConfig, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> nn.Module:
    """The LM of ``cfg.model`` with the activation strategy and few-bit activations applied, on ``device`` (default
    :func:`resolve_device`; parameters stay in host memory with ``offload.params``). It is built on the meta device
    and materialised where it runs, with weights drawn from ``train.seed`` on the host, so every device starts from
    the same weights; ``"meta"`` builds it without allocating anything (any size). The result has
    ``forward(tokens) -> logits`` and ``loss(tokens)``. ``dtype``: the weights' dtype (default float32; float64 to
    check a strategy's gradients exactly).

    The active pieces apply themselves phase by phase: the budget they plan to (refused before anything is
    allocated), a builder of their own (a transformers model), the builder's options, the weights written (in host
    memory or in a dtype a piece declares), then each piece's conversion of the model."""
    from ..models.llama import build_llama
    from ..sharding import ShardedWriter, active_mesh

    check_strategy(cfg)
    pieces = list(active_pieces(cfg))
    where = backends.as_device(device) if device is not None else resolve_device(cfg)
    on_meta = not backends.backend_for(where).holds_data
    budget = next((piece.budget(cfg) for piece in pieces if piece.budget is not None), 0)
    target = Target(where, on_meta, active_mesh(where), budget, dtype)
    builder = next((piece.build for piece in pieces if piece.build is not None), None)
    if builder is not None:
        return builder(cfg, target)
    options: Options = {"form": "plain", "checkpoint": False, "beta": cfg.strategy.beta, "loss_chunk": 0}
    for piece in pieces:
        if piece.options is not None:
            piece.options(cfg, options, target)
    with torch.device("meta"):  # built without allocating, then materialised where it runs
        try:
            lm = build_llama(model_config(cfg), **options)
        except ReversibleError as exc:
            explained = [piece.build_error(cfg, exc) for piece in pieces if piece.build_error is not None]
            if not explained:
                raise
            raise StrategyError(explained[0]) from None
    if not on_meta:
        on_host = any(piece.weights_on_host for piece in pieces)
        lm.to_empty(device="cpu" if on_host else where)
        final = dtype or next((piece.weight_dtype for piece in pieces if piece.weight_dtype is not None), None)
        # under a mesh, each device receives only its piece of each weight
        write = None if target.mesh is None or on_host else ShardedWriter(lm, target.mesh, final)
        lm.init_weights(cfg.train.seed, write)  # drawn on the host from the seed: the same weights on every device
        if write is not None:
            target = dataclasses.replace(target, placed=write.placed)
    if dtype is not None:
        lm.to(dtype)
    model: nn.Module = lm
    for piece in pieces:
        if piece.convert is not None:
            model = piece.convert(cfg, model, target)
    return model


def build_optimizer(cfg: RunConfig, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW over ``model``'s trainable parameters (weight decay on matrices only), or the optimizer of the first
    active piece that builds one: fused into the backward pass with ``strategy.fused_optimizer``, with its state in
    host memory with ``strategy.offload.optimizer``."""
    params = [p for p in model.parameters() if p.requires_grad]
    per_layer = layer_ndims(model)
    ndims = [per_layer[id(p)] for p in params]
    for piece in active_pieces(cfg):
        if piece.optimizer is not None:
            built = piece.optimizer(cfg, model, params, ndims)
            if built is not None:
                return built
    return adamw(cfg, params, ndims)


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
    on_phase: Callable[[str], None] | None = None
    """Called as the step enters each of its phases (:data:`PHASES`: each micro-batch's forward and backward, then
    the optimizer step with its clipping): what measures the memory of each (``revlib-xla memory``'s estimate,
    the training log on cuda)."""

    def phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)


#: A training step's phases, in order (:attr:`StepReport.on_phase`)
PHASES = ("forward", "backward", "optimizer step")


def make_step(
    cfg: RunConfig, model: nn.Module, optimizer: torch.optim.Optimizer, report: StepReport | None = None
) -> Callable[[Tensor], Tensor]:
    """One training step on a ``(B, T)`` token batch: forward and backward (over ``optim.grad_accum_steps``
    micro-batches), gradient clipping by the global norm (``optim.grad_clip``), the optimizer step, gradients
    freed; returns the mean loss (a 0-d tensor on the device). bf16 precision runs under autocast. On XLA it does not
    sync: the caller cuts the step (:func:`revlib_xla.backends.sync`). With ``train.nonfinite=skip`` the step reads
    the loss and the gradient norm on the host before the update (a sync) and drops the gradients instead of
    stepping when either is NaN or inf. ``report`` (if given) receives the gradient norm and whether the update was
    skipped."""
    from ..sharding import shard_batch

    device = compute_device(model)
    scopes = [piece.step_scope(cfg, device) for piece in active_pieces(cfg) if piece.step_scope is not None]
    params = [p for p in model.parameters() if p.requires_grad]
    accum = cfg.optim.grad_accum_steps
    clip = cfg.optim.grad_clip
    skip = cfg.train.nonfinite == "skip"  # (refused with strategy.fused_optimizer by the config)
    report = report if report is not None else StepReport()
    # bfloat16 device gradients are summed over micro-batches in float32 on the host, not rounded at each addition
    host = optimizer if isinstance(optimizer, HostOptimizer) and optimizer.gradients_on_host else None

    def scope() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for make in scopes:  # autocast (precision), then saved tensors to the host (offload.activations)
            stack.enter_context(make())
        return stack

    # DDP: one all-reduce per step, of the micro-batches' sum; not where the host takes each micro-batch's gradients
    no_sync = getattr(model, "no_sync", None) if host is None else None

    def step(tokens: Tensor) -> Tensor:
        tokens = shard_batch(tokens.to(device))  # split over the mesh's data x fsdp, if there is one
        total: Tensor | None = None
        for index, micro in enumerate(tokens.chunk(accum)):
            with no_sync() if no_sync is not None and index < accum - 1 else contextlib.nullcontext():
                report.phase("forward")
                with scope():
                    loss = lm_loss(model, micro) / accum
                report.phase("backward")
                if host is not None:  # streamed gradients are stepped as they arrive where nothing needs them all
                    host.backward_starts(final=index == accum - 1 and not (clip > 0 or skip))
                loss.backward()
            if host is not None and accum > 1:
                host.accumulate()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        report.phase("optimizer step")
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
