"""Checkpoint planning: the fastest schedule of a sequential network under a memory budget, in parts.

* the cost model: :class:`Chain` (rotor's, plus reversible stages, host offload and compressed variants);
* planning, pure (a chain in, a schedule out): :func:`solve` finds the optimal persistent schedule, :func:`plan`
  the same for a budget that also holds values outside the chain;
* schedules: :class:`Schedule` lists :class:`Op` s of the kinds :class:`OpKind`, each with one row in
  :data:`OPERATIONS` (its time, its rule on the cost model :class:`Simulation`, its rule on the executor);
  :func:`early_stops` says which recomputations stop at their last saved tensor (priced ``Chain.stopped_fw``);
* sizing: :func:`measure_chain` measures a model's stages into a chain (eager, or the TPU compiler on XLA),
  :func:`fit_budget` searches a budget whose compiled step fits a TPU;
* execution: :func:`run_schedule` and :class:`ScheduleExecutor` run a schedule on a model's stages.

``revlib_xla.Checkpointable`` composes them: it measures a model, plans and runs the schedule.
"""

from .chain import Chain, StageCache, StageOption
from .execute import ScheduleExecutor, check_schedule, run_schedule
from .schedule import (
    KINDS,
    OPERATIONS,
    Op,
    Operation,
    OpKind,
    Schedule,
    ScheduleError,
    Simulation,
    ValueKind,
    early_stops,
    simulate,
)
from .sizing import MeasuredChain, Sizing, fit_budget, measure_chain
from .solver import InfeasibleBudget, min_memory, no_checkpoint_memory, plan, solve
from .stages import atomic, flatten_sequential

__all__ = [
    "Chain",
    "StageOption",
    "StageCache",
    "Op",
    "OpKind",
    "Operation",
    "OPERATIONS",
    "ValueKind",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "simulate",
    "early_stops",
    "KINDS",
    "solve",
    "plan",
    "min_memory",
    "no_checkpoint_memory",
    "InfeasibleBudget",
    "Sizing",
    "MeasuredChain",
    "measure_chain",
    "fit_budget",
    "ScheduleExecutor",
    "run_schedule",
    "check_schedule",
    "atomic",
    "flatten_sequential",
]
