"""Checkpoints of a training run: atomic, complete, resumable bit for bit.

A checkpoint is a directory ``<out_dir>/checkpoints/step_<N>/`` holding

* ``model.safetensors``: the weights (each tied tensor stored once; the names it is also known by are in the file's
  metadata), readable by any safetensors loader; where the optimizer keeps more precise master weights than the
  device (``strategy.param_dtype=bf16``: float32 masters on the host), the masters, so a resumed run continues
  from them exactly;
* ``optimizer.pt``: the optimizer's ``state_dict`` (on the host);
* ``state.pt``: the step, the data sampler's position, the random states (torch's CPU generator, the device's,
  numpy's, Python's) and the last metrics;
* ``config.yaml``: the resolved run configuration.

Saving is atomic: everything is written into a temporary directory, each file and the directory are flushed to
disk (fsync), and the directory is renamed into place; only then is the ``latest`` pointer (a text file naming the
directory) replaced, itself through a flushed temporary file and an atomic rename. A crash at any point leaves the
previous ``latest`` intact and pointing at a complete checkpoint. The oldest checkpoints beyond ``keep`` are
deleted after the pointer moved.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .. import _tree, backend

__all__ = ["Checkpoint", "save_checkpoint", "load_checkpoint", "latest_checkpoint", "rng_state", "set_rng_state"]

LATEST = "latest"
_PREFIX = "step_"


@dataclasses.dataclass
class Checkpoint:
    """What a checkpoint restores besides the weights and optimizer state: the step it was taken after, the
    sampler's position, the random states and the last metrics."""

    step: int
    sampler: dict[str, int]
    rng: dict[str, Any]
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every random state a step can draw from: torch's CPU generator, ``device``'s own, numpy's, Python's."""
    return {
        "torch": torch.get_rng_state(),
        "device": _tree.map_tensors(lambda t: t.cpu(), backend.backend_for(device).get_rng_state(device)),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Put back what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    if state.get("device") is not None:
        backend.backend_for(device).set_rng_state(device, state["device"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _masters(optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """``id(parameter)`` -> the optimizer's master weight of it, where it keeps a more precise one
    (:meth:`revlib_xla.train.HostOptimizerState.master_weights`)."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = getattr(optimizer, "master_weights", list)()
    return {id(p): master for p, master in pairs}


def _weights(
    model: nn.Module, masters: dict[int, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's parameters and buffers on the host (a parameter's master weight instead, where ``masters`` has
    one), each tensor once, and the other names of tied ones."""
    masters = masters or {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
            continue
        first[id(tensor)] = name
        unique[name] = masters.get(id(tensor), tensor).detach().to("cpu").contiguous()
    return unique, aliases


def _write(path: Path, write: Any) -> None:
    write(str(path))
    _fsync(path)


def save_checkpoint(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: Checkpoint,
    config_yaml: str,
    keep: int = 3,
) -> Path:
    """Write a checkpoint of ``model`` (the LM whose weights are saved), ``optimizer`` and ``state`` under
    ``directory`` atomically (see the module docstring), point ``latest`` at it and delete all but the newest
    ``keep``. Returns the checkpoint's directory."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    name = f"{_PREFIX}{state.step:08d}"
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        weights, aliases = _weights(model, _masters(optimizer))
        metadata = {"format": "pt", "tied": json.dumps(aliases)}
        _write(tmp / "model.safetensors", lambda p: save_file(weights, p, metadata=metadata))
        host_optimizer = _tree.map_tensors(lambda t: t.detach().to("cpu"), optimizer.state_dict())
        _write(tmp / "optimizer.pt", lambda p: torch.save(host_optimizer, p))
        _write(tmp / "state.pt", lambda p: torch.save(dataclasses.asdict(state), p))
        _write(tmp / "config.yaml", lambda p: Path(p).write_text(config_yaml))
        _fsync(tmp)
        if final.exists():  # a checkpoint of the same step from an earlier, interrupted attempt
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(root)
        _point_latest(root, name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(root, keep)
    return final


def _point_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync(root)


def _prune(root: Path, keep: int) -> None:
    latest = latest_checkpoint(root)
    steps = sorted(p for p in root.glob(f"{_PREFIX}*") if p.is_dir())
    for old in steps[: max(0, len(steps) - keep)]:
        if old != latest:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``latest`` points at under ``directory``, or ``None`` when there is none."""
    root = Path(directory)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "state.pt").is_file() else None


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer) -> Checkpoint:
    """Restore ``model``'s weights and ``optimizer``'s state from the checkpoint directory ``path`` (weights are
    copied into the existing tensors, on their devices, so every reference to them stays valid); return the rest.
    A checkpoint of a differently shaped model raises ``ValueError`` naming the tensor."""
    ckpt = Path(path)
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    weights, _ = _weights(model)
    missing = sorted(set(weights) - set(stored))
    unexpected = sorted(set(stored) - set(weights))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {ckpt}: the weights do not match the model (missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}); was it written by a run with another model or strategy?"
        )
    tensors = dict(list(model.named_parameters()) + list(model.named_buffers()))
    exact = {id(tensors[name]): value for name, value in stored.items() if value.dtype != tensors[name].dtype}
    with torch.no_grad():
        for name, value in stored.items():
            target = tensors[name]
            if target.shape != value.shape:
                raise ValueError(
                    f"checkpoint {ckpt}: {name} has shape {tuple(value.shape)}, the model's is {tuple(target.shape)}"
                )
            target.copy_(value.to(target.dtype))
    optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=False))
    load_masters = getattr(optimizer, "load_master_weights", None)
    if load_masters is not None and exact:  # saved masters more precise than the device weights: restored exactly
        load_masters(exact)
    state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=False)
    return Checkpoint(**state)
