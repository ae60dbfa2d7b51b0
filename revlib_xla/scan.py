"""Deprecated module path: the scanned reversible sequence and stacked parameter storage live in
:mod:`revlib_xla.reversible` (``stack_layers``, ``layer_parameters``, ``layer_shape``, ...), the scanned runs of a
``Checkpointable`` in :mod:`revlib_xla.planner.scanned` (``ScannedStages``). This module re-exports them."""

import warnings

from .planner.scanned import ScannedStages, scan_runs
from .reversible import (
    ReplacedParameterError,
    ScanUnsupported,
    layer_parameters,
    layer_shape,
    repeat_period,
    stack_layers,
)
from .reversible.stacks import stacked_views, stacks_of

warnings.warn(
    "revlib_xla.scan is deprecated: import stack_layers, layer_parameters and layer_shape from revlib_xla.reversible, "
    "ScannedStages from revlib_xla.planner.scanned",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = [
    "ReplacedParameterError",
    "ScanUnsupported",
    "ScannedStages",
    "layer_parameters",
    "layer_shape",
    "repeat_period",
    "scan_runs",
    "stack_layers",
    "stacked_views",
    "stacks_of",
]
