"""Does a converted pretrained model keep what it learned? A transformers Llama trained to a plateau on the Python
standard library's sources (bytes), then converted by ``revlib_xla.hf.memory_efficient`` with each strategy: its
validation loss right after the conversion, and after 100 fine-tuning steps against 100 steps of the plain model;
beside it, the bytes each strategy keeps per layer between the forward and the backward at Llama-3.2-1B's width
(hidden 2048, vocabulary 128256), against transformers' own checkpointing.

``nice .venv/bin/python bench/hf_keeps_what_it_learned.py`` (~15 min on 2 CPU cores) writes
``bench/results/hf_keeps_what_it_learned-cpu.{md,json}``; ``--quick`` runs a 6-layer model for a few steps.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from revlib_xla import memory
from revlib_xla.demo.data import load_corpus, sample_batch, split_corpus
from revlib_xla.hf import memory_efficient


@dataclasses.dataclass(frozen=True)
class Setting:
    layers: int = 12
    hidden: int = 128
    heads: int = 4
    intermediate: int = 344
    batch: int = 16
    seq: int = 128
    pretrain_steps: int = 600
    pretrain_lr: float = 3e-3
    finetune_steps: int = 100
    finetune_lr: float = 1e-3
    eval_batches: int = 40
    corpus_bytes: int = 4 << 20


#: strategy name -> memory_efficient arguments (None: the plain model; "hf": transformers' checkpointing)
STRATEGIES: dict[str, dict | str | None] = {
    "plain": None,
    "hf checkpointing": "hf",
    "plan": {"strategy": "plan"},
    "momentum (beta 2**-6, default)": {"strategy": "momentum"},
    "momentum (beta 2**-8)": {"strategy": "momentum", "beta": 2**-8},
    "momentum (beta 2**-4)": {"strategy": "momentum", "beta": 2**-4},
    "reversible (two-stream)": {"strategy": "reversible"},
}


def llama(setting: Setting, seed: int = 0, **fields):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=setting.hidden,
        intermediate_size=setting.intermediate,
        num_hidden_layers=setting.layers,
        num_attention_heads=setting.heads,
        num_key_value_heads=setting.heads,
        max_position_embeddings=max(256, setting.seq),
        tie_word_embeddings=False,
        use_cache=False,
        **fields,
    )
    return transformers.LlamaForCausalLM(config)


def convert(model, how):
    if how is None:
        return model
    if how == "hf":
        model.gradient_checkpointing_enable()
        return model
    return memory_efficient(model, **how)


@torch.no_grad()
def validation_loss(model, val: torch.Tensor, setting: Setting) -> float:
    gen = torch.Generator().manual_seed(123)
    was = model.training
    model.eval()
    total = 0.0
    for _ in range(setting.eval_batches):
        ids = sample_batch(val, setting.batch, setting.seq, gen)
        total += float(model(ids, labels=ids, use_cache=False).loss)
    model.train(was)
    return total / setting.eval_batches


def train(model, data: torch.Tensor, steps: int, lr: float, seed: int, setting: Setting) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model.train()
    losses = []
    for _ in range(steps):
        ids = sample_batch(data, setting.batch, setting.seq, gen)
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def pretrained(setting: Setting, cache: Path | None):
    train_text, val_text = split_corpus(load_corpus(setting.corpus_bytes), 0.05)
    model = llama(setting)
    key = f"{setting.layers}x{setting.hidden}-{setting.pretrain_steps}-{setting.batch}x{setting.seq}"
    path = None if cache is None else cache / f"pretrained-{key}.pt"
    if path is not None and path.exists():
        model.load_state_dict(torch.load(path))
        return model, train_text, val_text, None
    t = time.perf_counter()
    losses = train(model, train_text, setting.pretrain_steps, setting.pretrain_lr, 1, setting)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), path)
    return model, train_text, val_text, {"seconds": time.perf_counter() - t, "last_losses": losses[-10:]}


def keeps(setting: Setting, cache: Path | None) -> dict:
    base, train_text, val_text, pre = pretrained(setting, cache)
    trained = validation_loss(base, val_text, setting)
    rows = {}
    for name, how in STRATEGIES.items():
        model = convert(copy.deepcopy(base), how)
        at_conversion = validation_loss(model, val_text, setting)
        t = time.perf_counter()
        train(model, train_text, setting.finetune_steps, setting.finetune_lr, 2, setting)
        seconds = time.perf_counter() - t
        rows[name] = {"at_conversion": at_conversion, "fine_tuned": validation_loss(model, val_text, setting)}
        rows[name]["fine_tune_seconds"] = seconds
        print(name, rows[name], flush=True)
    plain = rows["plain"]["fine_tuned"]
    for row in rows.values():
        row["jump"] = row["at_conversion"] / trained - 1
        row["behind_plain_fine_tune"] = row["fine_tuned"] / plain - 1
    return {"pretrained": trained, "pretraining": pre, "rows": rows}


def held_per_layer(how, dtype: torch.dtype, tokens: int, layers=(2, 4)) -> tuple[float, float]:
    """Bytes live after the forward (StorageTracker: every storage, each once) less those before, at Llama-3.2-1B's
    width and vocabulary, on fake tensors (counted as on real ones; nothing computed): per added layer, and at its 16
    layers (extrapolated from 2 and 4)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from revlib_xla.fit.gpu import _on_fake_host
    from revlib_xla.hf import model_from_config

    held = []
    for depth in layers:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        model = model_from_config("llama-3.2-1b", num_hidden_layers=depth, device="meta", dtype=dtype)
        model.config.use_cache = False
        _on_fake_host(model, mode)
        model = convert(model.train(), how)
        with mode:
            ids = torch.zeros(1, tokens, dtype=torch.int64)
            tracker = memory.StorageTracker()
            tracker.track(model, ids)
            with tracker:
                before = tracker.current()
                out = model(input_ids=ids, labels=ids, use_cache=False)
                held.append(tracker.current() - before)
            out.loss.backward()
        del model, out
    per_layer = (held[1] - held[0]) / (layers[1] - layers[0])
    return per_layer, held[0] + (16 - layers[0]) * per_layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="bench/results/hf_keeps_what_it_learned-cpu")
    parser.add_argument("--cache", default=".cache/bench")
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(2)
    setting = Setting()
    if args.quick:
        setting = Setting(layers=6, hidden=64, intermediate=172, batch=8, seq=64, pretrain_steps=150)
    result = {"setting": dataclasses.asdict(setting), "machine": platform.processor() or platform.machine()}
    result["torch"] = torch.__version__
    out = Path(args.out)
    partial = out.with_suffix(".keeps.json")  # the fine-tuning rows, kept if the byte counts below are re-run
    if partial.exists() and not args.quick:
        result.update(json.loads(partial.read_text()))
    else:
        result.update(keeps(setting, Path(args.cache) if args.cache else None))
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({k: result[k] for k in ("pretrained", "pretraining", "rows")}))
    widths = {}
    for name, how in STRATEGIES.items():
        if name == "plan":  # its bytes follow its budget: planner.md
            continue
        for dtype in (torch.float32, torch.bfloat16):
            key = f"{name} {str(dtype).removeprefix('torch.')}"
            widths[key] = held_per_layer(how, dtype, args.tokens)
            print(key, widths[key], flush=True)
    result["held_per_layer"] = {"tokens": args.tokens, "bytes": widths}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(report(result))
    partial.unlink()


def report(result: dict) -> str:
    s = result["setting"]
    lines = [
        "# A converted pretrained model keeps what it learned",
        "",
        f"`bench/hf_keeps_what_it_learned.py`, CPU ({result['machine']}, torch {result['torch']}), float32. A "
        f"transformers Llama ({s['layers']} layers, hidden {s['hidden']}, bytes vocabulary) trained for "
        f"{s['pretrain_steps']} steps ({s['batch']} x {s['seq']} bytes, AdamW {s['pretrain_lr']}) on the Python "
        f"standard library's sources: validation loss {result['pretrained']:.4f}. Each strategy converts a copy "
        f"(`revlib_xla.hf.memory_efficient`), then {s['finetune_steps']} fine-tuning steps (AdamW "
        f"{s['finetune_lr']}, the same batches for every row). Validation: {s['eval_batches']} batches of held-out "
        "text, in eval mode (the converted model's own function).",
        "",
        "| strategy | right after conversion | change | after fine-tuning | against plain fine-tuning |",
        "|---|---|---|---|---|",
    ]
    for name, row in result["rows"].items():
        lines.append(
            f"| {name} | {row['at_conversion']:.4f} | {100 * row['jump']:+.2f} % | {row['fine_tuned']:.4f} | "
            f"{100 * row['behind_plain_fine_tune']:+.2f} % |"
        )
    lines += [
        "",
        "`plan` and transformers' checkpointing compute the plain model's function (equal within 1e-10 in float64, "
        "`tests/hf/test_hf_convert.py`); in float32 `plan` rounds differently (its chunked loss, its order of "
        f"gradient sums), and over {s['finetune_steps']} AdamW steps that alone moved the validation loss by "
        f"{100 * result['rows']['plan']['behind_plain_fine_tune']:+.2f} %: the scale of the noise in the last "
        "column. (No step times here: at this size they say nothing; see `bench/README.md`.)",
    ]
    held = result["held_per_layer"]
    lines += [
        "",
        f"Bytes each strategy keeps per layer between the forward and the backward, at Llama-3.2-1B's width (hidden "
        f"2048, vocabulary 128256; 2 and 4 layers, 1 x {held['tokens']} tokens, on fake tensors; StorageTracker: every "
        "storage live after the forward, less those before, per added layer):",
        "",
        "| strategy | dtype | per layer | bytes per element of the hidden state | against hf checkpointing | "
        "whole forward at 16 layers (with the logits) |",
        "|---|---|---|---|---|---|",
    ]
    elements = held["tokens"] * 2048
    for key, (value, total) in held["bytes"].items():
        name, dtype = key.rsplit(" ", 1)
        ref = held["bytes"][f"hf checkpointing {dtype}"][0]
        lines.append(
            f"| {name} | {dtype} | {value / 2**20:.3f} MiB | {value / elements:.3f} | {value / ref:.3f}x | "
            f"{total / 2**20:.1f} MiB |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
