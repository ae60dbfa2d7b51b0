"""What per-parameter gradient clipping costs a fused optimizer step, at Llama-3.2-1B's width.

A fused step (``revlib_xla.fuse_optimizer``) updates each parameter inside the backward pass, so it cannot clip by
the global norm; ``max_grad_norm`` clips each parameter's gradient by its own norm right before its step. This
times, interleaved round by round in one process, a training step of a few Llama-3.2-1B-shaped layers (hidden 2048,
intermediate 8192, 32 heads, 8 kv heads, vocabulary 128256, untied head) with

* ``fused``: the fused step without clipping;
* ``fused + max_grad_norm``: the fused step clipping each parameter's gradient;
* ``unfused + clip_grad_norm_``: backward, ``torch.nn.utils.clip_grad_norm_`` over all gradients, ``step()``,

and reports medians and each variant's ratio to ``fused``. SGD keeps the optimizer's own share of the step small, so
the clipping's share is not diluted by AdamW's.

    nice .venv/bin/python bench/fused_clip_cost.py [--layers 2 --seq 128 --rounds 5] [--out bench/results/...md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import revlib_xla as revlib
from revlib_xla.models.llama import build_llama, llama_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    config = llama_config("llama-1b", n_layers=args.layers, tie_embeddings=False)
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (1, args.seq))
    sgd = lambda params: torch.optim.SGD(params, lr=1e-4)
    model = build_llama(config, "plain")
    params = sum(p.numel() for p in model.parameters())

    def fused_step(max_grad_norm: float | None) -> float:
        fused = revlib.fuse_optimizer(model, sgd, max_grad_norm=max_grad_norm)
        try:
            start = time.perf_counter()
            model.loss(tokens).backward()
            fused.step()
            return time.perf_counter() - start
        finally:
            fused.remove()

    unfused_opt = sgd(model.parameters())

    def unfused_step() -> float:
        start = time.perf_counter()
        model.loss(tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        unfused_opt.step()
        unfused_opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    variants = {
        "fused": lambda: fused_step(None),
        "fused + max_grad_norm": lambda: fused_step(1.0),
        "unfused + clip_grad_norm_": unfused_step,
    }
    for run in variants.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            times[name].append(run())
    base = statistics.median(times["fused"])
    lines = [
        "# Per-parameter clipping in a fused step: cost",
        "",
        f"{args.layers} layers of Llama-3.2-1B's shape (hidden 2048, vocab 128256, untied head; {params / 1e6:.0f}M "
        f"parameters), batch 1 x {args.seq} tokens, SGD, {args.rounds} interleaved rounds after one warm-up; "
        f"{platform.machine()} CPU, torch {torch.__version__}, {torch.get_num_threads()} threads.",
        "",
        "| variant | median step (s) | range (s) | ratio to fused (median of per-round ratios) |",
        "|---|---|---|---|",
    ]
    for name, values in times.items():
        ratio = statistics.median(v / f for v, f in zip(values, times["fused"]))
        lines.append(
            f"| {name} | {statistics.median(values):.3f} | {min(values):.3f}-{max(values):.3f} | {ratio:.3f} |"
        )
    per_round = [f"{v / f:.3f}" for v, f in zip(times["fused + max_grad_norm"], times["fused"])]
    lines += ["", f"fused median {base:.3f} s; fused + max_grad_norm / fused per round: {', '.join(per_round)}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
