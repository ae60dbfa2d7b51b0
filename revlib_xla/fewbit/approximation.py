"""The optimal piecewise-constant approximation of an activation's derivative, computed by revlib_xla itself.

A few-bit activation keeps, for each input element x, only the index k of the interval (b_k, b_{k+1}] that x falls
in, and its backward multiplies the incoming gradient by a level l_k instead of f'(x). With K = 2**bits intervals
the borders b_1 < ... < b_{K-1} (b_0 = -inf, b_K = +inf) and levels l_0..l_{K-1} are chosen to minimise the
expected squared error of the derivative for a standard-normal input (activations after a normalisation layer are
roughly standard normal):

    J(b, l) = integral of (f'(x) - q(x))**2 * w(x) dx,   q = l_k on (b_k, b_{k+1}],  w = N(0, 1) density.

How it is solved:

1. For fixed borders the optimal level of each interval is the weighted mean of f' over it,
   l_k = S1_k / S0_k with S0_k = int w, S1_k = int f' w, and then J = int f'**2 w - sum_k S1_k**2 / S0_k.
   So only the borders are unknown.
2. Global start: a dynamic program over 801 candidate borders on [-8, 8] (plus the kinks of f') picks the best K-1
   borders on that grid exactly (O(K N**2)).
3. Refinement: the derivative of J with respect to one border is
   dJ/db_k = w(b_k) * (l_k - l_{k-1}) * (2 f'(b_k) - l_{k-1} - l_k),
   zero where f'(b_k) is the mean of the two neighbouring levels. Sweeps alternately over the odd and the even
   borders (each half is independent given the other) move every border to the zero of its own derivative with
   its neighbours fixed (the minimum is bracketed on a 64-point grid between the neighbours, then located by
   bisection on the sign of that derivative; a move that would raise J is refused). Every 10 sweeps Newton's method
   (finite-difference Hessian, backtracking on J) is tried on the borders not sitting at a kink of f'; it is kept
   only if a further sweep then moves nothing by more than 1e-9. Iteration stops when no border moves by 1e-12. The
   bisection also finds minima at a jump of f' (SELU at 0), where the derivative changes sign without a zero.
4. Of two optima that are mirror images (f' symmetric about 0, or about a constant: tanh, gelu, ...), the one
   with the smaller first border is taken, so that every CPU gives the same table.
5. Borders are rounded to float32 (the comparison precision of the kernels) and the levels recomputed for them.

The moments S0, S1, S2 come from 32-point Gauss-Legendre quadrature on cells of width <= 1/20 whose ends include
every kink of f', with f' evaluated by torch autograd in float64, which is accurate to ~1e-15.
The built-in activations' tables are stored in ``tables.json``, written by this optimiser
(``python -m revlib_xla.fewbit.activations``) and checked against it by the tests; other parameters are computed on
first use and cached in memory (:func:`revlib_xla.fewbit.stepwise_table`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

__all__ = ["StepwiseDerivative", "optimal_stepwise", "weighted_error", "derivative_of", "SUPPORTED_BITS"]

SUPPORTED_BITS = (1, 2, 3, 4)
_LIMIT = 12.0  # the normal weight beyond +-12 is below 1e-31: the integrals stop there
_CELL = 0.05  # quadrature cell width
_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(32)
_DP_GRID = np.linspace(-8.0, 8.0, 801)
#: Round-off of J: the quadrature sums ~500 cells of O(1e-3) terms in float64, so two computations of the same J
#: (on two CPUs, or at mirrored borders) agree to ~1e-16 absolute; errors closer than _TIE * max(J, _ERROR_FLOOR)
#: are equal.
_TIE = 1e-13
_ERROR_FLOOR = 1e-3


def derivative_of(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[np.ndarray], np.ndarray]:
    """f' as a numpy function, by torch autograd in float64 (f acts elementwise)."""

    def derivative(x: np.ndarray) -> np.ndarray:
        t = torch.tensor(np.asarray(x, dtype=np.float64), device="cpu").requires_grad_(True)
        # identity saved-tensor hooks: a table computed on first use inside a caller's hooks (a cast to bfloat16 by
        # memory_efficient_intermediates, a byte counter) must not go through them
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda v: v, lambda v: v):
            (grad,) = torch.autograd.grad(fn(t).sum(), t)
        return grad.numpy()

    return derivative


def _normal_pdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


class _Moments:
    """Prefix integrals M_p(x) = int_{-LIMIT}^x f'(t)**p w(t) dt for p = 0, 1, 2, at any x."""

    def __init__(self, derivative: Callable[[np.ndarray], np.ndarray], kinks: Iterable[float]) -> None:
        self.derivative = derivative
        edges = set(np.arange(-_LIMIT, _LIMIT + _CELL / 2, _CELL).round(12).tolist())
        edges.update(float(k) for k in kinks if -_LIMIT < k < _LIMIT)
        self.edges = np.array(sorted(edges))
        lo, hi = self.edges[:-1], self.edges[1:]
        cells = self._integrate(lo, hi)  # (3, cells)
        self.prefix = np.concatenate([np.zeros((3, 1)), np.cumsum(cells, axis=1)], axis=1)
        self.total = self.prefix[:, -1]

    def _integrate(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        half = (hi - lo)[:, None] / 2
        x = (lo[:, None] + hi[:, None]) / 2 + half * _GL_NODES[None, :]
        d = self.derivative(x.ravel()).reshape(x.shape)
        w = _normal_pdf(x) * _GL_WEIGHTS[None, :] * half
        return np.stack([w.sum(1), (d * w).sum(1), (d * d * w).sum(1)])

    def at(self, x: np.ndarray) -> np.ndarray:
        """(3, len(x)) prefix moments; x is clipped to the integration range."""
        x = np.clip(np.asarray(x, dtype=np.float64), -_LIMIT, _LIMIT)
        cell = np.clip(np.searchsorted(self.edges, x, side="right") - 1, 0, len(self.edges) - 2)
        return self.prefix[:, cell] + self._integrate(self.edges[cell], x)


@dataclasses.dataclass(frozen=True)
class StepwiseDerivative:
    """A piecewise-constant derivative: ``levels[k]`` on ``(borders[k-1], borders[k]]`` (open ends at +-inf).

    ``error`` is the weighted squared error J; ``relative_error`` is sqrt(J / int f'**2 w), the relative L2 error of
    the gradient for a standard-normal input.
    """

    bits: int
    borders: tuple[float, ...]
    levels: tuple[float, ...]
    error: float
    relative_error: float

    def __post_init__(self) -> None:
        if len(self.levels) != len(self.borders) + 1:
            raise ValueError(f"{len(self.levels)} levels need {len(self.levels) - 1} borders, got {len(self.borders)}")
        if any(b >= c for b, c in zip(self.borders, self.borders[1:])):
            raise ValueError(f"borders must increase strictly, got {self.borders}")


def _levels_and_error(moments: _Moments, borders: np.ndarray) -> tuple[np.ndarray, float]:
    ends = np.concatenate([[-_LIMIT], np.clip(borders, -_LIMIT, _LIMIT), [_LIMIT]])
    m = moments.at(ends)
    s0, s1 = np.diff(m[0]), np.diff(m[1])
    safe = s0 > 1e-300
    levels = np.where(safe, s1 / np.where(safe, s0, 1.0), 0.0)
    # Outside +-LIMIT an interval can be empty of weight: give it its neighbour's level (it never matters).
    for k in range(len(levels)):
        if not safe[k]:
            levels[k] = levels[k - 1] if k > 0 else levels[k + 1] if k + 1 < len(levels) else 0.0
    error = float(moments.total[2] - np.sum(np.where(safe, s1 * s1 / np.where(safe, s0, 1.0), 0.0)))
    return levels, error


def weighted_error(
    derivative: Callable[[np.ndarray], np.ndarray],
    borders: Sequence[float],
    levels: Sequence[float] | None = None,
    kinks: Iterable[float] = (),
) -> float:
    """J for these borders (and levels; by default the optimal ones, the weighted means)."""
    moments = _moments_for(derivative, tuple(kinks))
    _, error = _levels_and_error(moments, np.asarray(borders, dtype=np.float64))
    if levels is None:
        return error
    ends = np.concatenate([[-_LIMIT], np.clip(borders, -_LIMIT, _LIMIT), [_LIMIT]])
    m = moments.at(ends)
    s0, s1, s2 = np.diff(m[0]), np.diff(m[1]), np.diff(m[2])
    lv = np.asarray(levels, dtype=np.float64)
    return float(np.sum(s2 - 2 * lv * s1 + lv * lv * s0))


_MOMENTS_CACHE: dict[tuple[int, tuple[float, ...]], _Moments] = {}


def _moments_for(derivative: Callable[[np.ndarray], np.ndarray], kinks: tuple[float, ...]) -> _Moments:
    key = (id(derivative), kinks)
    hit = _MOMENTS_CACHE.get(key)
    if hit is None or hit.derivative is not derivative:
        hit = _MOMENTS_CACHE[key] = _Moments(derivative, kinks)
    return hit


def _dynamic_program(moments: _Moments, pieces: int, kinks: Iterable[float]) -> np.ndarray:
    grid = np.array(sorted(set(_DP_GRID.tolist()) | {float(k) for k in kinks if -8 < k < 8}))
    points = np.concatenate([[-_LIMIT], grid, [_LIMIT]])
    m = moments.at(points)
    s0 = m[0][None, :] - m[0][:, None]  # [i, j]: interval points[i]..points[j]
    s1 = m[1][None, :] - m[1][:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = np.where(s0 > 1e-300, s1 * s1 / s0, 0.0)  # maximise the sum of gains = minimise J
    gain = np.where(np.triu(np.ones_like(gain, dtype=bool), 1), gain, -np.inf)
    n = len(points)
    best = gain[0].copy()  # one piece from points[0] to points[j]
    choice = []
    for _ in range(pieces - 1):
        total = best[:, None] + gain  # previous pieces end at i, next piece i..j
        arg = np.argmax(total, axis=0)
        best = total[arg, np.arange(n)]
        choice.append(arg)
    borders, j = [], n - 1
    for arg in reversed(choice):
        j = int(arg[j])
        borders.append(points[j])
    return np.array(sorted(borders))


def _border_slope(moments: _Moments, left: np.ndarray, border: np.ndarray, right: np.ndarray) -> np.ndarray:
    """dJ/db for each border with its neighbours fixed (its sign is what bisection needs)."""
    m = moments.at(np.concatenate([left, border, right])).reshape(3, 3, -1)
    s0l, s1l = m[0, 1] - m[0, 0], m[1, 1] - m[1, 0]
    s0r, s1r = m[0, 2] - m[0, 1], m[1, 2] - m[1, 1]
    ll = np.where(s0l > 1e-300, s1l / np.maximum(s0l, 1e-300), 0.0)
    lr = np.where(s0r > 1e-300, s1r / np.maximum(s0r, 1e-300), 0.0)
    d = moments.derivative(border)
    return _normal_pdf(border) * (lr - ll) * (2 * d - ll - lr)


def _slopes(moments: _Moments, b: np.ndarray) -> np.ndarray:
    ext = np.concatenate([[-_LIMIT], b, [_LIMIT]])
    return _border_slope(moments, ext[:-2], b, ext[2:])


def _local_gain(moments: _Moments, left: np.ndarray, border: np.ndarray, right: np.ndarray) -> np.ndarray:
    """sum of S1**2 / S0 over the two intervals a border separates (J along that border is a constant minus it)."""
    m = moments.at(np.concatenate([left, border, right]).ravel()).reshape(3, 3, *border.shape)
    gain = np.zeros(border.shape)
    for a, b in ((0, 1), (1, 2)):
        s0, s1 = m[0, b] - m[0, a], m[1, b] - m[1, a]
        gain = gain + np.where(s0 > 1e-300, s1 * s1 / np.maximum(s0, 1e-300), 0.0)
    return gain


def _coordinate_sweep(moments: _Moments, b: np.ndarray, samples: int = 64) -> float:
    """Move every border to the minimum of J along its own axis (odd borders, then even); return the largest move.

    The minimum along one axis is bracketed on a grid of ``samples`` points between the neighbours (J may have
    several local minima there) and then located by bisection on the sign of dJ/db.
    """
    moved = 0.0
    for parity in (0, 1):
        idx = np.arange(parity, len(b), 2)
        if len(idx) == 0:
            continue
        ext = np.concatenate([[-_LIMIT], b, [_LIMIT]])
        left, right = ext[idx], ext[idx + 2]
        frac = np.linspace(0.0, 1.0, samples + 1)[None, 1:-1]
        grid = left[:, None] + (right - left)[:, None] * frac  # (borders, samples - 1)
        gains = _local_gain(
            moments, np.broadcast_to(left[:, None], grid.shape), grid, np.broadcast_to(right[:, None], grid.shape)
        )
        best = np.argmax(gains, axis=1)
        rows = np.arange(len(idx))
        full = np.concatenate([left[:, None], grid, right[:, None]], axis=1)
        lo, hi = full[rows, best], full[rows, best + 2]
        for _ in range(50):
            mid = (lo + hi) / 2
            slope = _border_slope(moments, left, mid, right)
            lo = np.where(slope < 0, mid, lo)
            hi = np.where(slope < 0, hi, mid)
        new = (lo + hi) / 2
        current = _local_gain(moments, left, b[idx], right)
        candidate = _local_gain(moments, left, new, right)
        new = np.where(candidate >= current, new, b[idx])  # never make J worse
        moved = max(moved, float(np.max(np.abs(new - b[idx]))))
        b[idx] = new
    return moved


def _newton(moments: _Moments, b: np.ndarray, fixed: np.ndarray, tol: float) -> bool:
    """Newton's method on dJ/db = 0 for the borders not pinned at a kink; True when it converged."""
    free = np.flatnonzero(~fixed)
    if len(free) == 0:
        return True
    _, error = _levels_and_error(moments, b)
    for _ in range(50):
        grad = _slopes(moments, b)[free]
        h = 1e-6
        hess = np.empty((len(free), len(free)))
        for col, k in enumerate(free):
            up, down = b.copy(), b.copy()
            up[k] += h
            down[k] -= h
            hess[:, col] = (_slopes(moments, up)[free] - _slopes(moments, down)[free]) / (2 * h)
        hess = (hess + hess.T) / 2
        try:
            if np.min(np.linalg.eigvalsh(hess)) <= 0:
                return False
            step = -np.linalg.solve(hess, grad)
        except np.linalg.LinAlgError:
            return False
        scale = 1.0
        while scale > 1e-4:
            trial = b.copy()
            trial[free] += scale * step
            if np.all(np.diff(trial) > 0):
                _, trial_error = _levels_and_error(moments, trial)
                if trial_error <= error + 1e-16:
                    break
            scale /= 2
        else:
            return False
        b[:] = trial
        error = trial_error
        if np.max(np.abs(scale * step)) < tol:
            return True
    return False


def _refine(moments: _Moments, borders: np.ndarray, kinks: Sequence[float], tol: float = 1e-12) -> np.ndarray:
    b = borders.copy()
    if len(b) == 0:
        return b
    kink_array = np.array(list(kinks) or [np.inf])
    for sweep in range(400):
        moved = _coordinate_sweep(moments, b)
        if moved < tol:
            break
        if sweep % 10 == 9:  # coordinate sweeps converge slowly near the optimum; Newton finishes the job
            at_kink = np.min(np.abs(b[:, None] - kink_array[None, :]), axis=1) < 1e-9
            trial = b.copy()
            if _newton(moments, trial, at_kink, tol) and _coordinate_sweep(moments, trial.copy()) < 1e-9:
                b = trial
                _coordinate_sweep(moments, b)
                break
    return b


def _break_mirror_tie(moments: _Moments, borders: np.ndarray) -> np.ndarray:
    """Of the borders and their mirror image, the one with the smaller first border when both have the same error.

    The normal weight is symmetric, so when f'(-x) is f'(x) or c - f'(x) (tanh, sigmoid, gelu, hardswish, ...) the
    mirrored borders -b[::-1] are as good as b. Several of these optima are not symmetric themselves (tanh at 1 and 2
    bits), and which of the two the dynamic program finds is decided by the last bits of its sums, which differ
    between CPUs; this rule makes the result the same everywhere.
    """
    mirror = -borders[::-1]
    _, error = _levels_and_error(moments, borders)
    _, mirror_error = _levels_and_error(moments, mirror)
    if abs(mirror_error - error) <= _TIE * max(error, _ERROR_FLOOR) and tuple(mirror) < tuple(borders):
        return mirror
    return borders


def optimal_stepwise(
    fn: Callable[[torch.Tensor], torch.Tensor], bits: int, kinks: Iterable[float] = ()
) -> StepwiseDerivative:
    """The optimal ``2**bits``-level approximation of ``fn``'s derivative (see the module docstring).

    ``fn`` acts elementwise on float64 tensors; ``kinks`` lists points where f' is not smooth (quadrature cells and
    DP candidates end there).
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    kinks = tuple(sorted(float(k) for k in kinks))
    derivative = derivative_of(fn)
    moments = _Moments(derivative, kinks)
    borders = _break_mirror_tie(moments, _refine(moments, _dynamic_program(moments, 2**bits, kinks), kinks))
    borders32 = np.unique(borders.astype(np.float32)).astype(np.float64)
    if len(borders32) != len(borders):
        raise ArithmeticError(f"two optimal borders round to the same float32 value: {borders}")
    levels, error = _levels_and_error(moments, borders32)
    relative = math.sqrt(max(error, 0.0) / moments.total[2]) if moments.total[2] > 0 else 0.0
    return StepwiseDerivative(bits, tuple(borders32.tolist()), tuple(levels.tolist()), error, relative)
