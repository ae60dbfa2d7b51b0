"""revlib_xla: train PyTorch models that do not fit in accelerator memory, on TPU (torch_xla), GPU and CPU.

The public API is what ``__all__`` lists, by area (each name's own docstring says the rest):

Reversible networks (activation memory that does not grow with depth):
    ``ReversibleSequential``, ``ReversibleModule``, ``MemoryModes``, ``ReversibleError``; ``check_invertible`` and
    ``InvertibilityReport`` measure how exactly the backward rebuilds each layer's input.
Couplings (how a block's output is merged into the other stream, and undone):
    ``additive_coupling_forward``, ``additive_coupling_inverse``, ``momentum_coupling``, ``affine_coupling``,
    ``CouplingPair``.
Planned checkpointing (rotor's optimal schedules, with reversible stages and offload in the plan):
    ``Checkpointable``, ``atomic``, ``flatten_sequential``; the ``planner`` module (chain, solver, schedules).
Parameters off the device, and the optimizer inside the backward:
    ``offload_tensor``, ``ParameterStreamer``, ``OffloadModel``, ``OffloadModelError``; ``fuse_optimizer``,
    ``fused_optimizer_of``, ``FusedOptimizer``, ``FusedOptimizerError``.
Smaller saved activations:
    ``memory_efficient_intermediates``; the ``fewbit`` module (few-bit activations, ``RandomizedLinear``).
Measuring memory:
    the ``memory`` module (``memory.eager_peak``, ``memory.saved_bytes``, ``memory.tpu_memory``, ...).
Will it fit, without the chip:
    the ``fit`` module (a training step traced at full size without allocating it, ``fit.trace_step``; its compiled
    HBM per TPU chip, ``fit.compile_steps``; the largest batch that fits, ``fit.max_batch``; ``fit.CHIPS``).
TPU pods (one process, every chip of a TPU VM, torch_xla SPMD):
    the ``sharding`` module (a mesh from the run config, ``sharding.apply_mesh``; parameters split FSDP-style,
    ``sharding.shard_model``; a traced step partitioned for N chips, ``sharding.shard_step``).
Reference models:
    the ``models`` module (a byte-level transformer LM, ResNets and a GPT as ``nn.Sequential``).
Training runs (what ``revlib-xla train`` does, usable from Python):
    the ``train`` module (``train.load_config``, ``train.build_model``, ``train.make_step``, ``train.train``).
Several processes (DDP and FSDP2 compose with the reversible and planned backwards):
    the ``fsdp`` module (FSDP2 units per block inside them; ``fsdp.counting_collectives`` counts all-gathers).
HuggingFace transformers models (the ``[hf]`` extra):
    the ``hf`` module (``hf.memory_efficient(model, strategy="plan" | "reversible" | "momentum")``,
    ``hf.model_from_config``).

Modules are reached as attributes (``revlib_xla.memory.eager_peak`` after ``import revlib_xla``); they, and the
names above, are imported on first use: ``import revlib_xla`` alone imports neither torch nor torch_xla. Modules and
names with a leading underscore, and modules not named here (``backend``, ``recompute``, ``compiled``, whose public
names ``memory`` re-exports, ``units``, the deprecated ``compile_cache``, ``hlo_liveness`` and ``tpu_compile``,
``demo``), are internal.

Compatibility (thin facades over the API above; the names are the same objects):
    RevLib 1.7: ``import revlib_xla as revlib`` runs RevLib code, with RevLib's defects fixed (see README). Its
    top-level names are here: besides the above, the aliases ``DUAL_OR_QUAD_TENSOR``, ``TENSOR_OR_LIST``,
    ``COUPLING``, ``FUSED_OPTIMIZER`` and ``ReversibleModuleCache``, ``TensorOffload``, ``replace_grad``,
    ``reverse_and_swap``; the modules ``core`` and ``utils`` hold ``revlib.core``'s and ``revlib.utils``'s
    names. rotor, fairscale and FewBit: the ``compat`` module (``compat.rotor``,
    ``compat.fairscale``, ``compat.fewbit``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import compat, core, fewbit, fit, fsdp, hf, memory, models, planner, sharding, train, utils
    from .core import TensorOffload, replace_grad, reverse_and_swap
    from .intermediates import memory_efficient_intermediates
    from .offload import ParameterStreamer
    from .offload_model import OffloadModel, OffloadModelError
    from .optim.fused import FusedOptimizer, FusedOptimizerError, fuse_optimizer, fused_optimizer_of
    from .planner.checkpointable import Checkpointable
    from .planner.stages import atomic, flatten_sequential
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
    from .reversible.coupling import (
        COUPLING,
        TENSOR_OR_LIST,
        CouplingPair,
        additive_coupling_forward,
        additive_coupling_inverse,
        affine_coupling,
        momentum_coupling,
    )

__version__ = "0.1.0"

# Nothing is imported with the package itself (``import revlib_xla`` does not even import torch, so that
# ``revlib-xla --help`` answers at once): a public module is imported on first access, and a public name on first
# access from the module that defines it.
_LAZY_MODULES = (
    "memory",
    "fewbit",
    "models",
    "train",
    "hf",
    "utils",
    "core",
    "compat",
    "fit",
    "sharding",
    "fsdp",
    "planner",
)
_HOMES = {
    "planner.checkpointable": ("Checkpointable",),
    "planner.stages": ("atomic", "flatten_sequential"),
    "core": ("TensorOffload", "replace_grad", "reverse_and_swap"),
    "reversible.coupling": (
        "COUPLING",
        "TENSOR_OR_LIST",
        "CouplingPair",
        "additive_coupling_forward",
        "additive_coupling_inverse",
        "affine_coupling",
        "momentum_coupling",
    ),
    "optim.fused": ("FusedOptimizer", "FusedOptimizerError", "fuse_optimizer", "fused_optimizer_of"),
    "intermediates": ("memory_efficient_intermediates",),
    "offload": ("ParameterStreamer",),
    "offload_model": ("OffloadModel", "OffloadModelError"),
    "reversible": (
        "DUAL_OR_QUAD_TENSOR",
        "FUSED_OPTIMIZER",
        "InvertibilityReport",
        "MemoryModes",
        "ReversibleError",
        "ReversibleModule",
        "ReversibleModuleCache",
        "ReversibleSequential",
        "check_invertible",
        "offload_tensor",
    ),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    # reversible networks
    "ReversibleSequential",
    "ReversibleModule",
    "MemoryModes",
    "ReversibleError",
    "check_invertible",
    "InvertibilityReport",
    # couplings
    "additive_coupling_forward",
    "additive_coupling_inverse",
    "momentum_coupling",
    "affine_coupling",
    "CouplingPair",
    # planned checkpointing
    "Checkpointable",
    "atomic",
    "flatten_sequential",
    "planner",
    # parameters off the device, fused optimizer
    "offload_tensor",
    "ParameterStreamer",
    "OffloadModel",
    "OffloadModelError",
    "fuse_optimizer",
    "fused_optimizer_of",
    "FusedOptimizer",
    "FusedOptimizerError",
    # smaller saved activations, memory, models
    "memory_efficient_intermediates",
    "fewbit",
    "memory",
    "models",
    "train",
    "fit",
    # several processes
    "fsdp",
    "sharding",
    # HuggingFace transformers models
    "hf",
    # RevLib compatibility
    "DUAL_OR_QUAD_TENSOR",
    "TENSOR_OR_LIST",
    "COUPLING",
    "FUSED_OPTIMIZER",
    "ReversibleModuleCache",
    "TensorOffload",
    "replace_grad",
    "reverse_and_swap",
    "core",
    "utils",
    # rotor, fairscale, FewBit compatibility
    "compat",
]


def __getattr__(name: str) -> Any:
    """Import a public module (``_LAZY_MODULES``), or the module defining a public name, on first access."""
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    home = _HOME_OF.get(name)
    if home is not None:
        value = getattr(importlib.import_module(f".{home}", __name__), name)
        globals()[name] = value  # later accesses do not come here
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # an internal module (``revlib_xla.backends``)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_MODULES) | set(_HOME_OF))
