"""Shared by the model families: named sizes with ``field=value`` overrides, and the check of an image batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

Config = TypeVar("Config")


def named_config(family: str, sizes: Mapping[str, Config], name: str, overrides: Mapping[str, Any]) -> Config:
    """``sizes[name]`` with ``overrides`` replacing its fields (a frozen dataclass, validated again on replace).

    An unknown name or field is a ValueError that lists the choices, so a typo in a config file says what to write.
    """
    if name not in sizes:
        raise ValueError(f"unknown {family} model {name!r}; expected one of {', '.join(sizes)}")
    config = sizes[name]
    fields = {f.name for f in dataclasses.fields(config)}  # type: ignore[arg-type]  # Config is a dataclass
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"{family} model {name!r}: unknown field(s) {', '.join(unknown)}; "
            f"expected some of {', '.join(sorted(fields))}"
        )
    return dataclasses.replace(config, **overrides)  # type: ignore[type-var]  # Config is a dataclass


def check_images(model: str, images: torch.Tensor, in_channels: int, multiple: int, example: int, why: str) -> None:
    """Raise a ValueError naming the problem and the fix unless ``images`` is ``(batch, in_channels, H, W)`` with
    ``H`` and ``W`` multiples of ``multiple`` (``why`` says what needs that)."""
    if images.dim() != 4 or images.shape[1] != in_channels:
        raise ValueError(
            f"{model} expects images of shape (batch, {in_channels}, height, width), got {tuple(images.shape)}"
        )
    if images.shape[2] % multiple or images.shape[3] % multiple:
        raise ValueError(
            f"{model}: image size {tuple(images.shape[2:])} is not a multiple of {multiple} ({why}); resize or crop "
            f"to a multiple, e.g. {example}x{example}"
        )
