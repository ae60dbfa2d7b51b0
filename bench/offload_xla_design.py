#!/usr/bin/env python
"""Which way should parameters stay off a TPU's HBM? The TPU compiler's answer, without a TPU.

Three graphs of a reversible model (Linear-GELU-Linear blocks), compiled for one TPU v5e chip by libtpu's deviceless
compiler (``revlib_xla.memory.tpu_memory``; nothing is executed):

* ``whole step``: forward + backward of all layers, parameters as graph arguments (no offload);
* ``whole step + place_to_host``: the same, every parameter use wrapped in ``place_to_device(place_to_host(w))``
  (torch_xla's host-placement annotations, the only in-graph host-memory tool it has);
* ``one layer``: forward + backward of one layer, the upper bound of the per-layer graphs ``target_device`` runs
  (each layer's parameters uploaded as the arguments of its own graph).

Prints and records the HBM peak, host bytes and argument bytes of each. Results:
``bench/results/offload_xla_design-tpu-v5e.md/.json``. Usage: ``python bench/offload_xla_design.py``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
from torch import nn

import revlib_xla as revlib
from revlib_xla import backends, memory


class HostAnnotatedLinear(nn.Linear):
    """``nn.Linear`` whose weight and bias pass through ``place_to_host`` then ``place_to_device`` at each use."""

    def forward(self, x):
        from torch_xla.experimental.stablehlo_custom_call import place_to_device, place_to_host

        return nn.functional.linear(
            x, place_to_device(place_to_host(self.weight)), place_to_device(place_to_host(self.bias))
        )


def step(model, x):
    loss = model(x).square().mean()
    loss.backward()
    return loss


def graphs(width: int, depth: int, batch: int) -> dict[str, str]:
    """StableHLO of the three graphs (see the module docstring)."""
    backends.device_for("xla")

    def model(n, linear):
        torch.manual_seed(0)
        blocks = [nn.Sequential(linear(width, 2 * width), nn.GELU(), linear(2 * width, width)) for _ in range(n)]
        return revlib.ReversibleSequential(*blocks, split_dim=-1)

    x = torch.randn(batch, 2 * width)
    return {
        "whole step": memory.step_stablehlo(step, model(depth, nn.Linear), x),
        "whole step + place_to_host": memory.step_stablehlo(step, model(depth, HostAnnotatedLinear), x),
        "one layer (target_device)": memory.step_stablehlo(step, model(1, nn.Linear), x),
    }


def measure(width: int = 512, depth: int = 8, batch: int = 64) -> dict[str, dict[str, float]]:
    texts = graphs(width, depth, batch)
    results = memory.tpu_memory_many(list(texts.values()), "v5e", cache=False)
    return {
        name: {
            "hbm_peak_bytes": r.hbm_peak_bytes,
            "host_bytes": r.host_bytes,
            "argument_bytes": r.argument_bytes,
            "host_annotations": texts[name].count("annotate_device_placement"),
        }
        for name, r in zip(texts, results)
    }


def main() -> int:
    width, depth, batch = 512, 8, 64
    out = measure(width, depth, batch)
    lines = [
        "# Parameters off the TPU's HBM: per-layer graphs vs in-graph host annotations",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}: TPU v5e (one chip), "
        f"deviceless compile with libtpu (nothing executed, no TPU used); {depth} reversible layers "
        f"Linear({width})-GELU-Linear, batch {batch}, float32, forward + backward.",
        "",
        "| graph | HBM peak (MiB) | host buffers (MiB) | arguments (MiB) | host annotations |",
        "|---|---|---|---|---|",
    ]
    for name, r in out.items():
        lines.append(
            f"| {name} | {r['hbm_peak_bytes'] / 2**20:.1f} | {r['host_bytes'] / 2**20:.1f} | "
            f"{r['argument_bytes'] / 2**20:.1f} | {r['host_annotations']} |"
        )
    lines += [
        "",
        "Host annotations move copies of the parameters to host memory inside the graph, but the "
        "parameters still arrive as HBM arguments; a per-layer graph holds one layer's parameters.",
    ]
    results = ROOT / "bench" / "results"
    (results / "offload_xla_design-tpu-v5e.json").write_text(
        json.dumps({"config": {"width": width, "depth": depth, "batch": batch}, "results": out}, indent=2) + "\n"
    )
    (results / "offload_xla_design-tpu-v5e.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
