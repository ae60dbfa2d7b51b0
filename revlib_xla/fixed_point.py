"""Deprecated module path: exact (fixed-point) streams live in :mod:`revlib_xla.reversible.fixed_point`. This
module re-exports its names."""

import warnings

from .reversible.fixed_point import *  # noqa: F403
from .reversible.fixed_point import __all__ as __all__

warnings.warn(
    "revlib_xla.fixed_point is deprecated: import from revlib_xla.reversible.fixed_point",
    DeprecationWarning,
    stacklevel=2,
)
