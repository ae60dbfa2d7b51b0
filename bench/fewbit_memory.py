#!/usr/bin/env python
"""FewBit's README table, reproduced on a scaled-down RoBERTa-like encoder: training-step peak memory for

* ``vanilla``     - nn.GELU and nn.Linear;
* ``gelu-3bit``   - every GELU replaced by ``fewbit.GELU(bits=3)``;
* ``randomized``  - every nn.Linear of the encoder (q, k, v, output, both FFN layers) replaced by
  ``fewbit.RandomizedLinear(proj_dim_ratio=0.2)`` (the classifier head stays);
* ``both``.

Two measurements per variant, from the same weights and batch: the eager peak of one training step (forward, loss,
backward) on the CPU by PyTorch's MemTracker (``revlib_xla.memory.eager_peak``), and the HBM peak the TPU v5e
compiler plans for the same step traced on XLA (``step_stablehlo`` + ``tpu_memory``; a deviceless compile, not a
TPU run). Results go to ``bench/results/fewbit_memory-<device>.json`` and ``.md``.

Usage: ``python bench/fewbit_memory.py [--quick] [--no-tpu] [--out-dir DIR]``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from revlib_xla import backends, fewbit, memory

CONFIGS = {
    "full": dict(vocab=1000, width=256, heads=4, hidden=1024, layers=4, seq=128, batch=16),
    "quick": dict(vocab=100, width=32, heads=2, hidden=64, layers=2, seq=16, batch=4),
}
VARIANTS = ("vanilla", "gelu-3bit", "randomized", "both")


class Layer(nn.Module):
    """A post-norm RoBERTa layer with separate q/k/v/output projections (every one an nn.Linear)."""

    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.ff1, self.act, self.ff2 = nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        split = lambda t: t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
        attn = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        x = self.norm1(x + self.o(attn.transpose(1, 2).reshape(b, s, d)))
        return self.norm2(x + self.ff2(self.act(self.ff1(x))))


class Encoder(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, hidden: int, layers: int, seq: int, **_: Any) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.layers = nn.ModuleList(Layer(width, heads, hidden) for _ in range(layers))
        self.head = nn.Linear(width, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position.weight[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h)
        return self.head(h[:, 0])


def variant(model: nn.Module, name: str) -> nn.Module:
    model = copy.deepcopy(model)
    if name in ("gelu-3bit", "both"):
        model = fewbit.map_module(model, lambda m: fewbit.convert_activation(m, bits=3))
    if name in ("randomized", "both"):
        model = fewbit.map_module(
            model, lambda m: fewbit.convert_linear(m, fewbit.RandomizedLinear, proj_dim_ratio=0.2), patt=r"layers\..*"
        )
    return model


def step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(tokens), labels)
    loss.backward()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-tpu", action="store_true", help="skip the deviceless TPU v5e compile")
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    cfg = CONFIGS["quick" if args.quick else "full"]
    tpu = not args.no_tpu and backends.xla_available() and importlib.util.find_spec("libtpu") is not None
    if tpu:
        backends.device_for("xla")  # start torch_xla's runtime before the first backward (see README, XLA)
    torch.manual_seed(0)
    base = Encoder(**cfg)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]))
    labels = torch.randint(0, 2, (cfg["batch"],))
    rows: dict[str, dict[str, Any]] = {}
    for name in VARIANTS:
        eager = memory.eager_peak(step, variant(base, name), tokens, labels)
        rows[name] = {"eager_peak": eager.total, "eager_activations": eager.activations}
    if tpu:
        texts = [memory.step_stablehlo(step, variant(base, name), tokens, labels) for name in VARIANTS]
        for name, mem in zip(VARIANTS, memory.tpu_memory_many(texts, "v5e")):
            rows[name]["tpu_v5e_hbm_peak"] = mem.hbm_peak_bytes
    device = "cpu"  # results are filed as <benchmark>-<device>: cpu, xla-cpu, cuda-<gpu>
    result = {
        "config": cfg,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "device": device,
        "rows": rows,
    }
    lines = [
        f"# FewBit memory table, scaled-down RoBERTa ({cfg['layers']} layers, width {cfg['width']}, "
        f"FFN {cfg['hidden']}, batch {cfg['batch']} x {cfg['seq']} tokens, fp32)",
        "",
        "Peak of one training step (forward, loss, backward). Eager: CPU, PyTorch MemTracker. TPU v5e: HBM peak "
        "planned by the TPU compiler for the same step (deviceless compile, not a TPU run).",
        "",
        "| variant | eager peak | saving | activations at the peak | TPU v5e HBM peak | saving |",
        "|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        r, v = rows[name], rows["vanilla"]
        tpu_cells = (
            (
                f"{memory.format_bytes(r['tpu_v5e_hbm_peak'])} | "
                f"{100 * (1 - r['tpu_v5e_hbm_peak'] / v['tpu_v5e_hbm_peak']):.1f} %"
            )
            if tpu
            else "- | -"
        )
        lines.append(
            f"| {name} | {memory.format_bytes(r['eager_peak'])} | "
            f"{100 * (1 - r['eager_peak'] / v['eager_peak']):.1f} % | "
            f"{memory.format_bytes(r['eager_activations'])} | {tpu_cells} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"fewbit_memory-{device}" + ("-quick" if args.quick else "")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text(text)


if __name__ == "__main__":
    main()
