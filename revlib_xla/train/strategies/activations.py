"""How a step keeps what the backward pass needs, ``strategy.activations`` and its companions, as pieces.

* ``activations=checkpoint``: each block under :func:`revlib_xla.backends.checkpoint` (``torch.utils.checkpoint`` on
  eager devices, torch_xla's on XLA).
* ``activations=reversible`` / ``momentum``: the LM's two-stream reversible and MomentumNet forms, activations
  rebuilt in the backward pass.
* ``exact`` (with those two): the two residual streams as fixed-point integers, so the backward rebuilds every
  layer's input bit for bit (true, the default: :mod:`~revlib_xla.reversible.fixed_point`, 8 bytes per element), or as
  floating-point numbers checked by the backward's rebuild check (false: the bytes of the activations' dtype, and
  a refusal where the rebuilt input is off).
* ``model.scan``: the reversible form's identical layers stacked and run as one loop.
* ``fewbit``: the MLP activation's derivative stored in that many bits (:mod:`revlib_xla.fewbit`).
* ``activations=plan``: :class:`revlib_xla.Checkpointable` over the LM's stages with the fastest schedule that fits
  ``budget`` bytes (``auto`` = the chip's HBM less the parameters, gradients and optimizer state):
  :class:`PlannedLM`.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from ... import backends
from ...losses import next_token_loss
from ...planner.checkpointable import Checkpointable
from ..config import RunConfig
from .base import Options, Piece, StrategyError, Target, register
from .sizing import plan_budget

__all__ = ["PlannedLM", "CHECKPOINT", "REVERSIBLE", "MOMENTUM", "EXACT", "SCAN", "FEWBIT", "PLAN"]


class _LossInside(Checkpointable):
    """The LM's Checkpointable, whose output (the logits) goes straight into :meth:`PlannedLM.loss`: no caller keeps
    it through the backward; autograd holds its gradient until the backward phase returns (and, on the CPU, the
    stages' captured random states: :meth:`Checkpointable.random_state_bytes`)."""

    def held_during_backward(self) -> float:
        chain = self._need_chain("held_during_backward")
        return 0.0 if self._sample is not None else float(chain.cw[-1] + self.random_state_bytes())


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
        self.lm = lm
        self.planned = _LossInside(cast(Any, lm).as_sequential(), mem_limit=budget, tpu_generation=tpu_generation)
        self.autocast = autocast
        self._loss_sized: tuple[tuple[int, ...], torch.dtype | None] | None = None  # what loss_transient sized
        if sample is not None:
            self.plan(sample)

    def plan(self, sample: Tensor) -> None:
        """Measure the stages on ``sample`` (a token batch of the step's shape) and plan now, before an optimizer is
        fused into the backward (the measurement's backward passes would step it); under autocast to bfloat16 on
        the ``autocast`` device type where the step runs so (``strategy.precision=bf16``): the activations the step
        keeps are bfloat16, half what a float32 measurement finds."""
        from ...planner.solver import InfeasibleBudget

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
        their peak besides the logits and their gradient, which the plan counts already (counted here too, the
        smallest budget of a llama-1b plan at 2 x 2048 tokens was 29 % above the plain model's peak). At Llama's
        vocabulary this is several times the logits (their float32 copy and log-probabilities, and those
        gradients); a plan that took it as 0 peaked above its budget there. Measured on an eager device
        (:class:`revlib_xla.memory.StorageTracker`); 0 on XLA, where the compiled stages' sizes stand for it."""
        from ...memory import StorageTracker

        if backends.is_tracing_lazily(sample):
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
        # the logits and their gradient are the chain's output and its gradient, which the plan counts
        return max(0, peak - start - 2 * logits.numel() * logits.element_size())

    def forward(self, tokens: Tensor) -> Tensor:
        sized = (tuple(tokens.shape), self._autocast_now())
        if self.training and torch.is_grad_enabled() and self._loss_sized != sized:
            # measured at this call (built on meta, or another batch shape): the loss stage is sized first
            self.planned.loss_tmp_memory_usage = self.loss_transient(tokens)
            self._loss_sized = sized
        return self.planned(tokens)

    def _autocast_now(self) -> torch.dtype | None:
        """The dtype autocast computes in on the LM's device now, or None where it is off."""
        kind = backends.backend_for(next(self.lm.parameters()).device).autocast_device_type
        return torch.get_autocast_dtype(kind) if kind and torch.is_autocast_enabled(kind) else None

    def loss(self, tokens: Tensor) -> Tensor:
        return next_token_loss(self(tokens), tokens)


def _checkpoint(cfg: RunConfig, options: Options, target: Target) -> None:
    options["checkpoint"] = True


def _form(form: str) -> Any:
    def options(cfg: RunConfig, options: Options, target: Target) -> None:
        options["form"] = form

    return options


def _exact(cfg: RunConfig, options: Options, target: Target) -> None:
    options["exact"] = None if cfg.strategy.exact else False  # None: the library's fixed-point streams


def _scan(cfg: RunConfig, options: Options, target: Target) -> None:
    options["scan"] = None  # an XLA loop, else layer by layer


def _scan_error(cfg: RunConfig, exc: Exception) -> str:
    return f"model.scan=true: {exc}. With this config: model.overrides.n_layers=2 or more, or model.scan=false"


def _fewbit(cfg: RunConfig, lm: nn.Module, target: Target) -> nn.Module:
    from ...fewbit import convert_activation
    from ...fewbit.conversion import map_module

    bits = cfg.strategy.fewbit
    map_module(lm, lambda m: convert_activation(m, bits=bits) if isinstance(m, nn.SiLU) else m)
    return lm


def _plan(cfg: RunConfig, lm: nn.Module, target: Target) -> nn.Module:
    from ...compiled.worker import TPU_GENERATIONS
    from ...sharding import planning_budget

    generation = cfg.chip.name if cfg.chip.name in TPU_GENERATIONS else None
    micro_batch = cfg.data.batch_size // cfg.optim.grad_accum_steps
    sample = torch.zeros(micro_batch, cfg.data.seq_len, dtype=torch.long, device=target.device)
    budget = planning_budget(target.budget, target.mesh)  # measured on the whole batch: see there
    autocast = backends.backend_for(target.device).autocast_device_type if cfg.strategy.precision == "bf16" else None
    return PlannedLM(lm, budget, generation, sample=None if target.on_meta else sample, autocast=autocast)


def _activations(value: str) -> Any:
    return lambda cfg: cfg.strategy.activations == value


CHECKPOINT = register(Piece("activations=checkpoint", _activations("checkpoint"), options=_checkpoint))
REVERSIBLE = register(Piece("activations=reversible", _activations("reversible"), options=_form("reversible")))
MOMENTUM = register(Piece("activations=momentum", _activations("momentum"), options=_form("momentum")))
EXACT = register(Piece("exact", lambda cfg: cfg.strategy.activations in ("reversible", "momentum"), options=_exact))
SCAN = register(Piece("model.scan", lambda cfg: cfg.model.scan, options=_scan, build_error=_scan_error))
FEWBIT = register(Piece("fewbit", lambda cfg: bool(cfg.strategy.fewbit), convert=_fewbit))
PLAN = register(Piece("activations=plan", _activations("plan"), budget=plan_budget, convert=_plan))
