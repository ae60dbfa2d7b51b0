#!/usr/bin/env python
"""llama-8b fully fine-tuned on one GPU with the composed strategy (gpu_configs/llama-8b-24gb.yaml), measured: the
command a lent GPU runs after ``make gpu-check`` (``make gpu-8b``; about 3 minutes on an H100, most of it the host's
AdamW over 8 B weights).

On the GPU (under a 24 GiB limit, ``torch.cuda.set_per_process_memory_fraction``, where the card has more): the
config's steps at 1 x 2048 tokens, ``optim.grad_clip=0`` (each weight stepped on the host as its gradient arrives,
beside the rest of the backward) and then the default clipping; per step its time, tokens/s, each phase's peak
(forward, backward, optimizer step: ``revlib_xla.train.metrics.PhasePeaks``) and the allocator's peak; the same
steps with the gradients freed instead of sent (``HostOptimizer.gradients_dropped``: the device's own forward and
backward, no host work), whose time the step's is compared with; and ``revlib-xla memory``'s estimate of the same
step beside the measured peak. Writes ``<out-dir>/gpu_8b-cuda-<device>.md``.

The host needs the masters and moments (89.75 GiB) and, with clipping, the bfloat16 gradients (14.96 GiB more): a
host with less is refused before the first step, and said so in the file.

``--dry``: llama-tiny on the CPU (2 steps), so that the command cannot rot between GPUs (tests/project/test_gpu_8b.py).
``--wheels DIR`` installs pydantic first (the GPU image lacks it), as ``bench/gpu_check.py`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # bench/ is not a package: found by the path above

GiB = 2**30
CONFIG = ROOT / "gpu_configs" / "llama-8b-24gb.yaml"
TINY = "model.overrides={vocab_size: 256, dim: 64, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 128}"


def run_case(overrides: list[str], steps: int, dry: bool, limit_gib: float | None) -> dict[str, Any]:
    """One configuration's steps, measured (see the module docstring)."""
    import torch

    from revlib_xla.fit.chips import chip
    from revlib_xla.fit.gpu import estimate_step, for_gpu
    from revlib_xla.train.config import load_config
    from revlib_xla.train.metrics import PhasePeaks
    from revlib_xla.train.strategy import StepReport, build_model, build_optimizer, lr_at, make_step

    device = torch.device("cpu" if dry else "cuda")
    size = [TINY, "data.seq_len=64"] if dry else []
    cfg = load_config(str(CONFIG), [*size, *overrides, f"train.device={device.type}"])
    result: dict[str, Any] = {"overrides": overrides}
    gpu = chip(cfg.chip.name)
    estimate = estimate_step(for_gpu(cfg, gpu))
    result["estimate"] = {"peak": estimate.peak, "phases": dict(estimate.phases), "host": estimate.host}
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        if limit_gib is not None and total > limit_gib * GiB:
            torch.cuda.set_per_process_memory_fraction(limit_gib * GiB / total)
            result["limit"] = limit_gib * GiB
    model = build_model(cfg, device)
    opt = build_optimizer(cfg, model)
    report = StepReport()
    phases = PhasePeaks(device)
    report.on_phase = phases.mark if phases.on else None
    step = make_step(cfg, model, opt, report)
    g = torch.Generator().manual_seed(0)
    vocab = 256 if dry else 128256
    tokens = cfg.data.batch_size * cfg.data.seq_len

    def batch() -> torch.Tensor:
        return torch.randint(0, vocab, (cfg.data.batch_size, cfg.data.seq_len), generator=g)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    timed, device_only, losses = [], [], []
    for i in range(steps + 1):  # the first creates the host state (masters, moments)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, i)
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        phases.take()
        start = time.perf_counter()
        losses.append(float(step(batch())))
        sync()
        seconds = time.perf_counter() - start
        taken = phases.take()
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
        if i:
            timed.append({"seconds": seconds, "peak": peak, "phases": dict(taken.peaks)})
    for _ in range(max(1, steps // 2)):  # the device's own forward and backward: gradients freed, not sent
        sync()
        start = time.perf_counter()
        with opt.gradients_dropped():
            loss = step(batch())
        sync()
        device_only.append(time.perf_counter() - start)
        del loss
    step_s = sorted(r["seconds"] for r in timed)[len(timed) // 2]
    device_s = sorted(device_only)[len(device_only) // 2]
    peaks = [r["peak"] for r in timed if r["peak"] is not None]
    result.update(
        losses=losses,
        steps=timed,
        step_s=step_s,
        device_s=device_s,
        ratio=step_s / device_s,
        tokens_per_s=tokens / step_s,
        peak=max(peaks) if peaks else None,
        reserved=torch.cuda.max_memory_reserved() if device.type == "cuda" else None,
    )
    del model, opt, step
    return result


def child(args: argparse.Namespace) -> int:
    cases = [["optim.grad_clip=0"], []]  # each weight stepped as it arrives; then the default global-norm clipping
    found = []
    for overrides in cases:
        try:
            found.append(run_case(overrides, args.steps, args.dry, args.limit_gib))
        except BaseException as exc:  # recorded; the next case still runs
            found.append({"overrides": overrides, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            traceback.print_exc()
        import gc

        gc.collect()
        if not args.dry:
            import torch

            torch.cuda.empty_cache()
    Path(args.json).write_text(json.dumps(found))
    return 0


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def write(out: Path, env: dict[str, Any], dry: bool, found: list[dict[str, Any]], notes: list[str]) -> None:
    lines = [
        "# llama-8b fully fine-tuned on one GPU: the composed strategy, measured",
        "",
        *gpu_check.header_lines(env, dry),
        "",
        "`bench/gpu_8b.py` (`make gpu-8b`): gpu_configs/llama-8b-24gb.yaml (reversible layers, bfloat16 weights, "
        "each gradient streamed to the host, AdamW over float32 masters on the host), 1 x 2048 tokens of random "
        "ids, under a 24 GiB limit of the device's memory; each row's step time is the median of the steps after "
        "the first; *device only*: the same steps with the gradients freed instead of sent (no host work).",
        *[f"- {note}" for note in notes],
        "",
        "| case | step s | device only s | step / device | tokens/s | peak (allocated) | estimate | "
        "measured / estimate | phases (measured) | phases (estimate) | reserved |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in found:
        case = " ".join(r["overrides"]) or "optim.grad_clip=1.0 (default)"
        if "error" in r:
            lines.append(f"| {case} | failed: {r['error'][:400]} |" + " |" * 9)
            continue
        measured = max((p for s in r["steps"] for p in s["phases"].values()), default=None)
        phases = {k: max(s["phases"].get(k, 0) for s in r["steps"]) for k in r["estimate"]["phases"]}
        ratio = "-" if r["peak"] is None else f"{r['peak'] / r['estimate']['peak']:.3f}"
        lines.append(
            f"| {case} | {r['step_s']:.2f} | {r['device_s']:.2f} | {r['ratio']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{_gib(r['peak'])} | {_gib(r['estimate']['peak'])} | {ratio} | "
            + ", ".join(f"{k} {_gib(v)}" for k, v in phases.items() if measured is not None)
            + " | "
            + ", ".join(f"{k} {_gib(v)}" for k, v in r["estimate"]["phases"].items())
            + f" | {_gib(r['reserved'])} |"
        )
    lines.append("")
    out.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry", action="store_true", help="llama-tiny on the CPU: checks the command, measures nothing"
    )
    parser.add_argument("--steps", type=int, default=3, help="steps measured per case, after a first one (3)")
    parser.add_argument("--limit-gib", type=float, default=24.0, help="the device memory the run may use (24)")
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--wheels", help="install pydantic from this folder first (no index), as gpu_check does")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    notes = []
    if args.wheels:
        notes += gpu_check.install_wheels(Path(args.wheels), out_dir / "gpu_8b-install.log")
    env = dict(gpu_check.probe_environment(), commit=gpu_check._commit(), date=time.strftime("%Y-%m-%d %H:%M"))
    tag = gpu_check.device_tag(env, args.dry)
    data = out_dir / f"gpu_8b-{tag}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--json", str(data), "--steps", str(args.steps)]
    cmd += ["--limit-gib", str(args.limit_gib)] + (["--dry"] if args.dry else [])
    done = subprocess.run(cmd, env=gpu_check.child_env(), cwd=ROOT, check=False)
    found = json.loads(data.read_text()) if data.exists() else []
    if done.returncode != 0:
        notes.append(f"the measuring process ended with exit status {done.returncode}")
    write(out_dir / f"gpu_8b-{tag}.md", env, args.dry, found, notes)
    print((out_dir / f"gpu_8b-{tag}.md").read_text())
    return 0 if found and all("error" not in r for r in found) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
