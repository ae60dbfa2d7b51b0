"""Reference models built on revlib_xla, shared by the demo, the benchmarks and the tests.

The Llama-style LM at real sizes (:mod:`.llama`), and families with named sizes (each has ``*_names()`` and
``build_*(name, **overrides)``): RevNets (:mod:`.revnet`), i-RevNets (:mod:`.irevnet`), Reformer-style LMs
(:mod:`.reformer`), and the earlier models (:mod:`.zoo`: the byte-level LM, the GPT and the ResNets). Every named
model is built by name through :mod:`.registry` (``build_model(name, form=...)``, ``model_names()``).
"""

from . import registry
from .gpt import gpt
from .irevnet import IREVNET_SIZES, IRevNet, IRevNetConfig, build_irevnet, irevnet_config, irevnet_names
from .llama import LLAMA_SIZES, Form, LlamaConfig, LlamaLM, build_llama, llama_config, num_params, train_flops_per_token
from .reformer import (
    REFORMER_SIZES,
    ChunkedMLP,
    ReformerConfig,
    ReformerLM,
    build_reformer,
    reformer_config,
    reformer_names,
)
from .registry import build_model, model_names, register
from .resnet import resnet, resnet18, resnet50, resnet101
from .revnet import REVNET_SIZES, RevNet, RevNetConfig, build_revnet, revnet_config, revnet_names
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
from .zoo import build_zoo, zoo_names

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
    "zoo_names",
    "build_zoo",
    "RevNetConfig",
    "RevNet",
    "REVNET_SIZES",
    "revnet_names",
    "revnet_config",
    "build_revnet",
    "IRevNetConfig",
    "IRevNet",
    "IREVNET_SIZES",
    "irevnet_names",
    "irevnet_config",
    "build_irevnet",
    "ReformerConfig",
    "ReformerLM",
    "ChunkedMLP",
    "REFORMER_SIZES",
    "reformer_names",
    "reformer_config",
    "build_reformer",
]
