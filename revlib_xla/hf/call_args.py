"""What a converted model's layers are called with in training: any KV cache dropped (the backward runs the layers
again), whether transformers is collecting per-layer outputs, and on a lazy device (XLA) the causal mask built ahead
(:func:`_causal_mask_on_lazy_devices`, a forward pre-hook). Used by :mod:`revlib_xla.hf.convert`."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
from torch import nn

from .. import backends
from .._tree import tree_leaves
from .layers import HFConversionError
from .masks import causal_mask


def _cache_type() -> type | None:
    return getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)


def _capturing_outputs() -> bool:
    """Whether transformers is collecting per-layer outputs (``output_hidden_states``/``output_attentions``) with
    its forward hooks (5.x's ``capture_outputs``); False where this version has no such collector."""
    for name in ("transformers.utils.output_capturing", "transformers.utils.generic"):
        collector = getattr(sys.modules.get(name), "_active_collector", None)
        if collector is not None:
            try:
                return bool(collector.get())
            except Exception:  # a collector of another shape: not one this code knows
                return False
    return False


def _without_cache(args: tuple[Any, ...], kwargs: dict[str, Any], strategy: str) -> tuple[tuple, dict]:
    """The layer arguments of a training forward with any KV cache replaced by ``None`` and ``use_cache=False``:
    the backward runs the layers again, which would write (and attend to) their keys and values a second time. An
    empty cache is dropped with a warning; one that already holds tokens is refused."""
    cache_type = _cache_type()
    if cache_type is None:
        return args, kwargs
    found: list[Any] = [v for v in tree_leaves((args, kwargs)) if isinstance(v, cache_type)]
    if not found:
        return args, kwargs
    for cache in found:
        if cache.get_seq_length() > 0:
            raise HFConversionError(
                f"strategy={strategy!r}: a training forward got a {type(cache).__name__} that already holds "
                f"{cache.get_seq_length()} tokens; its backward runs the layers again and would append their keys "
                f"and values a second time. Train without past_key_values, or run it under torch.no_grad()"
            )
    warnings.warn(
        f"revlib_xla.hf ({strategy}): a training forward with use_cache=True; the KV cache is not written (the "
        f"backward recomputes the layers, which would write it twice). Pass use_cache=False when training",
        stacklevel=4,
    )

    def clean(value: Any) -> Any:
        return None if isinstance(value, cache_type) else value

    kwargs = {k: clean(v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return tuple(clean(a) for a in args), kwargs


def _takes_causal_mask(model: nn.Module) -> bool:
    """Whether ``model`` is a decoder-only causal LM of a family :mod:`revlib_xla.hf.configs` knows, attending to
    all earlier positions (no sliding window): the mask transformers builds without an ``attention_mask`` is then
    the plain causal one."""
    from .configs import CONFIGS

    config = getattr(model, "config", None)
    causal = {model_type for model_type, task, _ in CONFIGS.values() if task == "causal-lm"}
    return (
        config is not None
        and getattr(config, "model_type", None) in causal
        and not getattr(config, "is_encoder_decoder", False)
        and not getattr(config, "sliding_window", None)
        and "sliding_attention" not in (getattr(config, "layer_types", None) or ())
        and callable(getattr(model, "generate", None))  # a language model, not a classifier on the same layers
    )


def _causal_mask_on_lazy_devices(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """On a lazy device (XLA), a call without ``attention_mask``, ``position_ids`` and KV cache gets the causal mask
    as a 4-D tensor (what transformers would build): without one, transformers reads the position ids from the
    device to look for packed sequences, which runs the graph in the middle of every step."""
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if not isinstance(tokens, torch.Tensor) or not backends.is_tracing_lazily(tokens) or args[1:]:
        return None
    if any(kwargs.get(k) is not None for k in ("attention_mask", "position_ids", "past_key_values", "inputs_embeds")):
        return None
    mask = causal_mask(model, tokens)
    return None if mask is None else (args, {**kwargs, "attention_mask": mask})
