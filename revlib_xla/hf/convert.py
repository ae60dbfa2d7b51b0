"""``memory_efficient(model, strategy=...)``: a transformers model's layer stack run with less activation memory.

The layer list (``model.model.layers``, ``transformer.h``, ``gpt_neox.layers``, ``bert.encoder.layer``...) is
replaced by a :class:`ConvertedLayers`: the same layer objects under the same names (state-dict keys, ``layer_idx``
and so the KV cache's indexing do not change), which, while the stack's own forward iterates it, yields one runner
that runs every layer under the strategy:

* ``plan``: the layers as the stages of a :class:`revlib_xla.Checkpointable` (the planner's fastest schedule
  within ``budget``), in training forwards with gradients; the plain layers otherwise (generation, eval).
  Function-preserving: the same outputs and gradients.
* ``reversible``: every layer's attention branch ``F`` and MLP branch ``G`` become two layers of a
  :class:`revlib_xla.ReversibleSequential` on two streams that both start as the hidden state:
  ``x1 += F(x2); x2 += G(x1)``; the stack returns ``(x1 + x2) / 2``. Activation memory independent of depth. This
  is a different function from the model's (as Reversible ViT's and MEFT's): fine-tune after converting.
* ``momentum``: the layers as an exact MomentumNet over their residual branches ``r(x) = layer(x) - x``
  (:mod:`revlib_xla.reversible.exact_momentum`): the original function up to ``beta`` (default ``2**-6``) times the
  change of the residual branch from one layer to the next, so a pretrained model keeps what it learned; the
  backward rebuilds every layer's input bit for bit from the output and ``m`` bits per element per layer
  (``beta = n / 2**m``).

The reversible and momentum stacks run their memory-saving backward only in training forwards with gradients; under
``torch.no_grad()`` (``generate()``) the same function runs layer by layer, with the KV cache written once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .. import fewbit as _fewbit
from ..planner.checkpointable import Checkpointable
from ..reversible import ReversibleSequential
from ..reversible.exact_momentum import ExactMomentumStack, Momentum
from ..units import parse_bytes
from . import head as _head
from .call_args import _causal_mask_on_lazy_devices, _takes_causal_mask
from .layers import Branches, HFConversionError, find_layer_stack
from .runners import HeadBytes, Planned, Runner, TwoStream
from .runners import Momentum as MomentumRunner
from .saving import FUNCTION_CHANGING, MarkedSave

__all__ = ["STRATEGIES", "DEFAULT_BETA", "ConvertedLayers", "Conversion", "memory_efficient"]

STRATEGIES = ("plan", "reversible", "momentum")

#: momentum's default beta: 2**-6, kept exactly at 6 bits per element per layer; a 12-layer Llama trained to a
#: plateau moves by 0.08 % in validation loss when converted (bench/hf_keeps_what_it_learned.py).
DEFAULT_BETA = 2**-6


class ConvertedLayers(nn.ModuleList):
    """The model's layer list after :func:`memory_efficient`: the same layers under the same names. While the
    stack's forward runs (and the strategy takes over that forward), iterating it or slicing it whole yields one
    runner for the whole stack; otherwise, and when indexed, it is the plain list."""

    runner: Runner

    def __init__(self, layers: list[nn.Module], runner: Runner) -> None:
        super().__init__(layers)
        object.__setattr__(self, "runner", runner)
        self._depth = 0  # > 0 while the owning stack's forward runs

    def enter(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        self._depth += 1

    def leave(self, module: nn.Module, args: Any, *rest: Any) -> None:
        self._depth = max(self._depth - 1, 0)

    def _active(self) -> bool:
        return self._depth > 0 and self.runner.takes_over(self)

    def __iter__(self) -> Iterator[Any]:
        if self._active():
            return iter([self.runner])
        return super().__iter__()

    def __getitem__(self, idx: Any) -> Any:
        if not isinstance(idx, slice):
            return super().__getitem__(idx)
        modules = list(self._modules.values())[idx]
        if self._active():
            if len(modules) != len(self):
                raise HFConversionError(
                    f"revlib_xla.hf: the stack ran {len(modules)} of its {len(self)} converted layers; the "
                    f"{self.runner.strategy} strategy runs the whole stack"
                )
            return [self.runner]
        return nn.ModuleList(modules)


class Conversion:
    """What :func:`memory_efficient` did to a model (``model.revlib_xla_conversion``)."""

    def __init__(
        self,
        strategy: str,
        path: str,
        layer_class: str,
        runner: Runner,
        loss: _head.ChunkedLoss | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.strategy = strategy
        self.path = path
        self.layer_class = layer_class
        self.runner = runner
        #: The chunked causal-LM loss now the model's ``loss_function`` (:mod:`revlib_xla.hf.head`), else None.
        self.loss = loss
        #: the :func:`memory_efficient` arguments that convert a fresh model the same way (a marked save keeps them)
        self.options: dict[str, Any] = dict(options or {})
        self._undo: list[Callable[[], None]] = []

    def undo(self, model: nn.Module) -> None:
        """Put the plain layer list, the hooks and the loss back (see :func:`revlib_xla.hf.unconvert`)."""
        for step in reversed(self._undo):
            step()
        self._undo = []
        model.__dict__.pop("revlib_xla_conversion", None)

    @property
    def checkpointable(self) -> Checkpointable | None:
        """The plan's :class:`~revlib_xla.Checkpointable` (its ``sequence`` is the schedule), else None."""
        return self.runner.checkpointable if isinstance(self.runner, Planned) else None

    @property
    def net(self) -> ReversibleSequential | ExactMomentumStack | None:
        """The reversible stack (a :class:`~revlib_xla.ReversibleSequential`) or the momentum stack (an
        :class:`~revlib_xla.reversible.exact_momentum.ExactMomentumStack`), else None."""
        if isinstance(self.runner, TwoStream):
            return self.runner.net
        return self.runner.stack if isinstance(self.runner, MomentumRunner) else None

    def __repr__(self) -> str:
        return (
            f"Conversion(strategy={self.strategy!r}, path={self.path!r}, layer_class={self.layer_class!r}, "
            f"chunked_loss={self.loss is not None})"
        )


def _disable_hf_checkpointing(model: nn.Module, layers: list[nn.Module]) -> None:
    if not any(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        return
    warnings.warn(
        "revlib_xla.hf: transformers' own gradient checkpointing was on; it is turned off (the strategy replaces it)",
        stacklevel=3,
    )
    name = "activation_checkpointing_disable"  # 5.23; 5.15-5.22: gradient_checkpointing_disable
    disable: Callable[[], None] = getattr(model, name if hasattr(model, name) else "gradient_checkpointing_disable")
    disable()


class TanhGELU(nn.Module):
    """GELU's tanh approximation as one operation (``F.gelu(x, approximate="tanh")``): the function of transformers'
    ``NewGELUActivation`` (GPT-2's ``gelu_new``), which writes the same formula as seven elementwise operations that
    autograd saves five tensors of the MLP's width for (``x``, ``x ** 3``'s input, the tanh's argument and output,
    ``0.5 * x``); this saves only ``x``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(x, approximate="tanh")


def fuse_layer_activations(layers: list[nn.Module]) -> None:
    """Replace transformers' elementwise-composed tanh GELU in ``layers`` by :class:`TanhGELU` (same function up to
    rounding, a fifth of the saved activations)."""

    def fuse(module: nn.Module) -> nn.Module:
        cls = type(module)
        composed = cls.__module__ == "transformers.activations" and cls.__name__ == "NewGELUActivation"
        return TanhGELU() if composed else module

    for layer in layers:
        _fewbit.map_module(layer, fuse)


def convert_layer_activations(layers: list[nn.Module], bits: int) -> None:
    """The MLP activations of ``layers`` (transformers' activation classes included) with few-bit derivatives."""
    for layer in layers:
        _fewbit.map_module(layer, lambda m: _fewbit.convert_activation(m, bits=bits))


def memory_efficient(
    model: nn.Module,
    strategy: str = "plan",
    *,
    budget: float | str = "auto",
    beta: float = DEFAULT_BETA,
    fewbit: int = 0,
    chunked_loss: bool | str = True,
    exact: bool | None = None,
) -> nn.Module:
    """Run a transformers model's layer stack with less activation memory; returns ``model``, changed in place.

    Args:
        model: a transformers model (GPT-2, Llama, Qwen2/3, Mistral, GPT-NeoX, BERT-style encoders for ``plan``
            and ``momentum``, ...), found by its layer list (``config.num_hidden_layers`` layers of one class).
        strategy: ``"plan"`` (exact: the planner's checkpointing schedule), ``"reversible"`` (two-stream
            reversible layers from each layer's attention and MLP branches; a different function, O(1) activation
            memory in depth: for training from scratch) or ``"momentum"`` (an exact MomentumNet: the pretrained
            function up to ``beta``, ``m`` bits per element per layer; for fine-tuning).
        budget: ``plan`` only: the activation budget in bytes (or ``"8GiB"``); ``"auto"``: the fastest schedule on
            cpu and xla, 90 % of the free memory on cuda (:class:`revlib_xla.Checkpointable`'s default).
        beta: ``momentum`` only: ``n / 2**m`` in (0, 1), ``m <= 16`` (default ``2**-6``); smaller is closer to the
            original model and keeps ``m`` bits per element per layer for the backward (exact at any ``beta``).
        fewbit: bits (1-4) of the few-bit derivative of the MLP activations (transformers' activation classes
            included); 0 keeps them (GPT-2's tanh GELU then runs as one operation, :class:`TanhGELU`: the same
            function, and a fifth of what autograd saves for it).
        chunked_loss: compute a causal LM's loss (transformers' ``ForCausalLMLoss`` after a plain linear head) in
            chunks of tokens, with no tensor of the vocabulary's size kept for the backward
            (:mod:`revlib_xla.hf.head`: the same gradients; the loss has no second derivative), for the batches
            where that holds less than transformers' loss (:func:`~revlib_xla.hf.head.chunking_pays`: from about
            0.6 x hidden-size tokens); ``"always"``: for every batch; False keeps transformers' loss.
        exact: ``reversible``: the streams' arithmetic, as :class:`revlib_xla.ReversibleSequential`'s ``exact``
            (default ``None``: fixed-point streams that rebuild every layer's input bit for bit, for float32 and
            narrower weights; ``False``: floating-point streams, checked by the backward). ``momentum`` is exact by
            construction and refuses ``False``.

    Train with ``use_cache=False``: a training forward drops an empty KV cache with a warning (the backward
    recomputes the layers) and refuses one that holds tokens. Under ``torch.no_grad()`` the KV cache works as usual.
    """
    if strategy not in STRATEGIES:
        raise HFConversionError(f"memory_efficient: strategy={strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if getattr(model, "revlib_xla_conversion", None) is not None:
        raise HFConversionError(
            f"memory_efficient: {type(model).__name__} is already converted "
            f"({model.revlib_xla_conversion}); convert a fresh model"
        )
    if strategy != "plan" and budget != "auto":
        raise HFConversionError(f"memory_efficient: budget= applies to strategy='plan', not {strategy!r}")
    if chunked_loss not in (True, False, "always"):
        raise HFConversionError(f"memory_efficient: chunked_loss={chunked_loss!r}; pass True, False or 'always'")
    if strategy == "plan" and exact is not None:
        raise HFConversionError("memory_efficient: exact= applies to strategy='reversible' and 'momentum', not 'plan'")
    if strategy == "momentum":
        if exact is False:
            raise HFConversionError(
                "memory_efficient: strategy='momentum' is exact by construction (integer streams and the bits the "
                "multiplication by beta drops); exact=False applies to strategy='reversible'"
            )
        try:
            Momentum.of(beta)
        except ValueError as exc:
            raise HFConversionError(f"memory_efficient: {exc}") from None
    elif beta != DEFAULT_BETA:
        raise HFConversionError(f"memory_efficient: beta= applies to strategy='momentum', not {strategy!r}")
    stack = find_layer_stack(model)
    layers = list(stack.layers)
    runner: Runner
    if strategy == "reversible":
        branches = [Branches.of(layer) for layer in layers]  # refuses unsplittable layers before changing anything
    _disable_hf_checkpointing(model, layers)
    if fewbit:
        convert_layer_activations(layers, fewbit)
    fuse_layer_activations(layers)  # after fewbit, which replaces the activations it knows
    if strategy == "plan":
        limit = None if budget == "auto" else parse_bytes(budget, "memory_efficient: budget")
        runner = Planned(
            layers, limit, HeadBytes.of(model, bool(chunked_loss) and _head.applies(model), chunked_loss == "always")
        )
    elif strategy == "reversible":
        blocks = [block for b in branches for block in (b.f, b.g)]
        runner = TwoStream(strategy, layers, ReversibleSequential(*blocks, split_dim=None, exact=exact))
    else:
        runner = MomentumRunner(layers, beta)
    original_list = stack.layers
    converted = ConvertedLayers(layers, runner)
    converted.train(stack.layers.training)
    setattr(stack.owner, stack.attr, converted)
    handles = [
        stack.owner.register_forward_pre_hook(converted.enter),
        stack.owner.register_forward_hook(converted.leave, always_call=True),
    ]
    if _takes_causal_mask(model):
        handles.append(model.register_forward_pre_hook(_causal_mask_on_lazy_devices, with_kwargs=True))
    loss = _head.chunked_loss(model, always=chunked_loss == "always") if chunked_loss else None
    options: dict[str, Any] = {"fewbit": fewbit, "chunked_loss": chunked_loss}
    if strategy == "momentum":
        options["beta"] = beta
    if strategy == "reversible" and exact is not None:
        options["exact"] = exact
    conversion = Conversion(strategy, stack.path, type(layers[0]).__name__, runner, loss, options)

    def put_back() -> None:
        setattr(stack.owner, stack.attr, original_list)
        for handle in handles:
            handle.remove()
        if loss is not None:
            setattr(model, "loss_function", loss.original)  # noqa: B010
        model.__dict__.pop("save_pretrained", None)

    conversion._undo.append(put_back)
    model.__dict__["revlib_xla_conversion"] = conversion
    if strategy in FUNCTION_CHANGING:
        model.__dict__["save_pretrained"] = MarkedSave(model)  # marks the saved config: revlib_xla.hf.saving
    return model
