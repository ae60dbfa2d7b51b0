"""Deprecated module path: the disk cache of compiled results lives in :mod:`revlib_xla.compiled.cache`. This
module re-exports its names."""

import warnings

from .compiled.cache import DEFAULT_MAX_BYTES, directory_for, load, max_bytes, store

warnings.warn(
    "revlib_xla.compile_cache is deprecated: import from revlib_xla.compiled.cache", DeprecationWarning, stacklevel=2
)

__all__ = ["DEFAULT_MAX_BYTES", "directory_for", "load", "max_bytes", "store"]
