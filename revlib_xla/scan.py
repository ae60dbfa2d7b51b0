"""Reversible sequences run as scans: one layer (or one repeating group of layers) compiled, whatever the depth.

On XLA an unrolled reversible step traces every layer into the graph, so compile time grows with depth (about 1 s
per layer on XLA:CPU, bench/results/xla_compile_time-xla-cpu.md). When the layers repeat (every layer like the
first, or every group of ``period`` layers like the first group: a RevNet block's F and G, Llama's attention and
MLP branches), :class:`revlib_xla.ReversibleSequential` runs them as two XLA while loops instead:

* forward: a scan, without autograd, over the layers' parameters and buffers stacked along a new leading
  dimension, carrying the two streams; one node over the whole sequence keeps only the final streams (memory O(1)
  in depth, as the unrolled walk);
* backward: a scan in reverse carrying ``(y0, y1, dy0, dy1)``; its body puts an optimization barrier over what it
  reads (no merging with the forward), rebuilds each layer's input, recomputes the layer with autograd and takes its
  vector-Jacobian product; the per-layer parameter gradients are the scan's outputs, unstacked into each parameter's
  gradient.

Stacking copies the parameters (and buffers) once per pass: a transient copy of the repeated layers' weights, as
torch_xla's ``scan_layers`` makes.

What was tried (torch 2.9, torch_xla 2.9): torch_xla's public ``scan`` traces its body with AOTAutograd and saves
the body's activations per iteration for its own backward (O(depth), and no custom inversion); its forward loop
``_scan_impl_pytree`` traces the body lazily, so a body may call ``torch.autograd.grad`` and place barriers, and its
gradients equal plain autograd's to the last bits in float64. That private function is what runs here (the xla
backend's ``scan_loop``; without it the layers run unrolled). Random numbers: the scan gives each iteration its own
device seed (one int64 per iteration, drawn with ``torch.randint``); handing it the seeds the unrolled walk gives
each layer makes the scan draw exactly the unrolled walk's dropout masks, and the backward scan the same again. With
a group of several layers per iteration, the layers of a group would share one seed: such groups run scanned only
when their layers draw no random numbers (else unrolled; with ``scan=True`` a clear error).

Also unrolled: module hooks (the body is traced once, so they would run once for all layers), modules in training
mode with persistent buffers (batch norm's kernels update running statistics without a version bump that the body
could see), other buffers changed in place (seen by their version counters while tracing), tensor arguments that
require grad, ``target_device`` and ``fused_optimizer`` (both work per layer inside the unrolled walk). With the
scan, parameter gradients reach autograd together at the end of the sequence's backward (one node), not layer by
layer.

Devices that do not trace lazily (cpu, cuda) run the layers unrolled, which is the same computation.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from . import _tree, backend
from ._grad_destination import GradDestination, node_destination

if TYPE_CHECKING:
    from .reversible import ReversibleModule, ReversibleSequential, _Plan

Tensor = torch.Tensor

__all__ = ["ScanUnsupported", "repeat_period"]

_SCAN_SEED_HIGH = 2**62  # the bound torch_xla's scan draws its per-iteration seeds below


class ScanUnsupported(Exception):
    """Why a call cannot run as a scan (internal: the caller falls back, or raises under ``scan=True``)."""


# ----------------------------------------------------------------------------------------------------------------
# Structure: which layers repeat


def _signature(layer: ReversibleModule) -> list[tuple[str, str, Any]]:
    """What must match between two layers for one traced body to run both: submodule types, settings and hooks,
    parameter and buffer names, shapes, dtypes and ties, and the coupling pair. ``(kind, name, value)`` entries."""
    wrapper, block = layer.wrapped_module, layer.block
    sig: list[tuple[str, str, Any]] = [
        ("coupling_forward", "", wrapper.coupling_forward),
        ("coupling_inverse", "", wrapper.coupling_inverse),
    ]
    for name, module in block.named_modules(remove_duplicate=False):
        sig.append(("module", name, (type(module).__qualname__, module.extra_repr(), module.training)))
        for key, value in vars(module).items():
            if not key.startswith("_") and key != "training" and isinstance(value, (bool, int, float, str, type(None))):
                sig.append(("attribute", f"{name}.{key}".lstrip("."), value))
    for kind, items in (
        ("parameter", block.named_parameters(remove_duplicate=False)),
        ("buffer", block.named_buffers(remove_duplicate=False)),
    ):
        first: dict[int, str] = {}
        for name, t in items:
            tied = first.setdefault(id(t), name)
            sig.append((kind, name, (tuple(t.shape), t.dtype, t.requires_grad, tied)))
    return sig


def _difference(a: list[tuple[str, str, Any]], b: list[tuple[str, str, Any]]) -> str | None:
    """How signature ``b`` differs from ``a`` (the first difference), or ``None``."""
    for (kind_a, name_a, value_a), (kind_b, name_b, value_b) in zip(a, b):
        if (kind_a, name_a) != (kind_b, name_b):
            return f"it has {kind_b} '{name_b}' where the other has {kind_a} '{name_a}'"
        if value_a != value_b:
            return f"its {kind_b}{f' {name_b!r}' if name_b else ''} is {_show(value_b)}, not {_show(value_a)}"
    if len(a) != len(b):
        return f"it has {len(b)} modules, parameters and buffers, the other {len(a)}"
    return None


def _show(value: Any) -> str:
    if callable(value):
        return getattr(value, "__qualname__", None) or repr(value)
    if isinstance(value, tuple) and len(value) == 4 and isinstance(value[1], torch.dtype):
        shape, dtype, requires_grad, tied = value
        return f"{shape} {dtype}{'' if requires_grad else ' frozen'}{f' (tied to {tied})' if tied else ''}"
    if isinstance(value, tuple) and len(value) == 3:
        kind, settings, training = value
        return f"{kind}({settings}){'' if training else ' in eval mode'}"
    return repr(value)


def repeat_period(layers: Sequence[ReversibleModule], describe: Callable[[int], str]) -> int:
    """The smallest ``period`` such that every layer is identical in structure to layer ``i % period`` (dividing the
    number of layers), or :class:`ScanUnsupported` naming the first layer that differs (for the period that repeats
    longest) and how."""
    sigs = [_signature(layer) for layer in layers]
    n = len(layers)
    best: tuple[int, int, str] | None = None  # (first differing layer, period, how)
    for period in range(1, n // 2 + 1):
        if n % period:
            continue
        for i in range(period, n):
            how = _difference(sigs[i % period], sigs[i])
            if how is not None:
                if best is None or i > best[0]:
                    best = (i, period, how)
                break
        else:
            return period
    if best is None:
        return n  # a single layer: nothing repeats, one iteration
    i, period, how = best
    raise ScanUnsupported(
        f"the layers are not identical in structure: {describe(i)} differs from {describe(i % period)} ({how})"
    )


_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _refuse_hooks_and_state(plan: _Plan) -> None:
    """Module hooks run where the block is called: once per trace of the scan's body, not once per layer; and
    buffers a module updates in its forward would be updated in the trace's slices only."""
    from torch.nn.modules import module as module_globals

    if any(getattr(module_globals, f"_global{h}", None) for h in _MODULE_HOOKS):
        raise ScanUnsupported("global module hooks are registered (they would run once for all layers)")
    for i, layer in enumerate(plan.layers):
        for name, module in layer.block.named_modules():
            if any(getattr(module, h, None) for h in _MODULE_HOOKS):
                raise ScanUnsupported(
                    f"{plan.describe(i)} has hooks on its module {name or 'itself'!r} (they would run once for all "
                    f"layers)"
                )
            if module.training and any(
                b is not None and key not in module._non_persistent_buffers_set for key, b in module._buffers.items()
            ):
                # Kernels such as batch norm's update running statistics without bumping the version counter that
                # the body checks, so a module that may update its state is not scanned.
                raise ScanUnsupported(
                    f"{plan.describe(i)}: its module {name or 'itself'!r} is in training mode with buffers (running "
                    f"statistics), which the scan would not update per layer; call .eval() on it or pass scan=False"
                )


# ----------------------------------------------------------------------------------------------------------------
# Layout: what each iteration of the scan gets


@dataclasses.dataclass
class _Layout:
    """The sequence as ``iterations`` repeats of ``period`` layers: per position ``j`` in the group, the names of
    the block's parameters and buffers, and for each iteration the index of each parameter in ``plan.params``
    (``None``: not trained); the arguments, shared by every layer or stacked per iteration."""

    period: int
    iterations: int
    param_names: list[list[str]]
    buffer_names: list[list[str]]
    param_index: list[dict[str, list[int | None]]]
    arg_specs: list[Any]  # per position: the (args, kwargs) tree spec
    arg_leaves: list[list[Any]]  # per position: each leaf is a constant, a _Shared slot or a _Stacked slot list

    def tensors(self, plan: _Plan, j: int) -> dict[str, Tensor]:
        """Position ``j``'s parameters and buffers stacked over the iterations (a copy)."""
        blocks = [plan.layers[t * self.period + j].block for t in range(self.iterations)]
        found = [dict(b.named_parameters()) | dict(b.named_buffers()) for b in blocks]
        with torch.no_grad():
            return {n: torch.stack([f[n] for f in found]) for n in self.param_names[j] + self.buffer_names[j]}

    def stacked_args(self, j: int, arg_tensors: Sequence[Tensor]) -> list[Tensor]:
        return [
            torch.stack([arg_tensors[k] for k in leaf.slots])
            for leaf in self.arg_leaves[j]
            if isinstance(leaf, _Stacked)
        ]

    def args(self, j: int, arg_tensors: Sequence[Tensor], stacked: Sequence[Tensor]) -> tuple[Any, Any]:
        """Position ``j``'s ``(args, kwargs)`` inside the body: shared tensors as they are, stacked ones sliced."""
        slices = iter(stacked)
        leaves = [
            arg_tensors[leaf.slot]
            if isinstance(leaf, _Shared)
            else next(slices)
            if isinstance(leaf, _Stacked)
            else leaf
            for leaf in self.arg_leaves[j]
        ]
        return _tree.tree_unflatten(leaves, self.arg_specs[j])


@dataclasses.dataclass(frozen=True)
class _Shared:
    slot: int


@dataclasses.dataclass(frozen=True)
class _Stacked:
    slots: tuple[int, ...]


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # objects whose == is not a truth value
        return False


def _layout(plan: _Plan, period: int, arg_tensors: Sequence[Tensor]) -> _Layout:
    from .reversible import _Slot

    n = len(plan.layers)
    iterations = n // period
    index = {id(p): k for k, p in enumerate(plan.params)}
    param_names, buffer_names, param_index, specs, leaves_of = [], [], [], [], []
    for i, layer in enumerate(plan.layers):
        block_params = {id(p) for p in layer.block.parameters()}
        if any(id(plan.params[k]) not in block_params for k in plan.layer_params[i]):
            raise ScanUnsupported(f"{plan.describe(i)} trains a parameter outside its block (in its coupling)")
    for j in range(period):
        block = plan.layers[j].block
        param_names.append([name for name, _ in block.named_parameters()])
        buffer_names.append([name for name, _ in block.named_buffers()])
        per_name: dict[str, list[int | None]] = {name: [] for name in param_names[j]}
        for t in range(iterations):
            for name, p in plan.layers[t * period + j].block.named_parameters():
                per_name[name].append(index.get(id(p)))
        param_index.append(per_name)
        flats = [_tree.tree_flatten(plan.layer_args[t * period + j]) for t in range(iterations)]
        spec = flats[0][1]
        leaves: list[Any] = []
        for pos, leaf in enumerate(flats[0][0]):
            column = [f[0][pos] if f[1] == spec and len(f[0]) == len(flats[0][0]) else None for f in flats]
            where = f"the arguments of {plan.describe(j)} and {plan.describe((iterations - 1) * period + j)}"
            if not isinstance(leaf, _Slot):
                if not all(_same(leaf, other) for other in column):
                    raise ScanUnsupported(f"{where} differ in structure or in a value that is not a tensor")
                leaves.append(leaf)
                continue
            if not all(isinstance(other, _Slot) for other in column):
                raise ScanUnsupported(f"{where} differ in structure (a tensor in one, not in the other)")
            slots = tuple(other.index for other in column if isinstance(other, _Slot))
            tensors = [arg_tensors[k] for k in slots]
            if any(t.requires_grad for t in tensors):
                raise ScanUnsupported(f"{where} include a tensor that requires grad (its gradient is not scanned)")
            if len(set(slots)) == 1:
                leaves.append(_Shared(slots[0]))
            elif all(t.shape == tensors[0].shape and t.dtype == tensors[0].dtype for t in tensors):
                leaves.append(_Stacked(slots))
            else:
                raise ScanUnsupported(f"{where} include tensors of different shapes or dtypes")
        specs.append(spec)
        leaves_of.append(leaves)
    return _Layout(period, iterations, param_names, buffer_names, param_index, specs, leaves_of)


# ----------------------------------------------------------------------------------------------------------------
# Choosing the scan


def scanned_forward(
    model: ReversibleSequential, plan: _Plan, x0: Tensor, x1: Tensor, arg_tensors: Sequence[Tensor]
) -> tuple[Tensor, Tensor] | None:
    """The reversible forward as a scan (its backward a reverse scan), or ``None`` where the layers run unrolled:
    ``scan=False``, a device that does not trace lazily, or (with ``scan=None``) anything the scan cannot run.
    With ``scan=True``, what the scan cannot run raises a :class:`revlib_xla.ReversibleError` naming it."""
    from .reversible import ReversibleError

    wanted = getattr(model, "scan", False)  # models pickled before the argument existed: its default
    if wanted is False or (wanted is None and not backend.is_tracing_lazily(x0)):
        return None  # nothing to compile: the unrolled walk, without checking anything per call
    try:
        run = _prepare(model, plan, x0, arg_tensors)
        if run is None:
            return None
        return _ScannedLayers.apply(run, x0, x1, *plan.params)  # type: ignore[no-any-return]
    except ScanUnsupported as why:
        if wanted:
            raise ReversibleError(
                f"ReversibleSequential(scan=True): {why}. Make the layers identical in structure (the same module "
                f"types, settings, parameter shapes and dtypes, couplings and argument structure), or pass "
                f"scan=None (scan when possible) or scan=False (run the layers unrolled)."
            ) from None
        return None


def _prepare(model: ReversibleSequential, plan: _Plan, x0: Tensor, arg_tensors: Sequence[Tensor]) -> _Run | None:
    if model.fused_optimizer is not None:
        raise ScanUnsupported("fused_optimizer steps each layer inside the backward walk, which the scan does not run")
    if plan.offload is not None:
        raise ScanUnsupported("target_device streams each layer's parameters, which the scan stacks instead")
    _refuse_hooks_and_state(plan)
    period = repeat_period(plan.layers, plan.describe)
    layout = _layout(plan, period, arg_tensors)
    if not backend.is_tracing_lazily(x0):
        return None  # eager devices: the unrolled walk is the same computation, without a compiler to save
    loop = backend.scan_loop(x0.device)
    if loop is None:
        raise ScanUnsupported(f"the {x0.device.type} backend has no compiled loop (Backend.scan_loop)")
    return _Run(plan, layout, list(arg_tensors), loop)


# ----------------------------------------------------------------------------------------------------------------
# The scans


class _Seeds(TorchFunctionMode):
    """Hands torch_xla's scan the per-iteration seeds the unrolled walk would give each layer, in place of the
    random ones it draws (``torch.randint(0, 2**62, (iterations,), dtype=torch.int64)``)."""

    def __init__(self, seeds: list[int]) -> None:
        super().__init__()
        self.seeds, self.used = seeds, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func is torch.randint
            and not self.used
            and len(args) == 3
            and args[:2] == (0, _SCAN_SEED_HIGH)
            and tuple(args[2]) == (len(self.seeds),)
            and kwargs.get("dtype") == torch.int64
        ):
            self.used = True
            return torch.tensor(self.seeds, dtype=torch.int64).to(kwargs.get("device", "xla"))
        return func(*args, **kwargs)


class _Run:
    """One call's scans: the plan, the layout, the arguments and the loop."""

    def __init__(self, plan: _Plan, layout: _Layout, arg_tensors: list[Tensor], loop: Callable[..., Any]) -> None:
        self.plan, self.layout, self.arg_tensors, self.loop = plan, layout, arg_tensors, loop
        self.draws = False  # whether the body draws random numbers (found while tracing the forward)

    def _xs(self) -> list[tuple[dict[str, Tensor], list[Tensor]]]:
        return [
            (self.layout.tensors(self.plan, j), self.layout.stacked_args(j, self.arg_tensors))
            for j in range(self.layout.period)
        ]

    @contextlib.contextmanager
    def _seeded(self, replay: bool) -> Iterator[_Seeds | None]:
        """The layers' seeds for the loop: a fresh device seed for the trace, then one seed per iteration."""
        plan = self.plan
        with plan.call.scope(replay=replay) as reseed:
            reseed(plan.seed_of(0))
            if plan.call.seed is None or self.layout.period > 1:
                yield None
                return
            seeds = [plan.seed_of(t) for t in range(self.layout.iterations)]
            with _Seeds([s for s in seeds if s is not None]) as mode:
                yield mode

    def forward(self, x0: Tensor, x1: Tensor) -> tuple[Tensor, Tensor]:
        from .reversible import _forward_layer

        plan, layout = self.plan, self.layout
        device = x0.device

        def body(carry, xs):
            a0, a1 = carry
            for j, (tensors, stacked) in enumerate(xs):
                args, kwargs = layout.args(j, self.arg_tensors, stacked)
                buffers = [tensors[n] for n in layout.buffer_names[j]]
                versions = [b._version for b in buffers]
                before = backend.RngState.capture(device).accel
                a0, a1 = a1, _forward_layer(plan, j, a0, a1, args, kwargs, tensors)
                if backend.RngState.capture(device).accel != before:
                    self.draws = True
                if [b._version for b in buffers] != versions:
                    raise ScanUnsupported(f"{plan.describe(j)} changes a buffer in its forward (running statistics)")
            if self.draws and layout.period > 1:
                raise ScanUnsupported(
                    f"the layers repeat in groups of {layout.period} and draw random numbers (dropout): the layers of "
                    f"a group would share one seed per iteration"
                )
            return (a0, a1), ()

        with torch.no_grad(), plan.call.autocast.replay(), self._seeded(replay=False) as seeds:
            (y0, y1), _ = self.loop(body, (x0, x1), self._xs())
        _check_seeded(seeds, self.draws)
        return y0, y1

    def backward(
        self, y0: Tensor, y1: Tensor, dy0: Tensor, dy1: Tensor, trained: list[bool]
    ) -> tuple[Tensor, Tensor, list[Tensor | None]]:
        """The input gradients, and the gradient of each of ``plan.params`` (``None`` where not ``trained``)."""
        plan, layout = self.plan, self.layout
        autocast = plan.call.autocast
        layer_autocast = autocast.replay if autocast.differs_from_now() else contextlib.nullcontext
        wanted = [
            [n for n in layout.param_names[j] if any(k is not None and trained[k] for k in layout.param_index[j][n])]
            for j in range(layout.period)
        ]

        def body(carry, xs):
            b0, b1, g0, g1 = carry
            grads: list[dict[str, Tensor]] = [{} for _ in xs]
            for j in reversed(range(len(xs))):
                tensors, stacked = xs[j]
                args, kwargs = layout.args(j, self.arg_tensors, stacked)
                b0, b1, g0, g1 = backend.optimization_barrier([b0, b1, g0, g1, *tensors.values()])[:4]
                leaves = {n: t.detach().requires_grad_() if n in wanted[j] else t for n, t in tensors.items()}
                x0, g0, g1, found = _recompute_vjp(
                    plan, j, b0, b1, g0, g1, args, kwargs, leaves, wanted[j], layer_autocast
                )
                grads[j] = {n: found[n] if found[n] is not None else torch.zeros_like(leaves[n]) for n in wanted[j]}
                b0, b1 = x0, b0
            return (b0, b1, g0, g1), grads

        with torch.no_grad(), self._seeded(replay=True) as seeds:
            (x0, x1, dx0, dx1), stacked_grads = self.loop(body, (y0, y1, dy0, dy1), self._xs(), reverse=True)
        _check_seeded(seeds, self.draws)
        if plan.rebuild is not None:  # verify_inverse: the sequence's input, rebuilt
            plan.rebuild.compare(0, x0, x1)
        grads: list[Tensor | None] = [None] * len(plan.params)
        for j in range(layout.period):
            for name, stack in stacked_grads[j].items():
                for t, k in enumerate(layout.param_index[j][name]):
                    if k is not None and trained[k]:
                        grads[k] = stack[t] if grads[k] is None else grads[k] + stack[t]
        return dx0, dx1, grads


def _check_seeded(seeds: _Seeds | None, draws: bool) -> None:
    if seeds is not None and draws and not seeds.used:
        raise RuntimeError(
            "ReversibleSequential: torch_xla's scan no longer draws its per-iteration seeds as this version of "
            "revlib_xla expects, so the recomputation would draw other dropout masks; pass scan=False"
        )


def _recompute_vjp(
    plan: _Plan,
    j: int,
    y0: Tensor,
    y1: Tensor,
    dy0: Tensor,
    dy1: Tensor,
    args: Any,
    kwargs: Any,
    tensors: dict[str, Tensor],
    wanted: list[str],
    layer_autocast: Callable[[], contextlib.AbstractContextManager[Any]],
) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor | None]]:
    """Layer ``j`` of the group inside the backward body: its input ``x0`` rebuilt from ``(y0, y1)``, the gradients
    of its two input streams, and those of its ``wanted`` parameters."""
    from .reversible import _call_block, _to_compute, _vjp

    wrapper = plan.wrappers[j]
    with torch.enable_grad(), layer_autocast():
        x1 = y0.detach().requires_grad_()
        fn_out = _call_block(plan, j, _to_compute(x1, plan), args, kwargs, tensors)
        x0 = wrapper.uncouple(y1, _tree.detached(fn_out))
        x0 = x0.detach()
        if plan.stream_dtype is not None:
            x0 = x0.to(plan.stream_dtype)
        x0_leaf = x0.requires_grad_()
        out = wrapper.couple(x0_leaf, fn_out)
        if plan.stream_dtype is not None:
            out = out.to(plan.stream_dtype)
    inputs = [x0_leaf, x1, *(tensors[n] for n in wanted)]
    found = list(_vjp(out, inputs, dy1))
    dx0 = found[0] if found[0] is not None else torch.zeros_like(x0)
    dx1 = dy0 if found[1] is None else dy0 + found[1]
    return x0.detach(), dx0, dx1, dict(zip(wanted, found[2:]))


_UNUSED = GradDestination.UNUSED


class _ScannedLayers(torch.autograd.Function):
    """The whole sequence as one autograd node: the forward scan keeps only the final streams (and the parameters,
    for the in-place check); the backward scan rebuilds every layer and returns every parameter's gradient."""

    @staticmethod
    def forward(ctx, run: _Run, x0: Tensor, x1: Tensor, *params: Tensor):  # type: ignore[override]
        ctx.run = run
        y0, y1 = run.forward(x0, x1)
        ctx.save_for_backward(*params, *run.arg_tensors)
        ctx.streams = [y0.detach(), y1.detach()]
        ctx.stream_versions = (y0._version, y1._version)
        return y0, y1

    @staticmethod
    def backward(ctx, dy0: Tensor, dy1: Tensor):  # type: ignore[override]
        from .reversible import _INPLACE_HINT, ReversibleError

        run: _Run = ctx.run
        if torch.is_grad_enabled():
            raise ReversibleError(
                "ReversibleSequential (scanned): a gradient of a gradient (create_graph=True) cannot be taken through "
                "the reversible backward: it rebuilds each layer's input without autograd history. Use "
                "memory_mode=MemoryModes.no_savings for this model."
            )
        try:
            ctx.saved_tensors  # noqa: B018  # raises if a parameter or argument was changed in place
        except RuntimeError as err:
            if _INPLACE_HINT not in str(err):
                raise
            raise ReversibleError(
                "a tensor the reversible backward needs was modified in place after the forward: a parameter or a "
                "tensor argument of the (scanned) layers. Clone it before changing it, or change it only after "
                "backward()."
            ) from None
        y0, y1 = ctx.streams
        if (y0._version, y1._version) != ctx.stream_versions:
            raise ReversibleError(
                "a tensor the reversible backward needs was modified in place after the forward: the sequence's "
                "output. Clone it before changing it, or change it only after backward()."
            )
        edges = [node for node, _ in ctx.next_functions][2:]  # x0, x1, then the parameters
        trained = [node_destination(node) is not _UNUSED for node in edges]
        dx0, dx1, grads = run.backward(y0, y1, dy0, dy1, trained)
        return (None, dx0, dx1, *grads)
