"""An optimizer whose state and float32 master weights live in host memory (ZeRO-Offload's CPU optimizer), beside
:mod:`revlib_xla.optim.fused` (the step fused into the backward pass).

:class:`HostOptimizer` wraps any ``torch.optim`` optimizer built by a factory (as :func:`revlib_xla.fuse_optimizer`
takes one): the factory is given host master copies of the parameters, and each step brings the device gradients
to the host, steps there one weight at a time and copies the updated weights back. The training CLI builds it with
AdamW (``strategy.offload.optimizer``: :class:`revlib_xla.train.strategy.HostOptimizerState`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .. import backends

__all__ = ["HostOptimizer", "InnerFactory", "master_dtype"]

InnerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""Builds the optimizer that steps the given parameters (the host masters, or with ``annotate`` the device ones)."""


class HostOptimizer(torch.optim.Optimizer):
    """The optimizer ``inner`` builds, with its state (and float32 master weights) in host memory.

    Two ways to keep the state in host memory:

    * host step (the default, and what ``strategy.offload.optimizer`` uses on every device, as ZeRO-Offload
      does): the optimizer runs on the CPU over host master copies of the parameters (page-locked where the
      backend can copy from them asynchronously); each step brings the gradients to the host and the updated
      weights back, one weight at a time. The state never occupies device memory. On a lazy device (XLA) the
      step first runs the pending graph (forward and backward, :func:`revlib_xla.backends.sync`), so the device
      program is the forward and backward producing gradients, and the weights come back as new device data.
    * ``annotate`` (XLA, by request only): the state stays a graph value annotated to live in host memory between
      steps (:func:`revlib_xla.backends.place_on_host`). The TPU compiler rejects such a step (an output moved to
      host is returned without a host layout), and torch_xla has no host-resident graph arguments, so the state
      would come back into HBM as an argument anyway; kept to show the annotations.

    :meth:`device_part_only` runs the device part of the host step alone (how :func:`revlib_xla.fit.trace_step`
    sizes it without running anything); :meth:`host_state_bytes` is the host memory the state and master copies
    take.
    """

    def __init__(self, params: list[nn.Parameter], inner: InnerFactory, annotate: bool = False) -> None:
        self.device_params = params
        self.annotate = annotate
        self._deferred: list[list[Tensor]] = []
        self._sums: list[Tensor | None] = [None] * len(params)  # float32 sums of micro-batch gradients (host)
        if annotate:
            self.inner = inner(params)
        else:
            # Filled from the device weights at the first step (or by load_state_dict): nothing is copied when the
            # step is only traced for sizing, and weights loaded after the optimizer was built are the ones used.
            self.host = [nn.Parameter(torch.empty(p.shape, dtype=master_dtype(p.dtype))) for p in params]
            self._filled = False
            for h, p in zip(self.host, params):
                backends.pin_host_tensor_(h, p.device)
            self.inner = inner(self.host)
        self.defaults = self.inner.defaults
        self.param_groups = self.inner.param_groups  # schedulers and set_lr reach the inner groups
        self.state = self.inner.state
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    def _move_state(self, move: Callable[[Tensor], Tensor]) -> None:
        for state in self.inner.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor) and key != "step":
                    state[key] = move(value)

    @contextlib.contextmanager
    def device_part_only(self) -> Iterator[list[Tensor]]:
        """Within the block, :meth:`step` of the host step does only its device part: the gradients it would
        bring to the host are appended to the yielded list (still pending on the device), and nothing is run,
        copied or updated. (``annotate``: the whole step is the device's; nothing is sent.)"""
        sent: list[Tensor] = []
        self._deferred.append(sent)
        try:
            yield sent
        finally:
            self._deferred.pop()

    def host_state_bytes(self) -> int:
        """Host bytes of the master weights and the optimizer state (AdamW: two moments per weight, four with
        amsgrad's maximum), whether or not a step has created the state yet. The step adds one weight's gradient
        in the master's dtype at a time (the largest: :meth:`host_step_bytes`)."""
        if self.annotate:
            return 0
        moments = 3 if self.defaults.get("amsgrad") else 2
        return sum(h.numel() * h.element_size() * (1 + moments) for h in self.host)

    def host_step_bytes(self) -> int:
        """Host bytes the step needs beside :meth:`host_state_bytes`: the largest weight's gradient, brought to the
        host in the master's dtype (the weights are stepped one at a time)."""
        return max((h.numel() * h.element_size() for h in getattr(self, "host", [])), default=0)

    @property
    def accumulates_on_host(self) -> bool:
        """Whether micro-batch gradients are summed on the host (:meth:`accumulate`): the device gradients are
        narrower than the masters (bfloat16), and a sum in their dtype would round at every addition."""
        return not self.annotate and any(h.dtype != p.dtype for h, p in zip(self.host, self.device_params))

    @torch.no_grad()
    def accumulate(self) -> None:
        """Add the device gradients to their float32 sums on the host and free them (after each micro-batch's
        backward; :meth:`step` steps with the sums). Traced for sizing (:meth:`device_part_only`): nothing."""
        if self._deferred:
            return
        grads = [p.grad for p in self.device_params]
        if self.device_params and backends.backend_for(self.device_params[0].device).lazy:
            backends.sync(self.device_params[0].device)
        for i, (h, p, g) in enumerate(zip(self.host, self.device_params, grads)):
            if g is not None:
                grad = backends.to_host_blocking(g.detach(), "cpu").to(h.dtype)
                total = self._sums[i]
                self._sums[i] = grad if total is None else total.add_(grad)
                p.grad = None

    def clip_grad_norm_(self, params: list[nn.Parameter], max_norm: float) -> Tensor:
        """Clip by the global norm the gradients :meth:`step` will use: the host sums where :meth:`accumulate`
        made them, else ``params``' device gradients. Returns the norm before clipping."""
        if not any(s is not None for s in self._sums):
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        for h, total in zip(self.host, self._sums):
            h.grad = total
        try:
            return torch.nn.utils.clip_grad_norm_(self.host, max_norm)  # scales the sums in place
        finally:
            for h in self.host:
                h.grad = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.annotate:
            self._move_state(lambda t: backends.place_on_device(t))
            out = self.inner.step(closure)
            self._move_state(lambda t: backends.place_on_host(t))
            return out
        grads = [p.grad for p in self.device_params]
        if self._deferred:
            self._deferred[-1].extend(g for g in grads if g is not None)
            return None
        if self.device_params and backends.backend_for(self.device_params[0].device).lazy:
            backends.sync(self.device_params[0].device)  # one program: forward and backward (and the loss)
        if not self._filled:
            self._copy_from_device()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # One weight at a time: AdamW steps only the weights that have a gradient, so the host holds one float32
        # gradient beside the masters and state (llama-3b: 1.5 GiB for the embedding, not 12 GiB for all).
        for i, (h, p, g) in enumerate(zip(self.host, self.device_params, grads)):
            total, self._sums[i] = self._sums[i], None
            if g is None and total is None:
                continue
            grad = None if g is None else backends.to_host_blocking(g.detach(), "cpu").to(h.dtype)
            h.grad = total if grad is None else grad if total is None else total.add_(grad)
            self.inner.step()
            h.grad = None
            p.copy_(h, non_blocking=False)
        return loss

    def _copy_from_device(self) -> None:
        with torch.no_grad():
            for h, p in zip(self.host, self.device_params):
                h.copy_(p)
        self._filled = True

    def master_weights(self) -> list[tuple[Tensor, Tensor]]:
        """``(device parameter, host master weight)`` pairs whose master is more precise than the device weight
        (float32 masters of bfloat16 weights), once the masters hold the weights (after the first step or a
        restore): what a checkpoint saves instead of the rounded device weights."""
        if self.annotate or not self._filled:
            return []
        return [(p, h) for p, h in zip(self.device_params, self.host) if h.dtype != p.dtype]

    def load_master_weights(self, values: dict[int, Tensor]) -> None:
        """Set the masters of the device parameters in ``values`` (``id(parameter)`` -> the saved float32
        weight) exactly, and the device weights to their rounding; other masters are copied from the device."""
        if self.annotate:
            return
        if not self._filled:
            self._copy_from_device()
        with torch.no_grad():
            for h, p in zip(self.host, self.device_params):
                if id(p) in values and h.dtype != p.dtype:
                    h.copy_(values[id(p)])
                    p.copy_(h)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.device_params:
            p.grad = None
        self._sums = [None] * len(self.device_params)
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        # torch replaces the groups and the state: what set_lr and the tracer reach must be the new ones
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        if not self.annotate:  # the master copies follow the restored weights
            self._copy_from_device()


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a host master weight: float32 for a half-precision device weight, else the weight's own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
