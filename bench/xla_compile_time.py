#!/usr/bin/env python
"""Compile time of a reversible training step on XLA, against depth.

For each depth, builds a transformer-like ReversibleSequential (layers alternate a pre-norm attention block and a
pre-norm MLP block, both with dropout), and runs full training steps (forward, loss, backward, AdamW step,
``torch_xla.sync()``) on fixed-shape inputs made on the host. Per depth it records:

* ``trace_s``: wall time of the Python forward/backward/optimizer step before the sync (lazy tracing), step 0;
* ``compile_s``: torch_xla's ``CompileTime`` metric for step 0. AdamW's state is created beforehand by a separate
  elementwise graph, so step 0 compiles the steady-state step graph; ``compile_cpu_s``: process CPU seconds spent in
  step 0's sync (the XLA compiler's threads included; less sensitive to other processes on a shared machine than
  wall time);
* ``new_compiles_after_warmup``: compilations during steps 1..N (must be 0: requirement 8);
* ``execute_ms``: median ``ExecuteTime`` of the steady-state steps;
* ``graph_inputs`` / ``hlo_lines``: size of the step's graph (its HLO text before optimizations).

``--modes`` also times ``no_savings`` (plain autograd over the unrolled layers) as the baseline the reversible graph
should be compared with. Results go to ``bench/results/xla_compile_time-xla-<platform>.{json,md}``.

Usage: ``PJRT_DEVICE=CPU python bench/xla_compile_time.py [--depths 4 8 16 32 64] [--width 128] [--modes ...]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import itertools

import revlib_xla as revlib


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, p: float):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        return self.drop(self.out(y))


def mlp(width: int, p: float) -> nn.Module:
    return nn.Sequential(
        nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(p)
    )


def build(depth: int, width: int, heads: int, p: float, mode: str) -> nn.Module:
    blocks = [Attention(width, heads, p) if i % 2 == 0 else mlp(width, p) for i in range(depth)]
    return revlib.ReversibleSequential(*blocks, split_dim=-1, memory_mode=revlib.MemoryModes[mode])


def measure(depth: int, mode: str, args) -> dict:
    import torch_xla
    import torch_xla.debug.metrics as met

    dev = torch_xla.device()
    torch.manual_seed(0)
    model = build(depth, args.width, args.heads, args.dropout, mode).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(args.batch, args.seq, 2 * args.width, generator=gen),
            torch.randn(args.batch, args.seq, 2 * args.width, generator=gen),
        )
        for _ in range(args.steps)
    ]
    # Create AdamW's state with a separate (elementwise-only) graph, so that step 0 already compiles the
    # steady-state step graph and steps 1.. must all hit the cache.
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch_xla.sync()

    rows = []
    loss = None
    for step, (x, target) in enumerate(batches):
        met.clear_all()
        x, target = x.to(dev), target.to(dev)
        t0, tc0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        t1, tc1 = time.perf_counter(), time.process_time()
        info = {}
        if step == 0:
            hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss] + [p for p in model.parameters()])
            info["hlo_lines"] = hlo.count("\n")
        c0 = time.process_time()
        torch_xla.sync()
        loss_value = float(loss.detach().cpu())  # waits for the execution
        t2 = time.perf_counter()
        c1 = time.process_time()
        compile_data = met.metric_data("CompileTime")
        execute_data = met.metric_data("ExecuteTime")
        rows.append(
            {
                "trace_s": t1 - t0,
                "trace_cpu_s": tc1 - tc0,
                "sync_s": t2 - t1,
                "sync_cpu_s": c1 - c0,
                "compiles": 0 if compile_data is None else compile_data[0],
                "compile_s": 0.0 if compile_data is None else compile_data[1] / 1e9,
                "execute_ms": None if execute_data is None else execute_data[1] / 1e6 / max(execute_data[0], 1),
                "loss": loss_value,
                **info,
            }
        )
    steady = rows[1:]
    return {
        "depth": depth,
        "mode": mode,
        "trace_s": rows[0]["trace_s"],
        "trace_cpu_s": rows[0]["trace_cpu_s"],
        "steady_trace_cpu_s": statistics.median(r["trace_cpu_s"] for r in rows[1:]) if len(rows) > 1 else None,
        "compiles_step0": rows[0]["compiles"],
        "compile_s": rows[0]["compile_s"],
        "compile_cpu_s": rows[0]["sync_cpu_s"],
        "new_compiles_after_warmup": sum(r["compiles"] for r in steady),
        "steady_trace_s": statistics.median(r["trace_s"] for r in steady) if steady else None,
        "execute_ms": statistics.median(r["execute_ms"] for r in steady if r["execute_ms"] is not None)
        if steady
        else None,
        "hlo_lines": rows[0].get("hlo_lines"),
        "loss_finite": all(math.isfinite(r["loss"]) for r in rows),
        "load_avg_1m": os.getloadavg()[0],
        "steps": rows,
    }


def fit_linear(rows, key):
    """Least-squares ``key ~ a + b * depth`` over the rows: (a, b), or None with fewer than two depths."""
    pts = [(r["depth"], r[key]) for r in rows if r.get(key) is not None]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else 0.0
    return my - b * mx, b


def marginal(rows, key):
    """Per-layer cost between consecutive depths: (key[d2] - key[d1]) / (d2 - d1); constant when growth is linear."""
    rows = sorted(rows, key=lambda r: r["depth"])
    return {r2["depth"]: (r2[key] - r1[key]) / (r2["depth"] - r1["depth"]) for r1, r2 in itertools.pairwise(rows)}


def markdown(result) -> str:
    cfg = result["config"]
    lines = [
        f"# Compile time of a reversible training step vs depth ({result['device']})",
        "",
        f"Generated by `bench/xla_compile_time.py` on {result['date']} ({result['machine']}); torch {result['torch']}, "
        f"torch_xla {result['torch_xla']}.",
        f"Model: layers alternate pre-norm attention ({cfg['heads']} heads) and pre-norm MLP (4x) blocks, stream width "
        f"{cfg['width']}, dropout {cfg['dropout']}; input {cfg['batch']}x{cfg['seq']}x{2 * cfg['width']}; step = "
        f"forward, MSE loss, backward, AdamW, `torch_xla.sync()`. Depth = reversible layers.",
        "",
        "| mode | depth | trace CPU (s) | trace wall (s) | compile CPU (s) | compile CPU s/layer | compile wall (s) "
        "| HLO lines | compiles after step 0 | execute (ms) | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['mode']} | {r['depth']} | {r['steady_trace_cpu_s']:.2f} | {r['trace_s']:.2f} "
            f"| {r['compile_cpu_s']:.2f} | {r['compile_cpu_s'] / r['depth']:.3f} | {r['compile_s']:.2f} "
            f"| {r['hlo_lines']} "
            f"| {r['new_compiles_after_warmup']} | {r['execute_ms']:.1f} | {r['load_avg_1m']:.1f} |"
        )
    lines.append("")
    for mode, fit in result["compile_cpu_fit"].items():
        if fit is not None:
            steps = ", ".join(f"{v:.2f} (to {d})" for d, v in result["compile_cpu_marginal_s_per_layer"][mode].items())
            lines.append(
                f"- `{mode}`: compile CPU ~ {fit[0]:.1f} s + {fit[1]:.2f} s x depth (least squares); "
                f"marginal s/layer between consecutive depths: {steps}."
            )
    lines += [
        "- compile = torch_xla's `CompileTime` metric (wall time of the XLA compile of the steady-state step graph; "
        "AdamW's state is created beforehand by a separate elementwise graph); compile CPU = process CPU seconds in "
        "that step's sync (compiler threads included). trace = Python forward/backward/step before the sync. On a "
        "shared machine wall times rise with the load average shown; the CPU column is steadier.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument(
        "--modes", nargs="+", default=["autograd_function", "no_savings"], choices=["autograd_function", "no_savings"]
    )
    ap.add_argument("--width", type=int, default=128, help="stream width (the input has twice as many features)")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=3, help="steps per depth (step 0 compiles, the rest must not)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)

    import torch_xla.runtime as xr

    device = f"xla-{xr.device_type().lower()}"
    rows = []
    for mode in args.modes:
        for depth in args.depths:
            row = measure(depth, mode, args)
            rows.append(row)
            print(
                f"{mode:18s} depth {depth:3d}: trace {row['trace_s']:.2f}s compile {row['compile_s']:.2f}s "
                f"(cpu {row['compile_cpu_s']:.2f}s), hlo {row['hlo_lines']} lines, "
                f"new compiles {row['new_compiles_after_warmup']}, load {row['load_avg_1m']:.1f}",
                flush=True,
            )
            write(rows, args, device)
    return 0 if all(r["new_compiles_after_warmup"] == 0 and r["loss_finite"] for r in rows) else 1


def write(rows, args, device) -> None:
    """Write the results so far (each depth adds a row; an interrupted run keeps what it measured)."""
    import torch_xla

    result = {
        "device": device,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "torch_xla": torch_xla.__version__,
        "config": {k: getattr(args, k) for k in ("width", "heads", "batch", "seq", "dropout", "steps")},
        "rows": rows,
        "compile_cpu_fit": {m: fit_linear([r for r in rows if r["mode"] == m], "compile_cpu_s") for m in args.modes},
        "compile_cpu_marginal_s_per_layer": {
            m: marginal([r for r in rows if r["mode"] == m], "compile_cpu_s") for m in args.modes
        },
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"xla_compile_time-{device}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))


if __name__ == "__main__":
    sys.exit(main())
