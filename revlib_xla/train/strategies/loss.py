"""``strategy.loss_chunk`` as a piece: the LM head and cross entropy run over chunks of that many positions, each
chunk's logits recomputed in the backward pass, so no whole ``(batch, seq, vocab)`` logits tensor is ever alive
(:func:`revlib_xla.losses.chunked_next_token_loss`). ``auto``: on (:data:`AUTO_LOSS_CHUNK`) for the reversible
and momentum forms on one chip, off for the torch_xla baselines (``none``, ``checkpoint``), over a mesh of several
chips, and where the logits come out of a wrapper (``plan``, ``offload.params``, ``model.hf_config``), which refuse
an explicit value."""

from __future__ import annotations

from ..config import RunConfig
from .base import Options, Piece, Refusal, Target, register

__all__ = ["AUTO_LOSS_CHUNK", "loss_chunk", "LOSS_CHUNK"]

AUTO_LOSS_CHUNK = 256
"""Positions per chunk of ``strategy.loss_chunk=auto`` where it is on: at Llama's vocabulary (128256) a chunk's
float32 logits are 125 MiB per sequence, against 1 GiB for 2048 positions; 2048 positions make 8 chunks whatever the
batch, so the traced graph does not grow with the batch."""


def loss_chunk(cfg: RunConfig, sharded: bool = False) -> int:
    """Positions per chunk of the LM's loss (``strategy.loss_chunk``; 0 = the whole logits tensor at once).
    ``auto`` stays off for a step split over several chips (``chip.chips > 1`` or ``sharded``: an active mesh),
    where chunking has not been measured yet; an explicit value applies there too."""
    s = cfg.strategy
    if s.loss_chunk != "auto":
        return int(s.loss_chunk)
    chunked = s.activations in ("reversible", "momentum") and not s.offload.params and cfg.model.hf_config is None
    return AUTO_LOSS_CHUNK if chunked and cfg.chip.chips == 1 and not sharded else 0


def _wrapped(cfg: RunConfig) -> str | None:
    s = cfg.strategy
    if not (isinstance(s.loss_chunk, int) and s.loss_chunk > 0):
        return None
    wrapped = [
        key
        for key, on in (
            ("strategy.activations=plan", s.activations == "plan"),
            ("strategy.offload.params=true", s.offload.params),
            (f"model.hf_config={cfg.model.hf_config}", cfg.model.hf_config is not None),
        )
        if on
    ]
    if not wrapped:
        return None
    return (
        f"strategy.loss_chunk={s.loss_chunk}: with {wrapped[0]} the logits come out of the wrapped model "
        f"whole, so the loss cannot be chunked; set strategy.loss_chunk=0 (or auto), or use "
        f"strategy.activations=reversible, momentum, checkpoint or none"
    )


def _options(cfg: RunConfig, options: Options, target: Target) -> None:
    options["loss_chunk"] = loss_chunk(cfg, sharded=target.mesh is not None)


LOSS_CHUNK = register(
    Piece(
        "loss_chunk",
        lambda cfg: True,  # auto decides per config; an explicit value is refused where a wrapper holds the logits
        refuses=(Refusal("strategy.activations=plan, strategy.offload.params, model.hf_config", _wrapped),),
        options=_options,
    )
)
