"""The memory strategy of a training run as named pieces, one per setting of the config's ``strategy`` section.

Each piece (:class:`Piece`, a frozen record) says when it is on, what it refuses to be combined with (each refusal
with its message, so every :class:`StrategyError` about a combination comes from the pieces) and how it applies
itself: options of the model's builder, a conversion of the built model, the optimizer, a scope around the step.
:mod:`revlib_xla.train.strategy` composes the active pieces phase by phase, each phase in :data:`ORDER`:

``model.hf_config``, ``activations=checkpoint``, ``activations=reversible``, ``activations=momentum``, ``exact``,
``model.scan``, ``param_dtype``, ``mesh``, ``fewbit``, ``offload.params``, ``activations=plan``, ``loss_chunk``,
``fused_optimizer``, ``offload.optimizer``, ``precision``, ``offload.activations``.

The modules, by role: :mod:`.base` (the piece, the registry, the order), :mod:`.sizing` (the model's config and
size, the chip, bytes per parameter, the planner's budget), :mod:`.activations`, :mod:`.offload`,
:mod:`.precision`, :mod:`.loss`, :mod:`.optimizer` and :mod:`.hf` (the pieces). A new strategy is one piece,
registered under a name that has its place in :data:`ORDER`.
"""

from . import activations, hf, loss, offload, optimizer, precision
from .base import ORDER, Piece, Refusal, StrategyError, Target, active_pieces, refuse, register, registered

__all__ = [
    "ORDER",
    "Piece",
    "Refusal",
    "StrategyError",
    "Target",
    "active_pieces",
    "refuse",
    "register",
    "registered",
    "activations",
    "hf",
    "loss",
    "offload",
    "optimizer",
    "precision",
]
