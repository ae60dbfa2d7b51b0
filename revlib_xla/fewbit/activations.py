"""Few-bit activations: the exact forward, and a backward that keeps only ``bits`` bits per input element.

Smooth activations (celu, elu, gelu, hardswish, logsigmoid, mish, selu, sigmoid, silu, softplus, softsign, tanh,
tanhshrink) take ``bits`` in 1..4: the backward multiplies the incoming gradient by the optimal ``2**bits``-level
piecewise-constant approximation of the derivative (:mod:`.approximation`). Piecewise-linear activations
(leaky_relu, relu, threshold, hardsigmoid, hardtanh, relu6, hardshrink, softshrink) have a derivative with two
values, so one bit (inside or outside a band) gives their gradient exactly - elementwise equal to PyTorch's.

What is saved for backward: the packed codes (one uint8 tensor of ``bits * numel / 8`` bytes, rounded up to a whole
packing group); borders and levels are constants of the activation.

Infinite and NaN inputs get PyTorch's gradient where the codes can carry it: piecewise-linear activations send NaN
to the side of the band PyTorch's backward kernel sends it (relu: passes the gradient, leaky_relu: the slope, ...),
so their gradients equal PyTorch's at NaN and +-inf too; ELU, CELU, SELU and Hardswish, whose PyTorch gradient at
NaN is the one at +inf, code NaN in the top interval. Where PyTorch's gradient is NaN (at NaN for most smooth
activations, and at +-inf for GELU, Mish, SiLU and Softsign), the codes cannot tell that input from the finite ones
of its interval (the lowest for NaN and -inf, the highest for +inf): the forward also saves two flags (2 bytes),
whether such an input occurred at each end, and the backward makes that end's level NaN, so the gradient is NaN
there and at every element coded in the same interval - never a finite number in its place.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .. import backends, kernels
from .approximation import SUPPORTED_BITS, StepwiseDerivative, derivative_of, optimal_stepwise

Tensor = torch.Tensor

__all__ = [
    "SMOOTH",
    "PIECEWISE",
    "stepwise_table",
    "few_bit",
    "FewBitFunction",
    "Band",
    "StepCode",
    "TABLES_FILE",
    "write_builtin_tables",
]

TABLES_FILE = Path(__file__).with_name("tables.json")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclasses.dataclass(frozen=True)
class SmoothSpec:
    """A smooth activation: its forward, default parameters and the points where its derivative has a kink."""

    forward: Callable[..., Tensor]
    defaults: tuple[tuple[str, Any], ...] = ()
    kinks: Callable[..., tuple[float, ...]] = lambda **_: ()


SMOOTH: dict[str, SmoothSpec] = {
    "celu": SmoothSpec(lambda x, alpha: F.celu(x, alpha), (("alpha", 1.0),), lambda **_: (0.0,)),
    "elu": SmoothSpec(lambda x, alpha: F.elu(x, alpha), (("alpha", 1.0),), lambda **_: (0.0,)),
    "gelu": SmoothSpec(lambda x, approximate: F.gelu(x, approximate=approximate), (("approximate", "none"),)),
    "hardswish": SmoothSpec(F.hardswish, (), lambda: (-3.0, 3.0)),
    "logsigmoid": SmoothSpec(F.logsigmoid),
    "mish": SmoothSpec(F.mish),
    "selu": SmoothSpec(F.selu, (), lambda: (0.0,)),
    "sigmoid": SmoothSpec(torch.sigmoid),
    "silu": SmoothSpec(F.silu),
    "softplus": SmoothSpec(
        lambda x, beta, threshold: F.softplus(x, beta, threshold),
        (("beta", 1.0), ("threshold", 20.0)),
        lambda beta, threshold: (threshold / beta,),
    ),
    "softsign": SmoothSpec(F.softsign, (), lambda: (0.0,)),
    "tanh": SmoothSpec(torch.tanh),
    "tanhshrink": SmoothSpec(F.tanhshrink),
}


@dataclasses.dataclass(frozen=True)
class PiecewiseSpec:
    """A piecewise-linear activation: its forward, and its derivative as a band (see :class:`Band`)."""

    forward: Callable[..., Tensor]
    band: Callable[..., Band]
    defaults: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class Band:
    """A two-valued derivative: ``inside`` where ``lo < x < hi`` (``lo <= x <= hi`` if ``closed``), else
    ``outside``; None means no bound. The boundary conventions are PyTorch's backward kernels'."""

    lo: float | None
    hi: float | None
    closed: bool
    inside: float
    outside: float
    bits: int = 1
    nan_inside: bool = False  # PyTorch's kernel tests "outside" (x <= lo, ...), so NaN lands inside
    select_zero: bool = True  # a zero level gives 0 for an inf/NaN gradient: PyTorch's kernel selects (not leaky_relu)

    @property
    def levels(self) -> tuple[float, float]:
        return (self.outside, self.inside)


PIECEWISE: dict[str, PiecewiseSpec] = {
    "relu": PiecewiseSpec(F.relu, lambda: Band(0.0, None, False, 1.0, 0.0, nan_inside=True)),
    "leaky_relu": PiecewiseSpec(
        lambda x, negative_slope: F.leaky_relu(x, negative_slope),
        lambda negative_slope: Band(0.0, None, False, 1.0, negative_slope, select_zero=False),
        (("negative_slope", 0.01),),
    ),
    "threshold": PiecewiseSpec(
        lambda x, threshold, value: F.threshold(x, threshold, value),
        lambda threshold, value: Band(threshold, None, False, 1.0, 0.0, nan_inside=True),
        (("threshold", None), ("value", None)),
    ),
    "hardsigmoid": PiecewiseSpec(F.hardsigmoid, lambda: Band(-3.0, 3.0, False, 1.0 / 6.0, 0.0)),
    "hardtanh": PiecewiseSpec(
        lambda x, min_val, max_val: F.hardtanh(x, min_val, max_val),
        lambda min_val, max_val: Band(min_val, max_val, False, 1.0, 0.0, nan_inside=True),
        (("min_val", -1.0), ("max_val", 1.0)),
    ),
    "relu6": PiecewiseSpec(F.relu6, lambda: Band(0.0, 6.0, False, 1.0, 0.0, nan_inside=True)),
    "hardshrink": PiecewiseSpec(
        lambda x, lambd: F.hardshrink(x, lambd), lambda lambd: Band(-lambd, lambd, True, 0.0, 1.0), (("lambd", 0.5),)
    ),
    "softshrink": PiecewiseSpec(
        lambda x, lambd: F.softshrink(x, lambd), lambda lambd: Band(-lambd, lambd, True, 0.0, 1.0), (("lambd", 0.5),)
    ),
}


@dataclasses.dataclass(frozen=True)
class StepCode:
    """A stepwise derivative used by the backward: borders and levels, as the kernels take them, and where
    PyTorch's gradient of the activation is NaN at a non-finite input (see the module docstring).

    ``nan_high``: NaN is coded in the top interval (PyTorch's gradient at NaN is finite, its gradient at +inf);
    ``nan_at_nan`` / ``nan_at_neg_inf`` / ``nan_at_pos_inf``: PyTorch's gradient there is NaN.
    """

    bits: int
    borders: tuple[float, ...]
    levels: tuple[float, ...]
    nan_high: bool = False
    nan_at_nan: bool = False
    nan_at_neg_inf: bool = False
    nan_at_pos_inf: bool = False

    @property
    def flags_nan(self) -> bool:
        """Whether the forward must record non-finite inputs (some end level may have to become NaN)."""
        return self.nan_at_nan or self.nan_at_neg_inf or self.nan_at_pos_inf

    def nan_ends(self, x: Tensor) -> Tensor:
        """Two bools on ``x``'s device, no host sync: whether the lowest / highest level must be NaN for ``x``."""
        no = torch.zeros((), dtype=torch.bool, device=x.device)
        if self.nan_at_nan and self.nan_at_neg_inf:
            low = ~(x > float("-inf")).all()  # NaN or -inf, in one pass (XLA's min() skips NaN)
        elif self.nan_at_nan:
            low = x.isnan().any()
        elif self.nan_at_neg_inf:
            low = (x == float("-inf")).any()
        else:
            low = no
        high = (x == float("inf")).any() if self.nan_at_pos_inf else no
        return torch.stack([low, high])


def _params(name: str, defaults: tuple[tuple[str, Any], ...], given: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    unknown = set(given) - {key for key, _ in defaults}
    if unknown:
        raise TypeError(
            f"few-bit {name} has no parameter(s) {sorted(unknown)}; it takes {[key for key, _ in defaults] or 'none'}"
        )
    params = tuple((key, given.get(key, default)) for key, default in defaults)
    missing = [key for key, value in params if value is None]
    if missing:
        raise TypeError(f"few-bit {name} needs the parameter(s) {missing}")
    return params


_NOT_NUMBERS = {("threshold", "value"), ("gelu", "approximate")}  # the backward never compares with these


def check_params(name: str, params: dict[str, Any]) -> None:
    """Refuse a parameter the backward cannot use: a non-number, NaN (every comparison with a NaN band edge is
    false), or, for a smooth activation, an infinity (its derivative table is computed from the parameters)."""
    for key, value in params.items():
        if (name, key) in _NOT_NUMBERS:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"few-bit {name}: {key} must be a number, got {type(value).__name__} {value!r}")
        if math.isnan(value) or (name in SMOOTH and math.isinf(value)):
            why = (
                "its derivative table is computed from it"
                if name in SMOOTH
                else "its gradient compares the input with it, and every comparison with NaN is false"
            )
            raise ValueError(
                f"few-bit {name}: {key}={value} cannot be used ({why}); pass a finite number, or keep "
                f"torch's own activation here"
            )


def _table_key(name: str, params: tuple[tuple[str, Any], ...], bits: int) -> str:
    return json.dumps([name, [[k, v] for k, v in params], bits])


@functools.cache
def _builtin_tables() -> dict[str, dict[str, Any]]:
    if not TABLES_FILE.exists():
        return {}
    return json.loads(TABLES_FILE.read_text())


@functools.cache
def stepwise_table(name: str, bits: int, params: tuple[tuple[str, Any], ...] = ()) -> StepwiseDerivative:
    """The optimal stepwise derivative of a smooth activation: from ``tables.json`` for the built-in parameters,
    else computed now by :func:`~revlib_xla.fewbit.approximation.optimal_stepwise` (a second or two) and cached."""
    spec = SMOOTH[name]
    params = params or _params(name, spec.defaults, {})
    stored = _builtin_tables().get(_table_key(name, params, bits))
    if stored is not None:
        return StepwiseDerivative(
            bits, tuple(stored["borders"]), tuple(stored["levels"]), stored["error"], stored["relative_error"]
        )
    kwargs = dict(params)
    return optimal_stepwise(lambda x: spec.forward(x, **kwargs), bits, spec.kinks(**kwargs))


def write_builtin_tables(path: Path = TABLES_FILE) -> dict[str, dict[str, Any]]:
    """Compute every smooth activation's table at its default parameters and bits 1-4 and write them to ``path``
    (``python -m revlib_xla.fewbit.activations``)."""
    tables = {}
    for name, spec in SMOOTH.items():
        params = _params(name, spec.defaults, {})
        kwargs = dict(params)
        for bits in SUPPORTED_BITS:
            table = optimal_stepwise(functools.partial(spec.forward, **kwargs), bits, spec.kinks(**kwargs))
            tables[_table_key(name, params, bits)] = dataclasses.asdict(table)
    path.write_text(json.dumps(tables, indent=1) + "\n")
    _builtin_tables.cache_clear()
    stepwise_table.cache_clear()
    return tables


class FewBitFunction(torch.autograd.Function):
    """y = forward(x) exactly; saves the packed codes of x (and, where needed, two NaN flags); backward =
    grad * levels[code]."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, forward: Callable[[Tensor], Tensor], derivative: Any) -> Tensor:
        y = forward(x)
        nan_ends = None
        if isinstance(derivative, Band):
            packed = kernels.encode_band(x, derivative.lo, derivative.hi, derivative.closed, derivative.nan_inside)
        else:
            packed = kernels.encode_stepwise(x, derivative.borders, derivative.bits, derivative.nan_high)
            if derivative.flags_nan:
                nan_ends = derivative.nan_ends(x)
        # Tie the codes to the output: the encode must run when the output is made, so the compiler cannot move it
        # to the backward pass and keep the full input alive instead (a no-op in eager mode).
        y, packed, *ends = backends.optimization_barrier([y, packed] + ([nan_ends] if nan_ends is not None else []))
        nan_ends = ends[0] if ends else None
        ctx.save_for_backward(packed, nan_ends)
        ctx.derivative = derivative
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        packed, nan_ends = ctx.saved_tensors
        derivative = ctx.derivative
        select_zero = derivative.select_zero if isinstance(derivative, Band) else True
        return (
            kernels.stepwise_grad(
                packed, grad.contiguous(), tuple(derivative.levels), derivative.bits, select_zero, nan_ends
            ),
            None,
            None,
        )


def _check_input(name: str, x: Any) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"few-bit {name} needs a tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"few-bit {name} needs a floating-point tensor (float32, bfloat16, float16 or float64), got {x.dtype}"
        )


def check_bits(name: str, bits: Any) -> int:
    """Validate ``bits`` for activation ``name`` (1-4 for smooth ones, 1 for piecewise-linear ones)."""
    allowed = SUPPORTED_BITS if name in SMOOTH else (1,)
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in allowed:
        why = (
            "its derivative takes two values, so 1 bit is exact"
            if name in PIECEWISE
            else "supported widths are 1, 2, 3 and 4 bits"
        )
        raise ValueError(f"few-bit {name} does not support bits={bits!r}: {why}")
    return bits


@functools.cache
def derivative_for(name: str, bits: int, params: tuple[tuple[str, Any], ...]) -> Any:
    """The :class:`StepCode` or :class:`Band` derivative the backward of ``name`` uses, computed on real numbers
    also when first asked for inside ``FakeTensorMode`` (a step sized without running it)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _derivative(name, bits, params)


def _derivative(name: str, bits: int, params: tuple[tuple[str, Any], ...]) -> Any:
    if name in PIECEWISE:
        return PIECEWISE[name].band(**dict(params))
    table = stepwise_table(name, bits, params)
    kwargs = dict(params)
    # PyTorch's own gradient (cpu autograd, float64) at NaN, +inf and -inf decides where NaN is coded and where
    # the gradient must be NaN.
    at_nan, at_pos_inf, at_neg_inf = derivative_of(lambda t: SMOOTH[name].forward(t, **kwargs))(
        np.array([math.nan, math.inf, -math.inf])
    ).tolist()
    return StepCode(
        bits,
        table.borders,
        table.levels,
        nan_high=math.isfinite(at_nan) and at_nan == at_pos_inf,
        nan_at_nan=not math.isfinite(at_nan),
        nan_at_neg_inf=not math.isfinite(at_neg_inf),
        nan_at_pos_inf=not math.isfinite(at_pos_inf),
    )


def few_bit(name: str, x: Tensor, bits: int, **params: Any) -> Tensor:
    """Apply activation ``name`` to ``x`` with a ``bits``-bit backward (the functional forms call this)."""
    if name not in SMOOTH and name not in PIECEWISE:
        raise ValueError(
            f"{name!r} has no few-bit form; few-bit activations are "
            f"{sorted(SMOOTH)} (1-4 bits) and {sorted(PIECEWISE)} (1 bit)"
        )
    _check_input(name, x)
    bits = check_bits(name, bits)
    spec = SMOOTH.get(name) or PIECEWISE[name]
    params_t = _params(name, spec.defaults, params)
    check_params(name, dict(params_t))
    kwargs = dict(params_t)

    def forward(t: Tensor) -> Tensor:
        return spec.forward(t, **kwargs)

    if not (torch.is_grad_enabled() and x.requires_grad):
        return forward(x)  # nothing will be differentiated: nothing to save
    return FewBitFunction.apply(x, forward, derivative_for(name, bits, params_t))


if __name__ == "__main__":
    written = write_builtin_tables()
    print(f"wrote {len(written)} tables to {TABLES_FILE}")
