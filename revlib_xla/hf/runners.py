"""What a converted layer stack runs in place of its layers (:func:`revlib_xla.hf.convert.memory_efficient`): one
runner per strategy, called by the stack as ``runner(hidden, *layer_args, **layer_kwargs)``.

* :class:`Planned` (``plan``): the layers as the stages of a :class:`revlib_xla.Checkpointable` sized for layers of
  one class (:class:`LayerCheckpointable`, with the LM head and loss counted: :class:`HeadBytes`);
* :class:`Momentum` (``momentum``): an exact momentum stack over the layers' residual branches;
* :class:`TwoStream` (``reversible``): a two-stream :class:`revlib_xla.ReversibleSequential` over each layer's
  attention and MLP branches.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
from torch import nn

from .. import backends
from .._tree import detached, tree_leaves
from ..planner import Chain
from ..planner.checkpointable import Checkpointable, _signature, agreed_chain
from ..planner.sizing import measure_chain
from ..reversible import ReversibleSequential
from ..reversible.exact_momentum import ExactMomentumStack, reference_values
from ..units import parse_bytes
from . import head as _head
from .call_args import _cache_type, _capturing_outputs, _without_cache
from .layers import Branches, HFConversionError

__all__ = ["Runner", "HeadBytes", "LayerCheckpointable", "Planned", "Momentum", "TwoStream", "run_forward_hooks"]


class _Call:
    """A layer call's arguments after the hidden state, carried through the planner's stages as one opaque value
    (torch.utils._pytree does not open it: the masks and rotary tables in it are constants of the call)."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.args = args
        self.kwargs = kwargs
        self.returns_tuple = False


class _Stage(nn.Module):
    """One layer as a planner stage: ``(hidden, call) -> (layer(hidden, *call.args, **call.kwargs), call)``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: tuple[torch.Tensor, _Call]) -> tuple[torch.Tensor, _Call]:
        hidden, call = x
        out = self.layer(hidden, *call.args, **call.kwargs)
        call.returns_tuple = isinstance(out, tuple)
        return (out[0] if isinstance(out, tuple) else out), call


class Runner:
    """What the stack calls in place of its layers: ``runner(hidden, *layer_args, **layer_kwargs)``."""

    strategy = ""

    def takes_over(self, layers: nn.Module) -> bool:
        """Whether this forward runs through the runner (else the stack iterates the plain layers)."""
        return True

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def _check_arguments(strategy: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse layer arguments that need gradients: the runner treats them as constants of the call."""
    named = [(f"positional argument {j + 1} after the hidden state", a) for j, a in enumerate(args)]
    named += [(f"keyword argument '{k}'", v) for k, v in kwargs.items()]
    for where, value in named:
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(value)):
            raise HFConversionError(
                f"strategy={strategy!r}: the layers' {where} requires grad (e.g. trainable encoder states for "
                f"cross-attention); revlib_xla.hf passes layer arguments as constants of the call. Detach it, or "
                f"leave this model unconverted"
            )


def _repeated(one: Chain, n: int) -> Chain:
    """The chain of ``n`` copies of a one-stage chain whose output is the size of its input (a layer)."""
    return one.replace(
        fw=one.fw * n,
        bw=one.bw[:1] * n + one.bw[1:],
        cw=one.cw[:1] * n + one.cw[1:],
        cbw=one.cbw[:1] + one.cbw[1:] * n,
        fwd_tmp=one.fwd_tmp * n,
        bwd_tmp=one.bwd_tmp[:1] * n + one.bwd_tmp[1:],
        reversible=one.reversible * n,
        inverse_time=one.inverse_time * n,
        offload_time=one.offload_time * n,
        options=one.options * n,
        names=one.names * n,
        grad_fwd_tmp=None if one.grad_fwd_tmp is None else one.grad_fwd_tmp * n,
        stopped_fw=one.stopped_fw * n,
        caches=one.caches * n,
    )


def _same_shapes(layers: list[nn.Module]) -> bool:
    shapes = [[(t.shape, t.dtype) for t in (*layer.parameters(), *layer.buffers())] for layer in layers]
    return all(s == shapes[0] for s in shapes)


@dataclasses.dataclass(frozen=True)
class HeadBytes:
    """What a model's LM head and loss hold at once for a number of tokens, above the stack's output: the logits
    (kept in the model's output) and, with transformers' loss, the float32 log-probabilities the cross entropy
    saves, their gradient and the logits' gradient; with the chunked loss (:mod:`revlib_xla.hf.head`), the head
    input's gradient, the float32 sum of the weight's gradient (and a chunk's product in a lower precision) and one
    chunk's float32 tensors instead."""

    vocab: int = 0
    hidden: int = 0
    element_size: int = 4  # the head's dtype; the loss works in float32 (transformers upcasts)
    chunked: bool = False
    always: bool = False  # chunked for every batch, not only where it holds less (chunking_pays)
    tied: bool = False  # the head's weight is the input embedding's
    embedding: int = 0  # bytes of the input embedding's weight, where it gets a gradient

    @classmethod
    def of(cls, model: nn.Module, chunked: bool, always: bool = False) -> HeadBytes:
        """The model's output embedding's sizes; nothing for a model without one (a bare encoder)."""
        weight = getattr(_head.output_head(model), "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            return cls()
        get_input = getattr(model, "get_input_embeddings", None)
        embedding = getattr(get_input() if callable(get_input) else None, "weight", None)
        tied = embedding is weight
        size = (
            embedding.numel() * embedding.element_size()
            if isinstance(embedding, torch.Tensor) and embedding.requires_grad
            else 0
        )
        return cls(weight.shape[0], weight.shape[1], weight.element_size(), chunked, always, tied, size)

    def embedding_backward(self, hidden_bytes: int) -> int:
        """Bytes the input embedding's backward holds, after the layers', given the bytes of its output (the
        layers' input) ``hidden_bytes``: its dense weight gradient beside that output and its gradient, and, tied,
        the head's gradient waiting beside them (:meth:`held_gradient`), then the two gradients' sum. At
        Llama-3.2-1B's vocabulary in float32 that is 2.9 GiB, above every plan's peak of a 1 x 512 step: no budget
        below it holds."""
        if not self.tied:
            return self.embedding + 2 * hidden_bytes if self.embedding else 0
        return max(2 * self.embedding + 2 * hidden_bytes, 3 * self.embedding)

    def held_gradient(self) -> int:
        """Bytes held through the whole backward of the layers: a tied head's weight gradient. Autograd sums the
        two gradients of a weight used twice before accumulating it, so the head's (computed first) waits in the
        engine's buffer until the input embedding's backward, after every layer's (Llama-3.2-1B in bfloat16:
        0.5 GiB, which the plan at real width overshot its budget by)."""
        return self.vocab * self.hidden * self.element_size if self.tied else 0

    def __call__(self, tokens: int) -> int:
        pays = self.always or _head.chunking_pays(tokens, self.hidden, self.vocab, self.element_size)
        if self.chunked and pays:
            # The loss's backward holds the float32 sum of the weight's gradient and its scaled copy in the weight's
            # dtype: for a tied head, the gradient counted by held_gradient (see losses._scaled_into).
            weight_grad = self.vocab * self.hidden * (4 + (0 if self.tied else self.element_size))
            chunk = _head.chunk_bytes(tokens, self.hidden, self.vocab) + weight_grad
            return tokens * (self.vocab + self.hidden) * self.element_size + chunk
        # transformers' loss: its backward's float32 tensors beside the logits and their gradient, then the head's
        # weight gradient beside the logits' gradient; a tied head's is the gradient held_gradient counts from then
        weight = self.vocab * self.hidden * self.element_size
        logits = tokens * self.vocab * self.element_size
        return max(0, max(tokens * self.vocab * 8 + 2 * logits, 2 * logits + weight) - self.held_gradient())


class LayerCheckpointable(Checkpointable):
    """A Checkpointable over layers of one class with the same shapes: they cost the same, so the first is
    measured and its costs repeated (a 32-layer model is measured in the time of one layer).

    ``head``: the bytes the LM head and loss hold at once for a number of tokens (:class:`HeadBytes`), the
    chain's loss stage: the loss runs while the chain holds what its schedule keeps at its end (a last layer's
    saved activations, say), so a plan that ignored the head would peak above its budget there."""

    def __init__(self, stages: nn.Sequential, mem_limit: float | None, head: HeadBytes = HeadBytes()) -> None:
        super().__init__(stages, mem_limit=mem_limit)
        self.head = head

    def held_during_backward(self) -> float:
        """Checkpointable's (the output and its gradient), a tied head's weight gradient
        (:meth:`HeadBytes.held_gradient`) and the tensors the layers are called with (the causal mask, the rotary
        tables, the positions: the run holds its input until its backward ends, after the embedding's backward)."""
        return super().held_during_backward() + self.head.held_gradient() + self.call_bytes

    call_bytes = 0  # bytes of the tensors in the layers' call (_Call), set by measure
    plan_state = (*Checkpointable.plan_state, "call_bytes", "loss_tmp_memory_usage")

    def after_layers(self) -> float:
        """The least budget the step needs whatever the schedule: the input embedding's backward after the
        layers' (:meth:`HeadBytes.embedding_backward`)."""
        # and the loss and its gradient, alive through the whole backward: two float32 scalars, each one allocation
        # of the device's granularity (512 bytes on cuda)
        device = next((p.device for p in self.parameters()), torch.device("cpu"))
        unit = backends.backend_for(device).allocation_granularity
        scalars = 2 * -(-4 // unit) * unit
        return float(self.head.embedding_backward(int(self._need_chain("after_layers").cw[0])) + scalars)

    def min_memory(self) -> float:
        return max(super().min_memory(), self.after_layers())

    def no_checkpoint_memory(self) -> float:
        return max(super().no_checkpoint_memory(), self.after_layers())

    def get_expected_memory(self) -> float:
        return max(super().get_expected_memory(), self.after_layers())

    def compute_sequence(self, mem_limit: float | str | None = None, mem_slots: int | None = None) -> Any:
        from ..planner import InfeasibleBudget

        if mem_limit is not None or self.mem_limit is not None:
            limit = parse_bytes(mem_limit if mem_limit is not None else cast(float, self.mem_limit), "budget")
            if limit < self.after_layers():
                raise InfeasibleBudget(
                    f"memory_efficient: budget {limit:.6g} bytes is below what the step holds after its layers "
                    f"(the input embedding's backward: {self.after_layers():.6g} bytes); pass a larger budget",
                    self.after_layers(),
                )
        return super().compute_sequence(mem_limit, mem_slots)

    def measure(self, sample_input: Any) -> Chain:
        hidden, call = sample_input
        tensors = [t for t in tree_leaves((call.args, call.kwargs)) if isinstance(t, torch.Tensor)]
        storages = {
            id(t.untyped_storage()): (t.untyped_storage().nbytes(), backends.backend_for(t).allocation_granularity)
            for t in tensors
            if not backends.is_tracing_lazily(t)  # XLA: no storage; the compiled program's sizes stand for them
        }
        self.call_bytes = sum(-(-size // unit) * unit for size, unit in storages.values())
        self.loss_tmp_memory_usage = self.head(hidden.numel() // max(hidden.shape[-1], 1))
        layers = [cast(_Stage, stage).layer for stage in self.stages]
        if not _same_shapes(layers) or len(self.stages) == 1:
            return super().measure(sample_input)
        n = len(self.stages)
        measured = measure_chain(self.stages[:1], sample_input, {}, self.sizing())
        if measured.chain.cw[0] != measured.chain.cw[1]:
            return super().measure(sample_input)
        self.measurements = measured.measurements * n
        self.chain = agreed_chain(_repeated(measured.chain, n))  # every process plans from the first's
        self._signature = _signature(sample_input)
        self._sample = detached(sample_input) if measured.lazy else None
        self.sequence = None
        return self.chain


class Planned(Runner):
    strategy = "plan"

    def __init__(self, layers: list[nn.Module], budget: float | None, head: HeadBytes = HeadBytes()) -> None:
        stages = nn.Sequential(*[_Stage(layer) for layer in layers])
        self.checkpointable = LayerCheckpointable(stages, budget, head)

    def takes_over(self, layers: nn.Module) -> bool:
        return layers.training and torch.is_grad_enabled() and not _capturing_outputs()

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = _without_cache(args, kwargs, self.strategy)
        _check_arguments(self.strategy, args, kwargs)
        self.checkpointable.train(True)
        out, call = self.checkpointable((hidden, _Call(args, kwargs)))
        return (out,) if call.returns_tuple else out


class Residual(nn.Module):
    """A layer's residual branch ``f(x) = layer(x) - x``, through ``layer.forward`` (the layer's own forward hooks,
    e.g. transformers' output recorders, see the merged stream instead: :meth:`TwoStream._plain`)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer  # registered here, in a stack that the model does not register
        self.returns_tuple = False  # whether the layer's forward returned a tuple, at the last call

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.layer.forward(x, *args, **kwargs)
        self.returns_tuple = isinstance(out, tuple)
        return (out[0] if isinstance(out, tuple) else out) - x


class Momentum(Runner):
    """The layers as an exact momentum stack (:class:`revlib_xla.reversible.exact_momentum.ExactMomentumStack` over
    their residual branches): the original function up to ``beta`` times the change of the residual from one layer to
    the next, ``bits`` bits per element per layer for the backward."""

    strategy = "momentum"

    def __init__(self, layers: list[nn.Module], beta: float) -> None:
        self.layers = layers
        self.residuals = [Residual(layer) for layer in layers]
        self.stack = ExactMomentumStack(self.residuals, beta=beta)
        self.returns_tuple = False

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        training = self.layers[0].training
        self.stack.train(training)
        if training and torch.is_grad_enabled() and not _capturing_outputs():
            args, kwargs = _without_cache(args, kwargs, self.strategy)
            _check_arguments(self.strategy, args, kwargs)
            out = self.stack(hidden, *args, **kwargs)
        else:
            out = self._layer_by_layer(hidden, args, kwargs)
        self.returns_tuple = self.residuals[0].returns_tuple
        return (out,) if self.returns_tuple else out

    def _layer_by_layer(self, hidden: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """The same function, layer by layer with plain autograd (or none): generation writes the KV cache once, and
        each layer's forward hooks (transformers' ``output_hidden_states`` recorder) see the stack's value before and
        after it."""
        if torch.is_grad_enabled():
            values = reference_values(self.stack, hidden, *args, **kwargs)
        else:
            values = self.stack.layer_values(hidden, args, kwargs)
        before = next(values)
        for layer, after in zip(self.layers, values):
            run_forward_hooks(layer, before, after)
            before = after
        return before


class TwoStream(Runner):
    """A reversible stack: ``net`` (a ReversibleSequential, two blocks per layer) on the streams
    ``(hidden, hidden)``; :meth:`merge` turns the streams after ``k`` layers into the hidden state."""

    def __init__(self, strategy: str, layers: list[nn.Module], net: ReversibleSequential) -> None:
        self.strategy = strategy
        self.layers = layers
        self.net = net
        self.branches = [Branches.of(layer) for layer in layers]
        self.checked = False
        # The stack's own convention, returned alike: layers that return a tuple (GPT-J's, and some architectures
        # in older transformers) are read as ``outputs[0]`` by their stack. Reversible learns it from the split
        # check's call of the first layer, momentum from each call of a layer's residual branch.
        self.returns_tuple = False
        self.residuals = [m for m in net.modules() if isinstance(m, Residual)]

    def merge(self, x0: torch.Tensor, x1: torch.Tensor, k: int) -> torch.Tensor:
        return (x0 + x1) / 2

    def __call__(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.net.train(self.layers[0].training)
        # (fake tensors, sizing under FakeTensorMode, have no values to check: the first real forward checks)
        if self.branches and not self.checked and not self._holds_tokens(args, kwargs) and backends.holds_data(hidden):
            self._check_split(hidden, args, kwargs)
        if self.layers[0].training and torch.is_grad_enabled() and not _capturing_outputs():
            args, kwargs = _without_cache(args, kwargs, self.strategy)
            _check_arguments(self.strategy, args, kwargs)
            x0, x1 = self.net((hidden, hidden), *args, **kwargs)
            out = self.merge(x0, x1, len(self.layers))
        else:
            out = self._plain(hidden, args, kwargs)
        if self.residuals:
            self.returns_tuple = self.residuals[0].returns_tuple
        return (out,) if self.returns_tuple else out

    @staticmethod
    def _holds_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        cache_type = _cache_type()
        if cache_type is None:
            return False
        caches: list[Any] = [v for v in tree_leaves((args, kwargs)) if isinstance(v, cache_type)]
        return any(cache.get_seq_length() > 0 for cache in caches)

    def _check_split(self, hidden: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The first call checks that the first layer's branches rebuild its forward (no cache written)."""
        cache_type = _cache_type()

        def clean(value: Any) -> Any:
            return None if cache_type is not None and isinstance(value, cache_type) else value

        a = tuple(clean(v) for v in args)
        k = {key: clean(v) for key, v in kwargs.items()}
        if "use_cache" in k:
            k["use_cache"] = False

        def call(layer: nn.Module, x: torch.Tensor) -> Any:
            out = layer.forward(x, *a, **k)
            self.returns_tuple = isinstance(out, tuple)
            return out

        self.branches[0].check(hidden.detach(), call, *a, **k)
        self.checked = True

    def _plain(self, hidden: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """The same function, block by block with plain autograd (or none): generation writes the KV cache once,
        and each layer's forward hooks (transformers' ``output_hidden_states`` recorder) see the hidden state
        before and after it."""
        walk = self.net.layer_walk(hidden, hidden)  # the net's own function, exact streams included
        for k, layer in enumerate(self.layers):
            before = self.merge(*walk.streams(), k)
            for i in (2 * k, 2 * k + 1):  # each layer's two blocks, with plain autograd
                walk.layer(i, *args, **kwargs)
            run_forward_hooks(layer, before, self.merge(*walk.streams(), k + 1))
        return self.merge(*walk.streams(), len(self.layers))


def run_forward_hooks(layer: nn.Module, before: torch.Tensor, after: torch.Tensor) -> None:
    hooks = getattr(layer, "_forward_hooks", {})
    with_kwargs = getattr(layer, "_forward_hooks_with_kwargs", {})
    for key, hook in list(hooks.items()):
        if with_kwargs.get(key, False):
            hook(layer, (before,), {}, after)
        else:
            hook(layer, (before,), after)
