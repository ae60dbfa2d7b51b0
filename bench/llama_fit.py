#!/usr/bin/env python
"""Will it fit: the largest batch of Llama training steps on one TPU chip, per memory strategy, without a TPU.

For each model (llama-1b, llama-3b), chip (v5e: 16 GiB, v6e: 32 GiB) and strategy (plain torch_xla, torch_xla
checkpointing per block, reversible, plan auto, plan + 2-bit FewBit, + optimizer state in host memory), the step
``revlib-xla train`` runs is traced at full size without allocating it and compiled deviceless for one chip
(``revlib_xla.fit``); :func:`revlib_xla.fit.max_batch` finds the largest batch that fits, verified at both
neighbours. Every figure is from the TPU compiler (deviceless libtpu), not a TPU run.

Writes ``bench/results/llama_fit-tpu-deviceless.{json,md}`` after every row (a run cut short keeps what finished).
On a small machine, where a full-size compile takes many minutes: ``--predict FILE.jsonl`` compiles each strategy
at 1 and 2 layers (full width and sequence), batches 1 and 2, and extrapolates the largest batch to the full depth;
``--verify FILE.jsonl --batches B,B+1`` compiles those batches at full size; ``--table`` writes the headline table
from ``llama_fit-tpu-deviceless-{earlier.json,predicted.jsonl,verified.jsonl}``.
Usage: ``nice .venv/bin/python bench/llama_fit.py [--models llama-1b] [--chips v5e] [--strategies none,reversible]``
(hours on a 2-core machine: every batch tried is a full-size compile).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from revlib_xla.fit import chips
from revlib_xla.fit.report import COMPILER_SOURCE, PLANNER_SOURCE, compile_steps
from revlib_xla.fit.strategies import (
    DEFAULT_COMPARISON,
    STRATEGIES,
    load,
    search_strategies,
    trace_config,
)
from revlib_xla.units import format_bytes

OUT = ROOT / "bench" / "results" / "llama_fit-tpu-deviceless"


def row_of(model: str, chip: chips.Chip, found) -> dict:
    best, failure = found.best_report, found.smallest_failure
    shown = best or failure
    return {
        "model": model,
        "chip": chip.name,
        "strategy": found.label,
        "largest_batch": found.best,
        "capped": found.capped,
        "total_bytes": best.total if best else None,
        "parameters_bytes": shown.parameters if shown else None,
        "optimizer_bytes": shown.optimizer if shown else None,
        "temporaries_bytes": shown.temporaries if shown else None,
        "host_bytes": shown.host if shown else None,
        "next_batch_needs_at_least_bytes": failure.at_least if failure else None,
        "batches_compiled": sorted(found.reports),
    }


def quick_row(model: str, chip: chips.Chip, chosen, overrides: list[str]) -> dict:
    """Batches 1 and 2 compiled; the largest batch predicted by the line through them (not verified)."""
    traced = [trace_config(load(None, overrides, chosen, b)) for b in (1, 2)]
    one, two = compile_steps(traced, chip, [chosen.name] * 2, [1, 2])
    predicted = None
    if one.fits and two.total is not None and one.total is not None and two.total > one.total:
        predicted = 1 + int((chip.usable_bytes - one.total) // (two.total - one.total))
    elif one.fits:
        predicted = 1
    shown = one
    return {
        "model": model,
        "chip": chip.name,
        "strategy": chosen.name,
        "largest_batch": predicted or 0,
        "verified": False,
        "capped": False,
        "total_bytes": one.total if one.fits else None,
        "batch2_bytes": two.total,
        "parameters_bytes": shown.parameters,
        "optimizer_bytes": shown.optimizer,
        "temporaries_bytes": shown.temporaries,
        "host_bytes": shown.host,
        "next_batch_needs_at_least_bytes": None if one.fits else one.at_least,
        "batches_compiled": [1, 2],
    }


def predict_rows(model: str, chip: chips.Chip, chosen: list, overrides: list[str]) -> list[dict]:
    """Per strategy, the largest batch predicted from full-size compiles of batches 1 and 2 (full depth, width and
    sequence): the step's HBM is affine in the batch (the activations and temporaries of each sequence), so the
    line through the two compiled points gives the per-sequence bytes; all compiled in one compiler process. Not
    verified: ``--verify --batches auto`` compiles the neighbours of the answer.

    (The earlier predictor compiled 1 and 2 layers and extrapolated in depth; it gave negative per-sequence slopes:
    at one or two layers the compiler's peak is set by the parts outside the layers, the logits and loss and the
    embedding's gradient, and by where the scheduler puts them, so the per-layer terms do not separate.)"""
    traced, labels, batches = [], [], []
    for s in chosen:
        for batch in (1, 2):
            traced.append(trace_config(load(None, overrides, s, batch)))
            labels.append(s.name)
            batches.append(batch)
    reports = compile_steps(traced, chip, labels, batches)
    rows = []
    for i, s in enumerate(chosen):
        one, two = reports[2 * i : 2 * i + 2]
        slope = two.at_least - one.at_least
        if one.fits:
            predicted = 1 + int((chip.usable_bytes - one.total) // slope) if slope > 0 else 1
        else:
            predicted = 0
        rows.append(
            {
                "model": model,
                "chip": chip.name,
                "strategy": s.name,
                "predicted_batch": max(predicted, 0),
                "predicted_bytes_at_batch_1": one.at_least,
                "bytes_per_batch_element": slope,
                "fits_at_1": one.fits,
                "host_bytes": one.host,
            }
        )
    return rows


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "# Largest batch per strategy, Llama at seq_len 2048 on one TPU chip",
        "",
        f"All figures {COMPILER_SOURCE}: the training step `revlib-xla train` runs, traced at full size and "
        f"compiled for one chip (libtpu 0.0.20 via jax 0.7.1). precision {args.precision}, AdamW. "
        "'does not fit' = not even batch 1 fits; then the bytes batch 1 needs are given. 'predicted' = the largest "
        "batch on the line through the compiled batches 1 and 2, not verified by a compile (--quick).",
        "",
        "| model | chip | strategy | largest batch | HBM at that batch | parameters | optimizer state | "
        "gradients+activations+temporaries | host | batches tried |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:

        def b(key: str, row: dict = r) -> str:
            return "-" if row[key] is None else format_bytes(row[key])

        best = str(r["largest_batch"]) if r["largest_batch"] else "does not fit"
        if r["largest_batch"] and not r.get("verified", True):
            best += " (predicted from batches 1, 2)"
        total = b("total_bytes") if r["largest_batch"] else f">= {b('next_batch_needs_at_least_bytes')} at batch 1"
        lines.append(
            f"| {r['model']} | {r['chip']} | {r['strategy']} | {best} | {total} | {b('parameters_bytes')} | "
            f"{b('optimizer_bytes')} | {b('temporaries_bytes')} | {b('host_bytes')} | {r['batches_compiled']} |"
        )
    return "\n".join(lines) + "\n"


#: The reduced depth at which CI recompiles each shipped config (full width, sequence and batch).
CHECK_OVERRIDES = ["model.overrides.n_layers=1"]

#: The sequence length of a sharded config's CI check (``ci`` in its record). A sharded compile of one block at the
#: config's own batch and sequence took 4 to 20 minutes and ~19 GB of host memory on the shared 2-core machine; at
#: one row per batch shard and 64 positions it is the same program's structure (full width, one block, the
#: config's slice topology and mesh) at a cost CI can pay.
CI_SEQ_LEN = 64


def ci_overrides(cfg) -> list[str]:
    """The overrides of a sharded config's CI check: one block, one row per batch shard (data x fsdp), and
    :data:`CI_SEQ_LEN` positions; full width, the config's slice topology and mesh."""
    from revlib_xla.sharding import BATCH_AXES, resolve_mesh

    mesh = resolve_mesh(cfg.mesh.axes(), cfg.chip.chips)
    return [*CHECK_OVERRIDES, f"data.batch_size={mesh.ways(BATCH_AXES)}", f"data.seq_len={CI_SEQ_LEN}"]


def record_configs(full: bool, names: str = "", only_ci: bool = False, keys: str = "") -> None:
    """Write ``tpu_configs/<name>.hbm.json`` for every shipped TPU config (or those ``names`` lists, comma
    separated): the HBM `revlib-xla memory` reports at the reduced depth CI checks (``check``; a sharded config's
    CI check is ``ci``: one row per batch shard, :data:`CI_SEQ_LEN` positions) and, with ``full``, at full depth.
    ``only_ci``: the sharded configs' ``ci`` checks alone; ``keys``: only these records (comma separated)."""
    for path in shipped_configs(names):
        cfg = load(str(path), [], STRATEGIES["config"])
        runs = config_runs(cfg, full)
        if only_ci:
            runs = [(key, overrides) for key, overrides in runs if key == "ci"]
        if keys:
            runs = [(key, overrides) for key, overrides in runs if key in keys.split(",")]
        for key, overrides in runs:
            print(path.name, key, record_run(path, key, overrides)["row"], flush=True)


def shipped_configs(names: str = "") -> list[Path]:
    """The shipped TPU configs (``tpu_configs/*.yaml`` for a TPU chip), or those ``names`` lists (comma separated)."""
    paths = []
    for path in sorted((ROOT / "tpu_configs").glob("*.yaml")):
        if (names and path.stem not in names.split(",")) or path.stem == "cpu-smoke":
            continue
        if load(str(path), [], STRATEGIES["config"]).chip.name in chips.TPU_CHIPS:
            paths.append(path)
    return paths


def config_runs(cfg, full: bool) -> list[tuple[str, list[str]]]:
    """The records of a config and their overrides: ``ci`` (sharded configs), ``check``, and ``full`` with ``full``."""
    runs = [("check", CHECK_OVERRIDES)] + ([("full", [])] if full else [])
    if cfg.chip.chips > 1:
        runs.insert(0, ("ci", ci_overrides(cfg)))
    return runs


def record_run(path: Path, key: str, overrides: list[str], report_out: list | None = None) -> dict:
    """Compile config ``path`` with ``overrides`` deviceless and write the report as ``key`` of its record (the
    :class:`revlib_xla.fit.FitReport` is appended to ``report_out`` where given)."""
    from revlib_xla.fit.strategies import size_strategies

    cfg = load(str(path), [], STRATEGIES["config"])
    chip = chips.chip(cfg.chip.name, "tpu")
    start = time.perf_counter()
    [report] = size_strategies(str(path), overrides, chip, [STRATEGIES["config"]])
    record_path = path.with_suffix(".hbm.json")
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    record.update(chip=chip.name, source=COMPILER_SOURCE, versions=dict(_versions()))
    record[key] = {
        "overrides": overrides,
        "hbm_bytes": report.total,
        "at_least_bytes": report.at_least,
        "fits": report.fits,
        "row": report.row(),
        "seconds": round(time.perf_counter() - start, 1),
    }
    run = load(str(path), overrides, STRATEGIES["config"])
    if run.strategy.activations in ("reversible", "momentum"):  # which streams the reversible stack ran on
        record[key]["streams"] = "exact" if run.strategy.exact else "float"
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    if report_out is not None:
        report_out.append(report)
    return record[key]


def _versions() -> dict:
    from revlib_xla.compiled import worker as tpu_compile

    return tpu_compile.versions()


def base_overrides(model: str, chip: chips.Chip, args: argparse.Namespace) -> list[str]:
    return [
        f"model.name={model}",
        "model.overrides={}",
        f"data.seq_len={args.seq_len}",
        f"strategy.precision={args.precision}",
        f"chip.name={chip.name}",
    ] + (["model.scan=true"] if args.scan else [])


#: The streams of a reversible row compiled before exact (fixed-point) streams existed: floating-point streams, the
#: step ``strategy.exact=false`` compiles now (the configs' one-block records recompiled so: the same bytes).
FLOAT_STREAMS = "float streams (compiled before exact streams)"


def streams_of(row: dict) -> str | None:
    """The streams a headline row's step ran on: ``exact``, ``float``, or for a reversible row recorded before
    exact streams existed, :data:`FLOAT_STREAMS`; ``None`` for a strategy without reversible streams."""
    if not row["strategy"].startswith("reversible"):
        return None
    return row.get("streams") or FLOAT_STREAMS


#: The note on rows compiled with ``--scan``.
SCANNED = "scanned layers (model.scan=true)"

PREDICTIONS = OUT.with_name(OUT.name + "-predicted.jsonl")
VERIFICATIONS = OUT.with_name(OUT.name + "-verified.jsonl")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def headline_rows(earlier: list[dict], predicted: list[dict], verified: list[dict]) -> list[dict]:
    """One row per (model, chip, strategy): verified by full-size compiles (the largest batch fits, the next does
    not) where those ran; else 'does not fit' where batch 1 did not (compiler or arguments); else the
    reduced-depth prediction."""
    keys: list[tuple[str, str, str]] = []
    for r in [*earlier, *predicted, *verified]:
        key = (r["model"], r["chip"], r["strategy"])
        if key not in keys:
            keys.append(key)
    rows = []
    for key in keys:
        mine = [r for r in verified if (r["model"], r["chip"], r["strategy"]) == key]
        if any(r.get("streams") == "exact" for r in mine):  # exact streams (the default) replace the earlier ones
            mine = [r for r in mine if r.get("streams") == "exact"]
        guess = next((r for r in predicted if (r["model"], r["chip"], r["strategy"]) == key and "error" not in r), None)
        before = next((r for r in earlier if (r["model"], r["chip"], r["strategy"]) == key and "error" not in r), None)
        row: dict = dict(zip(("model", "chip", "strategy"), key))
        fits = sorted(r["batch"] for r in mine if r["fits"])
        fails = sorted(r["batch"] for r in mine if not r["fits"])
        if guess is not None:
            row["predicted_batch"] = guess["predicted_batch"]
            row["predicted_bytes_at_batch_1"] = guess["predicted_bytes_at_batch_1"]
            row["predicted_bytes_per_batch_element"] = guess["bytes_per_batch_element"]
        if fits and fails and min(fails) == max(fits) + 1:
            best = next(r for r in mine if r["batch"] == max(fits))
            after = next(r for r in mine if r["batch"] == best["batch"] + 1)
            how = f"verified ({after['batch']} needs {format_bytes(after['at_least_bytes'])})"
            if after.get("source") == PLANNER_SOURCE:
                how = (
                    f"verified ({after['batch']} needs at least {format_bytes(after['at_least_bytes'])}: no plan fits "
                    f"the budget, by the planner's sizes, not compiled)"
                )
            row.update(largest_batch=best["batch"], how=how, shown=best)
        elif fits and guess is not None and guess["predicted_batch"] <= max(fits):
            best = next(r for r in mine if r["batch"] == max(fits))
            how = f"batch {best['batch']} compiled at full depth; {best['batch'] + 1} predicted not to fit"
            row.update(largest_batch=best["batch"], how=how, shown=best)
        elif fits and fails and min(fails) > max(fits) and guess is None:
            best = next(r for r in mine if r["batch"] == max(fits))
            after = next(r for r in mine if r["batch"] == min(fails))
            how = (
                f"fits at batch {best['batch']}, {after['batch']} needs {format_bytes(after['at_least_bytes'])} "
                f"(full-depth compiles); the batches between not compiled"
            )
            row.update(largest_batch=best["batch"], how=how, shown=best, lower_bound=True)
        elif fits and not fails and guess is None:
            best = next(r for r in mine if r["batch"] == max(fits))
            how = f"fits at batch {best['batch']} (full-depth compile); larger batches not compiled"
            row.update(largest_batch=best["batch"], how=how, shown=best, lower_bound=True)
        elif fails and min(fails) == 1:
            row.update(largest_batch=0, how="compiled at batch 1", shown=min(mine, key=lambda r: r["batch"]))
        elif before is not None and not before["largest_batch"]:
            shown = dict(before, at_least_bytes=before["next_batch_needs_at_least_bytes"])
            arguments = shown["at_least_bytes"] - shown["parameters_bytes"] - shown["optimizer_bytes"] < 2**26
            how = "arguments exceed the chip (not compiled)" if arguments else "compiled at batch 1 (out of memory)"
            row.update(largest_batch=0, how=how, shown=shown)
        elif guess is not None:
            row.update(largest_batch=guess["predicted_batch"], how="predicted", shown=None)
            if mine:
                row["full_depth_compiles"] = {r["batch"]: r["fits"] for r in mine}
        else:
            continue
        rows.append(row)
    return rows


def headline_markdown(rows: list[dict], strategies: dict) -> str:
    lines = [
        "# Largest batch per strategy, Llama at seq_len 2048 on one TPU chip",
        "",
        f"All figures {COMPILER_SOURCE} (libtpu 0.0.20 via jax 0.7.1): the training step "
        "`revlib-xla train` runs, traced at full size and compiled deviceless for one chip. AdamW; fp32 weights "
        "except in `+bf16` rows (bf16 weights and gradients on the chip, fp32 masters on the host); `reversible*` "
        "rows compute the loss in chunks of 256 positions (strategy.loss_chunk=auto). "
        "Usable HBM: v5e 15.75 GiB, v6e 31.75 GiB.",
        "",
        "*verified*: compiled at full size, the batch shown fits and the next one does not. *predicted*: on the "
        "line through full-size compiles of batches 1 and 2 (the step's HBM is affine in the batch), not verified "
        "at the answer. *does not fit*: not even batch 1 fits; the bytes batch 1 needs at least "
        "(the compiler's out-of-memory figure, or the step's arguments alone when they exceed the chip: then not "
        "compiled).",
        "",
        "| model | chip | strategy | largest batch | how | HBM at that batch | parameters | optimizer state in HBM "
        "| host | predicted HBM at batch 1 (+ per batch element) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shown = r.get("shown") or {}
        how = r["how"] + (f"; {shown['note']}" if shown.get("note") else "")
        streams = streams_of(dict(shown, strategy=r["strategy"])) if shown and "not compiled)" not in r["how"] else None
        how += f"; {streams} streams" if streams in ("exact", "float") else f"; {streams}" if streams else ""

        def b(value: int | None) -> str:
            return "-" if value is None else format_bytes(value)

        if r["largest_batch"]:
            total = b(shown.get("total_bytes")) if shown else "-"
            best = (">= " if r.get("lower_bound") else "") + str(r["largest_batch"])
        else:
            total = f">= {b(shown.get('at_least_bytes'))} at batch 1"
            best = "does not fit"
        predicted = (
            f"{b(r['predicted_bytes_at_batch_1'])} (+ {b(r['predicted_bytes_per_batch_element'])})"
            if "predicted_batch" in r
            else "-"
        )
        lines.append(
            f"| {r['model']} | {r['chip']} | {r['strategy']} | {best} | {how} | {total} | "
            f"{b(shown.get('parameters_bytes'))} | {b(shown.get('optimizer_bytes'))} | {b(shown.get('host_bytes'))} "
            f"| {predicted} |"
        )
    lines += ["", "Strategies:", ""]
    used = []
    for r in rows:
        if r["strategy"] not in used:
            used.append(r["strategy"])
    lines += [f"- `{n}`: {strategies[n].description} ({', '.join(strategies[n].overrides)})" for n in used]
    return "\n".join(lines) + "\n"


#: Written below the table: what the session could not compile, and the bytes that decide the rest.
HEADLINE_NOTES = """
**llama-3b on one v5e** (`reversible+offload+bf16`, compiled at full size): batch 1 takes 15,124,544,000 bytes
(14.09 GiB of the 15.75 GiB usable): the bf16 weights (program arguments) 6,425,499,648 bytes (5.98 GiB); the
compiler's peak beyond the arguments 8,690,633,216 bytes (8.09 GiB), of which the bf16 gradients sent to the host
(program outputs) are 5.98 GiB and activations and temporaries the other 2.11 GiB; inputs and scalars 8.4 MB.
Recompiled (9 minutes, idle machine) after the chunked loss summed the bf16 head's gradient in float32: +0.40 GiB
over the earlier 14,690,500,096 bytes (13.68 GiB; the one-block compile's +0.99 GiB bounded it). Batch 2 needed
17,288,620,544 bytes (16.10 GiB) before that change, which only adds memory: 2.42 GiB more per sequence (attention's
24 x 2048 x 2048 scores of one layer at a time, and its backward, dominate; the loss adds a 256-position chunk of
logits at a time, not 1 GiB of float32 logits per sequence). Plain torch_xla, checkpointing and reversible with
float32 weights need 35.91 GiB for the weights and AdamW state alone. Host memory (arithmetic from the parameter
count, what `host_state_bytes` and `host_step_bytes` report): float32 master weights and AdamW's two moments, 12
bytes per weight = 38.55 GB (35.91 GiB), plus one weight's float32 gradient during the host step (the tied
embedding: 1.47 GiB): 40,128,933,888 bytes (40.13 GB, 37.37 GiB) in all. The one-chip v5e VM (machine type
`ct5lp-hightpu-1t`, accelerator type v5litepod-1) has 24 vCPUs and 48 GB of RAM (Cloud TPU docs, "TPU v5e", VM types
table: https://cloud.google.com/tpu/docs/v5e); that leaves about 7.9 GB for the OS, Python, torch_xla and the data
pipeline: it fits on paper, tightly (not run on a TPU). The 4-chip VM (`ct5lp-hightpu-4t`, v5litepod-4: 112 vCPUs,
192 GB) and the 8-chip VM (`ct5lp-hightpu-8t`, v5litepod-8: 224 vCPUs, 384 GB) leave ample room. Colab's TPU v5e-1
runtime: its RAM is not stated in the documentation found; check `free -g` (about 40 GB free needed).

**llama-1b on one v6e**: plain torch_xla fits batch 1 (26.31 GiB) and not batch 2 (>= 35.10 GiB), both compiled at
full size. `reversible+offload+bf16` compiles at full size to 8.01 GiB at batch 1, 8.00 GiB at batch 2 (at small
batches the peak is set by what does not grow with the batch: 2.30 GiB of bf16 weights, 2.30 GiB of bf16
gradients and the largest temporaries), 10.36 GiB at batch 4 and 11.66 GiB at batch 5, of 31.75 GiB usable: batch 5
fits, 5x plain torch_xla's batch (the issue's goal is 4x). The largest batch is not verified: the line through
batches 4 and 5 (1.29 GiB per sequence) predicts about 20; the search's next round did not finish in this session
(a full-size compile took 17 to 25 minutes on the shared machine by then).

**Scanned layers** (`model.scan=true`, row `reversible+offload+bf16+scan`): llama-1b on one v6e at batch 1 compiles
at full size to 6,873,392,192 bytes (6.40 GiB) against the unrolled walk's 8,599,953,568 (8.01 GiB): 1.61 GiB
(20%) less, all of it in the compiler's peak beyond the arguments (4.10 GiB against 5.70 GiB; the bf16 weights,
2.30 GiB, and the host state are the same). Likely cause (not isolated): the loop body holds one layer's
recomputation and vector-Jacobian product at a time by construction, where the unrolled program lets the scheduler
overlap neighbouring layers' temporaries. So scanned and unrolled figures are not interchangeable: the scanned rows
are labelled, and the unrolled rows stay as compiled. Scanned, batch 20 fits in 32,729,090,112 bytes (30.48 GiB)
and batch 21 needs 34,117,423,168 (31.77 GiB, over the 31.75 GiB usable), both compiled at full size: **20x plain
torch_xla's batch** (1.29 GiB per sequence, the slope the unrolled walk showed between batches 4 and 5). A
scanned compile took 7.5 to 9 minutes of wall time on the loaded machine (the unrolled batch 1: 17).

**llama-1b on one v5e** (`reversible+offload+bf16+scan`), where plain torch_xla and checkpointing do not fit batch
1: batch 10 fits in 16,161,148,928 bytes (15.05 GiB of the 15.75 GiB usable) and batch 11 needs 17,281,046,528
(16.09 GiB), both compiled at full size; also compiled: batch 8 14,448,525,312 (13.46 GiB), 9 15,041,251,328
(14.01 GiB), 12 18,502,602,240 (17.23 GiB), 13 at least 16 GiB (the compiler's out-of-memory figure). The step is
not affine in the batch here: 0.59 GB from batch 8 to 9, then 1.12, 1.12 and 1.22 GB per sequence (the v6e's
line through batches 1 and 20 is 1.36 GB); so the v5e's batch was found by compiling, not by the v6e's slope, which
put it at 8. Each pair of batches took 18 minutes of wall time (one compiler process, load 10 to 20 on 2 cores).

**torch_xla checkpointing** (every block, `strategy.activations=checkpoint`; the issue's second baseline), llama-1b on
one v6e, compiled at full size: 19.01 GiB at batch 1 and 1.55 GiB more per sequence (batches 1 and 2); batch 9 fits
in 29.43 GiB and batch 10 needs 32.16 GiB of the 31.75 GiB usable: 9x plain torch_xla's batch, with float32
weights and AdamW state in HBM (13.81 GiB). On one v5e its batch 1 cannot fit: the arguments and gradients alone are
18.41 GiB (arithmetic; the v6e compile's batch-1 peak is 19.01 GiB); not compiled for v5e. llama-3b: its weights
and AdamW state alone exceed both chips (35.91 GiB).

Arithmetic from the parameter counts (not compiler figures): llama-1b has 4.60 GiB of float32 parameters (5.58 GiB
untied) and 9.21 GiB of AdamW state (11.16 GiB untied); llama-3b 11.97 GiB (13.44 GiB untied) and 23.94 GiB (26.87
GiB untied). With the optimizer on the host, the chip holds weights and gradients: float32 (`reversible+offload`)
llama-1b 9.21 GiB, llama-3b 23.94 GiB (over one v5e before any activation); bf16 (`reversible+offload+bf16`)
llama-1b 4.60 GiB, llama-3b 11.97 GiB. `reversible+fused` keeps float32 parameters and AdamW state with untied
embeddings: llama-1b 16.75 GiB (over one v5e), llama-3b 40.31 GiB (over one v6e).

**`plan` (budget auto)**, llama-1b on one v6e, searched at full size (`--verify --batches auto --limit 12`, with
`REVLIB_XLA_COMPILE_TIMEOUT=5400`; 19 minutes on the idle 2-core machine): batch 6 fits in 29,425,903,328 bytes
(27.41 GiB); at batch 7 the planner finds no schedule within what the chip leaves beside the 13.81 GiB of float32
weights and AdamW state and the 4.60 GiB of gradients (its smallest schedule needs 32.33 GiB in all, by its sizes:
not compiled, `StepDoesNotFit`). 6x plain torch_xla's batch, but fewer than torch_xla checkpointing's 9: at batch 6
the compiled step has 4.34 GiB to spare, so the planner's sizes are pessimistic at this size. Likely where (not
isolated): the head's stage (2048 x 128256 float32 logits, 1 GiB a sequence, its log-softmax and gradient) measured
alone, as a stage program, where the whole step's compile fuses the loss into it. The plan's total is not monotone
in the batch (28.24 GiB at 1, 27.35 at 2, 25.39 at 4, 25.60 at 5): budget auto keeps every activation where they
fit and recomputes more as the batch grows. On one v5e `plan` cannot start: the weights, gradients and AdamW state
alone are 18.41 GiB (budget auto refuses it, naming the key); llama-3b's exceed both chips.
**`plan+fewbit`** (2-bit FewBit derivatives of the MLP's SiLU), the same search (29 minutes): batch 6 fits in
31,154,138,336 bytes (29.01 GiB) and batch 7 has no schedule, by the same bound as `plan` (32.33 GiB): the smallest
schedule's size is set by what FewBit does not touch (the head's stage and the attention), and at batch 6 the
budget keeps more activations than `plan` does (29.01 against 27.41 GiB). The largest batch is 6 for both.

Not compiled: llama-1b `checkpoint` on v5e (above: it cannot fit) and the other empty combinations. A full-size
compile took 2 to 45 minutes of wall time on the shared 2-core machine.
`bench/llama_fit.py --predict
bench/results/llama_fit-tpu-deviceless-predicted.jsonl` compiles batches 1 and 2 at full size and predicts from
the line through them; `--verify bench/results/llama_fit-tpu-deviceless-verified.jsonl --batches auto` searches
at full size until both neighbours of the answer are compiled; `--table` writes this file.
"""


def write_headline(out: Path) -> None:
    """bench/results/llama_fit-tpu-deviceless.{md,json} from the earlier rows (the .json as it was), the
    predictions and the verifications (the two .jsonl files)."""
    earlier_path = out.with_name(out.name + "-earlier.json")
    earlier = json.loads(earlier_path.read_text()) if earlier_path.exists() else []
    rows = headline_rows(earlier, _jsonl(PREDICTIONS), _jsonl(VERIFICATIONS))
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    out.with_suffix(".md").write_text(headline_markdown(rows, STRATEGIES) + HEADLINE_NOTES)


def predict_or_verify(args: argparse.Namespace) -> int:
    for model in args.models.split(","):
        for chip_name in args.chips.split(","):
            chip = chips.chip(chip_name, "tpu")
            overrides = base_overrides(model, chip, args)
            chosen = [STRATEGIES[n] for n in args.strategies.split(",")]
            start = time.perf_counter()
            if args.predict:
                rows = predict_rows(model, chip, chosen, overrides)
                out = Path(args.predict)
            else:
                if args.batches == "auto":  # the search at full size: the answer and both neighbours compiled
                    [found] = search_strategies(None, overrides, chip, chosen[:1], args.limit)
                    reports = [found.reports[b] for b in sorted(found.reports)]
                else:
                    batches = [int(b) for b in args.batches.split(",")]
                    traced = [trace_config(load(None, overrides, chosen[0], b)) for b in batches]
                    reports = compile_steps(traced, chip, [chosen[0].name] * len(batches), batches)
                rows = [
                    {
                        "model": model,
                        "chip": chip.name,
                        "strategy": chosen[0].name,
                        "batch": r.batch,
                        "fits": r.fits,
                        "total_bytes": r.total,
                        "at_least_bytes": r.at_least,
                        "parameters_bytes": r.parameters,
                        "optimizer_bytes": r.optimizer,
                        "temporaries_bytes": r.temporaries,
                        "host_bytes": r.host,
                        "error": r.error,
                        "source": r.source,
                    }
                    for r in reports
                ]
                out = Path(args.verify)
            seconds = round(time.perf_counter() - start, 1)
            with out.open("a") as f:
                for row in rows:
                    row["seconds"] = seconds
                    if args.scan:
                        row["note"] = SCANNED
                    if row["strategy"].startswith("reversible"):
                        row["streams"] = "exact"  # the default (no strategy.exact=false here)
                    f.write(json.dumps(row) + "\n")
                    print(json.dumps(row), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="llama-1b,llama-3b")
    parser.add_argument("--chips", default="v5e,v6e")
    parser.add_argument("--strategies", default=",".join(DEFAULT_COMPARISON))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--limit", type=int, default=512)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="compile batches 1 and 2 only and predict the largest batch from the line through them (unverified)",
    )
    parser.add_argument(
        "--configs",
        action="store_true",
        help="record tpu_configs/*.hbm.json (the reduced-depth check CI repeats) instead of the table",
    )
    parser.add_argument("--full-configs", action="store_true", help="with --configs: also compile at full depth")
    parser.add_argument("--config-names", default="", help="with --configs: only these configs (comma separated)")
    parser.add_argument(
        "--ci-only", action="store_true", help="with --configs: only the sharded configs' CI checks (`ci`)"
    )
    parser.add_argument("--config-keys", default="", help="with --configs: only these records (check, ci, full)")
    parser.add_argument(
        "--predict",
        metavar="JSONL",
        help="append per-strategy predictions from reduced-depth compiles (predict_rows) to JSONL instead",
    )
    parser.add_argument(
        "--verify",
        metavar="JSONL",
        help="compile --batches at full depth for one --strategies entry and append the reports to JSONL",
    )
    parser.add_argument(
        "--batches",
        default="auto",
        help="with --verify: the batches to compile, e.g. 7,8, or auto: search at full size for the largest that fits",
    )
    parser.add_argument("--table", action="store_true", help="write the headline table from the .jsonl records")
    parser.add_argument(
        "--scan", action="store_true", help="model.scan=true: the reversible layers stacked, compiled as one loop"
    )
    args = parser.parse_args()
    if args.configs:
        record_configs(args.full_configs, args.config_names, args.ci_only, args.config_keys)
        return 0
    if args.predict or args.verify:
        return predict_or_verify(args)
    if args.table:
        write_headline(Path(args.out))
        return 0
    rows: list[dict] = []
    out = Path(args.out)
    for model in args.models.split(","):
        for chip_name in args.chips.split(","):
            chip = chips.chip(chip_name, "tpu")
            for name in args.strategies.split(","):
                overrides = base_overrides(model, chip, args)
                start = time.perf_counter()
                try:
                    if args.quick:
                        row = quick_row(model, chip, STRATEGIES[name], overrides)
                    else:
                        [found] = search_strategies(None, overrides, chip, [STRATEGIES[name]], args.limit)
                        row = row_of(model, chip, found)
                except Exception as exc:  # record why a strategy could not be sized, go on with the others
                    row = {"model": model, "chip": chip.name, "strategy": name, "error": f"{type(exc).__name__}: {exc}"}
                row["seconds"] = round(time.perf_counter() - start, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
                out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
                ok = [r for r in rows if "error" not in r]
                errors = [r for r in rows if "error" in r]
                text = markdown(ok, args)
                if errors:
                    text += "\nNot sized:\n\n" + "\n".join(
                        f"- {r['model']} {r['chip']} {r['strategy']}: {r['error'][:300]}" for r in errors
                    )
                out.with_suffix(".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
