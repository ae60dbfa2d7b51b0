"""The earlier reference models (the demo's byte-level LM, the planner's GPT and ResNets) by name, so the model
registry lists them beside the newer families; the modules themselves are unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from .gpt import gpt
from .resnet import resnet18, resnet50, resnet101
from .transformer import Flavour, TransformerConfig, build_lm

__all__ = ["zoo_names", "build_zoo"]


def _byte_lm(flavour: str = Flavour.REVERSIBLE, **config: Any) -> nn.Module:
    return build_lm(TransformerConfig(**config), flavour)


def _gpt(reversible: bool = False, **config: Any) -> nn.Module:
    return gpt(TransformerConfig(**config), reversible)


_ZOO: dict[str, Callable[..., nn.Module]] = {
    "byte-lm": _byte_lm,  # overrides: flavour and TransformerConfig fields
    "gpt": _gpt,  # overrides: reversible and TransformerConfig fields
    "resnet18": resnet18,  # overrides: num_classes, width, in_channels
    "resnet50": resnet50,
    "resnet101": resnet101,
}


def zoo_names() -> list[str]:
    """The earlier reference models, for the model registry."""
    return list(_ZOO)


def build_zoo(name: str, **overrides: Any) -> nn.Module:
    """Reference model ``name`` (one of :func:`zoo_names`) built with ``overrides`` as keyword arguments; unknown
    names or arguments raise ValueError naming the choices."""
    if name not in _ZOO:
        raise ValueError(f"unknown reference model {name!r}; expected one of {', '.join(_ZOO)}")
    try:
        return _ZOO[name](**overrides)
    except TypeError as error:
        if "unexpected keyword argument" not in str(error):
            raise
        raise ValueError(f"reference model {name!r}: {error}") from None
