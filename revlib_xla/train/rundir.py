"""The run directory (``train.out_dir``) of ``revlib-xla train``: one run at a time, and nothing a dead run left.

* :class:`RunLock`: ``<out_dir>/run.lock``, held with an exclusive ``flock`` (which the kernel lets go when the
  process ends, however it ends: taking over a dead run's lock is the kernel's, atomic, not a judgement), names the
  process that runs there (host, process id, start time) for the message of the second run on one ``out_dir``,
  which refuses with :class:`RunDirError` naming the first. A lock file a dead run left (no ``flock`` on it) is taken
  over, and said so; one whose process still runs but holds no ``flock`` (an earlier version's) or that was written
  on another host is refused. Where the file system has no ``flock``, the file is created exclusively and a holder
  judged by its process id (on this host: gone, or another process with that id now).
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
        self._fd: int | None = None
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
        """Take the lock: an exclusive ``flock`` on ``run.lock`` (the kernel lets it go when the process ends, however
        it ends, so a dead run's lock needs no judging), holding this process's name for the messages of the runs it
        refuses. Where the file system has no ``flock``, the file's exclusive creation instead, and a holder judged
        by its process id."""
        try:
            import fcntl
        except ImportError:  # not POSIX
            return self._acquire_by_creation()
        for _ in range(5):
            fd = self._open(os.O_CREAT | os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                self._refuse(self._holder() or {})
            except OSError:  # no flock on this file system
                os.close(fd)
                return self._acquire_by_creation()
            try:  # the file locked is the one at the path (not one a releasing run unlinked meanwhile)
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            holder = self._holder()
            if holder:  # written by a run that held no flock (an earlier version), or on another host
                try:
                    self._refuse_or_clear(holder, clear=False)
                except RunDirError:
                    os.close(fd)
                    raise
                self.taken_over = f"process {holder.get('pid')} on {holder.get('host')} (no longer running)"
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(self._me) + "\n").encode(), 0)
            self._fd, self._held = fd, True
            return None
        raise RunDirError(f"{self.path}: could not take the run lock (another run keeps taking it)")

    def _open(self, flags: int) -> int:
        try:
            return os.open(self.path, flags, 0o644)
        except FileExistsError:
            raise
        except OSError as exc:
            raise RunDirError(
                f"train.out_dir={str(self.path.parent)!r}: its run lock {self.path} cannot be written "
                f"({exc.strerror or exc}); give a writable train.out_dir"
            ) from None

    def _acquire_by_creation(self) -> None:
        for _ in range(3):
            try:
                fd = self._open(os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                holder = self._holder()
                if holder is None:  # released meanwhile
                    continue
                self._refuse_or_clear(holder)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(self._me) + "\n")
            self._fd, self._held = None, True
            return
        raise RunDirError(f"{self.path}: could not take the run lock (another run keeps taking it)")

    def _refuse(self, holder: dict[str, object]) -> None:
        who = f"process {holder.get('pid')} on {holder.get('host')}" if holder else "another process"
        raise RunDirError(
            f"train.out_dir={str(self.path.parent)!r} is in use by another run ({who}, lock {self.path}); "
            f"two runs in one directory overwrite each other's checkpoints. Give this run another "
            f"train.out_dir, or wait for that run to end"
        )

    def _refuse_or_clear(self, holder: dict[str, object], clear: bool = True) -> None:
        host, pid, started = holder.get("host"), holder.get("pid"), holder.get("started")
        who = f"process {pid} on {host}"
        if host == self._me["host"] and isinstance(pid, int):
            if _alive(pid, started if isinstance(started, str) else None):  # this process too: a run in a thread
                self._refuse(holder)
        elif holder:
            raise RunDirError(
                f"train.out_dir={str(self.path.parent)!r} is locked by {who} ({self.path}), which cannot be checked "
                f"from {self._me['host']}; give this run another train.out_dir, or, once that run is over, delete "
                f"{self.path}"
            )
        if not clear:
            return
        # the holder is gone (or the lock is unreadable: a crash while writing it): stale, replace it
        stale = self.path.with_name(f"{LOCK}.stale-{os.getpid()}")
        try:
            os.replace(self.path, stale)
            stale.unlink()
        except FileNotFoundError:
            return
        self.taken_over = f"{who} (no longer running)" if holder else "an unreadable lock"

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        fd, self._fd = self._fd, None
        if fd is not None:  # unlink while still holding the flock, then let it go
            try:
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    self.path.unlink()
            except FileNotFoundError:
                pass
            os.close(fd)
            return
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
