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
from typing import Dict, List, Tuple

__all__ = ["LivePeak", "LivenessParseError", "live_peak"]

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*)$", re.M)
_VALUE = re.compile(r"^ value: <\d+ (\S+) @(\d+)> \(size=(\d+),offset=(\d+)\)", re.M)
_RANGE = re.compile(r"^\s+(\S+):(\d+)-(\d+)$", re.M)
_MAX_TIME = re.compile(r"^HloLiveRange \(max (\d+)\)", re.M)


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


def live_peak(buffer_assignment: str, memory_space: int = 0, top: int = 8) -> LivePeak:
    """The most bytes that values other than the program's arguments and outputs hold at one time, in
    ``memory_space`` (see the module docstring); ``top``: how many of the values live at the peak to name.

    Arguments are the values of parameter allocations (live for the whole program); outputs are the values live at
    the end of the schedule. Values of one allocation that overlap in memory while live at the same time alias one
    buffer (a bitcast, a tuple element, an in-place update) and are counted once.
    """
    match = _MAX_TIME.search(buffer_assignment)
    if match is None:
        raise LivenessParseError("the buffer-assignment dump has no HloLiveRange section")
    end_of_schedule = int(match.group(1))
    ranges: Dict[str, Tuple[int, int]] = {
        m.group(1): (int(m.group(2)), int(m.group(3))) for m in _RANGE.finditer(buffer_assignment, match.end())}
    # (time, +1/-1, buffer key, bytes, value name) events; a buffer is (allocation, offset, size).
    events: List[Tuple[int, int, Tuple[int, int, int], str]] = []
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
            key = (index, offset, size)
            events.append((start, 0, key, name))
            events.append((stop + 1, -1, key, name))
    # Frees before allocations at the same time (-1 < 0): a buffer freed at t+1 and reused at t+1 is not doubled.
    events.sort(key=lambda e: (e[0], e[1]))
    holders: Dict[Tuple[int, int, int], List[str]] = {}
    level = best = best_time = 0
    best_holders: Dict[Tuple[int, int, int], List[str]] = {}
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
        if level > best:
            best, best_time = level, time
            best_holders = {key: list(names) for key, names in holders.items()}
    largest = sorted(((names[0], key[2]) for key, names in best_holders.items()), key=lambda item: -item[1])
    return LivePeak(bytes=best, time=best_time, schedule_length=end_of_schedule, largest=tuple(largest[:top]))
