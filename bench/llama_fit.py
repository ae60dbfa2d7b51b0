#!/usr/bin/env python
"""Will it fit: the largest batch of Llama training steps on one TPU chip, per memory strategy, without a TPU.

For each model (llama-1b, llama-3b), chip (v5e: 16 GiB, v6e: 32 GiB) and strategy (plain torch_xla, torch_xla
checkpointing per block, reversible, plan auto, plan + 2-bit FewBit, + optimizer state in host memory), the step
``revlib-xla train`` runs is traced at full size without allocating it and compiled deviceless for one chip
(``revlib_xla.fit``); :func:`revlib_xla.fit.max_batch` finds the largest batch that fits, verified at both
neighbours. Every figure is from the TPU compiler (deviceless libtpu), not a TPU run.

Writes ``bench/results/llama_fit-tpu-deviceless.{json,md}`` after every row (a run cut short keeps what finished).
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
from revlib_xla.fit.report import COMPILER_SOURCE, compile_steps
from revlib_xla.fit.strategies import (
    DEFAULT_COMPARISON,
    STRATEGIES,
    load,
    search_strategies,
    trace_config,
)
from revlib_xla.memory import format_bytes

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


def record_configs(full: bool) -> None:
    """Write ``tpu_configs/<name>.hbm.json`` for every shipped TPU config: the HBM `revlib-xla memory` reports at
    the reduced depth CI checks (``check``) and, with ``full``, at full depth."""
    from revlib_xla.fit.strategies import size_strategies

    for path in sorted((ROOT / "tpu_configs").glob("*.yaml")):
        cfg = load(str(path), [], STRATEGIES["config"])
        if cfg.chip.name not in chips.TPU_CHIPS or path.stem == "cpu-smoke":
            continue
        chip = chips.chip(cfg.chip.name, "tpu")
        record_path = path.with_suffix(".hbm.json")
        record = json.loads(record_path.read_text()) if record_path.exists() else {}
        record.update(chip=chip.name, source=COMPILER_SOURCE, versions=dict(_versions()))
        runs = [("check", CHECK_OVERRIDES)] + ([("full", [])] if full else [])
        for key, overrides in runs:
            start = time.perf_counter()
            [report] = size_strategies(str(path), overrides, chip, [STRATEGIES["config"]])
            record[key] = {
                "overrides": overrides,
                "hbm_bytes": report.total,
                "at_least_bytes": report.at_least,
                "fits": report.fits,
                "row": report.row(),
                "seconds": round(time.perf_counter() - start, 1),
            }
            record_path.write_text(json.dumps(record, indent=1) + "\n")
            print(path.name, key, record[key]["row"], flush=True)


def _versions() -> dict:
    from revlib_xla import tpu_compile

    return tpu_compile.versions()


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
    args = parser.parse_args()
    if args.configs:
        record_configs(args.full_configs)
        return 0
    rows: list[dict] = []
    out = Path(args.out)
    for model in args.models.split(","):
        for chip_name in args.chips.split(","):
            chip = chips.chip(chip_name, "tpu")
            for name in args.strategies.split(","):
                overrides = [
                    f"model.name={model}",
                    "model.overrides={}",
                    f"data.seq_len={args.seq_len}",
                    f"strategy.precision={args.precision}",
                    f"chip.name={chip.name}",
                ]
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
