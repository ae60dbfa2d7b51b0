#!/usr/bin/env python
"""Where a training step's time goes: transformers' gradient checkpointing against ``memory_efficient(model,
"reversible")``, operation by operation, on the models and batch of ``hf_memory.py``.

Every aten operation of ``--rounds`` steps per variant (interleaved) is timed by a dispatch mode and grouped by
operation and input shapes; the table lists the groups whose time differs most between the two variants, with
their call counts (deterministic) and times (medians over the rounds; each round's dispatch-mode overhead is alike
for both). It shows which operations explain the step-time ratio ``hf_memory.py`` reports.

Both runs keep freed memory in the process (``hf_memory.fixed_malloc``) so that no round pays page faults the other
does not.

Usage: ``nice python bench/hf_step_breakdown.py [--model llama] [--depth 32] [--rounds 5]``; results:
``bench/results/hf_step_breakdown-cpu-<model>-d<depth>.{json,md}``.
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import hf_memory

from revlib_xla.hf import memory_efficient

Key = tuple[str, str]


class OpTimes(TorchDispatchMode):
    """Wall time and calls per (operation, input shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: collections.Counter[Key] = collections.Counter()
        self.calls: collections.Counter[Key] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        elapsed = time.perf_counter() - start
        key = (str(func), " ".join(str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor)))
        self.seconds[key] += elapsed
        self.calls[key] += 1
        return out


def measure(model_name: str, depth: int, batch: int, seq: int, hidden: int, rounds: int) -> dict[str, Any]:
    base = hf_memory.build(model_name, depth, seq, hidden)
    models = {
        "hf-checkpointing": hf_memory.hf_checkpointing(copy.deepcopy(base)),
        "reversible": memory_efficient(copy.deepcopy(base), "reversible"),
    }
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    for model in models.values():
        for _ in range(2):
            hf_memory.step(model, ids)
    per_round: dict[str, list[OpTimes]] = {k: [] for k in models}
    steps: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(rounds):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            hf_memory.step(model, ids)
            steps[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
            with OpTimes() as times:
                hf_memory.step(model, ids)
            per_round[name].append(times)
    keys = sorted({k for runs in per_round.values() for r in runs for k in r.seconds})
    ops = []
    for key in keys:
        row: dict[str, Any] = {"op": key[0], "shapes": key[1]}
        for name, runs in per_round.items():
            row[f"{name}_calls"] = runs[0].calls[key]
            row[f"{name}_ms"] = 1000 * statistics.median(r.seconds[key] for r in runs)
        ops.append(row)
    return {
        "model": model_name,
        "depth": depth,
        "batch": batch,
        "seq": seq,
        "hidden": hidden,
        "rounds": rounds,
        "step_ms": {k: 1000 * statistics.median(v) for k, v in steps.items()},
        "step_ratio": statistics.median(r / h for r, h in zip(steps["reversible"], steps["hf-checkpointing"])),
        "ops": ops,
    }


def markdown(result: dict[str, Any], meta: dict[str, Any], top: int) -> str:
    hf_ms, rev_ms = result["step_ms"]["hf-checkpointing"], result["step_ms"]["reversible"]
    ops = result["ops"]
    total = {v: sum(o[f"{v}_ms"] for o in ops) for v in ("hf-checkpointing", "reversible")}
    ops = sorted(ops, key=lambda o: -abs(o["reversible_ms"] - o["hf-checkpointing_ms"]))
    lines = [
        f"# Step time by operation: {result['model']} at depth {result['depth']}, hf-checkpointing against reversible",
        "",
        f"{meta['date']}, {meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}; batch "
        f"{result['batch']} x {result['seq']} tokens, hidden {result['hidden']}, float32, "
        f"`torch.set_num_threads(1)`, freed memory kept in the process (`mallopt`). Step: median of "
        f"{result['rounds']} interleaved rounds without the dispatch mode; operations: medians over the same rounds, "
        f"each step timed op by op under a dispatch mode (whose overhead both variants pay alike).",
        "",
        f"- step: hf-checkpointing {hf_ms:.0f} ms, reversible {rev_ms:.0f} ms, ratio {result['step_ratio']:.3f} "
        f"(median of the rounds' ratios)",
        f"- aten operations, timed: hf-checkpointing {total['hf-checkpointing']:.0f} ms, reversible "
        f"{total['reversible']:.0f} ms (difference {total['reversible'] - total['hf-checkpointing']:+.1f} ms)",
        "",
        f"The {top} groups with the largest difference:",
        "",
        "| operation | input shapes | hf calls | hf ms | reversible calls | reversible ms | difference ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in ops[:top]:
        hf, rev = o["hf-checkpointing_ms"], o["reversible_ms"]
        lines.append(
            f"| `{o['op']}` | {o['shapes']} | {o['hf-checkpointing_calls']} | {hf:.2f} | {o['reversible_calls']} | "
            f"{rev:.2f} | {rev - hf:+.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama", choices=sorted(hf_memory.MODELS))
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--top", type=int, default=16, help="operation groups listed")
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    hf_memory.fixed_malloc()
    warnings.filterwarnings("ignore")
    import transformers

    result = measure(args.model, args.depth, args.batch, args.seq, args.hidden, args.rounds)
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"hf_step_breakdown-cpu-{args.model}-d{args.depth}"
    stem.with_suffix(".json").write_text(json.dumps({**meta, **result}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(result, meta, args.top))
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
