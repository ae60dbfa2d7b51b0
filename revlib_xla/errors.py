"""The library's error types that several modules raise (the lowest layer: imports nothing of the package)."""

from __future__ import annotations

__all__ = ["FusedOptimizerError", "ReversibleError"]


class ReversibleError(ValueError):
    """A reversible model was given input it cannot handle; the message names the layer and the problem."""


class FusedOptimizerError(ValueError):
    """A fused optimizer was asked for something it cannot do; the message names the parameter and the problem."""
