"""The stages of a sequential model: how a model is cut into the chain the planner schedules."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["atomic", "flatten_sequential", "check_one_input", "inverse_of"]


def inverse_of(stage: nn.Module) -> Callable[[Any], Any]:
    """The stage's ``inverse`` method (a reversible stage rebuilds its input from its output with it)."""
    inverse = getattr(stage, "inverse", None)
    if not callable(inverse):
        raise TypeError(f"{type(stage).__name__} has no inverse method: it cannot rebuild its input")
    return inverse


def atomic(module: nn.Module) -> nn.Module:
    """Mark an ``nn.Sequential`` as one stage (the planner will not split it). Returns the module."""
    module._revlib_atomic = True  # type: ignore[assignment]  # a plain flag; nn.Module's stub types attributes as tensors or modules
    return module


def _is_atomic(module: nn.Module) -> bool:
    return bool(getattr(module, "_revlib_atomic", False) or getattr(module, "not_really_sequential", False))


def flatten_sequential(model: nn.Module) -> list[nn.Module]:
    """The stages of ``model``: nested ``nn.Sequential`` containers are flattened (unless marked with
    :func:`atomic`), and a module that starts with an in-place operation on its input (``ReLU(inplace=True)``)
    is merged into the stage before it, so that no stage overwrites its own input, which may be a checkpoint."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"Checkpointable needs an nn.Sequential, got {type(model).__name__}. Write the model as "
            f"nn.Sequential(stage_0, stage_1, ...) where each stage takes the previous stage's output (a tensor or a "
            f"tuple of tensors); revlib_xla.models has ResNets and a GPT written this way."
        )
    flat: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, nn.Sequential) and not _is_atomic(module):
            for child in module:
                visit(child)
        elif flat and getattr(module, "inplace", False):
            flat[-1] = atomic(nn.Sequential(flat[-1], module))
        else:
            flat.append(module)

    visit(model)
    if not flat:
        raise ValueError("Checkpointable: the model has no stages (an empty nn.Sequential)")
    return flat


def check_one_input(index: int, stage: nn.Module) -> None:
    """Refuse a stage whose forward needs more than one argument: stages are called as nn.Sequential calls them."""
    try:
        parameters = inspect.signature(stage.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): left to the call
        return
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty]
    if len(names) > 1:
        raise TypeError(
            f"Checkpointable: stage {index} ({type(stage).__name__}) takes {len(names)} inputs ({', '.join(names)}); "
            f"each stage is called with one argument, the previous stage's output (a tensor, or a tuple, list or "
            f"dict of tensors), as nn.Sequential calls it. Give its forward one argument and unpack it "
            f"(def forward(self, inputs): {', '.join(names)} = inputs), or let the stage before return that tuple"
        )
