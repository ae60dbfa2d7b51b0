"""Module forms of the few-bit activations, drop-in replacements for ``torch.nn``'s: ``fewbit.GELU(bits=3)``.

Constructor arguments are PyTorch's plus the keyword ``bits`` (smooth activations: 1-4, default 3; piecewise-linear
ones: 1). ``inplace`` is accepted and ignored (see :mod:`.functional`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import functional as FB
from .activations import PIECEWISE, SMOOTH, check_bits, check_params

Tensor = torch.Tensor

__all__ = [
    "CELU",
    "ELU",
    "GELU",
    "Hardswish",
    "LogSigmoid",
    "Mish",
    "SELU",
    "Sigmoid",
    "SiLU",
    "Softplus",
    "Softsign",
    "Tanh",
    "Tanhshrink",
    "LeakyReLU",
    "ReLU",
    "Threshold",
    "Hardsigmoid",
    "Hardtanh",
    "ReLU6",
    "Hardshrink",
    "Softshrink",
    "FewBitActivation",
    "activation",
    "convert_activation",
    "MODULES",
]


class FewBitActivation(nn.Module):
    """Base class: ``forward(x) = fewbit.functional.<name>(x, **params, bits=bits)``."""

    name: str = ""

    def __init__(self, bits: int, **params: Any) -> None:
        super().__init__()
        self.bits = check_bits(self.name, bits)
        check_params(self.name, params)
        self.params: dict[str, Any] = params

    def forward(self, x: Tensor) -> Tensor:
        return getattr(FB, self.name)(x, **self.params, bits=self.bits)

    def extra_repr(self) -> str:
        return ", ".join([f"bits={self.bits}"] + [f"{k}={v!r}" for k, v in self.params.items()])


def _smooth(cls_name: str, name: str, **defaults: Any) -> type[FewBitActivation]:
    def __init__(self, *args: Any, bits: int = FB.DEFAULT_BITS, inplace: bool = False, **kwargs: Any) -> None:
        FewBitActivation.__init__(self, bits, **_bind(cls_name, defaults, args, kwargs))

    return type(
        cls_name,
        (FewBitActivation,),
        {"name": name, "__init__": __init__, "__doc__": f"Few-bit ``torch.nn.{cls_name}``."},
    )


def _piecewise(cls_name: str, name: str, **defaults: Any) -> type[FewBitActivation]:
    def __init__(self, *args: Any, bits: int = 1, inplace: bool = False, **kwargs: Any) -> None:
        FewBitActivation.__init__(self, bits, **_bind(cls_name, defaults, args, kwargs))

    return type(
        cls_name,
        (FewBitActivation,),
        {"name": name, "__init__": __init__, "__doc__": f"``torch.nn.{cls_name}`` with a 1-bit backward."},
    )


_REQUIRED = object()


def _bind(cls_name: str, defaults: dict[str, Any], args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    names = list(defaults)
    if len(args) > len(names):
        raise TypeError(f"{cls_name} takes at most {len(names)} positional argument(s) ({names}), got {len(args)}")
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in defaults:
            raise TypeError(f"{cls_name} got an unexpected argument {key!r}")
        if key in bound:
            raise TypeError(f"{cls_name} got {key!r} twice")
        bound[key] = value
    for key, default in defaults.items():
        if key not in bound:
            if default is _REQUIRED:
                raise TypeError(f"{cls_name} needs the argument {key!r}")
            bound[key] = default
    return bound


CELU = _smooth("CELU", "celu", alpha=1.0)
ELU = _smooth("ELU", "elu", alpha=1.0)
GELU = _smooth("GELU", "gelu", approximate="none")
Hardswish = _smooth("Hardswish", "hardswish")
LogSigmoid = _smooth("LogSigmoid", "logsigmoid")
Mish = _smooth("Mish", "mish")
SELU = _smooth("SELU", "selu")
Sigmoid = _smooth("Sigmoid", "sigmoid")
SiLU = _smooth("SiLU", "silu")
Softplus = _smooth("Softplus", "softplus", beta=1.0, threshold=20.0)
Softsign = _smooth("Softsign", "softsign")
Tanh = _smooth("Tanh", "tanh")
Tanhshrink = _smooth("Tanhshrink", "tanhshrink")
LeakyReLU = _piecewise("LeakyReLU", "leaky_relu", negative_slope=0.01)
ReLU = _piecewise("ReLU", "relu")
Threshold = _piecewise("Threshold", "threshold", threshold=_REQUIRED, value=_REQUIRED)
Hardsigmoid = _piecewise("Hardsigmoid", "hardsigmoid")
Hardtanh = _piecewise("Hardtanh", "hardtanh", min_val=-1.0, max_val=1.0)
ReLU6 = _piecewise("ReLU6", "relu6")
Hardshrink = _piecewise("Hardshrink", "hardshrink", lambd=0.5)
Softshrink = _piecewise("Softshrink", "softshrink", lambd=0.5)

#: few-bit module class by activation name (the functional name: ``'gelu'``, ``'leaky_relu'``, ...)
MODULES: dict[str, type[FewBitActivation]] = {
    cls.name: cls
    for cls in (
        CELU,
        ELU,
        GELU,
        Hardswish,
        LogSigmoid,
        Mish,
        SELU,
        Sigmoid,
        SiLU,
        Softplus,
        Softsign,
        Tanh,
        Tanhshrink,
        LeakyReLU,
        ReLU,
        Threshold,
        Hardsigmoid,
        Hardtanh,
        ReLU6,
        Hardshrink,
        Softshrink,
    )
}
assert set(MODULES) == set(SMOOTH) | set(PIECEWISE)

# torch.nn activation class -> (few-bit class, the attributes that carry its parameters)
_FROM_TORCH = {
    nn.CELU: (CELU, ("alpha",)),
    nn.ELU: (ELU, ("alpha",)),
    nn.GELU: (GELU, ("approximate",)),
    nn.Hardswish: (Hardswish, ()),
    nn.LogSigmoid: (LogSigmoid, ()),
    nn.Mish: (Mish, ()),
    nn.SELU: (SELU, ()),
    nn.Sigmoid: (Sigmoid, ()),
    nn.SiLU: (SiLU, ()),
    nn.Softplus: (Softplus, ("beta", "threshold")),
    nn.Softsign: (Softsign, ()),
    nn.Tanh: (Tanh, ()),
    nn.Tanhshrink: (Tanhshrink, ()),
    nn.LeakyReLU: (LeakyReLU, ("negative_slope",)),
    nn.ReLU: (ReLU, ()),
    nn.Threshold: (Threshold, ("threshold", "value")),
    nn.Hardsigmoid: (Hardsigmoid, ()),
    nn.ReLU6: (ReLU6, ()),
    nn.Hardtanh: (Hardtanh, ("min_val", "max_val")),
    nn.Hardshrink: (Hardshrink, ("lambd",)),
    nn.Softshrink: (Softshrink, ("lambd",)),
}


def activation(name: str, bits: int | None = None, **params: Any) -> FewBitActivation:
    """The few-bit module for activation ``name`` (``'gelu'``, ``'relu'``, ...) with ``bits`` (default: 3 for
    smooth activations, 1 for piecewise-linear ones). An activation without a few-bit form raises ``ValueError``
    naming the ones that have one."""
    cls = MODULES.get(name)
    if cls is None:
        raise ValueError(
            f"{name!r} has no few-bit form; few-bit activations are {sorted(SMOOTH)} (1-4 bits) "
            f"and {sorted(PIECEWISE)} (1 bit)"
        )
    if bits is None:
        bits = 1 if name in PIECEWISE else FB.DEFAULT_BITS
    return cls(bits=bits, **params)


# transformers' own activation classes (``transformers.activations``, what ``ACT2FN`` builds), by class name: the
# same functions as a few-bit module computes (the tanh GELUs up to rounding), matched without importing transformers.
# Those without a few-bit form (QuickGELU, clipped GELU, ReLU squared, ...) are left unchanged.
_FROM_TRANSFORMERS: dict[str, tuple[type[FewBitActivation], dict[str, Any]]] = {
    "GELUActivation": (GELU, {"approximate": "none"}),
    "NewGELUActivation": (GELU, {"approximate": "tanh"}),
    "GELUTanh": (GELU, {"approximate": "tanh"}),
    "PytorchGELUTanh": (GELU, {"approximate": "tanh"}),
    "FastGELUActivation": (GELU, {"approximate": "tanh"}),
    "AccurateGELUActivation": (GELU, {"approximate": "tanh"}),
    "SiLUActivation": (SiLU, {}),
    "MishActivation": (Mish, {}),
}


def convert_activation(module: nn.Module, bits: int = FB.DEFAULT_BITS) -> nn.Module:
    """The few-bit equivalent of a ``torch.nn`` activation module, or of one of transformers' activation classes
    (``GELUActivation``, ``NewGELUActivation``, ``GELUTanh``, ``FastGELUActivation``, ``SiLUActivation``,
    ``MishActivation``, ...), with the same parameters; smooth ones with ``bits``, piecewise-linear ones with 1 bit.
    Any other module is returned unchanged. For :func:`map_module`."""
    cls_of = type(module)
    if cls_of.__module__ == "transformers.activations" and cls_of.__name__ in _FROM_TRANSFORMERS:
        few, fixed = _FROM_TRANSFORMERS[cls_of.__name__]
        return few(bits=bits, **fixed)
    entry = _FROM_TORCH.get(cls_of)
    if entry is None:
        return module
    cls, attrs = entry
    params = {attr: getattr(module, attr) for attr in attrs}
    return cls(bits=bits if cls.name in SMOOTH else 1, **params)
