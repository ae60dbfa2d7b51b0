"""bench/gpu_check.py, the command a lent GPU runs (``make gpu-check``), run here at toy sizes on the CPU (``--dry``)
so that it cannot rot between GPUs: every part writes its file, a part that fails or runs out of time is recorded and
the others still run, and the packed results hold everything (the device tool returns at most 8 files)."""

import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402  (bench/ is not a package)


def _dry(tmp_path, *args, timeout=600):
    out, pack = tmp_path / "results", tmp_path / "pack"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry", "--out-dir", str(out)]
        + ["--work-dir", str(tmp_path / "work"), "--pack", str(pack), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    return done, out, pack


def _rows(text, first_column):
    """The cells of the markdown table rows whose first cell is ``first_column``."""
    return [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith(f"| {first_column} |")
    ]


@pytest.mark.slow
def test_dry_run_writes_every_part(tmp_path):
    done, out, pack = _dry(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tag = "cpu-dry"
    files = {name: (out / f"gpu_check-{name}-{tag}.md").read_text() for name in (*gpu_check.PART_ORDER, "summary")}
    for name, text in files.items():
        assert "- Mode: DRY" in text and "- Software: torch " in text, name
    assert [r[3] for r in _rows(files["summary"], "a. CUDA test cases and README blocks")] == ["ok"]
    assert re.search(r"\*\*\d+ passed, \d+ skipped\*\* of \d+ selected", files["tests"]), files["tests"]

    train = files["train"]
    for strategy in gpu_check.TRAIN_STRATEGIES:
        (row,) = _rows(train, strategy)[:1]
        tokens_per_s, status = row[1], row[-1]
        if strategy in ("none", "checkpoint", "plan", "offload.optimizer"):
            assert status == "ok" and float(tokens_per_s.replace(",", "")) > 0, row
        else:  # reversible and few-bit may be refused at bf16 by the library; the refusal is then recorded
            assert status == "ok" or status.startswith("failed after"), row
    estimate = _rows(train.split("## Measured peak beside the GPU estimate")[1], "none")[0]
    # a number, or the estimate's own error (torch 2.13's FakeTensorMode refuses the meta-built model's to_empty)
    assert estimate[4].startswith("failed: ") or (float(estimate[2]) > 0 and "parameters" in estimate[4]), estimate

    hf = files["hf"]
    assert _rows(hf, "plain")[0][4] == "the reference"
    # the same model built again from the same seed, and recomputed by checkpointing, on the CPU: the same gradients,
    # bit for bit (the noise floor is 0 here; on a GPU it is what the run reports)
    for variant in ("plain (again)", "transformers checkpointing"):
        assert _rows(hf, variant)[0][4].startswith("0.0e+00 ("), hf
    plan = _rows(hf, "memory_efficient(m, 'plan')")[0]
    assert plan[-1] == "ok" and float(plan[4].split()[0]) >= 0, plan

    peers = files["peers"]
    if "triton is not installed" not in peers:
        kernels = [line for line in peers.splitlines() if re.match(r"\| \d \| (float32|bfloat16|float16) \|", line)]
        assert len(kernels) == 4 * 3 + 2 and all("| yes | yes |" in line for line in kernels), peers
    assert "reversible_vs_peers.py: ok" in peers and "| no_savings |" in peers

    packed = sorted(p.name for p in pack.iterdir())
    assert len(packed) <= 8 and f"gpu_check-{tag}.tar.gz" in packed
    with tarfile.open(pack / f"gpu_check-{tag}.tar.gz") as tar:
        names = tar.getnames()
    assert {f"bench/results/gpu_check-{name}-{tag}.md" for name in files} <= set(names)
    assert any(n.startswith("logs/train") for n in names)


@pytest.mark.slow
def test_a_failed_part_and_a_part_out_of_time_are_recorded_and_the_next_runs(tmp_path):
    """One part raises, the next one hangs past its limit (both injected): the second runs after the first failed,
    both are written as such, the lines the stopped part wrote before its limit stay, and the exit status says the
    run found failures."""
    injected = ["--fail-part", "tests", "--fail-part", "peers:hang", "--limit", "peers=10", "--jobs", "1"]
    done, out, pack = _dry(tmp_path, "--parts", "tests,peers", *injected)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (out / "gpu_check-summary-cpu-dry.md").read_text()
    failed = _rows(summary, "a. CUDA test cases and README blocks")[0]
    assert failed[3].startswith("FAILED (exit 1): RuntimeError: --fail-part tests"), failed
    stopped = _rows(summary, "d. few-bit kernels; reversible core against RevLib 1.7.2")[0]
    assert stopped[3] == "stopped at its limit of 10 s", stopped
    peers = (out / "gpu_check-peers-cpu-dry.md").read_text()
    assert "Injected: written before the part's limit" in peers
    assert peers.rstrip().endswith("**This part stopped at its limit of 10 s.**")
    assert {p.name for p in pack.iterdir()} >= {"gpu_check-peers-cpu-dry.md", "gpu_check-cpu-dry.tar.gz"}


def test_run_limited_stops_the_whole_process_group(tmp_path):
    """A child that outlives its limit is stopped with everything it started (pytest's workers, a benchmark's)."""
    marker = tmp_path / "grandchild.pid"
    start = time.perf_counter()
    status, seconds = gpu_check.run_limited(
        ["bash", "-c", f"sleep 60 & echo $! > {marker}; wait"], 1.5, tmp_path / "log.txt", cwd=tmp_path
    )
    assert status is None and seconds < 15 and time.perf_counter() - start < 15
    grandchild = int(marker.read_text())
    for _ in range(50):
        if not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the grandchild {grandchild} still runs")
    assert gpu_check.run_limited(["true"], 10, tmp_path / "log.txt", cwd=tmp_path)[0] == 0


def test_device_names_and_chips():
    h200 = {"device_name": "NVIDIA H200", "device_memory": 150 * 2**30}
    assert gpu_check.device_tag(h200, dry=False) == "cuda-h200"
    assert gpu_check.device_tag({"device_name": "NVIDIA H100 80GB HBM3"}, dry=False) == "cuda-h100-80gb-hbm3"
    assert gpu_check.device_tag(h200, dry=True) == "cpu-dry"
    assert gpu_check.gpu_chip(h200) == "h200"
    assert gpu_check.gpu_chip({"device_name": "NVIDIA A100-SXM4-40GB", "device_memory": 40 * 2**30}) == "a100-40gb"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_targets_run_the_driver():
    """`make gpu-check GPU_CHECK_DRY=1` is the driver's dry run without wheels; `make gpu-check` installs from the
    wheel folder only; `make gpu-wheels` downloads for the GPU image's Python (3.12, manylinux x86-64)."""

    def dry_run(*args):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
        done = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        return " ".join(done.stdout.replace("\\\n", " ").split())

    dry = dry_run("gpu-check", "GPU_CHECK_DRY=1")
    assert "bench/gpu_check.py --dry --out-dir runs/gpu-check-dry/results" in dry and "--wheels" not in dry
    full = dry_run("gpu-check", "GPU_CHECK_PACK=/out")
    assert "bench/gpu_check.py --wheels .gpu-wheels --out-dir bench/results --pack /out" in full
    wheels = dry_run("gpu-wheels")
    for part in ("--only-binary=:all:", "--python-version 3.12", "--abi cp312", "--platform manylinux2014_x86_64"):
        assert part in wheels
    assert "'pydantic>=2.5'" in wheels and "--no-deps revlib==1.7.2" in wheels
