"""Deprecated module path: the function facade over the device backends lives in :mod:`revlib_xla.backends`
(``backends.sync``, ``backends.device_for``, ``backends.checkpoint``, ...; defined in
:mod:`revlib_xla.backends.facade`). This module re-exports it."""

import warnings

from . import backends as _backends
from .backends import *  # noqa: F403

warnings.warn(
    "revlib_xla.backend is deprecated: import from revlib_xla.backends (the same names: backends.sync, "
    "backends.device_for, ...)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = list(_backends.__all__)
