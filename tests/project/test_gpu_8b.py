"""bench/gpu_8b.py, what a lent GPU runs for llama-8b on one GPU (``make gpu-8b``), run here at a toy size on the CPU
(``--dry``) so that it cannot rot between GPUs: both cases (clipping off and on) step, the device-only steps run,
the estimate is beside each, and the file is written."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_8b_check_runs_dry_and_writes_its_table(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_8b.py"), "--dry", "--steps", "2", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = (tmp_path / "gpu_8b-cpu-dry.md").read_text()
    assert "- Mode: DRY" in text
    rows = [line for line in text.splitlines() if line.startswith("| optim.grad_clip=")]
    assert [r.split(" | ")[0] for r in rows] == ["| optim.grad_clip=0", "| optim.grad_clip=1.0 (default)"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1]) > 0 and float(cells[2]) > 0 and "forward" in cells[9], row
