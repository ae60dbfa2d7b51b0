"""What a strategy piece is, the registry of pieces and the fixed order they compose in.

A piece is one setting of the config's ``strategy`` section (``offload.params``, ``precision``, ...) as a small
frozen record: when it is on (:attr:`Piece.active`), what it refuses to be combined with (:attr:`Piece.refuses`,
each with its message), and the hooks by which it applies itself: options of the model's builder, a conversion of
the built model, the optimizer, a scope around the step's forward. :func:`revlib_xla.train.strategy.build_model`,
``build_optimizer`` and ``make_step`` run the active pieces' hooks phase by phase, each phase in :data:`ORDER`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from ..config import RunConfig

__all__ = [
    "StrategyError",
    "Refusal",
    "Target",
    "Options",
    "Piece",
    "ORDER",
    "register",
    "registered",
    "active_pieces",
    "refuse",
    "LanguageModel",
    "lm_loss",
    "language_model",
]


class StrategyError(ValueError):
    """A combination of ``strategy.*`` (or model) settings the library cannot run correctly; the message names the
    keys and what to use instead."""


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A combination a piece refuses: ``combined_with`` names the other setting (for the reader and the docs);
    ``message(cfg)`` returns the :class:`StrategyError` message where ``cfg`` combines them, else ``None``."""

    combined_with: str
    message: Callable[[RunConfig], str | None]


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the model being built runs: ``device`` (its step's device), ``on_meta`` (nothing allocated), ``mesh``
    (the SPMD mesh over it, or None), ``budget`` (``activations=plan``'s bytes, else 0), ``dtype`` (the weights'
    dtype the caller asked for, or None) and ``placed`` (the parameters written split over the mesh already)."""

    device: torch.device
    on_meta: bool
    mesh: Any
    budget: int
    dtype: torch.dtype | None = None
    placed: Collection[int] = ()


Options = dict[str, Any]
"""Keyword arguments of :func:`revlib_xla.models.llama.build_llama` that pieces fill in."""

OptimizerHook = Callable[["RunConfig", nn.Module, list[nn.Parameter], list[int]], torch.optim.Optimizer | None]
ScopeFactory = Callable[[], contextlib.AbstractContextManager[Any]]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One named strategy setting: what it declares, and the hooks by which it applies itself (all optional).

    Declared: ``refuses`` (the combinations it refuses, each with its message), ``weights_on_host`` (the weights
    are written in host memory, not on the device), ``weight_dtype`` (the dtype they are written in).

    Hooks, by phase:

    * ``budget(cfg)``: the activation budget in bytes it plans to, decided before anything is allocated.
    * ``build(cfg, target)``: builds the whole model instead of :func:`revlib_xla.models.llama.build_llama` (a
      transformers model).
    * ``options(cfg, options, target)``: fills in the builder's keyword arguments (form, checkpointing, ...);
      ``build_error(cfg, exc)``: the message of a builder's :class:`revlib_xla.ReversibleError` it explains.
    * ``convert(cfg, model, target)``: the built LM (weights written) -> the model (a cast, a conversion, a
      wrapper).
    * ``optimizer(cfg, model, params, ndims)``: an optimizer over ``params``, or None to leave it to the next piece
      (the first piece that returns one builds it; none: AdamW on the device).
    * ``step_scope(cfg, device)``: called when the step is made (it may refuse the device); returns what makes
      the context each micro-batch's forward runs in (autocast, saved tensors kept in host memory).
    """

    name: str
    active: Callable[[RunConfig], bool]
    refuses: tuple[Refusal, ...] = ()
    weights_on_host: bool = False
    weight_dtype: torch.dtype | None = None
    budget: Callable[[RunConfig], int] | None = None
    build: Callable[[RunConfig, Target], nn.Module] | None = None
    options: Callable[[RunConfig, Options, Target], None] | None = None
    build_error: Callable[[RunConfig, Exception], str] | None = None
    convert: Callable[[RunConfig, nn.Module, Target], nn.Module] | None = None
    optimizer: OptimizerHook | None = None
    step_scope: Callable[[RunConfig, torch.device], ScopeFactory] | None = None


ORDER: tuple[str, ...] = (
    "model.hf_config",
    "activations=checkpoint",
    "activations=reversible",
    "activations=momentum",
    "exact",
    "model.scan",
    "param_dtype",
    "mesh",
    "fewbit",
    "offload.params",
    "activations=plan",
    "loss_chunk",
    "fused_optimizer",
    "offload.optimizer",
    "precision",
    "offload.activations",
)
"""The order the pieces compose in, in every phase (refusals, builder options, conversions, optimizer, step scope).

It is what the strategies mean: the weights are cast (``param_dtype``) before they are split over a mesh and before
a wrapper streams or plans the model (``offload.params``, ``activations=plan``, which measures the model it wraps);
the fused optimizer is chosen before the host optimizer; autocast is entered before saved tensors go to the host.
The refusals run in this order, so where a config makes several mistakes the first is said."""

_REGISTRY: dict[str, Piece] = {}


def register(piece: Piece) -> Piece:
    """Add ``piece`` to the registry under its name, which must be one of :data:`ORDER` (its place)."""
    if piece.name not in ORDER:
        raise ValueError(f"strategy piece {piece.name!r} has no place in ORDER; add it there")
    if piece.name in _REGISTRY:
        raise ValueError(f"strategy piece {piece.name!r} is registered twice")
    _REGISTRY[piece.name] = piece
    return piece


def registered() -> list[Piece]:
    """Every registered piece, in :data:`ORDER`."""
    return [_REGISTRY[name] for name in ORDER if name in _REGISTRY]


def active_pieces(cfg: RunConfig) -> Iterator[Piece]:
    """The pieces ``cfg`` turns on, in :data:`ORDER`."""
    return (piece for piece in registered() if piece.active(cfg))


def refuse(cfg: RunConfig) -> None:
    """Raise :class:`StrategyError` with the first refusal of an active piece (in :data:`ORDER`) that ``cfg`` meets."""
    for piece in active_pieces(cfg):
        for refusal in piece.refuses:
            message = refusal.message(cfg)
            if message is not None:
                raise StrategyError(message)


# ----------------------------------------------------------------------------------------------------------------
# What every model the pieces build has


class LanguageModel(Protocol):
    """What the loop needs of a model: the next-token loss of a ``(B, T)`` token batch."""

    def loss(self, tokens: Tensor) -> Tensor: ...


def lm_loss(model: nn.Module, tokens: Tensor) -> Tensor:
    """``model.loss(tokens)``: the LMs and the wrappers here all have it."""
    return cast(LanguageModel, model).loss(tokens)


def language_model(model: nn.Module) -> nn.Module:
    """The LM inside ``model`` (the module whose weights a checkpoint saves): a wrapper's ``lm``, else ``model``."""
    inner = getattr(model, "lm", None)
    return inner if isinstance(inner, nn.Module) else model
