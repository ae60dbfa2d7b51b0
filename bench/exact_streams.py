#!/usr/bin/env python
"""Exact (fixed-point) reversible streams at real sizes, on the CPU: what floating-point streams rebuild, whether the
memory-saving gradients equal plain autograd's (``no_savings``) bit for bit, the step time of exact against float
streams, and the activation memory against depth.

Cases (each one process-sized; run them one at a time on a 24 GB machine):

* ``hf``: a transformers model with a published shape (``--config llama-3.2-1b``, ``qwen3-0.6b``, ``gpt2-124m``),
  random weights as built, converted by ``revlib_xla.hf.memory_efficient(model, "reversible")``, one forward and
  backward on ``--tokens`` tokens, in ``--dtype`` (weights): float streams (``exact=False``) against exact.
* ``native``: ``revlib_xla.models`` ``llama-1b`` (or ``--size``) in the reversible form, under bfloat16 autocast
  (``--autocast``), float32 weights.
* ``slice``: ``--layers`` real layers of ``--size`` (default ``llama-8b``, hidden 4096) built on the meta device and
  materialised alone, with a small vocabulary: the gradients of the reversible layers against ``no_savings``.
* ``time``: step time of exact against float streams (``verify_inverse=False``) at ``--size``'s width with
  ``--layers`` layers, interleaved rounds, CPU process time.
* ``memory``: the eager peak (tensor storages) of one training step at depths ``--depths``, exact and float.

Gradients are compared parameter by parameter through a digest of their bytes (no second copy of a 1B model's
gradients is kept); where digests differ the largest relative difference is reported from a kept copy of that
parameter only.

Usage: ``python bench/exact_streams.py hf --config llama-3.2-1b --dtype fp32 --out bench/results/...json``; ``--report
DIR`` writes ``exact_streams-cpu.md`` from the JSON lines of every case in DIR.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from revlib_xla import MemoryModes, ReversibleError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def digests(model: nn.Module) -> dict[str, str]:
    """A digest of each parameter gradient's bytes."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[name] = hashlib.blake2b(p.grad.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def compare(model: nn.Module, want: dict[str, str], keep: dict[str, torch.Tensor]) -> dict[str, Any]:
    got = digests(model)
    differ = sorted(n for n in want if got.get(n) != want[n])
    worst = 0.0
    for name in differ:
        if name in keep:
            g = dict(model.named_parameters())[name].grad.float()
            ref = keep[name].float()
            worst = max(worst, float((g - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
    return {"parameters": len(want), "bit_equal": len(want) - len(differ), "differ": differ[:8], "worst_rel": worst}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def rebuild_refusal(run: Callable[[], Any]) -> dict[str, Any]:
    """Run a step with float streams: the rebuild check's verdict (the relative error it measured), or none."""
    try:
        run()
    except ReversibleError as err:
        text = str(err)
        marker = "with a relative error of "
        value = float(text.split(marker)[1].split(" ")[0]) if marker in text else None
        return {"refused": True, "rebuild_error": value}
    return {"refused": False, "rebuild_error": None}


def hf_case(args: argparse.Namespace) -> dict[str, Any]:
    from revlib_xla.hf import memory_efficient, model_from_config

    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    model, build_s = timed(lambda: model_from_config(args.config, dtype=dtype, **overrides).train())
    layers = model.config.num_hidden_layers
    memory_efficient(model, "reversible")
    net = model.revlib_xla_conversion.net
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(1))

    def step() -> float:
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        return float(out.loss)

    record: dict[str, Any] = {"case": "hf", "config": args.config, "dtype": args.dtype, "layers": layers}
    record.update(tokens=args.tokens, hidden=model.config.hidden_size, vocab=vocab, build_s=round(build_s, 1))
    net.exact = False  # floating-point streams, as before: the backward's rebuild check measures them
    record["float_streams"] = rebuild_refusal(step)
    net.exact = None
    net._verified.clear()
    net.memory_mode = MemoryModes.no_savings
    loss_ref, record["no_savings_s"] = timed(step)
    want = digests(model)
    keep = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and p.grad.numel() < 2e7}
    net.memory_mode = MemoryModes.autograd_function
    loss, record["reversible_s"] = timed(step)
    record["loss_equal"] = loss == loss_ref
    record["gradients"] = compare(model, want, keep)
    return record


def native_case(args: argparse.Namespace) -> dict[str, Any]:
    from revlib_xla.models import build_llama, llama_config

    overrides = {} if args.layers is None else {"n_layers": args.layers}
    config = llama_config(args.size, **overrides)
    record: dict[str, Any] = {"case": "native", "size": args.size, "layers": config.n_layers, "tokens": args.tokens}
    record.update(autocast=args.autocast, hidden=config.dim, vocab=config.vocab_size)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens + 1), generator=torch.Generator().manual_seed(1))
    results = {}
    for exact in (False, None):
        for mode in (MemoryModes.no_savings, MemoryModes.autograd_function):
            if exact is False and mode is MemoryModes.no_savings:
                continue
            with torch.device("meta"):
                lm = build_llama(config, "reversible", memory_mode=mode, exact=exact)
            lm.to_empty(device="cpu")
            lm.init_weights(seed=0)

            def step(lm: nn.Module = lm) -> float:
                lm.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
                    loss = lm.loss(ids)
                loss.backward()
                return float(loss)

            if exact is False:
                record["float_streams"] = rebuild_refusal(step)
            elif mode is MemoryModes.no_savings:
                results["loss_ref"], record["no_savings_s"] = timed(step)
                want = digests(lm)
                keep = {
                    n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None and p.grad.numel() < 2e7
                }
            else:
                loss, record["reversible_s"] = timed(step)
                record["loss_equal"] = loss == results["loss_ref"]
                record["gradients"] = compare(lm, want, keep)
            del lm
    return record


def slice_case(args: argparse.Namespace) -> dict[str, Any]:
    """``--layers`` real layers of ``--size`` (their weights as the model initialises them), a 1024-token
    vocabulary: the LM is built on the meta device at full depth first (nothing allocated), then rebuilt with the
    slice's depth and the full model's init scale."""
    from revlib_xla.models import build_llama, llama_config

    full = llama_config(args.size)
    with torch.device("meta"):
        build_llama(full, "reversible")  # the full size builds without allocating
    config = llama_config(args.size, n_layers=args.layers, vocab_size=1024)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens + 1), generator=torch.Generator().manual_seed(1))
    record: dict[str, Any] = {"case": "slice", "size": args.size, "layers": args.layers, "tokens": args.tokens}
    record.update(autocast=args.autocast, hidden=config.dim, full_layers=full.n_layers)
    want: dict[str, str] = {}
    keep: dict[str, torch.Tensor] = {}
    for mode in (MemoryModes.no_savings, MemoryModes.autograd_function):
        with torch.device("meta"):
            lm = build_llama(config, "reversible", memory_mode=mode)
        lm.to_empty(device="cpu")
        lm.init_weights(seed=0)
        _scale_branch_outputs(lm, config.n_layers, full.n_layers)
        lm.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
            loss = lm.loss(ids)
        loss.backward()
        if mode is MemoryModes.no_savings:
            want = digests(lm)
            keep = {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None and p.grad.numel() < 2e7}
        else:
            record["gradients"] = compare(lm, want, keep)
        del lm
    return record


def _scale_branch_outputs(lm: nn.Module, layers: int, full_layers: int) -> None:
    """The output projections drawn at the full model's depth (their init scale shrinks with depth)."""
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_((layers / full_layers) ** 0.5)


def time_case(args: argparse.Namespace) -> dict[str, Any]:
    from revlib_xla.models import build_llama, llama_config

    config = llama_config(args.size, n_layers=args.layers, vocab_size=1024)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens + 1), generator=torch.Generator().manual_seed(1))
    models = {}
    for name, exact in (("float", False), ("exact", True)):
        with torch.device("meta"):
            lm = build_llama(config, "reversible", exact=exact, verify_inverse=False)
        lm.to_empty(device="cpu")
        lm.init_weights(seed=0)
        models[name] = lm

    def step(lm: nn.Module) -> None:
        lm.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
            loss = lm.loss(ids)
        loss.backward()

    times: dict[str, list[float]] = {name: [] for name in models}
    for lm in models.values():
        step(lm)  # warm-up
    for _ in range(args.rounds):
        for name, lm in models.items():
            start = time.process_time()
            step(lm)
            times[name].append(time.process_time() - start)
    ratios = sorted(e / f for e, f in zip(times["exact"], times["float"]))
    record: dict[str, Any] = {"case": "time", "size": args.size, "layers": args.layers, "tokens": args.tokens}
    record.update(autocast=args.autocast, hidden=config.dim, rounds=args.rounds)
    record.update({f"{k}_s": sorted(v)[len(v) // 2] for k, v in times.items()})
    record["ratio_median"] = ratios[len(ratios) // 2]
    record["ratio_range"] = [ratios[0], ratios[-1]]
    return record


def memory_case(args: argparse.Namespace) -> dict[str, Any]:
    from revlib_xla.memory import eager_peak
    from revlib_xla.models import build_llama, llama_config

    rows = []
    for exact in (False, True):
        for depth in args.depths:
            config = llama_config(args.size, n_layers=depth, vocab_size=1024)
            with torch.device("meta"):
                lm = build_llama(config, "reversible", exact=exact, verify_inverse=False)
            lm.to_empty(device="cpu")
            lm.init_weights(seed=0)
            ids = torch.randint(0, config.vocab_size, (1, args.tokens + 1), generator=torch.Generator().manual_seed(1))

            def step(model: nn.Module, tokens: torch.Tensor) -> None:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
                    loss = model.loss(tokens)
                loss.backward()

            peak = eager_peak(step, lm, ids)
            parts = ("total", "parameters", "gradients", "activations", "temporaries", "other")
            rows.append({"exact": exact, "depth": depth, **{k: int(getattr(peak, k)) for k in parts}})
            del lm
    record: dict[str, Any] = {"case": "memory", "size": args.size, "tokens": args.tokens, "autocast": args.autocast}
    record["rows"] = rows
    return record


CASES = {"hf": hf_case, "native": native_case, "slice": slice_case, "time": time_case, "memory": memory_case}


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def report(records: list[dict[str, Any]]) -> str:
    """The markdown of every recorded case (the newest record of each case and shape)."""
    lines = [
        "# Exact (fixed-point) reversible streams at real sizes, CPU",
        "",
        "Written by `python bench/exact_streams.py --report FILE.jsonl` from the records of `bench/exact_streams.py`;",
        "every row ran on this project's 2-core CPU machine (no accelerator), often shared with other jobs: times are",
        "for orientation, ratios come from interleaved rounds.",
        "",
    ]
    machine = records[-1]["machine"] if records else {}
    lines += [f"torch {machine.get('torch')}, {machine.get('threads')} threads, Python {machine.get('python')}.", ""]
    grads = [r for r in records if r["case"] in ("hf", "native", "slice")]
    if grads:
        lines += [
            "## Gradients: the memory-saving backward against `no_savings` (plain autograd, same function)",
            "",
            "| model | layers | hidden | vocab | precision | tokens | float streams | exact: loss equal | exact: "
            "gradients bit-equal |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in grads:
            model = r.get("config") or r.get("size")
            precision = r.get("dtype") or ("fp32 weights, bf16 autocast" if r.get("autocast") else "fp32")
            floats = r.get("float_streams")
            if floats is None:
                float_text = "-"
            elif floats["refused"]:
                float_text = f"refused (rebuild error {floats['rebuild_error']})"
            else:
                float_text = "accepted"
            g = r["gradients"]
            lines.append(
                f"| {model} | {r['layers']} | {r['hidden']} | {r.get('vocab', 1024)} | {precision} | {r['tokens']} | "
                f"{float_text} | {r.get('loss_equal', '-')} | {g['bit_equal']} of {g['parameters']} |"
            )
        lines.append("")
    for r in (r for r in records if r["case"] == "time"):
        lines += [
            "## Step time: exact against floating-point streams",
            "",
            f"{r['size']} width (hidden {r['hidden']}), {r['layers']} layers, 1 x {r['tokens']} tokens, "
            f"{'bf16 autocast' if r['autocast'] else 'float32'}, forward + backward, CPU process time, {r['rounds']} "
            f"interleaved rounds (`verify_inverse=False` in both):",
            "",
            "| float streams (median) | exact streams (median) | exact / float, median of the rounds | range |",
            "|---|---|---|---|",
            f"| {r['float_s']:.2f} s | {r['exact_s']:.2f} s | {r['ratio_median']:.3f} | "
            f"{r['ratio_range'][0]:.3f} - {r['ratio_range'][1]:.3f} |",
            "",
        ]
    for r in (r for r in records if r["case"] == "memory"):
        lines += [
            "## Memory against depth (eager peak, MemTracker: tensor storages)",
            "",
            f"{r['size']} width, vocabulary 1024, 1 x {r['tokens']} tokens, "
            f"{'bf16 autocast' if r['autocast'] else 'float32'}; activations and temporaries are what the step adds "
            f"beyond parameters and gradients:",
            "",
            "| streams | layers | peak | parameters | gradients | activations + temporaries + other |",
            "|---|---|---|---|---|---|",
        ]
        for row in r["rows"]:
            rest = row["activations"] + row["temporaries"] + row["other"]
            lines.append(
                f"| {'exact' if row['exact'] else 'float'} | {row['depth']} | {_gib(row['total'])} | "
                f"{_gib(row['parameters'])} | {_gib(row['gradients'])} | {_gib(rest)} |"
            )
        lines.append("")
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", choices=sorted(CASES), nargs="?")
    parser.add_argument("--report", default=None, help="write the markdown of this JSON-lines file's records")
    parser.add_argument("--config", default="llama-3.2-1b")
    parser.add_argument("--size", default="llama-1b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--autocast", action="store_true")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--out", default=None, help="append the record to this JSON-lines file")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            records = [json.loads(line) for line in f if line.strip()]
        out = os.path.splitext(args.report)[0] + ".md"
        with open(out, "w") as f:
            f.write(report(records) + "\n")
        print(out)
        return
    if args.case is None:
        parser.error("name a case, or --report FILE")
    if args.case == "slice" and args.layers is None:
        args.layers = 2
    if args.case in ("time",) and args.layers is None:
        args.layers = 4
    record = CASES[args.case](args)
    record["machine"] = machine()
    line = json.dumps(record)
    print(line)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
