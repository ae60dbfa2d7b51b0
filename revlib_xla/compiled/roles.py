"""The roles of a traced step's arguments: what each argument of the program holds. :mod:`revlib_xla.fit.trace`
records them on each :class:`~revlib_xla.fit.StepArgument` (and re-exports them); the fit report splits the compiled
peak by them, and :func:`revlib_xla.sharding.shard_step` shards the arguments by them."""

__all__ = ["PARAMETERS", "OPTIMIZER", "BUFFERS", "INPUTS", "OTHER", "ROLES"]

PARAMETERS = "parameters"
OPTIMIZER = "optimizer state"
BUFFERS = "buffers"
INPUTS = "inputs"
OTHER = "other"
#: The roles of a traced step's arguments; ``other`` holds what the step's code put on the device itself (scalars
#: such as the learning rate, the random seed).
ROLES = (PARAMETERS, OPTIMIZER, BUFFERS, INPUTS, OTHER)
