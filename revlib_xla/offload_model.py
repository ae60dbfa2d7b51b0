"""fairscale's ``OffloadModel`` (0.4.13 API and semantics), with its defects fixed.

A sequential model is cut into slices of about equal parameter count. All parameters and buffers stay on
``offload_device``; each slice's tensors are streamed to ``device`` for its forward and again for its backward
(:class:`revlib_xla.ParameterStreamer`: one slice in use and the next one in flight, at most two on the device),
and gradients accumulate on the offloaded parameters, where the optimizer steps them.

What differs from fairscale, and why (each is a test in ``tests/offload/test_offload_model.py``):

* No module state per call: boundary activations live in the autograd graph (or in the checkpoint Function's
  context), never on the module, so two forwards before one backward each keep their own.
* Without checkpointing, the tensors autograd saves that are the slice's parameter copies are stored as
  references to the host parameters and fetched again in the backward (fairscale's graph kept every slice's
  device weights alive).
* Copies are ordered with events on cuda (fairscale used side streams without synchronization); a checkpointed
  slice's recomputation draws the random numbers of its forward on the cpu and on the device (fairscale replayed
  only the CPU's), from generators of its own, also while other threads draw (see :mod:`revlib_xla.recompute`),
  and sees the buffer values its forward saw (``spectral_norm``, running statistics).
* Micro-batches split every tensor input along dim 0 and concatenate every tensor output (multi-tensor
  activations), without squeezing a trailing size-1 dimension; they work with and without checkpointing.
* It runs on cuda, on xla, and on the cpu (``device == offload_device``: a functional fallback with real copies).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from . import backends
from .offload import ParameterStreamer
from .recompute import CallReplay, RecomputeState, SavedBuffers, owned_buffers

__all__ = ["OffloadModel", "OffloadModelError", "split_by_parameters"]

Tensor = torch.Tensor


class OffloadModelError(TypeError, ValueError):
    """OffloadModel was given input it cannot handle; the message says what and where. A ``TypeError`` (what
    fairscale raised for a wrong model type) and a ``ValueError``."""


def split_by_parameters(modules: Sequence[nn.Module], num_slices: int) -> list[list[nn.Module]]:
    """Consecutive groups of ``modules`` (at most ``num_slices``, none empty) of about equal parameter count: a new
    group starts when adding the next module would pass the per-slice share."""
    num_slices = max(1, min(num_slices, len(modules)))
    counts = [sum(p.numel() for p in m.parameters()) for m in modules]
    share = sum(counts) / num_slices
    groups: list[list[nn.Module]] = [[]]
    current = 0
    for i, (m, n) in enumerate(zip(modules, counts)):
        remaining_modules = len(modules) - i
        remaining_groups = num_slices - len(groups)
        if groups[-1] and remaining_groups > 0 and (current + n > share or remaining_modules <= remaining_groups):
            groups.append([])
            current = 0
        groups[-1].append(m)
        current += n
    return groups


# ----------------------------------------------------------------------------------------------------------------
# Micro-batches


def _as_device(device: backends.DeviceLike, argument: str) -> torch.device:
    """``device`` (a device, its name, or a tensor standing for its device) as a ``torch.device``."""
    if isinstance(device, Tensor):
        return device.device
    if device is None:
        raise OffloadModelError(f"OffloadModel: `{argument}` is None; give a device (e.g. 'cpu')")
    return torch.device(device)


def _batch_size(inputs: Sequence[Any]) -> int | None:
    sizes = {t.shape[0] for t in inputs if isinstance(t, Tensor) and t.dim() > 0}
    if len(sizes) > 1:
        raise OffloadModelError(
            f"OffloadModel: micro-batching splits every tensor input along dim 0, but the inputs "
            f"have different sizes there: {sorted(sizes)}"
        )
    return sizes.pop() if sizes else None


def _micro_batches(inputs: Sequence[Any], n: int) -> list[tuple[Any, ...]]:
    if n == 1:
        return [tuple(inputs)]
    parts = [t.tensor_split(n) if isinstance(t, Tensor) and t.dim() > 0 else [t] * n for t in inputs]
    return [tuple(p[k] for p in parts) for k in range(n)]


def _as_tuple(out: Any, where: str) -> tuple[Tensor, ...]:
    out = out if isinstance(out, tuple) else (out,)
    if not all(isinstance(t, Tensor) for t in out):
        raise OffloadModelError(
            f"OffloadModel: {where} returned {[type(t).__name__ for t in out]}; a slice must "
            f"return a tensor or a tuple of tensors (they are the next slice's inputs)"
        )
    return out


def _join(outs: list[tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    if len(outs) == 1:
        return outs[0]
    return tuple(torch.cat(parts, 0) for parts in zip(*outs))


# ----------------------------------------------------------------------------------------------------------------
# Autograd pieces


class _Attach(torch.autograd.Function):
    """A device copy standing for a host tensor: its gradient goes to the host tensor."""

    @staticmethod
    def forward(ctx: Any, host: Tensor, copy: Tensor) -> Tensor:
        ctx.host_device = host.device
        return copy.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        backends.cut_graph(grad)
        return backends.to_host_blocking(grad, ctx.host_device), None


class _Boundary(torch.autograd.Function):
    """Identity on a slice's inputs (``entering``) or outputs; its backward releases (entering) or fetches the
    slice's tensors, so the slice's backward runs with its parameters on the device and no longer."""

    @staticmethod
    def forward(ctx: Any, owner: OffloadModel, index: int, entering: bool, dummy: Tensor, *acts: Tensor) -> Any:
        ctx.owner, ctx.index, ctx.entering = owner, index, entering
        out = tuple(a.detach() for a in acts)
        ctx.mark_non_differentiable(*(o for o in out if not (o.is_floating_point() or o.is_complex())))
        return out

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        streamer = ctx.owner._streamer
        if ctx.entering:
            streamer.release(ctx.index)
            if ctx.index == 0:
                streamer.release_all()
        else:
            streamer.fetch(ctx.index, prefetch=ctx.index - 1, persistent=False)
            if ctx.index == 0:
                # The first slice's entering boundary gets no gradient when the model's inputs are not
                # differentiable (token ids): end the pass when the whole backward has finished instead, so that no
                # copy made before the optimizer step is reused by the next forward.
                _at_end_of_backward(streamer.release_all)
        return (None, None, None, None) + grads


def _at_end_of_backward(callback: Any) -> None:
    """Run ``callback`` once the running backward pass has finished (autograd's engine callback queue)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:  # pragma: no cover - torch without the engine's callback queue
        callback()
        return
    queue(callback)


class _CheckpointedSlice(torch.autograd.Function):
    """One slice with activation checkpointing: the forward runs without autograd and keeps only the slice's
    inputs (on ``offload_device``), its seed and the values of the buffers it changed; the backward streams the
    slice in again, recomputes it as its forward ran (:mod:`revlib_xla.recompute`) and differentiates it."""

    @staticmethod
    def forward(ctx: Any, owner: OffloadModel, index: int, call: CallReplay, n_acts: int, *flat: Tensor) -> Any:
        acts = flat[:n_acts]
        ctx.owner, ctx.index, ctx.call, ctx.n_acts = owner, index, call, n_acts
        with torch.no_grad():
            outs, ctx.saved_buffers = owner._run_slice(index, acts, prefetch=index + 1, call=call)
        ctx.save_for_backward(*(a.to(owner.offload_device) for a in acts))
        ctx.act_devices = [a.device for a in acts]
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        owner: OffloadModel = ctx.owner
        saved = ctx.saved_tensors
        acts = [s.to(d) for s, d in zip(saved, ctx.act_devices)]
        leaves = [a.detach().requires_grad_(a.is_floating_point()) for a in acts]
        host = owner._slice_tensors[ctx.index]
        call: CallReplay = ctx.call
        # The recomputation replays the forward's random numbers and autocast state; the gradient is taken in the
        # ambient autocast state, as plain autograd takes it (the reversible core and Checkpointable do the same).
        with torch.enable_grad(), call.scope(replay=True) as reseed:
            reseed(call.unit_seed(ctx.index))
            copies = list(owner._streamer.fetch(ctx.index, prefetch=ctx.index - 1))
            if ctx.saved_buffers is not None:  # the copies are scratch: nothing to put back afterwards
                ctx.saved_buffers.swap_in(owner._buffers_of(ctx.index, copies))
            trainable = [k for k, t in enumerate(host) if t.requires_grad]
            for k in trainable:
                copies[k] = copies[k].detach().requires_grad_()
            param_grads: list[Tensor | None] = [None] * len(host)
            act_grads: list[list[Tensor | None]] = []
            mbs = _micro_batches(leaves, owner._num_microbatches)
            grad_mbs = _micro_batches(grads, owner._num_microbatches)
            for mb, gmb in zip(mbs, grad_mbs):
                with call.autocast.replay():
                    outs = owner._call(ctx.index, copies, mb)
                pairs = [(o, g) for o, g in zip(outs, gmb) if o.requires_grad and g is not None]
                wrt = [t for t in mb if t.requires_grad] + [copies[k] for k in trainable]
                got = (
                    torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
                    if pairs
                    else [None] * len(wrt)
                )
                it = iter(got)
                act_grads.append([next(it) if t.requires_grad else None for t in mb])
                for k in trainable:
                    g = next(it)
                    if g is not None:
                        so_far = param_grads[k]
                        param_grads[k] = g if so_far is None else so_far + g
            del copies, outs, mbs
        owner._streamer.release(ctx.index)
        if ctx.index == 0:
            owner._streamer.release_all()
        backends.cut_graph(owner.device)
        input_grads: list[Tensor | None] = []
        for j in range(ctx.n_acts):
            parts = [g for mb in act_grads if (g := mb[j]) is not None]
            whole = len(parts) == len(act_grads)  # every micro-batch has a gradient for this input
            input_grads.append(None if not whole else (parts[0] if len(parts) == 1 else torch.cat(parts, 0)))
        host_grads = [None if g is None else backends.to_host_blocking(g, h.device) for g, h in zip(param_grads, host)]
        return (None, None, None, None, *input_grads, *host_grads)


# ----------------------------------------------------------------------------------------------------------------


class OffloadModel(nn.Module):
    """Train a sequential model whose parameters live on ``offload_device`` (the host), streaming one slice at a
    time to ``device``; fairscale's ``OffloadModel`` API.

    Args:
        model: an ``nn.Sequential`` (cut into ``num_slices`` slices of about equal parameter count) or a list of
            modules, taken as pre-made slices. Each slice gets the previous one's outputs as positional inputs (a
            tuple output gives several) and must return a tensor or a tuple of tensors.
        device: where the computation runs (cuda, xla, or cpu).
        offload_device: where parameters, buffers, gradients and the optimizer state live.
        num_slices: how many slices an ``nn.Sequential`` is cut into (at most one per module).
        checkpoint_activation: keep only each slice's inputs (on ``offload_device``) and recompute the slice in the
            backward; without it, the slices' activations stay on ``device`` in the autograd graph.
        num_microbatches: run each slice on this many pieces of the batch (dim 0 of every tensor input) in turn.

    Parameters are moved to ``offload_device`` at construction; build the optimizer on ``model.parameters()``
    afterwards (or before: the Parameter objects are kept).
    """

    def __init__(
        self,
        model: nn.Sequential | Sequence[nn.Module],
        device: backends.DeviceLike,
        offload_device: backends.DeviceLike = "cpu",
        num_slices: int = 3,
        checkpoint_activation: bool = False,
        num_microbatches: int = 1,
    ):
        super().__init__()
        if model is None:
            raise OffloadModelError("OffloadModel: `model` is None")
        if device is None:
            raise OffloadModelError("OffloadModel: `device` is None; give the device the computation runs on")
        if isinstance(model, nn.Sequential):
            if len(model) == 0:
                raise OffloadModelError("OffloadModel: the nn.Sequential is empty")
            if not isinstance(num_slices, int) or num_slices < 1:
                raise OffloadModelError(f"OffloadModel: num_slices must be a positive int, got {num_slices!r}")
            slices = [nn.Sequential(*group) for group in split_by_parameters(list(model), num_slices)]
        elif isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
            slices = list(model)
        else:
            what = (
                type(model).__name__
                if not isinstance(model, (list, tuple))
                else f"a {type(model).__name__} of {[type(m).__name__ for m in model]}"
            )
            raise OffloadModelError(
                f"OffloadModel: `model` must be an nn.Sequential or a non-empty list of nn.Modules (pre-made "
                f"slices), got {what}. A model with its own forward cannot be cut into slices automatically: "
                f"write it as a sequence of modules, each taking the previous one's outputs"
            )
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise OffloadModelError(f"OffloadModel: num_microbatches must be a positive int, got {num_microbatches!r}")
        self.device = _as_device(device, "device")
        self.offload_device = _as_device(offload_device, "offload_device")
        self.model_slices = nn.ModuleList(slices)
        self.model_slices.to(self.offload_device)
        self._checkpoint_activation = checkpoint_activation
        self._num_microbatches = num_microbatches
        self._slice_tensors: list[list[Tensor]] = []
        self._slice_names: list[list[list[str]]] = []
        for s in self.model_slices:
            tensors: list[Tensor] = []
            names: list[list[str]] = []
            seen: dict[int, int] = {}
            for name, t in list(s.named_parameters(remove_duplicate=False)) + list(
                s.named_buffers(remove_duplicate=False)
            ):
                if id(t) not in seen:
                    seen[id(t)] = len(tensors)
                    tensors.append(t)
                    names.append([])
                names[seen[id(t)]].append(name)
            self._slice_tensors.append(tensors)
            self._slice_names.append(names)
        self._buffer_ids = {id(b) for b in self.model_slices.buffers()}
        self._streamer = ParameterStreamer(self._slice_tensors, self.device)

    def __getstate__(self):
        """Copies and pickles leave the streamer behind (device buffers, cuda streams); see ``__setstate__``."""
        state = super().__getstate__()
        state["_streamer"] = None
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._streamer = ParameterStreamer(self._slice_tensors, self.device)

    @property
    def streamer(self) -> ParameterStreamer:
        """The parameter streamer (its ``max_resident`` says how many slices were on the device at once)."""
        return self._streamer

    # -- running one slice ------------------------------------------------------------------------------------------
    def _call(self, index: int, copies: Sequence[Tensor], inputs: Sequence[Any]) -> tuple[Tensor, ...]:
        mapping = {name: t for names, t in zip(self._slice_names[index], copies) for name in names}
        out = torch.func.functional_call(self.model_slices[index], mapping, tuple(inputs))
        return _as_tuple(out, f"slice {index} ({type(self.model_slices[index]).__name__})")

    def _write_back_buffers(self, index: int, copies: Sequence[Tensor]) -> None:
        with torch.no_grad():
            for host, copy in zip(self._slice_tensors[index], copies):
                if id(host) in self._buffer_ids:
                    host.copy_(copy)

    def _buffers_of(self, index: int, copies: Sequence[Tensor]) -> list[Tensor]:
        """The device copies standing for slice ``index``'s buffers, in the order of :func:`owned_buffers`."""
        position = {id(t): k for k, t in enumerate(self._slice_tensors[index])}
        return [copies[position[id(b)]] for _, b in owned_buffers(self.model_slices[index].modules())]

    def _run_slice(
        self, index: int, inputs: Sequence[Any], prefetch: int, call: CallReplay | None = None
    ) -> tuple[tuple[Tensor, ...], SavedBuffers | None]:
        """Slice ``index`` on ``inputs`` (no autograd bookkeeping of parameters), micro-batched. With ``call`` (a
        checkpointed slice's first run): under the slice's random numbers, and returning the values its changed
        buffers had before (for the recomputation)."""
        copies = self._streamer.fetch(index, prefetch=prefetch)
        watch, saved = None, None
        if call is not None:
            state = RecomputeState.of(self)
            watch = state.watch(owned_buffers(self.model_slices[index].modules()), self._buffers_of(index, copies))
        with call.first_run(index) if call is not None else contextlib.nullcontext():
            outs = _join([self._call(index, copies, mb) for mb in _micro_batches(inputs, self._num_microbatches)])
        if call is not None:
            saved = state.changed(watch, f"OffloadModel slice {index}")
        backends.cut_graph(self.device)
        self._write_back_buffers(index, copies)
        del copies
        self._streamer.release(index)
        return outs, saved

    def _run_slice_with_graph(self, index: int, inputs: Sequence[Any]) -> tuple[Tensor, ...]:
        """Slice ``index`` under autograd without checkpointing: activations stay in the graph, parameter copies
        saved by it are replaced by references and fetched again in the backward."""
        streamer = self._streamer
        copies = list(streamer.fetch(index, prefetch=index + 1, persistent=False))
        host = self._slice_tensors[index]
        # Parameters must not change before the backward; buffers may (running statistics are written back after
        # the forward, and normalization's backward does not read them in training mode).
        versions = [None if id(t) in self._buffer_ids else t._version for t in host]
        storages = {
            c.untyped_storage().data_ptr(): k for k, c in enumerate(copies) if not backends.is_tracing_lazily(c)
        }
        for k, t in enumerate(host):
            if t.requires_grad:
                copies[k] = _Attach.apply(t, copies[k])

        def pack(t: Tensor) -> Any:
            if not backends.is_tracing_lazily(t):
                k = storages.get(t.untyped_storage().data_ptr())
                if k is not None:
                    return ("slice tensor", index, k, t.size(), t.stride(), t.storage_offset(), versions[k])
            return t

        def unpack(packed: Any) -> Tensor:
            if not (isinstance(packed, tuple) and packed and packed[0] == "slice tensor"):
                return packed
            _, i, k, size, stride, offset, version = packed
            if version is not None and self._slice_tensors[i][k]._version != version:
                raise RuntimeError(
                    f"OffloadModel: a parameter or buffer of slice {i} was modified in place between the forward "
                    f"and the backward (an optimizer step?); its gradient would be wrong. Step after backward()."
                )
            base = streamer.fetch(i, persistent=False)[k]
            return base.as_strided(size, stride, offset)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            outs = _join([self._call(index, copies, mb) for mb in _micro_batches(inputs, self._num_microbatches)])
        self._write_back_buffers(index, copies)
        del copies
        streamer.release(index)
        return outs

    # -- forward ----------------------------------------------------------------------------------------------------
    def forward(self, *inputs: Any) -> Any:
        batch = _batch_size(inputs)
        if self._num_microbatches > 1 and (batch is None or self._num_microbatches > batch):
            raise OffloadModelError(
                f"OffloadModel: num_microbatches={self._num_microbatches} is larger than the batch "
                f"({batch if batch is not None else 'no tensor input with a batch dimension'}); each micro-batch "
                f"needs at least one sample"
            )
        acts: tuple[Any, ...] = tuple(inputs)
        n = len(self.model_slices)
        if not torch.is_grad_enabled():
            for i in range(n):
                acts, _ = self._run_slice(i, acts, prefetch=i + 1)
            return acts if len(acts) > 1 else acts[0]
        dummy = torch.empty(0, requires_grad=True)  # makes every boundary's backward run
        call = CallReplay(self.device) if self._checkpoint_activation else None
        with (
            RecomputeState.of(self).python_random_check("OffloadModel")
            if call is not None
            else contextlib.nullcontext()
        ):
            return self._forward_slices(acts, call, dummy)

    def _forward_slices(self, acts: tuple[Any, ...], call: CallReplay | None, dummy: Tensor) -> Any:
        for i in range(len(self.model_slices)):
            if not all(isinstance(a, Tensor) for a in acts):
                raise OffloadModelError(
                    f"OffloadModel: slice {i} gets {[type(a).__name__ for a in acts]}; every "
                    f"input of a slice (and of the model) must be a tensor"
                )
            if call is not None:
                out = _CheckpointedSlice.apply(self, i, call, len(acts), *acts, *self._slice_tensors[i])
            else:
                out = _Boundary.apply(self, i, True, dummy, *acts)
                out = self._run_slice_with_graph(i, out if isinstance(out, tuple) else (out,))
                out = _Boundary.apply(self, i, False, dummy, *out)
            acts = out if isinstance(out, tuple) else (out,)
        return acts if len(acts) > 1 else acts[0]
