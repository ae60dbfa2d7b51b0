#!/usr/bin/env python
"""What exact (fixed-point) reversible streams cost in TPU HBM: every shipped reversible TPU config's step compiled
deviceless (libtpu 0.0.20 via jax 0.7.1; not a TPU run) with exact streams (``strategy.exact=true``, the default) and
with floating-point streams (``strategy.exact=false``), at the reduced depth CI checks (``check``: one block, full
width, sequence and batch; a sharded config's ``ci``: one row per batch shard, 64 positions) and at full depth
(``full``) where this machine could compile it.

One compile per process (``--config NAME --key check|ci|full --streams exact|float``), appended to
``bench/results/exact_streams-tpu-deviceless.jsonl`` with the process's peak host memory; ``--record`` (exact streams
only) also writes the figure into ``tpu_configs/NAME.hbm.json`` (what ``bench/llama_fit.py --configs`` writes and
CI compares). ``--table`` writes the ``.md`` and ``.json`` beside the JSON lines.

Usage (one at a time on a shared machine): ``flock /tmp/bigmem.lock nice .venv/bin/python bench/exact_streams_tpu.py
--config v5e-1-llama-3b --key check --streams float``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from revlib_xla.fit import chips
from revlib_xla.fit.report import COMPILER_SOURCE
from revlib_xla.fit.strategies import STRATEGIES, load, size_strategies

OUT = ROOT / "bench" / "results" / "exact_streams-tpu-deviceless"
STREAMS = {"exact": [], "float": ["strategy.exact=false"]}
KEYS = ("check", "ci", "full")
GIB = 2**30


def overrides_of(cfg, key: str) -> list[str]:
    import llama_fit

    runs = dict(llama_fit.config_runs(cfg, full=True))
    if key not in runs:
        raise SystemExit(f"--key {key}: this config has the records {', '.join(runs)}")
    return list(runs[key])


def stream_shape(cfg) -> dict:
    """The per-chip shape of one residual stream of ``cfg``'s step: batch rows per chip, positions, hidden; and the
    layers of the model as built."""
    from revlib_xla.sharding import BATCH_AXES, resolve_mesh
    from revlib_xla.train.strategy import model_config

    shards = resolve_mesh(cfg.mesh.axes(), cfg.chip.chips).ways(BATCH_AXES) if cfg.chip.chips > 1 else 1
    spec = model_config(cfg)
    return {
        "batch_per_chip": cfg.data.batch_size // shards,
        "seq_len": cfg.data.seq_len,
        "hidden": spec.dim,
        "layers": spec.n_layers,
    }


def compile_one(name: str, key: str, streams: str, record: bool) -> dict:
    import llama_fit

    path = ROOT / "tpu_configs" / f"{name}.yaml"
    base = load(str(path), [], STRATEGIES["config"])
    if base.strategy.activations not in ("reversible", "momentum"):
        raise SystemExit(f"{name}: strategy.activations={base.strategy.activations} has no reversible streams")
    overrides = overrides_of(base, key) + STREAMS[streams]
    cfg = load(str(path), overrides, STRATEGIES["config"])
    chip = chips.chip(cfg.chip.name, "tpu")
    start = time.perf_counter()
    if record:
        if streams != "exact":
            raise SystemExit("--record writes the config's own figure: exact streams only")
        reports: list = []
        llama_fit.record_run(path, key, overrides, reports)
        [report] = reports
    else:
        [report] = size_strategies(str(path), overrides, chip, [STRATEGIES["config"]])
    rss = max(resource.getrusage(r).ru_maxrss for r in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    row = {
        "config": name,
        "key": key,
        "streams": streams,
        "chip": chip.name,
        "chips": cfg.chip.chips,
        "precision": cfg.strategy.precision,
        "param_dtype": cfg.strategy.param_dtype,
        "overrides": overrides,
        **stream_shape(cfg),
        "fits": report.fits,
        "hbm_bytes": report.total,
        "at_least_bytes": report.at_least,
        "usable_bytes": chip.usable_bytes,
        "parameters_bytes": report.parameters,
        "optimizer_bytes": report.optimizer,
        "temporaries_bytes": report.temporaries,
        "host_bytes": report.host,
        "error": report.error,
        "seconds": round(time.perf_counter() - start, 1),
        "max_rss_bytes": rss * 1024,
        "source": COMPILER_SOURCE,
    }
    with OUT.with_suffix(".jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def _jsonl() -> list[dict]:
    path = OUT.with_suffix(".jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def comparison(rows: list[dict]) -> list[dict]:
    """Per (config, key): the latest exact and float rows and what the exact streams cost beyond the float ones."""
    latest: dict[tuple[str, str, str], dict] = {}
    for r in rows:
        latest[(r["config"], r["key"], r["streams"])] = r
    out = []
    pairs = sorted({(c, k) for c, k, _ in latest}, key=lambda ck: (ck[0], KEYS.index(ck[1])))
    for config, key in pairs:
        exact, floating = latest.get((config, key, "exact")), latest.get((config, key, "float"))
        shown = exact or floating
        assert shown is not None
        elements = shown["batch_per_chip"] * shown["seq_len"] * shown["hidden"]
        row = {k: shown[k] for k in ("config", "key", "chip", "chips", "precision", "param_dtype", "usable_bytes")} | {
            k: shown[k] for k in ("batch_per_chip", "seq_len", "hidden", "layers")
        }
        row["stream_elements"] = elements
        for label, r in (("exact", exact), ("float", floating)):
            row[f"{label}_hbm_bytes"] = None if r is None else r["hbm_bytes"]
            row[f"{label}_at_least_bytes"] = None if r is None else r["at_least_bytes"]
            row[f"{label}_fits"] = None if r is None else r["fits"]
        if exact is not None and floating is not None:
            diff = exact["at_least_bytes"] - floating["at_least_bytes"]
            row["difference_bytes"] = diff
            row["difference_bytes_per_stream_element"] = round(diff / elements, 3)
        out.append(row)
    return out


def markdown(rows: list[dict]) -> str:
    def gib(n: int | None) -> str:
        return "-" if n is None else f"{n / GIB:.2f} GiB"

    def fits(r: dict, label: str) -> str:
        if r[f"{label}_fits"] is None:
            return "not compiled"
        total = r[f"{label}_hbm_bytes"]
        if total is None:
            return f">= {gib(r[f'{label}_at_least_bytes'])}: does not fit"
        return f"{total:,} B ({gib(total)}): {'fits' if r[f'{label}_fits'] else 'does not fit'}"

    lines = [
        "# Exact against floating-point reversible streams: TPU HBM per chip",
        "",
        f"All figures {COMPILER_SOURCE}: libtpu 0.0.20 via jax 0.7.1, compiled on a 2-core x86 machine without a "
        "TPU; no TPU run was made. Each row compiles the training step `revlib-xla train` runs for the shipped "
        "config (`tpu_configs/NAME.yaml`), once as written (exact streams: `strategy.exact=true`, the default; "
        "int64 integers counting 2**-32) and once with `strategy.exact=false` (floating-point streams in the "
        "activations' dtype). `check`: one block at the config's width, sequence and batch; `ci`: a sharded "
        "config's CI check (one block, one row per batch shard, 64 positions); `full`: full depth.",
        "",
        "*per stream element*: the difference divided by the elements of one residual stream on one chip "
        "(batch rows per chip x positions x hidden): 8 would be one more int64 tensor of the stream's shape, 4 one "
        "float32 tensor. HBM = the compiler's peak of the step (arguments included; host memory excluded); usable: "
        "v5e 15.75 GiB, v6e 31.75 GiB, v5p 94.75 GiB.",
        "",
        "| config | record | layers | stream per chip (rows x positions x hidden) | exact streams | float streams | "
        "exact - float | per stream element |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        diff = r.get("difference_bytes")
        lines.append(
            f"| {r['config']} ({r['chips']} x {r['chip']}, {r['precision']}"
            f"{', bf16 weights' if r['param_dtype'] == 'bf16' else ''}) | {r['key']} | {r['layers']} | "
            f"{r['batch_per_chip']} x {r['seq_len']} x {r['hidden']} | {fits(r, 'exact')} | {fits(r, 'float')} | "
            + ("-" if diff is None else f"{diff:+,} B ({diff / GIB:+.3f} GiB)")
            + " | "
            + ("-" if diff is None else f"{r['difference_bytes_per_stream_element']:+.2f} B")
            + " |"
        )
    return "\n".join(lines) + "\n"


def write_table(notes: str = "") -> None:
    rows = comparison(_jsonl())
    OUT.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    notes_path = OUT.with_name(OUT.name + "-notes.md")
    extra = notes_path.read_text() if notes_path.exists() else ""
    OUT.with_suffix(".md").write_text(markdown(rows) + ("\n" + extra if extra else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="a shipped config's name (tpu_configs/NAME.yaml)")
    parser.add_argument("--key", choices=KEYS, default="check")
    parser.add_argument("--streams", choices=sorted(STREAMS), default="exact")
    parser.add_argument("--record", action="store_true", help="exact streams: also write tpu_configs/NAME.hbm.json")
    parser.add_argument("--table", action="store_true", help="write the .md and .json from the JSON lines")
    args = parser.parse_args()
    if args.table:
        write_table()
        return 0
    if not args.config:
        parser.error("--config NAME (or --table)")
    print(json.dumps(compile_one(args.config, args.key, args.streams, args.record)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
