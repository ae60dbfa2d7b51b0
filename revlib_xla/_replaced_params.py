"""Parameters that :func:`revlib_xla.scan.stack_layers` replaced: an optimizer still holding one raises at its step.

``stack_layers`` removes each layer's own parameters and registers stacks in their place. An optimizer built before
it holds the removed tensors: they never receive a gradient again, so ``optimizer.step()`` would skip them silently
and the model would stop learning with no error. Each removed parameter is marked here, and one global optimizer
step pre-hook (installed on first use) refuses a step of an optimizer that holds a marked parameter, naming it.
The hook looks at an optimizer's parameters once, and again only when its parameter count changes
(``add_param_group``), so a step costs one dictionary lookup.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_MARK = "_revlib_replaced_by"
_checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_installed = False


class ReplacedParameterError(RuntimeError):
    """An optimizer steps a parameter that :func:`revlib_xla.scan.stack_layers` replaced by a stack."""


def mark_replaced(param: torch.Tensor, where: str) -> None:
    """Record that ``param`` (named ``where``) was replaced by a stack; install the step pre-hook once."""
    global _installed
    setattr(param, _MARK, where)
    with _lock:
        if not _installed:
            register_optimizer_step_pre_hook(_refuse_replaced)
            _installed = True


def _refuse_replaced(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _checked.get(optimizer) == count:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            where = getattr(p, _MARK, None)
            if where is not None:
                raise ReplacedParameterError(
                    f"{type(optimizer).__name__}.step(): it holds '{where}', a parameter that "
                    f"revlib_xla.scan.stack_layers replaced by a stack, so it would never be updated again; build "
                    f"the optimizer after stack_layers, from model.parameters()"
                )
    _checked[optimizer] = count
