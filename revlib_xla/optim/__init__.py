"""Optimizers that keep a training step's gradients and optimizer state off the device.

* :mod:`.fused`: the step fused into the backward pass (:func:`fuse_optimizer`): each parameter is updated as soon
  as its gradient is complete, and the gradient freed.
* :mod:`.host`: the state and float32 master weights in host memory, the update run there (:class:`HostOptimizer`).
"""

from .fused import (
    FusedOptimizer,
    FusedOptimizerError,
    OptimizerFactory,
    StepsInBackward,
    fuse_optimizer,
    fused_optimizer_of,
)
from .host import HostOptimizer

__all__ = [
    "OptimizerFactory",
    "FusedOptimizer",
    "FusedOptimizerError",
    "StepsInBackward",
    "fuse_optimizer",
    "fused_optimizer_of",
    "HostOptimizer",
]
