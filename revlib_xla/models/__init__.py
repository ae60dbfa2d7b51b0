"""Reference models built on revlib_xla, shared by the demo, the benchmarks and the tests.

Families with named sizes (each has ``*_names()`` and ``build_*(name, **overrides)`` for the model registry):
RevNets (:mod:`.revnet`), i-RevNets (:mod:`.irevnet`), Reformer-style LMs (:mod:`.reformer`), and the earlier
models (:mod:`.zoo`: the byte-level LM, the GPT and the ResNets).
"""

from .gpt import gpt
from .irevnet import IREVNET_SIZES, IRevNet, IRevNetConfig, build_irevnet, irevnet_config, irevnet_names
from .reformer import (
    REFORMER_SIZES,
    ChunkedMLP,
    ReformerConfig,
    ReformerLM,
    build_reformer,
    reformer_config,
    reformer_names,
)
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
