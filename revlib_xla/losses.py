"""Language-model losses: the next-token cross entropy, and one chunked cross entropy that never holds the logits'
gradients (or, for the library's models, the logits themselves) for a whole batch.

At a real vocabulary the loss dominates a memory-efficient step's peak: Llama-3's 128256 logits per position make
the float32 logits, their log-probabilities and their gradients several GiB for a few thousand tokens, against one
stored layer input per layer. :class:`_ChunkedCrossEntropy` computes the cross entropy of ``hidden @ weight.T
(+ bias)`` a chunk of positions at a time, with the gradients of the head's input, weight and bias. It is used in
two ways, by whether the logits are given:

* the logits given, read only (a transformers model returns them anyway; :mod:`revlib_xla.hf.head`): each chunk's
  gradients are computed in the forward, as transformers' backward computes them (outside autocast, the logits'
  gradient in the logits' dtype), and the backward only scales them by the loss's gradient. What is kept from the
  forward to the backward is the head's input and weight gradients; no second derivative.
* the logits not given (:func:`chunked_next_token_loss`, the library's models): only the inputs are kept, and the
  backward recomputes each chunk's logits (behind an optimization barrier, so XLA cannot merge them with the
  forward's) and sums the head weight's gradient over the chunks in float32, rounded once; under
  ``create_graph=True`` the same computation is recorded, so double backward differentiates it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import backends

__all__ = ["next_token_loss", "chunked_next_token_loss", "chunked_head_loss"]


def next_token_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    """Mean cross entropy of ``logits[:, :-1]`` against ``tokens[:, 1:]``, in at least float32."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).to(dtype), tokens[:, 1:].reshape(-1))


def _chunk_loss_sum(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Summed cross entropy of one chunk: its logits ``hidden @ weight.T`` exist only inside this call."""
    logits = F.linear(hidden, weight)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).to(dtype), targets.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )


def _same(tensor: Tensor) -> Tensor:
    return tensor


class _ChunkedCrossEntropy(torch.autograd.Function):
    """The cross entropy of ``hidden @ weight.T (+ bias)`` against ``targets`` summed over chunks of ``chunk``
    positions (divided by ``denom`` where given), with the gradients of ``hidden``, ``weight`` and ``bias``.

    ``logits`` given: the logits of those rows, read only; ``hidden`` and ``logits`` are flattened to rows and
    chunked by rows, and the gradients are computed in the forward (see the module docstring). ``logits`` None: the
    positions are chunked along dimension 1 (the batch dimension stays whole, so a batch split over devices stays
    split); the head's products run in ``dtype`` with autocast off on ``autocast``'s device type, and the backward
    recomputes them.

    Why the weight's gradient is summed in float32 where the products run below it (a bfloat16 weight, or a float32
    one under autocast to bfloat16): autograd adds the gradients of a tensor used several times in that tensor's
    dtype, so one checkpointed chunk per use added the head's gradient in bfloat16, one rounding per chunk: relative
    error 1.65e-2 at 64-position chunks against 1.8e-3 unchunked. Here each chunk's weight gradient is one float32
    matrix product added in place into a float32 buffer, rounded once. Bytes at llama-1b (vocabulary 128256, dim
    2048, bfloat16 head 0.53 GB): the buffer is 1.05 GB, 1.58 GB with the final cast, where autograd held the
    0.53 GB bfloat16 sum plus one 0.53 GB chunk gradient (1.05 GB): +0.53 GB, only while the loss's backward runs.
    Cost: the weight's product per chunk is a float32 matrix product (one of the head's four)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        logits: Tensor | None,
        targets: Tensor,
        chunk: int,
        denom: Any,
        ignore_index: int,
        dtype: torch.dtype | None,
        autocast: str | None,
        no_second: Exception | None,
    ) -> Tensor:
        ctx.given = logits is not None
        ctx.chunk, ctx.ignore_index, ctx.no_second = chunk, ignore_index, no_second
        if logits is not None:
            return _gradients_now(ctx, hidden, weight, bias, logits, targets, denom)
        assert dtype is not None and denom is None, "recomputed chunks: the head's dtype, and the sum"
        ctx.save_for_backward(hidden, weight, targets)
        ctx.dtype, ctx.autocast = dtype, autocast
        with backends.autocast_off(autocast):
            head = weight.to(dtype)
            total = _chunk_loss_sum(hidden[:, :chunk].to(dtype), head, targets[:, :chunk], ignore_index)
            for start in range(chunk, hidden.shape[1], chunk):
                part = hidden[:, start : start + chunk].to(dtype)
                total = total + _chunk_loss_sum(part, head, targets[:, start : start + chunk], ignore_index)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        rest = (None,) * 8
        if ctx.given:
            return (*_scaled(ctx, grad), *rest)
        return (*_recomputed(ctx, grad), None, *rest)


def _gradients_now(
    ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, logits: Tensor, targets: Tensor, denom: Any
) -> Tensor:
    """The given-logits forward: the loss, and its gradients computed chunk by chunk (``logits`` is only read)."""
    rows = ctx.chunk
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    h = hidden.reshape(-1, hidden.shape[-1])
    z = logits.reshape(-1, logits.shape[-1])
    accumulate = torch.float64 if weight.dtype == torch.float64 else torch.float32
    grad_h = torch.empty_like(h) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if need_w else None
    grad_b = torch.zeros(z.shape[-1], dtype=accumulate, device=z.device) if need_b else None
    total = torch.zeros((), dtype=torch.float32, device=z.device)
    # transformers' loss would run its backward outside any autocast region: the chunks' gradients are too.
    with backends.autocast_off(backends.backend_for(z.device).autocast_device_type):
        for start in range(0, z.shape[0], rows):
            stop = min(start + rows, z.shape[0])
            # The chunk's own graph lives and dies here: the saved-tensor hooks around the loss (an offload
            # to the host, a memory counter) see only what the backward keeps (``save_for_backward`` below).
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
                chunk = z[start:stop].detach().float().requires_grad_(True)
                summed = nn.functional.cross_entropy(
                    chunk, targets[start:stop], ignore_index=ctx.ignore_index, reduction="sum"
                )
                (g,) = torch.autograd.grad(summed / denom, chunk)
            total = total + summed.detach()
            g = g.to(z.dtype)
            if grad_h is not None:
                grad_h[start:stop] = g @ weight.to(g.dtype)
            if grad_w is not None and g.dtype == accumulate:
                grad_w.addmm_(g.t(), h[start:stop])
            elif grad_w is not None:  # a low-precision product, summed in float32 in place
                grad_w.add_(g.t() @ h[start:stop].to(g.dtype))
            if grad_b is not None:
                grad_b += g.sum(0).to(accumulate)
            del chunk, summed, g
    ctx.shapes = (hidden.shape, hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.save_for_backward(*(t if t is not None else torch.empty(0, device=z.device) for t in (grad_h, grad_w, grad_b)))
    ctx.present = (grad_h is not None, grad_w is not None, grad_b is not None)
    return total / denom


def _scaled(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The given-logits backward: the forward's gradients times the loss's gradient."""
    if torch.is_grad_enabled():
        raise ctx.no_second or RuntimeError("the chunked loss of given logits has no second derivative")
    grad_h, grad_w, grad_b = ctx.saved_tensors
    has_h, has_w, has_b = ctx.present
    shape, h_dtype, w_dtype, b_dtype = ctx.shapes
    scale = grad_loss.to(torch.float32)
    out_h = (grad_h * scale.to(grad_h.dtype)).to(h_dtype).reshape(shape) if has_h else None
    out_w = _scaled_into(grad_w, scale, w_dtype) if has_w else None
    out_b = (grad_b * scale.to(grad_b.dtype)).to(b_dtype) if has_b else None
    return out_h, out_w, out_b


def _scaled_into(summed: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``(summed * scale).to(dtype)``, a weight's float32 gradient sum scaled and rounded once, without a second
    tensor of the sum's size where ``dtype`` is narrower: the product is formed a block of rows at a time (the
    whole product first, then its cast, held 10 bytes per element of a bfloat16 head at once, 2.5 GiB at Llama-3's
    vocabulary, where the planner's head counts 6). The same values either way: each element is multiplied in
    float32 and rounded to ``dtype`` once."""
    scale = scale.to(summed.dtype)
    if dtype == summed.dtype:
        return summed * scale
    out = torch.empty(summed.shape, dtype=dtype, device=summed.device)
    rows = max(1, summed.shape[0] // 16)
    for start in range(0, summed.shape[0], rows):
        out[start : start + rows] = summed[start : start + rows] * scale
    return out


def _recomputed(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor]:
    """The recomputing backward: each chunk's logits again, the weight's gradient summed in float32."""
    features, weight, targets = ctx.saved_tensors
    create_graph = torch.is_grad_enabled()  # double backward: record this backward
    want_features = ctx.needs_input_grad[0]
    with backends.autocast_off(ctx.autocast), torch.enable_grad():
        if create_graph:
            head = weight.to(ctx.dtype)
        else:
            features, head = features.detach(), weight.detach().to(ctx.dtype).requires_grad_()
        weight_grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        feature_grads: list[Tensor] = []
        for start in range(0, features.shape[1], ctx.chunk):
            part, part_targets = features[:, start : start + ctx.chunk], targets[:, start : start + ctx.chunk]
            w, g = head, grad
            if not create_graph:
                part, w, g, weight_grad = backends.optimization_barrier([part, head, grad, weight_grad])
                part = part.requires_grad_(want_features)
            logits = F.linear(part.to(ctx.dtype), w).float()
            loss = F.cross_entropy(
                logits.flatten(0, -2), part_targets.reshape(-1), ignore_index=ctx.ignore_index, reduction="sum"
            )
            (logit_grad,) = torch.autograd.grad(loss, logits, g, create_graph=create_graph, retain_graph=True)
            if want_features:
                feature_grads += torch.autograd.grad(logits, part, logit_grad, create_graph=create_graph)
            product = (logit_grad.flatten(0, -2).T, part.flatten(0, -2).float())
            weight_grad = torch.addmm(weight_grad, *product) if create_graph else weight_grad.addmm_(*product)
    features_grad = torch.cat(feature_grads, dim=1) if want_features else None
    return features_grad, weight_grad.to(weight.dtype)


def chunked_head_loss(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    logits: Tensor,
    targets: Tensor,
    denom: Any,
    ignore_index: int,
    rows: int,
    no_second: Exception | None = None,
) -> Tensor:
    """The cross entropy of the given ``logits`` (the rows of ``hidden @ weight.T + bias``, read only) against
    ``targets`` (flattened rows), summed and divided by ``denom``, computed ``rows`` rows at a time with the
    gradients of ``hidden``, ``weight`` and ``bias`` computed in the forward (the given-logits form above).
    ``no_second``: what a backward with ``create_graph=True`` raises (the caller's error, naming its way out)."""
    return _ChunkedCrossEntropy.apply(  # type: ignore[no-any-return]
        hidden, weight, bias, logits, targets, rows, denom, ignore_index, None, None, no_second
    )


def _head_compute_dtype(weight: Tensor) -> tuple[torch.dtype, str | None] | None:
    """The dtype the head's products run in, with the autocast device type to turn off while running them
    explicitly, where that dtype is below float32 (a bfloat16 weight, or a float32 one under autocast to bfloat16 or
    float16); None where they run in float32 or float64."""
    autocast = backends.backend_for(weight).autocast_device_type
    if autocast is not None and not torch.is_autocast_enabled(autocast):
        autocast = None
    if weight.dtype.itemsize < 4:
        return weight.dtype, autocast
    if autocast is not None and weight.dtype == torch.float32:
        dtype = torch.get_autocast_dtype(autocast)
        if dtype.itemsize < 4:
            return dtype, autocast
    return None


def chunked_next_token_loss(hidden: Tensor, weight: Tensor, tokens: Tensor, chunk: int) -> Tensor:
    """:func:`next_token_loss` of the logits ``hidden @ weight.T`` without ever holding them whole.

    ``hidden``: ``(B, T, dim)`` features after the final norm; ``weight``: the ``(vocab, dim)`` head (the embedding
    when tied); ``tokens``: ``(B, T)``. The positions ``0 .. T-2`` are cut into chunks of ``chunk`` along the
    sequence (the batch dimension stays whole, so a batch split over devices stays split); each chunk's logits and
    cross entropy are computed under activation checkpointing (:func:`revlib_xla.backends.checkpoint`: on XLA behind
    optimization barriers, so the compiler cannot merge the recomputation back into the forward), which keeps only
    the chunk's input and recomputes its logits in the backward pass. The mean is the sum of the chunks' sums over
    the count of targets that are not ``-100`` (cross entropy's ``ignore_index``, as in the unchunked mean): the same
    function as the unchunked loss, summed in another order. Head products below float32 (a bfloat16 weight, or
    autocast to bfloat16) get the weight's gradient summed over the chunks in float32 and rounded once
    (:class:`_ChunkedCrossEntropy`, recomputing its chunks), so its error does not grow with the count of chunks.
    """
    if chunk < 1:
        raise ValueError(f"chunked_next_token_loss: chunk={chunk} must be a positive number of positions")
    features, targets = hidden[:, :-1], tokens[:, 1:]
    low = (
        _head_compute_dtype(weight) if features.shape[1] and torch.is_grad_enabled() and weight.requires_grad else None
    )
    if low is not None:
        total_sum = _ChunkedCrossEntropy.apply(features, weight, None, None, targets, chunk, None, -100, *low, None)
        return total_sum / targets.ne(-100).sum()
    total: Tensor | None = None
    for start in range(0, features.shape[1], chunk):
        part = (features[:, start : start + chunk], weight, targets[:, start : start + chunk])
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            loss = backends.checkpoint(_chunk_loss_sum, *part, preserve_rng_state=False)
        else:
            loss = _chunk_loss_sum(*part)
        total = loss if total is None else total + loss
    assert total is not None, "tokens has a single position: nothing to predict"
    return total / targets.ne(-100).sum()  # the targets F.cross_entropy counts (not its ignore_index)
