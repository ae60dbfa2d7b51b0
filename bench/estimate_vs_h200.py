"""The GPU estimate beside the one GPU run on record (one H200, 2026-11-28, ../shared/notes/realscale.md): the same
steps sized on fake tensors (tensor storages in the CUDA allocator's 512-byte blocks, as ``revlib-xla memory --gpu``
counts them), nothing allocated.

* ``revlib-xla train``'s llama-1b (Llama-3.2-1B's shape), 8 x 2048 tokens, bf16 autocast, AdamW: what stays
  allocated between steps (the H200 logged it as ``memory_bytes``) is the weights and AdamW's state, the estimate's
  *parameters* + *optimizer state*; the step's peak beside it (the H200 run logged no peak in the note);
* transformers' Llama with Llama-3.2-1B's shape, bf16 weights, sdpa, 8 x 2048, one forward and backward: plain and
  with transformers' own checkpointing (non-reentrant): the peak above nothing (the H200 measured
  ``torch.cuda.max_memory_allocated`` from an empty device, weights included).

    python bench/estimate_vs_h200.py [--out bench/results/estimate_vs_h200-fake-tensors.md]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

GB = 1e9


def cli_rows() -> list[tuple[str, str, str]]:
    from revlib_xla.fit.chips import chip
    from revlib_xla.fit.gpu import estimate_step, for_gpu
    from revlib_xla.fit.strategies import STRATEGIES, load

    size = ["model.name=llama-1b", "data.seq_len=2048", "data.batch_size=8", "strategy.precision=bf16"]
    rows = []
    measured = {"none": 14.90, "plan": 43.79}
    for name in ("none", "plan"):
        step = estimate_step(for_gpu(load(None, size, STRATEGIES[name]), chip("h200")))
        between = (step.parameters + step.optimizer) / GB
        rows.append(
            (
                f"CLI llama-1b 8 x 2048 bf16, `{name}`: allocated between steps",
                f"{measured[name]:.2f} GB",
                f"{between:.2f} GB (weights {step.parameters / GB:.2f} + AdamW state {step.optimizer / GB:.2f}); "
                f"step peak {step.peak / GB:.2f} GB, in the {max(step.phases, key=lambda p: p[1])[0]}",
            )
        )
    return rows


def hf_rows() -> list[tuple[str, str, str]]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from revlib_xla.fit.gpu import _on_fake_host
    from revlib_xla.hf import model_from_config
    from revlib_xla.memory import StorageTracker

    rows = []
    for label, measured, checkpointing in (("plain", 60.72, False), ("transformers' checkpointing", 33.30, True)):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = model_from_config("llama-3.2-1b", device="meta", dtype=torch.bfloat16, attn_implementation="sdpa")
        model.config.use_cache = False
        _on_fake_host(model, mode)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        with mode:
            tokens = torch.zeros(8, 2048, dtype=torch.int64)
        tracker = StorageTracker()
        tracker.track(model, tokens)
        with tracker, mode:
            model(input_ids=tokens, labels=tokens).loss.backward()
        rows.append(
            (
                f"transformers Llama-3.2-1B shape, bf16, sdpa, 8 x 2048, forward + backward: {label}",
                f"{measured:.2f} GB",
                f"{tracker.peak('cpu') / GB:.2f} GB",
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/estimate_vs_h200-fake-tensors.md")
    args = parser.parse_args()
    start = time.perf_counter()
    rows = cli_rows() + hf_rows()
    lines = [
        "# The GPU estimate beside the H200 run of 2026-11-28",
        "",
        "`python bench/estimate_vs_h200.py`: the H200's figures from ../shared/notes/realscale.md (one NVIDIA H200, "
        "torch 2.11.0+cu130; `torch.cuda` allocator statistics), the estimate from fake tensors on this project's "
        f"2-core CPU with torch {torch.__version__} ({time.perf_counter() - start:.0f} s), not a GPU run. The "
        "H200 run was made at an older commit: what changed since (the chunked loss, exact streams, the planner's "
        "budget) changes some steps.",
        "",
        "| step | H200, measured | estimate (fake tensors) |",
        "|---|---|---|",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
        "- `none` between steps: the estimate is 0.5 % (70 MB) below the H200's: what the estimate does not "
        "count (cuBLAS's workspace, which torch allocates through its caching allocator, and the batch).",
        "- `plan` between steps: the H200's 43.79 GB (29 GB more than `none`) was the planner's measurement under "
        "PyTorch's MemTracker keeping a whole step's activations alive, fixed since "
        "(tests/memory/test_memory_between_steps.py, on the CPU's allocator); the estimate is what should stay. Not "
        "re-measured on a GPU.",
        "- transformers' plain step: the estimate 2.6 % below the H200's.",
        "- transformers' checkpointing: the estimate is 4.2 GB (12.7 %) below the H200's, about one bfloat16 logits "
        "tensor (8 x 2048 x 128256 x 2 bytes = 4.20 GB). Not explained without a GPU run; candidates: the GPU "
        "image's transformers 5.17 against 5.23 here (its loss's upcast of the logits), and CUDA's cross-entropy "
        "kernels holding a copy the CPU's meta functions do not. `make gpu-8b` and `make gpu-check` record the "
        "estimate beside each measured step when a GPU is lent.",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
