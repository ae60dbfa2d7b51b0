"""Deterministic memory measurement for training steps: what autograd keeps, the eager peak, and compiled XLA memory.

Three questions, three tools, all giving the same bytes when asked twice:

1. **What does autograd keep for the backward pass?** :class:`SavedTensorCounter` / :func:`saved_bytes` count the
   bytes of tensors saved for backward (``torch.autograd.graph.saved_tensors_hooks``), each storage once. This is
   the right number for "this block saves only its output" or "compression halves what is kept" assertions.
2. **What is the eager peak of a step, and what is it made of?** :func:`eager_peak` runs a step under PyTorch's
   ``MemTracker`` and splits the peak into parameters, gradients, activations, temporaries, optimizer state,
   buffers and inputs. It works for CPU and CUDA tensors, and under ``FakeTensorMode`` (``fake=True``) so a model
   that does not fit anywhere can be sized on a laptop. :func:`cuda_peak` gives the CUDA caching allocator's own
   ``max_memory_allocated`` for a call; :func:`allocator_peak` how far the allocator's bytes rose during a call on
   cpu (profiler memory events) or cuda, which also sees what ``torch.compile``'d code allocates.
3. **How much memory does the compiled XLA step need?** On XLA the Python lifetimes above mean nothing: the compiler
   decides what lives when. That part lives in :mod:`revlib_xla.compiled` and is re-exported here:
   :func:`step_stablehlo` traces one training step on the XLA device and returns its
   StableHLO (loss and every parameter gradient); :func:`xla_cpu_memory` compiles it for XLA:CPU in-process and
   :func:`tpu_memory` compiles it for a TPU generation (v5e by default; v5p, v6e) *without a TPU*, with libtpu's
   deviceless compiler in a child process. TPU figures are what the TPU compiler plans for one chip - they come
   from the TPU compiler, not from a TPU run. XLA:CPU numbers are useful for execution-level sanity checks but
   cannot judge rematerialisation, reversible or offload policies (XLA:CPU removes optimization barriers early
   and CSE merges recomputation back into the forward); use the TPU compiler for those.

Compiled results are cached by a hash of the StableHLO text (plus compiler versions and flags): in memory always,
and on disk when asked (``disk_cache=True`` or the ``REVLIB_XLA_CACHE`` environment variable). Byte counts in words
(:func:`format_bytes`, :func:`parse_bytes`) live in :mod:`revlib_xla.units`. Nothing here prints;
progress and timings go to the ``revlib_xla.memory`` logger at DEBUG level.

One question per module: ``saved.py`` (1), ``eager.py`` (2: the eager peak and :class:`StorageTracker`),
``allocator.py`` (2: the allocator's peaks); (3) in :mod:`revlib_xla.compiled`. Every public name is importable from
here.
"""

from __future__ import annotations

from ..compiled.memory import (
    MATMUL_PATTERN,
    TPU_GENERATIONS,
    CompiledMemory,
    MissingDependencyError,
    TpuCompileError,
    clear_compile_cache,
    compile_timeout,  # noqa: F401  (not in __all__, but read as memory.compile_timeout)
    tpu_memory,
    tpu_memory_many,
    tpu_memory_results,
    xla_cpu_memory,
)
from ..compiled.stablehlo import stablehlo_of, step_stablehlo
from ..units import BYTE_UNITS, format_bytes, parse_bytes  # noqa: F401  (BYTE_UNITS: as memory.BYTE_UNITS)
from .allocator import AllocatorPeak, CudaPeak, allocator_peak, cuda_peak
from .eager import EagerPeak, MemoryBreakdown, StorageTracker, eager_peak
from .saved import SavedTensorCounter, saved_bytes, storage_of, tensor_bytes

__all__ = [
    "SavedTensorCounter",
    "saved_bytes",
    "storage_of",
    "tensor_bytes",
    "MemoryBreakdown",
    "EagerPeak",
    "StorageTracker",
    "eager_peak",
    "CudaPeak",
    "cuda_peak",
    "AllocatorPeak",
    "allocator_peak",
    "CompiledMemory",
    "stablehlo_of",
    "step_stablehlo",
    "xla_cpu_memory",
    "tpu_memory",
    "tpu_memory_many",
    "tpu_memory_results",
    "clear_compile_cache",
    "TPU_GENERATIONS",
    "MATMUL_PATTERN",
    "MissingDependencyError",
    "TpuCompileError",
    "format_bytes",
    "parse_bytes",
]
