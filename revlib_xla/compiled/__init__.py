"""Compiled sizing: how much memory the compiler plans for a program, asked of the compiler itself, no device needed.

One concept per module: the deviceless compile worker, which imports only the standard library until it compiles
(``worker.py``: run in a child process for a TPU topology, or in-process for XLA:CPU), the peak of what a compiled
program keeps alive, read from its buffer assignment (``liveness.py``), the disk cache of compiled results
(``cache.py``), :class:`~revlib_xla.compiled.memory.CompiledMemory` and the functions that compile for it
(``memory.py``: ``tpu_memory``, ``xla_cpu_memory``, ...), the StableHLO of a training step traced without running
(``stablehlo.py``) and the roles of its arguments (``roles.py``). The public names are re-exported by
:mod:`revlib_xla.memory`, where users find them. This package's ``__init__`` imports nothing, so that the worker and
the liveness reader load without torch.
"""
