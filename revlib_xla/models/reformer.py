"""A Reformer-style reversible transformer language model (Kitaev, Kaiser and Levskaya 2020, "Reformer: The
Efficient Transformer"), with the feed-forward layers applied over chunks of the sequence.

The network is the two-stream reversible decoder of :mod:`revlib_xla.models.transformer` (``(x1, x2) ->
(x1 + Attention(x2), x2 + FeedForward(y1))``, causal, with a byte-level LM head), and adds the Reformer's second
memory saving: the feed-forward block is a function of each position alone, so it is computed ``ff_chunks``
sequence chunks at a time, each under activation checkpointing (:func:`revlib_xla.backends.checkpoint`). Its hidden
activation (``mlp_ratio * width`` features per position, the largest tensor of a layer) then exists for one chunk
at a time, in the forward and in the backward pass, instead of for the whole sequence: O(T / ff_chunks). With the
reversible layers (activation memory independent of depth) this bounds a layer's peak by its attention and one
chunk of feed-forward. The chunking changes the order of no floating-point operation within a position, so the
result is the unchunked model's.

On XLA the chunks are not checkpointed (torch_xla's checkpoint is reentrant and cannot run inside the reversible
core's backward); the results are the same and the compiler decides the memory.

The attention is exact causal attention (``scaled_dot_product_attention``); the Reformer's locality-sensitive
hashing attention is not implemented.

``ReformerLM`` has the state-dict keys of :class:`revlib_xla.models.ByteTransformerLM` of the same shape, so weights
load across the two (and across the flavours ``"no_savings"``, ``"checkpoint"``, ``"reversible"``).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import backends, recompute
from ._named import named_config
from .transformer import MLP, Block, ByteTransformerLM, Flavour, TransformerConfig, lm_loss

__all__ = [
    "ReformerConfig",
    "REFORMER_SIZES",
    "ChunkedMLP",
    "ReformerLM",
    "reformer_names",
    "reformer_config",
    "build_reformer",
]


@dataclasses.dataclass(frozen=True)
class ReformerConfig(TransformerConfig):
    """:class:`TransformerConfig` plus ``ff_chunks``: the number of sequence chunks each feed-forward block is
    computed in (1: the whole sequence at once)."""

    ff_chunks: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ff_chunks < 1:
            raise ValueError(f"ReformerConfig.ff_chunks must be positive, got {self.ff_chunks}")


class ChunkedMLP(MLP):
    """:class:`revlib_xla.models.transformer.MLP` computed over ``chunks`` pieces of the sequence, each checkpointed
    when gradients are on, so only one piece's hidden activation is alive at a time. Dropout, the one random
    operator, is applied to the joined output, outside the checkpoints, so the recomputation draws nothing."""

    def __init__(self, config: TransformerConfig, chunks: int) -> None:
        super().__init__(config)
        self.chunks = chunks

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunks == 1:
            return super().compute(x)
        if not torch.is_grad_enabled():
            x = x.detach()  # a view made without grad of a tensor requiring it confuses module hooks (MemTracker)
        pieces = x.chunk(self.chunks, dim=1)
        if not torch.is_grad_enabled():
            outputs = [self.transform(piece) for piece in pieces]
        elif backends.backend_for(x).checkpoint_in_partial_backward:
            outputs = [recompute.checkpoint(self.transform, piece) for piece in pieces]
        else:
            outputs = [self.transform(piece) for piece in pieces]
        return self.drop(torch.cat(outputs, dim=1))

    def extra_repr(self) -> str:
        return f"chunks={self.chunks}"


class ReformerLM(ByteTransformerLM):
    """Decoder-only LM, ``(B, T)`` tokens to ``(B, T, vocab_size)`` logits, with chunked feed-forward blocks (see
    the module docstring); ``flavour`` as for :class:`ByteTransformerLM` (``"reversible"`` by default)."""

    config: ReformerConfig

    def __init__(self, config: ReformerConfig, flavour: str = Flavour.REVERSIBLE) -> None:
        super().__init__(config, flavour)

    def feed_forward(self, config: TransformerConfig) -> Block:
        return ChunkedMLP(config, config.ff_chunks if isinstance(config, ReformerConfig) else 1)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy of ``tokens`` (float32 scalar)."""
        return lm_loss(self(tokens), tokens)


REFORMER_SIZES: dict[str, ReformerConfig] = {
    "reformer-tiny": ReformerConfig(width=64, depth=2, heads=2, seq_len=256, ff_chunks=4),
    "reformer-revlib": ReformerConfig(width=256, depth=6, heads=8, seq_len=1024, ff_chunks=16),
}
"""``reformer-tiny`` for smoke tests; ``reformer-revlib`` has the shape of RevLib's README Reformer example (256
features per stream, 6 layers, 8 heads, 1024 tokens, 16 feed-forward chunks, 256 byte classes)."""


def reformer_names() -> list[str]:
    """The named Reformer-style LMs, for the model registry."""
    return list(REFORMER_SIZES)


def reformer_config(name: str, **overrides: object) -> ReformerConfig:
    """The config of ``name`` with ``overrides`` (ReformerConfig fields); unknown names or fields raise ValueError
    listing the choices."""
    return named_config("Reformer", REFORMER_SIZES, name, overrides)


def build_reformer(name: str, flavour: str = Flavour.REVERSIBLE, **overrides: object) -> ReformerLM:
    """Reformer-style LM ``name`` (one of :func:`reformer_names`) in ``flavour`` with config ``overrides``; builds
    under ``torch.device("meta")``."""
    return ReformerLM(reformer_config(name, **overrides), flavour)
