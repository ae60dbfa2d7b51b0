"""Named model sizes: one way for every model family to turn ``name`` plus ``field=value`` overrides into a config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

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
