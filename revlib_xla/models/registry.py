"""Models by name: ``build_model("llama-1b", form="reversible")``, for the CLI, the configs and the benchmarks.

A factory is ``factory(form="plain", **overrides) -> nn.Module``; what ``form`` and ``overrides`` mean is the model
family's (for Llama sizes: a :class:`revlib_xla.models.llama.Form` and :class:`~revlib_xla.models.llama.LlamaConfig`
fields, plus ``checkpoint``, ``beta`` and ``memory_mode``). The built-in families register themselves when their
module is imported; :func:`build_model` and :func:`model_names` import them first.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["Factory", "register", "build_model", "model_names"]

Factory = Callable[..., nn.Module]

# Modules whose import registers the built-in models.
_BUILTIN = ("revlib_xla.models.llama",)

_FACTORIES: dict[str, Factory] = {}


def register(name: str, factory: Factory, *, replace: bool = False) -> None:
    """Make ``build_model(name, form, **overrides)`` call ``factory(form=form, **overrides)``. A name is registered
    once: registering it again raises a ValueError unless ``replace=True``."""
    if not callable(factory):
        raise TypeError(f"register({name!r}, ...): the factory must be callable, got {type(factory).__name__}")
    if name in _FACTORIES and not replace and _FACTORIES[name] is not factory:
        raise ValueError(f"a model named {name!r} is already registered; pass replace=True to replace it")
    _FACTORIES[name] = factory


def _load_builtin() -> None:
    for module in _BUILTIN:
        importlib.import_module(module)


def model_names() -> list[str]:
    """The registered names, in registration order (built-in families first)."""
    _load_builtin()
    return list(_FACTORIES)


def build_model(name: str, form: str = "plain", **overrides: Any) -> nn.Module:
    """The model registered as ``name`` in ``form``, with ``overrides``. An unknown name raises a ValueError that
    lists the registered names (and the closest one)."""
    _load_builtin()
    if name not in _FACTORIES:
        close = difflib.get_close_matches(name, _FACTORIES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown model {name!r}{hint}; expected one of {', '.join(_FACTORIES)}")
    return _FACTORIES[name](form=form, **overrides)
