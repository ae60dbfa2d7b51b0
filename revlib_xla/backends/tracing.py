"""Tracing a step without running it: the three switches that say so, in one place.

Sizing a step for a TPU traces it on a lazy device (XLA) and hands its program to the compiler; nothing may run, and
the program must be the step's own. Three things differ while that happens, and each has its own switch, because
their callers need them in different combinations and over different spans:

* :func:`checks_suspended` (this thread; nests): features that check their own work at run time add nothing to the
  traced program: the reversible backward's rebuild check arms no forward (:func:`checks_armed` is false). Entered
  by ``step_stablehlo`` and by ``fit.trace_step`` around both of its calls of the step. A step traced this way may
  still run (a value read runs the pending program).
* :func:`stand_in_inputs` (the whole process; nests): a planner measuring lazy stages gives each stage fresh device
  data of its input's shape (over untouched host memory: ``planner.measure.device_argument``) instead of computing
  the previous stage's output, so that a step is planned at full size without a device. Entered by
  ``fit.trace_step`` for a TPU (zero-copy storage) and by ``fit.plan_config``; not by ``step_stablehlo``, whose
  planners measure real values.
* :func:`execution_forbidden` (``device``'s runtime: on XLA, torch_xla's process-wide flag; on eager devices
  nothing): running the pending program raises ``RuntimeError('Unexpected execution ...')``. Entered around the
  steady-state step of ``fit.trace_step`` only (its first call may read small values: the recompute engine compares
  buffers with copies once), and by ``fit.plan_config``.

So ``fit.trace_step`` for a TPU has all three (the third for its second call only), ``fit.plan_config`` the last
two, ``step_stablehlo`` the first. The names they had before stay as aliases:
``revlib_xla.reversible.rebuild_check.suspended``/``armed``, ``revlib_xla.planner.sizing.without_execution`` and
``revlib_xla.planner.measure.executing``, ``revlib_xla.backends.execution_forbidden``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from .registry import DeviceLike, as_device, backend_for

__all__ = [
    "checks_armed",
    "checks_suspended",
    "execution_forbidden",
    "stand_in_inputs",
    "standing_in",
]

_LOCAL = threading.local()


@contextlib.contextmanager
def checks_suspended() -> Iterator[None]:
    """Within the block (this thread), no forward keeps its input for the reversible backward's rebuild check: for
    code that traces a step without running it (:func:`revlib_xla.memory.step_stablehlo`, :mod:`revlib_xla.fit`),
    whose program must be the step's own, and whose lazy values must never be computed."""
    depth = getattr(_LOCAL, "depth", 0)
    _LOCAL.depth = depth + 1
    try:
        yield
    finally:
        _LOCAL.depth = depth


def checks_armed() -> bool:
    """Whether a forward in this thread may keep its input for the check (not within :func:`checks_suspended`)."""
    return not getattr(_LOCAL, "depth", 0)


_STAND_IN: list[bool] = [False]


@contextlib.contextmanager
def stand_in_inputs() -> Iterator[None]:
    """Within the block, measuring lazy (XLA) stages runs nothing: each stage's input becomes fresh device data of
    its shape over untouched host memory (``revlib_xla.planner.measure.device_argument``) instead of the previous
    stage's output computed (its values do not matter for sizing). This is how a step is planned at full size
    without a TPU (:mod:`revlib_xla.fit`)."""
    _STAND_IN.append(True)
    try:
        yield
    finally:
        _STAND_IN.pop()


def standing_in() -> bool:
    """Whether the process is within :func:`stand_in_inputs`."""
    return _STAND_IN[-1]


def execution_forbidden(device: DeviceLike) -> contextlib.AbstractContextManager[None]:
    """A block in which running ``device``'s pending program raises instead (nothing to forbid on eager devices)."""
    return backend_for(as_device(device)).execution_forbidden()
