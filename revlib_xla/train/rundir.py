"""The run directory (``train.out_dir``) of ``revlib-xla train``: one run at a time, and nothing a dead run left.

* :class:`RunLock`: ``<out_dir>/run.lock`` names the process that runs there (host, process id, the process's start
  time). It is created exclusively, so of two runs started on one ``out_dir`` the second refuses with
  :class:`RunDirError` naming the first. A lock whose process is gone (on this host: no process has that id, or one
  with another start time has it now) is stale: it is taken over, and said so. A lock written on another host
  cannot be checked from here; the error says how to remove it once that run is known to be over.
* :func:`remove_stale_temporaries`: the temporary checkpoint directories (``.tmp-step_<N>-<pid>``) and pointer files
  (``.latest-<pid>``) that a killed save leaves behind; under the lock, no other run is writing them.
* :func:`set_aside`: what an earlier run left (checkpoints, ``metrics.jsonl``, TensorBoard events), moved to
  ``<name>.replaced-<time>`` when a run starts over (``train.resume=false``) instead of being mixed with the new
  run's or deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from types import TracebackType

from .config import ConfigError

__all__ = ["RunDirError", "RunLock", "prepare_out_dir", "remove_stale_temporaries", "set_aside", "LOCK"]

LOCK = "run.lock"


class RunDirError(RuntimeError):
    """The run directory is in use by another run, or cannot be used; the message names it and what to do."""


def prepare_out_dir(out_dir: str | os.PathLike[str]) -> Path:
    """Create ``out_dir`` (``train.out_dir``) if needed; a path that is a file, or under one, or that cannot be
    created is a :class:`ConfigError` naming the key."""
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.out_dir={str(out_dir)!r} is a file, not a directory; give a directory for the run")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"train.out_dir={str(out_dir)!r}: the directory cannot be created ({exc.strerror or exc}); give a "
            f"writable directory"
        ) from None
    return out


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (Linux: clock ticks since boot, from ``/proc``), or ``None`` where it
    cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name before it may hold spaces


def _alive(pid: int, started: str | None) -> bool:
    """Whether process ``pid`` (of this host) still runs and is the one that started at ``started``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        pass
    now = _start_time(pid)
    return started is None or now is None or now == started


class RunLock:
    """``<out_dir>/run.lock`` held while a run writes there (a context manager; see the module docstring)."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.path = Path(out_dir) / LOCK
        self.taken_over: str | None = None  # the stale lock this run replaced, for a message
        self._held = False
        self._me = {"host": socket.gethostname(), "pid": os.getpid(), "started": _start_time(os.getpid())}

    def _holder(self) -> dict[str, object] | None:
        try:
            holder = json.loads(self.path.read_text())
            return holder if isinstance(holder, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def acquire(self) -> None:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:  # released meanwhile
                    continue
                self._refuse_or_clear(holder)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self._me) + "\n")
            self._held = True
            return
        raise RunDirError(f"{self.path}: could not take the run lock (another run keeps taking it)")

    def _refuse_or_clear(self, holder: dict[str, object]) -> None:
        host, pid, started = holder.get("host"), holder.get("pid"), holder.get("started")
        who = f"process {pid} on {host}"
        if host == self._me["host"] and isinstance(pid, int):
            if _alive(pid, started if isinstance(started, str) else None):  # this process too: a run in a thread
                raise RunDirError(
                    f"train.out_dir={str(self.path.parent)!r} is in use by another run ({who}, lock {self.path}); "
                    f"two runs in one directory overwrite each other's checkpoints. Give this run another "
                    f"train.out_dir, or wait for that run to end"
                )
        elif holder:
            raise RunDirError(
                f"train.out_dir={str(self.path.parent)!r} is locked by {who} ({self.path}), which cannot be checked "
                f"from {self._me['host']}; give this run another train.out_dir, or, once that run is over, delete "
                f"{self.path}"
            )
        # the holder is gone (or the lock is unreadable: a crash while writing it): stale, replace it
        stale = self.path.with_name(f"{LOCK}.stale-{os.getpid()}")
        try:
            os.replace(self.path, stale)
            stale.unlink()
        except FileNotFoundError:
            return
        self.taken_over = f"{who} (no longer running)" if holder else "an unreadable lock"

    def release(self) -> None:
        if self._held:
            self._held = False
            holder = self._holder()
            if holder and holder.get("pid") == os.getpid() and holder.get("host") == self._me["host"]:
                self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def remove_stale_temporaries(ckpt_dir: str | os.PathLike[str]) -> list[str]:
    """Delete the temporary checkpoint directories and pointer files under ``ckpt_dir`` that another process left
    (a save killed midway: :func:`revlib_xla.train.checkpoint.save_checkpoint`); call under :class:`RunLock`.
    Returns their names."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    removed = []
    mine = f"-{os.getpid()}"
    for path in sorted(root.glob(".tmp-*")) + sorted(root.glob(".latest-*")):
        if path.name.endswith(mine):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def set_aside(
    out_dir: str | os.PathLike[str], names: tuple[str, ...] = ("checkpoints", "metrics.jsonl", "tb")
) -> list[str]:
    """Move what an earlier run left under ``out_dir`` (``names``) to ``<name>.replaced-<time>`` beside it; returns
    a line per moved entry (``'old -> new'``)."""
    out = Path(out_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for name in names:
        path = out / name
        if not path.exists():
            continue
        stem, dot, ext = name.partition(".")
        target = out / f"{stem}.replaced-{stamp}{dot}{ext}"
        n = 1
        while target.exists():
            target = out / f"{stem}.replaced-{stamp}-{n}{dot}{ext}"
            n += 1
        os.rename(path, target)
        moved.append(f"{path} -> {target}")
    return moved
