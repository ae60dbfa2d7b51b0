"""Step times of converted transformers models with the clients people train with, as ratios in the same run:

* **a padding collator's batches** (``DataCollatorWithPadding``: 16 batches of 9 lengths): ``plan`` (budget auto,
  and a budget that recomputes) against transformers' checkpointing and the plain model, every batch timed, rounds
  interleaved; the first round (where the plan measures the lengths longer than all before) reported apart;
* **``torch.compile``** (inductor) against eager, for the plain model, ``plan``, ``momentum`` and ``reversible``:
  steady-state step times after warm-up, and the compile's own time.

``nice .venv/bin/python bench/hf_clients_speed.py`` (~10 min on 2 CPU cores) writes
``bench/results/hf_clients_speed-cpu.{md,json}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from revlib_xla.hf import memory_efficient

LENGTHS = [160, 72, 248, 96, 248, 200, 72, 256, 112, 160, 264, 96, 256, 200, 144, 72]


def llama(layers: int, hidden: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=int(hidden * 2.6875), num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=512,
        tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).train()


def batches(batch: int) -> list[dict[str, torch.Tensor]]:
    import transformers
    from tokenizers import Tokenizer, models

    vocab = {"[PAD]": 0, **{f"<{i}>": i for i in range(1, 256)}}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[PAD]")), pad_token="[PAD]"
    )
    collator = transformers.DataCollatorWithPadding(tokenizer, return_tensors="pt")
    gen = torch.Generator().manual_seed(0)
    out = []
    for longest in LENGTHS:
        sizes = [int(torch.randint(longest // 2, longest + 1, (1,), generator=gen)) for _ in range(batch - 1)]
        rows = [torch.randint(1, 256, (n,), generator=gen) for n in [*sizes, longest]]
        out.append(collator([{"input_ids": r.tolist()} for r in rows]))
    return out


def step(model, batch) -> float:
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    t = time.perf_counter()
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss.backward()
    elapsed = time.perf_counter() - t
    model.zero_grad(set_to_none=True)
    return elapsed


def collator_rows(layers: int, hidden: int, batch: int, rounds: int) -> dict:
    data = batches(batch)
    base = llama(layers, hidden)
    models = {"plain": copy.deepcopy(base)}
    models["hf checkpointing"] = copy.deepcopy(base)
    models["hf checkpointing"].gradient_checkpointing_enable()
    models["plan (budget auto)"] = memory_efficient(copy.deepcopy(base), "plan")
    models["plan (smallest budget: below hf's bytes)"] = memory_efficient(copy.deepcopy(base), "plan")
    cp = models["plan (smallest budget: below hf's bytes)"].revlib_xla_conversion.checkpointable
    measure = cp.measure
    measured = []

    def smallest(sample):
        measured.append(tuple(sample[0].shape))
        chain = measure(sample)
        cp.mem_limit = cp.min_memory() * 1.02
        return chain

    cp.measure = smallest
    times: dict[str, list[list[float]]] = {name: [] for name in models}
    for r in range(rounds):
        for name, model in models.items():  # interleaved: every model once per round
            times[name].append([step(model, b) for b in data])
        print("round", r, {k: round(sum(v[-1]), 2) for k, v in times.items()}, flush=True)
    steady = {name: statistics.median(sum(t) for t in rounds_[1:]) for name, rounds_ in times.items()}
    first = {name: sum(rounds_[0]) for name, rounds_ in times.items()}
    return {"steady_seconds": steady, "first_round_seconds": first, "measured_shapes": measured, "rounds": rounds}


def compile_rows(layers: int, hidden: int, batch: int, seq: int, steps: int) -> dict:
    ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(3))
    rows = {}
    for strategy in ("none", "plan", "momentum", "reversible"):
        base = llama(layers, hidden)
        if strategy != "none":
            memory_efficient(base, strategy)
        eager, compiled = base, torch.compile(copy.deepcopy(base))
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        t = time.perf_counter()
        for _ in range(3):  # warm-up: the compiles (and the plan's measurement)
            step(compiled, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        compile_seconds = time.perf_counter() - t
        for _ in range(3):
            step(eager, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        for _ in range(steps):
            for name, m in (("eager", eager), ("compiled", compiled)):
                times[name].append(step(m, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}))
        rows[strategy] = {
            "eager": statistics.median(times["eager"]),
            "compiled": statistics.median(times["compiled"]),
            "warm_up_seconds": compile_seconds,
        }
        print(strategy, rows[strategy], flush=True)
    return rows


def report(result: dict) -> str:
    s = result["setting"]
    c = result["collator"]
    lines = [
        "# Converted transformers models with a padding collator and torch.compile: step times",
        "",
        f"`bench/hf_clients_speed.py`, CPU ({result['machine']}, 2 cores, torch {result['torch']}), float32, a "
        f"transformers Llama ({s['layers']} layers, hidden {s['hidden']}, bytes vocabulary).",
        "",
        f"**A padding collator** (`DataCollatorWithPadding`, {len(LENGTHS)} batches of {s['batch']} rows padded to "
        f"{len(set(LENGTHS))} lengths from {min(LENGTHS)} to {max(LENGTHS)}): the 16 batches' time, the median of "
        f"rounds 2-{c['rounds']} (interleaved), and the first round, where the plans measure (the smallest-budget "
        f"plan measured {len(c['measured_shapes'])} times: {', '.join(str(x[1]) for x in c['measured_shapes'])} "
        "tokens).",
        "",
        "| model | 16 batches | against hf checkpointing | first round |",
        "|---|---|---|---|",
    ]
    ref = c["steady_seconds"]["hf checkpointing"]
    for name, seconds in c["steady_seconds"].items():
        lines.append(f"| {name} | {seconds:.2f} s | {seconds / ref:.3f}x | {c['first_round_seconds'][name]:.2f} s |")
    lines += [
        "",
        f"**torch.compile** (inductor, default mode) against eager, {s['compile_batch']} x {s['compile_seq']} tokens: "
        f"medians of {s['compile_steps']} interleaved steps after 3 warm-up steps.",
        "",
        "| strategy | eager | compiled | compiled / eager | warm-up (3 steps, compiles included) |",
        "|---|---|---|---|---|",
    ]
    for name, row in result["compile"].items():
        lines.append(
            f"| {name} | {row['eager'] * 1e3:.1f} ms | {row['compiled'] * 1e3:.1f} ms | "
            f"{row['compiled'] / row['eager']:.3f}x | {row['warm_up_seconds']:.1f} s |"
        )
    lines += [
        "",
        "`momentum` and `reversible` run their stacks eagerly inside the compiled model (one graph break each): "
        "what compiles is the embedding, the final norm, the head and the loss.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/hf_clients_speed-cpu")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(2)
    setting = {
        "layers": args.layers, "hidden": args.hidden, "batch": 4, "compile_batch": 4, "compile_seq": 256,
        "compile_steps": 10,
    }  # fmt: skip
    result = {"setting": setting, "machine": platform.processor() or platform.machine(), "torch": torch.__version__}
    result["collator"] = collator_rows(args.layers, args.hidden, setting["batch"], args.rounds)
    result["compile"] = compile_rows(args.layers, args.hidden, setting["compile_batch"], setting["compile_seq"], 10)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(report(result))


if __name__ == "__main__":
    main()
