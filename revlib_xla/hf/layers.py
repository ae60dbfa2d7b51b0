"""Where a transformers model keeps its layers, and how a pre-LN layer splits into its two residual branches.

Architectures are recognised from the modules themselves, not from model names: the layer list is the model's one
``nn.ModuleList`` of ``config.num_hidden_layers`` layers of one class, and a layer splits into an attention branch
``F`` and an MLP branch ``G`` (``x -> x + F(x) -> (x + F(x)) + G(x + F(x))``) when it has one of the sub-module
layouts in :data:`SPLITS`. The split is checked against the layer's own forward on the first real input
(:meth:`Branches.check`), so a layer that has these attribute names but computes something else (extra norms, a
scaled residual) is refused instead of silently converted.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import backends

__all__ = ["HFConversionError", "LayerStack", "Split", "SPLITS", "find_layer_stack", "split_of", "Branches"]

#: the architectures whose layers :func:`split_of` splits (for error messages and the README)
REVERSIBLE_ARCHITECTURES = "GPT-2, Llama (Llama 2/3), Qwen2, Qwen3, Mistral, GPT-NeoX"


class HFConversionError(ValueError):
    """A transformers model, layer or call that a strategy of :func:`revlib_xla.hf.memory_efficient` cannot take;
    the message names the class or argument and what works instead."""


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """The model's decoder (or encoder) layers: ``getattr(owner, attr)`` is the ``nn.ModuleList``; ``path`` its
    dotted name in the model."""

    owner: nn.Module
    attr: str
    path: str

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.owner, self.attr)


def find_layer_stack(model: nn.Module) -> LayerStack:
    """The model's layer list: the ``nn.ModuleList`` of ``config.num_hidden_layers`` modules of one class (the
    longest such list if the config does not say). Raises :class:`HFConversionError` naming the model class when
    there is none, or more than one (encoder-decoder models)."""
    config = getattr(model, "config", None)
    depth = getattr(config, "num_hidden_layers", None)
    candidates = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            kinds = {type(m) for m in module}
            if len(kinds) == 1 and (depth is None or len(module) == depth):
                candidates.append((path, module))
    if depth is None and candidates:
        longest = max(len(m) for _, m in candidates)
        candidates = [(p, m) for p, m in candidates if len(m) == longest]
    if len(candidates) != 1:
        found = "none" if not candidates else ", ".join(f"'{p}'" for p, _ in candidates)
        raise HFConversionError(
            f"revlib_xla.hf: cannot find the layer stack of {type(model).__name__}: expected one nn.ModuleList of "
            f"{depth if depth is not None else 'N'} layers of one class, found {found}. Supported: decoder (or "
            f"encoder) models with one layer list, e.g. {REVERSIBLE_ARCHITECTURES}, BERT (plan, momentum)"
        )
    path = candidates[0][0]
    owner_path, _, attr = path.rpartition(".")
    return LayerStack(model.get_submodule(owner_path), attr, path)


@dataclasses.dataclass(frozen=True)
class Split:
    """A pre-LN layer layout: the names of its sub-modules for ``F`` (norm, attention, optional dropout) and ``G``
    (norm, MLP, optional dropout); ``exclude``: layer arguments not passed on to the attention (refused when set);
    ``absent``: sub-modules whose presence means another layout (e.g. Gemma-2's extra norms)."""

    name: str
    norm1: str
    attention: str
    norm2: str
    mlp: str
    dropout1: str | None = None
    dropout2: str | None = None
    exclude: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()


SPLITS = (
    Split("gpt2", "ln_1", "attn", "ln_2", "mlp", exclude=("encoder_hidden_states", "encoder_attention_mask")),
    Split(
        "llama",
        "input_layernorm",
        "self_attn",
        "post_attention_layernorm",
        "mlp",
        absent=("pre_feedforward_layernorm", "post_feedforward_layernorm"),
    ),
    Split(
        "gpt_neox",
        "input_layernorm",
        "attention",
        "post_attention_layernorm",
        "mlp",
        dropout1="post_attention_dropout",
        dropout2="post_mlp_dropout",
    ),
)


def _is_post_ln(layer: nn.Module) -> bool:
    """BERT-style: the LayerNorm sits after the residual add, inside the attention's and the MLP's output
    modules (``BertSelfOutput``, ``BertOutput``)."""
    return all(hasattr(layer, a) for a in ("attention", "intermediate", "output")) and hasattr(
        layer.output, "LayerNorm"
    )


def split_of(layer: nn.Module) -> Split:
    """The layout of ``layer`` among :data:`SPLITS`, or :class:`HFConversionError` naming its class, why it
    cannot be split and the strategies that work for it."""
    for split in SPLITS:
        names = (split.norm1, split.attention, split.norm2, split.mlp, split.dropout1, split.dropout2)
        if all(n is None or hasattr(layer, n) for n in names) and not any(hasattr(layer, n) for n in split.absent):
            return split
    name = type(layer).__name__
    if _is_post_ln(layer):
        why = (
            f"{name} is post-LN (its LayerNorm comes after each residual add, inside "
            f"{type(layer.output).__name__}): it has no x + f(x) form, so its branches cannot become the F and G of "
            f"a reversible layer without changing the function"
        )
    else:
        why = (
            f"revlib_xla.hf could not split {name} into an attention and an MLP residual branch (known layouts: "
            f"{REVERSIBLE_ARCHITECTURES})"
        )
    raise HFConversionError(
        f"strategy='reversible': {why}. strategy='plan' (exact) and strategy='momentum' work for {name}"
    )


def bind_layer_arguments(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments after the hidden state of a call ``layer(hidden, *args, **kwargs)``, by name (GPT-2's stack
    passes some positionally, Llama's and GPT-NeoX's by keyword); the layer's ``**kwargs`` are merged in."""
    signature = inspect.signature(layer.forward)
    bound = signature.bind(None, *args, **kwargs).arguments
    named = {}
    first = True
    for key, value in bound.items():
        if first:  # the hidden state
            first = False
            continue
        if signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif signature.parameters[key].kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise HFConversionError(
                    f"{type(layer).__name__}: {len(value)} extra positional arguments that revlib_xla.hf cannot name"
                )
        else:
            named[key] = value
    return named


class _Branch(nn.Module):
    """One residual branch of a layer, run from the layer's own sub-modules, registered here too (so a
    ReversibleSequential over the branches finds their parameters); the branches are never registered in the model,
    so its state-dict keys do not change."""

    layer: nn.Module

    def __init__(self, layer: nn.Module, split: Split, attention: bool) -> None:
        super().__init__()
        object.__setattr__(self, "layer", layer)  # for its signature; the branch's modules are registered below
        self.norm = getattr(layer, split.norm1 if attention else split.norm2)
        self.body = getattr(layer, split.attention if attention else split.mlp)
        drop = split.dropout1 if attention else split.dropout2
        self.dropout = getattr(layer, drop) if drop is not None else nn.Identity()
        self.split = split
        self.attention = attention

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.attention:
            return self.dropout(self.body(self.norm(x)))
        layer = self.layer
        named = bind_layer_arguments(layer, args, kwargs)
        for key in self.split.exclude:
            if named.pop(key, None) is not None:
                raise HFConversionError(
                    f"strategy='reversible': {type(layer).__name__} got {key}: cross-attention is not a branch of the "
                    f"two-stream layer; use strategy='plan' for encoder-decoder use"
                )
        out = self.body(self.norm(x), **named)
        return self.dropout(out[0] if isinstance(out, tuple) else out)


@dataclasses.dataclass
class Branches:
    """A layer's ``F`` (attention) and ``G`` (MLP) branch as modules taking ``(x, *layer_args, **layer_kwargs)``."""

    layer: nn.Module
    split: Split
    f: nn.Module
    g: nn.Module

    @classmethod
    def of(cls, layer: nn.Module) -> Branches:
        split = split_of(layer)
        return cls(layer, split, _Branch(layer, split, True), _Branch(layer, split, False))

    def residual(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The layer's own function rebuilt from the branches (``use_parallel_residual``: both read ``x``)."""
        a = x + self.f(x, *args, **kwargs)
        if getattr(self.layer, "use_parallel_residual", False):
            return a + self.g(x)
        return a + self.g(a)

    def check(self, x: torch.Tensor, call: Callable[[nn.Module, torch.Tensor], Any], *args: Any, **kw: Any) -> None:
        """Refuse the split unless the branches rebuild the layer's forward on ``x`` (eval mode, no dropout)."""
        was = self.layer.training
        self.layer.eval()
        try:
            # no autocast weight-cast cache: casts made here, without autograd, would be reused by the step's runs
            with torch.no_grad(), backends.autocast_cache_off():
                want = call(self.layer, x)
                want = want[0] if isinstance(want, tuple) else want
                got = self.residual(x, *args, **kw)
        finally:
            self.layer.train(was)
        for what, value in (("input", x), ("output", want)):
            if not bool(torch.isfinite(value).all()):
                raise HFConversionError(
                    f"strategy='reversible': the {what} of {type(self.layer).__name__} holds NaN or inf at the first "
                    f"forward, so its split cannot be checked: the weights (or the embeddings before it) hold NaN or "
                    f"inf, or its computation overflows. Check the model's weights (torch.isfinite)"
                )
        err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
        tol = {torch.float64: 1e-9, torch.float32: 1e-4}.get(x.dtype, 2e-2)
        if not err <= tol:
            raise HFConversionError(
                f"strategy='reversible': {type(self.layer).__name__} has the sub-modules of the {self.split.name} "
                f"layout, but x + F(x), + G(.) built from them differs from its forward by {err:.2e} (relative): "
                f"it computes something else. strategy='plan' (exact) and strategy='momentum' work for it"
            )
