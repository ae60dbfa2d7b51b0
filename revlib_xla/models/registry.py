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

from ..reversible import MemoryModes

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


_PLAIN_AUTOGRAD: dict[str, Any] = {"memory_mode": MemoryModes.no_savings}

# Families with named sizes that do not register themselves: (module, names function, builder, forms). A form
# maps to the keyword arguments it gives the builder; the vision models' "plain" is plain autograd of the same
# function (MemoryModes.no_savings), the Reformer's forms are its flavours.
_FAMILIES: tuple[tuple[str, str, str, dict[str, dict[str, Any]]], ...] = (
    ("revlib_xla.models.revnet", "revnet_names", "build_revnet", {"plain": _PLAIN_AUTOGRAD, "reversible": {}}),
    ("revlib_xla.models.irevnet", "irevnet_names", "build_irevnet", {"plain": _PLAIN_AUTOGRAD, "reversible": {}}),
    (
        "revlib_xla.models.reformer",
        "reformer_names",
        "build_reformer",
        {
            "plain": {"flavour": "no_savings"},
            "checkpoint": {"flavour": "checkpoint"},
            "reversible": {"flavour": "reversible"},
        },
    ),
    ("revlib_xla.models.zoo", "zoo_names", "build_zoo", {"plain": {}}),
)


def _family_factory(name: str, build: Callable[..., nn.Module], forms: dict[str, dict[str, Any]]) -> Factory:
    def factory(form: str = "plain", **overrides: Any) -> nn.Module:
        if form not in forms:
            raise ValueError(f"model {name!r} has no form {form!r}; expected one of {', '.join(forms)}")
        return build(name, **forms[form], **overrides)

    return factory


def _load_builtin() -> None:
    for module in _BUILTIN:
        importlib.import_module(module)
    for module, names, builder, forms in _FAMILIES:
        loaded = importlib.import_module(module)
        build = getattr(loaded, builder)
        for name in getattr(loaded, names)():
            if name not in _FACTORIES:
                _FACTORIES[name] = _family_factory(name, build, forms)


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
