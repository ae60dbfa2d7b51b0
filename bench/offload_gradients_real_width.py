"""The composed 8B-on-one-GPU strategy at a real width on the CPU: Llama-2-7B's layer (hidden 4096, 32 heads, MLP
11008) and vocabulary (32000), 2 layers, untied embeddings; reversible layers, bfloat16 weights, each gradient
streamed to the host, AdamW over float32 masters there (``strategy.offload.gradients``), global-norm clipping 1.0.
Beside it the same steps written out with torch alone (the bfloat16 model's gradients widened to float32, torch's
clip_grad_norm_, torch's AdamW over float32 masters): their losses and final master weights must be equal, bit for
bit, after every step.

Llama-3-8B's vocabulary (128256) with 2 layers is 1.49 B parameters, whose masters and moments alone (17.9 GB) and
the reference's beside them do not fit this 24 GB machine; Llama-2-7B's is a real vocabulary of the same width.

    python bench/offload_gradients_real_width.py [--steps 100] [--out bench/results/offload_gradients_real_width-cpu.md]
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import resource
import time
from pathlib import Path

import torch

from revlib_xla.train.config import load_config
from revlib_xla.train.strategy import build_model, build_optimizer, lr_at, make_step

SLICE = (
    "model.overrides={vocab_size: 32000, dim: 4096, n_layers: 2, n_heads: 32, n_kv_heads: 32, ffn_dim: 11008, "
    "tie_embeddings: false}"
)
BASE = [
    SLICE,
    "data.seq_len=64",
    "data.batch_size=1",
    "optim.lr=1e-4",
    "optim.warmup_steps=5",
    "strategy=reversible",
    "strategy.param_dtype=bf16",
    "strategy.precision=bf16",
    "strategy.offload.optimizer=true",
]


def batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 32000, (1, 64), generator=g) for _ in range(steps)]


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def streamed(steps: int) -> tuple[list[float], list[str], float, str]:
    cfg = load_config(None, [*BASE, "strategy.offload.gradients=true"])
    model = build_model(cfg, "cpu")
    opt = build_optimizer(cfg, model)
    step = make_step(cfg, model, opt)
    losses, digests, start = [], [], time.perf_counter()
    for i, batch in enumerate(batches(steps)):
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, i)
        losses.append(float(step(batch)))
        if i + 1 in (1, steps // 2, steps):
            digests.append(digest([m for _, m in opt.master_weights()]))
        print(f"streamed step {i + 1}: loss {losses[-1]:.6f}", flush=True)
    seconds = (time.perf_counter() - start) / steps
    count = sum(p.numel() for p in model.parameters())
    return losses, digests, seconds, f"{count / 1e9:.3f} B parameters"


def reference(steps: int) -> tuple[list[float], list[str], float]:
    cfg = load_config(None, BASE)
    model = build_model(cfg, "cpu")  # the same bfloat16 weights from the same seed
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_() for p in params]
    o = cfg.optim
    groups = [
        {"params": [m for m in masters if m.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [m for m in masters if m.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps)
    losses, digests, start = [], [], time.perf_counter()
    for i, batch in enumerate(batches(steps)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model.loss(batch)
        loss.backward()
        losses.append(float(loss.detach()))
        for p, m in zip(params, masters):
            m.grad = p.grad.detach().float()
            p.grad = None
        norm = torch.nn.utils.get_total_norm([m.grad for m in masters], 2.0)
        torch.nn.utils.clip_grads_with_norm_(masters, o.grad_clip, norm)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, i)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        if i + 1 in (1, steps // 2, steps):
            digests.append(digest(masters))
        print(f"reference step {i + 1}: loss {losses[-1]:.6f}", flush=True)
    return losses, digests, (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", default="bench/results/offload_gradients_real_width-cpu.md")
    args = parser.parse_args()
    torch.set_num_threads(2)
    s_losses, s_digests, s_time, size = streamed(args.steps)
    peak_streamed = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    r_losses, r_digests, r_time = reference(args.steps)
    equal_losses = sum(a == b for a, b in zip(s_losses, r_losses))
    equal_masters = sum(a == b for a, b in zip(s_digests, r_digests))
    checked = sorted({1, args.steps // 2, args.steps})
    lines = [
        "# The composed strategy at a real width on the CPU, against plain float32 AdamW",
        "",
        "`python bench/offload_gradients_real_width.py` (bench/offload_gradients_real_width.py): Llama-2-7B's layer "
        "and vocabulary (hidden 4096, 32 heads, MLP 11008, vocabulary 32000), 2 layers, untied; batch 1 x 64 "
        "random tokens; reversible (exact) layers, bfloat16 weights and autocast, each gradient streamed to the host "
        "(strategy.offload.gradients), AdamW over float32 masters on the host, optim.grad_clip=1.0 (every step "
        "waits for the global norm), lr 1e-4 with 5 warm-up steps and cosine decay. The reference: the same "
        "bfloat16 model's gradients widened to float32, torch's clip_grad_norm_ (get_total_norm, "
        "clip_grads_with_norm_), torch's AdamW over float32 masters.",
        "",
        f"- Machine: {platform.machine()}, {platform.processor() or 'cpu'}, torch {torch.__version__}, 2 threads",
        f"- Model: {size}",
        f"- Steps: {args.steps}",
        f"- Losses equal (==, float32): {equal_losses} of {args.steps}",
        f"- Master weights equal (SHA-256 of their bytes) after steps {', '.join(map(str, checked))}: "
        f"{equal_masters} of {len(s_digests)}",
        f"- First and last loss: {s_losses[0]:.6f} -> {s_losses[-1]:.6f} (reference {r_losses[0]:.6f} -> "
        f"{r_losses[-1]:.6f})",
        f"- Seconds per step: streamed {s_time:.2f}, reference {r_time:.2f} (the CPU is both device and host: no "
        "overlap to gain here; a speed figure belongs to a GPU run)",
        f"- Peak resident memory of the process after the streamed run: {peak_streamed / 2**30:.2f} GiB",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
