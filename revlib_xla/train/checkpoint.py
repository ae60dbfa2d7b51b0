"""Checkpoints of a training run: atomic, complete, resumable bit for bit.

A checkpoint is a directory ``<out_dir>/checkpoints/step_<N>/`` holding

* ``model.safetensors``: the weights (each tied tensor stored once; the names it is also known by are in the file's
  metadata), readable by any safetensors loader; where the optimizer keeps more precise master weights than the
  device (``strategy.param_dtype=bf16``: float32 masters on the host), the masters, so a resumed run continues
  from them exactly. Stacked layers (``model.scan``) are saved under the unstacked model's names, layer by layer,
  and their optimizer state split the same way, so a scanned run resumes unscanned and back;
* ``optimizer.pt``: the optimizer's ``state_dict`` (on the host), keyed by the weights' names where the optimizer
  keeps ``torch.optim``'s per-parameter state;
* ``state.pt``: the step, the data sampler's position, the random states (torch's CPU generator, the device's,
  numpy's, Python's) and the last metrics;
* ``config.yaml``: the resolved run configuration;
* ``manifest.json``: the byte size and SHA-256 of each file above, written last: a checkpoint is whole when every
  file it lists has its recorded size, and, where a run resumes from it, its recorded digest (a byte changed in
  place, the size kept, is found: :func:`checkpoint_problem` with ``verify=True``).

Saving is atomic: everything is written into a temporary directory, each file and the directory are flushed to
disk (fsync), and the directory is renamed into place; only then is the ``latest`` pointer (a text file naming the
directory) replaced, itself through a flushed temporary file and an atomic rename. A crash at any point leaves the
previous ``latest`` intact and pointing at a complete checkpoint. The oldest checkpoints beyond ``keep`` are
deleted after the pointer moved.

Resuming (:func:`find_resumable`) takes the checkpoint ``latest`` names when it is whole, else the newest whole one,
and names every checkpoint it passed over and why (a missing directory or file, a truncated or empty file, a file
its loader cannot read: :class:`CheckpointError`). A checkpoint that is whole but belongs to another model or
optimizer raises :class:`CheckpointMismatch` instead: an older checkpoint of the same run would not fit either.
Weights that are not finite (NaN or inf) are never saved, so rotation never replaces a finite checkpoint by one
that is not.
"""

from __future__ import annotations

import dataclasses
import hashlib
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

from .. import _tree, backends

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointMismatch",
    "NonFiniteWeights",
    "checkpoint_problem",
    "checkpoint_steps",
    "find_resumable",
    "weight_slices",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "rng_state",
    "set_rng_state",
]

LATEST = "latest"
MANIFEST = "manifest.json"
_PREFIX = "step_"
_FILES = ("model.safetensors", "optimizer.pt", "state.pt", "config.yaml")


class CheckpointError(OSError):
    """A checkpoint could not be written, or is not whole or not readable; the message names its directory and the
    file."""


class CheckpointMismatch(ValueError):
    """A whole checkpoint that does not fit the model or optimizer it is loaded into (another model, or another
    strategy's optimizer state); the message names the checkpoint and what differs, ``path`` is its directory."""

    def __init__(self, message: str, path: Path | None = None, what: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.what = what or message
        """What differs, in a few words (``its weights do not match the model's``), for a message that names the
        run's settings instead."""


class NonFiniteWeights(ValueError):
    """Weights holding NaN or inf, refused by :func:`save_checkpoint`; the message names the tensor."""


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
        "device": _tree.map_tensors(lambda t: t.cpu(), backends.backend_for(device).get_rng_state(device)),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Put back what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    if state.get("device") is not None:
        backends.backend_for(device).set_rng_state(device, state["device"])
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


def weight_slices(model: nn.Module) -> list[tuple[str, torch.Tensor, int | None]]:
    """Every parameter of ``model`` under the names of ``state_dict()`` (the unstacked model's), as
    ``(name, parameter, index)``: ``index`` is the layer's position in a stacked parameter
    (:func:`revlib_xla.scan.stack_layers`: ``state_dict()`` gives each layer a view of the stack), else ``None``."""
    params = {id(p): p for _, p in model.named_parameters(remove_duplicate=False)}
    slices: list[tuple[str, torch.Tensor, int | None]] = []
    layers: dict[int, list[int]] = {}  # a stack's views: their positions in ``slices``
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in params:
            slices.append((name, value, None))
        elif value._is_view() and id(value._base) in params:
            layers.setdefault(id(value._base), []).append(len(slices))
            slices.append((name, params[id(value._base)], None))
    # The views come layer by layer, each layer's (tied) names together; storage offsets would say which layer a
    # view is on cpu, not on every device (XLA tensors have none).
    for positions in layers.values():
        name, stack, _ = slices[positions[0]]
        names_per_layer = len(positions) // stack.shape[0]
        for n, at in enumerate(positions):
            slices[at] = (slices[at][0], stack, n // names_per_layer)
    return slices


def _weights(
    model: nn.Module, masters: dict[int, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's parameters (under their unstacked names: :func:`weight_slices`) and buffers on the host (a
    parameter's master weight instead, where ``masters`` has one), each tensor once, and the other names of tied
    ones."""
    masters = masters or {}
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple[int, int | None], str] = {}
    named = weight_slices(model) + [(n, b, None) for n, b in model.named_buffers(remove_duplicate=False)]
    for name, tensor, index in named:
        if (id(tensor), index) in first:
            aliases[name] = first[(id(tensor), index)]
            continue
        first[(id(tensor), index)] = name
        value = masters.get(id(tensor), tensor).detach()
        unique[name] = (value if index is None else value[index]).to("cpu").contiguous()
    return unique, aliases


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The model parameters behind the indices of ``optimizer.state_dict()``, in order (a host-stepping optimizer's
    groups hold its host masters: the device parameters they stand for)."""
    host, device = getattr(optimizer, "host", None), getattr(optimizer, "device_params", None)
    stands_for = {id(h): p for h, p in zip(host, device)} if host is not None and device is not None else {}
    return [stands_for.get(id(p), p) for group in optimizer.param_groups for p in group["params"]]


def _names_of(model: nn.Module) -> dict[int, list[tuple[str, int | None]]]:
    """``id(parameter)`` -> its ``(name, layer index)`` entries of :func:`weight_slices`."""
    names: dict[int, list[tuple[str, int | None]]] = {}
    for name, tensor, index in weight_slices(model):
        names.setdefault(id(tensor), []).append((name, index))
    return names


def _optimizer_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """``optimizer.state_dict()`` keyed by the weights' unstacked names (a stacked parameter's state split per
    layer), so that a scanned run resumes unscanned and back; ``None`` for an optimizer whose state is not
    ``torch.optim``'s per-parameter form (then saved as it is)."""
    saved = optimizer.state_dict()
    params = _optimizer_params(optimizer)
    names = _names_of(model)
    if set(saved) != {"state", "param_groups"} or any(id(p) not in names for p in params):
        return None
    state: dict[str, dict[str, Any]] = {}
    for i, p in enumerate(params):
        for name, index in names[id(p)]:
            if i in saved["state"]:
                state[name] = {
                    k: v[index] if index is not None and isinstance(v, torch.Tensor) and v.shape == p.shape else v
                    for k, v in saved["state"][i].items()
                }
    groups = [
        {**g, "params": [name for i in g["params"] for name, _ in names[id(params[i])]]} for g in saved["param_groups"]
    ]
    return {"by_name": True, "state": state, "param_groups": groups}


def _optimizer_from_names(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`_optimizer_by_name` for this model and optimizer: a ``state_dict`` to load."""
    params = _optimizer_params(optimizer)
    names = _names_of(model)
    group_of = {name: g for g in saved["param_groups"] for name in g["params"]}
    state: dict[int, dict[str, Any]] = {}
    for i, p in enumerate(params):
        parts = [saved["state"][name] for name, _ in names[id(p)] if name in saved["state"]]
        if not parts:
            continue
        stacked = names[id(p)][0][1] is not None
        state[i] = {
            k: torch.stack([part[k] for part in parts]) if stacked and isinstance(v, torch.Tensor) and v.ndim else v
            for k, v in parts[0].items()
        }
    groups, i = [], 0
    for g in optimizer.param_groups:
        first = names[id(params[i])][0][0]
        groups.append(
            {
                **{k: v for k, v in group_of[first].items() if k != "params"},
                "params": list(range(i, i + len(g["params"]))),
            }
        )
        i += len(g["params"])
    return {"state": state, "param_groups": groups}


def _write(path: Path, write: Any) -> None:
    write(str(path))
    _fsync(path)


def _check_finite(weights: dict[str, torch.Tensor]) -> None:
    """Raise :class:`NonFiniteWeights` naming the first tensor of ``weights`` that holds NaN or inf."""
    for name, tensor in weights.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = tensor[~torch.isfinite(tensor)]
            raise NonFiniteWeights(
                f"the weight {name} holds {bad.numel()} non-finite value(s) ({_nonfinite_kinds(bad)}) of "
                f"{tensor.numel()}; a checkpoint of them would replace a finite one"
            )


def _nonfinite_kinds(values: torch.Tensor) -> str:
    """``values`` (non-finite) as ``'nan'``, ``'inf'``, ``'-inf'`` or a combination, for messages."""
    kinds = [
        name
        for name, present in (
            ("nan", bool(values.isnan().any())),
            ("inf", bool((values == float("inf")).any())),
            ("-inf", bool((values == float("-inf")).any())),
        )
        if present
    ]
    return ", ".join(kinds)


def _free_bytes(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**30:.2f} GiB free there"
    except OSError:
        return "free space unknown"


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
    ``keep``. Returns the checkpoint's directory. Weights holding NaN or inf raise :class:`NonFiniteWeights` and
    nothing is written; a failed write (a full disk) raises :class:`CheckpointError` naming the checkpoint, and
    ``latest`` still names the previous one."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    name = f"{_PREFIX}{state.step:08d}"
    final = root / name
    weights, aliases = _weights(model, _masters(optimizer))
    try:
        _check_finite(weights)
    except NonFiniteWeights as exc:
        raise NonFiniteWeights(f"checkpoint {final} not written: {exc}") from None
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        metadata = {"format": "pt", "tied": json.dumps(aliases)}
        _write(tmp / "model.safetensors", lambda p: save_file(weights, p, metadata=metadata))
        by_name = _optimizer_by_name(model, optimizer)
        host_optimizer = _tree.map_tensors(
            lambda t: t.detach().to("cpu").clone(), optimizer.state_dict() if by_name is None else by_name
        )
        _write(tmp / "optimizer.pt", lambda p: torch.save(host_optimizer, p))
        _write(tmp / "state.pt", lambda p: torch.save(dataclasses.asdict(state), p))
        _write(tmp / "config.yaml", lambda p: Path(p).write_text(config_yaml))
        shutil.copymode(tmp / "config.yaml", tmp / "model.safetensors")  # safetensors writes 0600, not the umask's
        sizes = {file: (tmp / file).stat().st_size for file in _FILES}
        digests = {file: _sha256(tmp / file) for file in _FILES}
        manifest = json.dumps({"bytes": sizes, "sha256": digests}, indent=1) + "\n"
        _write(tmp / MANIFEST, lambda p: Path(p).write_text(manifest))
        _fsync(tmp)
        if final.exists():  # a checkpoint of the same step from an earlier, interrupted attempt
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(root)
        _point_latest(root, name)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (OSError, RuntimeError)) and not isinstance(exc, CheckpointError):
            # torch.save on a full disk raises RuntimeError ("... unexpected pos ..."): say what and where
            previous = latest_checkpoint(root)
            raise CheckpointError(
                f"writing checkpoint {final} failed ({_free_bytes(root)}): {type(exc).__name__}: {exc}; "
                + (f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists")
            ) from exc
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_problem(path: str | os.PathLike[str], verify: bool = False) -> str | None:
    """Why the checkpoint directory ``path`` is not whole (a missing directory or file, a file shorter or longer
    than its manifest records, an empty file; with ``verify``, a file whose SHA-256 is not the one recorded when it
    was written: changed in place), or ``None`` when it is. A checkpoint written before manifests existed is whole
    when its files are present and not empty; one written before digests were recorded is checked by size."""
    ckpt = Path(path)
    if not ckpt.is_dir():
        return "the directory does not exist"
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text()) if (ckpt / MANIFEST).is_file() else None
        recorded = None if manifest is None else manifest["bytes"]
        digests = None if manifest is None else manifest.get("sha256")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST} cannot be read ({type(exc).__name__}: {exc})"
    for file in _FILES:
        if not (ckpt / file).is_file():
            return f"{file} is missing"
        size = (ckpt / file).stat().st_size
        if recorded is not None and size != recorded.get(file):
            return f"{file} has {size} bytes, {recorded.get(file)} were written"
        if recorded is None and size == 0 and file != "config.yaml":
            return f"{file} is empty"
    if verify and digests:
        for file in _FILES:
            if file in digests and _sha256(ckpt / file) != digests[file]:
                return f"{file} is not what was written (its SHA-256 differs from the manifest's: changed on disk)"
    return None


def _step_of(path: Path) -> int | None:
    digits = path.name[len(_PREFIX) :]
    return int(digits) if path.name.startswith(_PREFIX) and digits.isdigit() else None


def checkpoint_steps(directory: str | os.PathLike[str]) -> list[Path]:
    """The checkpoint directories (``step_<N>``) under ``directory``, newest first."""
    root = Path(directory)
    found = [p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and _step_of(p) is not None] if root.is_dir() else []
    return sorted(found, key=lambda p: -(_step_of(p) or 0))


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``latest`` points at under ``directory`` when it is whole (:func:`checkpoint_problem`), else
    ``None``."""
    named = _latest_name(Path(directory))
    if named is None:
        return None
    path = Path(directory) / named
    return path if checkpoint_problem(path) is None else None


def _latest_name(root: Path) -> str | None:
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        return pointer.read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def find_resumable(
    directory: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[Path | None, Checkpoint | None, list[str]]:
    """Load the checkpoint a run resumes from: the one ``latest`` names if it is whole and readable, else the
    newest one that is. Returns ``(its directory, what it restores, what was passed over)``, the last a line per
    checkpoint skipped (its name and why). ``(None, None, skipped)`` when there is nothing to load: no checkpoint
    (``skipped`` empty), or none whole (``skipped`` names each; a ``latest`` pointer to nothing counts). A whole
    checkpoint of another model or optimizer raises :class:`CheckpointMismatch`."""
    root = Path(directory)
    named = _latest_name(root)
    candidates = checkpoint_steps(root)
    skipped: list[str] = []
    if named is not None:
        pointed = root / named
        if pointed in candidates:
            candidates.remove(pointed)
            candidates.insert(0, pointed)
        else:
            skipped.append(f"{named} (named by {LATEST}): {checkpoint_problem(pointed) or 'not a checkpoint'}")
    elif (root / LATEST).exists():
        skipped.append(f"{LATEST}: empty or unreadable")
    for path in candidates:
        problem = checkpoint_problem(path, verify=True)
        if problem is None:
            try:
                return path, load_checkpoint(path, model, optimizer), skipped
            except CheckpointError as exc:
                problem = str(exc).removeprefix(f"checkpoint {path}: ")
        skipped.append(f"{path.name}: {problem}")
    return None, None, skipped


def _whole(parts: dict[int | None, torch.Tensor]) -> torch.Tensor:
    """A parameter's value from its saved parts: itself, or a stacked parameter's layers in order."""
    if None in parts:
        return parts[None]
    return torch.stack([parts[i] for i in sorted(i for i in parts if i is not None)])


def _read(ckpt: Path, file: str, read: Any) -> Any:
    """``read(path)`` of ``ckpt``'s ``file``, any failure to read it as :class:`CheckpointError` naming both."""
    try:
        return read(ckpt / file)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {ckpt}: {file} cannot be read ({type(exc).__name__}: {' '.join(str(exc).split())})"
        ) from exc


def _optimizer_form(saved: dict[str, Any]) -> str:
    if "by_name" in saved or set(saved) == {"state", "param_groups"}:
        return "one torch.optim optimizer (state and param_groups)"
    if "optimizers" in saved:
        return f"a fused optimizer ({len(saved['optimizers'])} per-parameter optimizers)"
    return "keys " + ", ".join(sorted(map(str, saved)))


def load_checkpoint(path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer) -> Checkpoint:
    """Restore ``model``'s weights and ``optimizer``'s state from the checkpoint directory ``path`` (weights are
    copied into the existing tensors, on their devices, so every reference to them stays valid); return the rest.
    A file that cannot be read (missing, truncated, corrupt) raises :class:`CheckpointError`; a checkpoint of a
    differently shaped model, or of another kind of optimizer, raises :class:`CheckpointMismatch` naming the
    tensor or the optimizer's form."""
    ckpt = Path(path)

    def weights_of(file: Path) -> dict[str, torch.Tensor]:
        with safe_open(str(file), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    stored = _read(ckpt, "model.safetensors", weights_of)
    saved = _read(ckpt, "optimizer.pt", lambda f: torch.load(f, map_location="cpu", weights_only=False))
    state = _read(ckpt, "state.pt", lambda f: torch.load(f, map_location="cpu", weights_only=False))
    if not isinstance(saved, dict) or not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"checkpoint {ckpt}: optimizer.pt or state.pt does not hold what a checkpoint saves")
    weights, _ = _weights(model)
    missing = sorted(set(weights) - set(stored))
    unexpected = sorted(set(stored) - set(weights))
    if missing or unexpected:
        raise CheckpointMismatch(
            f"checkpoint {ckpt}: the weights do not match the model (missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}); was it written by a run with another model or strategy?",
            ckpt,
            f"its weights do not match this model's ({len(missing)} missing, {len(unexpected)} unexpected)",
        )
    here = optimizer.state_dict()  # (empty for a sharded model's stand-in while loading: nothing to compare)
    if here and _optimizer_form(saved) != _optimizer_form(here):
        raise CheckpointMismatch(
            f"checkpoint {ckpt}: its optimizer state is that of {_optimizer_form(saved)}, this run's optimizer "
            f"({type(optimizer).__name__}) keeps that of {_optimizer_form(here)}; was it written with another "
            f"strategy (strategy.fused_optimizer, strategy.offload.optimizer)?",
            ckpt,
            f"its optimizer state is that of {_optimizer_form(saved)}, this run's that of {_optimizer_form(here)}",
        )
    tensors = {name: (tensor, index) for name, tensor, index in weight_slices(model)}
    tensors.update((name, (b, None)) for name, b in model.named_buffers())
    exact: dict[int, dict[int | None, torch.Tensor]] = {}
    with torch.no_grad():
        for name, value in stored.items():
            tensor, index = tensors[name]
            target = tensor if index is None else tensor[index]
            if target.shape != value.shape:
                raise CheckpointMismatch(
                    f"checkpoint {ckpt}: {name} has shape {tuple(value.shape)}, the model's is {tuple(target.shape)}",
                    ckpt,
                    f"its {name} has shape {tuple(value.shape)}, this model's {tuple(target.shape)}",
                )
            if value.dtype != tensor.dtype:
                exact.setdefault(id(tensor), {})[index] = value
            target.copy_(value.to(tensor.dtype))
    try:
        optimizer.load_state_dict(_optimizer_from_names(model, optimizer, saved) if "by_name" in saved else saved)
    except (KeyError, ValueError, IndexError) as exc:
        raise CheckpointMismatch(
            f"checkpoint {ckpt}: its optimizer state does not fit this run's optimizer ({type(exc).__name__}: "
            f"{exc}); was it written with another strategy or model?",
            ckpt,
            "its optimizer state does not fit this run's optimizer",
        ) from None
    load_masters = getattr(optimizer, "load_master_weights", None)
    if load_masters is not None and exact:  # saved masters more precise than the device weights: restored exactly
        load_masters({key: _whole(parts) for key, parts in exact.items()})
    try:
        return Checkpoint(**state)
    except TypeError as exc:
        raise CheckpointError(f"checkpoint {ckpt}: state.pt does not hold a checkpoint's state ({exc})") from None
