"""Progress lines of the long sizing commands (``revlib-xla memory``, ``revlib-xla plan``) on stderr.

Off unless a command turns it on (:func:`shown`), so library calls print nothing. Each line starts with the
seconds since it was turned on: ``[  12.3 s] plan+fewbit, batch 8: tracing the step``. :func:`waiting` covers a
long silent wait (the deviceless TPU compile: minutes for a full-size step) with a line every ``every`` seconds.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

__all__ = ["say", "shown", "waiting"]

_STATE: dict[str, object] = {}


def say(text: str) -> None:
    """Print ``text`` with the elapsed time, where progress is shown; nothing otherwise."""
    start, stream = _STATE.get("start"), _STATE.get("stream")
    if isinstance(start, float) and stream is not None:
        print(f"[{time.perf_counter() - start:6.1f} s] {text}", file=stream, flush=True)  # type: ignore[call-overload]


@contextlib.contextmanager
def shown(stream: TextIO | None = None) -> Iterator[None]:
    """Show progress lines on ``stream`` (default stderr) inside the block."""
    before = dict(_STATE)
    _STATE.update(start=time.perf_counter(), stream=stream or sys.stderr)
    try:
        yield
    finally:
        _STATE.clear()
        _STATE.update(before)


@contextlib.contextmanager
def waiting(text: str, every: float = 30.0) -> Iterator[None]:
    """Say ``text``, then ``still <text>`` every ``every`` seconds until the block ends, then how long it took."""
    if "start" not in _STATE:
        yield
        return
    say(text)
    began = time.perf_counter()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every):
            say(f"still {text} ({time.perf_counter() - began:.0f} s)")

    thread = threading.Thread(target=beat, name="revlib-xla-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    say(f"done {text} in {time.perf_counter() - began:.1f} s")
