"""Convert pretrained models: replace modules in a tree (``map_module``) and rebuild linear layers
(``convert_linear``), as FewBit's ``fewbit.util`` does, with its README's examples working."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["convert_linear", "map_module"]


def convert_linear(module: nn.Module, cls: type[nn.Linear], **kwargs: Any) -> nn.Module:
    """``cls(in, out, bias=..., **kwargs)`` with ``module``'s weight and bias (same tensors: nothing is copied),
    on its device and dtype, when ``module`` is exactly an ``nn.Linear``; any other module is returned unchanged."""
    if type(module) is not nn.Linear:
        return module
    new = cls(
        module.in_features,
        module.out_features,
        bias=module.bias is not None,
        device=module.weight.device,
        dtype=module.weight.dtype,
        **kwargs,
    )
    new.weight = module.weight
    if module.bias is not None:
        new.bias = module.bias
    new.train(module.training)
    return new


def _wants_path(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def map_module(root: nn.Module, fn: Callable[..., nn.Module], patt: str | re.Pattern | None = None) -> nn.Module:
    """Replace, depth first, every module of ``root`` (``root`` included) by ``fn(module)`` or
    ``fn(module, path)`` (``fn`` may take the dotted path as a second argument; the root's path is ``''``).

    Children are replaced in place, so ``root`` itself is changed; the return value is ``fn(root)`` (usually
    ``root``). With ``patt``, only modules whose path fully matches the regular expression are passed to ``fn``.
    """
    if not isinstance(root, nn.Module):
        raise TypeError(f"map_module needs an nn.Module, got {type(root).__name__}")
    pattern = re.compile(patt) if isinstance(patt, str) else patt
    with_path = _wants_path(fn)

    def visit(module: nn.Module, path: str) -> nn.Module:
        for name, child in list(module.named_children()):
            replaced = visit(child, f"{path}.{name}" if path else name)
            if replaced is not child:
                setattr(module, name, replaced)
        if pattern is not None and not pattern.fullmatch(path):
            return module
        result = fn(module, path) if with_path else fn(module)
        if not isinstance(result, nn.Module):
            raise TypeError(
                f"map_module: fn returned {type(result).__name__} for module {path or '<root>'}; "
                f"it must return an nn.Module"
            )
        return result

    return visit(root, "")
