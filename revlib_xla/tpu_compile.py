"""Deprecated module path: the deviceless compile worker lives in :mod:`revlib_xla.compiled.worker`. This module
re-exports its names."""

import warnings

from .compiled.worker import (
    HBM_ONLY_FLAGS,
    JAX_VERSION_TESTED,
    SLICE_TOPOLOGIES,
    STAT_FIELDS,
    TPU_GENERATIONS,
    compile_for_cpu,
    compile_for_tpu,
    compile_module,
    dump_flags,
    main,
    slice_topology,
    tpu_environment,
    versions,
)

warnings.warn(
    "revlib_xla.tpu_compile is deprecated: import from revlib_xla.compiled.worker", DeprecationWarning, stacklevel=2
)

__all__ = [
    "HBM_ONLY_FLAGS",
    "JAX_VERSION_TESTED",
    "SLICE_TOPOLOGIES",
    "STAT_FIELDS",
    "TPU_GENERATIONS",
    "compile_for_cpu",
    "compile_for_tpu",
    "compile_module",
    "dump_flags",
    "main",
    "slice_topology",
    "tpu_environment",
    "versions",
]
