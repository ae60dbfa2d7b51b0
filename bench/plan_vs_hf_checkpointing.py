#!/usr/bin/env python
"""``memory_efficient(model, "plan")`` against transformers' own checkpointing at Llama-3.2-1B's real shape: the
activation bytes of a training step and the FLOPs it runs (the recomputation's cost), counted, not timed.

transformers Llama with Llama-3.2-1B's config (hidden 2048, 32 heads, 8 kv heads, MLP 8192, vocabulary 128256),
bfloat16 weights, ``--layers`` decoder layers, a batch of 1 x ``--seq`` tokens, one step (forward with labels,
backward). The step runs on fake tensors (``FakeTensorMode``: nothing is allocated or computed, so the real shape
fits this machine): bytes are every tensor storage live at once (``revlib_xla.memory.StorageTracker``, the rise over
the weights and their gradients), FLOPs are ``torch.utils.flop_counter.FlopCounterMode``'s count of the step's
matrix products and attention. Variants: ``plain``; ``transformers checkpointing`` (``gradient_checkpointing_enable``,
non-reentrant, with the chunked loss as the plan has it); ``plan`` at transformers' activation bytes and at the
planner's smallest budget. A CPU or GPU run's time is not measured here.

Usage: ``python bench/plan_vs_hf_checkpointing.py [--layers 4,16] [--seq 2048] [--out bench/results/...md]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def measure(layers: int, seq: int) -> list[dict]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from revlib_xla.fit.gpu import _on_fake_host
    from revlib_xla.hf import chunked_loss, memory_efficient, model_from_config
    from revlib_xla.memory import StorageTracker

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        tokens = torch.zeros(1, seq, dtype=torch.int64)

    def make():
        model = model_from_config("llama-3.2-1b", num_hidden_layers=layers, device="meta", dtype=torch.bfloat16)
        model.config.use_cache = False
        _on_fake_host(model, mode)
        return model.train()

    def step(model):
        with mode:
            model(input_ids=tokens, labels=tokens).loss.backward()

    def counted(model):
        with mode:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            tracker = StorageTracker()
            tracker.track(model, tokens)
            with tracker:
                start = tracker.current()
                step(model)
                rise = tracker.peak() - start
            with FlopCounterMode(display=False) as flops:
                step(model)
        return rise, flops.get_total_flops()

    rows = []
    plain_bytes, plain_flops = counted(make())
    rows.append({"variant": "plain", "activation_bytes": plain_bytes, "flops": plain_flops})
    theirs_model = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        theirs_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    chunked_loss(theirs_model)
    theirs_bytes, theirs_flops = counted(theirs_model)
    rows.append({"variant": "transformers checkpointing", "activation_bytes": theirs_bytes, "flops": theirs_flops})
    planned = memory_efficient(make(), "plan")
    step(planned)
    checkpointable = planned.revlib_xla_conversion.runner.checkpointable
    for label, budget in (
        ("plan at transformers' bytes", theirs_bytes),
        ("plan at its smallest budget", checkpointable.min_memory() * 1.02),
    ):
        schedule = checkpointable.compute_sequence(budget)
        used, flops = counted(planned)
        rows.append(
            {
                "variant": label,
                "budget": budget,
                "activation_bytes": used,
                "flops": flops,
                "operations": schedule.counts(),
            }
        )
    for row in rows:
        row.update({"layers": layers, "seq": seq})
        row["flops_vs_plain"] = row["flops"] / plain_flops
        row["flops_vs_transformers"] = row["flops"] / theirs_flops
    return rows


def report(rows: list[dict]) -> str:
    gib = 2**30
    lines = [
        "# `plan` against transformers' checkpointing at Llama-3.2-1B's shape: bytes and FLOPs",
        "",
        "Written by `python bench/plan_vs_hf_checkpointing.py`. transformers Llama with Llama-3.2-1B's config, bf16",
        "weights, 1 x seq tokens, one training step run on fake tensors (nothing computed: bytes are every tensor",
        "storage live at once above the weights and their gradients, FLOPs are FlopCounterMode's count). Counted, not",
        f"timed; no GPU. torch {torch.__version__}, {datetime.date.today().isoformat()}.",
        "",
        "| layers | seq | variant | activation bytes | FLOPs | FLOPs / plain | FLOPs / transformers' | schedule |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ops = ", ".join(f"{k} {v}" for k, v in sorted(r.get("operations", {}).items()))
        lines.append(
            f"| {r['layers']} | {r['seq']} | {r['variant']} | {r['activation_bytes'] / gib:.3f} GiB | "
            f"{r['flops'] / 1e12:.3f} T | {r['flops_vs_plain']:.3f} | {r['flops_vs_transformers']:.3f} | {ops} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="4,16", help="comma-separated decoder depths")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "plan_vs_hf_checkpointing-fake-tensors.md"))
    args = parser.parse_args(argv)
    rows = [row for layers in args.layers.split(",") for row in measure(int(layers), args.seq)]
    out = Path(args.out)
    out.write_text(report(rows))
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
