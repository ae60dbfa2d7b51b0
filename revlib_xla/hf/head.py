"""A causal LM's loss without autograd's vocabulary-sized tensors: the cross entropy in chunks of tokens.

transformers computes the loss from the logits: ``logits.float()``, ``log_softmax`` (which autograd saves, a float32
tensor of the logits' size) and, in the backward, two more float32 tensors of that size (the gradients of the
log-probabilities and of the logits). With a real vocabulary these dominate a checkpointed model's peak: a Llama-3
batch of 4096 tokens has 0.5 G logits, some 8 GiB in those tensors, against 1 GiB of stored layer inputs for all its
32 layers.

:class:`ChunkedLoss` replaces the model's ``loss_function`` (transformers' ``ForCausalLMLoss``) where the logits come
straight from a plain ``nn.Linear`` LM head: it runs torch's own cross entropy on a few tokens at a time
(:func:`revlib_xla.losses.chunked_head_loss`, the library's one chunked cross entropy) and turns each chunk's gradient
at once into the gradients of the head's input, weight and bias. The backward then only scales them by the loss's
gradient. The logits the model returns are unchanged; nothing of the vocabulary's size outlives a
chunk. Each chunk computes what transformers computes for those rows (the same float32 kernels, the same
``1 / count`` or ``1 / num_items_in_batch`` scale), so the head's input gradient is the same per row and the weight's
gradient differs only by the order of the sum over tokens.

Where the fused path does not apply the original loss runs: the logits were changed after the head (soft-capping),
the head is not a plain ``nn.Linear`` (quantized), the logits are float16 (a gradient scaler's scale must reach the
float32 gradients before they are rounded to float16), nothing needs a gradient, or the model is sharded with FSDP2.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import fsdp
from ..losses import chunked_head_loss
from .layers import HFConversionError

__all__ = ["ChunkedLoss", "applies", "chunked_loss", "chunking_pays", "rows_per_chunk", "chunk_bytes"]

_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def rows_per_chunk(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: a chunk's float32 logits hold about half the bytes of the head's float32 input (at least
    16 tokens, at most all of them)."""
    return max(1, min(tokens, max(16, (tokens * hidden) // (2 * max(vocab, 1)))))


def chunk_bytes(tokens: int, hidden: int, vocab: int) -> int:
    """What one chunk holds at once: its float32 logits, log-probabilities and their gradient."""
    return 3 * 4 * vocab * rows_per_chunk(tokens, hidden, vocab)


def chunking_pays(tokens: int, hidden: int, vocab: int, element_size: int) -> bool:
    """Whether the chunked loss holds less than transformers' for ``tokens`` rows: transformers' float32 logits,
    log-probabilities and their gradients (and the logits' gradient in the head's dtype) against the chunked loss's
    head input gradient, one chunk, the float32 sum of the weight's gradient and its copy in the weight's dtype.
    Below about ``0.6 * hidden`` tokens (1229 at Llama-3.2-1B's width in bfloat16; measured on fake tensors: the
    two peaks cross between 1024 and 1536) the sum is the larger, and transformers' loss runs."""
    ours = tokens * hidden * element_size + chunk_bytes(tokens, hidden, vocab) + (4 + element_size) * vocab * hidden
    return ours < tokens * vocab * (element_size + 8)


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output embedding (its LM head), else None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None


def _causal_lm_loss() -> Callable[..., Any] | None:
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # pragma: no cover - transformers without the loss module (< 4.46)
        return None
    return ForCausalLMLoss  # type: ignore[no-any-return]


class ChunkedLoss:
    """A causal LM's ``loss_function`` that computes transformers' ``ForCausalLMLoss`` in chunks of tokens (see the
    module docstring); ``original`` runs wherever the chunked path does not apply.

    It learns the head's input from a forward hook on the head (weak references: nothing outlives the forward) and
    takes the chunked path only for the logits that hook saw leave the head, untouched."""

    def __init__(self, head: nn.Linear, original: Callable[..., Any], always: bool = False) -> None:
        self.head = head
        self.original = original
        self.always = always  # chunked for every batch, not only where it holds less (chunking_pays)
        self._last: tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]] | None = None
        head.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._last = None
        if isinstance(output, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
            self._last = (weakref.ref(output), weakref.ref(args[0]))

    def _fused_input(self, logits: Any, vocab_size: int) -> torch.Tensor | None:
        last, self._last = self._last, None
        if last is None or last[0]() is not logits or not torch.is_grad_enabled():
            return None
        hidden, head = last[1](), self.head
        if hidden is None or not isinstance(logits, torch.Tensor):
            return None
        if logits.dtype not in _FUSED_DTYPES or logits.shape[-1] != vocab_size:
            return None
        if not any(t is not None and t.requires_grad for t in (hidden, head.weight, head.bias)):
            return None
        unit = fsdp.fsdp_module_type()
        if unit is not None and isinstance(head, unit):
            return None
        return hidden

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        hidden = self._fused_input(logits, vocab_size)
        if hidden is not None:
            if shift_labels is None:  # tokens < n predict n, as transformers shifts them
                target = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1)
            else:
                target = shift_labels.reshape(-1)
            target = target.to(logits.device)
            rows = logits.numel() // vocab_size
            pays = self.always or chunking_pays(rows, hidden.shape[-1], vocab_size, logits.element_size())
            if pays and target.numel() == rows and hidden.numel() // hidden.shape[-1] == rows:
                return self._chunked(hidden, logits, target, num_items_in_batch, ignore_index)
        # Where the chunked loss does not apply or would hold more, and for shapes that disagree (transformers'
        # own error).
        return self.original(
            logits,
            labels,
            vocab_size,
            num_items_in_batch=num_items_in_batch,
            ignore_index=ignore_index,
            shift_labels=shift_labels,
            **kwargs,
        )

    def _chunked(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        target: torch.Tensor,
        num_items_in_batch: Any,
        ignore_index: int,
    ) -> torch.Tensor:
        if num_items_in_batch is None:
            denom: Any = (target != ignore_index).sum().to(torch.float32)  # cross_entropy's "mean" weight
        elif torch.is_tensor(num_items_in_batch):
            denom = num_items_in_batch.to(logits.device)
        else:
            denom = num_items_in_batch
        chunk = rows_per_chunk(target.numel(), hidden.shape[-1], logits.shape[-1])
        head = self.head
        no_second = HFConversionError(
            "revlib_xla.hf: the chunked LM loss has no second derivative (backward with create_graph=True). "
            "Convert the model with memory_efficient(..., chunked_loss=False) to differentiate its loss twice."
        )
        return chunked_head_loss(
            hidden, head.weight, head.bias, logits.detach(), target, denom, ignore_index, chunk, no_second
        )


def applies(model: nn.Module) -> bool:
    """Whether :func:`chunked_loss` would change ``model``: its head is a plain ``nn.Linear`` and its loss
    transformers' ``ForCausalLMLoss``."""
    causal = _causal_lm_loss()
    if type(output_head(model)) is not nn.Linear or causal is None:
        return False
    try:
        return getattr(model, "loss_function", None) is causal
    except AttributeError:  # a loss_function property that needs a config field the model lacks
        return False


def chunked_loss(model: nn.Module, always: bool = False) -> ChunkedLoss | None:
    """Give ``model`` a :class:`ChunkedLoss` as its ``loss_function`` where :func:`applies`; returns it, or None
    where the model keeps its loss. It computes the loss in chunks for the batches where that holds less than
    transformers' loss (:func:`chunking_pays`), ``always``: for every batch."""
    if not applies(model):
        return None
    head = output_head(model)
    assert isinstance(head, nn.Linear)
    loss = ChunkedLoss(head, getattr(model, "loss_function"), always)  # noqa: B009 (nn.Module types it as a tensor)
    setattr(model, "loss_function", loss)  # noqa: B010
    return loss
