"""Loading what a converted model saved, and the plain model back: :func:`from_pretrained` converts a marked save
(:mod:`revlib_xla.hf.saving`) again as it was trained; :func:`unconvert` turns a converted model back into the plain
one where that keeps its function (``plan``), or where the caller accepts the difference (``momentum``,
``approximate=True``); a two-stream ``reversible`` model has no plain form and is refused."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from torch import nn

from .convert import memory_efficient
from .layers import HFConversionError
from .saving import MARK

__all__ = ["from_pretrained", "unconvert"]


def _config_dict(path: str | Path, **hub: Any) -> dict[str, Any] | None:
    folder = Path(path)
    if folder.is_dir():
        file = folder / "config.json"
        return json.loads(file.read_text()) if file.exists() else None
    from transformers.utils import cached_file

    resolved = cached_file(str(path), "config.json", **hub)
    return None if resolved is None else json.loads(Path(resolved).read_text())


def from_pretrained(path: str | Path, model_class: Any = None, **kwargs: Any) -> nn.Module:
    """Load a model saved by ``save_pretrained``: converted again as it was trained where its config is marked
    (``revlib_xla`` entry, see the module docstring), else the plain model as transformers loads it.

    ``model_class``: the transformers class to build (default ``AutoModelForCausalLM``); ``kwargs`` go to its
    ``from_pretrained`` (``dtype=``, ``device_map=``, ...).
    """
    import transformers

    cls = model_class if model_class is not None else transformers.AutoModelForCausalLM
    hub = {k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only") if k in kwargs}
    config_dict = _config_dict(path, **hub)
    mark = None if config_dict is None else config_dict.get(MARK)
    if config_dict is None or mark is None:
        return cls.from_pretrained(path, **kwargs)
    if not isinstance(mark, dict) or "strategy" not in mark or "original_model_type" not in mark:
        raise HFConversionError(
            f"revlib_xla.hf.from_pretrained: {path}: config.json's {MARK!r} entry is not one "
            f"revlib_xla wrote ({mark!r})"
        )
    fields = {k: v for k, v in config_dict.items() if k not in (MARK, "model_type", "transformers_version")}
    config = transformers.AutoConfig.for_model(mark["original_model_type"], **fields)
    model = cls.from_pretrained(path, config=config, **kwargs)
    return memory_efficient(model, mark["strategy"], **mark.get("options", {}))


def unconvert(model: nn.Module, approximate: bool = False) -> nn.Module:
    """The model with its plain layer list back (in place; returns ``model``): the state-dict keys are the same,
    ``save_pretrained`` writes a plain transformers model again.

    ``plan``: the same function. ``momentum``: the plain layers compute the momentum stack's function only up to
    ``beta`` times the change of the residual from one layer to the next; refused unless ``approximate=True``.
    ``reversible`` (two-stream): another function, with no plain form: refused.
    """
    conversion = getattr(model, "revlib_xla_conversion", None)
    if conversion is None:
        raise HFConversionError(f"unconvert: {type(model).__name__} was not converted by revlib_xla.hf")
    if conversion.strategy == "reversible":
        raise HFConversionError(
            "unconvert: a two-stream reversible model computes another function than its architecture, which has "
            "no plain form; keep it converted (save_pretrained marks the saved config; revlib_xla.hf.from_pretrained "
            "loads it converted)"
        )
    if conversion.strategy == "momentum" and not approximate:
        beta = conversion.options.get("beta")
        raise HFConversionError(
            f"unconvert: the plain layers compute this momentum model's function only approximately (up to beta = "
            f"{beta} times the change of each residual from one layer to the next); pass approximate=True to accept "
            f"that, or keep it converted (revlib_xla.hf.from_pretrained loads the marked save)"
        )
    if conversion.strategy == "momentum":
        warnings.warn(
            f"unconvert: the plain layers compute the momentum model's function up to beta = "
            f"{conversion.options.get('beta')}",
            stacklevel=2,
        )
    conversion.undo(model)
    return model
