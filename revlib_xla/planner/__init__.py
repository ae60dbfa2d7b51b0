"""Checkpoint planning: the fastest schedule of a sequential network under a memory budget.

:class:`Chain` is the cost model (rotor's, plus reversible stages, host offload and compressed variants);
:func:`solve` finds the optimal persistent schedule; :class:`Schedule` lists its operations.
``revlib_xla.Checkpointable`` measures a model and runs the schedule.
"""

from .chain import Chain, StageOption
from .schedule import KINDS, Op, Schedule, ScheduleError, simulate
from .solver import InfeasibleBudget, min_memory, no_checkpoint_memory, solve

__all__ = [
    "Chain",
    "StageOption",
    "Op",
    "Schedule",
    "ScheduleError",
    "simulate",
    "KINDS",
    "solve",
    "min_memory",
    "no_checkpoint_memory",
    "InfeasibleBudget",
]
