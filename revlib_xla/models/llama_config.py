"""The shapes of the Llama models: :class:`LlamaConfig`, the named sizes (:data:`LLAMA_SIZES`, :func:`llama_config`),
the forms the blocks are chained in (:class:`Form`), and what a size costs (:func:`num_params`,
:func:`train_flops_per_token`). Re-exported by :mod:`revlib_xla.models.llama`, where the model is."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of a :class:`LlamaLM` (the defaults are Llama-3.2-1B's).

    Args:
        vocab_size: tokens in the vocabulary (rows of the embedding).
        dim: model width (features of the residual stream).
        n_layers: blocks (each one attention and one MLP branch).
        n_heads: query heads; must divide ``dim``; ``dim // n_heads`` (the head size) must be even (rotary).
        n_kv_heads: key/value heads (grouped-query attention); must divide ``n_heads``.
        ffn_dim: hidden features of the SwiGLU MLP.
        max_seq_len: longest input sequence (rows of the rotary tables).
        rope_theta: base of the rotary frequencies. Llama 3.1/3.2's "llama3" frequency scaling for long context is
            not applied (plain RoPE with this base, HF's ``rope_type="default"``).
        norm_eps: epsilon of the RMSNorms.
        tie_embeddings: the head reuses the embedding matrix (no separate ``head``).
        dropout: dropout probability on each attention and MLP branch's output (replayed exactly in recomputation).
    """

    vocab_size: int = 128256
    dim: int = 2048
    n_layers: int = 16
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 8192
    max_seq_len: int = 8192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(
                f"LlamaConfig: n_heads={self.n_heads} does not divide dim={self.dim}; pick n_heads among the divisors "
                f"of dim (the head size is dim // n_heads)"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig: n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}; each key/value "
                f"head serves n_heads // n_kv_heads query heads (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig: the head size dim // n_heads = {self.head_dim} is odd; rotary embeddings rotate pairs "
                f"of features, so it must be even"
            )
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise ValueError(
                f"LlamaConfig: rope_theta ({self.rope_theta}) and norm_eps ({self.norm_eps}) must be positive"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LlamaConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        """Features per attention head."""
        return self.dim // self.n_heads


LLAMA_SIZES: dict[str, LlamaConfig] = {
    # ~9.6M parameters; byte-level (vocab 256) so that it trains on raw text with no tokenizer (the CLI's default);
    # untied (the head costs 98K parameters), so its reversible forms start well conditioned (see init_weights).
    "llama-tiny": LlamaConfig(
        vocab_size=256,
        dim=384,
        n_layers=6,
        n_heads=6,
        n_kv_heads=2,
        ffn_dim=1024,
        max_seq_len=2048,
        tie_embeddings=False,
    ),
    # ~128M parameters with a 32000-token vocabulary (Llama-2's tokenizer; token ids fit uint16 files).
    "llama-125m": LlamaConfig(
        vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=3072, max_seq_len=4096
    ),
    # The published shapes: Llama-3.2-1B, Llama-3.2-3B (tied heads), Llama-3-8B (untied).
    "llama-1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192),
    "llama-3b": LlamaConfig(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192),
    "llama-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, tie_embeddings=False),
}
"""The named sizes; :func:`llama_config` returns one with fields overridden."""


def llama_config(name: str, **overrides: Any) -> LlamaConfig:
    """The named size ``name`` (a key of :data:`LLAMA_SIZES`) with ``overrides`` (fields of :class:`LlamaConfig`)
    applied. Unknown names and fields raise a ValueError that lists the choices."""
    if name not in LLAMA_SIZES:
        raise ValueError(f"unknown Llama size {name!r}; expected one of {', '.join(LLAMA_SIZES)}")
    fields = [f.name for f in dataclasses.fields(LlamaConfig)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(
            f"{name}: unknown LlamaConfig field(s) {', '.join(unknown)}; expected some of {', '.join(fields)}"
        )
    return dataclasses.replace(LLAMA_SIZES[name], **overrides)


class Form(str, enum.Enum):
    """How the blocks are chained (see the module docstring). A string enum: ``"reversible"`` and
    ``Form.REVERSIBLE`` are interchangeable."""

    PLAIN = "plain"
    REVERSIBLE = "reversible"
    MOMENTUM = "momentum"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def of(cls, value: str | Form) -> Form:
        """``value`` as a member, or a ValueError that lists the forms."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unknown Llama form {value!r}; expected one of {', '.join(f.value for f in cls)}"
            ) from None


def _matmul_params(config: LlamaConfig) -> int:
    """Weights that multiply activations in one token's forward: every linear layer and the head (tied or not)."""
    attention = 2 * config.dim * config.n_heads * config.head_dim + 2 * config.dim * config.n_kv_heads * config.head_dim
    mlp = 3 * config.dim * config.ffn_dim
    return config.n_layers * (attention + mlp) + config.dim * config.vocab_size


def num_params(config: LlamaConfig) -> int:
    """The parameter count of :func:`build_llama` ``(config)`` in any form (tied weights once)."""
    embeddings = config.vocab_size * config.dim * (1 if config.tie_embeddings else 2)
    norms = (2 * config.n_layers + 1) * config.dim
    return _matmul_params(config) - config.dim * config.vocab_size + embeddings + norms


def train_flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward and backward, no recomputation), for MFU:
    ``6 * N + 6 * n_layers * n_heads * head_dim * seq_len``.

    ``N`` counts the weights of every matrix multiplication (all linear layers and the head, tied or not; the
    embedding lookup is not a matmul). The second term is causal attention: per layer and token, ``q @ k^T`` and
    ``attn @ v`` each take ``2 * n_heads * head_dim`` FLOPs per attended position, on average ``seq_len / 2``
    positions under the causal mask, and the backward costs twice the forward (the PaLM formula, halved for the
    mask)."""
    if seq_len < 1:
        raise ValueError(f"train_flops_per_token: seq_len must be positive, got {seq_len}")
    attention = 6 * config.n_layers * config.n_heads * config.head_dim * seq_len
    return float(6 * _matmul_params(config) + attention)
