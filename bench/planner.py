#!/usr/bin/env python
"""Benchmark of the planner: solver speed, and step time against memory for planned checkpointing.

1. Solver: time to solve a random 100-stage chain at 500 memory slots (rotor's recurrence, and with reversible
   stages and offload enabled), median of 3.
2. Overhead against memory, on a GPT-style decoder (``revlib_xla.models.gpt``) on this machine's device: the step
   time over the no-checkpoint step time and the measured peak (activations, MemTracker on cpu) for
   * ``rotor``: ``Checkpointable`` with the reversible option off, at budgets from 10 % to 100 % of the
     no-checkpoint peak (budgets below the smallest feasible one are skipped);
   * ``hybrid``: the same decoder with reversible blocks, planned with the reversible option on;
   * ``sqrt``: ``torch.utils.checkpoint.checkpoint_sequential`` with sqrt(L) segments.
   All in one run, interleaved, medians of repeats. Writes ``bench/results/planner-<device>.{json,md,png}``.

torch's ``activation_memory_budget`` under ``torch.compile`` is not included: on the CPU, inductor needs setuptools
and a C++ toolchain, and its compiled kernels allocate outside PyTorch's Python dispatch, so MemTracker cannot see
their memory (the peak read the same at budgets 1.0, 0.5 and 0.1); it belongs in a GPU run, measured with
``torch.cuda.max_memory_allocated``.

Usage: ``python bench/planner.py [--quick]``.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import revlib_xla as revlib  # noqa: E402
from revlib_xla.memory import eager_peak  # noqa: E402
from revlib_xla.models import TransformerConfig, gpt  # noqa: E402
from revlib_xla.planner import Chain, InfeasibleBudget, no_checkpoint_memory, solve  # noqa: E402


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().lower().replace(" ", "-")
    return "cpu-" + (platform.processor() or platform.machine()).lower().replace(" ", "-")


def solver_speed(length: int = 100, slots: int = 500):
    rng = random.Random(0)
    chain = Chain([rng.random() for _ in range(length)], [rng.random() for _ in range(length + 1)],
                  [rng.randint(1, 10) for _ in range(length + 1)], [0] + [rng.randint(10, 30) for _ in range(length)],
                  [rng.randint(0, 5) for _ in range(length)], [rng.randint(0, 5) for _ in range(length + 1)])
    extended = chain.replace(reversible=[True] * length).with_bandwidth(20.0)
    out = {}
    for name, c in (("rotor", chain), ("extended", extended)):
        limit = 0.3 * no_checkpoint_memory(chain)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            solve(c, limit, slots)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def step_time(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    depth = 2 if args.quick else 8
    repeats = 2 if args.quick else 7
    config = TransformerConfig(width=128, depth=depth, heads=4, seq_len=128, dropout=0.1, vocab_size=256)
    tokens = torch.randint(0, 256, (4, 128))
    results = {"device": device_name(), "torch": torch.__version__, "solver_s": solver_speed(), "config": {
        "width": 128, "depth": depth, "seq": 128, "batch": 4}, "rows": []}
    print("solver:", results["solver_s"])

    plain = gpt(config)
    rev = gpt(config, reversible=True)

    def step(model):
        def run(m=model):
            out = m(tokens)
            out.float().square().mean().backward()
        return run

    def peak_of(module):
        peak = eager_peak(lambda m, x: m(x).float().square().mean().backward(), module, tokens, zero_grad=False)
        return peak.total - peak.parameters - peak.gradients - peak.optimizer - peak.buffers

    stages = list(plain)
    segments = max(1, round(math.sqrt(len(stages))))

    class Sqrt(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = plain

        def forward(self, x):
            first = self.seq[0](x)  # integer tokens cannot enter checkpoint_sequential (no grad)
            return torch.utils.checkpoint.checkpoint_sequential(torch.nn.Sequential(*stages[1:]), segments, first,
                                                                use_reentrant=False)

    # Plan first; then time every variant round-robin (machine drift spreads evenly); then measure peaks.
    base_peak = peak_of(plain)
    rev_peak = peak_of(rev)
    variants = [("no checkpoint", None, None, plain, None),
                (f"checkpoint_sequential ({segments} segments)", None, None, Sqrt(), None),
                ("no checkpoint (reversible-block model)", None, None, rev, None)]
    for method, model in (("rotor", plain), ("hybrid", rev)):
        planned = revlib.Checkpointable(model, reversible=(method == "hybrid"))
        planned.measure(tokens)
        for fraction in (0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0):
            peak = base_peak if method == "rotor" else rev_peak
            try:
                schedule = planned.compute_sequence(fraction * peak)
            except InfeasibleBudget:
                continue
            variants.append((method, fraction, fraction * peak, planned, schedule))
    times = {k: [] for k in range(len(variants))}
    for _ in range(repeats + 1):
        for k, (_, _, _, module, schedule) in enumerate(variants):
            if schedule is not None:
                module.sequence = schedule
            times[k].append(step_time(step(module), 1))
    base_time = statistics.median(times[0][1:])
    rev_time = statistics.median(times[2][1:])
    for k, (method, fraction, budget, module, schedule) in enumerate(variants):
        if schedule is not None:
            module.sequence = schedule
        reference = rev_time if method in ("hybrid", "no checkpoint (reversible-block model)") else base_time
        row = {"method": method, "budget": budget, "fraction": fraction,
               "time_ratio": statistics.median(times[k][1:]) / reference, "peak": peak_of(module)}
        if schedule is not None:
            row["planned_ratio"] = schedule.makespan / solve(module.chain, 1e18).makespan
        results["rows"].append(row)
        print(row)
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"planner-{results['device']}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    lines = [f"# Planner benchmark on {results['device']} (torch {results['torch']})", "",
             f"Solver, 100 stages x 500 slots: rotor {results['solver_s']['rotor']:.2f} s, with reversible stages "
             f"and offload {results['solver_s']['extended']:.2f} s (median of 3).", "",
             f"GPT decoder, width 128, depth {depth} (x2 blocks), seq 128, batch 4, dropout 0.1, float32; step = "
             f"forward + loss + backward; time over the same model's no-checkpoint step time (median of {repeats}, "
             f"interleaved); peak = activations, their gradients and temporaries (MemTracker), parameters and "
             f"gradients excluded. `hybrid` plans the reversible-block variant of the decoder (two streams of width "
             f"128) and is compared with that model's own no-checkpoint step; `planned ratio` is the plan's makespan "
             f"over the no-recomputation makespan, from the measured stage times.", "",
             "| method | budget (% of no-checkpoint peak) | peak (MiB) | step time ratio | planned ratio |",
             "|---|---|---|---|---|"]
    for row in results["rows"]:
        budget = "-" if row["budget"] is None else f"{100 * row['fraction']:.0f}%"
        planned = f"{row['planned_ratio']:.2f}" if "planned_ratio" in row else "-"
        lines.append(f"| {row['method']} | {budget} | {row['peak'] / 2 ** 20:.2f} | {row['time_ratio']:.2f} | "
                     f"{planned} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for method, marker, ref in (("rotor", "o-", base_peak), ("hybrid", "s-", rev_peak)):
            rows = [r for r in results["rows"] if r["method"] == method]
            ax.plot([r["peak"] / ref for r in rows], [r["time_ratio"] for r in rows], marker, label=method)
        for r in results["rows"][1:2]:
            ax.plot([r["peak"] / base_peak], [r["time_ratio"]], "k^", label=r["method"])
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xlabel("measured peak / no-checkpoint peak")
        ax.set_ylabel("step time / no-checkpoint step time")
        ax.set_title(f"Planned checkpointing, GPT depth {depth}, {results['device']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(stem.with_suffix(".png"), dpi=120)
    except ImportError:
        pass
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
