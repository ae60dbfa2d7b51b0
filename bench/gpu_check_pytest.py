"""A pytest plugin for bench/gpu_check.py: one JSON line per test outcome, written as each test finishes.

Loaded with ``-p gpu_check_pytest`` (bench/ on ``PYTHONPATH``) and ``GPU_CHECK_PYTEST_LOG=<file>``. Under
pytest-xdist the workers' reports reach the controller, which alone writes, so the file holds every finished test
even when the run is stopped at its time limit (a JUnit file is written only at the end).
"""

from __future__ import annotations

import json
import os
import time

_LOG = os.environ.get("GPU_CHECK_PYTEST_LOG")
_WRITES = False  # set in pytest_configure: the controller (or a run without xdist), never an xdist worker


def pytest_configure(config) -> None:
    global _WRITES
    _WRITES = bool(_LOG) and not hasattr(config, "workerinput")


def _message(report) -> str:
    """The first lines of a failure (the exception) or the reason of a skip."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = str(report.longreprtext or "")
    crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
    return str(crash) if crash else text[-1500:]


def _write(record: dict) -> None:
    with open(_LOG, "a") as log:
        log.write(json.dumps(record) + "\n")


def pytest_collection_finish(session) -> None:
    """The tests selected (after -k and -m), in a run without xdist."""
    if _WRITES and not session.config.pluginmanager.hasplugin("dsession"):
        _write({"selected": len(session.items)})


def pytest_xdist_node_collection_finished(node, ids) -> None:
    """The tests selected, as the first xdist worker to finish collecting reports them (every worker collects all)."""
    global _SELECTED_WRITTEN
    if _WRITES and not _SELECTED_WRITTEN:
        _SELECTED_WRITTEN = True
        _write({"selected": len(ids)})


_SELECTED_WRITTEN = False


def pytest_runtest_logreport(report) -> None:
    if not _WRITES:
        return
    # setup: a skip or an error before the test ran; call: the test; teardown: only an error counts
    if (
        report.when == "call"
        or (report.when == "setup" and not report.passed)
        or (report.when == "teardown" and report.failed)
    ):
        record = {
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": "error" if report.failed and report.when != "call" else report.outcome,
            "seconds": round(report.duration, 3),
            "worker": getattr(report, "worker_id", None),
            "time": time.time(),
        }
        if not report.passed:
            record["message"] = _message(report)
        _write(record)
