"""The fused optimizer, kept at :mod:`revlib_xla.optim.fused`; this name stays so ``revlib_xla.fused_optimizer``
imports keep working."""

from .optim.fused import (
    FusedOptimizer,
    FusedOptimizerError,
    OptimizerFactory,
    StepsInBackward,
    fuse_optimizer,
    fused_optimizer_of,
)

__all__ = [
    "OptimizerFactory",
    "FusedOptimizer",
    "FusedOptimizerError",
    "StepsInBackward",
    "fuse_optimizer",
    "fused_optimizer_of",
]
