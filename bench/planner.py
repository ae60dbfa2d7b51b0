#!/usr/bin/env python
"""Benchmark of the planner: solver speed, and step time against memory for planned checkpointing and its peers.

1. Solver: time to solve a random 100-stage chain at 500 memory slots (rotor's recurrence, and with reversible
   stages and offload enabled), median of 3.
2. Overhead against memory, on a GPT-style decoder (``revlib_xla.models.gpt``) on ``--device``: step time over a
   no-checkpoint step time, against memory, for
   * ``rotor``: ``Checkpointable`` with the reversible option off, at budgets from 10 % to 100 % of the
     no-checkpoint peak (budgets below the smallest feasible one are skipped);
   * ``hybrid``: the same decoder with reversible blocks, planned with the reversible option on, and
     ``rotor (reversible-block model)``: that model planned with the option off (rotor alone on the same model);
   * ``sqrt``: ``torch.utils.checkpoint.checkpoint_sequential`` with sqrt(L) segments;
   * ``torch.compile``: the decoder under ``torch.compile`` (inductor) with
     ``torch._functorch.config.activation_memory_budget`` at 1.0 ... 0.0, one compile per budget.
   All variants are timed in one run, interleaved round-robin (machine drift spreads evenly), medians of repeats.

Memory, three yardsticks (each row says which it has):
* ``peak``: MemTracker's peak of activations, their gradients, temporaries and the step's input (parameters and
  gradients excluded): what ``Checkpointable``'s budget is about. Eager rows only: compiled kernels allocate
  outside Python dispatch, so MemTracker cannot see them (it read the same peak at every budget).
* ``allocator peak``: how far the bytes allocated by PyTorch's allocator rose during one step
  (``revlib_xla.memory.allocator_peak``: profiler memory events on cpu, ``max_memory_allocated`` on cuda), with
  the parameter gradients already allocated (the step accumulates into them). Every row has it. On the eager
  no-checkpoint steps it equals ``peak`` less the input; on planned steps ``peak`` can read more, because
  MemTracker's module hooks keep tensors alive that the untracked step frees (the allocator peak of a hybrid plan
  rises to MemTracker's reading while MemTracker tracks the step).
* ``saved``: bytes saved for backward (saved-tensor hooks; they see what AOTAutograd's partitioned forward keeps,
  i.e. what ``activation_memory_budget`` decides; parameters excluded). No-checkpoint and compiled rows only (the
  checkpointing variants install hooks of their own, which take over from the counting ones).

The compiled rows run the decoder with dropout off: with dropout, torch 2.9's memory-budget partitioner
recomputes the random masks in the backward with fresh random numbers, so gradients below budget 1.0 are wrong
(pytorch/pytorch#190758); the run shows it on a small decoder (``dropout_check``). Their ratios (time and memory)
are against the compiled budget-1.0 step of the same model; the eager dropout-free step is recorded beside them.
Every compiled budget's gradients are checked against the eager dropout-free model's.

Writes ``bench/results/planner-<device>.{json,md,png}``.

Usage: ``python bench/planner.py [--device cpu|cuda] [--quick]``. On cpu, inductor needs setuptools (the
``[bench]`` extra) and a C++ compiler.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import revlib_xla as revlib
from revlib_xla.memory import SavedTensorCounter, allocator_peak, eager_peak
from revlib_xla.models import TransformerConfig, gpt
from revlib_xla.planner import Chain, InfeasibleBudget, no_checkpoint_memory, solve

#: activation_memory_budget values of the compiled rows (1.0: save what the partitioner would anyway; 0.0:
#: recompute everything it may).
COMPILE_BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.1, 0.0)
#: Relative gradient error (per parameter, in norm) a compiled step may have against eager float32: reductions are
#: reordered by fusion, nothing more.
GRAD_TOLERANCE = 1e-4
MiB = 2**20


REV_ROTOR = "rotor (reversible-block model)"


def device_name(device: torch.device) -> str:
    """The name results are filed under: ``cuda-<the GPU's name>`` on cuda, ``cpu`` on cpu."""
    if device.type == "cuda":
        return "cuda-" + torch.cuda.get_device_name(device).lower().replace(" ", "-")
    return "cpu"


def solver_speed(length: int = 100, slots: int = 500) -> dict[str, float]:
    """Median seconds (of 3) to solve a random chain, with rotor's recurrence and with the extensions on."""
    rng = random.Random(0)
    chain = Chain(
        [rng.random() for _ in range(length)],
        [rng.random() for _ in range(length + 1)],
        [rng.randint(1, 10) for _ in range(length + 1)],
        [0] + [rng.randint(10, 30) for _ in range(length)],
        [rng.randint(0, 5) for _ in range(length)],
        [rng.randint(0, 5) for _ in range(length + 1)],
    )
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


def compiled_forward(model: torch.nn.Module, budget: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """``torch.compile`` of ``model``'s forward, partitioned under ``activation_memory_budget=budget``.

    Dynamo caches compiled graphs per code object, and its guards do not include the functorch config, so two
    compiled wrappers of the same forward would share (and silently reuse) one graph. Each budget therefore gets a
    function with a code object of its own, compiled whole (``fullgraph``) at its first call, which must happen
    under :func:`compiling`. The budget is also in AOTAutograd's cache key, so a warm disk cache hands back the
    graph of the right budget.
    """
    namespace: dict[str, Any] = {}
    exec(f"def forward_budget_{round(budget * 100)}(x):\n    return model(x)\n", {"model": model}, namespace)
    return torch.compile(next(iter(namespace.values())), fullgraph=True)


def compiling(budget: float, fallback_random: bool = False) -> contextlib.ExitStack:
    """The configuration a compiled forward must first be called (compiled) under."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._functorch.config.patch(activation_memory_budget=budget))
    if fallback_random:  # inductor draws random numbers as eager does (same generator, same order)
        stack.enter_context(torch._inductor.config.patch(fallback_random=True))
    return stack


def loss_of(forward: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    return forward(tokens).float().square().mean()


def gradients(
    forward: Callable[[torch.Tensor], torch.Tensor], model: torch.nn.Module, tokens: torch.Tensor, seed: int = 1
) -> list[torch.Tensor]:
    """The parameter gradients of one step from fresh (``None``) gradients, under a fixed seed."""
    for param in model.parameters():
        param.grad = None
    torch.manual_seed(seed)
    loss_of(forward, tokens).backward()
    return [param.grad.detach().clone() for param in model.parameters()]


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest per-parameter ``|got - want| / |want|`` (Frobenius norms)."""
    return max(((g - w).norm() / w.norm().clamp_min(1e-30)).item() for g, w in zip(got, want))


def dropout_check(device: torch.device) -> list[dict[str, Any]]:
    """Gradients of a compiled small decoder *with* dropout against eager, at a few budgets.

    Inductor draws its random numbers as eager does here (``fallback_random``), so at budget 1.0 the compiled
    gradients equal eager's. Below 1.0, torch 2.9's partitioner may recompute dropout in the backward with fresh
    random numbers (pytorch/pytorch#190758): the loss still equals eager's, the gradients do not.
    """
    config = TransformerConfig(width=64, depth=1, heads=4, seq_len=32, dropout=0.1, vocab_size=256)
    torch.manual_seed(0)
    model = gpt(config).to(device)
    tokens = torch.randint(0, 256, (2, 32), device=device)
    torch.manual_seed(1)
    eager_loss = loss_of(model, tokens).item()
    eager = gradients(model, model, tokens)
    out = []
    for budget in (1.0, 0.5, 0.0):
        forward = compiled_forward(model, budget)
        with compiling(budget, fallback_random=True):
            loss_of(forward, tokens).backward()
        torch.manual_seed(1)
        loss = loss_of(forward, tokens).item()
        error = relative_error(gradients(forward, model, tokens), eager)
        out.append(
            {
                "budget": budget,
                "loss_matches": abs(loss - eager_loss) <= 1e-5 * abs(eager_loss),
                "grad_rel_err": error,
                "grads_match": error <= GRAD_TOLERANCE,
            }
        )
        print("dropout check:", out[-1])
    torch._dynamo.reset()
    return out


@dataclass
class Variant:
    """One row: how to run its step, what its ratios are taken against, and what was measured."""

    method: str
    run: Callable[[], None]
    reference: str  # the method of the row its ratios are taken against
    module: torch.nn.Module | None = None  # for MemTracker (eager rows)
    fraction: float | None = None  # Checkpointable budget / no-checkpoint peak, or activation_memory_budget
    budget: float | None = None  # Checkpointable budget in bytes
    schedule: Any = None
    saved_of: Callable[[], torch.Tensor] | None = None  # a forward whose saved bytes are counted
    params: list[torch.Tensor] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    row: dict[str, Any] = field(default_factory=dict)

    def select(self) -> None:
        if self.schedule is not None:
            self.module.sequence = self.schedule


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="depth 2, 2 repeats, compile budgets 1.0 and 0.0")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    started = time.perf_counter()
    torch.manual_seed(0)
    depth = 2 if args.quick else 8
    repeats = 2 if args.quick else 7
    budgets = (1.0, 0.0) if args.quick else COMPILE_BUDGETS
    assert budgets[0] == 1.0, "the compiled rows' reference is the budget-1.0 step, compiled first"
    config = TransformerConfig(width=128, depth=depth, heads=4, seq_len=128, dropout=0.1, vocab_size=256)
    tokens = torch.randint(0, 256, (4, 128), device=device)
    results: dict[str, Any] = {
        "device": device_name(device),
        "torch": torch.__version__,
        "solver_s": solver_speed(),
        "config": {"width": 128, "depth": depth, "seq": 128, "batch": 4, "dropout": 0.1},
        "compile_budgets": list(budgets),
        "rows": [],
    }
    print("solver:", results["solver_s"])
    results["dropout_check"] = dropout_check(device)

    plain = gpt(config).to(device)
    rev = gpt(config, reversible=True).to(device)
    # The compiled rows' model: the same weights, dropout off (see the module docstring).
    quiet = gpt(TransformerConfig(width=128, depth=depth, heads=4, seq_len=128, dropout=0.0, vocab_size=256))
    quiet = quiet.to(device)
    quiet.load_state_dict(plain.state_dict())

    def stepper(forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            loss_of(forward, tokens).backward()

        return run

    def peak_of(module: torch.nn.Module) -> int:
        peak = eager_peak(lambda m, x: loss_of(m, x).backward(), module, tokens, zero_grad=False)
        return peak.total - peak.parameters - peak.gradients - peak.optimizer - peak.buffers

    stages = list(plain)
    segments = max(1, round(math.sqrt(len(stages))))

    class Sqrt(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seq = plain

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            first = self.seq[0](x)  # integer tokens cannot enter checkpoint_sequential (no grad)
            return torch.utils.checkpoint.checkpoint_sequential(
                torch.nn.Sequential(*stages[1:]), segments, first, use_reentrant=False
            )

    sqrt_model = Sqrt()
    base_peak, rev_peak = peak_of(plain), peak_of(rev)
    variants = [
        Variant(
            "no checkpoint",
            stepper(plain),
            "no checkpoint",
            plain,
            saved_of=lambda: loss_of(plain, tokens),
            params=list(plain.parameters()),
        ),
        Variant(f"checkpoint_sequential ({segments} segments)", stepper(sqrt_model), "no checkpoint", sqrt_model),
        Variant(
            "no checkpoint (reversible-block model)",
            stepper(rev),
            "no checkpoint (reversible-block model)",
            rev,
            saved_of=lambda: loss_of(rev, tokens),
            params=list(rev.parameters()),
        ),
        Variant(
            "no checkpoint (dropout 0)",
            stepper(quiet),
            "no checkpoint (dropout 0)",
            quiet,
            saved_of=lambda: loss_of(quiet, tokens),
            params=list(quiet.parameters()),
        ),
    ]
    for method, model in (("rotor", plain), (REV_ROTOR, rev), ("hybrid", rev)):
        planned = revlib.Checkpointable(model, reversible=(method == "hybrid"))
        planned.measure(tokens)
        peak = base_peak if method == "rotor" else rev_peak
        reference = "no checkpoint" if method == "rotor" else "no checkpoint (reversible-block model)"
        for fraction in (0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0):
            try:
                schedule = planned.compute_sequence(fraction * peak)
            except InfeasibleBudget:
                continue
            variants.append(Variant(method, stepper(planned), reference, planned, fraction, fraction * peak, schedule))

    # Compile every budget (each its own graph), then check its gradients against the eager dropout-free model.
    torch._dynamo.reset()
    eager_grads = gradients(quiet, quiet, tokens)
    compile_s = {}
    for budget in budgets:
        forward = compiled_forward(quiet, budget)
        start = time.perf_counter()
        with compiling(budget):
            stepper(forward)()
        sync()
        compile_s[budget] = time.perf_counter() - start
        variant = Variant(
            "torch.compile",
            stepper(forward),
            "torch.compile",
            fraction=budget,
            saved_of=lambda f=forward: loss_of(f, tokens),
            params=list(quiet.parameters()),
        )
        variant.row["compile_s"] = compile_s[budget]
        variant.row["grad_rel_err"] = relative_error(gradients(forward, quiet, tokens), eager_grads)
        variant.row["grads_match"] = variant.row["grad_rel_err"] <= GRAD_TOLERANCE
        print(
            f"torch.compile, activation_memory_budget={budget}: compiled in {compile_s[budget]:.1f} s, gradient "
            f"error against eager {variant.row['grad_rel_err']:.2e}"
        )
        variants.append(variant)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    # From here on nothing may recompile: a recompile would mean a budget's graph was not the one timed.
    torch._dynamo.config.error_on_recompile = True
    for _ in range(repeats + 1):  # the first round warms up (and is dropped)
        for variant in variants:
            variant.select()
            sync()
            start = time.perf_counter()
            variant.run()
            sync()
            variant.times.append(time.perf_counter() - start)
    for variant in variants:  # every .grad exists now: each step below accumulates into it
        variant.select()
        row = variant.row
        row.update(
            method=variant.method,
            fraction=variant.fraction,
            budget=variant.budget,
            reference=variant.reference,
            time_s=statistics.median(variant.times[1:]),
        )
        row["peak"] = peak_of(variant.module) if variant.module is not None else None
        row["allocator_peak"] = allocator_peak(variant.run, device=device).increase
        if variant.saved_of is not None:
            with SavedTensorCounter(exclude=variant.params) as counter:
                loss = variant.saved_of()
            del loss
            row["saved"] = counter.bytes
        if variant.schedule is not None:
            row["planned_ratio"] = variant.schedule.makespan / solve(variant.module.chain, 1e18).makespan
    torch._dynamo.config.error_on_recompile = False
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    rows: dict[str, dict[str, Any]] = {}
    for variant in variants:  # the first row of a method is its reference (torch.compile: budget 1.0)
        rows.setdefault(variant.method, variant.row)
    first_compiled = rows["torch.compile"]
    for variant in variants:
        row, ref = variant.row, rows[variant.reference]
        row["time_ratio"] = row["time_s"] / ref["time_s"]
        row["allocator_ratio"] = row["allocator_peak"] / ref["allocator_peak"]
        if row["peak"] is not None:
            row["peak_ratio"] = row["peak"] / ref["peak"]
        if "saved" in row and ref.get("saved"):
            row["saved_ratio"] = row["saved"] / ref["saved"]
        results["rows"].append(row)
        print({k: v for k, v in row.items() if k != "budget"})
    quiet_row = rows["no checkpoint (dropout 0)"]
    results["compiled_vs_eager"] = {
        "time_ratio": first_compiled["time_s"] / quiet_row["time_s"],
        "allocator_ratio": first_compiled["allocator_peak"] / quiet_row["allocator_peak"],
        "saved_ratio": first_compiled["saved"] / quiet_row["saved"],
    }
    results["grads_match"] = all(v.row["grads_match"] for v in variants if v.method == "torch.compile")
    results["wall_s"] = time.perf_counter() - started
    write(results, depth, repeats, quick=args.quick)


def write(results: dict[str, Any], depth: int, repeats: int, quick: bool) -> None:
    """``bench/results/planner-<device>.{json,md,png}`` from the measured rows (``-quick`` after the device
    name for a ``--quick`` run, so that it never replaces the recorded results)."""
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"planner-{results['device']}{'-quick' if quick else ''}"
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2))
    vs = results["compiled_vs_eager"]
    check = results["dropout_check"]
    lines = [
        f"# Planner benchmark on {results['device']} (torch {results['torch']})",
        "",
        f"Solver, 100 stages x 500 slots: rotor {results['solver_s']['rotor']:.2f} s, with reversible stages and "
        f"offload {results['solver_s']['extended']:.2f} s (median of 3).",
        "",
        f"GPT decoder, width 128, depth {depth} (x2 blocks), seq 128, batch 4, dropout 0.1, float32; step = "
        f"forward + loss + backward; step time = median of {repeats}, all rows interleaved in one run "
        f"({results['wall_s'] / 60:.0f} min in all). Ratios are against the row named in `against`:",
        "",
        "* `peak` (MemTracker): activations, their gradients, temporaries and the input, parameters and gradients "
        "excluded; what `Checkpointable`'s budget counts. Eager rows only: MemTracker cannot see inside compiled "
        "kernels.",
        "* `allocator`: how far PyTorch's allocator rose during one step (`revlib_xla.memory.allocator_peak`: "
        "profiler memory events on cpu, `max_memory_allocated` on cuda), parameter gradients already allocated. "
        "All rows. On the eager no-checkpoint steps it equals `peak` less the input; on planned steps `peak` "
        "can read more: MemTracker's module hooks keep tensors alive that the untracked step frees (a hybrid "
        "plan's allocator peak rises to MemTracker's reading while MemTracker tracks the step).",
        "* `saved`: bytes saved for backward (saved-tensor hooks, which see what AOTAutograd's compiled graph "
        "keeps), parameters excluded; no-checkpoint and compiled rows.",
        "* `hybrid` plans the reversible-block variant of the decoder (two streams of width 128) against that "
        f"model's own no-checkpoint step; `{REV_ROTOR}` plans the same model with rotor alone (reversible option "
        "off), the comparison that isolates what rebuilding inputs buys; `planned` is the plan's makespan over the "
        "no-recomputation makespan.",
        "* `torch.compile` rows: inductor with `torch._functorch.config.activation_memory_budget` = the budget "
        "column, one compile per budget, **dropout off** (below budget 1.0 torch 2.9 recomputes dropout masks "
        "with fresh random numbers and gets the gradients wrong, pytorch/pytorch#190758; check below). Their "
        "ratios are against the compiled budget-1.0 step, not the eager one; `grad err` is the largest "
        "per-parameter relative gradient error against the eager dropout-free model "
        f"(tolerance {GRAD_TOLERANCE:g}): {'all match' if results['grads_match'] else 'SOME DO NOT MATCH'}. The "
        f"compiled budget-1.0 step against the eager dropout-free step: time {vs['time_ratio']:.2f}x, allocator "
        f"peak {vs['allocator_ratio']:.2f}x, saved {vs['saved_ratio']:.2f}x.",
        "",
        "| method | budget | against | peak MiB (ratio) | allocator MiB (ratio) | saved MiB (ratio) | step time "
        "ratio | planned | grad err | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(row: dict[str, Any], key: str) -> str:
        if row.get(key) is None:
            return "-"
        ratio = row.get(key + "_ratio" if key != "allocator_peak" else "allocator_ratio")
        return f"{row[key] / MiB:.2f}" + (f" ({ratio:.2f})" if ratio is not None else "")

    for row in results["rows"]:
        if row["fraction"] is None:
            budget = "-"
        elif row["method"] == "torch.compile":
            budget = f"{row['fraction']:g}"
        else:
            budget = f"{100 * row['fraction']:.0f}%"
        planned = f"{row['planned_ratio']:.2f}" if "planned_ratio" in row else "-"
        err = f"{row['grad_rel_err']:.1e}" if "grad_rel_err" in row else "-"
        comp = f"{row['compile_s']:.0f}" if "compile_s" in row else "-"
        if row["method"] == "torch.compile":
            against = "itself" if row["fraction"] == 1.0 else "torch.compile 1.0"
        else:
            against = "itself" if row["reference"] == row["method"] else row["reference"]
        lines.append(
            f"| {row['method']} | {budget} | {against} | {cell(row, 'peak')} | "
            f"{cell(row, 'allocator_peak')} | {cell(row, 'saved')} | {row['time_ratio']:.2f} | {planned} | "
            f"{err} | {comp} |"
        )
    lines += [
        "",
        "Dropout check (GPT width 64, depth 1, seq 32, batch 2, dropout 0.1; inductor with "
        "`fallback_random`, so it draws eager's random numbers; gradients against eager with the same seed):",
        "",
        "| activation_memory_budget | loss equals eager | gradient rel. error | gradients match |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {c['budget']:g} | {c['loss_matches']} | {c['grad_rel_err']:.1e} | {c['grads_match']} |" for c in check
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        print(stem.with_suffix(".md").read_text())
        return
    rows = results["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    styles = (("rotor", "o-", "C0"), (REV_ROTOR, "o--", "C4"), ("hybrid", "s-", "C1"))
    for method, style, colour in styles:
        chosen = [r for r in rows if r["method"] == method]
        left.plot(
            [r["peak_ratio"] for r in chosen], [r["time_ratio"] for r in chosen], style, color=colour, label=method
        )
        right.plot(
            [r["allocator_ratio"] for r in chosen], [r["time_ratio"] for r in chosen], style, color=colour, label=method
        )
    for r in rows:
        if r["method"].startswith("checkpoint_sequential"):
            left.plot([r["peak_ratio"]], [r["time_ratio"]], "k^", label=r["method"])
            right.plot([r["allocator_ratio"]], [r["time_ratio"]], "k^", label=r["method"])
    compiled = [r for r in rows if r["method"] == "torch.compile"]
    right.plot(
        [r["allocator_ratio"] for r in compiled],
        [r["time_ratio"] for r in compiled],
        "D-",
        color="C2",
        label="torch.compile budget (allocator peak)",
    )
    right.plot(
        [r["saved_ratio"] for r in compiled],
        [r["time_ratio"] for r in compiled],
        "D:",
        color="C2",
        mfc="none",
        label="torch.compile budget (saved bytes)",
    )
    for r in compiled:
        right.annotate(
            f"{r['fraction']:g}",
            (r["allocator_ratio"], r["time_ratio"]),
            fontsize=7,
            textcoords="offset points",
            xytext=(4, 3),
        )
    for ax in (left, right):
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.legend(fontsize=7)
    left.set_xlabel("MemTracker peak / no-checkpoint peak (eager)")
    right.set_xlabel("allocator peak / own no-checkpoint step's\n(torch.compile: / compiled budget 1.0)")
    left.set_ylabel("step time / own no-checkpoint step time\n(torch.compile: / compiled budget 1.0)")
    left.set_title("eager rows, MemTracker", fontsize=9)
    right.set_title("all rows, allocator peak", fontsize=9)
    fig.suptitle(f"Planned checkpointing vs peers, GPT depth {depth}, {results['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    print(stem.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
