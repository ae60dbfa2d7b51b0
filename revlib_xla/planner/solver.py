"""The optimal persistent schedule of a chain under a memory budget (rotor's dynamic program, extended).

``Opt[m][i][l]`` is the least time to run the forward and backward of stages ``i..l`` (``l = L`` includes the
loss) with ``m`` memory slots free, x_i held outside them and the gradient of x_{l+1} inside them. A persistent
schedule for ``[i, l]`` is one of:

* base (``i == l``): ``Fe_i B_i`` (or the loss ``L``); right after ``CF_i`` (the earlier segment of a leaf at
  ``j = i + 1``), the plain ``Fe_i`` stops early and costs ``stopped_fw[i]`` (:func:`~.schedule.early_stops`);
* chain: ``Fe_i``, then ``[i+1, l]`` with ``m - |x̄_{i+1}|``, then ``B_i``;
* leaf at ``j`` (``i < j <= l``): ``CF_i Fn_{i+1} .. Fn_{j-1}``, then ``[j, l]`` with ``m - |x_j|``, then
  ``[i, j-1]`` with ``m``;
* reversible (stage i reversible): ``Fr_i``, then ``[i+1, l]`` with ``m + |x_i| - |x_{i+1}|``, then ``Br_i``;
* offloaded leaf at ``j``: the leaf, with x_i written to host memory while ``[j, l]`` runs (``WM_i``/``RM_i``),
  which gives ``[j, l]`` the ``|x_i|`` slots as well.

* cached leaf at ``j`` (stage i has an attention cache, ``Chain.caches``): ``CA_i Fn_{i+1} .. Fn_{j-1}``, then
  ``[j, l]`` with ``m - |x_j| - |cache_i|``, then ``[i, j-1]`` *cached* with ``m - |cache_i|``: a third table,
  ``Opt`` for segments whose stage i keeps its cache (outside their slots), where stage i's plain forwards cost
  and keep what the cache makes them (its leaves run ``CF_i``, its chain and base ``Fe_i``, all cheaper).

Dropping or offloading x_i frees memory only when x_i is a tensor of its own: not when it is part of x̄_i (the
chain case) or the caller's input x_0. So the program keeps two tables, for inputs that can and cannot be freed.

Every candidate is evaluated for all ``i`` of one segment length and all ``m`` at once (tensor operations over
``[i, j, m]``), so 100 stages and 500 slots take about a second. Ties go to the leaf, then the chain, as in rotor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch

from .chain import Chain
from .schedule import Op, OpKind, Schedule, simulate

__all__ = ["solve", "plan", "min_memory", "no_checkpoint_memory", "InfeasibleBudget"]

_INF = math.inf


class InfeasibleBudget(ValueError):
    """No schedule fits in the budget. ``minimum`` is the smallest budget any schedule fits in (chain units).
    ``unit`` is set when the budget is at least that minimum but the plan's sizes, rounded up to multiples of
    ``unit`` (the budget over the finest number of slots tried), are not: a budget a little larger fits."""

    def __init__(self, message: str, minimum: float, unit: float | None = None) -> None:
        super().__init__(message)
        self.minimum = minimum
        self.unit = unit

    def naming(self, budget: str) -> str:
        """The message with the budget called what the user typed (``--budget``, ``strategy.budget``) instead of
        ``Checkpointable``'s ``mem_limit``."""
        return str(self).removeprefix("Checkpointable: ").replace("mem_limit", budget)


class _Arrays:
    """The chain as padded tensors: stage i in 0..L (the loss is stage L), x_i for i in 0..L+1."""

    def __init__(self, chain: Chain, unit: float, rounding: Callable[[float], float]) -> None:
        n = chain.length
        self.n = n
        size = lambda v: rounding(v / unit)
        self.cw = torch.tensor([size(v) for v in chain.cw] + [0], dtype=torch.float64)
        self.fw = torch.tensor(list(chain.fw) + [0.0], dtype=torch.float64)
        self.sfw = torch.tensor(list(chain.stopped_fw) + [0.0], dtype=torch.float64)
        self.ftmp = torch.tensor([size(v) for v in chain.fwd_tmp] + [0], dtype=torch.float64)
        self.rev = torch.tensor(list(chain.reversible) + [False])
        self.inv = torch.tensor(list(chain.inverse_time) + [0.0], dtype=torch.float64)
        self.off = torch.tensor([_INF if t is None else t for t in chain.offload_time] + [_INF], dtype=torch.float64)
        opts = [chain.stage_options(i) for i in range(n + 1)]
        k = max(len(o) for o in opts)
        self.k = k

        def table(get, pad):
            return torch.tensor(
                [[get(o[c]) if c < len(o) else pad for c in range(k)] for o in opts], dtype=torch.float64
            )

        self.ofw = table(lambda o: o.fw, _INF)  # an absent option costs infinite time
        self.obw = table(lambda o: o.bw, 0.0)
        self.oxb = table(lambda o: size(o.cbw), 0.0)
        self.oft = table(lambda o: size(o.fwd_tmp), 0.0)
        self.obt = table(lambda o: size(o.bwd_tmp), 0.0)
        self.prefix = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(self.fw, 0)])
        # Attention caches (none where the chain has reversible stages or offload: not planned together yet).
        caches = list(chain.caches) + [None]
        if any(chain.reversible) or any(t is not None for t in chain.offload_time):
            caches = [None] * (n + 1)
        self.cached = any(c is not None for c in caches)
        self.ca = torch.tensor([size(c.bytes) if c is not None else 0 for c in caches], dtype=torch.float64)
        self.has_ca = torch.tensor([c is not None for c in caches])
        # with the cache kept: plain forward time, x̄ of the plain option, stopped recomputation
        self.cfw = torch.tensor(
            [c.fw if c is not None else f for c, f in zip(caches, self.fw.tolist())], dtype=torch.float64
        )
        self.csfw = torch.tensor(
            [chain.cached_stopped_fw(i) if caches[i] is not None else self.sfw[i].item() for i in range(n)] + [0.0],
            dtype=torch.float64,
        )
        self.cofw = self.ofw.clone()
        self.cofw[:, 0] = torch.where(self.has_ca, self.cfw, self.ofw[:, 0])
        self.coxb = self.oxb.clone()
        cxb = [size(c.cbw) if c is not None else 0.0 for c in caches]
        self.coxb[:, 0] = torch.where(self.has_ca, torch.tensor(cxb, dtype=torch.float64), self.oxb[:, 0])
        self.coft = self.oft.clone()
        cft = [size(chain.cached_fwd_tmp(i, grad=True)) if caches[i] is not None else 0.0 for i in range(n)] + [0.0]
        self.coft[:, 0] = torch.where(self.has_ca, torch.tensor(cft, dtype=torch.float64), self.oft[:, 0])
        cftmp = [size(chain.cached_fwd_tmp(i, grad=False)) if caches[i] is not None else 0.0 for i in range(n)]
        # fmax[i, j]: memory of CF_i Fn_{i+1} .. Fn_{j-1} above x_i (j in i+1..n).
        cw = self.cw.tolist()
        ftmp = self.ftmp.tolist() + [0.0]
        # fmax_cached: the same where CF_i reads stage i's kept cache (its own temporaries).
        fmax = [[_INF] * (n + 2) for _ in range(n + 1)]
        fmax_cached = [[_INF] * (n + 2) for _ in range(n + 1)]
        for i in range(n + 1):
            running = cw[i + 1] + ftmp[i]  # CF_i: x_i is outside the budget
            cached_running = cw[i + 1] + (cftmp[i] if i < n and caches[i] is not None else ftmp[i])
            for j in range(i + 1, n + 2):
                if j - 1 > i:
                    later = cw[j - 1] + cw[j] + ftmp[j - 1]  # Fn_{j-1}: x_{j-1}, x_j, temporaries
                    running, cached_running = max(running, later), max(cached_running, later)
                fmax[i][j], fmax_cached[i][j] = running, cached_running
        self.fmax = torch.tensor(fmax, dtype=torch.float64)
        self.fmax_cached = torch.tensor(fmax_cached, dtype=torch.float64)
        self.fmax_list, self.fmax_cached_list = self.fmax.tolist(), self.fmax_cached.tolist()
        self.lists = {
            name: getattr(self, name).tolist()
            for name in (
                *("cw", "fw", "sfw", "prefix", "ftmp", "rev", "inv", "off", "ofw", "obw", "oxb", "oft", "obt"),
                *("ca", "has_ca", "cfw", "csfw", "cofw", "coxb", "coft"),
            )
        }

    # What an operation needs of segment [i, l]'s budget (x_i held outside it), for stage i's option c. The tables
    # compute the same for all i and m at once.
    def base_time(self, i: int, c: int, after_cf: bool, cached: bool = False) -> float:
        """``Fe_i B_i`` with option c; right after ``CF_i`` the plain ``Fe_i`` stops early; ``cached``: stage i
        keeps its attention cache."""
        if after_cf and c == 0:
            fw = self.lists["csfw" if cached else "sfw"][i]
        else:
            fw = self.lists["cofw" if cached else "ofw"][i][c]
        return fw + self.lists["obw"][i][c]

    def fe_b_need(self, i: int, l: int, c: int, cached: bool = False) -> float:
        """``Fe_i`` with the gradient of x_{l+1} held, then ``B_i`` (the base case when ``l == i``)."""
        cw, obt = self.lists["cw"], self.lists["obt"]
        oxb, oft = (self.lists["coxb"], self.lists["coft"]) if cached else (self.lists["oxb"], self.lists["oft"])
        return max(cw[l + 1] + oxb[i][c] + oft[i][c], cw[i] + cw[i + 1] + oxb[i][c] + obt[i][c])

    def fr_br_need(self, i: int, l: int, c: int) -> float:
        """``Fr_i`` with the gradient of x_{l+1} held, then ``Br_i`` (x_{i+1}, its gradient, the rebuilt x_i)."""
        cw, oxb, oft, obt = self.lists["cw"], self.lists["oxb"], self.lists["oft"], self.lists["obt"]
        return max(
            2 * cw[i + 1] + oxb[i][c] + oft[i][c],
            2 * cw[i + 1] + cw[i] + oxb[i][c] + obt[i][c],
            cw[l + 1] + cw[i + 1] + self.lists["ftmp"][i],
        )


def _shifted(values: torch.Tensor, shift: torch.Tensor, slots: int) -> torch.Tensor:
    """``values[..., m - shift]`` for every m (infinite where the index leaves 0..slots); ``shift`` broadcasts
    against ``values[..., 0]``."""
    m = torch.arange(slots + 1, dtype=shift.dtype)
    idx = m - shift.unsqueeze(-1)
    # torch.broadcast_shapes would import sympy (seconds) on first use.
    shape = tuple(
        max(p, q)
        for p, q in zip(
            (1,) * (idx.dim() - values.dim()) + tuple(values.shape),
            (1,) * (values.dim() - idx.dim()) + tuple(idx.shape),
        )
    )
    out = torch.gather(values.expand(shape), -1, idx.clamp(0, slots).long().expand(shape))
    return out.masked_fill_(((idx < 0) | (idx > slots)).expand(shape), _INF)


class _Tables:
    """Opt for inputs that can be freed (``free``) and that cannot (``kept``), indexed ``[l - i, i, m]``, and the
    base case run right after ``CF_i`` (``after_cf[i, m]``: its plain ``Fe_i`` stops early).

    Only values are stored; :func:`_rebuild` finds the choices again for the few states a schedule visits. Besides
    ``free``, two copies make every operand of the leaf candidate a strided view with no copy: ``free`` shifted by
    |x_i| along m (the later segment, x_j held) and ``free`` with the length axis reversed (the earlier segment).
    """

    def __init__(self, a: _Arrays, slots: int, dtype: torch.dtype) -> None:
        n, s = a.n, slots
        shape = (n + 1, n + 1, s + 1)
        self.extended = extended = bool(a.rev.any()) or bool(torch.isfinite(a.off).any())
        self.free = torch.full(shape, _INF, dtype=dtype)
        self.kept = torch.full(shape, _INF, dtype=dtype) if extended else self.free
        shifted = torch.full(shape, _INF, dtype=dtype)  # [len, i, m] = free[len, i, m - |x_i|]
        rfree = torch.full(shape, _INF, dtype=dtype)  # [n - len, i, m] = free[len, i, m]
        rkept = torch.full(shape, _INF, dtype=dtype) if extended else rfree
        m = torch.arange(s + 1, dtype=dtype)
        cw = a.cw.to(dtype)
        row = s + 1

        def store(d: int, best_free: torch.Tensor, best_kept: torch.Tensor) -> None:
            count = best_free.shape[0]
            self.free[d, :count] = best_free
            shifted[d, :count] = _shifted(best_free, cw[:count], s)
            rfree[n - d, :count] = best_free
            if extended:
                self.kept[d, :count] = best_kept
                rkept[n - d, :count] = best_kept

        # Segments whose stage i keeps its attention cache (see the module docstring); a copy with the length axis
        # reversed, as rfree, for the earlier segment of the leaves.
        self.has_cache = a.cached
        self.cached = torch.full(shape, _INF, dtype=dtype) if a.cached else self.free
        rcached = torch.full(shape, _INF, dtype=dtype) if a.cached else rfree
        ca = a.ca.to(dtype)

        def store_cached(d: int, best: torch.Tensor) -> None:
            count = best.shape[0]
            self.cached[d, :count] = best
            rcached[n - d, :count] = best

        # Base: Fe_i B_i (the loss for i = L).
        i = torch.arange(n + 1)
        need = torch.maximum(a.cw[i + 1, None] + a.oxb + a.oft, a.cw[i, None] + a.cw[i + 1, None] + a.oxb + a.obt)
        unfit_base = m < need.to(dtype).unsqueeze(-1)

        def fastest(times: torch.Tensor) -> torch.Tensor:  # [stage, option] -> [stage, m]: the best that fits
            vals = times.to(dtype).unsqueeze(-1).expand(-1, -1, s + 1).clone()
            return vals.masked_fill_(unfit_base, _INF).amin(dim=1)

        times = a.ofw + a.obw
        best = fastest(times)
        store(0, best, best)
        stopped = times.clone()
        stopped[:, 0] = a.sfw + a.obw[:, 0]
        self.after_cf = fastest(stopped)
        self.after_cf_cached = self.after_cf
        if a.cached:
            need = torch.maximum(
                a.cw[i + 1, None] + a.coxb + a.coft, a.cw[i, None] + a.cw[i + 1, None] + a.coxb + a.obt
            )
            unfit_cached = m < need.to(dtype).unsqueeze(-1)

            def fastest_cached(times: torch.Tensor) -> torch.Tensor:
                vals = times.to(dtype).unsqueeze(-1).expand(-1, -1, s + 1).clone()
                return vals.masked_fill_(unfit_cached, _INF).amin(dim=1)

            times = a.cofw + a.obw
            store_cached(0, fastest_cached(times))
            stopped = times.clone()
            stopped[:, 0] = a.csfw + a.obw[:, 0]
            self.after_cf_cached = fastest_cached(stopped)

        for d in range(1, n + 1):
            count = n + 1 - d
            i = torch.arange(count)
            l = i + d
            j = i[:, None] + d - torch.arange(d)[None, :]  # j runs from l down to i + 1
            # Leaf at j: CF_i Fn.. then [j, l] with m - |x_j|, then [i, j-1] with m.
            later = shifted.as_strided((count, d, row), (row, n * row, 1), d * row)
            earlier = (n - d + 1) * (n + 1) * row
            fwd = (a.prefix[j] - a.prefix[i, None]).to(dtype).unsqueeze(-1)
            unfit = m < (a.cw[l + 1, None] + a.fmax[i[:, None], j]).to(dtype).unsqueeze(-1)
            base = (later + fwd).masked_fill_(unfit, _INF)
            leaf = base + rfree.as_strided((count, d, row), (row, (n + 1) * row, 1), earlier)
            # j = i + 1: the earlier segment is stage i's base case right after CF_i.
            leaf[:, -1] = base[:, -1] + self.after_cf[:count]
            best_free = leaf.amin(dim=1)
            # Chain: Fe_i (option c), [i+1, l] with m - |x̄_{i+1}|, B_i.
            after = _shifted(self.kept[d - 1, 1 : count + 1].unsqueeze(1), a.oxb[i].to(dtype), s)
            need = torch.maximum(
                a.cw[l + 1, None] + a.oxb[i] + a.oft[i], a.cw[i, None] + a.cw[i + 1, None] + a.oxb[i] + a.obt[i]
            )
            chain_vals = after + (a.ofw[i] + a.obw[i]).to(dtype).unsqueeze(-1)
            chain_best = chain_vals.masked_fill_(m < need.to(dtype).unsqueeze(-1), _INF).amin(dim=1)
            best_free = torch.minimum(best_free, chain_best)
            if a.cached:
                has = a.has_ca[i]
                # Cached leaf at j: CA_i Fn.. then [j, l] with m - |x_j| - |cache_i|, then [i, j-1] cached with
                # m - |cache_i|.
                shift = ca[i][:, None]
                unfit_ca = m < (a.cw[l + 1, None] + a.fmax[i[:, None], j] + a.ca[i, None]).to(dtype).unsqueeze(-1)
                base_ca = (_shifted(later, shift, s) + fwd).masked_fill_(unfit_ca, _INF)
                earlier_cached = rcached.as_strided((count, d, row), (row, (n + 1) * row, 1), earlier)
                leaf_ca = base_ca + _shifted(earlier_cached, shift, s)
                leaf_ca[:, -1] = base_ca[:, -1] + _shifted(self.after_cf_cached[:count], ca[i], s)
                leaf_ca.masked_fill_(~has[:, None, None], _INF)
                best_free = torch.minimum(best_free, leaf_ca.amin(dim=1))
                # Segment [i, l] with stage i's cache kept: its CF_i and Fe_i read it.
                gain = (a.fw[i] - a.cfw[i]).to(dtype)[:, None, None]
                unfit_c = m < (a.cw[l + 1, None] + a.fmax_cached[i[:, None], j]).to(dtype).unsqueeze(-1)
                base_c = (later + fwd - gain).masked_fill_(unfit_c, _INF)
                leaf_c = base_c + earlier_cached
                leaf_c[:, -1] = base_c[:, -1] + self.after_cf_cached[:count]
                after_c = _shifted(self.free[d - 1, 1 : count + 1].unsqueeze(1), a.coxb[i].to(dtype), s)
                need_c = torch.maximum(
                    a.cw[l + 1, None] + a.coxb[i] + a.coft[i], a.cw[i, None] + a.cw[i + 1, None] + a.coxb[i] + a.obt[i]
                )
                chain_c = after_c + (a.cofw[i] + a.obw[i]).to(dtype).unsqueeze(-1)
                chain_c = chain_c.masked_fill_(m < need_c.to(dtype).unsqueeze(-1), _INF).amin(dim=1)
                store_cached(d, torch.minimum(leaf_c.amin(dim=1), chain_c))
            best_kept = best_free
            if extended:
                leaf_kept = base + rkept.as_strided((count, d, row), (row, (n + 1) * row, 1), earlier)
                leaf_kept[:, -1] = leaf[:, -1]
                best_kept = torch.minimum(leaf_kept.amin(dim=1), chain_best)
                # Reversible: Fr_i, [i+1, l] with m + |x_i| - |x_{i+1}|, Br_i (option c).
                sub = _shifted(self.free[d - 1, 1 : count + 1], (a.cw[i + 1] - a.cw[i]).to(dtype), s).unsqueeze(1)
                need = torch.maximum(
                    2 * a.cw[i + 1, None] + a.oxb[i] + a.oft[i],
                    2 * a.cw[i + 1, None] + a.cw[i, None] + a.oxb[i] + a.obt[i],
                )
                need = torch.maximum(need, (a.cw[l + 1] + a.cw[i + 1] + a.ftmp[i])[:, None])
                cost = ((a.fw[i] + a.inv[i])[:, None] + a.ofw[i] + a.obw[i]).to(dtype)
                cost = torch.where(a.rev[i, None], cost, torch.full_like(cost, _INF))
                rev_vals = (sub + cost.unsqueeze(-1)).masked_fill_(m < need.to(dtype).unsqueeze(-1), _INF)
                best_free = torch.minimum(best_free, rev_vals.amin(dim=1))
                # Offloaded leaf: as the leaf, and [j, l] also gets x_i's slots; two transfers of x_i.
                off = a.off[i]
                if bool(torch.isfinite(off).any()):
                    moved = _shifted(later, -cw[i, None], s)  # later[..., m + |x_i|]
                    moved = (moved + fwd + (2 * off).to(dtype)[:, None, None]).masked_fill_(unfit, _INF)
                    moved += rfree.as_strided((count, d, row), (row, (n + 1) * row, 1), earlier)
                    best_free = torch.minimum(best_free, moved.amin(dim=1))
            store(d, best_free, best_kept)

    def value(self, free: bool, i: int, l: int, m: int, after_cf: bool = False, cached: bool = False) -> float:
        if m < 0 or m >= self.free.shape[-1]:
            return _INF
        if after_cf:
            return float((self.after_cf_cached if cached else self.after_cf)[i, m])
        if cached:
            return float(self.cached[l - i, i, m])
        return float((self.free if free else self.kept)[l - i, i, m])


class _Segment(NamedTuple):
    """Segment [i, l] to run with m slots, its input x_i freeable or not (see :class:`_Tables`); ``after_cf``: a
    base case right after ``CF_i``; ``cached``: stage i keeps its attention cache."""

    free: bool
    i: int
    l: int
    m: int
    after_cf: bool = False
    cached: bool = False


# A choice's operations and sub-segments, built only for the choice taken (lambdas bind their loop values as
# defaults, hence the open signature).
_Steps = Callable[..., Sequence["Op | _Segment"]]


def _choices(
    t: _Tables, a: _Arrays, free: bool, i: int, l: int, m: int, after_cf: bool = False, cached: bool = False
) -> Iterator[tuple[float, _Steps]]:
    """Every way to run segment [i, l] with m slots, as (time, a function giving its operations and sub-segments),
    in rotor's order of preference for ties: leaves (nearest j first), chain, cached leaves, reversible,
    offloaded leaves."""
    cw, fw, prefix, fmax = a.lists["cw"], a.lists["fw"], a.lists["prefix"], a.fmax_list
    obw = a.lists["obw"]
    ofw, oxb = (a.lists["cofw"], a.lists["coxb"]) if cached else (a.lists["ofw"], a.lists["oxb"])
    if i == l:
        for c in range(a.k):
            if m >= a.fe_b_need(i, i, c, cached):
                yield (
                    a.base_time(i, c, after_cf, cached),
                    (lambda c=c: [Op(OpKind.L, a.n)] if i == a.n else [Op(OpKind.FE, i, c), Op(OpKind.B, i, c)]),
                )
        return

    def forward(j: int, first: OpKind = OpKind.CF) -> list[Op | _Segment]:
        steps: list[Op | _Segment] = [Op(first, i)]
        return steps + [Op(OpKind.FN, k) for k in range(i + 1, j)]

    gain = fw[i] - a.lists["cfw"][i] if cached else 0.0
    leaf_fmax = a.fmax_cached_list if cached else fmax
    for j in range(i + 1, l + 1):
        if m >= cw[l + 1] + leaf_fmax[i][j]:
            stops = j == i + 1  # the earlier segment is stage i's base case right after CF_i
            yield (
                prefix[j]
                - prefix[i]
                - gain
                + t.value(True, j, l, m - int(cw[j]))
                + t.value(free, i, j - 1, m, stops, cached),
                lambda j=j, stops=stops: (
                    forward(j) + [_Segment(True, j, l, m - int(cw[j])), _Segment(free, i, j - 1, m, stops, cached)]
                ),
            )
    for c in range(a.k):
        if m >= a.fe_b_need(i, l, c, cached):
            sub = m - int(oxb[i][c])
            yield (
                ofw[i][c] + obw[i][c] + t.value(False, i + 1, l, sub),
                lambda c=c, sub=sub: [Op(OpKind.FE, i, c), _Segment(False, i + 1, l, sub), Op(OpKind.B, i, c)],
            )
    if not cached and a.lists["has_ca"][i]:
        own = int(a.lists["ca"][i])
        for j in range(i + 1, l + 1):
            if m >= cw[l + 1] + fmax[i][j] + own:
                stops = j == i + 1
                rest = m - own
                yield (
                    prefix[j]
                    - prefix[i]
                    + t.value(True, j, l, rest - int(cw[j]))
                    + t.value(free, i, j - 1, rest, stops, True),
                    lambda j=j, stops=stops, rest=rest: (
                        forward(j, OpKind.CA)
                        + [_Segment(True, j, l, rest - int(cw[j])), _Segment(free, i, j - 1, rest, stops, True)]
                    ),
                )
    if not free or cached:
        return
    if a.lists["rev"][i]:
        sub = m + int(cw[i]) - int(cw[i + 1])
        for c in range(a.k):
            if m >= a.fr_br_need(i, l, c):
                yield (
                    fw[i] + a.lists["inv"][i] + ofw[i][c] + obw[i][c] + t.value(True, i + 1, l, sub),
                    lambda c=c: [Op(OpKind.FR, i), _Segment(True, i + 1, l, sub), Op(OpKind.BR, i, c)],
                )
    off = a.lists["off"][i]
    if math.isfinite(off):
        for j in range(i + 1, l + 1):
            if m >= cw[l + 1] + fmax[i][j]:
                sub = m + int(cw[i]) - int(cw[j])
                yield (
                    prefix[j] - prefix[i] + 2 * off + t.value(True, j, l, sub) + t.value(True, i, j - 1, m),
                    lambda j=j, sub=sub: (
                        forward(j)
                        + [
                            Op(OpKind.WM, i),
                            _Segment(True, j, l, sub),
                            Op(OpKind.RM, i),
                            _Segment(True, i, j - 1, m),
                        ]
                    ),
                )


def _rebuild(t: _Tables, a: _Arrays, top: int) -> list[Op]:
    ops: list[Op] = []
    # An explicit stack instead of recursion: deep chains would exceed Python's recursion limit.
    stack: list[Op | _Segment] = [_Segment(False, 0, a.n, top)]
    while stack:
        item = stack.pop()
        if isinstance(item, Op):
            ops.append(item)
            continue
        free, i, l, m, after_cf, cached = item
        target = t.value(free, i, l, m, after_cf, cached)
        # The table was computed in its own precision and order of additions: accept the first choice within it.
        slack = 1e-9 if t.free.dtype == torch.float64 else 1e-5
        steps = next(
            (
                steps
                for value, steps in _choices(t, a, free, i, l, m, after_cf, cached)
                if value <= target + slack * max(1.0, abs(target))
            ),
            None,
        )
        if steps is None:
            raise AssertionError(f"planner: no choice reaches the table's value for [{i}, {l}] at {m} slots")
        stack.extend(reversed(steps()))
    return ops


def min_memory(chain: Chain) -> float:
    """The smallest budget (in the chain's size unit, the input x_0 included) that any schedule fits in.

    Feasibility is monotone in the budget, so the DP over slots becomes a DP over the least budget per segment
    (max of what the operations need and what the sub-segments need, shifted by what stays held meanwhile). Its
    tables are real tensors also inside ``FakeTensorMode`` (an infeasible budget met while sizing a step).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _least(_Arrays(chain, 1.0, float))


def _least(a: _Arrays) -> float:
    """:func:`min_memory` in the units of ``a`` (bytes, or slots when ``a`` holds rounded sizes)."""
    n = a.n
    cw, fmax, rev, off = a.lists["cw"], a.fmax_list, a.lists["rev"], a.lists["off"]
    opts = [[c for c in range(a.k) if math.isfinite(a.lists["ofw"][i][c])] for i in range(n + 1)]
    oxb = a.lists["oxb"]
    free = [[_INF] * (n + 1) for _ in range(n + 1)]
    kept = [[_INF] * (n + 1) for _ in range(n + 1)]
    for i in range(n + 1):
        free[i][i] = kept[i][i] = min(a.fe_b_need(i, i, c) for c in opts[i])
    for d in range(1, n + 1):
        for i in range(0, n + 1 - d):
            l = i + d
            chain_need = min(max(a.fe_b_need(i, l, c), kept[i + 1][l] + oxb[i][c]) for c in opts[i])
            leaf_free = leaf_kept = _INF
            for j in range(i + 1, l + 1):
                head = max(cw[l + 1] + fmax[i][j], free[j][l] + cw[j])
                leaf_free = min(leaf_free, max(head, free[i][j - 1]))
                leaf_kept = min(leaf_kept, max(head, kept[i][j - 1]))
                if math.isfinite(off[i]):
                    leaf_free = min(
                        leaf_free, max(cw[l + 1] + fmax[i][j], free[j][l] + cw[j] - cw[i], free[i][j - 1], 0.0)
                    )
            best_free = min(chain_need, leaf_free)
            if rev[i]:
                need = min(a.fr_br_need(i, l, c) for c in opts[i])
                best_free = min(best_free, max(need, free[i + 1][l] + cw[i + 1] - cw[i], 0.0))
            free[i][l] = best_free
            kept[i][l] = min(chain_need, leaf_kept)
    return max(kept[0][n], 0.0) + cw[0]


def _plain_ops(chain: Chain) -> list[Op]:
    n = chain.length
    return [Op(OpKind.FE, i) for i in range(n)] + [Op(OpKind.L, n)] + [Op(OpKind.B, i) for i in reversed(range(n))]


def no_checkpoint_memory(chain: Chain) -> float:
    """The peak of the plain schedule (every stage keeps what autograd saves): the budget at which nothing needs
    recomputing."""
    return simulate(chain, _plain_ops(chain))[1]


def _plain_is_fastest(chain: Chain) -> bool:
    """Whether no schedule is faster than the plain one: every schedule runs each stage's backward once with one of
    its options (``B``, or ``Br`` which adds an inverse), after a forward with autograd of that option, so when the
    plain option is the cheapest of each stage, the plain schedule's time is a lower bound."""
    return all(chain.fw[i] + chain.bw[i] <= opt.fw + opt.bw for i in range(chain.length) for opt in chain.options[i])


#: The largest table the solver builds when it refines the resolution: (stages + 1)**2 * (slots + 1) entries.
_MAX_TABLE = 1 << 22


def solve(chain: Chain, mem_limit: float, mem_slots: int = 500, dtype: torch.dtype = torch.float64) -> Schedule:
    """The fastest persistent schedule of ``chain`` whose memory stays within ``mem_limit`` (the chain's size unit,
    input x_0 included: rotor's budget), or :class:`InfeasibleBudget` (a ValueError) stating the smallest budget
    that works.

    Sizes are rounded up to multiples of ``mem_limit / mem_slots`` (rotor's discretization), so the plan is
    optimal within that resolution and never exceeds the limit. Returns a :class:`Schedule` with ``ops``,
    ``makespan`` and ``peak_memory`` (peak computed on the exact sizes). The tables are real tensors also when
    planning inside ``FakeTensorMode`` (a step sized without running it).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _solve(chain, mem_limit, mem_slots, dtype)


def _solve(chain: Chain, mem_limit: float, mem_slots: int, dtype: torch.dtype) -> Schedule:
    if not isinstance(chain, Chain):
        raise TypeError(f"solve: chain must be a revlib_xla.planner.Chain, not {type(chain).__name__}")
    if not (isinstance(mem_slots, int) and mem_slots >= 1):
        raise ValueError(f"solve: mem_slots must be a positive integer, got {mem_slots!r}")
    if not (isinstance(mem_limit, (int, float)) and math.isfinite(mem_limit) and mem_limit > 0):
        raise ValueError(f"solve: mem_limit must be a positive number, got {mem_limit!r}")
    for i, opts in enumerate(chain.options):
        for opt in opts:
            if opt.cbw < chain.cw[i + 1]:
                raise ValueError(
                    f"solve: option {opt.name!r} of stage {i} keeps {opt.cbw} < cw[{i + 1}] = "
                    f"{chain.cw[i + 1]}: what a stage keeps alive with autograd includes its output"
                )
    plain = _plain_ops(chain)
    plain_time, plain_peak = simulate(chain, plain)
    if mem_limit >= plain_peak and _plain_is_fastest(chain):
        # Exact: rounding sizes up could make the plain schedule miss a budget it fits.
        return Schedule(tuple(plain), plain_time, plain_peak, chain)
    slots = mem_slots
    tables, a, top = _table(chain, mem_limit / slots, slots, dtype)
    if tables is None:
        minimum = min_memory(chain)
        if mem_limit < minimum:
            raise InfeasibleBudget(
                f"no schedule of this {chain.length}-stage chain fits in {mem_limit:.6g}: the smallest budget any "
                f"schedule fits in is {minimum:.6g} (x_0 included); pass a larger mem_limit",
                minimum,
            )
        # The budget holds a plan, but not once every size is rounded up to mem_limit/mem_slots: sizes in whole
        # multiples of one grid (bytes are) fit exactly on it, if the table is not too large; else refine.
        finest = max(mem_slots, _MAX_TABLE // (chain.length + 1) ** 2)
        grid = _grid(chain)
        if grid is not None and mem_limit // grid <= finest:
            slots = int(mem_limit // grid)
            tables, a, top = _table(chain, grid, slots, dtype)
        while tables is None and slots < finest:
            slots = min(2 * slots, finest)
            if _least(_Arrays(chain, mem_limit / slots, _round_up)) <= slots:
                tables, a, top = _table(chain, mem_limit / slots, slots, dtype)
        if tables is None:
            unit = mem_limit / slots
            raise InfeasibleBudget(
                f"the smallest budget of this {chain.length}-stage chain is {minimum:.6g} (x_0 included) and "
                f"mem_limit is {mem_limit:.6g}, but the planner rounds every size up to a multiple of "
                f"mem_limit/slots ({unit:.6g} at {slots} slots, the finest it tries for this chain), and rounded "
                f"up the plan no longer fits: pass a mem_limit a little larger",
                minimum,
                unit,
            )
    ops = _rebuild(tables, a, top)
    time, peak = simulate(chain, ops)
    return Schedule(tuple(ops), time, peak, chain)


def _grid(chain: Chain) -> int | None:
    """The largest size every size of the chain is a whole multiple of, if they are all whole numbers."""
    sizes = [*chain.cw, *chain.cbw, *chain.fwd_tmp, *(chain.grad_fwd_tmp or ()), *chain.bwd_tmp]
    sizes += [v for opts in chain.options for o in opts for v in (o.cbw, o.fwd_tmp, o.bwd_tmp)]
    sizes += [v for c in chain.caches if c is not None for v in (c.bytes, c.cbw)]
    if not all(float(v).is_integer() for v in sizes):
        return None
    return math.gcd(*(int(v) for v in sizes)) or None


def _round_up(value: float) -> float:
    return float(math.ceil(value - 1e-9))


def _table(chain: Chain, unit: float, slots: int, dtype: torch.dtype) -> tuple[_Tables | None, _Arrays, int]:
    """The DP tables for ``slots`` slots of ``unit`` each (sizes rounded up to whole slots), or None when no
    schedule fits at that resolution."""
    a = _Arrays(chain, unit, _round_up)
    top = slots - int(a.cw[0])
    if top < 0:
        return None, a, top
    tables = _Tables(a, slots, dtype)
    return (tables if math.isfinite(tables.value(False, 0, a.n, top)) else None), a, top


def plan(chain: Chain, mem_limit: float, mem_slots: int = 500, held: float = 0.0) -> Schedule:
    """The planning step (a chain of costs in, a schedule out): :func:`solve` for a budget ``mem_limit`` of which
    ``held`` is taken by values outside the chain for the whole backward (a model's output and its gradient).
    :class:`InfeasibleBudget` says, in budgets that include ``held``, the smallest one that works."""
    if mem_limit <= held:
        raise InfeasibleBudget(
            f"Checkpointable: mem_limit {mem_limit:.6g} does not even hold the model's output and "
            f"its gradient ({held:.6g} bytes); pass a larger mem_limit",
            held + min_memory(chain),
        )
    try:
        return solve(chain, mem_limit - held, mem_slots)
    except InfeasibleBudget as exc:
        smallest = exc.minimum + held
        if exc.unit is None:
            why = f"the smallest budget for this model and input is {smallest:.6g} bytes"
        else:
            why = (
                f"it is above the smallest budget for this model and input ({smallest:.6g} bytes), but the "
                f"planner rounds sizes up to multiples of {exc.unit:.6g} bytes and the rounded plan does not "
                f"fit"
            )
        raise InfeasibleBudget(
            f"Checkpointable: no schedule fits in mem_limit {mem_limit:.6g} bytes: {why} "
            f"(budgets include {held:.6g} bytes for the output and its gradient); pass a "
            f"larger mem_limit",
            smallest,
            exc.unit,
        ) from None
