#!/usr/bin/env python
"""What ``verify_inverse`` costs: :func:`revlib_xla.check_invertible` (run once, at the first training forward of a
model whose couplings are not additive) against one training step of the same model, in CPU process time with one
thread, on small and on real-size layers (momentum coupling, beta 0.9, float32).

Usage: ``python bench/verify_inverse_cost.py [--out bench/results/verify_inverse_cost-cpu.md]``.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import torch
from torch import nn

import revlib_xla as revlib


class Attention(nn.Module):
    """Pre-LN multi-head self-attention with an output projection."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        h = self.norm(x)
        return self.proj(self.attn(h, h, h, need_weights=False)[0])


def mlp(width: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


CASES = [  # name, blocks, input shape (two streams along the last dim), repetitions
    ("MLP 16-16-16, batch 8, 8 layers", lambda: [mlp(16, 16) for _ in range(8)], (8, 32), 20),
    ("MLP 1024-4096-1024, 2x128 tokens, 4 layers", lambda: [mlp(1024, 4096) for _ in range(4)], (2, 128, 2048), 3),
    (
        "attention width 512, 8 heads, 2x256 tokens, 4 layers",
        lambda: [Attention(512, 8) for _ in range(4)],
        (2, 256, 1024),
        3,
    ),
]


def process_time(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm-up
    start = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="", help="also write the table to this markdown file")
    out = parser.parse_args().out
    torch.set_num_threads(1)
    rows: list[str] = []
    for name, make, shape, reps in CASES:
        torch.manual_seed(0)
        pair = revlib.momentum_coupling(0.9)
        model = revlib.ReversibleSequential(
            *make(),
            split_dim=-1,
            coupling_forward=[pair.forward],
            coupling_inverse=[pair.inverse],
            verify_inverse=False,
        )
        x = torch.randn(*shape, requires_grad=True)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()

        def forward() -> None:
            with torch.no_grad():
                model(x)

        t_step, t_forward = process_time(step, reps), process_time(forward, reps)
        t_check = process_time(lambda: revlib.check_invertible(model, x.detach()), reps)
        rows.append(
            f"| {name} | {t_step * 1e3:.1f} | {t_forward * 1e3:.1f} | {t_check * 1e3:.1f} | "
            f"{t_check / t_step:.2f} | {t_check / t_forward:.2f} |"
        )
    table = "\n".join(
        [
            f"verify_inverse's check against a training step: CPU process time, 1 thread, torch {torch.__version__}, "
            f"{platform.processor() or platform.machine()}",
            "",
            "| layers | training step (ms) | no-grad forward (ms) | check (ms) | check / step | check / forward |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
