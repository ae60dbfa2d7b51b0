#!/usr/bin/env python
"""Memory of building a model under a mesh: the weights initialised piece by piece on the devices
(``revlib_xla.sharding.ShardedWriter``, what ``build_model`` does under a mesh) against drawn whole, put whole on
every device and split after (what it did before).

One process drives 4 XLA:CPU devices (SPMD, ``mesh.fsdp=4``), where device memory is host memory: the process's
resident memory, sampled every 0.5 ms while ``build_model`` runs, is host and devices together. Each way runs in a
fresh process (the peak is of that build alone). Results go to ``bench/results/spmd_init-xla-cpu.{md,json}``.

Usage: ``python bench/spmd_init.py [--vocab 32768] [--dim 512]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 4
WAYS = ("piece by piece", "whole, split after")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(way: str, vocab: int, dim: int) -> dict[str, float]:
    """In this (fresh) process: the peak resident memory growth of one build_model under a mesh of 4 devices."""
    sys.path.insert(0, str(ROOT))
    import torch

    from revlib_xla import backends, sharding
    from revlib_xla.train import strategy
    from revlib_xla.train.config import load_config

    cfg = load_config(
        None,
        [
            f"model.overrides={{vocab_size: {vocab}, dim: {dim}, n_layers: 2, n_heads: 4, n_kv_heads: 2, "
            f"ffn_dim: {3 * dim}}}",
            "data.seq_len=16",
            "data.batch_size=8",
            "strategy=reversible",
            "train.device=xla",
            "mesh.fsdp=-1",
        ],
    )
    assert sharding.apply_mesh(cfg) is not None
    xla = backends.device_for("xla")
    torch.zeros(1, device=xla)
    backends.sync(xla)
    if way == WAYS[1]:  # every weight copied whole (to every device), then split by shard_model
        sharding.ShardedWriter = lambda *args, **kwargs: None  # type: ignore[assignment,misc]
    peak, done = [0], [False]

    def poll() -> None:
        while not done[0]:
            peak[0] = max(peak[0], _rss())
            time.sleep(0.0005)

    before = _rss()
    sampler = threading.Thread(target=poll)
    sampler.start()
    lm = strategy.language_model(strategy.build_model(cfg, xla))
    backends.sync(xla)
    done[0] = True
    sampler.join()
    return {
        "model_bytes": sum(p.numel() * p.element_size() for p in lm.parameters()),
        "largest_bytes": max(p.numel() * p.element_size() for p in lm.parameters()),
        "peak_growth_bytes": peak[0] - before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    if args.way:
        print(json.dumps(measure(args.way, args.vocab, args.dim)))
        return
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(DEVICES)}
    rows = []
    for way in WAYS:
        command = [sys.executable, __file__, "--way", way, "--vocab", str(args.vocab), "--dim", str(args.dim)]
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
        rows.append({"way": way, **json.loads(out.strip().splitlines()[-1])})
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"XLA:CPU ({platform.processor() or platform.machine()}), {DEVICES} SPMD devices, fsdp={DEVICES}",
        "vocab": args.vocab,
        "dim": args.dim,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "spmd_init-xla-cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    mib = 2**20
    lines = [
        "# Building a model under a mesh: peak memory of the weights' initialisation",
        "",
        f"{meta['device']}; reversible Llama, vocab {args.vocab}, dim {args.dim}, 2 layers, float32; {meta['date']}. "
        f"Made by `bench/spmd_init.py`. Peak growth: the process's resident memory (host and the XLA:CPU devices "
        f"together) during `build_model`, above what it held before.",
        "",
        "| initialisation | model (MiB) | largest weight (MiB) | peak growth (MiB) | growth / model |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['way']} | {row['model_bytes'] / mib:.0f} | {row['largest_bytes'] / mib:.0f} | "
            f"{row['peak_growth_bytes'] / mib:.0f} | {row['peak_growth_bytes'] / row['model_bytes']:.2f}x |"
        )
    (out_dir / "spmd_init-xla-cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
