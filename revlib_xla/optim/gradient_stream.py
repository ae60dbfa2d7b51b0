"""Each weight's gradient sent to host memory as the backward pass produces it: the device never holds a full set
of gradients (:class:`GradientStream`, what ``HostOptimizer(stream_gradients=True)`` and
``strategy.offload.gradients`` use).

A post-accumulate-grad hook on every trainable parameter takes ``param.grad`` as soon as autograd has accumulated
it, frees it on the device (``param.grad = None``) and starts its copy to the host (cuda: into page-locked memory on
a side stream, :func:`revlib_xla.backends.to_host`; the device memory is released once the copy is done). On the
host the gradient is kept in the device's dtype (a bfloat16 gradient in 2 bytes per weight; widening it to float32
later is exact); a second part of the same gradient (a tied weight, the next micro-batch) starts a float32 sum, as
:meth:`HostOptimizer.accumulate` sums micro-batches. Where the backend copies asynchronously, a host thread takes
the copies as they complete (``overlap``), so the host's work runs beside the rest of the backward; elsewhere the
hook does it at once.

While :attr:`GradientStream.final` is set (the optimizer may step each weight as soon as its gradient is whole: the
last micro-batch, no global-norm clipping, no non-finite check), :attr:`GradientStream.on_whole` is called with the
weight's index once its gradient has arrived; weights whose gradient arrives in several parts (``shared``) wait
for :meth:`GradientStream.wait` instead.

Lazy devices (XLA) are refused: a hook there runs while the step is traced, before any gradient exists.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Collection, Sequence

import torch
from torch import Tensor, nn

from .. import backends

__all__ = ["GradientStream", "GradientStreamError"]


class GradientStreamError(RuntimeError):
    """A gradient could not be taken to the host (the host thread's error, re-raised where the step waits)."""


class GradientStream:
    """Post-accumulate-grad hooks that move ``params``' gradients to host memory (see the module docstring).

    ``dtypes``: each weight's host sum dtype (its float32 master's). ``shared``: ``id`` s of parameters whose
    gradient arrives in parts. ``overlap``: take the copies on a host thread (default: where the backend's copies
    to the host are asynchronous, cuda)."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        dtypes: Sequence[torch.dtype],
        shared: Collection[int] = (),
        overlap: bool | None = None,
    ) -> None:
        self.params = list(params)
        self.dtypes = list(dtypes)
        device = self.params[0].device if self.params else torch.device("cpu")
        if backends.backend_for(device).lazy:
            raise ValueError(
                f"gradient streaming (strategy.offload.gradients) takes each gradient when autograd accumulates it, "
                f"which on {device.type} happens while the step is traced, before any value exists; use "
                f"strategy.offload.optimizer=true without offload.gradients there (the host step brings the "
                f"gradients over after the backward)"
            )
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.whole_at_once = [id(p) not in shared for p in self.params]
        #: the host gradients (the device's dtype for one part, a float32 sum for several), by parameter index
        self.grads: list[Tensor | None] = [None] * len(self.params)
        self.final = False
        self.on_whole: Callable[[int], None] | None = None
        self.drop = False  # sizing an eager device's step: the gradient is freed, nothing sent
        self.keep: list[Tensor] | None = None  # sizing a traced step: the gradients collected, nothing sent
        self._error: BaseException | None = None
        asynchronous = backends.backend_for(device).device_copier(device).asynchronous
        self.overlap = asynchronous if overlap is None else overlap
        self._queue: queue.Queue[tuple[int, backends.HostCopy] | None] | None = None
        self._thread: threading.Thread | None = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._arrived) for p in self.params]

    # -- the device side (autograd's hooks) --------------------------------------------------------------------
    def _arrived(self, param: Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        param.grad = None
        if self.keep is not None:
            self.keep.append(grad)
            return
        if self.drop:
            return
        copy = backends.to_host(grad.detach())
        del grad
        i = self.index[id(param)]
        if not self.overlap:
            self._take(i, copy)
            return
        self._started().put((i, copy))

    def _started(self) -> queue.Queue[tuple[int, backends.HostCopy] | None]:
        if self._queue is None:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._work, name="revlib_xla gradient stream", daemon=True)
            self._thread.start()
            weakref.finalize(self, self._queue.put, None)  # the thread ends with the stream
        return self._queue

    # -- the host side -----------------------------------------------------------------------------------------
    def _work(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    self._take(*item)
            except BaseException as exc:  # re-raised by wait(), on the training thread
                self._error = exc
            finally:
                self._queue.task_done()

    @torch.no_grad()
    def _take(self, i: int, copy: backends.HostCopy) -> None:
        if copy.event is not None:
            copy.event.synchronize()
        grad = copy.tensor
        total = self.grads[i]
        if total is None:
            self.grads[i] = grad
        else:
            if total.dtype != self.dtypes[i]:
                total = total.to(self.dtypes[i])
            self.grads[i] = total.add_(grad)
        if self.final and self.whole_at_once[i] and self.on_whole is not None:
            self.on_whole(i)

    def wait(self) -> None:
        """Return once every gradient sent so far is on the host; raise what the host thread met."""
        if self._queue is not None:
            self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise GradientStreamError(f"a gradient could not be taken to the host: {error}") from error

    def take(self, i: int) -> Tensor | None:
        """The host gradient of parameter ``i`` in its master's dtype, and forget it (the tensor is the caller's
        to scale in place); ``None`` where none arrived."""
        grad, self.grads[i] = self.grads[i], None
        return None if grad is None else grad.to(self.dtypes[i])

    def clear(self) -> None:
        """Forget every gradient (``zero_grad``)."""
        self.wait()
        self.grads = [None] * len(self.params)

    def remove(self) -> None:
        """Remove the hooks and stop the host thread."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._queue is not None:
            self._queue.put(None)
            assert self._thread is not None
            self._thread.join()
            self._queue = self._thread = None
