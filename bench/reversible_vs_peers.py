#!/usr/bin/env python
"""Benchmark of revlib_xla's reversible core against its baselines and against the real RevLib 1.7.2.

One run measures, on the same model with the same weights and input, the training step time (forward + loss +
backward + zeroing the gradients) and the peak memory of the step for:

* ``no_savings``  - revlib_xla's ReversibleSequential with ``MemoryModes.no_savings`` (plain autograd, the reference);
* ``checkpoint``  - the same model with every reversible layer wrapped in ``torch.utils.checkpoint``
  (``use_reentrant=False``; on XLA ``torch_xla.utils.checkpoint``);
* ``revlib_xla``  - revlib_xla's reversible mode (its default, ``MemoryModes.autograd_function``);
* ``baseline``    - with ``--baseline DIR``: revlib_xla's reversible mode imported from another checkout (e.g. a git
  worktree of an earlier commit), to show a change costs no time and no memory, measured in the same run;
* ``revlib``      - the real ``revlib==1.7.2`` from PyPI (its default, ``autograd_function``), installed into a
  throwaway directory (``.cache/bench/revlib-1.7.2``) and imported only by its own worker process.

Every variant runs in its own worker process (the revlib worker with the throwaway directory on ``PYTHONPATH``, the
same Python and torch), so the two libraries never share a process and memory measurements do not see each other.
Timings are interleaved round-robin across the workers to spread machine drift evenly. Results go to
``bench/results/reversible_vs_peers-<device>.json`` and ``.md``. See ``bench/README.md``.

Usage: ``python bench/reversible_vs_peers.py [--quick] [--device auto|cpu|xla|cuda[,..]] [--out-dir DIR]
[--baseline DIR]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
REVLIB_VERSION = "1.7.2"
DEFAULT_REVLIB_DIR = ROOT / ".cache" / "bench" / f"revlib-{REVLIB_VERSION}"
DEFAULT_OUT_DIR = ROOT / "bench" / "results"

VARIANTS = ("no_savings", "checkpoint", "revlib_xla", "baseline", "revlib")
REVERSIBLE_VARIANTS = ("revlib_xla", "baseline", "revlib")
BASELINE_TIME_TOLERANCE = 1.03  # a change to the reversible core may cost at most 3 % of a step

# Sizes: a step of the full configuration takes ~50-200 ms per variant on one CPU thread (compute-bound enough that
# per-op Python overhead is a minor part), and the whole run stays under ~8 minutes on a 2-core machine. 41 repeats:
# on a shared machine the spread of one variant's step times (p25-p75) is +-15 %, the size of the margins judged.
CONFIGS: dict[str, dict[str, Any]] = {
    "full": {
        "models": {
            "mlp": {"kind": "mlp", "width": 128, "hidden": 512, "batch": 1, "seq": 128, "depth": 32},
            "transformer": {
                "kind": "transformer",
                "width": 128,
                "hidden": 512,
                "heads": 4,
                "batch": 1,
                "seq": 128,
                "depth": 32,
            },
            # compute-bound: issue 15's shape (matmuls dominate; the halves of the split input are not contiguous)
            "mlp512": {"kind": "mlp", "width": 512, "hidden": 512, "batch": 256, "seq": 1, "depth": 16},
        },
        "warmup": 3,
        "repeats": 41,
        "xla_models": ["mlp"],
        "xla_warmup": 2,
        "xla_repeats": 7,
    },
    "quick": {
        "models": {"mlp": {"kind": "mlp", "width": 16, "hidden": 32, "batch": 1, "seq": 16, "depth": 4}},
        "warmup": 1,
        "repeats": 3,
        "xla_models": ["mlp"],
        "xla_warmup": 1,
        "xla_repeats": 2,
    },
}

# Targets (see bench/README.md).
TARGET_TIME_VS_REVLIB = 1.05
TARGET_TIME_VS_NO_SAVINGS_CPU = 1.4


# =================================================================================================================
# The model (pure torch: built identically in every worker, whichever library wraps it)


def build_blocks(cfg: dict[str, Any]):
    """The blocks of the reversible stack, one per reversible layer (``depth`` of them), seeded."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class MLP(nn.Module):
        """Linear -> GELU -> Linear, on channels-last (batch, seq, width)."""

        def __init__(self, width: int, hidden: int, norm: bool = False):
            super().__init__()
            self.norm = nn.LayerNorm(width) if norm else nn.Identity()
            self.up = nn.Linear(width, hidden)
            self.down = nn.Linear(hidden, width)

        def forward(self, x):
            return self.down(F.gelu(self.up(self.norm(x))))

    class Attention(nn.Module):
        """Pre-norm causal multi-head self-attention (scaled_dot_product_attention)."""

        def __init__(self, width: int, heads: int):
            super().__init__()
            self.heads = heads
            self.norm = nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, c))

    torch.manual_seed(0)
    blocks = []
    for i in range(cfg["depth"]):
        if cfg["kind"] == "mlp":
            blocks.append(MLP(cfg["width"], cfg["hidden"]))
        elif cfg["kind"] == "transformer":  # RevNet-style transformer: F = attention, G = MLP
            blocks.append(
                Attention(cfg["width"], cfg["heads"]) if i % 2 == 0 else MLP(cfg["width"], cfg["hidden"], norm=True)
            )
        else:
            raise ValueError(f"unknown model kind {cfg['kind']!r}")
    return blocks


def describe_model(cfg: dict[str, Any]) -> str:
    if cfg["kind"] == "mlp":
        block = f"Linear({cfg['width']},{cfg['hidden']})-GELU-Linear({cfg['hidden']},{cfg['width']})"
    else:
        block = (
            f"alternating pre-LN causal attention ({cfg['heads']} heads) / pre-LN MLP "
            f"({cfg['width']}->{cfg['hidden']}->{cfg['width']})"
        )
    return (
        f"{cfg['depth']} reversible layers of {block}; input ({cfg['batch']}, {cfg['seq']}, {2 * cfg['width']}) "
        f"split into two streams of width {cfg['width']} along the last dim; fp32; loss = mean(out^2)"
    )


# =================================================================================================================
# Peak memory of an eager step: live bytes of the storages allocated during the step


class StorageTracker:
    """TorchDispatchMode that follows every storage created by an op while it is active.

    ``peak`` is the largest total of live storages created inside the mode (activations, saved tensors, temporaries,
    gradients); storages that existed before (parameters, the input) and views/in-place results on existing storages
    are not counted. Deterministic: it counts bytes, not allocator pages. Works on any eager device (the autograd
    engine carries the mode into its worker threads).
    """

    def __init__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self
        self.live = 0
        self.peak = 0
        self._seen: dict[int, Any] = {}

        def storage_ids(tensors):
            ids = set()
            for t in tensors:
                if isinstance(t, _torch().Tensor):
                    try:
                        ids.add(t.untyped_storage()._cdata)
                    except Exception:  # sparse / meta-less tensors: nothing to count
                        pass
            return ids

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                inputs = storage_ids(tree_flatten((args, kwargs))[0])
                out = func(*args, **kwargs)
                for t in tree_flatten(out)[0]:
                    if not isinstance(t, _torch().Tensor):
                        continue
                    try:
                        storage = t.untyped_storage()
                    except Exception:
                        continue
                    key = storage._cdata
                    if key in inputs or key in tracker._seen:
                        continue
                    size = storage.nbytes()
                    tracker.live += size
                    tracker.peak = max(tracker.peak, tracker.live)
                    tracker._seen[key] = weakref.finalize(storage, tracker._free, key, size)
                return out

        self._mode = _Mode()

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.pop(key, None)

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def _torch():
    import torch

    return torch


# =================================================================================================================
# Worker process: one variant on one device


class _Device:
    """The device a worker runs on, and how a step is finished there."""

    def __init__(self, kind: str, threads: int):
        import torch

        self.kind = kind
        self.torch = torch
        torch.set_num_threads(threads)
        if kind == "xla":
            import torch_xla
            import torch_xla.core.xla_model as xm

            self.xm, self.torch_xla = xm, torch_xla
            self.device = torch_xla.device()
        elif kind == "cuda":
            torch.cuda.init()  # before any model is built (RevLib decides on CUDA RNG handling at construction)
            self.device = torch.device("cuda")
        else:
            self.device = torch.device("cpu")

    def finish(self):
        if self.kind == "xla":
            self.torch_xla.sync()
            self.xm.wait_device_ops()
        elif self.kind == "cuda":
            self.torch.cuda.synchronize()


def _import_lib(name: str, revlib_dir: str):
    if name == "revlib":
        import revlib as lib  # from the throwaway directory on PYTHONPATH

        where = Path(revlib_dir).resolve()
        if where not in Path(lib.__file__).resolve().parents:
            raise RuntimeError(f"imported revlib from {lib.__file__}, expected it under {where}")
        return lib, REVLIB_VERSION
    if name == "baseline":
        import revlib_xla as lib  # from the baseline checkout, first on PYTHONPATH

        where = Path(os.environ["REVLIB_XLA_BASELINE"]).resolve()
        if where not in Path(lib.__file__).resolve().parents:
            raise RuntimeError(f"imported revlib_xla from {lib.__file__}, expected the baseline under {where}")
        return lib, f"{lib.__version__} ({where.name})"
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import revlib_xla as lib

    return lib, lib.__version__


class _Runner:
    """One variant: its own copy of the model (identical weights), the input, and the step."""

    def __init__(self, variant: str, lib_name: str, dev: _Device, spec: dict[str, Any]):
        torch = dev.torch
        self.variant, self.dev, self.torch = variant, dev, torch
        lib, self.lib_version = _import_lib(lib_name, spec.get("revlib_dir", ""))
        self.lib_file = lib.__file__
        blocks = build_blocks(spec["model"])
        states = torch.load(spec["weights"])
        for block, state in zip(blocks, states):
            block.load_state_dict(state)
        mode = lib.MemoryModes.autograd_function if variant in REVERSIBLE_VARIANTS else lib.MemoryModes.no_savings
        model = lib.ReversibleSequential(*blocks, split_dim=-1, memory_mode=mode)
        expected = "0-1.wrapped_module.wrapped_module."
        if not any(k.startswith(expected) for k in model.state_dict()):
            raise RuntimeError(f"unexpected state-dict layout in {lib_name}: {list(model.state_dict())[:3]}")
        self.model = model.to(dev.device)
        self.x = torch.load(spec["input"]).to(dev.device).requires_grad_()
        if dev.kind == "xla":
            dev.torch_xla.sync()
        self.forward = self._make_forward()

    def _make_forward(self):
        if self.variant != "checkpoint":
            return self.model
        torch = self.torch
        if self.dev.kind == "xla":
            import torch_xla.utils.checkpoint as xla_checkpoint

            def ckpt(fn, a, b):
                return xla_checkpoint.checkpoint(fn, a, b)
        else:
            import torch.utils.checkpoint as torch_checkpoint

            def ckpt(fn, a, b):
                return torch_checkpoint.checkpoint(fn, a, b, use_reentrant=False)

        layers = list(self.model)

        def forward(x):
            x0, x1 = x.chunk(2, -1)
            for layer in layers:  # one checkpoint per reversible layer: y1 = coupling(x0, f(x1))
                x0, x1 = x1, ckpt(layer.wrapped_module, x0, x1)
            return torch.cat([x0, x1], -1)

        return forward

    # -- one step -------------------------------------------------------------------------------------------------
    def _loss_backward(self):
        loss = self.forward(self.x).square().mean()
        loss.backward()
        return loss

    def _zero(self):
        self.model.zero_grad(set_to_none=True)
        self.x.grad = None

    def step(self):
        self._loss_backward()
        self.dev.finish()
        self._zero()

    # -- commands -------------------------------------------------------------------------------------------------
    def cmd_info(self):
        return {
            "lib_version": self.lib_version,
            "lib_file": self.lib_file,
            "device": str(self.dev.device),
            "threads": self.torch.get_num_threads(),
            "torch": self.torch.__version__,
            "pid": os.getpid(),
        }

    def cmd_time(self, n: int = 1):
        """Step times on the primary clock (eager CPU: CPU time of this single-threaded worker, which other load on
        a shared machine barely moves; elsewhere wall-clock, since the device works asynchronously) and wall-clock."""
        self.dev.finish()
        times, wall = [], []
        cpu_clock = self.dev.kind == "cpu"
        for _ in range(n):
            start, start_cpu = time.perf_counter(), time.process_time()
            self.step()
            end, end_cpu = time.perf_counter(), time.process_time()
            wall.append(end - start)
            times.append(end_cpu - start_cpu if cpu_clock else end - start)
        return {"times": times, "wall_times": wall}

    def cmd_memory(self):
        torch = self.torch
        self.dev.finish()
        if self.dev.kind == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            self.step()
            return {"peak_bytes": int(torch.cuda.max_memory_allocated() - base), "method": "cuda_allocator"}
        tracker = StorageTracker()
        with tracker:
            self._loss_backward()
            self._zero()
        return {"peak_bytes": int(tracker.peak), "method": "storage_tracker"}

    def cmd_grads(self, path: str):
        loss = self._loss_backward()
        self.dev.finish()
        grads = {name: p.grad.detach().cpu().clone() for name, p in self.model.named_parameters() if p.grad is not None}
        grads["<input>"] = self.x.grad.detach().cpu().clone()
        missing = [name for name, p in self.model.named_parameters() if p.grad is None]
        self.torch.save({"grads": grads, "loss": float(loss.detach().cpu()), "missing": missing}, path)
        self._zero()
        return {"path": path, "missing": missing}

    def cmd_hlo(self, path: str):
        """StableHLO of one whole training step (loss, input grad, parameter grads), for the compile-based memory."""
        self.dev.finish()
        loss = self._loss_backward()
        outputs = [loss, self.x.grad] + [p.grad for p in self.model.parameters() if p.grad is not None]
        text = self.dev.xm.get_stablehlo(outputs)
        Path(path).write_text(text)
        self._zero()
        self.dev.torch_xla.sync()
        return {"path": path, "chars": len(text)}


class _Worker:
    """The variants of one library on one device (one process per library, so RevLib never meets revlib_xla)."""

    def __init__(self, spec: dict[str, Any]):
        self.dev = _Device(spec["device"], spec["threads"])
        self.runners: dict[str, Any] = {}
        self.failed: dict[str, str] = {}
        for v in spec["variants"]:
            try:
                self.runners[v] = _Runner(v, spec["lib"], self.dev, spec)
            except Exception:
                self.failed[v] = traceback.format_exc()

    def call(self, cmd: str, variant: str, **kw):
        if variant in self.failed:
            raise RuntimeError(f"variant {variant} could not be set up:\n{self.failed[variant]}")
        return getattr(self.runners[variant], f"cmd_{cmd}")(**kw)


def worker_main(spec_json: str) -> int:
    # The protocol uses the original stdout; anything printed by libraries goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj):
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    try:
        worker = _Worker(json.loads(spec_json))
    except Exception:
        reply({"error": traceback.format_exc()})
        return 1
    reply({"ready": True})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        cmd = request.pop("cmd")
        if cmd == "quit":
            break
        try:
            reply({"ok": worker.call(cmd, **request)})
        except Exception:
            reply({"error": traceback.format_exc()})
    return 0


# =================================================================================================================
# XLA memory from the compiled program (own process: libtpu must be set up before it loads)


def compile_main(request_json: str) -> int:
    request = json.loads(request_json)
    sys.path.insert(0, str(ROOT))
    out: dict[str, Any] = {"results": {}}
    try:
        from revlib_xla.compiled import worker as tpu_compile
    except Exception as exc:
        out["error"] = f"revlib_xla.compiled.worker is not importable: {type(exc).__name__}: {exc}"
        print(json.dumps(out))
        return 0
    out["versions"] = tpu_compile.versions()
    dot = re.compile(r"\b(dot|convolution)\(")
    for name, path in request["modules"].items():
        text = Path(path).read_text()
        entry: dict[str, Any] = {}
        for target, fn in (
            ("xla_cpu", tpu_compile.compile_for_cpu),
            ("tpu_" + request["generation"], lambda t: tpu_compile.compile_for_tpu(t, request["topology"], 0)),
        ):
            try:
                res = fn(text)
            except Exception as exc:
                entry[target] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                continue
            host = sum(
                res.get(k, 0)
                for k in ("host_argument_size_in_bytes", "host_temp_size_in_bytes", "host_output_size_in_bytes")
            )
            entry[target] = {
                "peak_bytes": res["peak_memory_in_bytes"] - host,
                "temp_bytes": res["temp_size_in_bytes"],
                "argument_bytes": res["argument_size_in_bytes"],
                "output_bytes": res["output_size_in_bytes"],
                "dots_optimized": len(dot.findall(res["optimized_hlo"])),
                "dots_before": len(dot.findall(res["pre_optimization_hlo"])),
                "compile_s": round(res["compile_seconds"], 2),
            }
        out["results"][name] = entry
    print(json.dumps(out))
    return 0


# =================================================================================================================
# Orchestrator


class WorkerProcess:
    """A worker in its own process, driven by JSON lines over its stdin/stdout."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str], log_path: Path):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--worker", json.dumps(spec)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=str(ROOT),
        )
        self.error: str | None = None  # the whole worker is unusable
        self._ready = False

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.flush()
            tail = self.log_path.read_text()[-3000:] if self.log_path.exists() else ""
            self.error = f"worker exited with code {self.proc.returncode}\n{tail}"
            return {"error": self.error}
        return json.loads(line)

    def wait_ready(self) -> None:
        if not self._ready:
            msg = self._read()
            if "error" in msg:
                self.error = msg["error"]
            self._ready = True

    def call(self, cmd: str, variant: str, **kw) -> dict[str, Any]:
        """{"ok": result} or {"error": text}."""
        self.wait_ready()
        if self.error:
            return {"error": self.error}
        try:
            self.proc.stdin.write(json.dumps({"cmd": cmd, "variant": variant, **kw}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            self.error = f"worker died: {exc}"
            return {"error": self.error}
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class InProcessWorker:
    """The same interface, running in this process (``--inprocess``: saves a process start in smoke runs)."""

    def __init__(self, spec: dict[str, Any]):
        self.error: str | None = None
        try:
            self.worker = _Worker(spec)
        except Exception:
            self.error = traceback.format_exc()

    def wait_ready(self) -> None:
        pass

    def call(self, cmd: str, variant: str, **kw) -> dict[str, Any]:
        if self.error:
            return {"error": self.error}
        try:
            return {"ok": self.worker.call(cmd, variant, **kw)}
        except Exception:
            return {"error": traceback.format_exc()}

    def close(self) -> None:
        self.worker = None


def ensure_revlib(revlib_dir: Path, install: bool) -> dict[str, Any]:
    """Make sure revlib==1.7.2 sits in ``revlib_dir`` (a throwaway --target directory, never the project venv)."""
    if (revlib_dir / "revlib" / "core.py").exists():
        return {"available": True, "dir": str(revlib_dir), "installed_now": False}
    if not install:
        return {
            "available": False,
            "reason": f"revlib {REVLIB_VERSION} is not cached in {revlib_dir} and "
            f"installing was disabled (--no-install)",
        }
    revlib_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="revlib-", dir=revlib_dir.parent))
    commands = []
    if shutil.which("uv"):
        commands.append(
            [
                "uv",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--target",
                str(tmp),
                "-p",
                sys.executable,
                f"revlib=={REVLIB_VERSION}",
            ]
        )
    commands.append(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp), f"revlib=={REVLIB_VERSION}"]
    )
    errors = []
    for command in commands:
        try:
            res = subprocess.run(command, capture_output=True, text=True, timeout=180)
        except Exception as exc:
            errors.append(f"{command[0]}: {exc}")
            continue
        if res.returncode == 0 and (tmp / "revlib" / "core.py").exists():
            if revlib_dir.exists():
                shutil.rmtree(revlib_dir)
            tmp.rename(revlib_dir)
            return {"available": True, "dir": str(revlib_dir), "installed_now": True}
        errors.append(f"{' '.join(command[:3])}: exit {res.returncode}: {(res.stderr or res.stdout).strip()[-300:]}")
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "available": False,
        "reason": f"could not install revlib=={REVLIB_VERSION} from PyPI: " + " | ".join(errors),
    }


def _describe_checkout(path: str) -> str:
    """``path`` and, where it is a git checkout, its commit."""
    done = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"{path} (commit {done.stdout.strip()})" if done.returncode == 0 else path


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_name(devices: list[str]) -> str:
    import torch

    if "cuda" in devices:
        return "cuda-" + slug(torch.cuda.get_device_name())
    if "xla" in devices and os.environ.get("PJRT_DEVICE", "CPU").upper() not in ("CPU", ""):
        return "xla-" + slug(os.environ["PJRT_DEVICE"])
    return "cpu"  # the CPU's model is written inside the result, not in its name


def xla_importable() -> str | None:
    """None if torch_xla imports (checked in a child, so this process never loads it), else the reason."""
    try:
        res = subprocess.run(
            [sys.executable, "-c", "import torch_xla"],
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")},
        )
    except Exception as exc:
        return str(exc)
    return None if res.returncode == 0 else (res.stderr.strip().splitlines() or ["import failed"])[-1]


def resolve_devices(arg: str, quick: bool) -> dict[str, str | None]:
    """Device kind -> None (run it) or the reason it is skipped."""
    import torch

    wanted = ["cpu"] if (arg == "auto" and quick) else (["cpu", "xla", "cuda"] if arg == "auto" else arg.split(","))
    out: dict[str, str | None] = {}
    for kind in wanted:
        kind = kind.strip()
        if kind == "cpu":
            out[kind] = None
        elif kind == "cuda":
            out[kind] = None if torch.cuda.is_available() else "no CUDA GPU on this machine"
        elif kind == "xla":
            reason = xla_importable()
            out[kind] = None if reason is None else f"torch_xla not available: {reason}"
        else:
            raise SystemExit(f"--device: unknown device kind {kind!r} (use cpu, xla, cuda or auto)")
    return out


def summarize(times: list[float]) -> dict[str, float]:
    ms = sorted(t * 1e3 for t in times)
    q = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) >= 2 else [ms[0]] * 3
    return {"median_ms": statistics.median(ms), "p25_ms": q[0], "p75_ms": q[2], "min_ms": ms[0], "n": len(ms)}


def grad_error(grads: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """max over tensors of max|g - ref| / max|ref| (the worst tensor is named)."""
    worst, worst_name = 0.0, None
    missing = sorted(set(ref) - set(grads))
    for name, r in ref.items():
        if name not in grads:
            continue
        g = grads[name].double()
        r = r.double()
        denom = float(r.abs().max())
        err = float((g - r).abs().max()) / denom if denom > 0 else float((g - r).abs().max())
        if err > worst or worst_name is None:
            worst, worst_name = err, name
    return {"max_rel_err": worst, "worst_tensor": worst_name, "missing": missing}


def run_group(
    device: str,
    model_name: str,
    cfg: dict[str, Any],
    variants: list[str],
    files: dict[str, str],
    revlib_info: dict[str, Any],
    args,
    workdir: Path,
    bar,
    warmup: int,
    repeats: int,
) -> dict[str, Any]:
    """Start one worker per library, time the variants round-robin, then measure memory and gradients."""
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
    base_env.pop("PYTHONPATH", None)
    libs: dict[str, list[str]] = {}
    for variant in variants:
        libs.setdefault(variant if variant in ("revlib", "baseline") else "revlib_xla", []).append(variant)
    workers: dict[str, Any] = {}
    rows: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for lib, lib_variants in sorted(libs.items(), key=lambda kv: kv[0] != "revlib"):  # processes start first
        spec = {
            "lib": lib,
            "variants": lib_variants,
            "device": device,
            "model": cfg,
            "threads": args.threads,
            "weights": files["weights"],
            "input": files["input"],
            "revlib_dir": revlib_info.get("dir", ""),
        }
        if lib == "revlib_xla" and args.inprocess:
            worker = InProcessWorker(spec)
        else:
            env = dict(base_env)
            if lib == "revlib":
                env["PYTHONPATH"] = revlib_info["dir"]
            if lib == "baseline":
                env["PYTHONPATH"] = env["REVLIB_XLA_BASELINE"] = str(Path(args.baseline).resolve())
            worker = WorkerProcess(spec, env, workdir / f"{device}-{model_name}-{lib}.log")
        for variant in lib_variants:
            workers[variant] = worker
            rows[variant] = {"device": device, "model": model_name, "variant": variant, "lib": lib}

    def call(variant, cmd, **kw):
        if variant in errors:
            return None
        res = workers[variant].call(cmd, variant, **kw)
        if "error" in res:
            errors[variant] = res["error"]
            return None
        return res["ok"]

    hlo_files: dict[str, str] = {}
    try:
        for variant in variants:
            info = call(variant, "info")
            if info:
                rows[variant]["worker"] = info
        for variant in variants:  # warm-up (XLA: this is where the step graph gets compiled)
            call(variant, "time", n=warmup)
            bar.update(warmup)
        times: dict[str, list[float]] = {v: [] for v in variants}
        wall: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(repeats):  # round-robin, rotating the order every round
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for variant in order:
                res = call(variant, "time", n=1)
                if res:
                    times[variant].extend(res["times"])
                    wall[variant].extend(res.get("wall_times", res["times"]))
                bar.update(1)
        for variant in variants:
            if device == "xla":
                path = str(workdir / f"{model_name}-{variant}.stablehlo.mlir")
                if call(variant, "hlo", path=path):
                    hlo_files[variant] = path
            else:
                mem = call(variant, "memory")
                if mem:
                    rows[variant]["peak_bytes"] = mem["peak_bytes"]
                    rows[variant]["peak_method"] = mem["method"]
            path = str(workdir / f"{device}-{model_name}-{variant}.grads.pt")
            if call(variant, "grads", path=path):
                rows[variant]["grads_file"] = path
            bar.update(2)
        for variant in variants:
            if times[variant]:
                rows[variant]["time"] = summarize(times[variant])
                rows[variant]["time"]["clock"] = "process_cpu" if device == "cpu" else "wall"
                rows[variant]["times_ms"] = [round(t * 1e3, 3) for t in times[variant]]
                rows[variant]["wall_time"] = summarize(wall[variant])
            if variant in errors:
                lines = [ln for ln in errors[variant].strip().splitlines() if ln.strip()]
                rows[variant]["error"] = (lines[-1] if lines else "unknown error")[:500]
                rows[variant]["error_log"] = errors[variant][-3000:]
    finally:
        for worker in {id(w): w for w in workers.values()}.values():
            worker.close()
    return {"rows": rows, "hlo_files": hlo_files}


def run_compile(hlo: dict[str, str], args) -> dict[str, Any]:
    if not hlo:
        return {"error": "no StableHLO was exported"}
    topology, accel = {"v5e": ("v5e:2x2", "v5litepod-4"), "v6e": ("v6e:2x2", "v6e-4")}[args.tpu]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "TPU_ACCELERATOR_TYPE": accel,
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_SKIP_MDS_QUERY": "1",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }
    env.pop("PYTHONPATH", None)
    request = {"modules": hlo, "generation": args.tpu, "topology": topology}
    try:
        res = subprocess.run(
            [sys.executable, str(SCRIPT), "--compile", json.dumps(request)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            cwd=str(ROOT),
        )
    except Exception as exc:
        return {"error": f"compile process failed: {exc}"}
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"error": f"compile process exit {res.returncode}: {res.stderr.strip()[-500:]}"}
    return json.loads(lines[-1])


def _compiled_peak(row: dict[str, Any], target: str) -> int | None:
    """A row's compiled peak bytes for ``target`` (``tpu_v5e``, ``xla_cpu``), or ``None`` where it was not compiled."""
    return (row.get("compiled") or {}).get(target, {}).get("peak_bytes")


def add_ratios_and_verdicts(results: dict[str, Any]) -> None:
    verdicts = []
    groups: dict[tuple, dict[str, dict[str, Any]]] = {}
    for row in results["rows"]:
        groups.setdefault((row["device"], row["model"]), {})[row["variant"]] = row
    for (device, model), rows in groups.items():
        mem_key = "peak_bytes"
        for row in rows.values():
            ratios = {}
            for ref_name in ("revlib", "no_savings", "baseline"):
                ref = rows.get(ref_name)
                if not ref:
                    continue
                if "time" in row and "time" in ref:
                    ratios[f"time_vs_{ref_name}"] = row["time"]["median_ms"] / ref["time"]["median_ms"]
                if row.get(mem_key) is not None and ref.get(mem_key):
                    ratios[f"memory_vs_{ref_name}"] = row[mem_key] / ref[mem_key]
                for target in ("xla_cpu", f"tpu_{results['config']['tpu']}"):
                    a = _compiled_peak(row, target)
                    b = _compiled_peak(ref, target)
                    if a is not None and b:
                        ratios[f"{target}_memory_vs_{ref_name}"] = a / b
            row["ratios"] = ratios

        ours, revlib, plain = rows.get("revlib_xla"), rows.get("revlib"), rows.get("no_savings")
        where = f"{device}/{model}"
        if ours is None:
            continue
        if revlib is None or revlib.get("error") or "time" not in revlib:
            why = (revlib or {}).get("error") or results["revlib"].get("reason") or "not run"
            verdicts.append(
                {
                    "target": "memory <= revlib",
                    "where": where,
                    "status": "not measured",
                    "detail": f"revlib not measured: {why}",
                }
            )
            verdicts.append(
                {
                    "target": f"time <= {TARGET_TIME_VS_REVLIB}x revlib",
                    "where": where,
                    "status": "not measured",
                    "detail": f"revlib not measured: {why}",
                }
            )
        else:
            if device == "xla":
                tpu = f"tpu_{results['config']['tpu']}"
                for target in (tpu, "xla_cpu"):
                    a = _compiled_peak(ours, target)
                    b = _compiled_peak(revlib, target)
                    if a is None or b is None:
                        verdicts.append(
                            {
                                "target": f"memory <= revlib ({target} compiled peak)",
                                "where": where,
                                "status": "not measured",
                                "detail": "compile failed or unavailable",
                            }
                        )
                    else:
                        verdicts.append(
                            {
                                "target": f"memory <= revlib ({target} compiled peak)",
                                "where": where,
                                "status": "met" if a <= b else "not met",
                                "detail": f"{a / 2**20:.2f} MiB vs {b / 2**20:.2f} MiB ({a / b:.3f}x)",
                            }
                        )
            elif ours.get("peak_bytes") is not None and revlib.get("peak_bytes") is not None:
                a, b = ours["peak_bytes"], revlib["peak_bytes"]
                verdicts.append(
                    {
                        "target": "memory <= revlib",
                        "where": where,
                        "status": "met" if a <= b else "not met",
                        "detail": f"{a / 2**20:.2f} MiB vs {b / 2**20:.2f} MiB ({a / b:.3f}x)",
                    }
                )
            if "time" in ours:
                a, b = ours["time"]["median_ms"], revlib["time"]["median_ms"]
                note = " (XLA:CPU timing, indicative only)" if device == "xla" else ""
                verdicts.append(
                    {
                        "target": f"time <= {TARGET_TIME_VS_REVLIB}x revlib",
                        "where": where,
                        "status": "met" if a <= TARGET_TIME_VS_REVLIB * b else "not met",
                        "detail": f"{a:.1f} ms vs {b:.1f} ms ({a / b:.3f}x){note}",
                    }
                )
        if device == "cpu" and plain and "time" in plain and "time" in ours:
            a, b = ours["time"]["median_ms"], plain["time"]["median_ms"]
            verdicts.append(
                {
                    "target": f"time <= {TARGET_TIME_VS_NO_SAVINGS_CPU}x no_savings (eager CPU)",
                    "where": where,
                    "status": "met" if a <= TARGET_TIME_VS_NO_SAVINGS_CPU * b else "not met",
                    "detail": f"{a:.1f} ms vs {b:.1f} ms ({a / b:.3f}x)",
                }
            )
        base = rows.get("baseline")
        if base and "time" in base and "time" in ours:
            a, b = ours["time"]["median_ms"], base["time"]["median_ms"]
            verdicts.append(
                {
                    "target": f"time <= {BASELINE_TIME_TOLERANCE}x baseline",
                    "where": where,
                    "status": "met" if a <= BASELINE_TIME_TOLERANCE * b else "not met",
                    "detail": f"{a:.1f} ms vs {b:.1f} ms ({a / b:.3f}x)",
                }
            )
        if base and device == "xla":
            tpu = f"tpu_{results['config']['tpu']}"
            for target in (tpu, "xla_cpu"):
                a = _compiled_peak(ours, target)
                b = _compiled_peak(base, target)
                if a is not None and b is not None:
                    verdicts.append(
                        {
                            "target": f"memory == baseline ({target} compiled peak, bytes)",
                            "where": where,
                            "status": "met" if a == b else "not met",
                            "detail": f"{a} vs {b} bytes",
                        }
                    )
        if base and ours.get("peak_bytes") is not None and base.get("peak_bytes") is not None:
            a, b = ours["peak_bytes"], base["peak_bytes"]
            verdicts.append(
                {
                    "target": "memory == baseline (bytes)",
                    "where": where,
                    "status": "met" if a == b else "not met",
                    "detail": f"{a} vs {b} bytes",
                }
            )
        ge = ours.get("grad_error", {}).get("max_rel_err")
        if ge is not None:
            verdicts.append(
                {
                    "target": "gradients agree with no_savings (max rel err <= 1e-4)",
                    "where": where,
                    "status": "met" if ge <= 1e-4 else "not met",
                    "detail": f"{ge:.2e}",
                }
            )
    results["verdicts"] = verdicts


def _fmt_bytes(b: int | None) -> str:
    return "—" if b is None else f"{b / 2**20:.2f}"


def _fmt_ratio(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"


def write_markdown(results: dict[str, Any], path: Path) -> None:
    meta, cfgs = results["meta"], results["config"]
    lines = [
        f"# Reversible core vs peers — {results['device_name']}",
        "",
        f"Generated by `bench/reversible_vs_peers.py{' --quick' if cfgs['quick'] else ''}` on {meta['date']} "
        f"({meta['wall_s']:.0f} s). torch {meta['torch']}, torch_xla {meta.get('torch_xla') or '—'}, "
        f"revlib_xla {meta['revlib_xla']}, revlib {results['revlib'].get('version', '—')}, "
        f"Python {meta['python']}; CPU: {meta['cpu']} ({meta['cpu_count']} cores), "
        f"torch threads per worker: {cfgs['threads']}.",
        "",
    ]
    if cfgs.get("baseline"):
        lines += [f"Baseline (`--baseline`): {cfgs['baseline']}.", ""]
    if not results["revlib"].get("available"):
        lines += [f"**revlib not measured**: {results['revlib'].get('reason')}", ""]
    for dev, reason in results["devices"].items():
        if reason:
            lines += [f"- device `{dev}` skipped: {reason}"]
    lines += ["", "## Verdicts", ""]
    for v in results["verdicts"]:
        mark = {"met": "met", "not met": "**NOT MET**"}.get(v["status"], v["status"])
        lines.append(f"- {v['where']}: {v['target']}: {mark} — {v['detail']}")
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in results["rows"]:
        groups.setdefault((row["device"], row["model"]), []).append(row)
    tpu = f"tpu_{cfgs['tpu']}"
    for (device, model), rows in groups.items():
        lines += ["", f"## {device} / {model}", "", describe_model(cfgs["models"][model]), ""]
        if device == "xla":
            lines += [
                f"Step time: XLA:CPU execution + tracing, median of {cfgs['xla_repeats']} (indicative only: "
                f"XLA:CPU is not a TPU). Memory: compiled peak of the whole step's program (arguments + outputs "
                f"+ temporaries), from a deviceless TPU {cfgs['tpu']} compile and from XLA:CPU; XLA:CPU expands "
                f"optimization barriers early and CSEs recomputation, so only the TPU column judges memory "
                f"policies. Dots = dot/convolution ops after optimization (recomputation shows up here).",
                "",
                f"| variant | step ms (median) | p25–p75 | vs revlib | vs no_savings | {cfgs['tpu']} peak MiB | "
                f"vs revlib | XLA:CPU peak MiB (temp) | dots {cfgs['tpu']} / CPU | grad err vs no_savings |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
        else:
            method = (
                "CUDA allocator: max_memory_allocated during the step minus allocated before it"
                if device == "cuda"
                else "storage tracker: peak live bytes of storages allocated during the step (activations, saved "
                "tensors, temporaries, gradients; parameters and input excluded)"
            )
            clock = (
                "CPU time of the single-threaded worker process (other load on a shared machine barely moves "
                "it; wall-clock medians in the last column)"
                if device == "cpu"
                else "wall-clock"
            )
            lines += [
                f"Step time: forward + loss + backward + zero grads, {clock}, median of {cfgs['repeats']} "
                f"interleaved repeats after {cfgs['warmup']} warm-up steps. Peak memory: {method}.",
                "",
                "| variant | step ms (median) | p25–p75 | vs revlib | vs no_savings | peak MiB | vs revlib | "
                "vs no_savings | grad err vs no_savings | wall ms (median) |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
        for row in rows:
            r = row.get("ratios", {})
            t = row.get("time")
            tm = f"{t['median_ms']:.1f}" if t else "—"
            iq = f"{t['p25_ms']:.1f}–{t['p75_ms']:.1f}" if t else "—"
            ge = row.get("grad_error", {}).get("max_rel_err")
            ge_s = "—" if ge is None else f"{ge:.1e}"
            wt = row.get("wall_time")
            wall_ms = f"{wt['median_ms']:.1f}" if wt else "—"
            name = row["variant"] + (" (failed: see JSON)" if row.get("error") else "")
            if device == "xla":
                c = row.get("compiled") or {}
                tp, cp = c.get(tpu, {}), c.get("xla_cpu", {})
                lines.append(
                    f"| {name} | {tm} | {iq} | {_fmt_ratio(r.get('time_vs_revlib'))} | "
                    f"{_fmt_ratio(r.get('time_vs_no_savings'))} | {_fmt_bytes(tp.get('peak_bytes'))} | "
                    f"{_fmt_ratio(r.get(tpu + '_memory_vs_revlib'))} | {_fmt_bytes(cp.get('peak_bytes'))} "
                    f"({_fmt_bytes(cp.get('temp_bytes'))}) | {tp.get('dots_optimized', '—')} / "
                    f"{cp.get('dots_optimized', '—')} | {ge_s} |"
                )
            else:
                lines.append(
                    f"| {name} | {tm} | {iq} | {_fmt_ratio(r.get('time_vs_revlib'))} | "
                    f"{_fmt_ratio(r.get('time_vs_no_savings'))} | {_fmt_bytes(row.get('peak_bytes'))} | "
                    f"{_fmt_ratio(r.get('memory_vs_revlib'))} | {_fmt_ratio(r.get('memory_vs_no_savings'))} | "
                    f"{ge_s} | {wall_ms} |"
                )
    lines += [
        "",
        "Variants: `no_savings` = revlib_xla `MemoryModes.no_savings` (plain autograd, the reference); "
        "`checkpoint` = the same model with `torch.utils.checkpoint(use_reentrant=False)` per reversible "
        "layer (XLA: `torch_xla.utils.checkpoint`); `revlib_xla` = revlib_xla's default reversible mode; "
        "`baseline` (with `--baseline DIR`) = the same mode from another checkout of revlib_xla; "
        "`revlib` = revlib 1.7.2 from PyPI, default `autograd_function`, in its own process. All variants run "
        "in separate worker processes with identical weights and input.",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, few repeats: a smoke run in seconds")
    parser.add_argument(
        "--device", default="auto", help="comma-separated cpu,xla,cuda or 'auto' (all available; --quick: cpu only)"
    )
    parser.add_argument("--out-dir", default=str(DEFAULT_OUT_DIR), help="where the .json/.md results go")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads in every worker (default 1)")
    parser.add_argument("--repeats", type=int, help="timed steps per variant (default 41; quick 3)")
    parser.add_argument("--warmup", type=int, help="untimed steps per variant first (default 3; quick 1)")
    parser.add_argument("--models", help="comma-separated subset of the configuration's models")
    parser.add_argument(
        "--revlib-dir",
        default=str(DEFAULT_REVLIB_DIR),
        help="throwaway --target directory holding revlib 1.7.2 (installed there if missing)",
    )
    parser.add_argument("--no-install", action="store_true", help="never install revlib; skip it if not cached")
    parser.add_argument("--no-revlib", action="store_true", help="skip the revlib rows")
    parser.add_argument(
        "--baseline",
        help="a checkout of revlib_xla (e.g. a git worktree of an earlier commit) measured as the 'baseline' variant",
    )
    parser.add_argument("--tpu", default="v5e", choices=("v5e", "v6e"), help="TPU generation for XLA memory")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--inprocess",
        action="store_true",
        help="run the revlib_xla variants in this process (revlib always gets its own process)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--compile", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if args.compile:
        return compile_main(args.compile)

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    start = time.time()
    import torch
    from tqdm import tqdm

    conf = dict(CONFIGS["quick" if args.quick else "full"])
    models = dict(conf["models"])
    if args.models:
        models = {m: models[m] for m in args.models.split(",")}
    warmup = args.warmup if args.warmup is not None else conf["warmup"]
    repeats = args.repeats if args.repeats is not None else conf["repeats"]
    devices = resolve_devices(args.device, args.quick)
    run_devices = [d for d, reason in devices.items() if reason is None]
    if args.no_revlib:
        revlib_info = {"available": False, "reason": "skipped (--no-revlib)"}
    else:
        revlib_info = ensure_revlib(Path(args.revlib_dir), install=not args.no_install)
    if revlib_info.get("available"):
        revlib_info["version"] = REVLIB_VERSION
    variants = [
        v
        for v in VARIANTS
        if (v != "revlib" or revlib_info.get("available")) and (v != "baseline" or args.baseline is not None)
    ]

    workdir = Path(tempfile.mkdtemp(prefix="revbench-"))
    files: dict[str, dict[str, str]] = {}
    for name, cfg in models.items():  # seeded weights and input, saved once, loaded by every worker
        blocks = build_blocks(cfg)
        torch.save([b.state_dict() for b in blocks], workdir / f"{name}.weights.pt")
        g = torch.Generator().manual_seed(1)
        torch.save(torch.randn(cfg["batch"], cfg["seq"], 2 * cfg["width"], generator=g), workdir / f"{name}.x.pt")
        files[name] = {"weights": str(workdir / f"{name}.weights.pt"), "input": str(workdir / f"{name}.x.pt")}

    plan = []
    for device in run_devices:
        names = [m for m in models if device != "xla" or m in conf["xla_models"]]
        w, r = (conf["xla_warmup"], conf["xla_repeats"]) if device == "xla" else (warmup, repeats)
        if device == "xla" and args.repeats is not None:
            r = args.repeats
        for name in names:
            plan.append((device, name, w, r))
    total = sum(len(variants) * (w + r + 2) for _, _, w, r in plan)
    results: dict[str, Any] = {
        "benchmark": "reversible_vs_peers",
        "device_name": device_name(run_devices),
        "devices": devices,
        "revlib": revlib_info,
        "rows": [],
        "config": {
            "quick": args.quick,
            "threads": args.threads,
            "warmup": warmup,
            "repeats": repeats,
            "xla_warmup": conf["xla_warmup"],
            "xla_repeats": (args.repeats or conf["xla_repeats"]),
            "models": models,
            "tpu": args.tpu,
            "variants": variants,
            "baseline": _describe_checkout(args.baseline) if args.baseline else None,
        },
    }
    compiled: dict[str, Any] = {}
    with tqdm(total=total, desc="benchmark", unit="step", disable=args.no_progress, file=sys.stderr) as bar:
        for device, name, w, r in plan:
            bar.set_postfix_str(f"{device}/{name}")
            group = run_group(device, name, models[name], variants, files[name], revlib_info, args, workdir, bar, w, r)
            rows = group["rows"]
            ref = rows.get("no_savings", {}).get("grads_file")
            ref_grads = torch.load(ref)["grads"] if ref else None
            for row in rows.values():
                gf = row.pop("grads_file", None)
                if gf and ref_grads is not None:
                    data = torch.load(gf)
                    row["grad_error"] = grad_error(data["grads"], ref_grads)
                    row["loss"] = data["loss"]
                    if data["missing"]:
                        row["grad_error"]["params_without_grad"] = data["missing"]
            if group["hlo_files"]:
                bar.set_postfix_str(f"{device}/{name}: compiling for memory")
                comp = run_compile({f"{name}/{v}": p for v, p in group["hlo_files"].items()}, args)
                compiled[f"{device}/{name}"] = {k: v for k, v in comp.items() if k != "results"}
                for v, row in rows.items():
                    if f"{name}/{v}" in comp.get("results", {}):
                        row["compiled"] = comp["results"][f"{name}/{v}"]
                    elif comp.get("error"):
                        row["compiled_error"] = comp["error"]
            results["rows"].extend(rows.values())
    results["compile"] = compiled

    import importlib.metadata as md

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    results["meta"] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "wall_s": round(time.time() - start, 1),
        "torch": torch.__version__,
        "torch_xla": version("torch_xla"),
        "jax": version("jax"),
        "libtpu": version("libtpu"),
        "revlib_xla": _revlib_xla_version(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "load_avg_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    add_ratios_and_verdicts(results)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"reversible_vs_peers-{results['device_name']}" + ("-quick" if args.quick else "")
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
    write_markdown(results, out_dir / f"{stem}.md")
    shutil.rmtree(workdir, ignore_errors=True)
    print((out_dir / f"{stem}.md").read_text())
    print(f"wrote {out_dir / stem}.json and .md in {results['meta']['wall_s']:.0f} s")
    return 0


def _revlib_xla_version() -> str:
    text = (ROOT / "revlib_xla" / "__init__.py").read_text()
    m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", text)
    return m.group(1) if m else "unknown"


if __name__ == "__main__":
    sys.exit(main())
