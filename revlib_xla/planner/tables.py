"""The tables of the solver's dynamic program (:mod:`revlib_xla.planner.solver`): the chain as padded tensors
(``_Arrays``) and ``Opt`` for inputs that can and cannot be freed, and for segments that keep an attention cache,
filled for every segment length at once (``_Tables``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .chain import Chain

_INF = math.inf


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
