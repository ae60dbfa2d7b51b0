"""Deprecated module path: the couplings live in :mod:`revlib_xla.reversible.coupling` (and their public names in
``revlib_xla``). This module re-exports them."""

import warnings

from .reversible.coupling import *  # noqa: F403
from .reversible.coupling import __all__ as __all__

warnings.warn(
    "revlib_xla.coupling is deprecated: import the couplings from revlib_xla (or revlib_xla.reversible.coupling)",
    DeprecationWarning,
    stacklevel=2,
)
