#!/usr/bin/env python
"""Compile time and TPU HBM of a reversible training step against depth: unrolled vs scanned.

For each depth, builds the transformer-like ReversibleSequential of ``bench/xla_compile_time.py`` (layers alternate a
pre-norm attention block and a pre-norm MLP block: they repeat with period 2, as Llama's branches do) without
dropout (a group of several layers that draws random numbers runs unrolled, see ``reversible.scan``), and traces one
training step: forward, MSE loss, backward. Modes: ``scan`` (``scan=None``: scanned, chosen automatically, over
per-layer parameters stacked per pass), ``stacked`` (``scan=None`` after ``reversible.stack_layers``: the loops
read the stacked parameters and write stacked gradients), ``unrolled`` (``scan=False``). Per depth and mode it records:

* ``compile_s``: torch_xla's ``CompileTime`` metric of the step's graph on XLA:CPU (wall), ``compile_cpu_s``: process
  CPU seconds in the sync that compiled it (the compiler's threads included; steadier on a shared machine);
* ``whiles``: while loops in the step's HLO (2 when scanned), ``hlo_lines``: its size;
* ``tpu_peak_mib`` / ``tpu_argument_mib``: the TPU v5e compiler's peak and argument bytes for the same step's
  StableHLO, compiled deviceless (``revlib_xla.memory.tpu_memory``), and the parameter (+ gradient) bytes.

Results: ``bench/results/scan_compile-xla-cpu.{json,md}``. Usage:
``PJRT_DEVICE=CPU nice python bench/scan_compile.py [--depths 4 8 16 32 64] [--width 64] [--no-tpu]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from xla_compile_time import Attention, mlp  # the same blocks as the unrolled compile-time benchmark

import revlib_xla as revlib

MIB = 2**20


MODES = {"scan": None, "stacked": None, "unrolled": False}  # mode -> ReversibleSequential(scan=...)
# mode -> Checkpointable(scan=...); checkpointed-stacked: scan=True, then revlib_xla.reversible.stack_layers on it
CHECKPOINTED = {"checkpointed-scan": True, "checkpointed-unrolled": False, "checkpointed-stacked": True}


class Layer(torch.nn.Module):
    """A residual transformer layer (pre-norm attention, then pre-norm MLP) for the checkpointed stack."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attention, self.mlp = Attention(width, heads, 0.0), mlp(width, 0.0)

    def forward(self, x):
        x = x + self.attention(x)
        return x + self.mlp(x)


def build_checkpointed(depth: int, args, mode: str) -> torch.nn.Module:
    """``Checkpointable(scan=...)``'s stages run with a fixed schedule (no measuring): every stage's input kept as
    a checkpoint in the forward, every stage recomputed with autograd in the backward (the scanned run is one
    stage: its forward loop, then its forward again keeping the layers' inputs, and its backward loop)."""
    from revlib_xla.planner import Chain, Op, Schedule, ScheduleExecutor, simulate

    layers = torch.nn.Sequential(*[Layer(args.width, args.heads) for _ in range(depth)])
    checkpointed = revlib.Checkpointable(layers, scan=CHECKPOINTED[mode])
    n = len(checkpointed.stages)
    chain = Chain([1.0] * n, [1.0] * (n + 1), [1.0] * (n + 1), [1.0] * (n + 1), [0.0] * n, [0.0] * (n + 1))
    ops = [Op("CF", i) for i in range(n)] + [Op("L", n)]
    ops += [op for i in reversed(range(n)) for op in (Op("Fe", i), Op("B", i))]
    schedule = Schedule(tuple(ops), *simulate(chain, ops), chain)
    if mode == "checkpointed-stacked":  # the stacks live on the model: run through the Checkpointable itself
        revlib.scan.stack_layers(checkpointed)
        checkpointed.chain, checkpointed.sequence = chain, schedule
        return checkpointed
    return ScheduleExecutor(torch.nn.Sequential(*checkpointed.stages), schedule)


def build(depth: int, args, mode: str) -> torch.nn.Module:
    blocks = [Attention(args.width, args.heads, 0.0) if i % 2 == 0 else mlp(args.width, 0.0) for i in range(depth)]
    model = revlib.ReversibleSequential(*blocks, split_dim=-1, scan=MODES[mode])
    return revlib.scan.stack_layers(model) if mode == "stacked" else model


def measure(depth: int, mode: str, args) -> dict:
    import torch_xla
    import torch_xla.debug.metrics as met

    dev = torch_xla.device()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    checkpointed = mode in CHECKPOINTED
    model = (build_checkpointed if checkpointed else build)(depth, args, mode).to(dev, dtype)
    gen = torch.Generator().manual_seed(1)
    width = args.width if checkpointed else 2 * args.width  # a residual stream, or the reversible pair
    x = torch.randn(args.batch, args.seq, width, generator=gen).to(dev, dtype)
    target = torch.randn(args.batch, args.seq, width, generator=gen).to(dev, dtype)
    torch_xla.sync()
    met.clear_all()
    loss = F.mse_loss(model(x), target)
    loss.backward()
    outputs = [loss] + [p.grad for p in model.parameters()]
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(outputs)
    stablehlo = revlib.backend.lazy_stablehlo(outputs) if args.tpu else None
    c0, t0 = time.process_time(), time.perf_counter()
    torch_xla.sync()
    float(loss.detach().cpu())
    c1, t1 = time.process_time(), time.perf_counter()
    compiled = met.metric_data("CompileTime")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    row = {
        "depth": depth,
        "mode": mode,
        "dtype": args.dtype,
        "compile_s": 0.0 if compiled is None else compiled[1] / 1e9,
        "compiles": 0 if compiled is None else compiled[0],
        "compile_cpu_s": c1 - c0,
        "sync_wall_s": t1 - t0,
        "whiles": hlo.count(" while("),
        "hlo_lines": hlo.count("\n"),
        "param_mib": params / MIB,
    }
    if stablehlo is not None:
        found = revlib.memory.tpu_memory(stablehlo, "v5e", hbm_only=True)
        row["tpu_peak_mib"] = found.peak_bytes / MIB
        row["tpu_argument_mib"] = found.argument_bytes / MIB
        row["tpu_output_mib"] = found.output_bytes / MIB
        row["tpu_live_temp_mib"] = found.live_temporary_bytes / MIB
    return row


def write(rows: list[dict], args, load: tuple[float, float]) -> None:
    import torch_xla

    out = ROOT / "bench" / "results"
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    meta = {
        "generated": stamp,
        "device": "XLA:CPU (PJRT_DEVICE=CPU) for compile times; TPU v5e deviceless compile for HBM",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "torch_xla": torch_xla.__version__,
        "load_avg_before_after": load,
        "args": vars(args),
    }
    (out / "scan_compile-xla-cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        "# Compile time and TPU HBM of a reversible training step vs depth: unrolled vs scan (xla-cpu)",
        "",
        f"Generated by `bench/scan_compile.py` on {stamp} ({meta['machine']}); torch {torch.__version__}, torch_xla "
        f"{torch_xla.__version__}. Load average before/after: {load[0]:.1f} / {load[1]:.1f} (a shared machine: wall "
        f"and CPU times rise with it).",
        f"Model: layers alternate pre-norm attention ({args.heads} heads) and pre-norm MLP (4x) blocks, stream width "
        f"{args.width}, no dropout; input {args.batch}x{args.seq}x{2 * args.width}; step = forward, MSE loss, "
        f"backward, one sync. Depth = reversible layers. TPU: v5e, deviceless compile of the same step's StableHLO, "
        f"every buffer in HBM (`hbm_only`): peak = arguments (parameters, input) + outputs (gradients, loss) + live "
        f"temporaries; the TPU pads small dimensions to its tiles, so arguments and outputs exceed the logical bytes.",
        "checkpointed-*: `Checkpointable(nn.Sequential(*layers), scan=True/False)` over residual layers (pre-norm "
        f"attention, then pre-norm MLP; stream width {args.width}, input {args.batch}x{args.seq}x{args.width}), run "
        "with a fixed schedule (every stage's input checkpointed, every stage recomputed once in the backward); depth "
        "= layers; checkpointed-scan stacks the run's parameters per pass, checkpointed-stacked stores them stacked "
        "(`reversible.stack_layers` on the Checkpointable: the loops read the stacks and write their gradients).",
        "",
        "| mode | dtype | depth | compile wall (s) | compile CPU (s) | while loops | HLO lines | params (MiB) "
        "| TPU v5e peak (MiB) | TPU live temporaries (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tpu = f"{r['tpu_peak_mib']:.2f}" if "tpu_peak_mib" in r else "-"
        temp = f"{r['tpu_live_temp_mib']:.2f}" if "tpu_live_temp_mib" in r else "-"
        lines.append(
            f"| {r['mode']} | {r.get('dtype', 'float32')} | {r['depth']} | {r['compile_s']:.2f} | "
            f"{r['compile_cpu_s']:.2f} | {r['whiles']} | {r['hlo_lines']} | {r['param_mib']:.2f} | {tpu} | {temp} |"
        )
    lines.append("")
    for mode, dtype in sorted({(r["mode"], r.get("dtype", "float32")) for r in rows}):
        own = {r["depth"]: r for r in rows if r["mode"] == mode and r.get("dtype", "float32") == dtype}
        if len(own) < 2:
            continue
        low, high = min(own), max(own)
        ratio = own[high]["compile_s"] / max(own[low]["compile_s"], 1e-9)
        cpu = own[high]["compile_cpu_s"] / max(own[low]["compile_cpu_s"], 1e-9)
        lines_ratio = own[high]["hlo_lines"] / own[low]["hlo_lines"]
        line = (
            f"- {mode} ({dtype}): depth {high} / depth {low}: compile wall {ratio:.2f}x, compile CPU {cpu:.2f}x, "
            f"HLO lines {lines_ratio:.2f}x"
        )
        if "tpu_peak_mib" in own[low]:
            grow = (own[high]["tpu_peak_mib"] - own[low]["tpu_peak_mib"]) / (high - low)
            per_layer = (own[high]["param_mib"] - own[low]["param_mib"]) / (high - low)
            line += (
                f"; TPU peak grows {grow:.3f} MiB per layer (parameters: {per_layer:.3f} MiB per layer, with their "
                f"gradients {2 * per_layer:.3f})"
            )
            if "tpu_live_temp_mib" in own[low] and "tpu_live_temp_mib" in own[high]:
                temp = (own[high]["tpu_live_temp_mib"] - own[low]["tpu_live_temp_mib"]) / (high - low)
                line += f", of which live temporaries {temp:.3f} (the rest: arguments and outputs, tile-padded)"
        lines.append(line)
    earlier = sorted({(r["mode"], r.get("dtype", "float32"), r["measured"]) for r in rows if "measured" in r})
    for mode, dtype, when in earlier:
        lines.append(
            f"- the {mode} ({dtype}) rows were measured on {when} (an earlier run, kept; its load is in git history)"
        )
    (out / "scan_compile-xla-cpu.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameters and input")
    parser.add_argument("--no-tpu", dest="tpu", action="store_false", help="skip the deviceless TPU compile")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES) + list(CHECKPOINTED),
        default=list(MODES),
        help="scan: scan=None over per-layer parameters (stacked per pass); stacked: scan=None after "
        "reversible.stack_layers; unrolled: scan=False; checkpointed-scan / checkpointed-unrolled: a residual "
        "stack under Checkpointable(scan=True/False), every layer recomputed once (a fixed schedule); "
        "checkpointed-stacked: checkpointed-scan after reversible.stack_layers on the Checkpointable. Rows of "
        "other modes already in the JSON are kept.",
    )
    args = parser.parse_args()
    load0 = os.getloadavg()[0]
    rows = []
    for mode in args.modes:
        for depth in args.depths:
            rows.append(measure(depth, mode, args))
            print(json.dumps(rows[-1]), flush=True)
    write(kept_rows(args.modes, args.dtype) + rows, args, (load0, os.getloadavg()[0]))


def kept_rows(modes: list[str], dtype: str) -> list[dict]:
    """The rows of the modes and dtypes not measured now, from the last results (each row carries when it was
    measured)."""
    path = ROOT / "bench" / "results" / "scan_compile-xla-cpu.json"
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    return [
        {"measured": old["meta"]["generated"], **r}
        for r in old["rows"]
        if r["mode"] not in modes or r.get("dtype", "float32") != dtype
    ]


if __name__ == "__main__":
    main()
