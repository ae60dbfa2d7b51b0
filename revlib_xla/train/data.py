"""Training data for ``revlib-xla train``: token streams and a deterministic, resumable batch sampler.

Three sources, all ending as one flat stream of token ids split into training and validation parts:

* ``bytes``: the bytes of local text files (``data.path``: a file or a directory, read recursively), or by default
  the Python standard library's source (:func:`revlib_xla.demo.load_corpus`, the same text on every machine);
  token id = byte value, so the model's vocabulary must have at least 256 entries.
* ``tokens``: a pre-tokenized file of ``uint16`` or ``uint32`` ids (``data.token_dtype``), memory-mapped, so a
  file larger than RAM costs nothing to open.
* ``hf``: a Hugging Face ``datasets`` dataset (optional dependency; never downloaded by the tests): its
  ``input_ids``/``tokens`` column when it has one, else the UTF-8 bytes of its ``text`` column.

:class:`BatchSampler` cuts the training stream into non-overlapping windows of ``seq_len`` tokens and visits them in
a fresh random order every epoch. Its position (epoch, index in the epoch, seed) is all its state: a checkpoint
stores it and a resumed run draws exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import backends
from .config import ConfigError, RunConfig

__all__ = ["TokenData", "BatchSampler", "SamplerState", "load_data", "eval_batches"]

_CHECK_AT_LOAD = 1 << 24  # token ids checked against the vocabulary when the file is opened (the rest per batch)


@dataclasses.dataclass
class TokenData:
    """A stream of token ids split into training and validation parts (numpy arrays or memory maps), and where
    they came from (for messages)."""

    train: np.ndarray
    val: np.ndarray
    source: str
    vocab_size: int

    def check(self, tokens: np.ndarray, what: str) -> None:
        """Raise :class:`ConfigError` if ``tokens`` holds an id the model's vocabulary does not have."""
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            raise ConfigError(
                f"data: {what} of {self.source} holds token id {int(tokens.max())}, but the model has "
                f"vocab_size={self.vocab_size}; set model.overrides.vocab_size above it, or check data.path and "
                f"data.token_dtype"
            )


def _read_bytes(path: str) -> bytes:
    root = Path(path).expanduser()
    if root.is_file():
        return root.read_bytes()
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file())
        if not files:
            raise ConfigError(f"data.path={path!r}: the directory has no files")
        return b"\n\n".join(p.read_bytes() for p in files)
    raise ConfigError(f"data.path={path!r}: no such file or directory (give a text file or a directory of them)")


def _hf_tokens(name: str, vocab_size: int) -> np.ndarray:
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        raise ConfigError(
            f"data.kind=hf (data.hf_dataset={name!r}) needs the 'datasets' package: pip install datasets"
        ) from None
    ds = datasets.load_dataset(name, split="train")
    column = next((c for c in ("input_ids", "tokens") if c in ds.column_names), None)
    if column is not None:
        return np.concatenate([np.asarray(row, dtype=np.int64) for row in ds[column]])
    if "text" not in ds.column_names:
        raise ConfigError(f"data.hf_dataset={name!r} has columns {ds.column_names}; expected input_ids, tokens or text")
    return np.frombuffer("\n\n".join(ds["text"]).encode(), dtype=np.uint8)


def load_data(cfg: RunConfig, vocab_size: int) -> TokenData:
    """The token stream ``cfg.data`` describes, split into training text and the last ``val_fraction`` as
    validation text. Raises :class:`ConfigError` naming ``data.*`` for a missing path, a file of the wrong size
    for its dtype, a stream too short for one window, or ids beyond ``vocab_size``."""
    d = cfg.data
    if d.kind == "bytes":
        if vocab_size < 256:
            raise ConfigError(
                f"data.kind=bytes needs a vocabulary of at least 256 byte values, the model has "
                f"vocab_size={vocab_size}; set model.overrides.vocab_size=256"
            )
        if d.path is None:
            from ..demo import load_corpus

            tokens: np.ndarray = np.frombuffer(load_corpus(), dtype=np.uint8)
            source = "the Python standard library's source"
        else:
            tokens = np.frombuffer(_read_bytes(d.path), dtype=np.uint8)
            source = repr(d.path)
    elif d.kind == "tokens":
        assert d.path is not None  # RunConfig requires it
        file = Path(d.path).expanduser()
        if not file.is_file():
            raise ConfigError(f"data.path={d.path!r}: no such file (data.kind=tokens reads a file of token ids)")
        dtype = np.dtype(d.token_dtype)
        if file.stat().st_size % dtype.itemsize:
            raise ConfigError(
                f"data.path={d.path!r}: {file.stat().st_size} bytes is not a whole number of {d.token_dtype} ids; "
                f"check data.token_dtype"
            )
        tokens = np.memmap(file, dtype=dtype, mode="r")
        source = repr(d.path)
        if d.token_dtype == "uint16":
            _refuse_wide_ids(np.asarray(tokens[:_CHECK_AT_LOAD]), d.path)
    else:
        assert d.hf_dataset is not None
        tokens = _hf_tokens(d.hf_dataset, vocab_size)
        source = f"the dataset {d.hf_dataset!r}"
    cut = int(len(tokens) * (1 - d.val_fraction))
    data = TokenData(tokens[:cut], tokens[cut:], source, vocab_size)
    for part, name in ((data.train, "the training part"), (data.val, "the validation part")):
        if len(part) < d.seq_len:
            raise ConfigError(
                f"data: {name} of {source} has {len(part)} tokens, fewer than data.seq_len={d.seq_len}; "
                f"give more data or a smaller data.seq_len"
            )
    data.check(np.asarray(tokens[:_CHECK_AT_LOAD]), "the start")
    return data


def _refuse_wide_ids(head: np.ndarray, path: str) -> None:
    """Refuse a file of 32-bit ids read as ``uint16``: each id becomes two, its low half and its high half, which
    is 0 (or a small number, for vocabularies above 65536) at every second position. Real 16-bit token streams do
    not have that pattern over thousands of ids."""
    pairs = len(head) // 2
    if pairs < 32:
        return
    low, high = head[: 2 * pairs : 2], head[1 : 2 * pairs : 2]
    if int(high.max()) <= 3 < int(low.max()):
        share = float((high == 0).mean())
        raise ConfigError(
            f"data.path={path!r} read as data.token_dtype=uint16 gives ids whose every second one is {int(high.max())} "
            f"or less ({share:.0%} of them 0), the high halves of 32-bit ids: it looks like a file of uint32 ids. "
            f"Set data.token_dtype=uint32"
        )


@dataclasses.dataclass
class SamplerState:
    """Where a :class:`BatchSampler` is: the epoch, the next window's index in that epoch's order, and the seed the
    orders are drawn from."""

    epoch: int = 0
    index: int = 0
    seed: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> SamplerState:
        return cls(int(state["epoch"]), int(state["index"]), int(state["seed"]))


class BatchSampler:
    """Batches of ``batch_size`` windows of ``seq_len`` tokens from ``tokens``, every window once per epoch in a
    random order drawn from ``(seed, epoch)`` alone. Deterministic and resumable: :attr:`state` is the position."""

    def __init__(self, data: TokenData, seq_len: int, batch_size: int, seed: int = 0) -> None:
        self.data, self.seq_len, self.batch_size = data, seq_len, batch_size
        self.windows = len(data.train) // seq_len
        self.state = SamplerState(seed=seed)
        self._order: tuple[int, np.ndarray] | None = None

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(backends.derive_seed(self.state.seed, epoch))
            self._order = (epoch, torch.randperm(self.windows, generator=generator).numpy())
        return self._order[1]

    def next_batch(self) -> torch.Tensor:
        """The next ``(batch_size, seq_len)`` int64 batch (on the host), advancing the position."""
        starts = []
        for _ in range(self.batch_size):
            if self.state.index >= self.windows:
                self.state.epoch, self.state.index = self.state.epoch + 1, 0
            starts.append(int(self._epoch_order(self.state.epoch)[self.state.index]) * self.seq_len)
            self.state.index += 1
        rows = np.stack([np.asarray(self.data.train[s : s + self.seq_len]) for s in starts])
        self.data.check(rows, "a training batch")
        return torch.from_numpy(rows.astype(np.int64))


def eval_batches(data: TokenData, seq_len: int, batch_size: int, batches: int) -> list[torch.Tensor]:
    """The fixed validation batches: the first ``batches * batch_size`` windows of the validation text, in order
    (fewer whole batches when it is short), so every evaluation of a run measures the same text."""
    windows = min(len(data.val) // seq_len, batches * batch_size)
    windows = windows // batch_size * batch_size or windows  # whole batches (one shape to compile) where possible
    rows = [np.asarray(data.val[i * seq_len : (i + 1) * seq_len]) for i in range(windows)]
    out = []
    for i in range(0, len(rows), batch_size):
        batch = np.stack(rows[i : i + batch_size])
        data.check(batch, "the validation part")
        out.append(torch.from_numpy(batch.astype(np.int64)))
    return out
