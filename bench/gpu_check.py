#!/usr/bin/env python
"""One prepared command that checks revlib_xla on a CUDA GPU at real size and records what it finds.

``make gpu-check`` (on the GPU machine, no package index) runs four parts, each in its own process under its own
time limit, each writing its results as they come to ``<out-dir>/gpu_check-<part>-cuda-<device>.md`` (with a
``.jsonl`` of the raw records), headed by the device, driver, torch and CUDA versions:

* ``tests``: the CUDA test cases (``pytest -k "cuda or test_kernels"``: every case of the device fixture on cuda,
  the tests named for CUDA, the kernel tests and the README sections whose code runs on CUDA);
* ``train``: ``revlib-xla train`` at llama-1b (full size), 8 x 2048 tokens, bf16 autocast, per strategy (none,
  checkpoint, reversible, plan, plan + fewbit, offload.optimizer), 6 steps: tokens/s, MFU, each step's peak and
  reserved bytes, what stays allocated between steps, and ``revlib-xla memory``'s GPU estimate beside the peak;
* ``hf``: ``revlib_xla.hf.memory_efficient`` on Llama-3.2-1B's shape (bf16, sdpa, 8 x 2048) against the plain
  model, transformers' checkpointing (and its ``offload=True`` where transformers offers it): peak, step time and
  gradients against the plain model's, beside the plain-vs-plain difference (the noise floor);
* ``peers``: the few-bit Triton kernels against their reference (bit for bit, and their time), and
  ``bench/reversible_vs_peers.py --device cuda`` against RevLib 1.7.2.

A part that fails or runs out of time is recorded as such and the next one runs. ``--pack DIR`` (the device tool's
``$OUT``) receives, after every part, the markdown files and one ``.tar.gz`` of every result and log.
``--wheels DIR`` first installs what the GPU image lacks (pydantic and its dependencies into ``.gpu-site/``, RevLib
into ``.cache/bench/revlib-1.7.2``) from that folder only (``make gpu-wheels`` fills it on a machine with an index).

``--dry``: the same command on the CPU at toy sizes (a tiny model, 2 steps, a few tests), so that it cannot rot
between GPUs; CI runs it (tests/project/test_gpu_check.py). See bench/README.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import io
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
REVLIB_VERSION = "1.7.2"
REVLIB_DIR = ROOT / ".cache" / "bench" / f"revlib-{REVLIB_VERSION}"
GiB = 2**30


# =================================================================================================================
# Sizes: the full run (a GPU, ~9 minutes) and the dry run (the CPU, toy sizes, plumbing only)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one mode runs: time limits per part (seconds) and the sizes of each part."""

    limits: dict[str, int]
    device: str
    pytest_paths: tuple[str, ...]
    pytest_extra: tuple[str, ...]
    test_timeout: int
    train_overrides: tuple[str, ...]
    train_steps: int
    hf_config: str
    hf_batch: tuple[int, int]
    hf_steps: int  # the first is a warm-up; the others are timed
    kernel_sizes: tuple[int, ...]
    kernel_time_size: int
    peers_args: tuple[str, ...]


FULL = Sizes(
    limits={"tests": 180, "train": 190, "hf": 90, "peers": 80},
    device="cuda",
    pytest_paths=("tests",),
    pytest_extra=(),
    test_timeout=120,
    train_overrides=("model.name=llama-1b", "model.overrides={}", "data.seq_len=2048", "data.batch_size=8"),
    train_steps=6,
    hf_config="llama-3.2-1b",
    hf_batch=(8, 2048),
    hf_steps=3,
    kernel_sizes=(4099,),
    kernel_time_size=8 * 2048 * 8192,  # llama-1b's MLP activation at 8 x 2048 tokens
    peers_args=("--device", "cuda", "--warmup", "2", "--repeats", "11", "--models", "transformer,mlp512"),
)
DRY = Sizes(
    limits={"tests": 90, "train": 90, "hf": 90, "peers": 90},
    device="cpu",
    pytest_paths=("tests/fewbit/test_kernels.py", "tests/project/test_readme.py"),
    pytest_extra=("-m", "not slow"),
    test_timeout=60,
    # the test suite's tiny Llama (tests/train/test_train_loop.py)
    train_overrides=(
        "model.overrides={vocab_size: 256, dim: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, ffn_dim: 64}",
        "data.seq_len=16",
        "data.batch_size=2",
    ),
    train_steps=2,
    hf_config="llama-tiny",
    hf_batch=(2, 32),
    hf_steps=2,
    kernel_sizes=(13,),
    kernel_time_size=4099,
    peers_args=("--quick", "--device", "cpu", "--repeats", "1", "--warmup", "0", "--inprocess"),
)
PART_ORDER = ("tests", "train", "hf", "peers")
TOTAL_BUDGET_S = 560  # the whole run, on top of installing the wheels; the device tool allows 600 s per command

# ``revlib-xla train`` strategies: name -> the config overrides that select it
TRAIN_STRATEGIES: dict[str, tuple[str, ...]] = {
    "none": ("strategy.activations=none",),
    "checkpoint": ("strategy.activations=checkpoint",),
    "reversible": ("strategy.activations=reversible",),
    "plan": ("strategy.activations=plan",),
    "plan+fewbit": ("strategy.activations=plan", "strategy.fewbit=2"),
    "offload.optimizer": ("strategy.activations=none", "strategy.offload.optimizer=true"),
}
TRAIN_STRATEGY_LIMIT_S = {"full": 60, "dry": 15}


def sizes(dry: bool) -> Sizes:
    return DRY if dry else FULL


# =================================================================================================================
# Recording: the environment header, markdown written as results come, the packed results


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def probe_environment() -> dict[str, Any]:
    """The device and software this run measures (run in a child process: the orchestrator never starts CUDA)."""
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpu_cores": os.cpu_count(),
        "cpu": _cpu_model(),
        "cuda_available": torch.cuda.is_available(),
    }
    for package in ("triton", "transformers", "jax", "pydantic", "revlib"):
        info[package] = _version(package)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=props.name, device_memory=props.total_memory, device_count=torch.cuda.device_count())
        with contextlib.suppress(Exception):
            version = int(torch._C._cuda_getDriverVersion())
            info["driver_cuda"] = f"{version // 1000}.{version % 1000 // 10}"
    smi = shutil.which("nvidia-smi")
    if smi:
        with contextlib.suppress(Exception):
            done = subprocess.run(
                [smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
            )
            info["driver"] = done.stdout.strip().splitlines()[0]
    return info


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _commit() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if done.returncode != 0:
        return "unknown (no git checkout here)"
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True)
    return done.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def device_tag(env: dict[str, Any], dry: bool) -> str:
    """``cuda-h200`` (the device's name without its vendor), or ``cpu-dry``."""
    if dry or not env.get("device_name"):
        return "cpu-dry" if dry else "cpu"
    name = re.sub(r"^nvidia\s+", "", env["device_name"].lower())
    return "cuda-" + (re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu")


def header_lines(env: dict[str, Any], dry: bool) -> list[str]:
    if env.get("device_name"):
        device = (
            f"{env['device_name']} ({env['device_memory'] / GiB:.1f} GiB, {env.get('device_count', 1)} visible); "
            f"driver {env.get('driver', 'unknown')} (CUDA {env.get('driver_cuda', '?')})"
        )
    else:
        device = f"no CUDA device: {env.get('cpu', 'cpu')}"
    return [
        f"- Device: {device}; {env.get('cpu_cores')} CPU cores ({env.get('cpu', '?')})",
        f"- Software: torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), triton {env.get('triton')}, "
        f"transformers {env.get('transformers')}, jax {env.get('jax')}, pydantic {env.get('pydantic')}, "
        f"Python {env.get('python')}",
        f"- revlib_xla: commit {env.get('commit', '?')}; run {env.get('date', '?')}",
        "- Mode: "
        + (
            "DRY (`--dry`: toy sizes on the CPU; it checks that the command works, it measures nothing)"
            if dry
            else "full (`make gpu-check`)"
        ),
    ]


class Report:
    """A markdown file written as results come: its header first, then each line appended and flushed."""

    def __init__(self, path: Path, title: str, env: dict[str, Any], dry: bool, intro: str = "") -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join([f"# {title}", "", *header_lines(env, dry), "", *([intro, ""] if intro else [])]))

    def line(self, text: str = "") -> None:
        with self.path.open("a") as f:
            f.write(text + "\n")

    def table(self, columns: list[str]) -> Callable[[list[Any]], None]:
        """Writes the header row of a table; returns the function that appends one row."""
        self.line("| " + " | ".join(columns) + " |")
        self.line("|" + "---|" * len(columns))
        return lambda cells: self.line("| " + " | ".join(_cell(c) for c in cells) + " |")


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    return str(value).replace("|", "\\|").replace("\n", " ")


class Records:
    """A JSON-lines file of raw results beside a part's markdown, appended as they come."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")

    def add(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def gb(value: float | None, digits: int = 2) -> str | None:
    return None if value is None else f"{value / 1e9:.{digits}f}"


def last_line(text: str, limit: int = 300) -> str:
    """The last non-empty line of a log or of an error output (the exception, or the CLI's error line), shortened."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return one_line(lines[-1] if lines else "", limit)


def one_line(text: str, limit: int = 300) -> str:
    """``text`` (an exception's message) on one line, shortened."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def pack(out_dir: Path, work_dir: Path, tag: str, since: float, dest: Path) -> None:
    """Copy the summary and part markdown files to ``dest`` and write there one ``.tar.gz`` of every result this run
    wrote (``bench/results/...``) and of its logs (the device tool returns at most 8 files)."""
    dest.mkdir(parents=True, exist_ok=True)
    results = sorted(p for p in out_dir.iterdir() if p.is_file() and p.stat().st_mtime >= since)
    for path in results:
        if path.suffix == ".md" and path.name.startswith("gpu_check-"):
            shutil.copyfile(path, dest / path.name)
    tmp = dest / f".gpu_check-{tag}.tar.gz.partial"
    with tarfile.open(tmp, "w:gz") as tar:
        for path in results:
            tar.add(path, arcname=f"bench/results/{path.name}")
        for log in sorted((work_dir / "logs").glob("*.log")):
            data = log.read_bytes()[-400_000:]  # the end of a long log
            info = tarfile.TarInfo(f"logs/{log.name}")
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(dest / f"gpu_check-{tag}.tar.gz")


# =================================================================================================================
# Running things under a time limit


def run_limited(
    cmd: list[str], limit: float, log_path: Path, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> tuple[int | None, float]:
    """Run ``cmd`` in a process group of its own with stdout and stderr appended to ``log_path``; the group is
    stopped (SIGTERM, then SIGKILL) at ``limit`` seconds. Returns (exit status or None when stopped, seconds)."""
    start = time.perf_counter()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"\n$ {' '.join(cmd)}  (limit {limit:.0f} s)\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
        try:
            return proc.wait(timeout=max(1.0, limit)), time.perf_counter() - start
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            return None, time.perf_counter() - start


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every child: the installed wheels' folder and this checkout first on the path, JAX without
    its default grab of 75 % of the GPU, torch_xla (where installed) on the CPU."""
    env = dict(os.environ)
    site = env.get("GPU_CHECK_SITE")  # set by --wheels (install_wheels), inherited by every child
    paths = ([site] if site else []) + [str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env.setdefault("PJRT_DEVICE", "CPU")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def install_wheels(wheels: Path, log: Path) -> list[str]:
    """Install what the GPU image lacks from ``wheels`` only (no index): pydantic and its dependencies into
    ``.gpu-site`` (first on every child's path from here on), RevLib into the folder bench/reversible_vs_peers.py
    reads. Without pip, the wheels are unpacked there instead (a wheel is a zip of what it installs)."""
    import importlib.util
    import zipfile

    wheels = wheels.resolve()
    found = sorted(wheels.glob("*.whl"))
    if not found:
        return [f"no wheels in {wheels} (make gpu-wheels on a machine with a package index fills it)"]
    site = ROOT / ".gpu-site"
    os.environ["GPU_CHECK_SITE"] = str(site)
    notes = []
    if importlib.util.find_spec("pip") is None:
        for wheel in found:
            target = REVLIB_DIR if wheel.name.startswith("revlib-") else site
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
        return [f"pip is not installed: unpacked {', '.join(w.name for w in found)}"]
    steps = [
        ("pydantic", ["--target", str(site), "--upgrade", "pydantic"]),
        ("revlib", ["--no-deps", "--target", str(REVLIB_DIR), "--upgrade", f"revlib=={REVLIB_VERSION}"]),
    ]
    for name, args in steps:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels), *args]
        status, seconds = run_limited(cmd, 120, log)
        result = "installed" if status == 0 else f"FAILED (exit {status}; logs/install.log)"
        notes.append(f"{name} from {wheels.name}/: {result} ({seconds:.0f} s)")
    return notes


# =================================================================================================================
# Part context


@dataclasses.dataclass
class Part:
    name: str
    dry: bool
    out_dir: Path
    work_dir: Path
    tag: str
    env: dict[str, Any]
    deadline: float  # time.time() by which the part must have written its results

    @property
    def sizes(self) -> Sizes:
        return sizes(self.dry)

    def report(self, title: str, intro: str = "") -> Report:
        return Report(self.out_dir / f"gpu_check-{self.name}-{self.tag}.md", title, self.env, self.dry, intro)

    def records(self) -> Records:
        return Records(self.out_dir / f"gpu_check-{self.name}-{self.tag}.jsonl")

    def left(self) -> float:
        return self.deadline - time.time()

    def log(self, name: str) -> Path:
        return self.work_dir / "logs" / f"{self.name}-{name}.log"


# =================================================================================================================
# Part a: the CUDA test cases


def part_tests(part: Part) -> None:
    s = part.sizes
    report = part.report(
        "CUDA test cases, kernel tests and README sections that run CUDA",
        '`pytest -k "cuda or test_kernels"`: every test case of the `device` fixture on cuda, the tests named for '
        "CUDA, tests/fewbit/test_kernels.py, and the README sections whose code runs on CUDA (their ids end in "
        f"`(cuda)`); per-test limit {s.test_timeout} s.",
    )
    outcomes = part.work_dir / "tests.jsonl"
    outcomes.unlink(missing_ok=True)
    workers = [] if part.dry else ["-n", str(max(1, min(14, (os.cpu_count() or 2) - 2)))]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        "gpu_check_pytest",
        "-q",
        "-rfE",
        "--timeout",
        str(s.test_timeout),
        *workers,
        "-k",
        "cuda or test_kernels",
        *s.pytest_extra,
        *s.pytest_paths,
    ]
    env = child_env(
        {
            "GPU_CHECK_PYTEST_LOG": str(outcomes),
            "PYTHONPATH": os.pathsep.join([child_env()["PYTHONPATH"], str(ROOT / "bench")]),  # the plugin, last
            # one thread per worker: 14 workers each starting torch's 16 threads would share 16 cores (a likely
            # reason why the first GPU's not-slow suite was a third done in 140 s)
            "OMP_NUM_THREADS": "1",
        }
    )
    report.line(f"Command: `{' '.join(cmd[1:])}` (OMP_NUM_THREADS=1)")
    report.line()
    status, seconds = run_limited(cmd, max(5.0, part.left() - 8), part.log("pytest"), env)
    lines = [json.loads(line) for line in outcomes.read_text().splitlines()] if outcomes.exists() else []
    results = [r for r in lines if "nodeid" in r]
    total = next((r["selected"] for r in lines if "selected" in r), None)
    counts: dict[str, int] = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    finished = "stopped at its time limit" if status is None else f"exit status {status}"
    report.line(
        f"**{', '.join(f'{n} {k}' for k, n in sorted(counts.items())) or 'no test finished'}** of "
        f"{total if total is not None else '?'} selected, in {seconds:.0f} s ({finished})."
    )
    report.line()
    bad = [r for r in results if r["outcome"] in ("failed", "error")]
    if bad:
        report.line("## Failures")
        report.line()
        row = report.table(["test", "s", "error"])
        for r in bad:
            row([f"`{r['nodeid']}`", r["seconds"], one_line(r.get("message", ""), 400)])
        report.line()
    if status is None:
        done = {r["nodeid"] for r in results}
        report.line(f"Not finished when stopped: {total - len(done) if total else '?'} tests.")
        report.line()
    skips: dict[str, int] = {}
    for r in results:
        if r["outcome"] == "skipped":
            reason = one_line(r.get("message", ""), 200)
            skips[reason] = skips.get(reason, 0) + 1
    if skips:
        report.line("## Skipped, by reason")
        report.line()
        row = report.table(["tests", "reason"])
        for reason, n in sorted(skips.items(), key=lambda kv: -kv[1]):
            row([n, reason])
        report.line()
    ran = sorted((r for r in results if r["outcome"] != "skipped"), key=lambda r: -r["seconds"])[:20]
    if ran:
        report.line("## Slowest")
        report.line()
        row = report.table(["s", "test", "outcome"])
        for r in ran:
            row([f"{r['seconds']:.1f}", f"`{r['nodeid']}`", r["outcome"]])
    if outcomes.exists():
        shutil.copyfile(outcomes, part.out_dir / f"gpu_check-tests-{part.tag}.jsonl")
    if status is None or bad:
        raise PartFailed(f"{len(bad)} failed; " + finished)


class PartFailed(Exception):
    """A part ran and recorded its results, and what it found is a failure (the run goes on)."""


# =================================================================================================================
# Part b: revlib-xla train at llama-1b


def gpu_chip(env: dict[str, Any]) -> str:
    """The ``chip.name`` of the GPU here (its memory for ``plan`` auto's budget and its peak for MFU)."""
    name = str(env.get("device_name", "")).lower()
    for key, chip in (("h200", "h200"), ("h100", "h100"), ("l4", "l4"), ("t4", "t4")):
        if key in name:
            return chip
    if "a100" in name:
        return "a100-80gb" if env.get("device_memory", 0) > 50 * GiB else "a100-40gb"
    return "h100"


def train_chip(env: dict[str, Any], dry: bool) -> str:
    """``chip.name`` of the train part's runs: the GPU here, or cpu-smoke's v5e in the dry run."""
    return "v5e" if dry else gpu_chip(env)


def train_overrides(part_sizes: Sizes, strategy: str, chip: str, out_dir: Path, device: str) -> list[str]:
    return [
        *part_sizes.train_overrides,
        *TRAIN_STRATEGIES[strategy],
        "strategy.precision=bf16",
        f"train.steps={part_sizes.train_steps}",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        "train.log_every=1",
        "train.progress=false",
        "train.resume=false",
        f"train.device={device}",
        f"train.out_dir={out_dir}",
        f"chip.name={chip}",
    ]


def part_train(part: Part) -> None:
    s = part.sizes
    chip = train_chip(part.env, part.dry)
    records = part.records()
    intro = (
        f"`python -m revlib_xla.cli train --config tpu_configs/cpu-smoke.yaml "
        f"{' '.join(train_overrides(s, 'none', chip, Path('<dir>'), s.device))}` per strategy, "
        + ("all in one process (the dry run)" if part.dry else "each in its own process")
        + f" (limit {TRAIN_STRATEGY_LIMIT_S['dry' if part.dry else 'full']} s each). Per step: the peak "
        "(`max_memory_allocated` from a reset before the step), the most reserved (`max_memory_reserved`) and "
        "what stays allocated after the step; tokens/s and MFU from the run's metrics.jsonl (median of the steps "
        f"after the first; MFU against chip.name={chip}). The final checkpoint is not written (at llama-1b it is "
        "~15 GB of disk and is not what is measured). `plan` auto's budget: chip.name's memory less the weights, "
        "gradients and optimizer state. GPU estimate: `revlib-xla memory --gpu`'s eager FakeTensor estimate of "
        "the same config, computed on the CPU from the start of the run."
    )
    report = part.report("revlib-xla train at real size, per strategy", intro)
    estimates_path = part.work_dir / "estimates.jsonl"  # written by the estimator the orchestrator started first
    row = report.table(
        [
            "strategy",
            "tokens/s",
            "s/step",
            "MFU",
            "peak per step (GB)",
            "max reserved (GB)",
            "allocated between steps (GB)",
            "loss first → last",
            "status",
        ]
    )
    measured: dict[str, dict[str, Any]] = {}
    strategy_limit = TRAIN_STRATEGY_LIMIT_S["dry" if part.dry else "full"]
    groups = [list(TRAIN_STRATEGIES)] if part.dry else [[name] for name in TRAIN_STRATEGIES]
    for group in groups:
        left = part.left() - 10
        if left < 10:
            for strategy in group:
                row([strategy, *[None] * 7, "not run: the part's time was spent"])
            continue
        for result in run_train(part, group, chip, min(strategy_limit * len(group), left)):
            records.add(result)
            measured[result["strategy"]] = result
            steps = result["steps"]
            later = steps[1:] or steps
            row(
                [
                    result["strategy"],
                    _median(later, "tokens_per_s", "{:,.0f}"),
                    _median(later, "step_time_s", "{:.3f}"),
                    _median(later, "mfu", "{:.1%}"),
                    " ".join(gb(st.get("peak_allocated"), 1) or "—" for st in steps) or None,
                    gb(max((st.get("peak_reserved") or 0) for st in steps), 1) if steps else None,
                    gb(steps[-1].get("allocated_after"), 2) if steps else None,
                    f"{steps[0]['loss']:.3f} → {steps[-1]['loss']:.3f}"
                    if steps and "loss" in steps[0] and "loss" in steps[-1]
                    else None,
                    result["status"],
                ]
            )
    # the estimates have run on the CPU since the run began; the last ones get 20 s more at most
    wait_until = time.time() + min(20.0, max(0.0, part.left() - 3))
    while time.time() < wait_until and _lines(estimates_path) < len(TRAIN_STRATEGIES):
        time.sleep(1)
    estimates = {}
    for line in estimates_path.read_text().splitlines() if estimates_path.exists() else []:
        e = json.loads(line)
        estimates[e["strategy"]] = e
        records.add({"kind": "estimate", **e})
    report.line()
    report.line("## Measured peak beside the GPU estimate")
    report.line()
    row = report.table(["strategy", "measured peak (GB)", "GPU estimate (GB)", "estimate / measured", "estimate"])
    for strategy in TRAIN_STRATEGIES:
        steps = measured.get(strategy, {}).get("steps", [])
        peak = max((st.get("peak_allocated") or 0) for st in steps) if steps else None
        e = estimates.get(strategy)
        total = e.get("total") if e else None
        ratio = f"{total / peak:.2f}" if total and peak else None
        text = (
            "not computed in the part's time"
            if e is None
            else f"failed: {e['error']}"
            if "error" in e
            else f"{e['detail']} ({e['seconds']:.0f} s)"
        )
        row([strategy, gb(peak, 3) if peak else None, gb(total, 3), ratio, text])
    failed = [k for k, v in measured.items() if v["status"] != "ok"]
    if failed and all(v["status"] != "ok" for v in measured.values()):
        raise PartFailed("no strategy trained: " + ", ".join(failed))


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _median(steps: list[dict[str, Any]], key: str, fmt: str) -> str | None:
    values = [st[key] for st in steps if st.get(key) is not None]
    return fmt.format(statistics.median(values)) if values else None


def run_train(part: Part, strategies: list[str], chip: str, limit: float) -> list[dict[str, Any]]:
    """``revlib-xla train`` for each of ``strategies``, one after another in one child process (the full run gives
    each strategy a process of its own; the dry run saves the start-ups); their per-step memory and metrics, or why
    each failed."""
    runs = []
    for strategy in strategies:
        run_dir = part.work_dir / "train" / strategy.replace("+", "-")
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        overrides = train_overrides(part.sizes, strategy, chip, run_dir, part.sizes.device)
        runs.append({"strategy": strategy, "dir": str(run_dir), "overrides": overrides})
    spec = part.work_dir / "train" / f"{strategies[0].replace('+', '-')}.spec.json"
    spec.write_text(json.dumps(runs))
    log = part.log("train-" + (strategies[0].replace("+", "-") if len(strategies) == 1 else "all"))
    status, _ = run_limited([sys.executable, str(SCRIPT), "--train-one", str(spec)], limit, log, child_env())
    results = []
    for run in runs:
        run_dir = Path(run["dir"])
        lines = (run_dir / "steps.jsonl").read_text().splitlines() if (run_dir / "steps.jsonl").exists() else []
        records = [json.loads(line) for line in lines]
        steps = [r for r in records if "step" in r]
        end = next((r for r in records if "end" in r), None)
        by_step = {}
        if (run_dir / "metrics.jsonl").exists():
            for line in (run_dir / "metrics.jsonl").read_text().splitlines():
                m = json.loads(line)
                if m.get("kind") == "train":
                    by_step[m["step"]] = m
        for st in steps:
            m = by_step.get(st["step"], {})
            st.update({k: m[k] for k in ("tokens_per_s", "step_time_s", "mfu", "loss") if k in m})
        if end is not None and end["end"] == 0:
            verdict = "ok"
        elif end is not None:
            verdict = f"failed after {len(steps)} steps: {end.get('error') or 'exit ' + str(end['end'])}"
        elif status is None:
            verdict = f"stopped at the limit of {limit:.0f} s after {len(steps)} steps"
        else:
            verdict = f"failed (exit {status}) after {len(steps)} steps: {_error_of(log.read_text(errors='replace'))}"
        took = end.get("seconds") if end else None
        results.append(
            {"kind": "train", "strategy": run["strategy"], "status": verdict, "seconds": took, "steps": steps}
        )
    return results


def _error_of(log_tail: str) -> str:
    """The error a failed child printed: the CLI's one-line message, or a traceback's last line."""
    lines = [line for line in log_tail.splitlines() if line.strip()]
    for line in reversed(lines):
        if "error:" in line or re.match(r"^\w+(\.\w+)*(Error|Exception|Refused)\b", line.strip()):
            return last_line(line, 400)
    return last_line(lines[-1] if lines else "no output", 400)


def train_one(spec_path: str) -> int:
    """``--train-one SPEC``: ``revlib-xla train`` in this process for each run of the spec (a JSON list of
    ``{"strategy", "dir", "overrides"}``), each step's allocator peak recorded in ``<dir>/steps.jsonl`` (the step
    function the loop builds is wrapped) and the final checkpoint left unwritten; the run's end (its exit status
    and the CLI's error line) closes that file."""
    import torch

    import revlib_xla.train.loop as loop
    from revlib_xla.cli import main

    build_step = loop.make_step
    current: dict[str, Any] = {}

    def make_step(cfg: Any, model: Any, optimizer: Any, report: Any = None) -> Callable[[Any], Any]:
        step_fn = build_step(cfg, model, optimizer, report)
        cuda, steps_path, count = cfg.train.device == "cuda", current["steps"], 0

        def measured(batch: Any) -> Any:
            nonlocal count
            count += 1
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            loss = step_fn(batch)
            record: dict[str, Any] = {"step": count}
            if cuda:
                torch.cuda.synchronize()
                record.update(
                    peak_allocated=torch.cuda.max_memory_allocated(),
                    peak_reserved=torch.cuda.max_memory_reserved(),
                    allocated_after=torch.cuda.memory_allocated(),
                )
            record["measured_s"] = round(time.perf_counter() - start, 4)
            with open(steps_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            return loss

        return measured

    loop.make_step = make_step
    loop.save_checkpoint = lambda *args, **kwargs: None
    for run in json.loads(Path(spec_path).read_text()):
        current["steps"] = steps_path = Path(run["dir"]) / "steps.jsonl"
        start = time.perf_counter()
        captured = io.StringIO()
        error = None
        print(f"gpu_check: train {run['strategy']}", flush=True)
        try:
            with contextlib.redirect_stderr(captured):
                status = main(["train", "--config", str(ROOT / "tpu_configs" / "cpu-smoke.yaml"), *run["overrides"]])
            if status:
                error = last_line(captured.getvalue(), 400)
        except Exception as exc:
            traceback.print_exc(file=captured)
            status, error = 1, one_line(f"{type(exc).__name__}: {exc}", 400)
        finally:
            sys.stderr.write(captured.getvalue())
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        with open(steps_path, "a") as f:
            f.write(
                json.dumps({"end": status, "error": error, "seconds": round(time.perf_counter() - start, 1)}) + "\n"
            )
    return 0


def estimates(path: str, chip: str, dry: bool) -> int:
    """``--estimates``: ``revlib-xla memory --gpu``'s estimate (:func:`revlib_xla.fit.gpu.estimate_step`) of each
    strategy's config, one JSON line each, in the background of the train part."""
    import warnings

    import torch

    from revlib_xla.fit import chips
    from revlib_xla.fit.gpu import estimate_step, for_gpu
    from revlib_xla.train.config import load_config

    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")
    s = sizes(dry)
    for strategy in TRAIN_STRATEGIES:
        start = time.perf_counter()
        record: dict[str, Any] = {"strategy": strategy}
        try:
            cfg = load_config(
                str(ROOT / "tpu_configs" / "cpu-smoke.yaml"), train_overrides(s, strategy, chip, Path("unused"), "cpu")
            )
            # the GPU here; the dry run's config names a TPU (cpu-smoke's v5e): sized for an H100 then
            gpu = chips.chip(cfg.chip.name if cfg.chip.name in chips.GPU_CHIPS else "h100", "gpu")
            step = estimate_step(for_gpu(cfg, gpu))
            record.update(
                total=int(step.peak),
                detail=f"parameters {step.parameters:,} B, optimizer state {step.optimizer:,} B (on the device)",
            )
        except Exception as exc:
            record["error"] = one_line(f"{type(exc).__name__}: {exc}", 300)
        record["seconds"] = round(time.perf_counter() - start, 1)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


# =================================================================================================================
# Part c: revlib_xla.hf at Llama-3.2-1B's shape


def part_hf(part: Part) -> None:
    import torch
    import transformers

    from revlib_xla.hf import memory_efficient, model_from_config

    s = part.sizes
    device = torch.device(s.device)
    cuda = device.type == "cuda"
    batch, seq = s.hf_batch
    report = part.report(
        "revlib_xla.hf against transformers at Llama-3.2-1B's shape",
        f"`model_from_config({s.hf_config!r}, dtype=torch.bfloat16, attn_implementation='sdpa')` (random weights, "
        f"the same seed for every variant), {batch} x {seq} tokens, labels = inputs; one step = forward with the "
        f"loss + backward, no optimizer. {s.hf_steps} steps per variant: the first warms up, the time is the median "
        "of the others; peak = the most `max_memory_allocated` of a step (weights included); gradients: the largest "
        "max|g - g_plain| / max|g_plain| over the parameters, against the first plain model's; `plain (again)` is "
        f"the same model built and run again: the noise floor. transformers {transformers.__version__}.",
    )
    records = part.records()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256 if part.dry else 128256, (batch, seq), generator=gen).to(device)

    def build() -> Any:
        torch.manual_seed(0)
        model = model_from_config(s.hf_config, device=device, dtype=torch.bfloat16, attn_implementation="sdpa")
        model.config.use_cache = False
        return model.train()

    def hf_checkpointing(model: Any, offload: bool = False) -> None:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        kwargs: dict[str, Any] = {}
        if offload:
            kwargs["offload"] = True
        key = (
            "activation_checkpointing_kwargs"
            if enable.__name__.startswith("activation")
            else "gradient_checkpointing_kwargs"
        )
        enable(**{key: {"use_reentrant": False}}, **kwargs)

    def offers_offload() -> bool:
        import inspect

        for name in (
            "activation_checkpointing_enable",
            "_activation_checkpointing_enable",
            "gradient_checkpointing_enable",
        ):
            fn = getattr(transformers.PreTrainedModel, name, None)
            if fn is not None and "offload" in inspect.signature(fn).parameters:
                return True
        return False

    reference: dict[str, torch.Tensor] = {}
    checksum: list[float] = []
    hf_peak: dict[str, int] = {}
    weight_bytes: list[int] = []
    row = report.table(
        ["variant", "peak (GB)", "max reserved (GB)", "step s", "grads vs plain (max rel.)", "loss", "status"]
    )

    def measure(name: str, convert: Callable[[Any], Any] | None) -> None:
        if part.left() < 10:
            row([name, *[None] * 5, "not run: the part's time was spent"])
            return
        record: dict[str, Any] = {"variant": name}
        model = None
        try:
            model = build()
            sample = float(next(model.parameters()).float().sum())
            if checksum and sample != checksum[0]:
                raise RuntimeError(
                    f"the rebuilt model's weights differ from the first build ({sample} != {checksum[0]})"
                )
            checksum.append(sample)
            weight_bytes.append(sum(p.numel() * p.element_size() for p in model.parameters()))
            if convert is not None:
                convert(model)
            peaks, reserved, times, losses = [], [], [], []
            for _ in range(s.hf_steps):
                model.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                if cuda:
                    torch.cuda.synchronize()
                    peaks.append(torch.cuda.max_memory_allocated())
                    reserved.append(torch.cuda.max_memory_reserved())
                times.append(time.perf_counter() - start)
                losses.append(float(loss))
            grads = {
                k: p.grad for k, p in model.state_dict(keep_vars=True).items() if getattr(p, "grad", None) is not None
            }
            if not reference:
                reference.update({k: g.detach().to("cpu", copy=True) for k, g in grads.items()})
                worst = None
            else:
                missing = sorted(set(reference) - set(grads))
                if missing:
                    raise RuntimeError(f"no gradient for {len(missing)} parameters, e.g. {missing[:3]}")
                errors = {k: _rel_err(grads[k], reference[k]) for k in reference}
                key = max(errors, key=lambda k: errors[k])
                worst = (errors[key], key)
            record.update(
                peaks=peaks,
                reserved=reserved,
                seconds=times,
                losses=losses,
                grad_err=worst and list(worst),
                status="ok",
            )
            if name.startswith("transformers checkpointing") and peaks:
                hf_peak[name] = max(peaks)
            row(
                [
                    name,
                    gb(max(peaks)) if peaks else None,
                    gb(max(reserved)) if reserved else None,
                    f"{statistics.median(times[1:] or times):.3f}",
                    f"{worst[0]:.1e} ({worst[1]})" if worst else "the reference",
                    f"{losses[-1]:.4f}",
                    "ok",
                ]
            )
        except Exception as exc:
            record.update(status="failed", error=traceback.format_exc()[-3000:])
            row([name, *[None] * 5, f"failed: {one_line(f'{type(exc).__name__}: {exc}', 400)}"])
        finally:
            records.add(record)
            del model
            if cuda:
                torch.cuda.empty_cache()

    measure("plain", None)
    measure("plain (again)", None)
    measure("transformers checkpointing", hf_checkpointing)
    if offers_offload():
        measure("transformers checkpointing, offload=True", lambda m: hf_checkpointing(m, offload=True))
    else:
        row(
            [
                "transformers checkpointing, offload=True",
                *[None] * 5,
                f"not offered by transformers {transformers.__version__}",
            ]
        )
    measure("memory_efficient(m, 'plan')", lambda m: memory_efficient(m, "plan"))
    if cuda and "transformers checkpointing" in hf_peak and weight_bytes:
        budget = hf_peak["transformers checkpointing"] - 2 * weight_bytes[0]  # less the weights and their gradients
        measure(
            f"memory_efficient(m, 'plan', budget={budget / 1e9:.2f}e9)",
            lambda m: memory_efficient(m, "plan", budget=budget),
        )
    measure("memory_efficient(m, 'reversible')", lambda m: memory_efficient(m, "reversible"))
    report.line()
    report.line(
        "The plan budget of the second plan row is transformers' checkpointing peak less the weights and their "
        "gradients (its activation bytes)."
    )


def _rel_err(a: Any, b: Any) -> float:
    b = b.to(a.device, non_blocking=True).float()
    denom = float(b.abs().max())
    diff = float((a.float() - b).abs().max())
    return diff / denom if denom else diff


# =================================================================================================================
# Part d: the few-bit Triton kernels and the reversible core against RevLib 1.7.2


def part_peers(part: Part) -> None:
    s = part.sizes
    report = part.report(
        "Few-bit Triton kernels against their reference; the reversible core against RevLib 1.7.2",
        "Kernels: `revlib_xla.kernels.fewbit_triton` (the Triton kernels a CUDA tensor runs) against "
        "`fewbit_reference` (pure PyTorch, the definition) on the same tensors: packed codes equal, gradients equal "
        "bit for bit (a NaN only has to be a NaN), every bit width and dtype, NaN/inf inputs, a size that needs "
        "padding; the time of one encode + one gradient, kernels against the reference on the same device.",
    )
    records = part.records()
    kernels_ok = True
    try:  # the kernels get 40 % of the part (Triton compiles each specialization on its first call), the peers the rest
        kernels_ok = check_kernels(part, report, records, time.time() + 0.4 * part.left())
    except Exception as exc:
        kernels_ok = False
        report.line(f"Kernel check failed: {one_line(f'{type(exc).__name__}: {exc}', 400)}")
        records.add({"kind": "kernels", "error": traceback.format_exc()[-3000:]})
    report.line()
    report.line("## bench/reversible_vs_peers.py")
    report.line()
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "reversible_vs_peers.py"),
        *s.peers_args,
        "--no-progress",
        "--no-install",
        "--revlib-dir",
        str(REVLIB_DIR),
        "--out-dir",
        str(part.out_dir),
    ]
    report.line(f"`{' '.join(c if c.startswith('-') else Path(c).name if '/' in c else c for c in cmd[1:])}`")
    report.line()
    started = time.time()
    status, seconds = run_limited(cmd, max(5.0, part.left() - 5), part.log("reversible_vs_peers"), child_env())
    for path in sorted(part.out_dir.glob("reversible_vs_peers-*.md")):
        if path.stat().st_mtime >= started:  # its own file (bench/results/reversible_vs_peers-<device>.md): inlined
            report.line(f"From `{path.name}`:")
            report.line()
            report.line(path.read_text().split("\n", 1)[-1].replace("\n## ", "\n### "))
    verdict = "ok" if status == 0 else "stopped at its time limit" if status is None else f"exit status {status}"
    report.line()
    report.line(f"reversible_vs_peers.py: {verdict} in {seconds:.0f} s.")
    records.add({"kind": "peers", "status": verdict, "seconds": round(seconds, 1)})
    if status != 0 or not kernels_ok:
        raise PartFailed(("kernels differ from the reference; " if not kernels_ok else "") + f"peers: {verdict}")


def check_kernels(part: Part, report: Report, records: Records, deadline: float) -> bool:
    """The Triton kernels against the reference, bit for bit, and their time, case by case until ``deadline``. On
    the CPU (``--dry``) they run in Triton's interpreter (the orchestrator starts the part with
    ``TRITON_INTERPRET=1``, which must be set before triton is imported)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        report.line("triton is not installed: the kernels are not checked here.")
        records.add({"kind": "kernels", "skipped": "triton is not installed"})
        return True
    if part.dry and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "the dry run checks the kernels in Triton's interpreter: start the part with TRITON_INTERPRET=1"
        )
    rows = kernel_cases(part.sizes, "cpu" if part.dry else "cuda")
    report.line("Device: " + ("Triton's interpreter on the CPU (TRITON_INTERPRET=1)" if part.dry else "cuda"))
    report.line()
    row = report.table(["bits", "dtype", "elements", "codes equal", "gradients equal", "kernels ms", "reference ms"])
    ok = True
    for r in rows:
        if time.time() > deadline:
            report.line()
            report.line("The remaining cases were not reached in the kernels' share of the part's time.")
            break
        records.add({"kind": "kernels", **r})
        ok &= r["codes_equal"] and r["grads_equal"]
        row(
            [
                r["bits"],
                r["dtype"],
                f"{r['n']:,}",
                "yes" if r["codes_equal"] else "NO",
                "yes" if r["grads_equal"] else "NO",
                r.get("kernel_ms"),
                r.get("reference_ms"),
            ]
        )
    return ok


def kernel_cases(s: Sizes, device: str) -> Iterator[dict[str, Any]]:
    """The timed size at 2 bits (strategy.fewbit=2), then every bit width and dtype at the test sizes (NaN/inf
    inputs and gradients, NaN coded high and a zero level that selects), each as one record."""
    import torch

    from revlib_xla import fewbit
    from revlib_xla.kernels import fewbit_reference as ref
    from revlib_xla.kernels import fewbit_triton

    def same_bits(got: torch.Tensor, expected: torch.Tensor) -> bool:
        as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[expected.dtype]
        nan = expected.isnan()
        return (
            got.dtype == expected.dtype
            and torch.equal(got.isnan(), nan)
            and torch.equal(got.view(as_int)[~nan], expected.view(as_int)[~nan])
        )

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn: Callable[[], Any], repeats: int) -> float:
        fn()
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        sync()
        return 1000 * (time.perf_counter() - start) / repeats

    # the real size first (timed, and checked there too), then every width and dtype at the test sizes
    cases = [(2, dtype, s.kernel_time_size, True) for dtype in ("bfloat16", "float32")]
    cases += [
        (b, d, n, False) for b in (1, 2, 3, 4) for d in ("float32", "bfloat16", "float16") for n in s.kernel_sizes
    ]
    for bits, dtype_name, n, time_it in cases:
        dtype = getattr(torch, dtype_name)
        table = fewbit.stepwise_table("gelu", bits)
        g = torch.Generator(device=device).manual_seed(n + bits)
        x = (torch.randn(n, generator=g, device=device) * 2).to(dtype)
        grad = torch.randn(n, generator=g, device=device).to(dtype)
        if n > 8:
            x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0], device=device)
            grad[4:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38], device=device).to(dtype)
        odd_levels = (float("nan"), 0.0) + tuple(table.levels[2:])
        codes_equal = grads_equal = True
        for nan_high, levels, select_zero in ((False, table.levels, False), (True, odd_levels, True)):
            expected_packed = ref.pack(ref.stepwise_codes(x, table.borders, nan_high), bits)
            packed = fewbit_triton.encode_stepwise(x, table.borders, bits, nan_high)
            levels_t = torch.tensor(levels, dtype=torch.float32, device=device)
            expected = ref.lookup(ref.unpack(expected_packed, bits, n), grad, levels_t, select_zero=select_zero)
            got = fewbit_triton.stepwise_grad(expected_packed, grad, levels_t, bits, select_zero)
            codes_equal &= torch.equal(packed, expected_packed)
            grads_equal &= same_bits(got, expected)
        record: dict[str, Any] = {
            "bits": bits,
            "dtype": dtype_name,
            "n": n,
            "codes_equal": codes_equal,
            "grads_equal": grads_equal,
        }
        if time_it:
            levels_t = torch.tensor(table.levels, dtype=torch.float32, device=device)
            repeats = 20 if device == "cuda" else 1

            def kernels() -> Any:
                return fewbit_triton.stepwise_grad(
                    fewbit_triton.encode_stepwise(x, table.borders, bits), grad, levels_t, bits
                )

            def reference() -> Any:
                packed = ref.pack(ref.stepwise_codes(x, table.borders), bits)
                return ref.lookup(ref.unpack(packed, bits, n), grad, levels_t)

            record.update(kernel_ms=round(timed(kernels, repeats), 3), reference_ms=round(timed(reference, repeats), 3))
        yield record


# =================================================================================================================
# The orchestrator


PARTS: dict[str, tuple[str, Callable[[Part], None]]] = {
    "tests": ("a. CUDA test cases and README blocks", part_tests),
    "train": ("b. revlib-xla train at llama-1b, per strategy", part_train),
    "hf": ("c. revlib_xla.hf at Llama-3.2-1B's shape", part_hf),
    "peers": ("d. few-bit kernels; reversible core against RevLib 1.7.2", part_peers),
}


def run_part(name: str, args: argparse.Namespace) -> int:
    """``--part NAME``: one part in this process (the orchestrator's child)."""
    env = json.loads(Path(args.env_file).read_text())
    part = Part(name, args.dry, Path(args.out_dir), Path(args.work_dir), args.tag, env, args.deadline)
    injected = dict(item.partition(":")[::2] for item in args.fail_part)  # tests: part -> "" (raise) or "hang"
    if name in injected:
        report = part.report(f"{PARTS[name][0]} (failure injected)")
        if injected[name] == "hang":
            report.line("Injected: written before the part's limit; the part then hangs.")
            time.sleep(3600)
        raise RuntimeError(f"--fail-part {name}: a failure injected to check that the run records it and goes on")
    try:
        PARTS[name][1](part)
    except PartFailed as exc:
        print(f"gpu_check: part {name}: {exc}", flush=True)
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="toy sizes on the CPU: check the command, measure nothing")
    parser.add_argument("--parts", default=",".join(PART_ORDER), help=f"comma-separated, of {', '.join(PART_ORDER)}")
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"), help="where the results go")
    parser.add_argument("--work-dir", help="logs and scratch (default runs/gpu-check or runs/gpu-check-dry)")
    parser.add_argument("--pack", help="after each part, copy the markdown and a .tar.gz of everything here ($OUT)")
    parser.add_argument("--wheels", help="install what the GPU image lacks from this folder first (no index)")
    parser.add_argument("--budget", type=float, default=TOTAL_BUDGET_S, help="seconds for all parts together")
    parser.add_argument("--jobs", type=int, help="parts run at once (default 1; 2 with --dry)")
    parser.add_argument("--limit", action="append", default=[], metavar="PART=S", help="a part's own time limit")
    # internal: the children
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--env-file", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    # tests: a part that raises (NAME) or hangs past its limit (NAME:hang)
    parser.add_argument("--fail-part", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--train-one", help=argparse.SUPPRESS)
    parser.add_argument("--estimates", help=argparse.SUPPRESS)
    parser.add_argument("--chip", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.probe:
        Path(args.probe).write_text(json.dumps(probe_environment()))
        return 0
    if args.train_one:
        return train_one(args.train_one)
    if args.estimates:
        return estimates(args.estimates, args.chip, args.dry)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.part:
        return run_part(args.part, args)
    if args.jobs is None:
        args.jobs = 2 if args.dry else 1
    return orchestrate(args)


def orchestrate(args: argparse.Namespace) -> int:
    start = time.time()
    s = sizes(args.dry)
    out_dir = Path(args.out_dir).resolve()
    work_dir = Path(args.work_dir or ROOT / "runs" / ("gpu-check-dry" if args.dry else "gpu-check")).resolve()
    shutil.rmtree(work_dir / "logs", ignore_errors=True)
    (work_dir / "logs").mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        print(f"gpu_check: --parts: unknown part(s) {', '.join(unknown)}; choose from {', '.join(PART_ORDER)}")
        return 2
    limits = dict(s.limits)
    for item in args.limit:
        name, _, value = item.partition("=")
        if name not in limits or not value.replace(".", "", 1).isdigit():
            print(f"gpu_check: --limit {item!r}: expected PART=SECONDS with PART one of {', '.join(PART_ORDER)}")
            return 2
        limits[name] = int(float(value))
    installed = install_wheels(Path(args.wheels), work_dir / "logs" / "install.log") if args.wheels else []
    env_file = work_dir / "environment.json"
    if args.dry:  # no GPU to keep free of this process's CUDA context: probed here (one start-up less)
        env_file.write_text(json.dumps(probe_environment()))
        status = 0
    else:
        probe = [sys.executable, str(SCRIPT), "--probe", str(env_file)]
        status, _ = run_limited(probe, 120, work_dir / "logs" / "probe.log", child_env())
    env = json.loads(env_file.read_text()) if status == 0 and env_file.exists() else {}
    env.update(commit=_commit(), date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    env_file.write_text(json.dumps(env))
    if not args.dry and not env.get("cuda_available"):
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); use --dry for the CPU check")
        return 2
    tag = device_tag(env, args.dry)
    summary = Report(out_dir / f"gpu_check-summary-{tag}.md", "GPU check: summary", env, args.dry)
    for note in installed:
        summary.line(f"- wheels: {note}")
    if status != 0:
        summary.line(f"- environment probe failed (exit {status}): see logs/probe.log")
    summary.line()
    row = summary.table(["part", "limit s", "took s", "result", "file"])
    lock = threading.Lock()
    estimator = None
    if "train" in parts:  # the train part's GPU estimates, on the CPU from now on (minutes of CPU at full size)
        estimates_file = work_dir / "estimates.jsonl"
        estimates_file.unlink(missing_ok=True)
        estimator = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--estimates", str(estimates_file), "--chip", train_chip(env, args.dry)]
            + (["--dry"] if args.dry else []),
            stdout=(work_dir / "logs" / "train-estimates.log").open("ab"),
            stderr=subprocess.STDOUT,
            env=child_env({"OMP_NUM_THREADS": "2"}),
            cwd=ROOT,
            start_new_session=True,
        )

    def run_one(name: str) -> bool:
        """One part in its own process under its limit; its summary row; whether it passed."""
        left = args.budget - (time.time() - start)
        limit = min(limits[name], left - 5)
        result_file = f"gpu_check-{name}-{tag}.md"
        if limit < 10:
            with lock:
                row([PARTS[name][0], limits[name], None, "not run: the run's time was spent", None])
            return False
        cmd = [
            *(sys.executable, str(SCRIPT), "--part", name, "--out-dir", str(out_dir), "--work-dir", str(work_dir)),
            *("--env-file", str(env_file), "--tag", tag, "--deadline", str(time.time() + limit - 3)),
            *(["--dry"] if args.dry else []),
            *(a for item in args.fail_part for a in ("--fail-part", item)),
        ]
        print(f"gpu_check: part {name} (limit {limit:.0f} s) ...", flush=True)
        # the dry run checks the Triton kernels in Triton's interpreter, which must be chosen before triton is imported
        extra = {"TRITON_INTERPRET": "1"} if args.dry and name == "peers" else {}
        status, seconds = run_limited(cmd, limit, work_dir / "logs" / f"{name}.log", child_env(extra))
        if status == 0:
            result = "ok"
        else:
            log = (work_dir / "logs" / f"{name}.log").read_text(errors="replace")
            result = (
                f"stopped at its limit of {limit:.0f} s"
                if status is None
                else "found failures (see its file)"
                if status == 3
                else f"FAILED (exit {status}): {_error_of(log)}"
            )
            md = out_dir / result_file
            if md.exists():
                with md.open("a") as f:
                    f.write(f"\n**This part {result}.**\n")
        print(f"gpu_check: part {name}: {result} ({seconds:.0f} s)", flush=True)
        with lock:
            row([PARTS[name][0], f"{limit:.0f}", f"{seconds:.0f}", result, f"`{result_file}`"])
            if args.pack:
                pack(out_dir, work_dir, tag, start, Path(args.pack))
        return status == 0

    # One part at a time on a GPU (a part's measurements must have the device to themselves); --jobs 2 in the dry
    # run, where the two CPU cores of CI each take one.
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            passed = list(pool.map(run_one, parts))
    finally:
        if estimator is not None and estimator.poll() is None:
            _stop_group(estimator)
    failures = passed.count(False)
    summary.line()
    logs = work_dir.relative_to(ROOT) if work_dir.is_relative_to(ROOT) else work_dir
    summary.line(f"Whole run: {time.time() - start:.0f} s. Logs: {logs}/logs (and in the packed .tar.gz).")
    if args.pack:
        pack(out_dir, work_dir, tag, start, Path(args.pack))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
