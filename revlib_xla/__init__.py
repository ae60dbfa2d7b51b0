"""revlib_xla: train PyTorch models that do not fit in accelerator memory, on TPU (torch_xla), GPU and CPU.

``import revlib_xla as revlib`` runs code written for RevLib 1.7: the same names, signatures and defaults, with
RevLib's defects fixed (see README). ``revlib_xla.utils`` must be imported explicitly, as in RevLib.
"""

from . import planner
from .checkpointable import Checkpointable, atomic, flatten_sequential
from .coupling import (
    COUPLING,
    TENSOR_OR_LIST,
    CouplingPair,
    additive_coupling_forward,
    additive_coupling_inverse,
    affine_coupling,
    momentum_coupling,
)
from .fused_optimizer import FusedOptimizer, FusedOptimizerError, fuse_optimizer, fused_optimizer_of
from .offload import ParameterStreamer
from .offload_model import OffloadModel, OffloadModelError
from .reversible import (
    DUAL_OR_QUAD_TENSOR,
    FUSED_OPTIMIZER,
    InvertibilityReport,
    MemoryModes,
    ReversibleError,
    ReversibleModule,
    ReversibleModuleCache,
    ReversibleSequential,
    check_invertible,
    offload_tensor,
)

__version__ = "0.1.0"

__all__ = [
    "ReversibleSequential",
    "ReversibleModule",
    "ReversibleModuleCache",
    "MemoryModes",
    "ReversibleError",
    "additive_coupling_forward",
    "additive_coupling_inverse",
    "momentum_coupling",
    "affine_coupling",
    "CouplingPair",
    "check_invertible",
    "InvertibilityReport",
    "offload_tensor",
    "DUAL_OR_QUAD_TENSOR",
    "TENSOR_OR_LIST",
    "COUPLING",
    "FUSED_OPTIMIZER",
    "Checkpointable",
    "atomic",
    "flatten_sequential",
    "planner",
    "fuse_optimizer",
    "fused_optimizer_of",
    "FusedOptimizer",
    "FusedOptimizerError",
    "ParameterStreamer",
    "OffloadModel",
    "OffloadModelError",
]
