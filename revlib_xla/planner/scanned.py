"""Runs of identical stages of a :class:`revlib_xla.Checkpointable` (``scan=True``) as one stage,
:class:`ScannedStages`: the forward keeps each layer's input, the backward recomputes one layer at a time, as two
compiled loops on XLA; and their parameters stored stacked (:func:`stack_stages`, what ``stack_layers`` does for a
Checkpointable)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .. import backends
from .._replaced_params import mark_replaced
from ..reversible.engine import vjp
from ..reversible.repeat import MODULE_HOOKS, ScanUnsupported, difference, module_signature
from ..reversible.scan import params_after
from ..reversible.stacks import KeyMap, load_into_stacks, stacked_state_dict

Tensor = torch.Tensor


# ----------------------------------------------------------------------------------------------------------------
# Checkpointable: a run of identical stages as one scanned stage


def _stage_refusal(stage: nn.Module) -> str | None:
    """What keeps a stage from running inside a scan's body (traced once for every layer), or ``None``."""
    for name, module in stage.named_modules():
        where = f"its module {name or 'itself'!r}"
        if any(getattr(module, h, None) for h in MODULE_HOOKS):
            return f"{where} has hooks (they would run once for all layers)"
        if module.training and any(
            b is not None and key not in module._non_persistent_buffers_set for key, b in module._buffers.items()
        ):
            return f"{where} is in training mode with buffers (running statistics, which the scan would not update)"
    return None


def scan_runs(stages: Sequence[nn.Module]) -> list[nn.Module]:
    """``stages`` with every run of two or more consecutive stages identical in structure (module types, settings,
    parameter and buffer names, shapes and dtypes) replaced by one :class:`ScannedStages`; stages that cannot run
    in a scan's body (hooks, training-mode running statistics, a parameter shared with another stage) stay as they
    are. Raises :class:`ScanUnsupported` naming why when no run is found."""
    sigs = [module_signature(stage) for stage in stages]
    owners: dict[int, int] = {}
    shared: set[int] = set()
    for i, stage in enumerate(stages):
        for p in stage.parameters():
            if owners.setdefault(id(p), i) != i:
                shared |= {i, owners[id(p)]}
    refused = {i: why for i, stage in enumerate(stages) if (why := _stage_refusal(stage)) is not None}
    out: list[nn.Module] = []
    why_not: list[str] = []
    i = 0
    while i < len(stages):
        end = i + 1
        if i not in refused and i not in shared:
            while end < len(stages) and end not in refused and end not in shared and sigs[end] == sigs[i]:
                end += 1
        if end - i >= 2:
            out.append(ScannedStages(stages[i:end]))
        else:
            out.append(stages[i])
            if i in refused:
                why_not.append(f"stage {i} ({type(stages[i]).__name__}): {refused[i]}")
            elif i in shared:
                why_not.append(f"stage {i} ({type(stages[i]).__name__}) shares a parameter with another stage")
            elif end < len(stages) and (how := difference(sigs[i], sigs[end])) is not None:
                why_not.append(f"stage {end} ({type(stages[end]).__name__}) differs from stage {i} ({how})")
        i = end
    if not any(isinstance(stage, ScannedStages) for stage in out):
        raise ScanUnsupported(
            "no two consecutive stages are identical in structure and scannable"
            + (f": {why_not[0]}" if why_not else "")
        )
    return out


class ScannedStages(nn.Module):
    """A run of stages identical in structure, run as one stage with rematerialisation inside (what torch_xla's
    ``scan_layers`` does with a full-remat partition, on this package's own loops): with autograd, the forward keeps
    only each layer's input and the backward recomputes one layer at a time with autograd, in reverse, taking its
    vector-Jacobian product. On XLA both are while loops over the layers' parameters and buffers stacked along a
    new leading dimension (one layer compiled, whatever the run's length; the stacks are transient copies, unless
    :func:`stack_layers` stored the parameters stacked: then the loops read the stacks and write their gradients);
    on eager devices (cpu, cuda) the same steps run layer by layer, on the layers' own parameters or on slices of
    the stacks.

    Each layer maps a tensor to a tensor of the same shape and dtype. Not supported (a clear error at the call):
    layers that draw random numbers (dropout: one trace would draw the same numbers for every layer), layers that
    change their buffers. Built by :class:`revlib_xla.Checkpointable` with ``scan=True`` (see :func:`scan_runs`)."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        # With stacked storage (stack_layers): per parameter of a layer, the stack's attribute on the owner and the
        # parameter's names in a layer (tied names together); the owner holds the stacks, as registered parameters.
        self._stacks: list[tuple[str, tuple[str, ...]]] | None = None
        self._owner: nn.Module | None = None

    def extra_repr(self) -> str:
        return f"{len(self.layers)} x {type(self.layers[0]).__name__}, scanned{', stacked' if self._stacks else ''}"

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The layers' parameters, or with stacked storage the stacks (held by the model: ``stack_layers``)."""
        if self._stacks is None or self._owner is None:
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
            return
        for attr, _ in self._stacks:
            yield prefix + attr, getattr(self._owner, attr)

    def _stacked_params(self) -> dict[str, Tensor]:
        """With stacked storage: each stack by its first name in a layer."""
        assert self._stacks is not None and self._owner is not None
        return {names[0]: getattr(self._owner, attr) for attr, names in self._stacks}

    def _aliased(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """``tensors`` (by a parameter's first name) with the tied names added: a stacked layer has no parameters to
        tie them by itself."""
        if self._stacks is None:
            return tensors
        return tensors | {name: tensors[names[0]] for _, names in self._stacks for name in names[1:]}

    def _layer(self, t: int, x: Tensor, params: dict[str, Tensor] | None = None) -> Any:
        """Layer ``t`` on ``x``: with its own parameters, or (stacked) with ``params`` (default: its slices)."""
        if self._stacks is None:
            return self.layers[t](x)
        if params is None:
            params = {name: stack[t] for name, stack in self._stacked_params().items()}
        return torch.func.functional_call(self.layers[t], self._aliased(params), (x,))

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"ScannedStages ({self.extra_repr()}): the layers' input must be one tensor (the loop's carry), got "
                f"{type(x).__name__}; pass scan=False to Checkpointable"
            )
        for index, layer in enumerate(self.layers):  # what may have changed since scan_runs took the layers
            if (why := _stage_refusal(layer)) is not None:  # e.g. model.train() after wrapping an eval-mode model
                raise ScanUnsupported(
                    f"ScannedStages ({self.extra_repr()}): layer {index} ({type(layer).__name__}): {why}; its "
                    f"forward runs again in the backward. Pass scan=False to Checkpointable, or wrap the model in the "
                    f"mode it runs in"
                )
        params = list(self.parameters())
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            return cast(Tensor, _ScannedStagesFn.apply(self, x, *params))
        return self._run_forward(x, keep=False)[0]

    # -- the loops ------------------------------------------------------------------------------------------------
    def _stacked(self) -> dict[str, Tensor]:
        """Every layer's parameters and buffers stacked by name, for the compiled loops: a copy, except the stacks of
        stacked storage, which are read as they are."""
        found = [dict(layer.named_parameters()) | dict(layer.named_buffers()) for layer in self.layers]
        with torch.no_grad():
            stacked = {n: torch.stack([f[n] for f in found]) for n in found[0]}
        return stacked if self._stacks is None else self._stacked_params() | stacked

    def _check_carry(self, x: Tensor, y: Any) -> Tensor:
        if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
            got = f"{tuple(y.shape)} {y.dtype}" if isinstance(y, torch.Tensor) else type(y).__name__
            raise ScanUnsupported(
                f"ScannedStages ({self.extra_repr()}): a layer maps {tuple(x.shape)} {x.dtype} to {got}; a scanned "
                f"layer must return a tensor of its input's shape and dtype. Pass scan=False to Checkpointable"
            )
        return y

    def _refuse_random(self, drawn: bool, before: backends.RngState, device: torch.device) -> None:
        """Raise if the layers drew random numbers: ``drawn`` (seen operator by operator), or the device's or the
        CPU's generator moved since ``before``."""
        after = backends.RngState.capture(device)
        moved = before.accel != after.accel or (
            before.cpu is not None and after.cpu is not None and not torch.equal(before.cpu, after.cpu)
        )
        if drawn or moved:
            raise ScanUnsupported(
                f"ScannedStages ({self.extra_repr()}): the layers draw random numbers (dropout), which a scanned run "
                f"of Checkpointable stages does not replay per layer; pass scan=False to Checkpointable (or use "
                f"dropout outside the repeated stages)"
            )

    def _run_forward(self, x: Tensor, keep: bool) -> tuple[Tensor, Any]:
        """The layers without autograd: the output, and with ``keep`` each layer's input (stacked on XLA)."""
        device = x.device
        before = backends.RngState.capture(device)
        loop = backends.scan_loop(device) if backends.is_tracing_lazily(x) else None
        if loop is None:
            inputs = []
            with _RandomOps() as seen:  # the stage may draw from generators of its own (Checkpointable's replay)
                for t in range(len(self.layers)):
                    if keep:
                        inputs.append(x)
                    x = self._check_carry(x, self._layer(t, x))
            self._refuse_random(seen.drawn, before, device)
            return x, inputs
        template = self.layers[0]

        def body(carry: Tensor, tensors: dict[str, Tensor]) -> tuple[Tensor, Any]:
            tensors = params_after(tensors, carry)
            y = self._check_carry(carry, torch.func.functional_call(template, self._aliased(tensors), (carry,)))
            return y, (carry if keep else ())

        y, inputs = loop(body, x, self._stacked())
        self._refuse_random(False, before, device)
        return y, inputs

    def _run_backward(
        self, inputs: Any, dy: Tensor, trained: list[bool], autocast: backends.AutocastState
    ) -> tuple[Tensor | None, list[Tensor | None]]:
        """The input's gradient and the gradient of each layer's parameters (in ``parameters()`` order; ``None``
        where not ``trained``), recomputing one layer at a time from its kept input."""
        if self._stacks is None:  # per layer, its parameters' names; trained[t * count + k]: layer t's k-th
            names = [n for n, _ in self.layers[0].named_parameters()]
            count = len(names)
            need = [any(trained[t * count + k] for t in range(len(self.layers))) for k in range(count)]
        else:  # per stack, its first name; trained[k] (count 0): the k-th stack
            names = list(self._stacked_params())
            count, need = 0, trained
        wanted_names = [n for n, wanted in zip(names, need) if wanted]
        loop = backends.scan_loop(dy.device) if backends.is_tracing_lazily(dy) else None
        grads: list[Tensor | None] = [None] * len(trained)
        if loop is None:
            per_layer: dict[str, list[Tensor]] = {n: [] for n in wanted_names}  # stacked: in reverse
            for t in reversed(range(len(self.layers))):
                leaf = inputs[t].detach().requires_grad_()
                params: dict[str, Tensor]
                if self._stacks is None:
                    params = dict(self.layers[t].named_parameters())
                else:
                    params = {n: s[t].detach().requires_grad_() for n, s in self._stacked_params().items()}
                with torch.enable_grad(), autocast.replay():
                    out = self._layer(t, _non_leaf(leaf), params)
                wanted = [(k, n) for k, n in enumerate(names) if trained[t * count + k]]
                found = vjp(out, [leaf, *(params[n] for _, n in wanted)], dy)
                dy = found[0] if found[0] is not None else torch.zeros_like(leaf)
                for (k, n), g in zip(wanted, found[1:]):
                    g = g if g is not None else torch.zeros_like(params[n])
                    if self._stacks is None:
                        grads[t * count + k] = g
                    else:
                        per_layer[n].append(g)
            if self._stacks is not None:  # each stack's gradient: its layers' gradients stacked
                return dy, [torch.stack(per_layer[n][::-1]) if need else None for n, need in zip(names, trained)]
            return dy, grads
        template = self.layers[0]

        def body(carry: Tensor, xs: tuple[Tensor, dict[str, Tensor]]) -> tuple[Tensor, dict[str, Tensor]]:
            x, tensors = xs
            fenced = backends.optimization_barrier([carry, x, *tensors.values()])
            g, x = fenced[0], fenced[1]
            tensors = params_after(dict(zip(tensors, fenced[2:])), g)
            leaves = {n: t.detach().requires_grad_() if n in wanted_names else t for n, t in tensors.items()}
            leaf = x.detach().requires_grad_()
            with torch.enable_grad(), autocast.replay():
                out = torch.func.functional_call(template, self._aliased(leaves), (_non_leaf(leaf),))
            found = vjp(out, [leaf, *(leaves[n] for n in wanted_names)], g)
            dx = found[0] if found[0] is not None else torch.zeros_like(leaf)
            return dx, {n: f if f is not None else torch.zeros_like(leaves[n]) for n, f in zip(wanted_names, found[1:])}

        with torch.no_grad():
            dx, stacked = loop(body, dy, (inputs, self._stacked()), reverse=True)
        if self._stacks is not None:  # the loop's stacked gradients are the stacks' gradients
            return dx, [stacked[n] if need else None for n, need in zip(names, trained)]
        for t in range(len(self.layers)):
            for k, name in enumerate(names):
                if trained[t * count + k]:
                    grads[t * count + k] = stacked[name][t]
        return dx, grads


def _non_leaf(leaf: Tensor) -> Tensor:
    """``leaf`` as a view, the input a layer gets in a backward body: module trackers (``MemTracker``, FSDP) put
    multi-tensor gradient hooks on a module's inputs, which fail on a leaf inside ``torch.autograd.grad``."""
    with torch.enable_grad():
        return leaf.view_as(leaf)


class _RandomOps(TorchDispatchMode):
    """Whether an operator that draws random numbers ran (``torch.Tag.nondeterministic_seeded``)."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.drawn = True
        return func(*args, **(kwargs or {}))


class _ScannedStagesFn(torch.autograd.Function):
    """A :class:`ScannedStages` run with autograd: the forward keeps each layer's input, the backward recomputes."""

    @staticmethod
    def forward(ctx, owner: ScannedStages, x: Tensor, *params: Tensor):  # type: ignore[override]
        ctx.owner = owner
        ctx.autocast = backends.AutocastState.capture(x.device)
        with torch.no_grad():
            y, inputs = owner._run_forward(x, keep=True)
        ctx.inputs = inputs
        ctx.save_for_backward(x, *params)  # torch's own error if one is changed in place before the backward
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        owner: ScannedStages = ctx.owner
        x, *params = ctx.saved_tensors
        trained = list(ctx.needs_input_grad[2:])
        if torch.is_grad_enabled():  # create_graph=True: the layers again with autograd, differentiable
            with torch.enable_grad(), ctx.autocast.replay():
                out = x
                for t in range(len(owner.layers)):
                    out = owner._layer(t, out)
            wants_x = ctx.needs_input_grad[1]
            wrt = [x] * wants_x + [p for p, need in zip(params, trained) if need]
            found = iter(torch.autograd.grad(out, wrt, dy, create_graph=True, allow_unused=True))
            dx = next(found) if wants_x else None
            return (None, dx, *(next(found) if need else None for need in trained))
        if ctx.inputs is None:
            raise RuntimeError(
                f"ScannedStages ({owner.extra_repr()}): a second backward through the same forward; its layers' inputs "
                f"were freed by the first (Checkpointable runs its forward phase again for a retained graph)"
            )
        dx, grads = owner._run_backward(ctx.inputs, dy, trained, ctx.autocast)
        ctx.inputs = None  # the layers' inputs: freed with the backward, as autograd frees saved tensors
        return (None, dx, *grads)


def stack_stages(owner: nn.Module, stages: Sequence[nn.Module]) -> None:
    """:func:`~revlib_xla.reversible.stacking.stack_layers` for a ``Checkpointable(scan=True)`` of ``owner`` (its
    model) with ``stages``: each scanned run's parameters stacked, held by ``owner``, with its state-dict keys kept
    (:class:`~revlib_xla.reversible.stacks.KeyMap`)."""
    runs = [stage for stage in stages if isinstance(stage, ScannedStages)]
    if not runs:
        raise ValueError("stack_layers: the Checkpointable has no scanned run of stages; build it with scan=True")
    if getattr(owner, "_stage_stacks", None) is not None or any(run._stacks is not None for run in runs):
        raise ValueError("stack_layers: the Checkpointable's scanned runs are stacked already")
    paths = {id(m): name for name, m in owner.named_modules()}
    keys = KeyMap({}, list(owner.state_dict(keep_vars=True)))
    planned: list[tuple[ScannedStages, list[tuple[str, tuple[str, ...]]]]] = []
    for run in runs:
        layer_paths = [paths[id(layer)] for layer in run.layers]
        tied: dict[int, list[str]] = {}
        for name, p in run.layers[0].named_parameters(remove_duplicate=False):
            tied.setdefault(id(p), []).append(name)
        entries = []
        for aliases in tied.values():
            attr = f"stacked_{layer_paths[0]}_{aliases[0]}".replace(".", "_").replace("-", "_")
            if hasattr(owner, attr) or attr in keys.stacks:
                raise ValueError(f"stack_layers: the model has an attribute '{attr}' already")
            found = [layer.get_parameter(aliases[0]) for layer in run.layers]
            for path, p in zip(layer_paths, found):
                if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
                    raise ValueError(
                        f"stack_layers: the parameter '{path}.{aliases[0]}' has hooks, which the stack replacing it "
                        f"would not have; register them on the stack (model.parameters()) after stack_layers"
                    )
            keys.stacks[attr] = [tuple(f"{path}.{a}" for a in aliases) for path in layer_paths]
            entries.append((attr, tuple(aliases)))
        planned.append((run, entries))
    for run, entries in planned:
        for attr, names in entries:
            found = [layer.get_parameter(names[0]) for layer in run.layers]
            with torch.no_grad():
                stack = nn.Parameter(torch.stack([p.detach() for p in found]), requires_grad=found[0].requires_grad)
            owner.register_parameter(attr, stack)
        for layer in run.layers:
            for name, p in list(layer.named_parameters(remove_duplicate=False)):
                module_name, _, leaf = name.rpartition(".")
                delattr(layer.get_submodule(module_name), leaf)
                mark_replaced(p, f"{paths[id(layer)]}.{name}")
        run._stacks = entries
        object.__setattr__(run, "_owner", owner)  # a plain reference: the model is no submodule of its stage
    vars(owner)["_stage_stacks"] = keys  # plain state: copied, pickled
    owner._register_state_dict_hook(stacked_state_dict)
    owner._register_load_state_dict_pre_hook(load_into_stacks, with_module=True)
    owner.register_forward_pre_hook(_refuse_stacked_call)


def _refuse_stacked_call(model: nn.Module, args: Any) -> None:
    raise RuntimeError(
        f"{type(model).__name__}: its scanned layers' parameters are stacked (stack_layers on the Checkpointable "
        f"that wraps it): call the Checkpointable, which runs the model in training and in eval mode"
    )
