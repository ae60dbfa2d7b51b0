"""Functional forms of the few-bit activations: ``fewbit.functional.gelu(x, bits=3)`` and so on.

Each takes PyTorch's arguments plus ``bits`` (1-4 for smooth activations, default 3; piecewise-linear ones are
exact with 1 bit, their only width). ``inplace`` is accepted for drop-in use and ignored: the forward is computed
out of place (the memory saved is in what backward keeps, not in the output).
"""

from __future__ import annotations

import torch

from .activations import few_bit

Tensor = torch.Tensor

__all__ = [
    "celu",
    "elu",
    "gelu",
    "hardswish",
    "logsigmoid",
    "mish",
    "selu",
    "sigmoid",
    "silu",
    "softplus",
    "softsign",
    "tanh",
    "tanhshrink",
    "leaky_relu",
    "relu",
    "threshold",
    "hardsigmoid",
    "hardtanh",
    "relu6",
    "hardshrink",
    "softshrink",
]

DEFAULT_BITS = 3


def celu(x: Tensor, alpha: float = 1.0, inplace: bool = False, *, bits: int = DEFAULT_BITS) -> Tensor:
    return few_bit("celu", x, bits, alpha=float(alpha))


def elu(x: Tensor, alpha: float = 1.0, inplace: bool = False, *, bits: int = DEFAULT_BITS) -> Tensor:
    return few_bit("elu", x, bits, alpha=float(alpha))


def gelu(x: Tensor, approximate: str = "none", *, bits: int = DEFAULT_BITS) -> Tensor:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu's approximate must be 'none' or 'tanh', got {approximate!r}")
    return few_bit("gelu", x, bits, approximate=approximate)


def hardswish(x: Tensor, inplace: bool = False, *, bits: int = DEFAULT_BITS) -> Tensor:
    return few_bit("hardswish", x, bits)


def logsigmoid(x: Tensor, *, bits: int = DEFAULT_BITS) -> Tensor:
    return few_bit("logsigmoid", x, bits)


def mish(x: Tensor, inplace: bool = False, *, bits: int = DEFAULT_BITS) -> Tensor:
    return few_bit("mish", x, bits)


def selu(x: Tensor, inplace: bool = False, *, bits: int = DEFAULT_BITS) -> Tensor:
    return few_bit("selu", x, bits)


def sigmoid(x: Tensor, *, bits: int = DEFAULT_BITS) -> Tensor:
    return few_bit("sigmoid", x, bits)


def silu(x: Tensor, inplace: bool = False, *, bits: int = DEFAULT_BITS) -> Tensor:
    return few_bit("silu", x, bits)


def softplus(x: Tensor, beta: float = 1.0, threshold: float = 20.0, *, bits: int = DEFAULT_BITS) -> Tensor:
    return few_bit("softplus", x, bits, beta=float(beta), threshold=float(threshold))


def softsign(x: Tensor, *, bits: int = DEFAULT_BITS) -> Tensor:
    return few_bit("softsign", x, bits)


def tanh(x: Tensor, *, bits: int = DEFAULT_BITS) -> Tensor:
    return few_bit("tanh", x, bits)


def tanhshrink(x: Tensor, *, bits: int = DEFAULT_BITS) -> Tensor:
    return few_bit("tanhshrink", x, bits)


def leaky_relu(x: Tensor, negative_slope: float = 0.01, inplace: bool = False, *, bits: int = 1) -> Tensor:
    return few_bit("leaky_relu", x, bits, negative_slope=float(negative_slope))


def relu(x: Tensor, inplace: bool = False, *, bits: int = 1) -> Tensor:
    return few_bit("relu", x, bits)


def threshold(x: Tensor, threshold: float, value: float, inplace: bool = False, *, bits: int = 1) -> Tensor:
    return few_bit("threshold", x, bits, threshold=float(threshold), value=float(value))


def hardsigmoid(x: Tensor, inplace: bool = False, *, bits: int = 1) -> Tensor:
    return few_bit("hardsigmoid", x, bits)


def hardtanh(x: Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False, *, bits: int = 1) -> Tensor:
    if not min_val < max_val:
        raise ValueError(f"hardtanh needs min_val < max_val, got {min_val} and {max_val}")
    return few_bit("hardtanh", x, bits, min_val=float(min_val), max_val=float(max_val))


def relu6(x: Tensor, inplace: bool = False, *, bits: int = 1) -> Tensor:
    return few_bit("relu6", x, bits)


def hardshrink(x: Tensor, lambd: float = 0.5, *, bits: int = 1) -> Tensor:
    return few_bit("hardshrink", x, bits, lambd=float(lambd))


def softshrink(x: Tensor, lambd: float = 0.5, *, bits: int = 1) -> Tensor:
    return few_bit("softshrink", x, bits, lambd=float(lambd))
