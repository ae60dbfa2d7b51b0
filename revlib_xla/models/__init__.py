"""Reference models built on revlib_xla, shared by the demo, the benchmarks and the tests."""
from .transformer import (FLAVOUR_LABELS, FLAVOURS, MLP, Block, ByteTransformerLM, CausalSelfAttention,
                          TransformerConfig, build_lm, lm_loss)

__all__ = [
    "TransformerConfig", "FLAVOURS", "FLAVOUR_LABELS", "Block", "CausalSelfAttention", "MLP", "ByteTransformerLM",
    "build_lm", "lm_loss",
]
