"""Built-in transformers configs (tiny ones for tests and notebooks, real shapes for memory estimates) and
:func:`model_from_config`: a model with random weights from one of them or from a local ``config.json``; nothing is
downloaded."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from ..backends.xla import xla_requested
from .layers import HFConversionError

__all__ = ["CONFIGS", "config_names", "model_from_config"]

_TINY_DECODER = {"vocab_size": 256, "max_position_embeddings": 256, "tie_word_embeddings": True}
_TINY_LLAMA = {
    **_TINY_DECODER,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

#: name -> (model_type, task, config fields); task "causal-lm" or "masked-lm"
CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # tiny: byte-level vocabularies (256), 4 layers, for tests, notebooks and the CPU
    "gpt2-tiny": (
        "gpt2",
        "causal-lm",
        {
            "vocab_size": 256,
            "n_positions": 256,
            "n_embd": 64,
            "n_layer": 4,
            "n_head": 4,
            "tie_word_embeddings": True,
            "bos_token_id": None,
            "eos_token_id": None,
        },
    ),
    "llama-tiny": ("llama", "causal-lm", _TINY_LLAMA),
    "qwen2-tiny": ("qwen2", "causal-lm", _TINY_LLAMA),
    "qwen3-tiny": ("qwen3", "causal-lm", {**_TINY_LLAMA, "head_dim": 16}),
    "mistral-tiny": ("mistral", "causal-lm", {**_TINY_LLAMA, "sliding_window": None}),
    "gpt-neox-tiny": (
        "gpt_neox",
        "causal-lm",
        {
            **_TINY_DECODER,
            "hidden_size": 64,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "rotary_pct": 0.25,
            "tie_word_embeddings": False,
        },
    ),
    "bert-tiny": (
        "bert",
        "masked-lm",
        {
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "max_position_embeddings": 256,
        },
    ),
    # real shapes (the published configs' sizes)
    "gpt2-124m": (
        "gpt2",
        "causal-lm",
        {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12},
    ),
    "llama-3.2-1b": (
        "llama",
        "causal-lm",
        {
            "vocab_size": 128256,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    "llama-3-8b": (
        "llama",
        "causal-lm",
        {
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
        },
    ),
    "qwen2.5-0.5b": (
        "qwen2",
        "causal-lm",
        {
            "vocab_size": 151936,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3-0.6b": (
        "qwen3",
        "causal-lm",
        {
            "vocab_size": 151936,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
        },
    ),
    "mistral-7b": (
        "mistral",
        "causal-lm",
        {
            "vocab_size": 32768,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
        },
    ),
    "pythia-160m": (
        "gpt_neox",
        "causal-lm",
        {
            "vocab_size": 50304,
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "max_position_embeddings": 2048,
            "rotary_pct": 0.25,
            "use_parallel_residual": True,
            "tie_word_embeddings": False,
        },
    ),
    "bert-base": (
        "bert",
        "masked-lm",
        {
            "vocab_size": 30522,
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "max_position_embeddings": 512,
        },
    ),
}


def config_names() -> list[str]:
    """The built-in config names."""
    return sorted(CONFIGS)


def _transformers() -> Any:
    """transformers, with its model classes' modules imported. transformers' model loading imports accelerate, which
    imports torch_xla wherever it is installed (8 s or more, and a ``PJRT_DEVICE`` warning) even when nothing uses
    XLA. Where this process has not asked for XLA (:func:`~revlib_xla.backends.xla.xla_requested`; accelerate's own
    ``USE_TORCH_XLA``, when set, is respected either way), accelerate is imported with its ``USE_TORCH_XLA=0``
    switch, so a CPU or GPU user's process never loads torch_xla; set ``PJRT_DEVICE`` (or import torch_xla) before
    the first model is built to have accelerate's XLA support."""
    import sys

    try:
        import transformers
    except ImportError as err:
        raise ImportError(
            "revlib_xla.hf needs transformers: pip install 'revlib_xla[hf]' (transformers>=5.15)"
        ) from err
    if "accelerate" in sys.modules or "USE_TORCH_XLA" in os.environ or xla_requested():
        import transformers.modeling_utils

        return transformers
    os.environ["USE_TORCH_XLA"] = "0"
    try:
        import transformers.modeling_utils
    finally:
        del os.environ["USE_TORCH_XLA"]
    return transformers


def model_from_config(
    name_or_path: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **overrides: Any,
) -> nn.Module:
    """A transformers model with random weights: ``name_or_path`` is a built-in config name (:func:`config_names`)
    or a local ``config.json`` (or a directory holding one). ``overrides`` set config fields
    (``num_hidden_layers=8``); ``device="meta"`` builds without allocating (real sizes, for memory estimates).
    Causal LMs come as ``AutoModelForCausalLM``, BERT-style configs as ``AutoModelForMaskedLM``."""
    transformers = _transformers()
    key = os.fspath(name_or_path)
    if key in CONFIGS:
        model_type, task, fields = CONFIGS[key]
        fields = dict(fields)
    else:
        path = os.path.join(key, "config.json") if os.path.isdir(key) else key
        if not os.path.isfile(path):
            raise HFConversionError(
                f"model_from_config: {key!r} is neither a built-in config ({', '.join(config_names())}) nor a local "
                f"config.json or a directory holding one"
            )
        with open(path) as f:
            fields = json.load(f)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise HFConversionError(f"model_from_config: {path} has no 'model_type'")
        architectures = fields.get("architectures") or []
        task = "masked-lm" if any("MaskedLM" in a for a in architectures) else "causal-lm"
    fields.update(overrides)
    config = transformers.AutoConfig.for_model(model_type, **fields)
    auto = transformers.AutoModelForMaskedLM if task == "masked-lm" else transformers.AutoModelForCausalLM
    with torch.device(device) if device is not None else _nothing():
        model = auto.from_config(config, **({"dtype": dtype} if dtype is not None else {}))
    return model


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
