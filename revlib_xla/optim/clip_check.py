"""``torch.nn.utils.clip_grad_norm_`` on the parameters of a fused optimizer (:mod:`revlib_xla.optim.fused`): refused
where it would silently clip nothing (the fused step has freed their gradients). Importing this module wraps torch's
function (again where something replaced it since: torch_xla puts its own in place when it starts)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import FusedOptimizerError

_COVERED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
"""``id(parameter)`` -> the live fused optimizer that steps it (kept by :meth:`FusedOptimizer._index`)."""


def _unchecked(clip: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    inner: Callable[..., torch.Tensor] = getattr(clip, "__wrapped__", clip)
    return inner if getattr(clip, "_revlib_checked", False) else clip


_torch_clip_grad_norm_ = _unchecked(torch.nn.utils.clip_grad.clip_grad_norm_)
"""torch's own clip_grad_norm_: what a fused step's per-group clipping runs."""


def _fused_without_grad(params: Sequence[torch.Tensor]) -> tuple[Any, int] | None:
    """The fused optimizer (a :class:`~revlib_xla.optim.fused.FusedOptimizer`) of the first of ``params`` whose
    gradient it freed, and that parameter's group."""
    for p in params:
        owner = _COVERED.get(id(p))
        if owner is not None and owner._by_id.get(id(p)) is p and p.grad is None:
            return owner, owner._of[id(p)]
    return None


def _checked(clip: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``clip`` (a ``clip_grad_norm_``) refusing the parameters of a fused optimizer whose gradients it freed."""
    if getattr(clip, "_revlib_checked", False):
        return clip

    @functools.wraps(clip)  # (torch_xla replaces torch's function only when the signature is torch's: it is)
    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        found = _fused_without_grad(params)
        if found is not None:
            owner, gi = found
            raise FusedOptimizerError(
                f"clip_grad_norm_ on the parameters of a fused optimizer ({owner.names[gi]}): the fused step "
                f"updates each parameter during the backward and frees its gradient, so there is nothing left to "
                f"clip (torch would return 0 and clip nothing). Clip each parameter's gradient by its own norm "
                f"inside the fused step (fuse_optimizer(model, factory, max_grad_norm=...)), or use an unfused "
                f"optimizer for global-norm clipping"
            )
        return clip(params, max_norm, *args, **kwargs)

    clip_grad_norm_._revlib_checked = True  # type: ignore[attr-defined]
    return clip_grad_norm_


def _install_clip_check() -> None:
    """Wrap ``torch.nn.utils.clip_grad_norm_`` with the fused-parameter check (again where something replaced it
    since: torch_xla puts its own in place when it starts)."""
    torch.nn.utils.clip_grad_norm_ = _checked(torch.nn.utils.clip_grad_norm_)
    torch.nn.utils.clip_grad.clip_grad_norm_ = _checked(torch.nn.utils.clip_grad.clip_grad_norm_)


_install_clip_check()
