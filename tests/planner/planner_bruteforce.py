"""Exhaustive search over persistent schedules, independent of the planner's dynamic program.

``schedules(L, options, extended)`` lists every persistent schedule of an L-stage chain (a checkpoint, once
stored, stays until its backward): each segment [i, l] is run as Fe_i ... B_i around the rest (chain), or by
storing x_j and running [j, l] then [i, j-1] (leaf), or (extended) as Fr_i ... Br_i (reversible) or as a leaf with
x_i written to host memory meanwhile, and (caches) with each leaf's first forward ``CF_i`` or ``CA_i`` (stage
i's attention cache kept until ``B_i``). Unlike the planner, the enumeration does not know which inputs may be
dropped or offloaded: ``evaluate`` runs every schedule on every chain of a batch with its own memory simulation
and discards what cannot run there.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

OpT = tuple[str, int, int]


def schedules(length: int, options: int = 1, extended: bool = False, caches: bool = False) -> list[tuple[OpT, ...]]:
    return list(segment_schedules(0, length, length, options, extended, caches))


@functools.cache
def segment_schedules(
    i: int, l: int, n: int, options: int = 1, extended: bool = False, caches: bool = False
) -> tuple[tuple[OpT, ...], ...]:
    """Every persistent schedule of segment [i, l] of an n-stage chain (l = n: up to the loss)."""
    out: list[tuple[OpT, ...]] = []
    if i == l:
        if i == n:
            return ((("L", n, 0),),)
        return tuple((("Fe", i, c), ("B", i, c)) for c in range(options))
    for c in range(options):
        for rest in segment_schedules(i + 1, l, n, options, extended, caches):
            out.append((("Fe", i, c),) + rest + (("B", i, c),))
    for j in range(i + 1, l + 1):
        for first in ("CF", "CA") if caches else ("CF",):
            fwd = ((first, i, 0),) + tuple(("Fn", k, 0) for k in range(i + 1, j))
            for later in segment_schedules(j, l, n, options, extended, caches):
                for earlier in segment_schedules(i, j - 1, n, options, extended, caches):
                    out.append(fwd + later + earlier)
                    if extended:
                        out.append(fwd + (("WM", i, 0),) + later + (("RM", i, 0),) + earlier)
    if extended:
        for c in range(options):
            for rest in segment_schedules(i + 1, l, n, options, extended, caches):
                out.append((("Fr", i, 0),) + rest + (("Br", i, c),))
    return tuple(out)


def evaluate(ops: Sequence[OpT], chains: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Time and peak memory of one schedule on a batch of chains (arrays with a leading batch axis); infinite
    time where the schedule cannot run on that chain.

    ``chains`` holds ``cw`` [B, L+2] (x_{L+1} padded with 0), ``fw`` [B, L], ``ftmp`` [B, L], per-option
    ``ofw``, ``obw``, ``ocbw``, ``oftmp``, ``obtmp`` [B, L+1, K] (ofw infinite where a stage lacks the option;
    the loss is stage L), ``rev`` [B, L] bool, ``inv`` [B, L], ``off`` [B, L] (infinite: not allowed), and
    optionally ``sfw`` [B, L]: the time of a plain ``Fe_i`` directly followed by ``B_i`` whose stage's run before
    was a ``CF_i`` (or ``CA_i``), its input never offloaded or dropped since (a recomputation that stops early);
    and optionally attention caches: ``ca`` [B, L] (bytes; 0: the stage has none), and while stage i's is kept,
    ``cfw`` (plain forward time), ``csfw`` (stopped recomputation), ``ccbw`` (what the plain ``Fe_i`` keeps),
    ``cftmp`` and ``cgftmp`` (transient memory of a forward without and with autograd).
    """
    cw = chains["cw"]
    batch = cw.shape[0]
    n = chains["fw"].shape[1]
    level = cw[:, 0].copy()
    peak = level.copy()
    time = np.zeros(batch)
    ok = np.ones(batch, dtype=bool)
    live: dict[tuple[str, int], np.ndarray] = {("x", 0): cw[:, 0]}
    owned = {("x", 0)}
    host = set()
    held = set()  # x_{i+1} after Fr_i, needed by Br_i
    previous: dict[int, str] = {}  # stage -> the kind of its latest run
    moved = set()  # stages whose input was written to the host or dropped by a Br since their latest run
    live[("d", n + 1)] = np.zeros(batch)

    def put(key, size):
        nonlocal level
        assert key not in live, (key, ops)
        live[key] = size
        level = level + size

    def take(key):
        nonlocal level
        level = level - live.pop(key)

    for k, (kind, i, c) in enumerate(ops):
        stops = (
            kind == "Fe"
            and c == 0
            and tuple(ops[k + 1 : k + 2]) == (("B", i, 0),)
            and previous.get(i) in ("CF", "CA")
            and i not in moved
            and "sfw" in chains
        )
        cached = c == 0 and ("c", i) in live and kind in ("Fn", "CF", "Fe")
        if kind == "CA":
            if ("c", i) in live:
                return np.full(batch, np.inf), peak
            ok &= chains["ca"][:, i] > 0
            put(("c", i), chains["ca"][:, i])
        if kind in ("Fn", "CF", "CA", "Fr", "Fe", "Br", "B"):
            previous[i] = kind
            moved.discard(i)
        if kind == "WM":
            moved.add(i)
        if kind == "Br":
            moved.add(i + 1)
        if kind in ("Fn", "CF", "CA", "Fr"):
            assert ("x", i) in live or ("xb", i) in live
            peak = np.maximum(peak, level + cw[:, i + 1] + chains["cftmp" if cached else "ftmp"][:, i])
            put(("x", i + 1), cw[:, i + 1])
            if kind == "Fr":
                if ("x", i) not in live or ("x", i) in owned:
                    return np.full(batch, np.inf), peak  # input not a tensor of its own: cannot be dropped
                ok &= chains["rev"][:, i]
                take(("x", i))
                held.add(i + 1)
            elif kind == "Fn" and ("x", i) in live and ("x", i) not in owned:
                take(("x", i))
            time = time + chains["cfw" if cached else "fw"][:, i]
        elif kind == "Fe":
            size = chains["ccbw"][:, i] if cached else chains["ocbw"][:, i, c]
            peak = np.maximum(peak, level + size + (chains["cgftmp"][:, i] if cached else chains["oftmp"][:, i, c]))
            put(("xb", i + 1), size)
            if stops:
                time = time + chains["csfw" if cached else "sfw"][:, i]
            else:
                time = time + (chains["cfw"][:, i] if cached else chains["ofw"][:, i, c])
        elif kind in ("B", "L"):
            peak = np.maximum(peak, level + cw[:, i] + chains["obtmp"][:, i, c])
            if kind == "B":
                take(("xb", i + 1))
                if ("c", i) in live:
                    take(("c", i))
            take(("d", i + 1))
            if ("x", i) in live and ("x", i) not in owned and i not in held:
                take(("x", i))
            put(("d", i), cw[:, i])
            time = time + chains["obw"][:, i, c] + (chains["ofw"][:, i, c] if kind == "L" else 0)
        elif kind == "Br":
            assert ("x", i) not in live and ("xb", i) not in live
            if ("c", i) in live:
                return np.full(batch, np.inf), peak
            size = chains["ocbw"][:, i, c]
            peak = np.maximum(peak, level + cw[:, i] + size + chains["oftmp"][:, i, c])
            peak = np.maximum(peak, level + 2 * cw[:, i] + size + chains["obtmp"][:, i, c])
            take(("x", i + 1))
            held.discard(i + 1)
            take(("d", i + 1))
            put(("d", i), cw[:, i])
            if i in held:
                put(("x", i), cw[:, i])
            time = time + chains["inv"][:, i] + chains["ofw"][:, i, c] + chains["obw"][:, i, c]
        elif kind == "WM":
            if ("x", i) not in live or ("x", i) in owned:
                return np.full(batch, np.inf), peak
            take(("x", i))
            host.add(i)
            time = time + chains["off"][:, i]
        elif kind == "RM":
            host.remove(i)
            put(("x", i), cw[:, i])
            peak = np.maximum(peak, level)
            time = time + chains["off"][:, i]
    assert ("d", 0) in live
    return np.where(ok, time, np.inf), peak


def best(
    all_schedules: Sequence[tuple[OpT, ...]], chains: dict[str, np.ndarray], budget: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per chain: the least time of a schedule within ``budget`` (inf if none) and the least peak of any
    schedule that can run."""
    batch = budget.shape[0]
    fastest = np.full(batch, np.inf)
    lowest = np.full(batch, np.inf)
    for ops in all_schedules:
        time, peak = evaluate(ops, chains)
        runs = np.isfinite(time)
        lowest = np.where(runs, np.minimum(lowest, peak), lowest)
        fastest = np.where(runs & (peak <= budget), np.minimum(fastest, time), fastest)
    return fastest, lowest


@functools.cache
def _count(i: int, l: int) -> int:
    """How many persistent schedules (rotor's: chain and leaf steps) segment [i, l] has."""
    if i == l:
        return 1
    return _count(i + 1, l) + sum(_count(j, l) * _count(i, j - 1) for j in range(i + 1, l + 1))


def sample(i: int, l: int, n: int, rng) -> tuple[OpT, ...]:
    """A persistent schedule of segment [i, l] of an n-stage chain (l = n: up to the loss), drawn uniformly among
    all of them (rotor's chain and leaf steps, one option per stage)."""
    if i == l:
        return (("L", n, 0),) if i == n else (("Fe", i, 0), ("B", i, 0))
    pick = rng.randrange(_count(i, l))
    if pick < _count(i + 1, l):
        return (("Fe", i, 0),) + sample(i + 1, l, n, rng) + (("B", i, 0),)
    pick -= _count(i + 1, l)
    for j in range(i + 1, l + 1):
        pick -= _count(j, l) * _count(i, j - 1)
        if pick < 0:
            fwd = (("CF", i, 0),) + tuple(("Fn", k, 0) for k in range(i + 1, j))
            return fwd + sample(j, l, n, rng) + sample(i, j - 1, n, rng)
    raise AssertionError("unreachable")


def segments(ops: Sequence[OpT], n: int) -> list[tuple[int, int, int, int]]:
    """The segments of a persistent schedule of an n-stage chain: (i, l, start, end), ops[start:end] running
    segment [i, l], the whole schedule first."""
    out: list[tuple[int, int, int, int]] = []
    pos = 0

    def seg(i: int, l: int) -> None:
        nonlocal pos
        start, k = pos, len(out)
        out.append((i, l, start, -1))
        kind = ops[pos][0]
        pos += 1
        if kind == "Fe":
            if i < l:
                seg(i + 1, l)
            assert ops[pos][:2] == ("B", i), (ops, pos)
            pos += 1
        elif kind == "CF":
            j = i + 1
            while ops[pos][0] == "Fn":
                j, pos = j + 1, pos + 1
            seg(j, l)
            seg(i, j - 1)
        else:
            assert kind == "L" and i == l == n, (ops, pos)
        out[k] = (i, l, start, pos)

    seg(0, n)
    assert pos == len(ops)
    return out


def neighbours(ops: Sequence[OpT], n: int, count: int, rng, every_below: int = 5) -> list[tuple[OpT, ...]]:
    """Schedules that differ from ``ops`` in one segment run another way: every other way for segments of fewer
    than ``every_below`` stages after the first, and ``count`` drawn uniformly over all segments. Near an optimal
    schedule, where a better one would be if the optimum were a local mistake."""
    parts = segments(ops, n)
    out = [
        tuple(ops[:start]) + other + tuple(ops[end:])
        for i, l, start, end in parts
        if l - i < every_below
        for other in segment_schedules(i, l, n)
    ]
    for _ in range(count):
        i, l, start, end = parts[rng.randrange(len(parts))]
        out.append(tuple(ops[:start]) + sample(i, l, n, rng) + tuple(ops[end:]))
    return out
