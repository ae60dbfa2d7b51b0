"""A byte-level decoder-only transformer language model, in three memory flavours that compute the same function.

Architecture (Reformer-style two-stream reversible transformer): bytes are embedded into ``2 * width`` features
(token + learned position), split along the feature dimension into two residual streams of ``width`` each, and
passed through ``depth`` transformer layers. Each transformer layer is two reversible layers of
:class:`revlib_xla.ReversibleSequential`::

    (x0, x1) -> (x1, x0 + Attention(x1)) -> (x0 + Attention(x1), x1 + MLP(x0 + Attention(x1)))

where ``Attention`` is ``LayerNorm -> causal multi-head self-attention`` and ``MLP`` is
``LayerNorm -> Linear -> GELU -> Linear``, each an ordinary module mapping ``(B, T, width) -> (B, T, width)``.
The two streams are concatenated again, normalised and projected to 256 byte logits.

Flavours (``build_lm(config, flavour)``) share this exact architecture, parameter layout and state-dict keys; they
differ only in what autograd keeps for the backward pass:

* ``"no_savings"``: the baseline. The same two-stream network run by ordinary autograd
  (``MemoryModes.no_savings``): every block's intermediate activations are kept, O(depth). It is the fair baseline
  because it has the same parameters, the same FLOPs and the same function as the other two flavours, so any memory
  difference comes from the saving strategy alone (an ordinary single-stream residual transformer would differ in
  embedding/head width and would not compute the same function).
* ``"checkpoint"``: as ``no_savings``, with every block (attention or MLP) under activation checkpointing
  (:func:`revlib_xla.backends.checkpoint`: ``torch.utils.checkpoint`` on eager devices, ``torch_xla.utils.checkpoint``
  on XLA). Keeps each block's input stream, O(depth) but with a small constant; recomputes every block once.
* ``"reversible"``: ``MemoryModes.autograd_function``: keeps only the final two streams and rebuilds each layer's
  input from its output in the backward pass, so activation memory does not grow with depth.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import recompute
from ..reversible import MemoryModes, ReversibleSequential

__all__ = [
    "TransformerConfig",
    "FLAVOURS",
    "FLAVOUR_LABELS",
    "Flavour",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "ByteTransformerLM",
    "build_lm",
    "lm_loss",
]


class Flavour(str, enum.Enum):
    """The three ways of running the same network (see the module docstring). A string enum: each member equals,
    hashes and prints as its value, so ``"reversible"`` and ``Flavour.REVERSIBLE`` are interchangeable."""

    NO_SAVINGS = "no_savings"
    CHECKPOINT = "checkpoint"
    REVERSIBLE = "reversible"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def of(cls, value: str) -> Flavour:
        """``value`` as a member, or a ValueError that lists the flavours."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"unknown flavour {value!r}; expected one of {', '.join(f.value for f in cls)}") from None


FLAVOURS: tuple[Flavour, ...] = tuple(Flavour)
"""The flavours, in the order tables list them."""

FLAVOUR_LABELS: dict[str, str] = {
    Flavour.NO_SAVINGS: "no savings",
    Flavour.CHECKPOINT: "checkpointing",
    Flavour.REVERSIBLE: "reversible",
}
"""Human-readable names of the flavours, for tables and plots."""


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Shape of a :class:`ByteTransformerLM`.

    Args:
        width: features of each of the two residual streams (the embedding has ``2 * width``).
        depth: transformer layers; each is one attention and one MLP reversible layer (``2 * depth`` in all).
        heads: attention heads; must divide ``width``.
        seq_len: longest input sequence (size of the learned position table).
        dropout: dropout on the embedding and on every block's output.
        mlp_ratio: hidden features of the MLP, as a multiple of ``width``.
        vocab_size: 256 for bytes.
    """

    width: int = 128
    depth: int = 4
    heads: int = 4
    seq_len: int = 128
    dropout: float = 0.0
    mlp_ratio: int = 4
    vocab_size: int = 256

    def __post_init__(self) -> None:
        for name in ("width", "depth", "heads", "seq_len", "mlp_ratio", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"TransformerConfig.{name} must be positive, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"TransformerConfig: heads ({self.heads}) must divide width ({self.width})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"TransformerConfig.dropout must be in [0, 1), got {self.dropout}")


class Block(nn.Module):
    """Base of the transformer's blocks: ``forward(x)`` runs :meth:`compute`, under activation checkpointing when
    :attr:`checkpointed` is set (the ``"checkpoint"`` flavour). A plain attribute, so it changes no state-dict key."""

    checkpointed: bool = False

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            return recompute.checkpoint(self.compute, x)
        return self.compute(x)


class CausalSelfAttention(Block):
    """``LayerNorm -> causal multi-head self-attention -> dropout``, ``(B, T, width) -> (B, T, width)``.

    Attention is :func:`torch.nn.functional.scaled_dot_product_attention` with ``is_causal=True`` (runs on cpu,
    cuda and torch_xla).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.heads = config.heads
        self.norm = nn.LayerNorm(config.width)
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.out = nn.Linear(config.width, config.width)
        self.drop = nn.Dropout(config.dropout)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, time, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.out(y.transpose(1, 2).reshape(batch, time, width)))


class MLP(Block):
    """``LayerNorm -> Linear -> GELU -> Linear -> dropout``, ``(B, T, width) -> (B, T, width)``."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        hidden = config.mlp_ratio * config.width
        self.norm = nn.LayerNorm(config.width)
        self.up = nn.Linear(config.width, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, config.width)
        self.drop = nn.Dropout(config.dropout)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.transform(x))

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """Everything but the dropout: a function of each position alone (what a chunked MLP splits)."""
        return self.down(self.act(self.up(self.norm(x))))


class ByteTransformerLM(nn.Module):
    """Decoder-only byte-level language model: ``forward(tokens) -> logits``.

    ``tokens`` is an integer tensor ``(B, T)`` with ``T <= config.seq_len``; the result is ``(B, T, vocab_size)``
    logits for the next byte at every position. Build it with :func:`build_lm`.
    """

    def __init__(self, config: TransformerConfig, flavour: str = Flavour.REVERSIBLE):
        super().__init__()
        self.config = config
        self.flavour = flavour = Flavour.of(flavour)
        features = 2 * config.width
        self.embed = nn.Embedding(config.vocab_size, features)
        self.pos = nn.Parameter(torch.zeros(config.seq_len, features))
        self.drop = nn.Dropout(config.dropout)
        blocks = []
        for _ in range(config.depth):
            blocks += [CausalSelfAttention(config), self.feed_forward(config)]
        for block in blocks:
            block.checkpointed = flavour is Flavour.CHECKPOINT
        mode = MemoryModes.autograd_function if flavour is Flavour.REVERSIBLE else MemoryModes.no_savings
        self.core = ReversibleSequential(*blocks, split_dim=-1, memory_mode=mode)
        self.norm = nn.LayerNorm(features)
        self.head = nn.Linear(features, config.vocab_size, bias=False)
        self.reset_parameters()

    def feed_forward(self, config: TransformerConfig) -> Block:
        """The MLP block of each layer (a subclass may return another with the same parameters)."""
        return MLP(config)

    def reset_parameters(self) -> None:
        """GPT-2-style initialisation: N(0, 0.02) weights, zero biases, output projections of blocks scaled by
        ``1 / sqrt(2 * depth)`` so the streams' scale does not grow with depth."""
        out_std = 0.02 / math.sqrt(2 * self.config.depth)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = out_std if name.endswith((".out", ".down")) else 0.02
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"ByteTransformerLM expects tokens of shape (batch, time), got {tuple(tokens.shape)}")
        time = tokens.shape[1]
        if time > self.config.seq_len:
            raise ValueError(
                f"ByteTransformerLM: sequence of {time} tokens is longer than seq_len={self.config.seq_len}"
            )
        x = self.drop(self.embed(tokens) + self.pos[:time])
        return self.head(self.norm(self.core(x)))

    def extra_repr(self) -> str:
        return f"flavour={self.flavour.value!r}"


def build_lm(config: TransformerConfig, flavour: str = Flavour.REVERSIBLE) -> ByteTransformerLM:
    """The byte-level LM of ``config`` in one of :data:`FLAVOURS` (``"no_savings"``, ``"checkpoint"``,
    ``"reversible"``). All flavours have the same state-dict keys, so weights load across them."""
    return ByteTransformerLM(config, flavour)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy in nats: position ``t`` predicts ``tokens[:, t + 1]`` (the last position has no
    target). ``ln(256) ~= 5.55`` is the loss of a uniform guess."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
