"""How much memory a compiled XLA program needs, from the compiler itself: :func:`tpu_memory` compiles StableHLO
for a TPU generation (v5e by default; v5p, v6e) *without a TPU*, with libtpu's deviceless compiler in a child process
(:mod:`revlib_xla.compiled.worker`); :func:`xla_cpu_memory` compiles it for XLA:CPU in-process. Both return a
:class:`CompiledMemory`. TPU figures are what the TPU compiler plans for one chip - they come from the TPU compiler,
not from a TPU run.

Compiled results are cached by a hash of the StableHLO text (plus compiler versions and flags): in memory always,
and on disk when asked (``disk_cache=True`` or the ``REVLIB_XLA_CACHE`` environment variable;
:mod:`revlib_xla.compiled.cache`). Nothing here prints; progress and timings go to the ``revlib_xla.memory`` logger
at DEBUG level. The public names are re-exported by :mod:`revlib_xla.memory`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..units import format_bytes
from . import cache as compile_cache
from .liveness import live_peak
from .worker import TPU_GENERATIONS  # stdlib-only at import time: no jax loaded

__all__ = [
    "CompiledMemory",
    "xla_cpu_memory",
    "tpu_memory",
    "tpu_memory_many",
    "tpu_memory_results",
    "compile_timeout",
    "clear_compile_cache",
    "TPU_GENERATIONS",
    "MATMUL_PATTERN",
    "MissingDependencyError",
    "TpuCompileError",
]

logger = logging.getLogger("revlib_xla.memory")  # the logger these functions have always used

#: Regular expression matching matrix-multiply instructions in optimized HLO text (TPU turns dots into
#: convolutions). Counting them shows whether a recomputation survived the compiler.
MATMUL_PATTERN = r"(dot|convolution)\("


_TPU_EXTRA_HINT = "pip install 'revlib_xla[tpu-compile]'"
_JAX_EXTRA_HINT = "pip install 'revlib_xla[jax]'  (or 'revlib_xla[tpu-compile]')"


class MissingDependencyError(ImportError):
    """An optional dependency of a measurement (jax, jaxlib, libtpu, torch_xla) is not installed."""


class TpuCompileError(RuntimeError):
    """The deviceless TPU compile failed; the message carries the compiler's error or the worker's stderr tail."""


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """Memory that XLA plans for a compiled program (``CompiledMemoryStats``), with the HLO it planned it for.

    For a TPU, these figures come from the TPU compiler (libtpu, compiling deviceless for one chip of
    ``topology``), not from a TPU run; no TPU was needed or used.

    ``peak_bytes`` is the compiler's peak, which on TPU *includes* buffers placed in host memory by offloading;
    ``hbm_peak_bytes`` = ``peak_bytes - host_bytes`` is what the chip's HBM must hold, and ``host_bytes`` the sum of
    host argument, output and temporary buffers. On XLA:CPU there is no host/device split (``host_bytes`` is 0).
    ``argument_bytes``, ``output_bytes``, ``temp_bytes`` and ``alias_bytes`` are the device-side sizes. On TPU the
    peak is the number to use: ``temp_bytes`` is often 0 on v5e/v6e, and on v5p (megacore) it can even exceed the
    peak.

    ``hbm_only``: compiled with the TPU compiler's memory-space assignment into VMEM turned off (see
    :func:`tpu_memory`); then ``peak_bytes`` = arguments + outputs + the peak of the temporaries, every buffer in
    HBM, and :attr:`live_temporary_bytes` is the most the program keeps alive at once besides its arguments and
    outputs. Without it, a TPU peak counts VMEM too: see :data:`revlib_xla.compiled.worker.HBM_ONLY_FLAGS`.

    ``live_peak_bytes`` (only when compiled with ``liveness=True``, else ``None``): the most bytes that values other
    than the program's arguments and outputs hold at one point of its schedule, from the compiler's buffer
    assignment (:func:`revlib_xla.compiled.liveness.live_peak`); ``live_peak_values`` names the largest of them. This is
    what the program keeps, where :attr:`live_temporary_bytes` is what its allocations reserve: the compiler may
    park a temporary in an output's buffer before that output is written (a step's parameter gradients come
    last), so the two differ.

    ``buffer_assignment`` (only with ``liveness=True``): the text of the compiler's buffer-assignment dump, for other
    liveness questions (:mod:`revlib_xla.compiled.liveness`).

    ``optimized_hlo`` is the HLO after the compiler's passes: count recomputation there with :meth:`count_ops`.
    ``pre_optimization_hlo`` (HLO before any pass) and ``stablehlo`` (the input) are where to assert that
    optimization barriers (``opt-barrier`` / ``stablehlo.optimization_barrier``) and host-offload annotations
    (``annotate_device_placement``) were emitted.
    """

    platform: str
    topology: str | None
    device_kind: str
    peak_bytes: int
    hbm_peak_bytes: int
    host_bytes: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    host_argument_bytes: int
    host_output_bytes: int
    host_temp_bytes: int
    versions: tuple[tuple[str, str], ...]
    hbm_only: bool
    live_peak_bytes: int | None
    live_peak_values: tuple[tuple[str, int], ...]
    optimized_hlo: str = dataclasses.field(repr=False, compare=False)
    pre_optimization_hlo: str = dataclasses.field(repr=False, compare=False)
    stablehlo: str = dataclasses.field(repr=False, compare=False)
    buffer_assignment: str | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def live_temporary_bytes(self) -> int:
        """The peak minus the host buffers, the arguments and the outputs: the most the program keeps alive at once
        besides its inputs and results (the compiler gives every argument and output its own buffer for the whole
        program). On TPU, meaningful only for an ``hbm_only`` compile."""
        return max(0, self.hbm_peak_bytes - self.argument_bytes - self.output_bytes)

    def count_ops(self, pattern: str = MATMUL_PATTERN, text: str = "optimized") -> int:
        """Matches of the regular expression ``pattern`` in one of the texts: ``'optimized'`` (default),
        ``'pre_optimization'`` or ``'stablehlo'``. The default pattern counts matrix multiplies."""
        texts = {
            "optimized": self.optimized_hlo,
            "pre_optimization": self.pre_optimization_hlo,
            "stablehlo": self.stablehlo,
        }
        if text not in texts:
            raise ValueError(f"text must be one of {sorted(texts)}, not {text!r}")
        return len(re.findall(pattern, texts[text]))

    def __str__(self) -> str:
        # A TPU compile is for a topology; an XLA:CPU compile has none.
        where = (
            f"TPU {self.topology} ({self.device_kind}), from the TPU compiler"
            if self.topology is not None
            else "XLA:CPU"
        )
        return (
            f"{where}: peak {format_bytes(self.peak_bytes)}, HBM peak {format_bytes(self.hbm_peak_bytes)}, "
            f"host {format_bytes(self.host_bytes)} (arguments {format_bytes(self.argument_bytes)}, outputs "
            f"{format_bytes(self.output_bytes)}, temporaries {format_bytes(self.temp_bytes)})"
        )


_COMPILE_CACHE: dict[str, CompiledMemory] = {}


def clear_compile_cache() -> None:
    """Empty the in-memory cache of compiled results (the disk cache is left alone)."""
    _COMPILE_CACHE.clear()


def _compile_helpers():
    from . import worker

    return worker


def _require(modules: Sequence[str], hint: str, what: str) -> None:
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if "libtpu" in missing and os.environ.get("TPU_LIBRARY_PATH") and os.path.exists(os.environ["TPU_LIBRARY_PATH"]):
        missing.remove("libtpu")
    if missing:
        raise MissingDependencyError(f"{what} needs {', '.join(missing)}, which is not installed: {hint}")


def _cache_key(
    platform: str,
    topology: str | None,
    device_index: int,
    text: str,
    hbm_only: bool = False,
    liveness: bool = False,
    partitions: int = 1,
) -> str:
    tc = _compile_helpers()
    header = json.dumps(
        {
            **({"partitions": partitions} if partitions > 1 else {}),
            "format": 3,
            "platform": platform,
            "topology": topology,
            "device_index": device_index,
            "hbm_only": hbm_only,
            "liveness": liveness,
            "versions": tc.versions(),
            # Flags that can change compiled numbers.
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "LIBTPU_INIT_ARGS": os.environ.get("LIBTPU_INIT_ARGS", ""),
        },
        sort_keys=True,
    )
    return hashlib.sha256(header.encode() + b"\0" + text.encode()).hexdigest()


def _from_result(
    result: Mapping[str, Any],
    platform: str,
    topology: str | None,
    text: str,
    versions: Mapping[str, str | None],
    hbm_only: bool = False,
) -> CompiledMemory:
    host = (
        result["host_argument_size_in_bytes"] + result["host_output_size_in_bytes"] + result["host_temp_size_in_bytes"]
    )
    return CompiledMemory(
        platform=platform,
        topology=topology,
        device_kind=result.get("device_kind", ""),
        peak_bytes=result["peak_memory_in_bytes"],
        hbm_peak_bytes=result["peak_memory_in_bytes"] - host,
        host_bytes=host,
        argument_bytes=result["argument_size_in_bytes"],
        output_bytes=result["output_size_in_bytes"],
        temp_bytes=result["temp_size_in_bytes"],
        alias_bytes=result["alias_size_in_bytes"],
        generated_code_bytes=result["generated_code_size_in_bytes"],
        host_argument_bytes=result["host_argument_size_in_bytes"],
        host_output_bytes=result["host_output_size_in_bytes"],
        host_temp_bytes=result["host_temp_size_in_bytes"],
        versions=tuple(sorted((k, str(v)) for k, v in versions.items())),
        hbm_only=hbm_only,
        live_peak_bytes=result.get("live_peak_bytes"),
        live_peak_values=tuple((str(n), int(b)) for n, b in result.get("live_peak_values", ())),
        optimized_hlo=result["optimized_hlo"],
        pre_optimization_hlo=result["pre_optimization_hlo"],
        stablehlo=text,
        buffer_assignment=result.get("buffer_assignment"),
    )


def _valid_entry(liveness: bool) -> Callable[[Mapping[str, Any]], bool]:
    """What a cached compile result must hold to be used (see :mod:`revlib_xla.compiled.cache`)."""
    from .worker import STAT_FIELDS

    def valid(entry: Mapping[str, Any]) -> bool:
        numbers = all(isinstance(entry[name], int) for name in STAT_FIELDS)
        texts = all(isinstance(entry[name], str) for name in ("optimized_hlo", "pre_optimization_hlo"))
        live = not liveness or (
            isinstance(entry["live_peak_bytes"], int)
            and all(isinstance(n, str) and isinstance(b, int) for n, b in entry["live_peak_values"])
        )
        return numbers and texts and live and isinstance(entry.get("versions", {}), dict)

    return valid


def _cached_result(
    key: str, cache: bool, directory: Path | None, liveness: bool = False
) -> tuple[CompiledMemory | None, dict[str, Any] | None]:
    if not cache:
        return None, None
    if key in _COMPILE_CACHE:
        return _COMPILE_CACHE[key], None
    return None, compile_cache.load(directory, key, _valid_entry(liveness))


def xla_cpu_memory(
    stablehlo_text: str, *, cache: bool = True, disk_cache: bool | str | os.PathLike[str] | None = None
) -> CompiledMemory:
    """Compile StableHLO for XLA:CPU in this process (jaxlib's CPU client) and return its memory plan.

    This matches what torch_xla's own XLA:CPU compile assigns. Good for checking that a step compiles and for
    XLA:CPU numbers; not for judging remat/reversible/offload policies (XLA:CPU drops optimization barriers before
    its CSE runs) - use :func:`tpu_memory` for those. ``cache``/``disk_cache``: see :func:`tpu_memory_many`.
    """
    _check_stablehlo(stablehlo_text, "xla_cpu_memory")
    _require(("jax", "jaxlib"), _JAX_EXTRA_HINT, "xla_cpu_memory")
    tc = _compile_helpers()
    key = _cache_key("cpu", None, 0, stablehlo_text)
    directory = compile_cache.directory_for(disk_cache)
    hit, stored = _cached_result(key, cache, directory)
    if hit is not None:
        return hit
    if stored is None:
        stored = tc.compile_for_cpu(stablehlo_text)
        stored["versions"] = tc.versions()
        logger.debug("xla_cpu_memory: compiled in %.2f s", stored["compile_seconds"])
        compile_cache.store(directory if cache else None, key, stored)
    memory = _from_result(stored, "xla:cpu", None, stablehlo_text, stored.get("versions", {}))
    if cache:
        _COMPILE_CACHE[key] = memory
    return memory


def _check_stablehlo(text: Any, what: str) -> None:
    if not isinstance(text, str):
        raise TypeError(
            f"{what} needs StableHLO text (a str, as memory.step_stablehlo() and memory.stablehlo_of() "
            f"return), got {type(text).__name__}"
        )


def _resolve_topology(generation: str, topology: str | None) -> str:
    if topology:
        return topology
    if generation in TPU_GENERATIONS:
        return TPU_GENERATIONS[generation]
    if ":" in generation:
        return generation
    raise ValueError(
        f"unknown TPU generation {generation!r}; choose one of {sorted(TPU_GENERATIONS)} or pass a "
        f"topology string such as 'v5e:2x2'"
    )


def tpu_memory(
    stablehlo_text: str,
    generation: str = "v5e",
    *,
    topology: str | None = None,
    device_index: int = 0,
    cache: bool = True,
    disk_cache: bool | str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    hbm_only: bool = False,
    liveness: bool = False,
) -> CompiledMemory:
    """Memory the TPU compiler plans for this StableHLO on one chip of a TPU ``generation``, without a TPU.

    The figures come from the TPU compiler (libtpu, compiling deviceless against a topology description), not from
    a TPU run; they are deterministic. ``generation`` is ``'v5e'`` (default), ``'v6e'`` or ``'v5p'`` (see
    :data:`TPU_GENERATIONS`), or a raw topology string; ``topology`` overrides it. The compile runs in a child
    process (``python revlib_xla/compiled/worker.py``) so that libtpu never loads into the caller's process; starting
    it costs about two seconds, so use :func:`tpu_memory_many` for several graphs.

    ``hbm_only=True`` compiles with memory-space assignment into VMEM turned off
    (:data:`revlib_xla.compiled.worker.HBM_ONLY_FLAGS`): every buffer lives in HBM, and the peak is the program's
    whole live set. Use it to compare a program's memory with a model of what it keeps (the planner's): by default
    the compiler moves whole buffers into the chip's ~112 MiB of VMEM, and the reported peak then counts the VMEM
    allocation instead of the HBM temporaries whenever it is the larger - for a small step, most of the "peak".
    A real TPU compiles with VMEM assignment on; its HBM use is at most the ``hbm_only`` peak.

    ``liveness=True`` also reads the compiler's buffer assignment (an XLA dump into a temporary directory) and fills
    :attr:`CompiledMemory.live_peak_bytes`: the peak of what the program keeps besides its arguments and outputs,
    and keeps the dump's text in :attr:`CompiledMemory.buffer_assignment`.

    Caveat: this uses the libtpu that jax finds (0.0.20 with jax 0.7.1), with jax's compile options, while torch_xla
    on a TPU compiles with its own libtpu and options; treat the numbers as a faithful approximation.

    Raises :class:`MissingDependencyError` without jax/jaxlib/libtpu, :class:`TpuCompileError` when the compile
    or the worker fails (with the compiler's message or the worker's stderr tail).
    """
    _check_stablehlo(stablehlo_text, "tpu_memory")
    return tpu_memory_many(
        [stablehlo_text],
        generation,
        topology=topology,
        device_index=device_index,
        cache=cache,
        disk_cache=disk_cache,
        timeout=timeout,
        hbm_only=hbm_only,
        liveness=liveness,
    )[0]


_TIMEOUT_ENV = "REVLIB_XLA_COMPILE_TIMEOUT"


def compile_timeout() -> float:
    """Seconds a deviceless compile's child process may run when the caller gives no ``timeout``:
    ``$REVLIB_XLA_COMPILE_TIMEOUT``, else 600. Callers deep in the library (the planner measuring stages for
    ``strategy.budget=auto``) take this default, so the variable is how a full-size run on a small machine gets
    more time."""
    raw = os.environ.get(_TIMEOUT_ENV, "").strip()
    if not raw:
        return 600.0
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{_TIMEOUT_ENV}={raw!r} is not a positive number of seconds; unset it for the default 600")
    return seconds


def tpu_memory_many(
    stablehlo_texts: Sequence[str],
    generation: str = "v5e",
    *,
    topology: str | None = None,
    device_index: int = 0,
    cache: bool = True,
    disk_cache: bool | str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    hbm_only: bool = False,
    liveness: bool = False,
) -> list[CompiledMemory]:
    """:func:`tpu_memory` for several modules, compiled in one child process (results in the same order).

    ``cache``: reuse results for StableHLO already compiled with the same compiler versions, topology and flags
    (in memory; and on disk when ``disk_cache`` is true, a directory, or ``None`` with ``$REVLIB_XLA_CACHE`` set -
    ``True`` means ``$REVLIB_XLA_CACHE`` or ``~/.cache/revlib_xla``). ``timeout`` bounds the child process, in
    seconds (default: :func:`compile_timeout`). ``hbm_only``, ``liveness``: see :func:`tpu_memory`.

    """
    results = tpu_memory_results(
        stablehlo_texts,
        generation,
        topology=topology,
        device_index=device_index,
        cache=cache,
        disk_cache=disk_cache,
        timeout=timeout,
        hbm_only=hbm_only,
        liveness=liveness,
        raise_errors=True,
    )
    return [r for r in results if isinstance(r, CompiledMemory)]


def tpu_memory_results(
    stablehlo_texts: Sequence[str],
    generation: str = "v5e",
    *,
    topology: str | None = None,
    device_index: int = 0,
    cache: bool = True,
    disk_cache: bool | str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    hbm_only: bool = False,
    liveness: bool = False,
    raise_errors: bool = False,
    partitions: int = 1,
) -> list[CompiledMemory | TpuCompileError]:
    """:func:`tpu_memory_many` where a module the compiler rejects (e.g. "Ran out of memory in memory space hbm")
    gets its :class:`TpuCompileError` in its place (``raise_errors=False``, the default) instead of raising, so the
    other modules' results are kept; a failure of the worker itself still raises. Errors are not cached.
    ``partitions > 1``: modules sharded for that many chips (``mhlo.sharding`` annotations, as
    :func:`revlib_xla.sharding.shard_step` writes them), split over the first chips of ``topology`` by the SPMD
    partitioner; the figures are then per chip."""
    if isinstance(stablehlo_texts, str):
        raise TypeError("tpu_memory_many takes a list of StableHLO texts; for one text use tpu_memory(text)")
    texts = list(stablehlo_texts)
    for i, text in enumerate(texts):
        _check_stablehlo(text, f"tpu_memory_many (module {i})")
    _require(("jax", "jaxlib", "libtpu"), _TPU_EXTRA_HINT, "tpu_memory (the deviceless TPU compile)")
    timeout = compile_timeout() if timeout is None else timeout
    tc = _compile_helpers()
    topo = _resolve_topology(generation, topology)
    directory = compile_cache.directory_for(disk_cache)
    keys = [_cache_key("tpu", topo, device_index, text, hbm_only, liveness, partitions) for text in texts]
    results: list[CompiledMemory | TpuCompileError | None] = [None] * len(texts)
    todo: dict[str, list[int]] = {}
    for i, (key, text) in enumerate(zip(keys, texts)):
        hit, stored = _cached_result(key, cache, directory, liveness)
        if hit is None and stored is not None:
            hit = _from_result(stored, "tpu", topo, text, stored.get("versions", {}), hbm_only)
            _COMPILE_CACHE[key] = hit
        if hit is not None:
            results[i] = hit
        else:
            todo.setdefault(key, []).append(i)
    if todo:
        order = list(todo)
        compiled = _run_tpu_worker(
            [texts[todo[key][0]] for key in order],
            topo,
            device_index,
            timeout,
            tc,
            hbm_only,
            liveness,
            raise_errors,
            partitions,
        )
        for key, outcome in zip(order, compiled):
            if isinstance(outcome, TpuCompileError):
                for i in todo[key]:
                    results[i] = outcome
                continue
            stored = outcome
            if cache:
                compile_cache.store(directory, key, stored)
            made = [
                _from_result(stored, "tpu", topo, texts[i], stored.get("versions", {}), hbm_only) for i in todo[key]
            ]
            for i, memory in zip(todo[key], made):
                results[i] = memory
            if cache:
                _COMPILE_CACHE[key] = made[0]
    return [r for r in results if r is not None]


def _stderr_tail(stderr: str | bytes | None, lines: int = 40) -> str:
    if isinstance(stderr, bytes):
        stderr = stderr.decode("utf-8", "replace")
    return "\n".join((stderr or "").strip().splitlines()[-lines:])


def _run_tpu_worker(
    texts: Sequence[str],
    topology: str,
    device_index: int,
    timeout: float,
    tc: Any,
    hbm_only: bool = False,
    liveness: bool = False,
    raise_errors: bool = True,
    partitions: int = 1,
) -> list[dict[str, Any] | TpuCompileError]:
    worker = Path(tc.__file__).resolve()
    with tempfile.TemporaryDirectory(prefix="revlib_xla_tpu_") as tmp:
        paths = []
        for i, text in enumerate(texts):
            path = Path(tmp) / f"module{i}.mlir"
            path.write_text(text, encoding="utf-8")
            paths.append(str(path))
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        env = tc.tpu_environment(topology, hbm_only=hbm_only)
        # libtpu writes log files (two per process) to $TPU_LOG_DIR, by default /tmp/tpu_logs, and never removes
        # them: unless the caller chose a directory, they go into this temporary directory and are deleted with it.
        env.setdefault("TPU_LOG_DIR", str(Path(tmp) / "tpu_logs"))
        order: dict[str, Any] = {
            "topology": topology,
            "device_index": device_index,
            "partitions": partitions,
            "modules": paths,
        }
        if liveness:
            order["dump_dir"] = str(Path(tmp) / "dump")
            env["XLA_FLAGS"] = tc.dump_flags(order["dump_dir"], env.get("XLA_FLAGS"))
        request.write_text(json.dumps(order), encoding="utf-8")
        command = [sys.executable, str(worker), str(request), str(result)]
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, env=env, capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as exc:
            raise TpuCompileError(
                f"the deviceless TPU compile ({topology}) did not finish in {timeout:.0f} s; a full-size step "
                f"can take longer on a small machine: pass timeout= or set ${_TIMEOUT_ENV} (seconds); "
                f"stderr tail:\n{_stderr_tail(exc.stderr)}"
            ) from None
        if proc.returncode != 0 or not result.exists():
            raise TpuCompileError(
                f"the deviceless TPU compile worker ({topology}) failed with exit code "
                f"{proc.returncode}; stderr tail:\n{_stderr_tail(proc.stderr)}"
            )
        payload = json.loads(result.read_text(encoding="utf-8"))
    logger.debug("tpu_memory: %d module(s) for %s in %.2f s", len(texts), topology, time.perf_counter() - start)
    out: list[dict[str, Any] | TpuCompileError] = []
    for i, item in enumerate(payload["results"]):
        if "error" in item:
            error = TpuCompileError(f"the TPU compiler ({topology}) rejected module {i}: {item['error']}")
            if raise_errors:
                raise error
            out.append(error)
            continue
        item["versions"] = payload.get("versions", {})
        if liveness:
            text = item.get("buffer_assignment")
            if not text:
                raise TpuCompileError(
                    f"the TPU compiler ({topology}) wrote no buffer assignment for module {i}; "
                    f"is --xla_dump_to overridden in XLA_FLAGS?"
                )
            peak = live_peak(text)
            item["live_peak_bytes"] = peak.bytes
            item["live_peak_values"] = [list(v) for v in peak.largest]
        out.append(item)
    return out
