"""Saving and loading converted models honestly.

A ``plan`` conversion computes the original function: ``save_pretrained`` writes a plain transformers model, and plain
transformers loads it as what it is. ``reversible`` (another function) and ``momentum`` (the original one only up to
``beta``) do not: the weights alone, loaded as the plain architecture, compute something else. Their
``save_pretrained`` therefore marks the saved config:

* ``model_type`` becomes ``revlib_xla:<strategy>:<model type>``, which transformers does not know:
  ``AutoModelForCausalLM.from_pretrained`` refuses the folder (naming that type), and an architecture's own class
  (``LlamaForCausalLM.from_pretrained``) warns that the checkpoint is of another type;
* a ``revlib_xla`` entry records the conversion (strategy, its settings, the original model type) and how to load
  it: :func:`revlib_xla.hf.from_pretrained` (:mod:`revlib_xla.hf.loading`), which builds the model and converts it
  again in one call (a fresh process needs nothing else).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["MARK", "FUNCTION_CHANGING", "saved_mark", "MarkedSave"]

#: the config entry a marked save writes
MARK = "revlib_xla"
#: the strategies whose function differs from the plain architecture's
FUNCTION_CHANGING = ("reversible", "momentum")


def saved_mark(conversion: Any, model_type: str) -> dict[str, Any]:
    """What a marked config records of ``conversion`` (a :class:`~revlib_xla.hf.convert.Conversion`)."""
    return {
        "strategy": conversion.strategy,
        "options": dict(conversion.options),
        "original_model_type": model_type,
        "load_with": "revlib_xla.hf.from_pretrained(path)",
        "why": (
            f"trained as revlib_xla.hf.memory_efficient(model, {conversion.strategy!r}): the plain architecture "
            f"computes another function with these weights"
        ),
    }


def _marked_config_class(base: type, model_type: str) -> type:
    return type(base.__name__, (base,), {"model_type": model_type, "__module__": base.__module__})


class MarkedSave:
    """``model.save_pretrained`` of a model whose conversion changes its function: the original method, with the
    saved config marked (the config's class reports the marked ``model_type`` for the duration of the call, and the
    ``revlib_xla`` entry is in it); the model in memory is unchanged afterwards."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def original(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.model).save_pretrained(self.model, *args, **kwargs)  # type: ignore[attr-defined]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        config = getattr(self.model, "config", None)
        conversion = getattr(self.model, "revlib_xla_conversion", None)
        if config is None or conversion is None or conversion.strategy not in FUNCTION_CHANGING:
            return self.original(*args, **kwargs)
        base = type(config)
        model_type = getattr(base, "model_type", "") or "unknown"
        config.__class__ = _marked_config_class(base, f"revlib_xla:{conversion.strategy}:{model_type}")
        setattr(config, MARK, saved_mark(conversion, model_type))
        try:
            return self.original(*args, **kwargs)
        finally:
            config.__class__ = base
            delattr(config, MARK)
