#!/usr/bin/env python
"""revlib_xla.hf against transformers' own gradient checkpointing, on the same model and batch.

For a small Llama and a small GPT-2 (``revlib_xla.hf.model_from_config``, random weights, float32; hidden 256, 4
heads, byte vocabulary 256) at depth 32/16/8/4 (deepest first), on a batch of ``--batch`` (default 4) x 256 tokens (at
4, a layer boundary is 1 MiB, one layer's activations some 15 MiB, the logits 1 MiB: the layers, not the LM head, are
what is measured), one training step
(forward with labels, backward; ``use_cache=False``) of:

* ``plain``: the model as built;
* ``hf-checkpointing``: ``gradient_checkpointing_enable()`` (``activation_checkpointing_enable()`` where it exists);
* ``reversible``: ``memory_efficient(model, "reversible")``;
* ``plan@hf``: ``memory_efficient(model, "plan")`` with the largest budget (halving the gap to a lower one) whose
  measured peak is at most hf-checkpointing's.

Memory: the eager peak of the step (``revlib_xla.memory.eager_peak``, tensor storages tracked by PyTorch's
MemTracker: exact, the same from run to run); activation memory = peak - parameters - gradients (the bytes of the
parameters, twice). Time: the median of ``--repeats`` steps per variant, the variants interleaved in one process,
so the ratios compare like with like on a shared machine. Results: ``bench/results/hf_memory-<device>.{json,md,png}``.

Usage: ``python bench/hf_memory.py [--quick] [--repeats N] [--out-dir DIR]``.
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from revlib_xla import memory
from revlib_xla.hf import memory_efficient, model_from_config

MODELS = {"llama": "llama-tiny", "gpt2": "gpt2-tiny"}
SHAPES = {  # config overrides: the layer structure at a size where per-layer activations dominate
    "llama": {"hidden_size": 256, "intermediate_size": 640, "num_attention_heads": 4, "num_key_value_heads": 2},
    "gpt2": {"n_embd": 256, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
}
POSITIONS = {"llama": "max_position_embeddings", "gpt2": "n_positions"}
VARIANTS = ("plain", "hf-checkpointing", "reversible", "plan@hf")


def build(model: str, depth: int, seq: int) -> torch.nn.Module:
    torch.manual_seed(0)
    fields = {**SHAPES[model], POSITIONS[model]: seq}
    return model_from_config(MODELS[model], num_hidden_layers=depth, **fields).train()


def hf_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    return model


def step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    model(ids, labels=ids, use_cache=False).loss.backward()


def peak(model: torch.nn.Module, ids: torch.Tensor) -> memory.EagerPeak:
    step(model, ids)  # warm-up: plan measures and plans at its first training forward
    return memory.eager_peak(step, model, ids)


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def plan_at(
    reference: torch.nn.Module, ids: torch.Tensor, target: int, probes: int
) -> tuple[torch.nn.Module, int, float]:
    """The plan converted model with the largest budget found whose peak is within ``target`` bytes."""
    model = memory_efficient(copy.deepcopy(reference), "plan")
    step(model, ids)
    cp = model.revlib_xla_conversion.checkpointable
    low, high = cp.min_memory(), cp.no_checkpoint_memory()
    best: tuple[float, int] | None = None
    for _ in range(probes):
        budget = high if best is None and low >= high else (low + high) / 2
        cp.compute_sequence(budget)
        got = memory.eager_peak(step, model, ids).total
        if got <= target:
            best, low = (budget, got), budget
        else:
            high = budget
    if best is None:
        cp.compute_sequence(cp.min_memory())
        best = (cp.min_memory(), memory.eager_peak(step, model, ids).total)
    cp.compute_sequence(best[0])
    return model, best[1], best[0]


def timed(models: dict[str, torch.nn.Module], ids: torch.Tensor, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(repeats):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step(model, ids)
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def run(models: list[str], depths: list[int], batch: int, seq: int, repeats: int, probes: int) -> list[dict[str, Any]]:
    rows = []
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    for model_name in models:
        for depth in depths:
            base = build(model_name, depth, seq)
            models = {
                "plain": base,
                "hf-checkpointing": hf_checkpointing(copy.deepcopy(base)),
                "reversible": memory_efficient(copy.deepcopy(base), "reversible"),
            }
            peaks = {k: peak(m, ids).total for k, m in models.items()}
            plan_model, plan_peak, budget = plan_at(base, ids, peaks["hf-checkpointing"], probes)
            models["plan@hf"] = plan_model
            peaks["plan@hf"] = plan_peak
            times = timed(models, ids, repeats)
            weights = param_bytes(base)
            for variant in VARIANTS:
                rows.append(
                    {
                        "model": model_name,
                        "depth": depth,
                        "variant": variant,
                        "peak_bytes": peaks[variant],
                        "activation_bytes": peaks[variant] - 2 * weights,
                        "param_bytes": weights,
                        "step_s": times[variant],
                        "plan_budget_bytes": budget if variant == "plan@hf" else None,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# revlib_xla.hf against transformers' gradient checkpointing (eager peak, CPU)",
        "",
        f"{meta['date']}, {meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}; batch "
        f"{meta['batch']} x {meta['seq']} tokens, float32, hidden 256, vocabulary 256. Peak: MemTracker's eager "
        f"peak of one training step (exact). Activations = peak - parameters - gradients. Step: median of "
        f"{meta['repeats']} interleaved steps (forward + backward, `nice`), relative to hf-checkpointing's; load "
        f"average {meta['load_before']} before, {meta['load_after']} after the run.",
        "",
        "| model | depth | variant | peak MiB | activations MiB | act / hf-ckpt | step ms | step / hf-ckpt |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["model"], r["depth"], r["variant"]): r for r in rows}
    for r in rows:
        hf = by[(r["model"], r["depth"], "hf-checkpointing")]
        lines.append(
            f"| {r['model']} | {r['depth']} | {r['variant']} | {mib(r['peak_bytes'])} | {mib(r['activation_bytes'])} "
            f"| {r['activation_bytes'] / hf['activation_bytes']:.2f} | {1000 * r['step_s']:.1f} "
            f"| {r['step_s'] / hf['step_s']:.2f} |"
        )
    lines += ["", "## Verdicts", ""]
    for model_name in sorted({r["model"] for r in rows}, key=list(MODELS).index):
        depths = sorted({r["depth"] for r in rows if r["model"] == model_name})
        deepest = depths[-1]
        rev, hf, plan = (by[(model_name, deepest, v)] for v in ("reversible", "hf-checkpointing", "plan@hf"))
        growth = [by[(model_name, d, "reversible")]["activation_bytes"] for d in depths]
        act_ratio = rev["activation_bytes"] / hf["activation_bytes"]
        rev_time, plan_time = rev["step_s"] / hf["step_s"], plan["step_s"] / hf["step_s"]
        lines += [
            f"- {model_name}: reversible activations over depths {depths}: {', '.join(mib(g) for g in growth)} MiB "
            f"(spread {mib(max(growth) - min(growth))} MiB: it grows by parameters and gradients only).",
            f"- {model_name}, depth {deepest}: reversible's activations {act_ratio:.2f}x hf-checkpointing's "
            f"({'met' if act_ratio <= 0.5 else 'NOT met'}: <= 0.5) at {rev_time:.2f}x its step time "
            f"({'met' if rev_time <= 1.0 else 'NOT met'}: <= 1).",
            f"- {model_name}, depth {deepest}: plan@hf peak {mib(plan['peak_bytes'])} MiB (hf-checkpointing "
            f"{mib(hf['peak_bytes'])}) at {plan_time:.2f}x its step time "
            f"({'met' if plan['peak_bytes'] <= hf['peak_bytes'] and plan_time < 1.0 else 'NOT met'}: peak <= hf's, "
            f"time < 1).",
        ]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["model"] for r in rows}, key=list(MODELS).index)
    fig, axes = plt.subplots(1, len(names), figsize=(5.5 * len(names), 4), squeeze=False)
    for ax, model_name in zip(axes[0], names):
        for variant in VARIANTS:
            mine = [r for r in rows if (r["model"], r["variant"]) == (model_name, variant)]
            pts = sorted((r["depth"], r["peak_bytes"] / 2**20) for r in mine)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
        ax.set_title(f"tiny {model_name}: eager peak of a training step")
        ax.set_xlabel("layers")
        ax.set_ylabel("MiB")
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(rows: list[dict[str, Any]], meta: dict[str, Any], stem: Path) -> None:
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(rows, meta))
    plot(rows, stem.with_suffix(".png"))
    print(stem.with_suffix(".md").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="depths 2 and 4, batch 2 x 32 (a smoke test)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch (of 256 tokens)")
    parser.add_argument("--probes", type=int, default=6, help="plan@hf: budgets tried in the bisection")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: llama,gpt2")
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument(
        "--merge", nargs="+", metavar="JSON", help="write one report from the .json files of runs with other --models"
    )
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        parts = [json.loads(Path(f).read_text()) for f in args.merge]
        meta = dict(parts[0]["meta"])
        meta["load_after"] = parts[-1]["meta"]["load_after"]
        write([r for part in parts for r in part["rows"]], meta, out / "hf_memory-cpu")
        return
    # deepest first: the depth the criteria are about is measured first on a slow machine
    depths, batch, seq = ([4, 2], 2, 32) if args.quick else ([32, 16, 8, 4], args.batch, 256)
    load_before = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    warnings.filterwarnings("ignore")
    import transformers

    models = args.models.split(",")
    rows = run(models, depths, batch, seq, args.repeats, args.probes)
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "batch": batch,
        "seq": seq,
        "repeats": args.repeats,
        "load_before": load_before,
        "load_after": ", ".join(f"{x:.1f}" for x in os.getloadavg()),
        "threads": torch.get_num_threads(),
    }
    suffix = ("-quick" if args.quick else "") + ("" if models == list(MODELS) else "-" + "-".join(models))
    write(rows, meta, out / f"hf_memory-cpu{suffix}")


if __name__ == "__main__":
    main()
