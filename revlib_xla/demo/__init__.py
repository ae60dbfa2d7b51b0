"""``make demo`` / ``python -m revlib_xla.demo``: train a reversible byte-level language model, then show its memory.

1. Reads the Python standard library's own source as bytes (the same corpus on every machine with Python), and
   trains a small reversible transformer language model (:mod:`revlib_xla.models`) on it for a fixed number of
   steps on the default device (a TPU if torch_xla finds one, else a GPU, else the CPU), with a progress bar.
   The loss starts near ``ln 256 = 5.55`` nats (a uniform guess over bytes) and has to fall clearly.
2. Measures one training step (forward and backward) of the same model at several depths, in the three flavours
   of :func:`revlib_xla.models.build_lm` (no savings, checkpointing, reversible): the eager peak counted by PyTorch's
   ``MemTracker`` (:func:`revlib_xla.memory.eager_peak`) and the HBM peak that the TPU v5e compiler plans for the
   compiled step (:func:`revlib_xla.memory.tpu_memory`, a deviceless compile: no TPU is needed or used). Prints the
   table and saves it as a plot.

Run ``python -m revlib_xla.demo --help`` for the options.

Here: the training and the entry point; the settings and the corpus in ``data.py``, the memory table in
``memory_table.py`` (every public name importable from here).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import sysconfig
import time
from collections.abc import Sequence

import torch

from .. import backends
from ..models import ByteTransformerLM, build_lm, lm_loss
from .data import UNIFORM_LOSS, DemoConfig, load_corpus, sample_batch, split_corpus
from .memory_table import (
    MemoryRow,
    TpuColumn,
    _rows,
    eager_memory,
    format_memory_table,
    memory_table,
    plot_memory_table,
)

__all__ = [
    "DemoConfig",
    "TrainResult",
    "MemoryRow",
    "load_corpus",
    "split_corpus",
    "sample_batch",
    "train",
    "evaluate",
    "generate",
    "eager_memory",
    "TpuColumn",
    "memory_table",
    "format_memory_table",
    "plot_memory_table",
    "main",
]

# ----------------------------------------------------------------------------------------------------------------
# Training


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` did: per-step training losses, validation loss before and after, time and device."""

    losses: list[float]
    val_before: float
    val_after: float
    seconds: float
    device: str

    def start_loss(self, window: int = 10) -> float:
        return sum(self.losses[:window]) / len(self.losses[:window])

    def end_loss(self, window: int = 10) -> float:
        return sum(self.losses[-window:]) / len(self.losses[-window:])

    @property
    def fell(self) -> bool:
        """The loss fell clearly: validation loss at least 1 nat below where it started."""
        return self.val_after < self.val_before - 1.0


@torch.no_grad()
def evaluate(model: ByteTransformerLM, data: torch.Tensor, batch: int, batches: int = 4, seed: int = 1234) -> float:
    """Mean loss over ``batches`` fixed random windows of ``data`` (the same windows every call), in eval mode."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    total = []
    for _ in range(batches):
        tokens = sample_batch(data, batch, model.config.seq_len, generator).to(device)
        total.append(lm_loss(model(tokens), tokens))
    model.train(was_training)
    return float(torch.stack(total).mean().cpu())


def train(
    config: DemoConfig,
    train_data: torch.Tensor,
    val_data: torch.Tensor,
    device: torch.device,
    flavour: str = "reversible",
    progress: bool = True,
) -> tuple[ByteTransformerLM, TrainResult]:
    """Train the ``flavour`` LM of ``config`` for ``config.steps`` AdamW steps on ``device``.

    Shapes are static (fixed batch and sequence length, constant learning rate), so on XLA the step compiles once
    (twice: the optimizer state appears in step 1) and every later step reuses it; each step ends with
    ``backends.sync``.
    """
    torch.manual_seed(config.seed)
    model = build_lm(config.model_config(), flavour).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01, betas=(0.9, 0.99))
    generator = torch.Generator().manual_seed(config.seed)
    val_before = evaluate(model, val_data, config.batch)
    bar = _progress(config.steps, progress)
    loss_tensors: list[torch.Tensor] = []
    start = time.perf_counter()
    for step in range(config.steps):
        tokens = sample_batch(train_data, config.batch, config.seq_len, generator).to(device)
        loss = lm_loss(model(tokens), tokens)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        backends.sync(device)
        loss_tensors.append(loss.detach())
        if bar is not None:
            bar.update(1)
            if step % 10 == 0 or step == config.steps - 1:
                bar.set_postfix(loss=f"{float(loss_tensors[-1].cpu()):.3f}")
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    losses = [float(v) for v in torch.stack(loss_tensors).cpu()] if loss_tensors else []
    return model, TrainResult(losses, val_before, evaluate(model, val_data, config.batch), seconds, str(device))


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    interactive = sys.stderr.isatty()
    return tqdm(total=total, desc="training", unit="step", dynamic_ncols=True, mininterval=0.2 if interactive else 5)


@torch.no_grad()
def generate(
    model: ByteTransformerLM, prompt: bytes, length: int = 120, temperature: float = 0.8, seed: int = 0
) -> bytes:
    """Sample ``length`` bytes after ``prompt``. The window is always ``seq_len`` bytes (the prompt is left-padded
    with spaces), so every call has the same shape and an XLA device compiles it once."""
    device = next(model.parameters()).device
    seq_len = model.config.seq_len
    window = list((b" " * seq_len + prompt)[-seq_len:])
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    out = bytearray()
    for _ in range(length):
        logits = model(torch.tensor([window], dtype=torch.long, device=device))[0, -1].float().cpu()
        probs = torch.softmax(logits / temperature, dim=-1)
        byte = int(torch.multinomial(probs, 1, generator=generator))
        out.append(byte)
        window = window[1:] + [byte]
    model.train(was_training)
    return bytes(out)


# ----------------------------------------------------------------------------------------------------------------
# Entry point


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = DemoConfig()
    parser = argparse.ArgumentParser(
        prog="python -m revlib_xla.demo",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps")
    parser.add_argument("--depth", type=int, default=defaults.depth, help="transformer layers of the trained model")
    parser.add_argument("--width", type=int, default=defaults.width, help="features per residual stream")
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len, help="bytes per training window")
    parser.add_argument("--batch", type=int, default=defaults.batch, help="windows per step")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--device",
        default=None,
        help="cpu, cuda, xla or a torch device string (default: TPU if torch_xla finds one, else GPU, else CPU)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for PyTorch (default on CPU: one per two cores, at most 4; the model is "
        "small and more threads mostly add synchronisation)",
    )
    parser.add_argument(
        "--table-depths",
        default=",".join(map(str, defaults.table_depths)),
        help="comma-separated depths of the memory table",
    )
    parser.add_argument("--no-memory-table", action="store_true", help="train only; skip the memory table and plot")
    parser.add_argument(
        "--no-train",
        action="store_true",
        help="the memory table and plot only (make demo trains with revlib-xla train first)",
    )
    parser.add_argument("--no-tpu", action="store_true", help="skip the deviceless TPU compile column")
    parser.add_argument("--out", default="revlib_xla_demo.png", help="where to save the memory plot (PNG)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def _resolve_device(name: str | None) -> torch.device:
    if name is None:
        return backends.default_device()
    return backends.device_for(name)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the process exit status (1 if the loss did not fall)."""
    args = _parse(argv)
    start = time.perf_counter()
    config = DemoConfig(
        width=args.width,
        depth=args.depth,
        seq_len=args.seq_len,
        batch=args.batch,
        steps=args.steps,
        lr=args.lr,
        seed=args.seed,
        table_depths=tuple(int(d) for d in args.table_depths.split(",") if d.strip()),
    )
    device = _resolve_device(args.device)
    if backends.is_host_memory(device) or args.threads is not None:
        torch.set_num_threads(args.threads or max(1, min(4, (os.cpu_count() or 2) // 2)))

    # The TPU column is traced first and compiled in a child process while the model trains. Tracing first also
    # initialises the XLA runtime before any backward pass: PyTorch's autograd engine sizes its device queues at
    # the first backward, and an XLA device initialised later fails its backward with an internal assert.
    column = None
    if not args.no_memory_table and not args.no_tpu:
        column = TpuColumn.start(config, config.table_depths)

    if not args.no_train and _train_and_report(config, device, quiet=args.quiet) != 0:
        return 1
    if not args.no_memory_table:
        _memory_report(config, column, args.out)
    print(f"demo finished in {time.perf_counter() - start:.0f} s")
    return 0


def _train_and_report(config: DemoConfig, device: torch.device, quiet: bool) -> int:
    """Train the demo model on the standard library's source and report; 1 if the validation loss did not fall."""
    corpus = load_corpus(config.corpus_bytes)
    train_data, val_data = split_corpus(corpus, config.val_fraction)
    model_config = config.model_config()
    params = sum(p.numel() for p in build_lm(model_config).parameters())
    print(
        f"revlib_xla demo: reversible byte-level transformer LM, width {config.width} x 2 streams, depth "
        f"{config.depth} ({2 * config.depth} reversible layers), {params / 1e6:.2f} M parameters"
    )
    print(
        f"corpus: {len(corpus) / 2**20:.2f} MiB of Python standard library source "
        f"({sysconfig.get_paths()['stdlib']}), {len(train_data):,} training / {len(val_data):,} validation bytes"
    )
    print(
        f"device: {device}; {config.steps} steps of batch {config.batch} x {config.seq_len} bytes, AdamW "
        f"lr {config.lr:g}"
    )

    model, result = train(config, train_data, val_data, device, progress=not quiet)
    print(
        f"training loss: {result.start_loss():.3f} (first 10 steps) -> {result.end_loss():.3f} (last 10 steps) "
        f"nats/byte; uniform guess = ln 256 = {UNIFORM_LOSS:.3f}"
    )
    print(
        f"validation loss: {result.val_before:.3f} -> {result.val_after:.3f} nats/byte "
        f"({result.val_after / math.log(2):.2f} bits/byte); {result.seconds:.1f} s, "
        f"{1000 * result.seconds / max(1, config.steps):.0f} ms/step"
    )
    prompt = bytes(val_data[: config.seq_len].tolist())
    sample = generate(model, prompt, length=120, seed=config.seed).decode("utf-8", "replace")
    print("sample after the validation prompt:\n    " + "\n    ".join(sample.splitlines() or [""]))
    del model
    if not result.fell:
        print(
            f"FAILED: the validation loss did not fall by 1 nat ({result.val_before:.3f} -> {result.val_after:.3f})",
            file=sys.stderr,
        )
        return 1
    print(f"ok: the loss fell by {result.val_before - result.val_after:.2f} nats/byte")
    return 0


def _memory_report(config: DemoConfig, column: TpuColumn | None, out: str | os.PathLike[str]) -> None:
    """The memory table of one training step at several depths (eager, and the TPU column when started), and its
    plot saved to ``out``."""
    print(
        f"\nmemory of one training step (forward + backward, batch {config.table_batch} x {config.seq_len} "
        f"bytes, fp32) of the same model at depths {', '.join(map(str, config.table_depths))}:"
    )
    eager = eager_memory(config, config.table_depths)
    if column is not None and not column.done():
        print("waiting for the TPU compiler...", flush=True)
    rows, reason = _rows(eager, column)
    print(format_memory_table(rows))
    print(
        "eager: peak of an eager step counted by PyTorch's MemTracker (tensor storages, measured on the CPU; "
        "the same on CUDA up to allocator rounding)."
    )
    if column is None:
        print("TPU column skipped (--no-tpu).")
    elif reason is None:
        print(
            "TPU v5e: HBM peak that the TPU compiler (libtpu, deviceless compile for one v5e chip) plans for the "
            "step traced by torch_xla; these figures come from the TPU compiler, not from a TPU run."
        )
    else:
        print(f"TPU column not available: {reason}")
    path = plot_memory_table(rows, out, config)
    print(f"plot saved to {path.resolve()}")
