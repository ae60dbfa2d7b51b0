"""What the demo trains on: its settings (:class:`DemoConfig`) and its corpus, the Python standard library's own
source as bytes, split and sampled into batches. Re-exported by :mod:`revlib_xla.demo`."""

from __future__ import annotations

import dataclasses
import math
import sysconfig
from pathlib import Path

import torch

from ..models import TransformerConfig

UNIFORM_LOSS = math.log(256)
"""Cross-entropy of a uniform guess over 256 byte values, in nats."""


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """What the demo trains and measures; the defaults keep ``make demo`` under 3 minutes on a 2-core CPU."""

    width: int = 64
    depth: int = 2
    heads: int = 4
    seq_len: int = 128
    batch: int = 16
    steps: int = 300
    lr: float = 3e-3
    seed: int = 0
    corpus_bytes: int = 2 << 20
    val_fraction: float = 0.05
    table_depths: tuple[int, ...] = (2, 4, 8, 16)
    table_batch: int = 4

    def model_config(self, depth: int | None = None) -> TransformerConfig:
        return TransformerConfig(
            width=self.width, depth=self.depth if depth is None else depth, heads=self.heads, seq_len=self.seq_len
        )


def load_corpus(max_bytes: int = 2 << 20) -> bytes:
    """The standard library's top-level ``.py`` files, in sorted order, concatenated up to ``max_bytes``.

    Deterministic for a given Python version; every Python installation has it. Files are joined with a blank line.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no .py files in the standard library directory {root}; the demo trains on them")
    chunks: list[bytes] = []
    total = 0
    for path in files:
        if total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data[: max_bytes - total] + b"\n\n")
        total += len(chunks[-1])
    return b"".join(chunks)[:max_bytes]


def split_corpus(data: bytes, val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes as a ``uint8`` tensor, split into training text and the last ``val_fraction`` as validation text."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


def sample_batch(data: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``seq_len`` bytes, as an ``int64`` host tensor ``(batch, seq_len)``."""
    if len(data) < seq_len:
        raise ValueError(f"the text has {len(data)} bytes, fewer than seq_len={seq_len}")
    starts = torch.randint(0, len(data) - seq_len + 1, (batch,), generator=generator)
    return torch.stack([data[s : s + seq_len] for s in starts.tolist()]).long()
