"""The disk cache of compiled memory results (:func:`revlib_xla.compiled.memory.tpu_memory`, ``xla_cpu_memory``).

One JSON file per result, named by a hash of what was compiled and how (the caller's key), in

* the directory given as ``disk_cache``, else ``$REVLIB_XLA_CACHE``, else ``$XDG_CACHE_HOME/revlib_xla``
  (``~/.cache/revlib_xla``);
* bounded in size: after each write the least recently used files are deleted until the directory holds at most
  ``$REVLIB_XLA_CACHE_MAX_BYTES`` bytes (default 1 GiB; suffixes such as ``512MiB`` or ``2GB`` are accepted); a
  read counts as a use;
* validated on read: a file that is not JSON, was written for another key, or lacks what the caller needs (a
  truncated or hand-edited entry) is deleted and reported as a miss, so the result is compiled again and rewritten.

Writes go through a temporary file and an atomic rename, so readers never see half a file; a full or read-only
directory makes the cache silently do nothing (a warning on the ``revlib_xla.memory`` logger).
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_MAX_BYTES", "directory_for", "max_bytes", "load", "store"]

logger = logging.getLogger("revlib_xla.memory")

DEFAULT_MAX_BYTES = 1 << 30
_SUFFIXES = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_STALE_TEMPORARY_SECONDS = 3600.0  # a writer that died mid-write leaves its temporary file behind


def directory_for(disk_cache: bool | str | os.PathLike[str] | None) -> Path | None:
    """Where the cache lives: ``None`` (no disk cache) for ``False``, or for ``None`` without
    ``$REVLIB_XLA_CACHE``; the default directory for ``True``; else the given directory."""
    if disk_cache is False:
        return None
    env = os.environ.get("REVLIB_XLA_CACHE")
    if disk_cache is None:
        if not env:
            return None
        disk_cache = True
    if disk_cache is True:
        if env:
            return Path(env)
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "revlib_xla"
    assert disk_cache is not None and disk_cache is not False  # both handled above
    return Path(disk_cache)


def max_bytes() -> int:
    """The size bound from ``$REVLIB_XLA_CACHE_MAX_BYTES`` (bytes, or a number with a unit), else 1 GiB."""
    raw = os.environ.get("REVLIB_XLA_CACHE_MAX_BYTES", "").strip()
    if not raw:
        return DEFAULT_MAX_BYTES
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]*)", raw)
    if not match or match.group(2).lower() not in _SUFFIXES:
        raise ValueError(
            f"REVLIB_XLA_CACHE_MAX_BYTES={raw!r} is not a size: give bytes (1073741824) or a number "
            f"with a unit ({', '.join(s for s in _SUFFIXES if s)}), e.g. 512MiB"
        )
    return int(float(match.group(1)) * _SUFFIXES[match.group(2).lower()])


def _path(directory: Path, key: str) -> Path:
    return directory / f"{key}.json"


def load(directory: Path | None, key: str, valid: Callable[[Mapping[str, Any]], bool]) -> dict[str, Any] | None:
    """The entry stored for ``key``, or ``None`` (no directory, no entry, or an invalid one, which is deleted)."""
    if directory is None:
        return None
    path = _path(directory, key)
    try:
        with open(path, encoding="utf-8") as f:
            entry = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:  # unreadable, truncated, not JSON, not UTF-8
        return _discard(path, f"{type(exc).__name__}: {exc}")
    if not isinstance(entry, dict) or entry.get("key") != key:
        return _discard(path, "written for another key")
    try:
        ok = valid(entry)
    except (KeyError, TypeError, ValueError) as exc:
        ok, why = False, f"{type(exc).__name__}: {exc}"
    else:
        why = "fields missing or of the wrong type"
    if not ok:
        return _discard(path, why)
    try:
        os.utime(path)  # a use: the least recently used entries are evicted first
    except OSError:
        pass
    return entry


def _discard(path: Path, why: str) -> dict[str, Any] | None:
    """Delete an invalid entry (logged); returns ``None``, what :func:`load` answers for it."""
    logger.warning("revlib_xla: ignoring the invalid compile cache entry %s (%s); compiling again", path, why)
    try:
        path.unlink()
    except OSError:
        pass
    return None


def store(directory: Path | None, key: str, entry: Mapping[str, Any]) -> None:
    """Write ``entry`` for ``key`` (atomically), then evict least recently used entries beyond :func:`max_bytes`."""
    if directory is None:
        return
    limit = max_bytes()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({**entry, "key": key}, f)
        size = os.path.getsize(tmp)
        if size > limit:
            os.unlink(tmp)
            logger.warning(
                "revlib_xla: a compile result of %d bytes exceeds REVLIB_XLA_CACHE_MAX_BYTES=%d; not cached on disk",
                size,
                limit,
            )
            return
        os.replace(tmp, _path(directory, key))
        _evict(directory, limit, keep=_path(directory, key))
    except OSError as exc:  # a read-only or full cache directory must not fail the measurement
        logger.warning("revlib_xla: could not write the compile cache in %s: %s", directory, exc)


def _evict(directory: Path, limit: int, keep: Path) -> None:
    """Delete the least recently used entries (and stale temporary files) until at most ``limit`` bytes remain."""
    now = time.time()
    entries = []
    for path in directory.iterdir():
        try:
            stat = path.stat()
        except OSError:  # deleted meanwhile by another process
            continue
        if path.suffix == ".tmp" and now - stat.st_mtime > _STALE_TEMPORARY_SECONDS:
            entries.append((float("-inf"), stat.st_size, path))  # garbage: first to go
        elif path.suffix == ".json":
            entries.append((stat.st_mtime, stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries, key=lambda item: item[0]):
        if total <= limit:
            break
        if path == keep:
            continue
        try:
            path.unlink()
            total -= size
        except OSError:
            pass
