"""A GPT-style decoder as one flat ``nn.Sequential``, plain or with reversible blocks, for the planner.

Plain: ``Embedding -> (Attention block, MLP block) x depth -> LayerNorm -> head``, each block pre-norm with its own
residual (``x + f(x)``). Reversible: the embedding is split into two streams and each block is a
:class:`revlib_xla.ReversibleModule` (``(x0, x1) -> (x1, x0 + f(x1))``) run by ordinary autograd, so the planner
can either keep what it saves or drop its input and rebuild it from its output (``Fr``/``Br``). The blocks are
those of :mod:`revlib_xla.models.transformer`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..reversible import ReversibleModule
from .transformer import MLP, CausalSelfAttention, TransformerConfig

__all__ = ["Embedding", "Residual", "SplitStreams", "MergeStreams", "gpt"]


class Embedding(nn.Module):
    """Token and learned position embeddings, with dropout: ``(B, T)`` integers to ``(B, T, width)``."""

    def __init__(self, config: TransformerConfig, width: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, width)
        self.positions = nn.Embedding(config.seq_len, width)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.tokens(tokens) + self.positions(positions))


class Residual(nn.Module):
    """``x + block(x)``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class SplitStreams(nn.Module):
    """``(B, T, 2w) -> ((B, T, w), (B, T, w))``: the two streams of a reversible stack."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x0, x1 = x.chunk(2, dim=-1)
        return x0.contiguous(), x1.contiguous()


class MergeStreams(nn.Module):
    """``(x0, x1) -> cat([x0, x1], -1)``."""

    def forward(self, streams: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.cat(list(streams), dim=-1)


def gpt(config: TransformerConfig, reversible: bool = False) -> nn.Sequential:
    """The decoder as ``nn.Sequential``: ``(B, T)`` tokens to ``(B, T, vocab_size)`` logits.

    Plain, the residual stream has ``config.width`` features; reversible, it has two streams of ``config.width``
    (``2 * width`` in the embedding and the head), as the Reformer does.
    """
    width = 2 * config.width if reversible else config.width
    layers: list[nn.Module] = [Embedding(config, width)]
    if reversible:
        layers.append(SplitStreams())
    for _ in range(config.depth):
        for block in (CausalSelfAttention(config), MLP(config)):
            layers.append(ReversibleModule(block) if reversible else Residual(block))
    if reversible:
        layers.append(MergeStreams())
    layers += [nn.LayerNorm(width), nn.Linear(width, config.vocab_size)]
    return nn.Sequential(*layers)
