"""Deprecated module path: the selective recomputation of attention (``AttentionCache``) lives in
:mod:`revlib_xla.planner.attention_cache`. This module re-exports it."""

import warnings

from .planner.attention_cache import AttentionCache, is_fused_attention

warnings.warn(
    "revlib_xla.attention_cache is deprecated: import from revlib_xla.planner.attention_cache",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["AttentionCache", "is_fused_attention"]
