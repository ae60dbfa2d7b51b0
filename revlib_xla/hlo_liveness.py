"""What a compiled XLA program keeps alive: the peak of its live values, from the compiler's buffer assignment.

XLA's ``CompiledMemoryStats`` give a program's *allocations*: every argument and every output gets its own buffer
for the whole program, and the temporaries share one heap. Two things make ``peak - arguments - outputs`` a poor
measure of what the program keeps at once:

* buffer assignment may park a temporary in an output's buffer while that output does not exist yet (a training
  step's parameter gradients are written last, so early activations of the same size live in them for free);
* on TPU, memory-space assignment moves buffers into VMEM and the reported peak then counts the VMEM allocation
  (see :data:`revlib_xla.tpu_compile.HBM_ONLY_FLAGS`).

:func:`live_peak` reads the buffer-assignment dump the compiler writes with
``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text`` (``*after_optimizations-buffer-assignment.txt``): each
value's allocation, offset, size and memory space, and, in its ``HloLiveRange`` section, the interval of the
program's schedule over which each value is live. It returns the most bytes held at one point of the schedule by
values that are neither arguments nor outputs of the program, in one memory space (0: HBM on TPU), each buffer
counted once however many values alias it. Pure text processing: no jax, no torch.

The dump format is XLA's debugging output, not a stable API; it was checked against jax 0.7.1 + libtpu 0.0.20, and
:class:`LivenessParseError` is raised when a dump does not have the expected sections.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

__all__ = ["LivePeak", "LivenessParseError", "live_peak", "ForwardBackwardSplit", "forward_backward_split",
           "optimization_barrier_arguments"]

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*)$", re.M)
_VALUE = re.compile(r"^ value: <\d+ (\S+) @(\d+)> \(size=(\d+),offset=(\d+)\)", re.M)
_RANGE = re.compile(r"^\s+(\S+):(\d+)-(\d+)$", re.M)
_MAX_TIME = re.compile(r"^HloLiveRange \(max (\d+)\)", re.M)
_SEQUENCE = re.compile(r"^\s+(\d+):(\S+)$", re.M)
_BARRIER = re.compile(r"stablehlo\.optimization_barrier\s+([^:]*?)\s*:")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.*)$", re.M)
_PARAMETER = re.compile(r"\bparameter\((\d+)\)")
_OPERAND = re.compile(r"%([\w.\-]+)")


class _Value(NamedTuple):
    name: str
    key: Tuple[int, int, int]  # the buffer: (allocation, offset, size)
    start: int
    stop: int


class LivenessParseError(ValueError):
    """A buffer-assignment dump without the sections :func:`live_peak` reads."""


@dataclasses.dataclass(frozen=True)
class LivePeak:
    """The peak of a program's live values (bytes), when it happens (``time``, a position in the schedule of
    ``schedule_length + 1`` positions) and the largest values live then (``(name, bytes)``, largest first)."""

    bytes: int
    time: int
    schedule_length: int
    largest: Tuple[Tuple[str, int], ...]


def _allocations(text: str) -> List[Tuple[str, str]]:
    """(header, body) of each allocation of the dump."""
    end = text.find("\nTotal bytes used")
    if end < 0:
        raise LivenessParseError("not an XLA buffer-assignment dump: no 'Total bytes used' line")
    head = text[:end]
    starts = list(_ALLOCATION.finditer(head))
    if not starts:
        raise LivenessParseError("the buffer-assignment dump lists no allocation")
    return [(m.group(0), head[m.end():starts[k + 1].start() if k + 1 < len(starts) else len(head)])
            for k, m in enumerate(starts)]


def _values(buffer_assignment: str, memory_space: int) -> Tuple[int, Dict[str, int], List[_Value]]:
    """The schedule's last position, the instruction sequence (name -> position) and every value other than the
    program's arguments and outputs in ``memory_space``, with its buffer and live interval."""
    match = _MAX_TIME.search(buffer_assignment)
    if match is None:
        raise LivenessParseError("the buffer-assignment dump has no HloLiveRange section")
    end_of_schedule = int(match.group(1))
    section = buffer_assignment[match.end():]
    ranges_at = section.find("BufferLiveRange:")
    sequence = {m.group(2): int(m.group(1)) for m in _SEQUENCE.finditer(section[:max(ranges_at, 0)])}
    ranges: Dict[str, Tuple[int, int]] = {
        m.group(1): (int(m.group(2)), int(m.group(3))) for m in _RANGE.finditer(buffer_assignment, match.end())}
    values: List[_Value] = []
    for header, body in _allocations(buffer_assignment):
        if any(word in header for word in ("parameter", "thread-local", "constant")):
            continue
        index = int(_ALLOCATION.match(header).group(1))
        for value in _VALUE.finditer(body):
            name, space, size, offset = value.group(1), int(value.group(2)), int(value.group(3)), int(value.group(4))
            if space != memory_space or size == 0:
                continue
            interval = ranges.get(name if "{" in name else name + "{}", ranges.get(name))
            if interval is None:
                raise LivenessParseError(f"value {name} has no live range in the dump")
            start, stop = interval
            if stop >= end_of_schedule:  # live at the end: an output of the program
                continue
            values.append(_Value(name, (index, offset, size), start, stop))
    return end_of_schedule, sequence, values


def _sweep(values: Sequence[_Value]) -> List[Tuple[int, int, Dict[Tuple[int, int, int], List[str]]]]:
    """(time, bytes live from then on, holders) at every time the live set changes; each buffer counted once."""
    events: List[Tuple[int, int, Tuple[int, int, int], str]] = []
    for v in values:
        events.append((v.start, 0, v.key, v.name))
        events.append((v.stop + 1, -1, v.key, v.name))
    # Frees before allocations at the same time (-1 < 0): a buffer freed at t+1 and reused at t+1 is not doubled.
    events.sort(key=lambda e: (e[0], e[1]))
    holders: Dict[Tuple[int, int, int], List[str]] = {}
    level = 0
    steps = []
    k = 0
    while k < len(events):
        time = events[k][0]
        while k < len(events) and events[k][0] == time:
            _, kind, key, name = events[k]
            if kind < 0:
                names = holders[key]
                names.remove(name)
                if not names:
                    del holders[key]
                    level -= key[2]
            else:
                if key not in holders:
                    holders[key] = []
                    level += key[2]
                holders[key].append(name)
            k += 1
        steps.append((time, level, holders))
        holders = {key: list(names) for key, names in holders.items()}
    return steps


def live_peak(buffer_assignment: str, memory_space: int = 0, top: int = 8) -> LivePeak:
    """The most bytes that values other than the program's arguments and outputs hold at one time, in
    ``memory_space`` (see the module docstring); ``top``: how many of the values live at the peak to name.

    Arguments are the values of parameter allocations (live for the whole program); outputs are the values live at
    the end of the schedule. Values of one allocation that overlap in memory while live at the same time alias one
    buffer (a bitcast, a tuple element, an in-place update) and are counted once.
    """
    end_of_schedule, _, values = _values(buffer_assignment, memory_space)
    best = best_time = 0
    best_holders: Dict[Tuple[int, int, int], List[str]] = {}
    for time, level, holders in _sweep(values):
        if level > best:
            best, best_time, best_holders = level, time, holders
    largest = sorted(((names[0], key[2]) for key, names in best_holders.items()), key=lambda item: -item[1])
    return LivePeak(bytes=best, time=best_time, schedule_length=end_of_schedule, largest=tuple(largest[:top]))


@dataclasses.dataclass(frozen=True)
class ForwardBackwardSplit:
    """What a program that runs a forward and then a backward keeps, split at the backward's first instruction
    (``time``, a position in the schedule): ``before``, the peak of the live values before it (the forward);
    ``across``, the bytes of values computed before it and still live at it (what the forward keeps for the
    backward); ``after``, the peak of the live values from it on (the backward). Arguments and outputs of the
    program are not counted (see :func:`live_peak`)."""

    time: int
    before: int
    across: int
    after: int


def optimization_barrier_arguments(stablehlo: str) -> List[Optional[int]]:
    """For each operand of the first ``stablehlo.optimization_barrier`` of a StableHLO module, the number of the
    ``main`` function argument it is (``%argN``), or ``None`` for a computed value."""
    match = _BARRIER.search(stablehlo)
    if match is None:
        raise LivenessParseError("the StableHLO module has no stablehlo.optimization_barrier")
    operands = [o.strip() for o in match.group(1).split(",")]
    return [int(o[4:]) if re.fullmatch(r"%arg\d+", o) else None for o in operands]


def _entry_dependents(optimized_hlo: str, parameters: Sequence[int]) -> List[str]:
    """The instructions of the entry computation that depend on any of the entry ``parameters`` (by number),
    the parameters themselves excluded."""
    start = optimized_hlo.find("\nENTRY ")
    if start < 0:
        raise LivenessParseError("the optimized HLO has no ENTRY computation")
    end = optimized_hlo.find("\n}", start)
    body = optimized_hlo[start:end if end >= 0 else len(optimized_hlo)]
    instructions: List[Tuple[str, str]] = [(m.group(1), m.group(2)) for m in _INSTRUCTION.finditer(body)]
    wanted = set(parameters)
    reached = {name for name, rhs in instructions
               if (p := _PARAMETER.search(rhs)) is not None and int(p.group(1)) in wanted}
    if len(reached) != len(wanted):
        raise LivenessParseError(f"the optimized HLO's entry computation lacks some of the parameters {sorted(wanted)}")
    params = set(reached)
    changed = True
    while changed:  # the text is in schedule order, so one pass normally suffices
        changed = False
        for name, rhs in instructions:
            if name not in reached and any(op in reached for op in _OPERAND.findall(rhs)):
                reached.add(name)
                changed = True
    return [name for name, _ in instructions if name in reached and name not in params]


def forward_backward_split(buffer_assignment: str, optimized_hlo: str, backward_arguments: Sequence[int],
                           memory_space: int = 0) -> ForwardBackwardSplit:
    """Split a compiled forward-then-backward program at its backward's first instruction: the earliest scheduled
    instruction of the entry computation that depends on one of ``backward_arguments`` (entry parameter numbers,
    e.g. the incoming gradient, held behind an optimization barrier with the forward's output so that no backward
    work can start before the forward is done). ``buffer_assignment`` and ``optimized_hlo``: the compiler's dump of
    that program and its HLO after optimizations. See :class:`ForwardBackwardSplit`."""
    _, sequence, values = _values(buffer_assignment, memory_space)
    times = [sequence[name] for name in _entry_dependents(optimized_hlo, backward_arguments) if name in sequence]
    if not times:
        raise LivenessParseError("no scheduled instruction depends on the backward's arguments")
    split = min(times)
    before = after = 0
    for time, level, _ in _sweep(values):
        if time < split:
            before = max(before, level)
            after = level  # in force until the next change, so also at `split` unless one happens there
        else:
            after = max(after, level)
    across: Dict[Tuple[int, int, int], int] = {}
    for v in values:
        if v.start < split <= v.stop:
            across[v.key] = v.key[2]
    return ForwardBackwardSplit(time=split, before=before, across=sum(across.values()), after=after)
