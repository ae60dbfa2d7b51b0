"""A Llama-style decoder language model at real sizes, in three forms that share the same blocks.

Architecture (Llama 3): token embedding; ``n_layers`` blocks of pre-norm grouped-query attention with rotary
position embeddings and a SwiGLU MLP; a final RMSNorm; a head tied to the embedding or separate. Parameter names
follow Hugging Face's ``LlamaForCausalLM`` below the branch level (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj``, ``input_layernorm``, ``post_attention_layernorm``), so that
:meth:`LlamaLM.hf_key_map` is a renaming; :meth:`LlamaLM.load_hf_state_dict` loads an HF checkpoint into any form.

Each block is two branches, each an ordinary module ``(B, T, dim) -> (B, T, dim)`` given the rotary tables:
``attn`` (:class:`AttentionBranch`: ``input_layernorm -> attention -> dropout``) and ``ffn`` (:class:`MLPBranch`:
``post_attention_layernorm -> SwiGLU MLP -> dropout``). The forms (:class:`Form`) differ in how the branches are
chained, i.e. in the function and in what autograd keeps:

* ``"plain"``: the residual network of Llama, ``x += attn(x); x += ffn(x)``. Activation memory grows with depth;
  ``checkpoint=True`` runs each block under activation checkpointing (:func:`revlib_xla.backends.checkpoint`).
* ``"reversible"``: a two-stream RevNet (as in Reversible ViT and Reformer) on
  :class:`revlib_xla.ReversibleSequential`: both streams start as the embedding, ``(x0, x1) -> (x1, x0 + attn(x1))
  -> (.., x1 + ffn(..))`` per block, and the two final streams are averaged before the final norm. Activation
  memory does not grow with depth: the backward rebuilds each layer's input from its output.
* ``"momentum"``: a MomentumNet (:func:`revlib_xla.utils.momentum_net`) over the same branches, ``v <- beta v +
  (1 - beta) f(x); x <- x + v`` in effect, both streams starting as the embedding; also O(1) in depth. Its inverse
  divides by ``beta`` at every branch, so the first training forward checks how exactly the input is rebuilt
  (``verify_inverse``) and raises where the gradients would be wrong.

Dropout (``config.dropout``, on each branch's output) draws per-layer seeded random numbers in the reversible forms,
so the backward's recomputation replays the forward's masks exactly (cpu, cuda, xla); the plain form with
``checkpoint=True`` restores the RNG state for the recomputation.

Every form builds under ``with torch.device("meta"):`` without allocating (``llama-8b`` included); then
``model.to_empty(device=d); model.init_weights(seed)`` materialises it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from .. import backends, recompute
from ..losses import chunked_next_token_loss, next_token_loss
from ..reversible import MemoryModes, ReversibleSequential, layer_parameters, stack_layers
from ..utils import momentum_net
from . import registry
from .llama_config import LLAMA_SIZES, Form, LlamaConfig, llama_config, num_params, train_flops_per_token

Tensor = torch.Tensor

__all__ = [
    "LlamaConfig",
    "LLAMA_SIZES",
    "llama_config",
    "Form",
    "RMSNorm",
    "RotaryEmbedding",
    "LlamaAttention",
    "LlamaMLP",
    "AttentionBranch",
    "MLPBranch",
    "LlamaBlock",
    "LlamaLM",
    "build_llama",
    "next_token_loss",
    "chunked_next_token_loss",
    "num_params",
    "train_flops_per_token",
]


# ---------------------------------------------------------------------------------------------------------------
# Layers


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dimension, computed in at least float32 (bfloat16 input is
    normalised in float32 and the result cast back before the weight, as Llama does; float64 stays float64)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def rotary_tables(
    head_dim: int, length: int, theta: float, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each ``(length, head_dim)`` in float32: position ``t`` and frequency ``theta**(-2i/head_dim)``
    with the frequencies repeated over the two halves of the head (the "rotate half" layout of HF's Llama, whose
    weights use it). Computed in float32, as the reference implementations do."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    angles = torch.arange(length, dtype=torch.int64, device=device).float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``(B, heads, T, head_dim)`` by the position angles ``cos``/``sin`` ``(T, head_dim)``, in ``x``'s
    dtype (as HF does): under bf16 autocast the projections are bf16 and the tables float32, and queries and keys
    promoted to float32 beside bf16 values are refused by XLA's attention."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RotaryEmbedding(nn.Module):
    """The rotary tables of a model, as non-persistent buffers (not in the state dict; :meth:`reset` rebuilds them
    after ``to_empty``). ``forward(x)`` gives the tables for ``x``'s sequence length, in ``x``'s dtype."""

    cos: Tensor
    sin: Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim, self.length, self.theta = config.head_dim, config.max_seq_len, config.rope_theta
        cos, sin = rotary_tables(self.head_dim, self.length, self.theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @torch.no_grad()
    def reset(self) -> None:
        """Recompute the tables into the buffers (on the host, so every device gets the same values)."""
        if backends.holds_data(self.cos):
            cos, sin = rotary_tables(self.head_dim, self.length, self.theta, device="cpu")
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        time = x.shape[1]
        return self.cos[:time].to(x.dtype), self.sin[:time].to(x.dtype)


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings, ``(B, T, dim) -> (B, T, dim)``.

    Key/value heads are repeated to the query heads by ``expand`` + ``reshape`` (query head ``h`` reads key/value
    head ``h // (n_heads // n_kv_heads)``), which runs on every torch >= 2.5 and on XLA; attention is
    :func:`torch.nn.functional.scaled_dot_product_attention` with ``is_causal=True``.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def _heads(self, x: Tensor, heads: int) -> Tensor:
        batch, time, _ = x.shape
        return x.view(batch, time, heads, self.head_dim).transpose(1, 2)

    def _repeat_kv(self, x: Tensor) -> Tensor:
        repeats = self.n_heads // self.n_kv_heads
        if repeats == 1:
            return x
        batch, heads, time, size = x.shape
        return x[:, :, None].expand(batch, heads, repeats, time, size).reshape(batch, heads * repeats, time, size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        batch, time, _ = x.shape
        q = apply_rotary(self._heads(self.q_proj(x), self.n_heads), cos, sin)
        k = apply_rotary(self._heads(self.k_proj(x), self.n_kv_heads), cos, sin)
        v = self._heads(self.v_proj(x), self.n_kv_heads)
        y = F.scaled_dot_product_attention(q, self._repeat_kv(k), self._repeat_kv(v), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, time, self.n_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``; ``act_fn`` is an ``nn.SiLU`` module (so
    :func:`revlib_xla.fewbit.convert_activation` finds it)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.up_proj = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, bias=False)
        self.act_fn: nn.Module = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class AttentionBranch(nn.Module):
    """``input_layernorm -> self_attn -> dropout``: the attention branch ``F`` of a block."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = LlamaAttention(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return self.dropout(self.self_attn(self.input_layernorm(x), cos, sin))


class MLPBranch(nn.Module):
    """``post_attention_layernorm -> mlp -> dropout``: the MLP branch ``G`` of a block. It takes (and ignores) the
    rotary tables so that a reversible sequence can pass the same arguments to every branch."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = LlamaMLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, cos: Tensor | None = None, sin: Tensor | None = None) -> Tensor:
        return self.dropout(self.mlp(self.post_attention_layernorm(x)))


class LlamaBlock(nn.Module):
    """A residual block of the plain form: ``x += attn(x); x += ffn(x)``, under activation checkpointing when
    :attr:`checkpointed` is set (a plain attribute: it changes no state-dict key)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn = AttentionBranch(config)
        self.ffn = MLPBranch(config)
        self.checkpointed = False

    def _residual(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(x, cos, sin)
        return x + self.ffn(x)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            return recompute.checkpoint(self._residual, x, cos, sin)
        return self._residual(x, cos, sin)


# ---------------------------------------------------------------------------------------------------------------
# The model


def _check_tokens(tokens: Tensor, config: LlamaConfig) -> None:
    """Shape, dtype and (on eager devices holding data, where reading two numbers is cheap) the range of ``tokens``.
    Lazy (XLA) tensors are not range-checked: that would execute the graph at every step."""
    if tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise ValueError(
            f"LlamaLM expects integer token ids of shape (batch, time), got {tokens.dtype} of shape "
            f"{tuple(tokens.shape)}"
        )
    if tokens.shape[1] > config.max_seq_len:
        raise ValueError(
            f"LlamaLM: a sequence of {tokens.shape[1]} tokens is longer than max_seq_len={config.max_seq_len}; "
            f"shorten the sequences or build the model with a larger max_seq_len"
        )
    if tokens.numel() and backends.holds_data(tokens) and not backends.is_tracing_lazily(tokens):
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= config.vocab_size:
            raise ValueError(
                f"LlamaLM: token ids must be in [0, {config.vocab_size}) (vocab_size), got ids from {low} to {high}; "
                f"the data's tokenizer does not match the model (set vocab_size)"
            )


class TokenEmbedding(nn.Module):
    """The first stage of :meth:`LlamaLM.as_sequential`: checks ``tokens`` and embeds them."""

    def __init__(self, embed: nn.Embedding, config: LlamaConfig) -> None:
        super().__init__()
        self.embed = embed
        self.config = config

    def forward(self, tokens: Tensor) -> Tensor:
        _check_tokens(tokens, self.config)
        return self.embed(tokens)


class BlockStage(nn.Module):
    """A block of :meth:`LlamaLM.as_sequential`, one tensor in and out: reads the rotary tables itself."""

    def __init__(self, block: nn.Module, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.block = block
        self.rotary = rotary

    def forward(self, x: Tensor) -> Tensor:
        return self.block(x, *self.rotary(x))


class OutputHead(nn.Module):
    """The final norm and the head: ``(B, T, dim) -> (B, T, vocab)`` logits. ``projection`` is the untied head or,
    tied, the embedding (whose matrix is the head's)."""

    def __init__(self, norm: RMSNorm, projection: nn.Linear | nn.Embedding) -> None:
        super().__init__()
        self.norm = norm
        self.projection = projection

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(self.norm(x), self.projection.weight)


class LlamaLM(nn.Module):
    """The decoder LM: ``forward(tokens)`` maps ``(B, T)`` token ids (``T <= max_seq_len``) to ``(B, T, vocab)``
    next-token logits; :meth:`loss` is the mean next-token cross entropy. Build it with :func:`build_llama`.

    Attributes: ``embed``, ``layers`` (plain: an ``nn.ModuleList`` of :class:`LlamaBlock`; reversible and momentum:
    the :class:`revlib_xla.ReversibleSequential` of the branches), ``norm``, ``head`` (``None`` when tied),
    ``rotary`` (the tables), ``blocks`` (the :class:`LlamaBlock` of every layer, in every form: the branches they
    hold are the ones ``layers`` runs).
    """

    layers: nn.Module

    def __init__(
        self,
        config: LlamaConfig,
        form: str | Form = Form.PLAIN,
        *,
        checkpoint: bool = False,
        beta: float = 0.9,
        memory_mode: MemoryModes | None = None,
        loss_chunk: int = 0,
        **stack_options: Any,
    ) -> None:
        super().__init__()
        self.config = config
        if loss_chunk < 0:
            raise ValueError(f"build_llama: loss_chunk={loss_chunk} must be 0 (off) or a positive number of positions")
        self.loss_chunk = loss_chunk
        self.form = form = Form.of(form)
        self.beta = beta
        if form is not Form.PLAIN and checkpoint:
            raise ValueError(
                f"build_llama: checkpoint=True applies to the plain form; the {form.value} form already keeps "
                f"activation memory constant in depth (drop checkpoint=True, or use form='plain')"
            )
        if form is Form.PLAIN and (memory_mode is not None or stack_options):
            given = ["memory_mode"] * (memory_mode is not None) + sorted(stack_options)
            raise ValueError(
                f"build_llama: {', '.join(given)} configure the reversible stack, which the plain form does not have; "
                f"use form='reversible' or 'momentum' (or checkpoint=True for the plain form)"
            )
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.rotary = RotaryEmbedding(config)
        blocks = [LlamaBlock(config) for _ in range(config.n_layers)]
        branches = [branch for block in blocks for branch in (block.attn, block.ffn)]
        mode = MemoryModes.autograd_function if memory_mode is None else MemoryModes(memory_mode)
        if form is Form.PLAIN:
            for block in blocks:
                block.checkpointed = checkpoint
            self.layers = nn.ModuleList(blocks)
        elif form is Form.REVERSIBLE:
            self.layers = ReversibleSequential(*branches, split_dim=None, memory_mode=mode, **stack_options)
        else:
            self.layers = momentum_net(*branches, split_dim=None, memory_mode=mode, beta=beta, **stack_options)
        # Not registered as submodules: their branches are registered (once) under ``layers``.
        self.blocks: tuple[LlamaBlock, ...] = tuple(blocks)
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.head: nn.Linear | None = (
            None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        )
        self.init_weights()
        if form is Form.REVERSIBLE and stack_options.get("scan", False) is not False:  # (momentum: layers differ)
            stack_layers(cast(ReversibleSequential, self.layers), stack_options["scan"])  # the scan reads them as is

    # -- weights ------------------------------------------------------------------------------------------------
    def _in_order(self) -> Iterator[nn.Module]:
        """The weight-holding modules in one order for every form: embedding, blocks, final norm, head."""
        with layer_parameters(self.layers):  # stacked layers (scan): each layer's parameters, for init
            yield self.embed
            for block in self.blocks:
                yield from block.modules()
            yield self.norm
            if self.head is not None:
                yield self.head

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, write: Callable[[Tensor, Tensor], None] | None = None) -> None:
        """Initialise every weight for training from scratch, and rebuild the rotary tables.

        Linear weights are N(0, 0.02) (HF's Llama), except the branches' output projections (``o_proj``,
        ``down_proj``): N(0, 0.02 / sqrt(2 * n_layers)), so the residual stream's scale does not grow with depth (GPT-2,
        torchtitan). The embedding is N(0, 1) when untied (torchtitan), N(0, 0.02) when it is also the head; norms
        are ones. Why it matters here: the reversible forms rebuild a stream by subtracting the branch outputs from a
        sum, which loses the precision by which the branch outputs outweigh the stream. With HF's init (all 0.02), 16
        layers of llama-tiny rebuild their input only to 2e-4 in float32 and 0.5 under bfloat16 autocast; with this
        one to 1e-7 and 3e-5 (untied; tied, where the embedding must stay small: 4e-6 and 8e-3).

        With ``seed``, the values are drawn on the host from a generator of their own, so a seed gives the same
        weights on every device and in every form; without, from the device's global generator. Call it after
        ``model.to_empty(device=...)`` to materialise a meta-built model. ``write(weight, value)`` (with ``seed``)
        puts each drawn value in its weight (default ``weight.copy_(value)``; a model split over devices:
        :class:`revlib_xla.sharding.ShardedWriter`): the values, drawn in one order, do not depend on where they go."""
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        outputs = {id(m) for block in self.blocks for m in (block.attn.self_attn.o_proj, block.ffn.mlp.down_proj)}
        for module in self._in_order():
            if isinstance(module, nn.Embedding):
                _normal_(module.weight, 0.02 if self.head is None else 1.0, generator, write)
            elif isinstance(module, nn.Linear):
                std = 0.02 / math.sqrt(2 * self.config.n_layers) if id(module) in outputs else 0.02
                _normal_(module.weight, std, generator, write)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        self.rotary.reset()

    def hf_key_map(self) -> dict[str, str]:
        """This model's state-dict keys -> the keys of HF's ``LlamaForCausalLM`` (``model.layers.{i}.self_attn.
        q_proj.weight``, ...), in any form. Tied models have no ``lm_head.weight`` here."""
        with layer_parameters(self.layers):  # stacked layers (scan): named as in the state dict
            name_of = {id(p): name for name, p in self.named_parameters(remove_duplicate=False)}
            mapping = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
            if self.head is not None:
                mapping["head.weight"] = "lm_head.weight"
            for i, block in enumerate(self.blocks):
                for local, param in block.named_parameters():
                    mapping[name_of[id(param)]] = f"model.layers.{i}.{local.split('.', 1)[1]}"
        return mapping

    def load_hf_state_dict(self, state_dict: dict[str, Tensor]) -> None:
        """Load the weights of an HF ``LlamaForCausalLM`` state dict (e.g. from its safetensors) into this model,
        copying into the existing parameters. Missing or unexpected keys and shape mismatches raise a ValueError
        naming them; a tied model ignores ``lm_head.weight`` (HF's copy of the embedding)."""
        mapping = self.hf_key_map()
        ignored = {"lm_head.weight"} if self.head is None else set()
        missing = sorted(hf for hf in mapping.values() if hf not in state_dict)
        unexpected = sorted(set(state_dict) - set(mapping.values()) - ignored)
        if missing or unexpected:
            raise ValueError(
                f"load_hf_state_dict: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
                f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''} (does the config match the checkpoint's?)"
            )
        with layer_parameters(self.layers), torch.no_grad():  # stacked layers: written layer by layer
            own = dict(self.named_parameters(remove_duplicate=False))
            for ours, theirs in mapping.items():
                if own[ours].shape != state_dict[theirs].shape:
                    raise ValueError(
                        f"load_hf_state_dict: {theirs} has shape {tuple(state_dict[theirs].shape)}, {ours} "
                        f"{tuple(own[ours].shape)} (does the config match the checkpoint's?)"
                    )
                own[ours].copy_(state_dict[theirs])

    # -- running ------------------------------------------------------------------------------------------------
    def _output(self) -> OutputHead:
        return OutputHead(self.norm, self.embed if self.head is None else self.head)

    def forward(self, tokens: Tensor) -> Tensor:
        return self._output()(self._trunk(tokens))

    def _trunk(self, tokens: Tensor) -> Tensor:
        """The residual stream after the last block, before the final norm: ``(B, T, dim)``."""
        _check_tokens(tokens, self.config)
        x = self.embed(tokens)
        cos, sin = self.rotary(x)
        if self.form is Form.PLAIN:
            for block in cast(nn.ModuleList, self.layers):
                x = block(x, cos, sin)
        elif self.form is Form.REVERSIBLE:
            x = self.layers(x, cos, sin)
        else:  # MomentumNet: the position stream, rescaled (utils.ReversibleStack's output)
            _, q = self.layers((x, x), cos, sin)
            x = q * self.beta ** (2 * self.config.n_layers)
        return x

    def loss(self, tokens: Tensor) -> Tensor:
        """Mean next-token cross entropy in nats (position ``t`` predicts ``tokens[:, t + 1]``), computed in at least
        float32 (a float64 model gives a float64 loss). ``log(vocab_size)`` is a uniform guess's loss. With
        ``loss_chunk`` positions per chunk (:func:`chunked_next_token_loss`), the logits are never whole."""
        if not self.loss_chunk:
            return next_token_loss(self(tokens), tokens)
        head = self._output()
        return chunked_next_token_loss(head.norm(self._trunk(tokens)), head.projection.weight, tokens, self.loss_chunk)

    def as_sequential(self) -> nn.Sequential:
        """The plain model as stages with one tensor input each, sharing this model's parameters: a
        :class:`TokenEmbedding`, one :class:`BlockStage` per block, and the :class:`OutputHead` (final norm and
        head). For :class:`revlib_xla.Checkpointable` (planned checkpointing)."""
        if self.form is not Form.PLAIN:
            raise ValueError(
                f"LlamaLM.as_sequential: the {self.form.value} form runs its layers as one reversible sequence, "
                f"not as separate stages; build the model with form='plain' for Checkpointable"
            )
        stages: list[nn.Module] = [TokenEmbedding(self.embed, self.config)]
        stages += [BlockStage(block, self.rotary) for block in cast(nn.ModuleList, self.layers)]
        stages.append(self._output())
        return nn.Sequential(*stages)

    def extra_repr(self) -> str:
        extra = f", beta={self.beta}" if self.form is Form.MOMENTUM else ""
        return f"form={self.form.value!r}{extra}"


def _normal_(
    weight: Tensor, std: float, generator: torch.Generator | None, write: Callable[[Tensor, Tensor], None] | None
) -> None:
    if generator is None:
        nn.init.normal_(weight, 0.0, std)
    elif backends.holds_data(weight):
        value = torch.empty(weight.shape, dtype=weight.dtype).normal_(0.0, std, generator=generator)
        if write is None:
            weight.copy_(value)
        else:
            write(weight, value)


def build_llama(
    config: LlamaConfig,
    form: str | Form = Form.PLAIN,
    *,
    checkpoint: bool = False,
    beta: float = 0.9,
    memory_mode: MemoryModes | None = None,
    loss_chunk: int = 0,
    **stack_options: Any,
) -> LlamaLM:
    """The Llama LM of ``config`` in ``form`` (``"plain"``, ``"reversible"``, ``"momentum"``).

    Args:
        checkpoint: plain form only: run each block under activation checkpointing.
        beta: momentum form only: MomentumNet's momentum (ignored by the other forms).
        memory_mode: reversible and momentum forms: ``MemoryModes.autograd_function`` (the default; O(1) activation
            memory in depth) or ``MemoryModes.no_savings`` (plain autograd of the same function: the reference).
        stack_options: reversible and momentum forms: further arguments of :class:`revlib_xla.ReversibleSequential`
            (``target_device``, ``fused_optimizer``, ``stream_dtype``, ``verify_inverse``, ...).
        loss_chunk: positions per chunk of :meth:`LlamaLM.loss` (:func:`chunked_next_token_loss`); 0: the whole
            ``(B, T, vocab)`` logits tensor at once.
    """
    return LlamaLM(
        config, form, checkpoint=checkpoint, beta=beta, memory_mode=memory_mode, loss_chunk=loss_chunk, **stack_options
    )


def _factory(name: str) -> registry.Factory:
    def build(form: str = Form.PLAIN, **overrides: Any) -> LlamaLM:
        options = {
            key: overrides.pop(key) for key in ("checkpoint", "beta", "memory_mode", "loss_chunk") if key in overrides
        }
        return build_llama(llama_config(name, **overrides), form, **options)

    build.__doc__ = f"{name}: build_llama(llama_config({name!r}, **overrides), form)"
    return build


for _name in LLAMA_SIZES:
    registry.register(_name, _factory(_name))
