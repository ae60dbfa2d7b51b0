"""The run configuration of ``revlib-xla train``: a typed schema (pydantic v2), YAML files and ``key=value`` overrides.

A run is described by seven sections, each a pydantic model that rejects unknown keys: ``model`` (which LM and how its
shape differs from the named size), ``strategy`` (how the step saves memory: activations, few-bit, offload, fused
optimizer, precision), ``data``, ``optim``, ``chip`` (the target for ``plan`` auto, the MFU estimate and
``revlib-xla memory``), ``mesh`` (how one process spreads the step over several devices: SPMD) and ``train``
(steps, evaluation, checkpoints, device).

:func:`load_config` reads a YAML file (``tpu_configs/*.yaml``), applies overrides written as dotted keys with YAML
values (``train.steps=10``, ``strategy.offload.optimizer=true``, ``optim.betas=[0.9,0.99]``; ``strategy=reversible``
is short for ``strategy.activations=reversible``) and validates the result. Every mistake a user can make is a
:class:`ConfigError` whose message names the dotted key, the bad value and what is allowed.
"""

from __future__ import annotations

import difflib
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..units import parse_bytes

__all__ = [
    "ConfigError",
    "ModelConfig",
    "OffloadConfig",
    "StrategyConfig",
    "DataConfig",
    "OptimConfig",
    "ChipConfig",
    "MeshConfig",
    "TrainConfig",
    "RunConfig",
    "ACTIVATIONS",
    "load_config",
    "apply_overrides",
    "dump_config",
    "llama_sizes",
]

ACTIVATIONS = ("none", "checkpoint", "reversible", "momentum", "plan")
"""The values of ``strategy.activations``: what the training step keeps of its activations."""

FEWBIT_BITS = range(0, 5)
"""``strategy.fewbit``: 0 (off) or the 1-4 bits the few-bit activations store per element."""


class ConfigError(ValueError):
    """A bad configuration: the message names the dotted key, the value given and what is allowed."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(_Section):
    """Which model to train: a named size (``llama-tiny`` ... ``llama-8b``) and fields of its ``LlamaConfig`` to
    change (``overrides: {vocab_size: 256}`` for bytes). ``scan``: the reversible form's layers stored stacked and
    run as one XLA loop (:func:`revlib_xla.scan.stack_layers`): the step compiles one layer whatever the depth,
    with the unrolled walk's gradients; cpu and cuda run the same layers one by one."""

    name: str = "llama-tiny"
    overrides: dict[str, Any] = Field(default_factory=dict)
    hf_config: str | None = None
    scan: bool = False


class OffloadConfig(_Section):
    """What lives in host memory instead of the accelerator's: parameters (streamed layer by layer), the optimizer
    state, the activations saved for the backward pass."""

    params: bool = False
    optimizer: bool = False
    gradients: bool = False  # with optimizer: each gradient to the host as the backward produces it
    activations: bool = False


class StrategyConfig(_Section):
    """How the training step fits in memory (the keys compose; unsupported combinations are refused by name)."""

    activations: Literal["none", "checkpoint", "reversible", "momentum", "plan"] = "none"
    budget: str | int = "auto"
    fewbit: int = 0
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    fused_optimizer: bool = False
    precision: Literal["fp32", "bf16"] = "fp32"
    param_dtype: Literal["fp32", "bf16"] = "fp32"
    loss_chunk: int | Literal["auto"] = "auto"
    beta: float = 0.9
    exact: bool = True  # the reversible and momentum forms' streams: fixed-point (true) or floating-point (false)
    data_parallel: Literal["ddp", "fsdp2"] = (
        "ddp"  # how torchrun's processes split the model: revlib_xla.train.distributed
    )

    @field_validator("budget")
    @classmethod
    def _budget(cls, value: str | int) -> str | int:
        if value == "auto":
            return value
        try:
            parse_bytes(value, "strategy.budget")  # a ValueError names the units
        except ValueError as exc:  # said after the key and value already: not twice
            raise ValueError(str(exc).removeprefix(f"strategy.budget={value!r}: ")) from None
        return value

    @field_validator("fewbit")
    @classmethod
    def _fewbit(cls, value: int) -> int:
        if value not in FEWBIT_BITS:
            raise ValueError("must be 0 (off) or 1, 2, 3 or 4 bits")
        return value

    @field_validator("loss_chunk")
    @classmethod
    def _loss_chunk(cls, value: int | str) -> int | str:
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError("must be auto, 0 (off: the whole logits tensor) or a positive number of positions")
        return value

    @field_validator("beta")
    @classmethod
    def _beta(cls, value: float) -> float:
        if not 0.0 < value < 1.0:
            raise ValueError("the momentum coefficient must be in (0, 1)")
        return value

    def budget_bytes(self) -> int | None:
        """The planner's budget in bytes, or ``None`` for ``auto``."""
        return None if self.budget == "auto" else int(parse_bytes(self.budget, "strategy.budget"))


class DataConfig(_Section):
    """What to train on: bytes of local text (default: the Python standard library's source), a pre-tokenized file
    of ``uint16``/``uint32`` ids, or a Hugging Face dataset (needs ``datasets``)."""

    kind: Literal["bytes", "tokens", "hf"] = "bytes"
    path: str | None = None
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    hf_dataset: str | None = None
    seq_len: int = Field(default=256, ge=2)
    batch_size: int = Field(default=8, ge=1)
    val_fraction: float = Field(default=0.05, gt=0.0, lt=1.0)


class OptimConfig(_Section):
    """AdamW with linear warmup and a cosine (or constant) schedule; weight decay on matrices only."""

    lr: float = Field(default=3e-4, gt=0.0)
    weight_decay: float = Field(default=0.1, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(default=1e-8, gt=0.0)
    warmup_steps: int = Field(default=10, ge=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    grad_clip: float = Field(default=1.0, ge=0.0)
    grad_accum_steps: int = Field(default=1, ge=1)
    #: how AdamW's step runs on the device: auto (torch's fused kernel on cuda: no temporaries; torch's default
    #: elsewhere), fused, foreach (torch's default on cuda: temporaries the size of every gradient at once) or
    #: for-loop (one weight at a time)
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError("both betas must be in [0, 1)")
        return value


class ChipConfig(_Section):
    """The accelerator the run targets: ``plan`` auto's budget, ``revlib-xla memory``, and a GPU run's MFU peak
    (a TPU's comes from its runtime)."""

    name: str = "v5e"
    chips: int = Field(default=1, ge=1)


class MeshConfig(_Section):
    """How one process spreads the step over the devices it drives (torch_xla SPMD: the chips of a TPU VM): a
    mesh of ``data x fsdp x tensor`` devices, ``-1`` for one axis = the devices the others leave. Parameters are
    sharded over ``fsdp`` (and ``tensor``) and the batch over ``data x fsdp``; see :mod:`revlib_xla.sharding`.
    Where one process drives one device (cpu, cuda) every axis must come to 1."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    @field_validator("data", "fsdp", "tensor")
    @classmethod
    def _axis(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError("a mesh axis is a number of devices (>= 1), or -1 for the devices the others leave")
        return value

    @model_validator(mode="after")
    def _one_fill(self) -> MeshConfig:
        filled = [name for name in ("data", "fsdp", "tensor") if getattr(self, name) == -1]
        if len(filled) > 1:
            raise ValueError(
                f"mesh: only one axis may be -1 (the devices the others leave), not {' and '.join(filled)}"
            )
        return self

    def axes(self) -> dict[str, int]:
        """The axes in mesh order (``data``, ``fsdp``, ``tensor``) with their sizes as written (-1: fill)."""
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}


class TrainConfig(_Section):
    """The loop: steps, evaluation, logging, checkpoints, device and where everything is written. ``nonfinite``:
    what a step whose loss or gradient norm is NaN or inf does: ``stop`` the run (with an error naming the step;
    the checkpoints keep finite weights) or ``skip`` the step's update (see :mod:`revlib_xla.train.loop`)."""

    steps: int = Field(default=100, ge=1)
    eval_every: int = Field(default=50, ge=0)
    eval_batches: int = Field(default=4, ge=1)
    log_every: int = Field(default=1, ge=1)
    seed: int = 0
    device: Literal["auto", "cpu", "cuda", "xla"] = "auto"
    out_dir: str = "runs/default"
    checkpoint_every: int = Field(default=50, ge=0)
    keep_checkpoints: int = Field(default=3, ge=1)
    resume: bool = True
    #: resume even where the seed, the data, the batch, the sequence length or the precision differ from the run that
    #: wrote the checkpoint (refused otherwise: the result would match neither run)
    resume_changed: bool = False
    progress: bool = True
    nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss or gradient norm: stop the run, or skip the step


class RunConfig(_Section):
    """A whole run: the seven sections."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    chip: ChipConfig = Field(default_factory=ChipConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)

    @model_validator(mode="after")
    def _cross_fields(self) -> RunConfig:
        s, o = self.strategy, self.optim
        if s.budget != "auto" and s.activations != "plan":
            raise ValueError(
                f"strategy.budget={s.budget!r} is the planner's budget and applies only to strategy.activations=plan "
                f"(here {s.activations!r}); remove strategy.budget or set strategy.activations=plan"
            )
        if not s.exact and s.activations not in ("reversible", "momentum"):
            raise ValueError(
                f"strategy.exact=false chooses the streams of a reversible stack, which strategy.activations="
                f"{s.activations} does not have; remove strategy.exact or set strategy.activations=reversible or "
                f"momentum"
            )
        if s.param_dtype == "bf16":
            _check_bf16_weights(s)
        if s.offload.gradients and (not s.offload.optimizer or s.offload.params):
            raise ValueError(
                "strategy.offload.gradients=true hands each gradient to the host optimizer as the backward produces "
                "it, which is strategy.offload.optimizer=true with strategy.offload.params=false (offloaded "
                "parameters' gradients are host tensors already); set strategy.offload.optimizer=true, or remove "
                "strategy.offload.gradients"
            )
        if self.model.scan:
            _check_scan(self)
        if s.fused_optimizer and o.grad_accum_steps > 1:
            raise ValueError(
                f"strategy.fused_optimizer=true steps each parameter inside the backward pass, so gradients cannot "
                f"be accumulated over optim.grad_accum_steps={o.grad_accum_steps}; set optim.grad_accum_steps=1 or "
                f"strategy.fused_optimizer=false"
            )
        if s.fused_optimizer and self.train.nonfinite == "skip":
            raise ValueError(
                "train.nonfinite=skip drops the update of a step whose loss or gradient norm is NaN or inf, but "
                "strategy.fused_optimizer=true updates each parameter during the backward pass, before that is "
                "known; set train.nonfinite=stop or strategy.fused_optimizer=false"
            )
        if s.fused_optimizer and o.grad_clip > 0:
            raise ValueError(
                f"strategy.fused_optimizer=true updates each parameter before the other gradients exist, so the "
                f"global-norm clipping optim.grad_clip={o.grad_clip} cannot be applied; set optim.grad_clip=0 or "
                f"strategy.fused_optimizer=false"
            )
        if self.data.batch_size % o.grad_accum_steps:
            raise ValueError(
                f"data.batch_size={self.data.batch_size} is split into optim.grad_accum_steps={o.grad_accum_steps} "
                f"micro-batches and must be a multiple of it"
            )
        if self.data.kind == "tokens" and not self.data.path:
            raise ValueError("data.kind=tokens needs data.path: a file of token ids (data.token_dtype)")
        if self.data.kind == "hf" and not self.data.hf_dataset:
            raise ValueError("data.kind=hf needs data.hf_dataset: the dataset's name or local path")
        return self


def _check_bf16_weights(s: StrategyConfig) -> None:
    """``strategy.param_dtype=bf16``: bfloat16 weights on the device need their float32 master copies and AdamW on
    the host (``offload.optimizer``) and bfloat16 computation (``precision``)."""
    if not s.offload.optimizer or s.offload.params:
        raise ValueError(
            "strategy.param_dtype=bf16 keeps bfloat16 weights on the device and their float32 master weights and "
            "AdamW state on the host, which is strategy.offload.optimizer=true (with strategy.offload.params=false: "
            "offloaded parameters are host tensors already); set strategy.offload.optimizer=true, or "
            "strategy.param_dtype=fp32 (a bfloat16 weight updated in place would lose every update below its "
            "precision)"
        )
    if s.precision != "bf16":
        raise ValueError(
            f"strategy.param_dtype=bf16 computes with bfloat16 weights, which needs strategy.precision=bf16 "
            f"(autocast; here {s.precision!r}); set strategy.precision=bf16 or strategy.param_dtype=fp32"
        )


def _check_scan(cfg: RunConfig) -> None:
    """``model.scan=true`` stacks the layers of the reversible form, whose Llama layers all repeat; every other way
    of running the layers has no scanned form."""
    s = cfg.strategy
    if s.activations != "reversible":
        why = (
            "the momentum form's layers are not stacked (build_llama stacks the reversible form only)"
            if s.activations == "momentum"
            else f"strategy.activations={s.activations} runs the plain model, which has no scanned form"
        )
        raise ValueError(
            f"model.scan=true stacks the layers of the reversible form; {why}. Set strategy.activations=reversible, "
            f"or model.scan=false"
        )
    for key, on, why in (
        ("model.hf_config", cfg.model.hf_config is not None, "a transformers model's layers are converted one by one"),
        ("strategy.offload.params", s.offload.params, "offloaded parameters are streamed layer by layer"),
        ("strategy.fused_optimizer", s.fused_optimizer, "a fused optimizer steps each layer's own parameters"),
    ):
        if on:
            raise ValueError(f"model.scan=true cannot be combined with {key} ({why}); set model.scan=false")


# ----------------------------------------------------------------------------------------------------------------
# Loading


def llama_sizes() -> list[str]:
    """The named model sizes ``model.name`` accepts."""
    from ..models.llama import LLAMA_SIZES

    return list(LLAMA_SIZES)


def _check_chip(cfg: RunConfig) -> None:
    """``chip.name`` is a chip the library knows (a TPU or a GPU), said before anything is built."""
    from ..chips import CHIPS

    if cfg.chip.name not in CHIPS:
        close = difflib.get_close_matches(str(cfg.chip.name).lower(), list(CHIPS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"chip.name={cfg.chip.name!r} is not a known chip{hint}; choose one of {', '.join(CHIPS)}")


def _check_model(cfg: RunConfig) -> None:
    """``model.name`` is a known size and ``model.overrides`` are fields of its config."""
    if cfg.model.hf_config is not None:
        return
    from ..models.llama import llama_config

    sizes = llama_sizes()
    if cfg.model.name not in sizes:
        close = difflib.get_close_matches(cfg.model.name, sizes, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"model.name={cfg.model.name!r} is not a known size{hint}; choose one of {', '.join(sizes)}")
    try:
        llama_config(cfg.model.name, **cfg.model.overrides)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model.overrides: {exc}") from None


def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys: list[str] = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        inner = field.annotation
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            keys.extend(_known_keys(inner, dotted + "."))
    return keys


def _allowed(model: type[BaseModel], path: Sequence[str | int]) -> str:
    """What the field at ``path`` accepts, for an error message."""
    current: Any = model
    for part in path:
        fields = getattr(current, "model_fields", None)
        if fields is None or part not in fields:
            return ""
        current = fields[part].annotation
    if typing.get_origin(current) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(current))
    return getattr(current, "__name__", None) or str(current).replace("typing.", "")


def _config_error(exc: ValidationError) -> ConfigError:
    """pydantic's errors as one line each: the dotted key, the value given, what is allowed."""
    lines = []
    for err in exc.errors():
        path = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith(("function-", "literal[")))]
        key = ".".join(str(p) for p in path)
        if err["type"] == "extra_forbidden":
            parent = ".".join(str(p) for p in path[:-1])
            siblings = [
                k for k in _known_keys(RunConfig) if k.rsplit(".", 1)[0] == parent or (not parent and "." not in k)
            ]
            close = difflib.get_close_matches(key, siblings, n=3, cutoff=0.5)
            lines.append(
                f"unknown key {key!r}"
                + (f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else "")
                + f"; the keys{' of ' + parent if parent else ''} are {', '.join(siblings)}"
            )
            continue
        msg = str(err["msg"]).removeprefix("Value error, ")
        if not key:  # a rule across fields: its message names the keys
            lines.append(msg)
            continue
        allowed = _allowed(RunConfig, path)
        lines.append(f"{key}={err.get('input')!r}: {msg}" + (f" (expected {allowed})" if allowed else ""))
    return ConfigError("; ".join(lines))


class _DuplicateKey(yaml.YAMLError):
    """A mapping that names a key twice (PyYAML keeps the last value silently)."""


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping."""


def _unique_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: the merged keys may be overridden
            continue
        key = loader.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
        line = key_node.start_mark.line + 1
        if key in seen:
            raise _DuplicateKey(f"the key {key!r} is given twice in one mapping (lines {seen[key]} and {line})")
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)  # type: ignore[arg-type]


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader


def _parse_value(text: str, item: str = "") -> Any:
    try:
        return _load_yaml(text) if text.strip() else ""
    except _DuplicateKey as exc:
        raise ConfigError(f"override {item!r}: {exc}") from None
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``data`` (a nested dict as read from YAML) with ``key=value`` overrides applied; values are parsed as YAML
    (``true``, ``10``, ``[0.9, 0.99]``, ``8GiB`` stays a string). ``strategy=NAME`` sets ``strategy.activations``."""
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=10 or strategy=reversible")
        value = _parse_value(text, item)
        if key == "strategy" and not isinstance(value, dict):
            key = "strategy.activations"
        parts = key.split(".")
        node = data
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override {item!r}: {'.'.join(parts[: depth + 1])} is a value ({child!r}), not a section"
                )
            node = child
        node[parts[-1]] = value
    return data


def load_config(path: str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> RunConfig:
    """The validated run configuration from the YAML file ``path`` (``None``: the defaults) and ``overrides``
    (``"train.steps=10"``, ``"strategy=reversible"``). Raises :class:`ConfigError` naming the key for every mistake:
    an unknown key (with the closest valid ones), a wrong type or value (with what is allowed), an unknown model
    size (with the list of sizes), a missing file."""
    data: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"--config {str(path)!r}: no such file (the shipped configs are in tpu_configs/)")
        try:
            loaded = _load_yaml(file.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(
                f"--config {str(path)!r} is not a text file (not UTF-8); give a YAML run config such as "
                f"tpu_configs/cpu-smoke.yaml"
            ) from None
        except _DuplicateKey as exc:
            raise ConfigError(f"--config {str(path)!r}: {exc}; give each key once") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config {str(path)!r} is not valid YAML: {exc}".replace("\n", " ")) from None
        if loaded is not None and not isinstance(loaded, Mapping):
            raise ConfigError(f"--config {str(path)!r}: expected a mapping of sections, got {type(loaded).__name__}")
        data = dict(loaded or {})
    data = apply_overrides(data, overrides)
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise _config_error(exc) from None
    _check_model(cfg)
    _check_chip(cfg)
    return cfg


def dump_config(cfg: RunConfig) -> str:
    """The resolved configuration as YAML (what a checkpoint records, and what :func:`load_config` reads back)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
