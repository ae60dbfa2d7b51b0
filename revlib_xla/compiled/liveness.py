"""What a compiled XLA program keeps alive: the peak of its live values, from the compiler's buffer assignment.

XLA's ``CompiledMemoryStats`` give a program's *allocations*: every argument and every output gets its own buffer
for the whole program, and the temporaries share one heap. Two things make ``peak - arguments - outputs`` a poor
measure of what the program keeps at once:

* buffer assignment may park a temporary in an output's buffer while that output does not exist yet (a training
  step's parameter gradients are written last, so early activations of the same size live in them for free);
* on TPU, memory-space assignment moves buffers into VMEM and the reported peak then counts the VMEM allocation
  (see :data:`revlib_xla.compiled.worker.HBM_ONLY_FLAGS`).

:func:`live_peak` reads the buffer-assignment dump the compiler writes with
``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text`` (``*after_optimizations-buffer-assignment.txt``): each
value's allocation, offset, size and memory space, and, in its ``HloLiveRange`` section, the interval of the
program's schedule over which each value is live. It returns the most bytes held at one point of the schedule by
values that are neither arguments nor outputs of the program, in one memory space (0: HBM on TPU), each buffer
counted once however many values alias it. :func:`forward_backward_split` splits the schedule of a program that runs
a forward and then a backward (behind an optimization barrier) at the backward's first instruction and reports what
is live across that point and the peaks on either side: what a compiled stage keeps for its backward, from the
compiler itself. Pure text processing: no jax, no torch.

The dump format is XLA's debugging output, not a stable API; it was checked against jax 0.7.1 + libtpu 0.0.20, and
:class:`LivenessParseError` is raised when a dump does not have the expected sections.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "LivePeak",
    "LivenessParseError",
    "live_peak",
    "ForwardBackwardSplit",
    "forward_backward_split",
    "optimization_barrier_arguments",
    "all_optimization_barrier_arguments",
]

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
    key: tuple[int, int, int]  # the buffer: (allocation, offset, size)
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
    largest: tuple[tuple[str, int], ...]


def _allocations(text: str) -> list[tuple[str, str]]:
    """(header, body) of each allocation of the dump."""
    end = text.find("\nTotal bytes used")
    if end < 0:
        raise LivenessParseError("not an XLA buffer-assignment dump: no 'Total bytes used' line")
    head = text[:end]
    starts = list(_ALLOCATION.finditer(head))
    if not starts:
        raise LivenessParseError("the buffer-assignment dump lists no allocation")
    return [
        (m.group(0), head[m.end() : starts[k + 1].start() if k + 1 < len(starts) else len(head)])
        for k, m in enumerate(starts)
    ]


def _values(
    buffer_assignment: str, memory_space: int, outputs: list[_Value] | None = None
) -> tuple[int, dict[str, int], list[_Value]]:
    """The schedule's last position, the instruction sequence (name -> position) and every value other than the
    program's arguments and outputs in ``memory_space``, with its buffer and live interval; the values of outputs
    are appended to ``outputs`` when given."""
    match = _MAX_TIME.search(buffer_assignment)
    if match is None:
        raise LivenessParseError("the buffer-assignment dump has no HloLiveRange section")
    end_of_schedule = int(match.group(1))
    section = buffer_assignment[match.end() :]
    ranges_at = section.find("BufferLiveRange:")
    sequence = {m.group(2): int(m.group(1)) for m in _SEQUENCE.finditer(section[: max(ranges_at, 0)])}
    ranges: dict[str, tuple[int, int]] = {
        m.group(1): (int(m.group(2)), int(m.group(3))) for m in _RANGE.finditer(buffer_assignment, match.end())
    }
    values: list[_Value] = []
    for header, body in _allocations(buffer_assignment):
        if any(word in header for word in ("parameter", "thread-local", "constant")):
            continue
        allocation = _ALLOCATION.match(header)
        assert allocation is not None  # headers are the pattern's matches (_allocations)
        index = int(allocation.group(1))
        for value in _VALUE.finditer(body):
            name, space, size, offset = value.group(1), int(value.group(2)), int(value.group(3)), int(value.group(4))
            if space != memory_space or size == 0:
                continue
            interval = ranges.get(name if "{" in name else name + "{}", ranges.get(name))
            if interval is None:
                raise LivenessParseError(f"value {name} has no live range in the dump")
            start, stop = interval
            if stop >= end_of_schedule:  # live at the end: an output of the program
                if outputs is not None:
                    outputs.append(_Value(name, (index, offset, size), start, stop))
                continue
            values.append(_Value(name, (index, offset, size), start, stop))
    return end_of_schedule, sequence, values


def _sweep(values: Sequence[_Value]) -> list[tuple[int, int, dict[tuple[int, int, int], list[str]]]]:
    """(time, bytes live from then on, holders) at every time the live set changes; each buffer counted once."""
    events: list[tuple[int, int, tuple[int, int, int], str]] = []
    for v in values:
        events.append((v.start, 0, v.key, v.name))
        events.append((v.stop + 1, -1, v.key, v.name))
    # Frees before allocations at the same time (-1 < 0): a buffer freed at t+1 and reused at t+1 is not doubled.
    events.sort(key=lambda e: (e[0], e[1]))
    holders: dict[tuple[int, int, int], list[str]] = {}
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
    best_holders: dict[tuple[int, int, int], list[str]] = {}
    for time, level, holders in _sweep(values):
        if level > best:
            best, best_time, best_holders = level, time, holders
    largest = sorted(((names[0], key[2]) for key, names in best_holders.items()), key=lambda item: -item[1])
    return LivePeak(bytes=best, time=best_time, schedule_length=end_of_schedule, largest=tuple(largest[:top]))


@dataclasses.dataclass(frozen=True)
class ForwardBackwardSplit:
    """What a program that runs a forward and then a backward keeps, split at the backward's first instruction
    (``time``, a position in the schedule). Arguments and outputs of the program are not counted (see
    :func:`live_peak`), except where said.

    ``before``: the peak of the live values before ``time`` (the forward). ``across``: the bytes of values computed
    before ``time`` and still live at it (what the forward keeps for the backward). ``after``: the peak of the live
    values from ``time`` on (the backward). ``after_with_outputs``: the same, counting the outputs asked for
    (``counted_outputs``) from the instruction that computes them on. ``outputs_read``: for each output asked about
    (``read_outputs``), whether an instruction from ``time`` on reads it (other than to return it)."""

    time: int
    before: int
    across: int
    after: int
    after_with_outputs: int
    outputs_read: tuple[bool, ...]


def optimization_barrier_arguments(stablehlo: str) -> list[int | None]:
    """For each operand of the first ``stablehlo.optimization_barrier`` of a StableHLO module, the number of the
    ``main`` function argument it is (``%argN``), or ``None`` for a computed value."""
    return all_optimization_barrier_arguments(stablehlo)[0]


def all_optimization_barrier_arguments(stablehlo: str) -> list[list[int | None]]:
    """:func:`optimization_barrier_arguments` of every ``stablehlo.optimization_barrier`` of a StableHLO module, in
    text order (a program may hold barriers of its own, e.g. FewBit's, besides the one a caller looks for)."""
    found = [
        [int(o[4:]) if re.fullmatch(r"%arg\d+", o) else None for o in (o.strip() for o in m.group(1).split(","))]
        for m in _BARRIER.finditer(stablehlo)
    ]
    if not found:
        raise LivenessParseError("the StableHLO module has no stablehlo.optimization_barrier")
    return found


def _entry(optimized_hlo: str) -> list[tuple[str, str]]:
    """(name, right-hand side) of each instruction of the entry computation, in text (schedule) order; the last
    one is the root."""
    start = optimized_hlo.find("\nENTRY ")
    if start < 0:
        raise LivenessParseError("the optimized HLO has no ENTRY computation")
    end = optimized_hlo.find("\n}", start)
    body = optimized_hlo[start : end if end >= 0 else len(optimized_hlo)]
    instructions = [(m.group(1), m.group(2)) for m in _INSTRUCTION.finditer(body)]
    if not instructions:
        raise LivenessParseError("the optimized HLO's entry computation has no instruction")
    root = re.search(r"^\s*ROOT\s+%(\S+)", body, re.M)
    if root is not None and root.group(1) != instructions[-1][0]:  # put the root last
        instructions = [i for i in instructions if i[0] != root.group(1)] + [
            i for i in instructions if i[0] == root.group(1)
        ]
    return instructions


def _dependents(instructions: Sequence[tuple[str, str]], parameters: Sequence[int]) -> list[str]:
    """The instructions that depend on any of the entry ``parameters`` (by number), the parameters excluded."""
    wanted = set(parameters)
    reached = {
        name for name, rhs in instructions if (p := _PARAMETER.search(rhs)) is not None and int(p.group(1)) in wanted
    }
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


def _root_outputs(instructions: Sequence[tuple[str, str]]) -> list[str]:
    """The instructions whose results the program returns, in order (the root's tuple operands, or the root)."""
    name, rhs = instructions[-1]
    match = re.search(r"\btuple\(([^()]*)\)", rhs)
    return _OPERAND.findall(match.group(1)) if match else [name]


def _value_of(name: str, rhs_of: dict[str, str]) -> tuple[str, str]:
    """(the instruction whose buffer holds ``name``'s result, the dump's value name of it): through
    get-tuple-element and bitcast."""
    index: list[str] = []
    while True:
        rhs = rhs_of.get(name, "")
        gte = re.search(r"\bget-tuple-element\(%([\w.\-]+)\), index=(\d+)", rhs)
        cast = re.search(r"\bbitcast\(%([\w.\-]+)\)", rhs)
        if gte:
            index.insert(0, gte.group(2))
            name = gte.group(1)
        elif cast and not index:
            name = cast.group(1)
        else:
            return name, name + "{" + ",".join(index) + "}"


def forward_backward_split(
    buffer_assignment: str,
    optimized_hlo: str,
    backward_arguments: Sequence[int],
    memory_space: int = 0,
    counted_outputs: Sequence[int] = (),
    read_outputs: Sequence[int] = (),
) -> ForwardBackwardSplit:
    """Split a compiled forward-then-backward program at its backward's first instruction: the earliest scheduled
    instruction of the entry computation that depends on one of ``backward_arguments`` (entry parameter numbers,
    e.g. the incoming gradient, held behind an optimization barrier with the forward's output so that no backward
    work can start before the forward is done). ``buffer_assignment`` and ``optimized_hlo``: the compiler's dump of
    that program and its HLO after optimizations. ``counted_outputs`` and ``read_outputs``: positions in the tuple
    the program returns. See :class:`ForwardBackwardSplit`."""
    outputs: list[_Value] = []
    _, sequence, values = _values(buffer_assignment, memory_space, outputs)
    instructions = _entry(optimized_hlo)
    times = [sequence[name] for name in _dependents(instructions, backward_arguments) if name in sequence]
    if not times:
        raise LivenessParseError("no scheduled instruction depends on the backward's arguments")
    split = min(times)
    rhs_of = dict(instructions)
    returned = _root_outputs(instructions)
    for k in list(counted_outputs) + list(read_outputs):
        if not 0 <= k < len(returned):
            raise LivenessParseError(f"the program returns {len(returned)} values, not {k + 1}")

    def peaks(extra: Sequence[_Value]) -> tuple[int, int]:
        before = after = 0
        for time, level, _ in _sweep(list(values) + list(extra)):
            if time < split:
                before = max(before, level)
                after = level  # in force until the next change, so also at `split` unless one happens there
            else:
                after = max(after, level)
        return before, after

    before, after = peaks(())
    wanted = {_value_of(returned[k], rhs_of)[1] for k in counted_outputs}
    counted = [v for v in outputs if (v.name if "{" in v.name else v.name + "{}") in wanted]
    if len(counted) < len(wanted):
        raise LivenessParseError(f"no buffer found for some of the outputs {sorted(wanted)}")
    _, after_with_outputs = peaks(counted)
    across: dict[tuple[int, int, int], int] = {}
    for v in values:
        if v.start < split <= v.stop:
            across[v.key] = v.key[2]
    root = instructions[-1][0]
    read = []
    for k in read_outputs:
        holder = _value_of(returned[k], rhs_of)[0]
        aliases = {holder} | {name for name, rhs in instructions if _value_of(name, rhs_of)[0] == holder}
        read.append(
            any(
                sequence.get(name, -1) >= split
                and name != root
                and name not in aliases
                and any(op in aliases for op in _OPERAND.findall(rhs))
                for name, rhs in instructions
            )
        )
    return ForwardBackwardSplit(
        time=split,
        before=before,
        across=sum(across.values()),
        after=after,
        after_with_outputs=after_with_outputs,
        outputs_read=tuple(read),
    )
