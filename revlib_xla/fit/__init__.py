"""Will it fit? The memory of a real training step on a chip, without the chip (``revlib-xla memory`` and ``plan``).

* :mod:`revlib_xla.chips`: the TPU chips and GPUs sized for (:data:`CHIPS`, re-exported here);
* :mod:`.trace`: a step traced at full size without allocating it (:func:`trace_step`), its aliases marked;
* :mod:`.report`: the compiled peak per chip, split into what backs each part (:func:`fit_report`);
* :mod:`.search`: the largest batch that fits, per strategy (:func:`max_batch`).
"""

from ..chips import CHIPS, GPU_CHIPS, TPU_CHIPS, Chip, chip
from .report import FitReport, compile_steps, fit_report, format_table
from .search import BatchSearch, max_batch
from .trace import ROLES, StepArgument, TracedStep, mark_aliases, stablehlo_arguments, trace_step

__all__ = [
    "CHIPS",
    "GPU_CHIPS",
    "TPU_CHIPS",
    "Chip",
    "chip",
    "ROLES",
    "StepArgument",
    "TracedStep",
    "mark_aliases",
    "stablehlo_arguments",
    "trace_step",
    "FitReport",
    "compile_steps",
    "fit_report",
    "format_table",
    "BatchSearch",
    "max_batch",
]
