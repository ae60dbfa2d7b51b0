"""An optimizer whose state and float32 master weights live in host memory (ZeRO-Offload's CPU optimizer), beside
:mod:`revlib_xla.optim.fused` (the step fused into the backward pass).

:class:`HostOptimizer` wraps any ``torch.optim`` optimizer built by a factory (as :func:`revlib_xla.fuse_optimizer`
takes one): the factory is given host master copies of the parameters, and each step brings the device gradients
to the host, steps there one weight at a time and copies the updated weights back. The training CLI builds it with
AdamW (``strategy.offload.optimizer``: :class:`revlib_xla.train.strategy.HostOptimizerState`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from .. import backends
from .gradient_stream import GradientStream

__all__ = ["HostOptimizer", "HostMemoryError", "InnerFactory", "master_dtype"]


class HostMemoryError(MemoryError):
    """The host lacks the memory a :class:`HostOptimizer` will hold (said when it is built, before the first
    step); ``needed`` and ``available`` in bytes, ``parts`` what the need is made of."""

    def __init__(self, needed: int, available: int, parts: dict[str, int]) -> None:
        from ..units import format_bytes

        self.needed, self.available, self.parts = needed, available, parts
        made_of = ", ".join(f"{name} {format_bytes(n)}" for name, n in parts.items() if n)
        super().__init__(
            f"the host optimizer needs {format_bytes(needed)} of host memory ({made_of}) and this host has "
            f"{format_bytes(available)} available"
        )


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

    ``stream_gradients=True`` (host step only): each gradient goes to the host as the backward produces it
    (:class:`~revlib_xla.optim.gradient_stream.GradientStream`), so the device never holds a full set of gradients,
    and where the step allows it (:meth:`backward_starts` with ``final=True``: the last micro-batch, no global-norm
    clipping) each weight is stepped on the host as soon as its gradient is whole, beside the rest of the backward
    (``shared``: ``id`` s of tied parameters, whose gradient arrives in parts: they wait for :meth:`step`). The
    results are those of the host step bit for bit: the same float32 gradients (sums of micro-batches in float32),
    the same global norm, the same per-weight AdamW.

    :meth:`device_part_only` runs the device part of the host step alone (how :func:`revlib_xla.fit.trace_step`
    sizes it without running anything); :meth:`host_state_bytes` is the host memory the state and master copies
    take.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        inner: InnerFactory,
        annotate: bool = False,
        stream_gradients: bool = False,
        shared: Collection[int] = (),
        overlap: bool | None = None,
        kept_gradients: str | None = None,
    ) -> None:
        self.device_params = params
        self.annotate = annotate
        if annotate and stream_gradients:
            raise ValueError("HostOptimizer: stream_gradients needs the host step (annotate=False)")
        self.stream: GradientStream | None = None
        self._coef: Tensor | None = None  # the global-norm clipping factor for the next step (streamed gradients)
        self._deferred: list[list[Tensor]] = []
        self._sums: list[Tensor | None] = [None] * len(params)  # float32 sums of micro-batch gradients (host)
        if annotate:
            self.inner = inner(params)
        else:
            self.kept_gradients = kept_gradients or ("all" if stream_gradients else "one")
            self._check_host_memory(params, self.kept_gradients)
            # Filled from the device weights at the first step (or by load_state_dict): nothing is copied when the
            # step is only traced for sizing, and weights loaded after the optimizer was built are the ones used.
            self.host = [nn.Parameter(torch.empty(p.shape, dtype=master_dtype(p.dtype))) for p in params]
            self._filled = False
            for h, p in zip(self.host, params):
                backends.pin_host_tensor_(h, p.device)
            self.inner = inner(self.host)
            if stream_gradients:
                self.stream = GradientStream(params, [h.dtype for h in self.host], shared, overlap)
                self.stream.on_whole = lambda i: self._step_one(i, self._taken(i))
        self.defaults = self.inner.defaults
        self.param_groups = self.inner.param_groups  # schedulers and set_lr reach the inner groups
        self.state = self.inner.state
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}

    @staticmethod
    def _check_host_memory(params: list[nn.Parameter], kept: str) -> None:
        """Raise :class:`HostMemoryError` before anything is allocated where the host cannot hold the masters, two
        moments per weight (AdamW's) and the gradients the step keeps there at once (``kept``: ``"one"``, the
        largest in float32; ``"all"``, every one in the device's dtype (streamed, waiting for a global norm);
        ``"sums"``, every one in float32 (summed over micro-batches)). Parameters without data (meta, fake:
        sizing) are not checked; ``kept_gradients`` of the constructor says which (default: ``"all"`` when
        streamed, else ``"one"``)."""
        from torch._subclasses.fake_tensor import FakeTensor

        if not params or isinstance(params[0], FakeTensor) or not backends.backend_for(params[0].device).holds_data:
            return
        available = backends.host_memory_available()
        if available is None:
            return
        sizes = [(p.numel(), master_dtype(p.dtype).itemsize, p.element_size()) for p in params]
        masters = sum(n * size for n, size, _ in sizes)
        largest = max(n * size for n, size, _ in sizes)
        gradients = {
            "one": largest,
            "all": sum(n * own for n, _, own in sizes) + largest,
            "sums": masters,
        }[kept]
        parts = {"float32 master weights": masters, "optimizer state": 2 * masters, "gradients": gradients}
        needed = sum(parts.values())
        if needed > available:
            raise HostMemoryError(needed, available, parts)

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
        if self.stream is not None:
            self.stream.keep = sent
        try:
            yield sent
        finally:
            self._deferred.pop()
            if self.stream is not None:
                self.stream.keep = None

    @contextlib.contextmanager
    def gradients_dropped(self) -> Iterator[None]:
        """Within the block streamed gradients are freed on the device and not sent (what an eager device holds
        of them, sized on fake tensors: :func:`revlib_xla.fit.gpu.estimate_step`); and :meth:`step` does
        nothing."""
        if self.stream is None:
            with self.device_part_only():
                yield
            return
        self.stream.drop = True
        try:
            with self.device_part_only():
                self.stream.keep = None
                yield
        finally:
            self.stream.drop = False

    def host_state_bytes(self) -> int:
        """Host bytes of the master weights and the optimizer state (AdamW: two moments per weight, four with
        amsgrad's maximum), whether or not a step has created the state yet. The step adds one weight's gradient
        in the master's dtype at a time (the largest: :meth:`host_step_bytes`)."""
        if self.annotate:
            return 0
        moments = 3 if self.defaults.get("amsgrad") else 2
        return sum(h.numel() * h.element_size() * (1 + moments) for h in self.host)

    def host_step_bytes(self) -> int:
        """Host bytes the step needs beside :meth:`host_state_bytes`: the gradients it keeps there at once (see
        :meth:`_check_host_memory`: the largest weight's in the master's dtype, as the weights are stepped one at
        a time; every streamed one in the device's dtype while a global norm is awaited; float32 sums of every
        one over micro-batches)."""
        host = getattr(self, "host", [])
        largest = max((h.numel() * h.element_size() for h in host), default=0)
        kept = getattr(self, "kept_gradients", "one")
        if kept == "sums":
            return sum(h.numel() * h.element_size() for h in host)
        if kept == "all":
            return sum(p.numel() * p.element_size() for p in self.device_params) + largest
        return largest

    @property
    def gradients_on_host(self) -> bool:
        """Whether the step's gradients are on the host before it (streamed, or summed there over micro-batches):
        clipping must then go through :meth:`clip_grad_norm_`."""
        return self.stream is not None or self.accumulates_on_host

    def backward_starts(self, final: bool) -> None:
        """Say what the next backward is: ``final`` when its gradients are the step's whole (the last micro-batch)
        and the step needs nothing of them all first (no global-norm clipping, no non-finite check): streamed
        gradients are then stepped as they arrive. Nothing without streamed gradients."""
        if self.stream is not None:
            self.stream.final = final

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
        if self.stream is not None:  # the hooks summed them on the host already
            self.stream.wait()
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
        if self.stream is not None:
            return self._streamed_norm(max_norm)
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
    def _streamed_norm(self, max_norm: float) -> Tensor:
        """torch's ``clip_grad_norm_`` (its own: torch_xla replaces it with one that rounds differently) over the
        streamed gradients, each widened to its master's dtype one at a
        time (the host never holds a second set): the norm of the per-weight norms; the factor is applied as
        :meth:`step` widens each gradient again, the same multiplication torch makes in place."""
        assert self.stream is not None
        self.stream.wait()
        # torch's per-tensor norm kernel (clip_grad_norm_'s on cpu and cuda), one widened gradient at a time
        grads = zip(self.stream.grads, self.stream.dtypes)
        norms = [torch._foreach_norm([g.to(d)], 2.0)[0] for g, d in grads if g is not None]
        if not norms:
            return torch.tensor(0.0)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        self._coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return total

    def _taken(self, i: int) -> Tensor | None:
        assert self.stream is not None
        grad = self.stream.take(i)
        if grad is not None and self._coef is not None:
            grad.mul_(self._coef)
        return grad

    @torch.no_grad()
    def _step_one(self, i: int, grad: Tensor | None) -> None:
        """Step weight ``i`` on the host with ``grad`` (its master's dtype) and copy it back to the device."""
        if grad is None:
            return
        if not self._filled:
            self._copy_from_device()
        h, p = self.host[i], self.device_params[i]
        h.grad = grad
        self.inner.step()
        h.grad = None
        p.copy_(h, non_blocking=False)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.stream is not None and not self._deferred:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self.stream.wait()
            self.stream.final = False
            for i in range(len(self.device_params)):
                self._step_one(i, self._taken(i))
            self._coef = None
            return loss
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
        self._coef = None
        if self.stream is not None:
            self.stream.clear()
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
