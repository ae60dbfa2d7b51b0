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
* ``plan@hf`` (``plan@hf+layer``): ``memory_efficient(model, "plan")`` with the largest budget (bisected) whose
  measured peak is at most hf-checkpointing's.

Memory: the eager peak of the step (``revlib_xla.memory.eager_peak``, tensor storages tracked by PyTorch's
MemTracker: exact, the same from run to run); activation memory = peak - parameters - gradients (the bytes of the
parameters, twice). Time: the median of ``--repeats`` steps per variant, the variants interleaved in one process,
so the ratios compare like with like on a shared machine, with freed memory kept in the process (:func:`fixed_malloc`)
so that no variant pays page faults that another's allocations caused. Results:
``bench/results/hf_memory-<device>.{json,md,png}``.

Usage: ``python bench/hf_memory.py [--quick] [--repeats N] [--out-dir DIR]``.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from revlib_xla import memory
from revlib_xla.hf import memory_efficient, model_from_config
from revlib_xla.planner import InfeasibleBudget

MODELS = {"llama": "llama-tiny", "gpt2": "gpt2-tiny"}
POSITIONS = {"llama": "max_position_embeddings", "gpt2": "n_positions"}
VARIANTS = ("plain", "hf-checkpointing", "reversible", "plan@hf", "plan@hf+layer", "plan-min")


def shape(model: str, hidden: int) -> dict[str, Any]:
    """Config overrides: the layer structure at ``hidden`` (4 heads; Llama's MLP 2.5 x hidden, GPT-2's 4 x)."""
    if model == "llama":
        return {
            "hidden_size": hidden,
            "intermediate_size": 5 * hidden // 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    return {"n_embd": hidden, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def build(model: str, depth: int, seq: int, hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    fields = {**shape(model, hidden), POSITIONS[model]: seq}
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


class OpCount(TorchDispatchMode):
    """The aten operations a step runs and their FLOPs (``torch.utils.flop_counter``'s formulas): deterministic, so
    the step-time ratios can be explained on a machine too loaded to time. (``FlopCounterMode`` itself cannot count
    the reversible step: its module tracker's multi-gradient hooks refuse the backward's nested ``autograd.grad``.)"""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.flops = 0
        self.flop_ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **(kwargs or {}), out_val=out)
            self.flop_ops += 1
        return out


def counted(model: torch.nn.Module, ids: torch.Tensor) -> OpCount:
    """The operations and FLOPs of one training step of ``model``."""
    model.zero_grad(set_to_none=False)
    with OpCount() as count:
        step(model, ids)
    return count


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def recomputed(model: torch.nn.Module) -> int:
    """Layer forwards a plan runs beyond one per layer (its ``Fn``/``CF`` operations: checkpointed recomputation)."""
    cp = model.revlib_xla_conversion.checkpointable
    counts = cp.sequence.counts()
    return counts.get("Fn", 0) + counts.get("CF", 0) + counts.get("Fe", 0) - cp.chain.length


def smallest_budget(cp: Any) -> float:
    """Plan the smallest schedule: at ``min_memory()``, or a hair above it where the solver's rounding of sizes to
    its memory slots does not fit at the exact minimum; returns the budget planned at."""
    for k in range(16):
        budget = cp.min_memory() * (1 + k / 500)
        try:
            cp.compute_sequence(budget)
            return budget
        except InfeasibleBudget:
            continue
    raise InfeasibleBudget(f"hf_memory: no plan within 3 % of min_memory() ({cp.min_memory():.6g} bytes)", budget)


def plan_at(
    reference: torch.nn.Module, ids: torch.Tensor, target: int | None, probes: int
) -> tuple[torch.nn.Module, memory.EagerPeak, float]:
    """The plan converted model with the largest budget found whose measured peak is within ``target`` bytes (the
    smallest plan when ``target`` is None or nothing larger fits), its peak and its budget."""
    model = memory_efficient(copy.deepcopy(reference), "plan")
    step(model, ids)
    cp = model.revlib_xla_conversion.checkpointable
    # The budget counts the chain's activations (and the head's, as the plan's loss stage) by what each stage
    # measured alone; the step's peak counts parameters too, and the planner's sizes are upper bounds, so a budget
    # somewhat above the target may still fit it: the bracket reaches 1.5 x the target (7 probes: 1/128 of it).
    low, high = cp.min_memory(), min(cp.no_checkpoint_memory(), 1.5 * target if target is not None else 0.0)
    best: tuple[float, memory.EagerPeak] | None = None
    for _ in range(probes if high > low else 0):
        budget = (low + high) / 2
        cp.compute_sequence(budget)
        got = memory.eager_peak(step, model, ids)
        if target is not None and got.total <= target:
            best, low = (budget, got), budget
        else:
            high = budget
    if best is None:
        budget = smallest_budget(cp)
        best = (budget, memory.eager_peak(step, model, ids))
    cp.compute_sequence(best[0])
    return model, best[1], best[0]


def timed(
    models: dict[str, torch.nn.Module], ids: torch.Tensor, repeats: int
) -> dict[str, tuple[float, float, list[float], float]]:
    """Per variant: the median step time, the median of its per-round ratios to hf-checkpointing's (variants
    interleaved round by round: a load change hits all of them alike), those ratios, and the median minor page
    faults per step."""
    times: dict[str, list[float]] = {k: [] for k in models}
    faults: dict[str, list[int]] = {k: [] for k in models}
    for _ in range(repeats):
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            before = minor_faults()
            start = time.perf_counter()
            step(model, ids)
            times[name].append(time.perf_counter() - start)
            faults[name].append(minor_faults() - before)
    hf = times["hf-checkpointing"]
    ratios = {k: [t / h for t, h in zip(v, hf, strict=True)] for k, v in times.items()}
    return {
        k: (statistics.median(v), statistics.median(ratios[k]), ratios[k], statistics.median(faults[k]))
        for k, v in times.items()
    }


def fixed_malloc() -> bool:
    """Keep freed memory in the process (glibc ``mallopt``), as a device's caching allocator keeps it; returns
    whether it could.

    By default glibc hands large blocks back to the system and page-faults them in again, depending on what the
    process allocated before. Measured on this machine (Llama, depth 32): hf-checkpointing took some 30,000 minor
    page faults per step in a process with only the reversible model beside it and next to none beside the plain
    model; reversible took 8,800 alone in its process and none beside hf-checkpointing; the ratio of their step
    times moved between 0.99 and 1.05 with it. With the mmap threshold at its largest (32 MiB) and no trimming, the
    timed steps fault next to never, whatever ran before. The peaks (tensor storages, MemTracker) do not depend on
    it."""
    name = ctypes.util.find_library("c")
    if name is None or platform.system() != "Linux":
        return False
    libc = ctypes.CDLL(name)
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 32 * 2**20)) and bool(libc.mallopt(m_trim_threshold, 2**62))


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def load() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def run(
    models: list[str],
    depths: list[int],
    batch: int,
    seq: int,
    hidden: int,
    repeats: int,
    probes: int,
    log: Path,
    timed_depths: list[int],
    skip: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    rows = []
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    for model_name in models:
        for depth in depths:
            if f"{model_name}:{depth}" in skip:
                continue
            base = build(model_name, depth, seq, hidden)
            models = {
                "plain": base,
                "hf-checkpointing": hf_checkpointing(copy.deepcopy(base)),
                "reversible": memory_efficient(copy.deepcopy(base), "reversible"),
            }
            peaks = {k: peak(m, ids) for k, m in models.items()}
            budgets: dict[str, float | None] = {}
            models["plan@hf"], peaks["plan@hf"], budgets["plan@hf"] = plan_at(
                base, ids, peaks["hf-checkpointing"].total, probes
            )
            # "a bit above": hf-checkpointing's peak and one layer's activations (what autograd keeps of it)
            above = (
                peaks["hf-checkpointing"].total + models["plan@hf"].revlib_xla_conversion.checkpointable.chain.cbw[1]
            )
            models["plan@hf+layer"], peaks["plan@hf+layer"], budgets["plan@hf+layer"] = plan_at(
                base, ids, int(above), probes
            )
            models["plan-min"], peaks["plan-min"], budgets["plan-min"] = plan_at(base, ids, None, 0)
            load_before = load()
            # plan-min (hundreds of recomputed layers at depth 32) is not timed: its peak is what it is for
            clocked = {k: m for k, m in models.items() if k != "plan-min"}
            times = timed(clocked, ids, repeats) if repeats and depth in timed_depths else {}
            counts = {k: counted(m, ids) for k, m in models.items()}
            weights = param_bytes(base)
            recompute = {"plain": 0, "hf-checkpointing": depth, "reversible": depth}
            targets = {"plan@hf": peaks["hf-checkpointing"].total, "plan@hf+layer": int(above)}
            for variant in VARIANTS:
                p = peaks[variant]
                rows.append(
                    {
                        "model": model_name,
                        "depth": depth,
                        "batch": batch,
                        "seq": seq,
                        "hidden": hidden,
                        "variant": variant,
                        "peak_bytes": p.total,
                        "activation_bytes": p.total - 2 * weights,
                        "param_bytes": weights,
                        "grad_bytes_at_peak": p.gradients,
                        "non_param_grad_bytes_at_peak": p.total - p.parameters - p.gradients,
                        "recomputed_layers": recompute.get(variant, None)
                        if variant in recompute
                        else recomputed(models[variant]),
                        "step_s": times[variant][0] if variant in times else None,
                        "step_ratio_hf": times[variant][1] if variant in times else None,
                        "step_ratios_hf": times[variant][2] if variant in times else None,
                        "minor_faults_per_step": times[variant][3] if variant in times else None,
                        "gflop": counts[variant].flops / 1e9,
                        "aten_ops": counts[variant].ops,
                        "flop_ops": counts[variant].flop_ops,
                        "plan_budget_bytes": budgets.get(variant),
                        "plan_target_bytes": targets.get(variant),
                        "load_during_timing": f"{load_before} -> {load()}",
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
                with log.open("a") as f:
                    f.write(json.dumps(rows[-1]) + "\n")
    return rows


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def above_one(r: dict[str, Any]) -> str:
    """How many timed rounds were not faster than hf-checkpointing's."""
    rounds = r.get("step_ratios_hf") or []
    return f"; {sum(x >= 1.0 for x in rounds)} of {len(rounds)} rounds at or above 1" if rounds else ""


def ratio(r: dict[str, Any]) -> str:
    """The median per-round ratio, and the rounds' range where recorded."""
    if r["step_ratio_hf"] is None:
        return "-"
    rounds = r.get("step_ratios_hf")
    spread = f" ({min(rounds):.2f}-{max(rounds):.2f})" if rounds and len(rounds) > 1 else ""
    return f"{r['step_ratio_hf']:.3f}{spread}"


def faults(r: dict[str, Any]) -> str:
    n = r.get("minor_faults_per_step")
    return "-" if n is None else f"{n:.0f}"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# revlib_xla.hf against transformers' gradient checkpointing (eager peak, CPU)",
        "",
        f"{meta['date']}, {meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}; batch "
        f"{meta['batch']} x {meta['seq']} tokens, hidden {meta['hidden']}, 4 heads, vocabulary 256, float32. Peak: "
        f"MemTracker's eager peak of one training step (exact, the same every run). Activations = peak - 2 x "
        f"parameters (the issue's 'peak minus parameters and gradients'); 'non-p/g at peak' = peak - parameters - "
        f"the gradients that exist at the moment of the peak. Recomputed: layer forwards beyond one per layer. GFLOP "
        f"and aten ops: one step's, counted by a dispatch mode (torch.utils.flop_counter's formulas; deterministic). "
        f"Step "
        f"ratio: median over {meta['repeats']} rounds of (variant / hf-checkpointing) step time (in brackets: the "
        f"rounds' lowest and highest), variants "
        f"interleaved in one process, `torch.set_num_threads({meta['threads']})`, `nice`; machine load (1/5/15 min) "
        f"{meta['load_before']} before, {meta['load_after']} after the run; per depth in the .jsonl. "
        + (
            "Freed memory kept in the process (glibc `mallopt`, as a device's caching allocator keeps it)"
            if meta.get("malloc") == "fixed"
            else "glibc's default allocator behaviour"
        )
        + "; faults: median minor page faults per timed step.",
        "",
        "| model | depth | variant | peak MiB | activations MiB | act / hf-ckpt | non-p/g at peak MiB | recomputed "
        "| GFLOP | GFLOP / hf-ckpt | aten ops | step ms | step / hf-ckpt | faults |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["model"], r["depth"], r["variant"]): r for r in rows}
    for r in rows:
        hf = by[(r["model"], r["depth"], "hf-checkpointing")]
        step_ms = "-" if r["step_s"] is None else f"{1000 * r['step_s']:.0f}"
        counted = r.get("gflop") is not None and hf.get("gflop")
        flops = f"{r['gflop']:.2f} | {r['gflop'] / hf['gflop']:.3f} | {r['aten_ops']}" if counted else "- | - | -"
        lines.append(
            f"| {r['model']} | {r['depth']} | {r['variant']} | {mib(r['peak_bytes'])} | {mib(r['activation_bytes'])} "
            f"| {r['activation_bytes'] / hf['activation_bytes']:.2f} | {mib(r['non_param_grad_bytes_at_peak'])} "
            f"| {r['recomputed_layers']} | {flops} | {step_ms} | {ratio(r)} | {faults(r)} |"
        )
    lines += ["", "## Verdicts (computed from the rows above)", ""]
    for model_name in sorted({r["model"] for r in rows}, key=list(MODELS).index):
        depths = sorted({r["depth"] for r in rows if r["model"] == model_name})
        deepest = depths[-1]
        rev, hf, plan = (by[(model_name, deepest, v)] for v in ("reversible", "hf-checkpointing", "plan@hf"))
        growth = [by[(model_name, d, "reversible")]["activation_bytes"] for d in depths]
        act_ratio = rev["activation_bytes"] / hf["activation_bytes"]
        timed = rev["step_ratio_hf"] is not None
        rev_time = (
            f"at {ratio(rev)}x its step time ({'met' if timed and rev['step_ratio_hf'] <= 1.0 else 'NOT met'}: "
            f"median <= 1{above_one(rev)})"
        )
        fewer = plan["recomputed_layers"] < hf["recomputed_layers"]
        faster = fewer and (not timed or plan["step_ratio_hf"] < 1.0)
        lines += [
            f"- {model_name}: reversible activations over depths {depths}: {', '.join(mib(g) for g in growth)} MiB "
            f"(spread {mib(max(growth) - min(growth))} MiB).",
            f"- {model_name}, depth {deepest}: reversible's activations {act_ratio:.2f}x hf-checkpointing's "
            f"({mib(rev['activation_bytes'])} vs {mib(hf['activation_bytes'])} MiB; "
            f"{'met' if act_ratio <= 0.5 else 'NOT met'}: <= 0.5) " + (rev_time if timed else "(not timed)") + ".",
            f"- {model_name}, depth {deepest}: plan@hf peak {mib(plan['peak_bytes'])} MiB (hf-checkpointing "
            f"{mib(hf['peak_bytes'])}), {plan['recomputed_layers']} recomputed layers (hf-checkpointing "
            f"{hf['recomputed_layers']}), {ratio(plan)}x its step time "
            f"({'met' if plan['peak_bytes'] <= hf['peak_bytes'] and faster else 'NOT met'}: peak <= hf's, fewer "
            f"recomputed layers, median time < 1{above_one(plan) if timed else '; time not measured'}).",
        ]
        above = by.get((model_name, deepest, "plan@hf+layer"))
        if above is not None:
            lines.append(
                f"- {model_name}, depth {deepest}: plan@hf+layer (target hf-checkpointing's peak + one layer's saved "
                f"activations, {mib(above['plan_target_bytes'])} MiB): peak {mib(above['peak_bytes'])} MiB, "
                f"{above['recomputed_layers']} recomputed layers, {ratio(above)}x hf-checkpointing's step time."
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["model"] for r in rows}, key=list(MODELS).index)
    panels = (("peak_bytes", "eager peak, MiB"), ("activation_bytes", "peak - 2 x parameters, MiB"))
    timed = any(r["step_ratio_hf"] is not None for r in rows)
    fig, axes = plt.subplots(len(names), 2 + timed, figsize=(5 * (2 + timed), 3.8 * len(names)), squeeze=False)
    for row_axes, model_name in zip(axes, names):
        for variant in VARIANTS:
            mine = sorted(
                (r for r in rows if (r["model"], r["variant"]) == (model_name, variant)), key=lambda r: r["depth"]
            )
            depths = [r["depth"] for r in mine]
            for ax, (key, label) in zip(row_axes, panels):
                ax.plot(depths, [r[key] / 2**20 for r in mine], marker="o", label=variant)
                ax.set_ylabel(label)
            if timed:
                row_axes[2].plot(depths, [r["step_ratio_hf"] or float("nan") for r in mine], marker="o", label=variant)
                row_axes[2].set_ylabel("step time / hf-checkpointing's")
        for ax in row_axes[:2]:
            ax.set_yscale("log")  # plain grows tenfold past the others
        for ax in row_axes:
            ax.set_title(f"tiny {model_name}")
            ax.set_xlabel("layers")
            ax.set_xscale("log", base=2)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write(rows: list[dict[str, Any]], meta: dict[str, Any], stem: Path) -> None:
    stem.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stem.with_suffix(".meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(rows, meta))
    plot(rows, stem.with_suffix(".png"))
    print(stem.with_suffix(".md").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="depths 2 and 4, batch 2 x 32 (a smoke test)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (0: peaks only)")
    parser.add_argument("--batch", type=int, default=32, help="sequences per batch")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--depths", default="32,16,8,4")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--probes", type=int, default=7, help="plan@hf: budgets tried in the bisection")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: llama,gpt2")
    parser.add_argument("--skip", default="", help="comma-separated model:depth pairs not to run (measured before)")
    parser.add_argument("--timed-depths", default="", help="comma-separated: time only these depths (default all)")
    parser.add_argument(
        "--malloc",
        choices=("fixed", "default"),
        default="fixed",
        help="fixed: freed memory stays in the process (see fixed_malloc); default: glibc's own behaviour",
    )
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument(
        "--report", nargs="+", metavar="JSONL", help="write the report of rows already measured (runs' .partial.jsonl)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    malloc = "fixed" if args.malloc == "fixed" and fixed_malloc() else "default"
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # deepest first: the depth the criteria are about is measured first on a slow machine
    depths = [4, 2] if args.quick else [int(d) for d in args.depths.split(",")]
    batch, seq = (2, 32) if args.quick else (args.batch, args.seq)
    hidden = 64 if args.quick else args.hidden
    stem = out / ("hf_memory-cpu-quick" if args.quick else f"hf_memory-cpu-h{hidden}-b{batch}x{seq}")
    log = stem.with_suffix(".partial.jsonl")
    if not args.report:
        log.unlink(missing_ok=True)
    load_before = load()
    warnings.filterwarnings("ignore")
    import transformers

    timed_depths = [int(d) for d in args.timed_depths.split(",") if d] or depths
    if args.report:
        rows = [json.loads(line) for f in args.report for line in Path(f).read_text().splitlines() if line.strip()]
        rows.sort(key=lambda r: (list(MODELS).index(r["model"]), -r["depth"], VARIANTS.index(r["variant"])))
    else:
        rows = run(
            args.models.split(","),
            depths,
            batch,
            seq,
            hidden,
            args.repeats,
            args.probes,
            log,
            timed_depths,
            frozenset(args.skip.split(",")),
        )
    meta = {
        "date": datetime.date.today().isoformat(),
        "device": f"cpu ({platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "batch": batch,
        "seq": seq,
        "hidden": hidden,
        "repeats": args.repeats,
        "load_before": "(per depth in the .jsonl)" if args.report else load_before,
        "load_after": "(per depth in the .jsonl)" if args.report else load(),
        "threads": torch.get_num_threads(),
        "malloc": malloc,
    }
    write(rows, meta, stem)
    log.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
