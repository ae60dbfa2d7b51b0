"""Reference models built on revlib_xla, shared by the demo, the benchmarks and the tests."""

from .gpt import gpt
from .resnet import resnet, resnet18, resnet50, resnet101
from .transformer import (
    FLAVOUR_LABELS,
    FLAVOURS,
    MLP,
    Block,
    ByteTransformerLM,
    CausalSelfAttention,
    Flavour,
    TransformerConfig,
    build_lm,
    lm_loss,
)

__all__ = [
    "TransformerConfig",
    "Flavour",
    "FLAVOURS",
    "FLAVOUR_LABELS",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "ByteTransformerLM",
    "build_lm",
    "lm_loss",
    "gpt",
    "resnet",
    "resnet18",
    "resnet50",
    "resnet101",
]
