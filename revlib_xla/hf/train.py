"""transformers models in ``revlib-xla train`` and ``revlib-xla memory``: ``model.hf_config=<name or config.json>``.

:func:`hf_spec` sizes the config's model without building it (parameters, vocabulary, FLOPs per token), and
:func:`build_hf_lm` builds it with the run's strategy applied: ``strategy.activations`` ``none``, ``checkpoint``
(transformers' own ``gradient_checkpointing_enable()``), or ``plan`` / ``reversible`` / ``momentum``
(:func:`revlib_xla.hf.memory_efficient`), with ``strategy.fewbit`` for the MLP activations. The result is an
:class:`HFCausalLM`: ``forward(tokens) -> logits`` and ``loss(tokens)``, as the loop expects of every model, with
the transformers model as ``.lm`` (what checkpoints save, under its own state-dict keys).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import Tensor, nn

from .. import backends
from ..losses import next_token_loss
from .configs import model_from_config
from .convert import convert_layer_activations, memory_efficient
from .layers import HFConversionError, find_layer_stack
from .masks import causal_mask

__all__ = ["HFSpec", "HFCausalLM", "LLAMA_NAMES", "hf_spec", "hf_overrides", "build_hf_lm", "check_hf_strategy"]


@dataclasses.dataclass(frozen=True)
class HFSpec:
    """What the training loop needs to know of a transformers config's model, counted on the meta device:
    ``num_params`` (tied weights once), ``matmul_params`` (the weights of every matrix multiplication, the LM head
    included even when tied), and the attention shape for the FLOPs."""

    name: str
    vocab_size: int
    num_params: int
    matmul_params: int
    n_layers: int
    attention_width: int  # heads x head dim of the queries
    tie_embeddings: bool

    def train_flops_per_token(self, seq_len: int) -> float:
        """``6 * N_matmul + 6 * n_layers * attention_width * seq_len`` (the formula of
        :func:`revlib_xla.models.llama.train_flops_per_token`: causal attention, backward twice the forward)."""
        return float(6 * self.matmul_params + 6 * self.n_layers * self.attention_width * seq_len)


#: ``model.overrides`` written with :class:`revlib_xla.models.llama.LlamaConfig`'s names (as tpu_configs/ do), and
#: the transformers config field each one means
LLAMA_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings",
}


def hf_overrides(cfg: Any) -> dict[str, Any]:
    """``model.overrides`` as transformers config fields (LlamaConfig's names translated, :data:`LLAMA_NAMES`)."""
    return {LLAMA_NAMES.get(key, key): value for key, value in cfg.model.overrides.items()}


def _model(cfg: Any, device: str) -> nn.Module:
    """The config's model on ``device``; an override the transformers config does not know is refused (transformers
    would keep it as an unused attribute)."""
    fields = hf_overrides(cfg)
    try:
        model = model_from_config(cfg.model.hf_config, device=device, **fields)
    except (TypeError, ValueError) as exc:  # bad values: transformers' own message
        raise HFConversionError(f"model.hf_config={cfg.model.hf_config!r}: {exc}") from None
    config: Any = model.config
    known = set(type(config)().to_dict()) | set(getattr(config, "attribute_map", {}))
    unknown = [key if key == name else f"{key} (as {name})" for key, name in _named(cfg, known)]
    if unknown:
        raise HFConversionError(
            f"model.overrides: {', '.join(unknown)}: not a field of {type(config).__name__} (model.hf_config="
            f"{cfg.model.hf_config!r}); with model.hf_config the overrides are the transformers config's fields "
            f"(e.g. hidden_size, num_hidden_layers, intermediate_size; LlamaConfig's names are translated)"
        )
    return model


def _named(cfg: Any, known: set[str]) -> list[tuple[str, str]]:
    """The overrides (as written, as translated) whose translated name ``known`` lacks."""
    return [(key, LLAMA_NAMES.get(key, key)) for key in cfg.model.overrides if LLAMA_NAMES.get(key, key) not in known]


def _meta_model(cfg: Any) -> nn.Module:
    return _model(cfg, "meta")


def hf_spec(cfg: Any) -> HFSpec:
    """The :class:`HFSpec` of ``cfg.model.hf_config`` (with ``model.overrides`` as config fields)."""
    model = _meta_model(cfg)
    config: Any = model.config
    params = {id(p): p for p in model.parameters()}
    # every matmul's weights: nn.Linear, and GPT-2's projections (transformers' Conv1D, a matrix all the same)
    weights: list[Any] = [
        getattr(m, "weight", None) for m in model.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
    ]
    matmul = sum(int(w.numel()) for w in weights if isinstance(w, torch.Tensor))
    hf: Any = model
    head = hf.get_output_embeddings()
    tied = head is not None and head.weight is hf.get_input_embeddings().weight
    heads = int(getattr(config, "num_attention_heads", 0) or getattr(config, "n_head", 0))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // max(heads, 1)
    return HFSpec(
        name=str(cfg.model.hf_config),
        vocab_size=int(config.vocab_size),
        num_params=sum(p.numel() for p in params.values()),
        matmul_params=matmul,
        n_layers=len(find_layer_stack(model).layers),
        attention_width=heads * int(head_dim),
        tie_embeddings=tied,
    )


def check_hf_strategy(cfg: Any) -> None:
    """Refuse the strategies a transformers model cannot run here, naming the key and what works instead."""
    s = cfg.strategy
    refused = {
        "strategy.offload.params": (
            s.offload.params,
            "streams an LM's stages (as_sequential) from host memory, which a transformers model does not have",
        ),
        "strategy.fused_optimizer": (
            s.fused_optimizer,
            "steps parameters inside the backward pass, which the converted transformers layers do not support yet",
        ),
    }
    for key, (on, why) in refused.items():
        if on:
            raise HFConversionError(
                f"{key}=true {why}; with model.hf_config={cfg.model.hf_config!r} use strategy.activations "
                f"none/checkpoint/plan/reversible/momentum, strategy.fewbit, strategy.offload.optimizer or "
                f"strategy.offload.activations instead"
            )
    _check_positions(cfg)


def _check_positions(cfg: Any) -> None:
    """``data.seq_len`` within a learned position table (GPT-2's ``wpe``, BERT's ``position_embeddings``): a longer
    sequence would index past its end. Rotary models (Llama) have no table and are not limited here."""
    model = _meta_model(cfg)
    limit = getattr(model.config, "max_position_embeddings", None)
    tables = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Embedding)
        and name.rsplit(".", 1)[-1] in ("wpe", "position_embeddings", "embed_positions")
    ]
    if tables and isinstance(limit, int) and cfg.data.seq_len > limit:
        raise HFConversionError(
            f"data.seq_len={cfg.data.seq_len} is longer than the {limit} positions of the learned position "
            f"embeddings of model.hf_config={cfg.model.hf_config!r} ({tables[0]}); set data.seq_len={limit} or less, "
            f"or model.overrides.max_position_embeddings={cfg.data.seq_len} (a larger table, newly initialized)"
        )


def _checkpoint_on_any_device(model: nn.Module) -> None:
    """transformers' per-layer checkpointing function, with XLA tensors sent to :func:`revlib_xla.backends.checkpoint`
    (``torch.utils.checkpoint``, transformers' own, fails on them in torch 2.9: there is no ``torch.xla``)."""
    for module in model.modules():
        own = module.__dict__.get("_gradient_checkpointing_func")
        if own is None:
            continue

        def checkpointed(fn: Any, *args: Any, _own: Any = own, **kwargs: Any) -> Any:
            first = next((a for a in args if isinstance(a, Tensor)), None)
            if first is None or not backends.is_tracing_lazily(first):
                return _own(fn, *args, **kwargs)
            return backends.checkpoint(functools.partial(fn, **kwargs) if kwargs else fn, *args)

        module.__dict__["_gradient_checkpointing_func"] = checkpointed


class HFCausalLM(nn.Module):
    """A transformers causal LM as the loop runs it: ``forward(tokens)`` the logits (no KV cache), ``loss(tokens)``
    the next-token cross entropy (:func:`revlib_xla.losses.next_token_loss`, as for every other model)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, tokens: Tensor) -> Tensor:
        mask = causal_mask(self.lm, tokens) if backends.is_tracing_lazily(tokens) else None
        logits: Tensor = self.lm(input_ids=tokens, attention_mask=mask, use_cache=False).logits
        return logits

    def loss(self, tokens: Tensor) -> Tensor:
        return next_token_loss(self(tokens), tokens)


def build_hf_lm(
    cfg: Any, target: torch.device, *, budget: int | None, dtype: torch.dtype | None = None, on_meta: bool = False
) -> HFCausalLM:
    """The model of ``cfg.model.hf_config`` with the run's strategy, on ``target``: weights drawn on the host from
    ``train.seed`` (the same on every device), or nothing allocated on the meta device. ``budget``: ``plan``'s
    activation budget in bytes."""
    check_hf_strategy(cfg)
    s = cfg.strategy
    if on_meta:
        model = _meta_model(cfg)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.train.seed)
            model = _model(cfg, "cpu")
        model.to(target)
    if dtype is not None:
        model.to(dtype)
    tie: Any = getattr(model, "tie_weights", None)
    if tie is not None:  # moving to XLA makes a new Parameter per use of a tied weight: tie them again
        tie()
    model.train()
    if s.activations == "checkpoint":
        hf: Any = model  # transformers' own, per layer (5.23's name, else 5.15-5.22's)
        (getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable)()
        _checkpoint_on_any_device(model)
    if s.activations in ("plan", "reversible", "momentum"):
        memory_efficient(
            model,
            s.activations,
            budget=budget if s.activations == "plan" and budget is not None else "auto",
            # momentum's beta where the run sets one (the config's default, 0.9, is the native MomentumNet's)
            **({"beta": s.beta} if s.activations == "momentum" and "beta" in s.model_fields_set else {}),
            fewbit=s.fewbit,
            exact=None if s.exact else False,  # (plan: no streams; the config refuses exact=false with it)
        )
    elif s.fewbit:
        convert_layer_activations(list(find_layer_stack(model).layers), s.fewbit)
    return HFCausalLM(model)
