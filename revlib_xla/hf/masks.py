"""The causal attention mask a transformers model would build for itself, built here so nothing reads the device.

Used by the training wrapper (:class:`revlib_xla.hf.train.HFCausalLM`) and by converted models on lazy devices
(:func:`revlib_xla.hf.convert.memory_efficient`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["causal_mask"]


def causal_mask(lm: nn.Module, tokens: Tensor) -> Tensor | None:
    """The causal mask of ``tokens`` in the 4-D form ``lm``'s attention takes as given (``sdpa``: boolean, True
    where a query attends; ``eager``: additive, 0 or the dtype's lowest), or None for other attention kernels.

    Without it, transformers builds the mask itself and on the way reads a value from the device (it looks for
    packed sequences in the position ids, or for padding in a 2-D mask): on XLA that executes the graph in the
    middle of the step (two graphs per step), and it stops ``revlib-xla memory`` from tracing the step at all."""
    kind = getattr(getattr(lm, "config", None), "_attn_implementation", None)
    if kind not in ("sdpa", "eager"):
        return None
    n = tokens.shape[-1]
    allowed = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()[None, None]
    if kind == "sdpa":
        return allowed
    dtype = next(lm.parameters()).dtype
    return torch.zeros((), dtype=dtype, device=tokens.device).masked_fill(~allowed, torch.finfo(dtype).min)
