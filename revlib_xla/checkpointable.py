"""Deprecated module path: ``Checkpointable`` lives in :mod:`revlib_xla.planner.checkpointable` (and is
``revlib_xla.Checkpointable``). This module re-exports it."""

import warnings

from .planner.checkpointable import Checkpointable, SavedAs
from .planner.stages import atomic, flatten_sequential

warnings.warn(
    "revlib_xla.checkpointable is deprecated: import Checkpointable from revlib_xla (or "
    "revlib_xla.planner.checkpointable)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["Checkpointable", "SavedAs", "atomic", "flatten_sequential"]
