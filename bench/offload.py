#!/usr/bin/env python
"""Benchmark of parameter offload and the fused optimizer (issue 5).

On one device per run, with the same weights and inputs, the median training-step time (forward, loss, backward,
optimizer step) of:

* ``reversible``             - revlib_xla ReversibleSequential, parameters on the device, unfused SGD;
* ``reversible+offload``     - the same with ``target_device``: parameters on the cpu, streamed layer by layer;
* ``reversible+fused``       - the same as ``reversible`` with ``fused_optimizer`` (SGD stepped in the backward);
* ``revlib-1.7.2``, ``revlib-1.7.2+offload`` - the real RevLib (``target_device``) when ``--revlib-dir`` points to
  an install of it (``pip install --no-deps --target DIR revlib==1.7.2``; cpu and cuda only: RevLib has no XLA code);
* ``sequential``             - a plain ``nn.Sequential`` of the same blocks on the device;
* ``offload_model``          - revlib_xla.OffloadModel of it (4 slices, ``checkpoint_activation=True``);
* ``fairscale-0.4.13``       - fairscale's OffloadModel, only where it runs (it requires CUDA) and is importable.

Also the time of the parameter transfers alone (every layer's copy to the device, as the streamer does them), and
from it the share of transfer time hidden behind compute:
``hidden = (t(reversible) + t(transfers, forward + backward) - t(reversible+offload)) / t(transfers)``, clamped to
[0, 1]. On cpu and xla the copies are synchronous, so nothing can be hidden there; on cuda they run on a side stream.

Timings are interleaved round-robin over the variants. Results go to ``bench/results/offload-<device>.json/.md``
with the device's name. Usage: ``python bench/offload.py [--device cpu|xla|cuda] [--quick] [--revlib-dir DIR]``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
from torch import nn

import revlib_xla
from revlib_xla import backends

CONFIGS = {
    "full": {"width": 256, "depth": 16, "batch": 64, "repeats": 9, "warmup": 2},
    "quick": {"width": 32, "depth": 4, "batch": 4, "repeats": 3, "warmup": 1},
}


def block(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"XLA:CPU on {name}" if device.type == "xla" else name


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


class Variant:
    """A model, its optimizer and its step on ``device``."""

    def __init__(
        self,
        name: str,
        model: nn.Module,
        opt: torch.optim.Optimizer | None,
        device: torch.device,
        in_width: int,
        batch: int,
    ):
        self.name, self.model, self.opt, self.device = name, model, opt, device
        gen = torch.Generator().manual_seed(0)
        # RevLib 1.7.2 gives its parameters no gradient unless the input needs one: all variants get such an input
        self.x = torch.randn(batch, in_width, generator=gen).to(device).requires_grad_()
        self.times: list[float] = []

    def step(self) -> None:
        loss = (self.model(self.x) - self.x.detach()).square().mean()
        loss.backward()
        if self.opt is not None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        backends.sync(self.device)

    def timed(self) -> None:
        start = time.perf_counter()
        self.step()
        self.times.append(time.perf_counter() - start)


def import_revlib(revlib_dir: str | None):
    if not revlib_dir:
        return None
    sys.path.insert(0, str(Path(revlib_dir).resolve()))
    try:
        import revlib

        return revlib
    except Exception as exc:  # not installed there
        print(f"revlib not importable from {revlib_dir}: {exc}")
        return None


def build(cfg: dict, device: torch.device, revlib_dir: str | None) -> dict[str, Variant]:
    width, depth, batch = cfg["width"], cfg["depth"], cfg["batch"]
    torch.manual_seed(0)
    blocks = [block(width) for _ in range(depth)]
    sgd = lambda params: torch.optim.SGD(params, lr=1e-3)
    out: dict[str, Variant] = {}

    def rev(**kw):
        return revlib_xla.ReversibleSequential(*copy.deepcopy(blocks), split_dim=-1, **kw)

    m = rev().to(device)
    out["reversible"] = Variant("reversible", m, sgd(m.parameters()), device, 2 * width, batch)
    m = rev(target_device=device)  # parameters stay on the cpu
    out["reversible+offload"] = Variant("reversible+offload", m, sgd(m.parameters()), device, 2 * width, batch)
    m = rev(fused_optimizer=sgd).to(device)
    out["reversible+fused"] = Variant("reversible+fused", m, None, device, 2 * width, batch)
    revlib = import_revlib(revlib_dir) if device.type != "xla" else None
    if revlib is not None:
        m = revlib.ReversibleSequential(*copy.deepcopy(blocks), split_dim=-1).to(device)
        out["revlib-1.7.2"] = Variant("revlib-1.7.2", m, sgd(m.parameters()), device, 2 * width, batch)
        m = revlib.ReversibleSequential(*copy.deepcopy(blocks), split_dim=-1, target_device=str(device))
        out["revlib-1.7.2+offload"] = Variant("revlib-1.7.2+offload", m, sgd(m.parameters()), device, 2 * width, batch)
    seq = nn.Sequential(*[nn.Sequential(copy.deepcopy(b), nn.Tanh()) for b in blocks])
    m = copy.deepcopy(seq).to(device)
    out["sequential"] = Variant("sequential", m, sgd(m.parameters()), device, width, batch)
    m = revlib_xla.OffloadModel(copy.deepcopy(seq), device, num_slices=4, checkpoint_activation=True)
    out["offload_model"] = Variant("offload_model", m, sgd(m.parameters()), device, width, batch)
    if device.type == "cuda":
        try:
            from fairscale.experimental.nn.offload import OffloadModel as FairscaleOffload

            m = FairscaleOffload(copy.deepcopy(seq), device, num_slices=4, checkpoint_activation=True)
            out["fairscale-0.4.13"] = Variant("fairscale-0.4.13", m, sgd(m.parameters()), device, width, batch)
        except ImportError:
            print("fairscale not importable: its row is left out")
    return out


def transfer_time(variant: Variant, repeats: int) -> float:
    """Seconds to copy every layer's tensors to the device once forward and once backward, as the streamer does."""
    model = variant.model
    model(variant.x).sum().backward()  # builds the streamer
    streamer = model.streamer
    times = []
    for _ in range(repeats):
        backends.sync(variant.device)
        start = time.perf_counter()
        for order in (range(len(streamer.units)), reversed(range(len(streamer.units)))):
            order = list(order)
            for j, i in enumerate(order):
                streamer.fetch(i, prefetch=order[j + 1] if j + 1 < len(order) else None)
                streamer.release(i)
        streamer.release_all()
        backends.sync(variant.device)
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "xla", "cuda"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--revlib-dir", default=str(ROOT / ".cache" / "bench" / "revlib-1.7.2"))
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = backends.device_for(args.device)
    cfg = CONFIGS["quick" if args.quick else "full"]
    variants = build(cfg, device, args.revlib_dir)
    for _ in range(cfg["warmup"]):
        for v in variants.values():
            v.step()
    for _ in range(cfg["repeats"]):
        for v in variants.values():
            v.timed()
    med = {name: statistics.median(v.times) for name, v in variants.items()}
    transfers = transfer_time(variants["reversible+offload"], cfg["repeats"])
    hidden = (med["reversible"] + transfers - med["reversible+offload"]) / transfers if transfers > 0 else 0.0
    name = device_name(device)
    result = {
        "device": name,
        "device_kind": device.type,
        "config": cfg,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "median_step_s": med,
        "transfer_s": transfers,
        "transfer_hidden_share": max(0.0, min(1.0, hidden)),
        "transfer_hidden_share_raw": hidden,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    where = {"cpu": "cpu", "xla": "xla-cpu" if "cpu" in name.lower() else f"xla-{slug(name)}"}.get(device.type)
    stem = f"offload-{where or f'{device.type}-{slug(name)}'}" + ("-quick" if args.quick else "")
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Offload and fused optimizer: {name} ({device.type})",
        "",
        f"{result['date']}, torch {torch.__version__}, one thread, {cfg['depth']} blocks of width "
        f"{cfg['width']} (Linear-GELU-Linear), batch {cfg['batch']}, SGD; median of {cfg['repeats']} "
        f"interleaved steps.",
        "",
        "| variant | step (ms) | vs its baseline |",
        "|---|---|---|",
    ]
    base = {
        "reversible+offload": "reversible",
        "reversible+fused": "reversible",
        "revlib-1.7.2+offload": "revlib-1.7.2",
        "offload_model": "sequential",
        "fairscale-0.4.13": "sequential",
    }
    for k, t in med.items():
        ratio = f"{t / med[base[k]]:.2f}x {base[k]}" if k in base and base[k] in med else ""
        lines.append(f"| {k} | {t * 1e3:.1f} | {ratio} |")
    lines += [
        "",
        f"Parameter transfers alone (every layer to the device, forward and backward): "
        f"{transfers * 1e3:.1f} ms; share hidden behind compute: {result['transfer_hidden_share']:.0%} "
        f"(raw {hidden:.2f}).",
    ]
    if device.type != "cuda":
        lines.append(
            "Copies are synchronous on this device (no side stream), so no transfer can be hidden here; "
            "the overlap exists only on cuda."
        )
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    sys.exit(main())
