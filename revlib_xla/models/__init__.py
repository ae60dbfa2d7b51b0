"""Reference models built on revlib_xla, shared by the demo, the benchmarks and the tests; the Llama-style LM at real
sizes (``llama``) and models by name (``registry``)."""

from . import registry
from .gpt import gpt
from .llama import LLAMA_SIZES, Form, LlamaConfig, LlamaLM, build_llama, llama_config, num_params, train_flops_per_token
from .registry import build_model, model_names, register
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
    "LlamaConfig",
    "LLAMA_SIZES",
    "llama_config",
    "Form",
    "LlamaLM",
    "build_llama",
    "num_params",
    "train_flops_per_token",
    "registry",
    "build_model",
    "model_names",
    "register",
]
