"""Deprecated module path: what a compiled program keeps alive lives in :mod:`revlib_xla.compiled.liveness`. This
module re-exports its names."""

import warnings

from .compiled.liveness import (
    ForwardBackwardSplit,
    LivenessParseError,
    LivePeak,
    all_optimization_barrier_arguments,
    forward_backward_split,
    live_peak,
    optimization_barrier_arguments,
)

warnings.warn(
    "revlib_xla.hlo_liveness is deprecated: import from revlib_xla.compiled.liveness", DeprecationWarning, stacklevel=2
)

__all__ = [
    "ForwardBackwardSplit",
    "LivePeak",
    "LivenessParseError",
    "all_optimization_barrier_arguments",
    "forward_backward_split",
    "live_peak",
    "optimization_barrier_arguments",
]
