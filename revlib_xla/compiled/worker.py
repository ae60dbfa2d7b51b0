"""Compile a StableHLO module with XLA and read back its memory statistics; no torch, no execution.

This is the one place in revlib_xla that touches JAX internals (jax/jaxlib 0.7.1: ``jax._src.compiler``,
``jax._src.interpreters.mlir``, ``jax._src.lib.xla_client``). Everything here works on StableHLO *text*, so it needs
neither torch nor torch_xla, and it is both

* a library module, used in-process by :func:`revlib_xla.compiled.memory.xla_cpu_memory` (XLA:CPU, via a private
  jaxlib CPU client, so JAX's own backends are never initialised), and
* a worker program, run by :func:`revlib_xla.compiled.memory.tpu_memory` in a child process as
  ``python path/to/worker.py REQUEST.json RESULT.json``. The child loads libtpu and compiles for a TPU
  *topology description* ("deviceless" compilation): the numbers are what the TPU compiler plans for one chip, with
  no TPU present and nothing executed. A separate process keeps libtpu (which takes a process-wide lock, logs to
  stderr, and may abort the process on bad input) away from the caller's process and its torch_xla runtime.

The request file is JSON ``{"topology": "v5e:2x2", "device_index": 0, "modules": [PATH, ...]}`` where each PATH holds
StableHLO text (``"partitions": N``: modules sharded over the topology's first N chips, see
:func:`compile_for_tpu`); the result file is JSON ``{"results": [...]}`` with one entry per module (see
:func:`compile_module`), or an ``"error"`` string per module that failed to compile. With ``"dump_dir": DIR`` in the
request (and the worker started with ``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text``, see
:func:`dump_flags`), each entry also holds ``"buffer_assignment"``: the text of the compiler's buffer-assignment
dump for that module.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # pragma: no cover - run as a file by memory.tpu_memory
    # Running a file puts its directory first on sys.path; our sibling modules must not shadow anything jax imports.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import functools
import importlib.metadata
import json
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "TPU_GENERATIONS",
    "SLICE_TOPOLOGIES",
    "slice_topology",
    "JAX_VERSION_TESTED",
    "HBM_ONLY_FLAGS",
    "versions",
    "tpu_environment",
    "compile_module",
    "compile_for_cpu",
    "compile_for_tpu",
    "dump_flags",
    "main",
    "STAT_FIELDS",
]

#: The jax/jaxlib release whose internals this module was written against.
JAX_VERSION_TESTED = "0.7.1"

#: Generation name -> the topology compiled for. Checked with jax 0.7.1 + libtpu 0.0.20: single-host 2x2 slices are
#: the smallest accepted ("v5e:1x1" is rejected as "not divisible by chips_per_host_bounds 2x2x1"). v5p devices are
#: megacore by default (one device = one chip with ``num_cores == 2``), so its numbers are per chip like v5e/v6e.
#: A raw v4 topology ("v4:2x2x1") exposes one device per TensorCore (16 GiB each); "v4" names the megacore chip
#: configuration (``@megacore``: one device per chip, both TensorCores and all 32 GiB, as torch_xla runs a v4).
TPU_GENERATIONS: dict[str, str] = {
    "v5e": "v5e:2x2",
    "v6e": "v6e:2x2",
    "v5p": "v5p:2x2x1",
    "v4": "v4:2x2x1@megacore",
}

#: Generation -> {chips: the topology of a slice of that many chips}, for programs partitioned over every chip of a
#: slice (SPMD). v5e and v6e hosts hold 8 chips (2x4); v5p and v4 slices are named by TensorCores (v5p-8 = 4 chips,
#: 2x2x1), and their devices are chips (megacore). Single-host slices, and multi-host ones up to 64 chips.
SLICE_TOPOLOGIES: dict[str, dict[int, str]] = {
    "v5e": {1: "v5e:2x2", 4: "v5e:2x2", 8: "v5e:2x4", 16: "v5e:4x4", 32: "v5e:4x8", 64: "v5e:8x8"},
    "v6e": {1: "v6e:2x2", 4: "v6e:2x2", 8: "v6e:2x4", 16: "v6e:4x4", 32: "v6e:4x8", 64: "v6e:8x8"},
    "v5p": {1: "v5p:2x2x1", 4: "v5p:2x2x1", 8: "v5p:2x2x2", 16: "v5p:2x2x4", 32: "v5p:2x4x4", 64: "v5p:4x4x4"},
    "v4": {
        1: "v4:2x2x1@megacore",
        4: "v4:2x2x1@megacore",
        8: "v4:2x2x2@megacore",
        16: "v4:2x2x4@megacore",
        32: "v4:2x4x4@megacore",
        64: "v4:4x4x4@megacore",
    },
}


def slice_topology(generation: str, chips: int) -> str:
    """The topology whose first ``chips`` devices a program partitioned over ``chips`` chips is compiled for; a
    ``ValueError`` naming the slice sizes there are for anything else."""
    sizes = SLICE_TOPOLOGIES.get(generation)
    if sizes is None:
        raise ValueError(f"unknown TPU generation {generation!r}; choose one of {', '.join(SLICE_TOPOLOGIES)}")
    if chips not in sizes:
        raise ValueError(
            f"no {generation} slice of {chips} chips to compile for; choose one of {', '.join(map(str, sizes))} chips"
        )
    return sizes[chips]


# Topology prefix -> a matching TPU_ACCELERATOR_TYPE (libtpu wants one; with a topology given it does not change
# the numbers).
_ACCELERATOR_TYPES = {"v5e": "v5litepod-4", "v6e": "v6e-4", "v5p": "v5p-8", "v4": "v4-8", "v3": "v3-8"}


#: libtpu flags that turn off memory-space assignment into VMEM (``S(1)`` buffers, allocation "color 1") for the
#: TPU families libtpu 0.0.20 names ``jf``, ``vf`` (v5e, v5p) and ``gf`` (v6e); each is accepted for every
#: generation. With them, every buffer of the program lives in HBM and the compiler's peak is the program's whole
#: live set: arguments + outputs + the HBM heap of temporaries.
#:
#: Why this matters (checked with jax 0.7.1 + libtpu 0.0.20): by default the compiler moves whole buffers into the
#: ~112 MiB of VMEM it may use on v5e, and ``peak_memory_in_bytes`` then reports arguments + outputs + the larger of
#: the HBM temporaries and the VMEM allocation (a 1024 x 2048 six-layer MLP step: 159.4 MB = 25.2 + 16.8 + 117.4 MB
#: of VMEM while its HBM temporaries were 29.6 MB; with 16384 rows: the HBM temporaries, 1661 MB). For a program
#: whose activations fit in VMEM the reported peak is the VMEM allocation, capped near 112 MiB: it says nothing
#: about what the program keeps alive.
HBM_ONLY_FLAGS = (
    "--xla_jf_vmem_memory_space_assignment=false",
    "--xla_vf_vmem_memory_space_assignment=false",
    "--xla_gf_vmem_memory_space_assignment=false",
)


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Installed versions of the packages that decide compiled numbers (part of every cache key)."""
    return {name: _dist_version(name) for name in ("jax", "jaxlib", "libtpu")}


def tpu_environment(topology: str, base: dict[str, str] | None = None, hbm_only: bool = False) -> dict[str, str]:
    """The environment a deviceless libtpu compile needs, on top of ``base`` (default: ``os.environ``).

    ``hbm_only``: add :data:`HBM_ONLY_FLAGS` to ``LIBTPU_INIT_ARGS`` (after any flags already there), so that no
    buffer is placed in VMEM.

    ``TPU_WORKER_HOSTNAMES`` and ``TPU_ACCELERATOR_TYPE`` stop libtpu from looking for a real TPU VM;
    ``TPU_SKIP_MDS_QUERY`` stops it from asking a cloud metadata server; ``ALLOW_MULTIPLE_LIBTPU_LOAD`` lets it load
    while another process (a JAX test, a training job) holds ``/tmp/libtpu_lockfile`` - without it the compile aborts
    with "Internal error when accessing libtpu multi-process lockfile".
    """
    env = dict(os.environ if base is None else base)
    prefix = topology.split(":", 1)[0]
    # Overridden, not defaulted: on a real TPU VM these describe that VM, not the topology compiled for.
    env["TPU_ACCELERATOR_TYPE"] = _ACCELERATOR_TYPES.get(prefix, "v5litepod-4")
    env["TPU_WORKER_HOSTNAMES"] = "localhost"
    env["TPU_SKIP_MDS_QUERY"] = "1"
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    if hbm_only:
        env["LIBTPU_INIT_ARGS"] = " ".join([env.get("LIBTPU_INIT_ARGS", "").strip(), *HBM_ONLY_FLAGS]).strip()
    return env


def dump_flags(directory: str, base: str | None = None) -> str:
    """``XLA_FLAGS`` (on top of ``base``) that make the compiler write its HLO and buffer assignment as text into
    ``directory``."""
    return " ".join([(base or "").strip(), f"--xla_dump_to={directory}", "--xla_dump_hlo_as_text"]).strip()


_BUFFER_ASSIGNMENT_SUFFIX = "after_optimizations-buffer-assignment.txt"


def _new_buffer_assignment(directory: str, seen: set) -> str | None:
    """The text of the buffer-assignment dump written since the last call (the newest, if several)."""
    try:
        names = [n for n in os.listdir(directory) if n.endswith(_BUFFER_ASSIGNMENT_SUFFIX) and n not in seen]
    except OSError:
        return None
    seen.update(names)
    if not names:
        return None
    newest = max(names, key=lambda n: os.path.getmtime(os.path.join(directory, n)))
    with open(os.path.join(directory, newest), encoding="utf-8") as f:
        return f.read()


# ----------------------------------------------------------------------------------------------------------------
# JAX internals (jax 0.7.1). Keep every private import inside these helpers.


def _jax_internals():
    try:
        from jax._src import compiler
        from jax._src.interpreters import mlir
        from jax._src.lib import xla_client as xc
        from jax._src.lib.mlir import ir
    except ImportError as exc:  # pragma: no cover - depends on the installed jax
        raise ImportError(
            f"revlib_xla's XLA memory measurement needs jax/jaxlib=={JAX_VERSION_TESTED} "
            f"(found {versions()}); install it with: pip install 'revlib_xla[tpu-compile]'"
        ) from exc
    return compiler, mlir, xc, ir


def _to_bytecode(stablehlo_text: str) -> bytes:
    _, mlir, _, ir = _jax_internals()
    with mlir.make_ir_context():
        return mlir.module_to_bytecode(ir.Module.parse(stablehlo_text))


def _pre_optimization_hlo(stablehlo_text: str) -> str:
    """The HLO text of the module before any XLA pass (where barriers are ``opt-barrier``)."""
    _, _, xc, _ = _jax_internals()
    computation = xc._xla.mlir.mlir_module_to_xla_computation(stablehlo_text, use_tuple_args=False, return_tuple=False)
    return computation.as_hlo_text()


#: The ``CompiledMemoryStats`` fields every result holds (bytes).
STAT_FIELDS = (
    "peak_memory_in_bytes",
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
    "host_argument_size_in_bytes",
    "host_output_size_in_bytes",
    "host_alias_size_in_bytes",
    "host_temp_size_in_bytes",
    "host_generated_code_size_in_bytes",
)


def compile_module(stablehlo_text: str, device: Any, *, load: bool, partitions: Sequence[Any] = ()) -> dict[str, Any]:
    """Compile ``stablehlo_text`` for one device and return its memory statistics and HLO texts.

    ``load=False`` compiles only (the only choice for a deviceless TPU topology); ``load=True`` also loads the
    executable, which the XLA:CPU client requires. ``partitions``: the devices of a program whose arguments carry
    ``mhlo.sharding`` annotations, split over them by the SPMD partitioner (GSPMD); the figures are then those of
    one of them (the first, ``device``). Returns a JSON-able dict: the ``CompiledMemoryStats`` fields (bytes),
    ``device_kind``, ``compile_seconds``, ``optimized_hlo`` and ``pre_optimization_hlo``.
    """
    compiler, _, xc, _ = _jax_internals()
    bytecode = _to_bytecode(stablehlo_text)
    if len(partitions) > 1:
        import numpy as np

        assignment = np.array(list(partitions), dtype=object).reshape(1, len(partitions))
        options = compiler.get_compile_options(
            num_replicas=1, num_partitions=len(partitions), device_assignment=assignment, use_spmd_partitioning=True
        )
        build = options.executable_build_options
        if hasattr(build, "use_shardy_partitioner"):
            build.use_shardy_partitioner = False  # the annotations are GSPMD's (mhlo.sharding), as torch_xla's
        devices = xc.DeviceList(tuple(partitions))
    else:
        options = compiler.get_compile_options(num_replicas=1, num_partitions=1, device_assignment=[device])
        devices = xc.DeviceList((device,))
    start = time.perf_counter()
    if load:
        executable = device.client.compile_and_load(bytecode, devices, options)
    else:
        executable = device.client.compile(bytecode, executable_devices=devices, compile_options=options)
    seconds = time.perf_counter() - start
    stats = executable.get_compiled_memory_stats()
    result: dict[str, Any] = {name: int(getattr(stats, name, 0) or 0) for name in STAT_FIELDS}
    result.update(
        device_kind=str(getattr(device, "device_kind", "")),
        compile_seconds=seconds,
        optimized_hlo=executable.hlo_modules()[0].to_string(),
        pre_optimization_hlo=_pre_optimization_hlo(stablehlo_text),
    )
    return result


@functools.lru_cache(maxsize=1)
def _cpu_device() -> Any:
    # A private CPU client: unlike jax.devices("cpu"), it does not initialise JAX's other backends (with libtpu
    # installed those would try to load it, take its lock and print warnings).
    _, _, xc, _ = _jax_internals()
    return xc.make_cpu_client().local_devices()[0]


def compile_for_cpu(stablehlo_text: str) -> dict[str, Any]:
    """Compile for XLA:CPU in this process (see :func:`compile_module` for the result)."""
    return compile_module(stablehlo_text, _cpu_device(), load=True)


@functools.cache
def _tpu_devices(topology: str) -> tuple[Any, ...]:
    """The devices of a topology; ``NAME@CONFIG`` picks libtpu's chip configuration (``megacore``)."""
    from jax.experimental import topologies

    name, _, chip_config = topology.partition("@")
    options = {"chip_config_name": chip_config} if chip_config else {}
    return tuple(topologies.get_topology_desc(topology_name=name, platform="tpu", **options).devices)


def compile_for_tpu(
    stablehlo_text: str, topology: str = "v5e:2x2", device_index: int = 0, partitions: int = 1
) -> dict[str, Any]:
    """Compile deviceless for one chip of a TPU topology, in this process; ``partitions > 1``: a program sharded
    over the topology's first ``partitions`` chips (see :func:`compile_module`), its figures per chip.

    Needs libtpu and the environment of :func:`tpu_environment` set *before* libtpu loads; this is why
    :func:`revlib_xla.compiled.memory.tpu_memory` calls it in a child process rather than in the caller's.
    """
    devices = _tpu_devices(topology)
    if partitions > len(devices):
        raise ValueError(f"the topology {topology} has {len(devices)} chips, not the {partitions} to partition over")
    spread = devices[:partitions] if partitions > 1 else ()
    return compile_module(stablehlo_text, devices[device_index], load=False, partitions=spread)


def main(argv: list[str] | None = None) -> int:
    """Worker entry point: ``worker.py REQUEST.json RESULT.json`` (see the module docstring)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: worker.py REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    with open(args[0], encoding="utf-8") as f:
        request = json.load(f)
    topology = request.get("topology", TPU_GENERATIONS["v5e"])
    device_index = int(request.get("device_index", 0))
    partitions = int(request.get("partitions", 1))
    dump_dir = request.get("dump_dir")
    seen: set = set()
    results = []
    for path in request["modules"]:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            results.append(compile_for_tpu(text, topology, device_index, partitions))
        except Exception as exc:  # report per module; the parent raises with this message
            results.append({"error": f"{type(exc).__name__}: {exc}"})
        if dump_dir:
            results[-1]["buffer_assignment"] = _new_buffer_assignment(dump_dir, seen)
    out = {"topology": topology, "device_index": device_index, "versions": versions(), "results": results}
    tmp = args[1] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f)
    os.replace(tmp, args[1])
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
