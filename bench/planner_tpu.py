#!/usr/bin/env python
"""Planned peak against the TPU compiler's peak: an 8-block MLP planned by ``Checkpointable`` on XLA at budgets
from the smallest to the no-checkpoint peak; each planned training step is exported as StableHLO and compiled
deviceless for TPU v5e (no TPU is used). Activation memory of the compiled step = HBM peak - arguments - outputs +
the input (the planner's budget counts the input; arguments are parameters and input, outputs the gradients).

Writes ``bench/results/planner_tpu-v5e-deviceless.{json,md}``. Usage: ``PJRT_DEVICE=CPU python bench/planner_tpu.py``.
"""
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from revlib_xla import backend, memory  # noqa: E402

DEVICE = backend.device_for("xla")
import revlib_xla as revlib  # noqa: E402

WIDTH, HIDDEN, TOKENS, DEPTH = 256, 1024, 1024, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


def main():
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(DEPTH)]).to(DEVICE)
    x = torch.randn(TOKENS, WIDTH).to(DEVICE)
    planned = revlib.Checkpointable(model, input=x, tpu_generation="v5e")
    low, high = planned.min_memory(), planned.no_checkpoint_memory()
    rows, texts = [], []
    for fraction in (0.0, 0.15, 0.3, 0.5, 0.75, 1.0):
        planned.compute_sequence(low * 1.02 + fraction * (high - low * 1.02))
        rows.append({"fraction": fraction, "planned": planned.get_expected_memory(),
                     "ops": planned.sequence.counts()})
        texts.append(memory.step_stablehlo(lambda m, inp: planned(inp).sum().backward(), model, x))
    for row, compiled in zip(rows, memory.tpu_memory_many(texts, "v5e", cache=False)):
        row["compiled"] = compiled.hbm_peak_bytes - compiled.argument_bytes - compiled.output_bytes + TOKENS * WIDTH * 4
        row["ratio"] = row["compiled"] / row["planned"]
    out = ROOT / "bench" / "results" / "planner_tpu-v5e-deviceless"
    out.with_suffix(".json").write_text(json.dumps(rows, indent=2))
    lines = ["# Planned peak vs TPU v5e compiled peak (deviceless compile, no TPU run)", "",
             f"{DEPTH} blocks x -> x + Linear({HIDDEN}->{WIDTH})(tanh(Linear({WIDTH}->{HIDDEN})(x))), {TOKENS} tokens, "
             f"fp32. Compiled activation memory = HBM peak - arguments - outputs + input.", "",
             "| budget position | planned (MiB) | compiled (MiB) | compiled / planned | operations |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['fraction']:.2f} | {row['planned'] / 2**20:.2f} | {row['compiled'] / 2**20:.2f} | "
                     f"{row['ratio']:.3f} | {row['ops']} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
