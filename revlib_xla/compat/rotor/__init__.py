"""rotor's names (``import rotor`` becomes ``from revlib_xla.compat import rotor``).

* ``rotor.Checkpointable(model, mem_limit=..., preserve_rng_state=...)``, with ``.measure(sample_input)`` and
  ``.compute_sequence(mem_limit)``: :class:`revlib_xla.Checkpointable`, which takes rotor's arguments.
* ``rotor.models``: ResNets written as one ``nn.Sequential`` (:mod:`revlib_xla.models`), and
  ``rotor.models.utils.ReLUAtEnd``.

Not here: ``rotor.Memory.MeasureMemory(device)``, rotor's meter of the CUDA allocator. It needs the memory
statistics of the backend layer, which is being rebuilt as ``revlib_xla.backends``; until then,
``revlib_xla.memory.cuda_peak`` and ``revlib_xla.memory.allocator_peak`` measure a call's peak on cuda and cpu.
"""

from ...planner.checkpointable import Checkpointable
from . import models

__all__ = ["Checkpointable", "models"]
