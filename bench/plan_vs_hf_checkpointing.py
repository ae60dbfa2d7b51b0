#!/usr/bin/env python
"""``memory_efficient(model, "plan")`` against transformers' own checkpointing at Llama-3.2-1B's real shape: the
activation bytes of a training step and the FLOPs it runs (the recomputation's cost), counted, not timed.

transformers Llama with Llama-3.2-1B's config (hidden 2048, 32 heads, 8 kv heads, MLP 8192, vocabulary 128256),
``--layers`` decoder layers, a batch of 1 x ``--seq`` tokens, one step (forward with labels, backward). The step
runs on bf16 fake tensors (``FakeTensorMode``: nothing is allocated or computed, so any size fits this machine), or
with ``--real`` on float32 CPU tensors. Bytes are every tensor storage live at once
(``revlib_xla.memory.StorageTracker``, the rise over the weights and their gradients); FLOPs are
``torch.utils.flop_counter.FlopCounterMode``'s count of the step's matrix products and attention. Variants:
``plain``; ``transformers checkpointing`` (``gradient_checkpointing_enable``, non-reentrant, with the chunked loss
as the plan has it); ``plan`` at transformers' activation bytes, 5 % above them and at the planner's smallest
budget.

Usage: ``python bench/plan_vs_hf_checkpointing.py [--layers 4,16] [--seq 2048] [--real] [--append]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def measure(layers: int, seq: int, real: bool = False) -> list[dict]:
    """Rows for one depth; ``real``: float32 tensors that hold data on the CPU instead of bf16 fake tensors."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from revlib_xla.fit.gpu import _on_fake_host
    from revlib_xla.hf import chunked_loss, memory_efficient, model_from_config
    from revlib_xla.memory import StorageTracker

    mode: Any = contextlib.nullcontext() if real else FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        tokens = torch.randint(0, 128256, (1, seq), generator=torch.Generator().manual_seed(0)) if real else None
        tokens = tokens if real else torch.zeros(1, seq, dtype=torch.int64)

    def make():
        torch.manual_seed(0)
        if real:
            model = model_from_config("llama-3.2-1b", num_hidden_layers=layers, dtype=torch.float32)
        else:
            model = model_from_config("llama-3.2-1b", num_hidden_layers=layers, device="meta", dtype=torch.bfloat16)
            _on_fake_host(model, mode)
        model.config.use_cache = False
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
    del theirs_model  # one model's weights and gradients at a time (16 float32 layers: 10 GB each)
    planned = memory_efficient(make(), "plan")
    step(planned)
    checkpointable = planned.revlib_xla_conversion.runner.checkpointable
    for label, budget in (
        ("plan at transformers' bytes", theirs_bytes),
        ("plan at 1.05 x transformers' bytes", theirs_bytes * 1.05),
        ("plan at 1.25 x transformers' bytes", theirs_bytes * 1.25),
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
        row.update({"layers": layers, "seq": seq, "tensors": "float32, real (CPU)" if real else "bf16, fake"})
        row["flops_vs_plain"] = row["flops"] / plain_flops
        row["flops_vs_transformers"] = row["flops"] / theirs_flops
    return rows


def report(rows: list[dict]) -> str:
    gib = 2**30
    lines = [
        "# `plan` against transformers' checkpointing at Llama-3.2-1B's shape: bytes and FLOPs",
        "",
        "Written by `python bench/plan_vs_hf_checkpointing.py [--real]`. transformers Llama with Llama-3.2-1B's",
        "config, 1 x seq tokens, one training step: on bf16 fake tensors (nothing computed, any size) or, `--real`, on",
        "float32 tensors on the CPU. Bytes are every tensor storage live at once above the weights and their",
        "gradients, FLOPs FlopCounterMode's count. Counted, not timed; no GPU. Both stop each recomputation at the",
        "last tensor its backward reads (torch's non-reentrant checkpoint, the planner's executor), on fake tensors",
        "as on real ones; on fake tensors the planner prices stages in counted FLOPs.",
        f"torch {torch.__version__}, {datetime.date.today().isoformat()}.",
        "",
        "| tensors | layers | seq | variant | activation bytes | FLOPs | FLOPs / plain | FLOPs / transformers' "
        "| schedule |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ops = ", ".join(f"{k} {v}" for k, v in sorted(r.get("operations", {}).items()))
        lines.append(
            f"| {r['tensors']} | {r['layers']} | {r['seq']} | {r['variant']} | {r['activation_bytes'] / gib:.3f} GiB | "
            f"{r['flops'] / 1e12:.3f} T | {r['flops_vs_plain']:.3f} | {r['flops_vs_transformers']:.3f} | {ops} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="4,16", help="comma-separated decoder depths")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--real", action="store_true", help="float32 tensors that hold data, on the CPU (slow)")
    parser.add_argument("--append", action="store_true", help="add the rows to those already in the .json")
    parser.add_argument("--out", default=None, help="default: bench/results/plan_vs_hf_checkpointing-<kind>.md")
    args = parser.parse_args(argv)
    kind = "cpu" if args.real else "fake-tensors"
    out = Path(args.out or ROOT / "bench" / "results" / f"plan_vs_hf_checkpointing-{kind}.md")
    rows = json.loads(out.with_suffix(".json").read_text()) if args.append else []
    rows += [row for layers in args.layers.split(",") for row in measure(int(layers), args.seq, args.real)]
    out.write_text(report(rows))
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
