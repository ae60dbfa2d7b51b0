"""RandomizedLinear: a linear layer that keeps a random sketch of its input instead of the input.

``y = x W^T + b`` as ``nn.Linear``. The weight gradient ``G^T X`` (X: the input as N x in rows, G: the output
gradient as N x out, N = batch * tokens) is estimated as ``(S G)^T (S X)`` with a random k x N matrix S whose
entries have mean 0 and variance 1/k, so ``E[S^T S] = I`` and the estimate is unbiased. Only ``S X`` (k x in) and
an integer seed are kept; S is drawn again from the seed in the backward pass. k = ``proj_dim_ratio * N`` rounded
down (at least 1, clamped to ``proj_dim_min``/``proj_dim_max``) or a fixed ``proj_dim``. The input gradient
``G W`` and the bias gradient are exact.

Costs: S is a dense k x N matrix made twice (forward and backward), and ``S X`` costs ``k N in`` multiply-adds;
with k = r N that is quadratic in N, so it suits the batch sizes of fine-tuning (FewBit's use) better than very
long sequences. The variance of the estimate grows like N / k.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import backends
from ..recompute import rng_scope

Tensor = torch.Tensor

__all__ = ["RandomizedLinear", "LinearGRP", "randomized_linear", "SKETCHES"]

SKETCHES = ("gaussian", "rademacher")


def _sketch(kind: str, rows: int, cols: int, seed: int, like: Tensor) -> Tensor:
    """The k x N sketch matrix drawn from ``seed`` on ``like``'s device (the caller's random state is kept)."""
    with rng_scope(like.device) as reseed:
        reseed(seed)
        if kind == "gaussian":
            s = torch.randn(rows, cols, device=like.device, dtype=like.dtype)
        else:
            s = torch.randint(0, 2, (rows, cols), device=like.device).to(like.dtype) * 2 - 1
    return s * (1.0 / math.sqrt(rows))


class _RandomizedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, proj_dim: int, kind: str, seed: int
    ) -> Tensor:
        out = F.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        sketched = None
        if weight.requires_grad:
            sketched = _sketch(kind, proj_dim, rows.shape[0], seed, rows) @ rows
            out, sketched = backends.optimization_barrier([out, sketched])  # as in the few-bit activations: sketch now
        ctx.save_for_backward(sketched, weight if x.requires_grad else None)
        ctx.meta = (kind, seed, proj_dim, x.shape, bias is not None and bias.requires_grad, rows.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        sketched, weight = ctx.saved_tensors
        kind, seed, proj_dim, shape, bias_grad, input_dtype = ctx.meta
        g = grad.reshape(-1, grad.shape[-1])
        # Under autocast the forward computed in a lower precision than the parameters: the backward computes in
        # the gradient's dtype, and S is drawn exactly as in the forward (in the input's dtype), then cast.
        dx = (g @ weight.to(g.dtype)).view(shape) if weight is not None else None
        dw = None
        if sketched is not None:
            s = _sketch(kind, proj_dim, g.shape[0], seed, g.new_empty((), dtype=input_dtype)).to(g.dtype)
            dw = (s @ g).t() @ sketched.to(g.dtype)
        db = g.sum(0) if bias_grad else None
        return dx, dw, db, None, None, None


def _proj_dim(rows: int, ratio: float | None, proj_dim: int | None, lo: int | None, hi: int | None) -> int:
    if proj_dim is not None:
        k = proj_dim
    elif ratio is not None:
        k = math.floor(ratio * rows)
    else:
        raise TypeError("randomized_linear: give proj_dim_ratio or proj_dim (the sketch's number of rows)")
    if lo is not None:
        k = max(k, lo)
    if hi is not None:
        k = min(k, hi)
    return max(1, min(k, rows))


def randomized_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    proj_dim_ratio: float | None = None,
    proj_dim: int | None = None,
    proj_dim_min: int | None = None,
    proj_dim_max: int | None = None,
    matmul: str = "gaussian",
) -> Tensor:
    """``F.linear`` with a sketched weight gradient (see the module docstring)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(
            f"randomized_linear needs a floating-point tensor, got "
            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}"
        )
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"randomized_linear: input of shape {tuple(x.shape)} does not end with in_features={weight.shape[1]}"
        )
    if not (
        torch.is_grad_enabled()
        and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    ):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    k = _proj_dim(rows, proj_dim_ratio, proj_dim, proj_dim_min, proj_dim_max)
    return _RandomizedLinearFunction.apply(x, weight, bias, k, matmul, backends.draw_seed())


class RandomizedLinear(nn.Linear):
    """``nn.Linear`` whose weight gradient comes from a random sketch of the input (FewBit's ``RandomizedLinear``).

    ``proj_dim_ratio`` (0 < r <= 1) keeps ``floor(r * N)`` sketch rows for N input rows; ``proj_dim`` fixes the
    number instead; ``proj_dim_min``/``proj_dim_max`` clamp it. ``matmul`` is the sketch: ``'gaussian'`` or
    ``'rademacher'``. Parameters and state-dict keys are ``nn.Linear``'s.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        proj_dim_ratio: float | None = None,
        proj_dim: int | None = None,
        proj_dim_min: int | None = None,
        proj_dim_max: int | None = None,
        matmul: str = "gaussian",
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        if (proj_dim_ratio is None) == (proj_dim is None):
            raise ValueError(
                "RandomizedLinear needs exactly one of proj_dim_ratio (a fraction of the input rows) "
                "and proj_dim (a number of rows)"
            )
        if proj_dim_ratio is not None and not 0 < proj_dim_ratio <= 1:
            raise ValueError(f"proj_dim_ratio must be in (0, 1], got {proj_dim_ratio}")
        if proj_dim is not None and proj_dim < 1:
            raise ValueError(f"proj_dim must be a positive number of rows, got {proj_dim}")
        if matmul not in SKETCHES:
            raise ValueError(f"matmul must be one of {SKETCHES}, got {matmul!r}")
        self.proj_dim_ratio, self.proj_dim = proj_dim_ratio, proj_dim
        self.proj_dim_min, self.proj_dim_max, self.matmul = proj_dim_min, proj_dim_max, matmul

    def forward(self, x: Tensor) -> Tensor:
        return randomized_linear(
            x,
            self.weight,
            self.bias,
            proj_dim_ratio=self.proj_dim_ratio,
            proj_dim=self.proj_dim,
            proj_dim_min=self.proj_dim_min,
            proj_dim_max=self.proj_dim_max,
            matmul=self.matmul,
        )

    def extra_repr(self) -> str:
        size = f"proj_dim_ratio={self.proj_dim_ratio}" if self.proj_dim is None else f"proj_dim={self.proj_dim}"
        return f"{super().extra_repr()}, {size}, matmul={self.matmul!r}"


#: FewBit's other name for it (Gaussian random projection).
LinearGRP = RandomizedLinear
