"""``revlib-xla train``: train a Llama-style LM from a config with a memory strategy, end to end.

The parts, each usable on its own: :mod:`~revlib_xla.train.config` (the typed run configuration, YAML and
``key=value`` overrides), :mod:`~revlib_xla.train.strategy` (the model, optimizer and step a strategy asks for,
composed from the named pieces of :mod:`~revlib_xla.train.strategies`),
:mod:`~revlib_xla.train.data` (token streams and a resumable sampler), :mod:`~revlib_xla.train.checkpoint`
(atomic checkpoints), :mod:`~revlib_xla.train.metrics` (progress bar, JSON lines, TensorBoard) and
:mod:`~revlib_xla.train.loop` (the loop: evaluation, preemption, bit-exact resume).
"""

from .checkpoint import CheckpointError, CheckpointMismatch
from .config import ConfigError, RunConfig, load_config
from .loop import DivergedError, TrainResult, train
from .rundir import RunDirError
from .strategy import StrategyError, build_model, build_optimizer, make_step

__all__ = [
    "ConfigError",
    "RunConfig",
    "load_config",
    "StrategyError",
    "build_model",
    "build_optimizer",
    "make_step",
    "TrainResult",
    "train",
    "DivergedError",
    "CheckpointError",
    "CheckpointMismatch",
    "RunDirError",
]
