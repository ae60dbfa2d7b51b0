"""Deprecated module path: the recomputation that stops at the last tensor its backward needs
(``DeferredSaves``) lives in :mod:`revlib_xla.planner.early_stop`.
This module re-exports it."""

import warnings

from .planner.early_stop import DeferredSaves, RecomputationMismatch

warnings.warn(
    "revlib_xla.early_stop is deprecated: import from revlib_xla.planner.early_stop",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["DeferredSaves", "RecomputationMismatch"]
