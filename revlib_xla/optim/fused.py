"""The optimizer step fused into the backward pass: each parameter is updated as soon as its gradient is complete,
and that gradient is freed at once, so a training step never holds more than a layer's worth of gradients.

Two ways in, one object (:class:`FusedOptimizer`) behind both:

* ``revlib_xla.fuse_optimizer(model, factory)`` works on any module. Like ``torch.distributed.fsdp.fully_shard``,
  it acts per parameter: a post-accumulate-grad hook on every trainable parameter steps that parameter's own
  optimizer (built by ``factory([param])``) and drops ``param.grad``. Anything that produces gradients through
  ordinary autograd leaves (plain modules, ``torch.utils.checkpoint``, the planner's ``Checkpointable``) works with
  it unchanged, and so do reversible sequences inside the model: their backward hands each layer's gradients to
  autograd as soon as the layer is done.
* ``ReversibleSequential(..., fused_optimizer=factory)`` (RevLib's API) builds one optimizer per layer and steps
  it inside the reversible backward, right after the layer's gradients are computed.

Why the results equal an unfused step bit for bit: torch's optimizers update each parameter from its own gradient
and its own state only (SGD, momentum, Adam, AdamW; no global-norm clipping), with the same kernels whatever the
grouping, and the steps run synchronously on the compute stream (cuda) or are traced into the same step graph
(xla), so nothing races with the next forward. Optimizers that couple parameters (gradient clipping by the global
norm, LAMB's trust ratio over groups, ZeRO) cannot be fused this way.

A post-accumulate-grad hook runs only when autograd accumulates into ``param.grad``: ``torch.autograd.grad(...)``
(which returns gradients instead) and ``backward(inputs=[...])`` step nothing but the parameters named there.

What the training loop around a fused step may and may not do, and how each is enforced:

* Learning-rate schedulers: the object is a ``torch.optim.Optimizer`` whose ``param_groups`` are the inner
  optimizers' own dicts, so every scheduler (and a manual ``lr`` change) reaches every fused step.
* Loss scaling (``GradScaler``) cannot be fused: the scaler skips the whole step when any gradient is inf/NaN, and a
  layer stepped early in the backward cannot be un-stepped when a later gradient overflows. A backward from a
  forward under float16 autocast is refused before any weight moves; ``scaler.step(fused)`` is refused.
* Gradient accumulation cannot be fused (each backward steps): once ``step()`` has been called, a parameter stepped
  again before the next ``step()`` is refused, and ``step()`` refuses when a parameter was stepped more than once
  since the previous ``step()``.
* Global-norm clipping cannot be fused: it needs the norm of every gradient before the first parameter moves, and
  the fused step moves the first parameter as soon as its gradient exists. ``torch.nn.utils.clip_grad_norm_`` called
  on fused parameters after the backward would find their gradients freed and clip nothing (it returns 0); it
  raises :class:`FusedOptimizerError` instead (importing this module wraps torch's function with that check,
  :mod:`revlib_xla.optim.clip_check`; it is unchanged for every other parameter). What a fused step can clip is
  each group's gradients by their own norm, right before its step: ``fuse_optimizer(model, factory,
  max_grad_norm=...)`` (one parameter per group), or
  ``fused.max_grad_norm = ...`` on a ``ReversibleSequential``'s own fused optimizer (one layer per group). That is
  per-parameter (per-layer) clipping, not the global norm; a global norm would need a second backward pass (the
  first only to measure it), twice the backward's time.
* Data parallelism across processes (DDP, FSDP) cannot be fused: the gradient a fused step reads is this process's
  own, not yet averaged across processes, so the replicas would drift apart. While torch.distributed runs several
  processes a fused step is refused before any weight moves (unless ``independent_processes`` is set).
* Converting the model after steps: ``.double()`` leaves the state in the old dtype, and the next step casts it as
  torch's ``load_state_dict`` does; ``.to(device)`` across tensor types (cpu to xla) makes new parameter tensors,
  and the optimizer moves onto them at the next forward (:meth:`FusedOptimizer.rebind`).
* Copies: the model refers to its fused optimizer, so ``copy.deepcopy(model)`` and pickling take a copy of it
  along, bound to the copied parameters (:func:`fused_optimizer_of` finds it).

Shared (tied) parameters are refused: their gradient arrives in parts (one per use under reversible or
checkpointed backward), and a step on the first part would both be wrong and change a weight the rest of the
backward still reads.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from .. import backends, fsdp
from ..errors import FusedOptimizerError
from .clip_check import _COVERED, _install_clip_check, _torch_clip_grad_norm_

__all__ = [
    "OptimizerFactory",
    "FusedOptimizer",
    "FusedOptimizerError",
    "StepsInBackward",
    "fuse_optimizer",
    "fused_optimizer_of",
]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

_NO_LOSS_SCALING = (
    "loss scaling cannot be fused: a GradScaler skips the whole step when any gradient is inf/NaN, but a fused step "
    "updates each layer during the backward, before the gradients of the layers below it exist, and cannot undo "
    "that when one of them overflows. Train in bfloat16 autocast (torch.autocast(device, dtype=torch.bfloat16) "
    "needs no GradScaler) or float32, or use an unfused optimizer"
)


def _processes_sharing_gradients() -> int:
    """How many processes torch.distributed runs (1 when it is not initialized)."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return int(distributed.get_world_size())
    return 1


def _state_follows_params(opt: torch.optim.Optimizer) -> bool:
    """Whether every floating-point state tensor of ``opt`` has its parameter's dtype and device (not so after
    ``model.double()`` or ``model.to(device)`` once the optimizer has state). ``step`` is torch's own business."""
    for p, state in opt.state.items():
        for key, value in state.items():
            if (
                key != "step"
                and isinstance(value, torch.Tensor)
                and value.is_floating_point()
                and (value.dtype != p.dtype or value.device != p.device)
            ):
                return False
    return True


class FusedOptimizer(torch.optim.Optimizer):
    """Per-group optimizers that are stepped during the backward pass (see the module docstring).

    ``groups`` are lists of parameters; ``factory(group)`` must return a ``torch.optim.Optimizer`` for each. The
    object is a ``torch.optim.Optimizer`` for the training loop around it: ``param_groups`` (the inner optimizers'
    own dicts, so learning-rate schedulers and manual ``lr`` changes reach every step), ``defaults``, ``state``,
    ``state_dict``/``load_state_dict``, and ``step()``/``zero_grad()``, which update nothing because the work
    already happened in the backward; ``step()`` checks that the loop is one a fused step can run (no GradScaler,
    no gradient accumulation). Copies (``copy.deepcopy``, pickling) made together with the parameters are bound to
    the copied parameters, state included.

    Under torch.distributed with several processes (DDP, FSDP) a fused step is refused before any weight moves: it
    would step each parameter on the process's own gradient, before the gradients are averaged across processes.
    Set ``independent_processes = True`` when each process trains a model of its own.
    """

    independent_processes: bool = False
    """Allow fused steps while torch.distributed runs several processes: only when they train separate models."""

    max_grad_norm: float | None = None
    """Clip each group's gradients by their own norm to at most this before its step (``None``: no clipping); see
    the module docstring for why not the global norm."""

    # GradScaler.step(optimizer) hands the step to an optimizer that says it handles loss scaling itself, instead
    # of failing on its own assertion; step() then refuses with the reason.
    _step_supports_amp_scaling = True
    # Attributes a copy does not take: the parameter index (rebuilt), what a scheduler or a GradScaler patched on.
    _TRANSIENT: tuple[str, ...] = ("_of", "_by_id", "step", "_opt_called", "grad_scale", "found_inf")

    def __init__(
        self, groups: Sequence[Sequence[nn.Parameter]], factory: OptimizerFactory, names: Sequence[str] | None = None
    ):
        # torch.optim.Optimizer.__init__ is not called: the parameter groups are the inner optimizers' own.
        if not callable(factory):
            raise FusedOptimizerError(
                f"the fused optimizer factory must be callable (params -> torch.optim."
                f"Optimizer), got {type(factory).__name__}"
            )
        self.names = list(names) if names is not None else [f"group {i}" for i in range(len(groups))]
        self.optimizers: list[torch.optim.Optimizer] = []
        for gi, group in enumerate(groups):
            group = list(group)
            opt = factory(group)
            if not isinstance(opt, torch.optim.Optimizer):
                raise FusedOptimizerError(
                    f"the fused optimizer factory returned {type(opt).__name__} for {self.names[gi]}; it must return "
                    f"a torch.optim.Optimizer built on the parameters it is given, e.g. "
                    f"lambda params: torch.optim.SGD(params, lr=1e-3)"
                )
            given = {id(p) for p in group}
            got = {id(p) for g in opt.param_groups for p in g["params"]}
            if got != given:
                raise FusedOptimizerError(
                    f"the optimizer the factory built for {self.names[gi]} does not hold exactly the parameters it was "
                    f"given ({len(got)} instead of {len(given)}); build it on the factory's argument"
                )
            self.optimizers.append(opt)
        self.params = [p for group in groups for p in group]
        self.steps_taken = 0  # optimizer steps run in backward passes (one per group and step)
        self._stepped: dict[int, int] = {}  # group -> fused steps since the last step() call
        self._step_called = False
        self._float16_forward: torch.device | None = None
        self._index()

    def rebind(self, groups: Sequence[Sequence[nn.Parameter]]) -> None:
        """Move this optimizer, state and hyperparameters included, onto new parameter tensors matched by position
        (the same groups and shapes): what ``model.to(device)`` leaves when it has to make new tensors (e.g. cpu to
        xla). The state is cast to the new parameters' dtype and device at their next step, as torch's
        ``load_state_dict`` does; schedulers attached to this object keep working."""
        new = [p for g in groups for p in g]
        sizes = [sum(len(g["params"]) for g in opt.param_groups) for opt in self.optimizers]
        if [len(g) for g in groups] != sizes or any(a.shape != b.shape for a, b in zip(self.params, new)):
            raise FusedOptimizerError(
                f"the model's parameters were replaced by tensors of other shapes or number ({len(new)} instead of "
                f"{len(self.params)}) after the fused optimizer took its first step; its state cannot follow them. "
                f"Change the model before training it, or fuse it again"
            )
        replaced = {id(p): q for p, q in zip(self.params, new)}
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["params"] = [replaced[id(p)] for p in group["params"]]
            state = opt.state
            opt.state = defaultdict(dict, {replaced[id(p)]: s for p, s in state.items()})
        self.params = new
        self._index()

    def _index(self) -> None:
        self._of: dict[int, int] = {
            id(p): gi for gi, opt in enumerate(self.optimizers) for g in opt.param_groups for p in g["params"]
        }
        self._by_id = {id(p): p for p in self.params}
        for p in self.params:
            _COVERED[id(p)] = self
        _install_clip_check()

    def _unregister(self) -> None:
        for p in self.params:
            if _COVERED.get(id(p)) is self:
                del _COVERED[id(p)]

    def covers(self, param: torch.Tensor) -> bool:
        return id(param) in self._of

    def record_forward(self, device: torch.device) -> None:
        """Called by the forward of the model this optimizer is fused into: remember whether it ran under float16
        autocast while autograd records, so that its backward is refused before any weight moves."""
        if torch.is_grad_enabled():
            state = backends.AutocastState.capture(device)
            self._float16_forward = device if state.enabled and state.dtype == torch.float16 else None

    def step_params(self, params: Sequence[nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
        """Give ``params`` their complete gradients ``grads``, step the optimizers that own them, and free the
        gradients. A gradient already in ``param.grad`` (left by the caller) is added, as autograd would."""
        owners: list[int] = []
        for p, g in zip(params, grads):
            if g is None:
                continue
            p.grad = g if p.grad is None else p.grad + g
            gi = self._of[id(p)]
            if gi not in owners:
                owners.append(gi)
        self._step_groups(owners)

    def step_accumulated(self, param: nn.Parameter) -> None:
        """Step the optimizer of ``param``, whose gradient autograd has just accumulated into ``param.grad``.

        Autograd also runs the hook when a backward sends the parameter no gradient (a custom Function returning
        ``None`` for it); there is nothing to do then."""
        if param.grad is not None:
            self._step_groups([self._of[id(param)]])

    def _step_groups(self, owners: Sequence[int]) -> None:
        for gi in owners:
            self._check_can_step(gi)
        for gi in owners:
            opt = self.optimizers[gi]
            if not _state_follows_params(opt):
                # The model was converted (.double(), .to(device)) after this optimizer's first step: torch's own
                # load_state_dict casts the state to each parameter's dtype and device.
                opt.load_state_dict(opt.state_dict())
            if self.max_grad_norm is not None:
                grads = [p for group in opt.param_groups for p in group["params"] if p.grad is not None]
                _torch_clip_grad_norm_(grads, self.max_grad_norm)
            opt.step()
            self.steps_taken += 1
            self._stepped[gi] = self._stepped.get(gi, 0) + 1
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = None

    def _check_can_step(self, gi: int) -> None:
        processes = _processes_sharing_gradients()
        if processes > 1 and not self.independent_processes:
            raise FusedOptimizerError(
                f"fused optimizer, {self.names[gi]}: torch.distributed runs {processes} processes, and a fused step "
                f"updates each parameter from this process's own gradient during the backward, before "
                f"DistributedDataParallel or FSDP average the gradients across processes: the replicas would drift "
                f"apart. Under DDP/FSDP use an unfused optimizer (optimizer.step() after backward). If each process "
                f"trains a model of its own, set independent_processes = True on the fused optimizer. No weight was "
                f"changed by this backward"
            )
        if self._float16_forward is not None:
            raise FusedOptimizerError(
                f"fused optimizer, {self.names[gi]}: this backward comes from a forward under float16 autocast on "
                f"{self._float16_forward}, which trains with a GradScaler, and {_NO_LOSS_SCALING}. No weight was "
                f"changed by this backward"
            )
        if self._step_called and gi in self._stepped:
            raise FusedOptimizerError(
                self._accumulation_message(gi, self._stepped[gi] + 1)
                + f"; this backward stops before stepping {self.names[gi]} again"
            )

    def _accumulation_message(self, gi: int, times: int) -> str:
        return (
            f"fused optimizer: {self.names[gi]} is stepped {times} times between two step() calls: several "
            f"backward passes per step (gradient accumulation, or a second loss) cannot be fused, because every "
            f"backward already steps each parameter on its own gradient. Call step() after every backward, or "
            f"accumulate with an unfused optimizer"
        )

    # -- looks like an optimizer ------------------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizers[0].defaults if self.optimizers else {}

    @property
    def state(self) -> dict[torch.Tensor, Any]:  # type: ignore[override]
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Updates nothing (the steps ran during backward); kept so an unchanged training loop still runs, and to
        refuse what a fused step cannot do: a GradScaler's step, and several backward passes since the last call."""
        if closure is not None:
            raise FusedOptimizerError("a fused optimizer steps during backward and cannot take a closure")
        scaled = "found_inf" in self.__dict__ or "grad_scale" in self.__dict__  # set by GradScaler.step
        self.__dict__.pop("found_inf", None)
        self.__dict__.pop("grad_scale", None)
        stepped, self._stepped, self._step_called = self._stepped, {}, True
        if scaled:
            moved = (
                f" The backward already stepped {len(stepped)} of {len(self.optimizers)} parameter groups on "
                f"the scaled gradients: restore the weights from a checkpoint."
                if stepped
                else ""
            )
            raise FusedOptimizerError(f"GradScaler.step() on a fused optimizer: {_NO_LOSS_SCALING}.{moved}")
        repeated = [(gi, n) for gi, n in stepped.items() if n > 1]
        if repeated:
            raise FusedOptimizerError(self._accumulation_message(*repeated[0]))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: fused steps free each gradient right after using it."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise FusedOptimizerError(
            "a fused optimizer's parameters are fixed when it is built; to train more "
            "parameters, fuse the model again (fused.remove(); fuse_optimizer(model, factory))"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        states = state.get("optimizers")
        if not isinstance(states, list) or len(states) != len(self.optimizers):
            raise FusedOptimizerError(
                f"state_dict holds {len(states) if isinstance(states, list) else 'no'} "
                f"optimizer states, this fused optimizer has {len(self.optimizers)}"
            )
        for opt, s in zip(self.optimizers, states):
            opt.load_state_dict(s)

    # -- copies and pickles -----------------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """What a learning-rate scheduler or GradScaler patched onto this object stays behind, as it does with
        torch's optimizers; the inner optimizers (with their state) and the parameters go along."""
        return {k: v for k, v in self.__dict__.items() if k not in self._TRANSIENT}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._index()

    def __repr__(self) -> str:
        kind = type(self.optimizers[0]).__name__ if self.optimizers else "none"
        return f"FusedOptimizer({len(self.optimizers)} x {kind}, {len(self.params)} parameters)"


def _refused(name: str) -> Callable[..., Any]:
    def method(self: FusedOptimizer, *args: Any, **kwargs: Any) -> Any:
        raise FusedOptimizerError(
            f"FusedOptimizer.{name}: a fused optimizer runs one optimizer per group inside the "
            f"backward; call {name} on each of fused.optimizers instead"
        )

    method.__name__ = name
    return method


# torch.optim.Optimizer's hook registrations need the state its __init__ builds; the inner optimizers have it.
for _name in [n for n in dir(torch.optim.Optimizer) if n.startswith("register_")]:
    setattr(FusedOptimizer, _name, _refused(_name))


@runtime_checkable
class StepsInBackward(Protocol):
    """What :func:`fuse_optimizer` needs from a module whose own backward steps a fused optimizer (a
    ``ReversibleSequential``): the internal protocol between the two features, so neither reads the other's fields.

    Such a module may be built with an optimizer of its own (``fused_optimizer_factory``, RevLib's
    ``fused_optimizer=``), which cannot be combined with :func:`fuse_optimizer`; otherwise the optimizer that
    :func:`fuse_optimizer` builds over the whole model is attached to it, so that its forward records what the
    optimizer must know (:meth:`FusedOptimizer.record_forward`) and :func:`fused_optimizer_of` and copies find it.
    """

    fused_optimizer_factory: OptimizerFactory | None

    def attach_fused_optimizer(self, optimizer: FusedOptimizer) -> None:
        """Use ``optimizer``, fused into a model containing this module."""

    def detach_fused_optimizer(self, optimizer: FusedOptimizer) -> None:
        """Stop using ``optimizer`` if it is the one attached (its fusion was removed)."""


def _refuse_fsdp_units(model: nn.Module, where: str) -> None:
    """FSDP2 writes each sharded parameter's ``.grad`` after its reduce-scatter instead of accumulating it, so no
    post-accumulate-grad hook fires and a fused step would never run: refused rather than training nothing."""
    unit_type = fsdp.fsdp_module_type()
    if unit_type is None:
        return
    for name, module in model.named_modules():
        if isinstance(module, unit_type):
            raise FusedOptimizerError(
                f"{where}: the module {name or type(module).__name__!r} is an FSDP2 unit (fully_shard). FSDP2 sets "
                f"each sharded parameter's gradient after reducing it across processes, without autograd's "
                f"accumulation, so a fused step would never run. Use an unfused optimizer (optimizer.step() after "
                f"backward)."
            )


class _HookedFusedOptimizer(FusedOptimizer):
    """A :class:`FusedOptimizer` driven by post-accumulate-grad hooks; :meth:`remove` undoes :func:`fuse_optimizer`.

    The model refers to it (a forward pre-hook, and reversible sequences inside it), so ``copy.deepcopy(model)``
    and ``torch.save(model)`` take it along: the copy is fused to its own optimizer, state included, and
    :func:`fused_optimizer_of` finds it. The parameters' hooks are not copied with them; they are set again."""

    _TRANSIENT = FusedOptimizer._TRANSIENT + ("_param_hooks",)

    def __init__(self, paths: Sequence[str], factory: OptimizerFactory, model: nn.Module):
        params = dict(model.named_parameters())
        super().__init__([[params[n]] for n in paths], factory, [f"parameter {n!r}" for n in paths])
        self._paths = list(paths)
        self._model = model
        self._model_params = tuple(model.parameters())
        self._model_hook = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        for module in model.modules():
            if isinstance(module, StepsInBackward):
                module.attach_fused_optimizer(self)
        self._hook_params()

    def _hook_params(self) -> None:
        self._param_hooks = [p.register_post_accumulate_grad_hook(self.step_accumulated) for p in self.params]

    def _before_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._follow_model()
        first = next(iter(backends.tensors_in((args, kwargs))), None)
        self.record_forward(first.device if first is not None else self.params[0].device)

    def _follow_model(self) -> None:
        """Rebind to the model's parameters when they were replaced by new tensors since the last forward (as
        ``model.to(device)`` does across tensor types, e.g. cpu to xla); their new tensors need the hooks too."""
        now = tuple(self._model.parameters())
        if len(now) == len(self._model_params) and all(a is b for a, b in zip(now, self._model_params)):
            return
        current = dict(self._model.named_parameters())
        missing = [n for n in self._paths if n not in current]
        if missing:
            raise FusedOptimizerError(
                f"fused optimizer: the model no longer has parameter {missing[0]!r}; fuse the "
                f"model again after changing it"
            )
        _refuse_fsdp_units(self._model, "fused optimizer")
        for h in self._param_hooks:
            h.remove()
        self.rebind([[current[n]] for n in self._paths])
        self._hook_params()
        self._model_params = now

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._hook_params()

    def remove(self) -> None:
        """Remove the hooks and detach reversible sequences from this optimizer (the model trains unfused again)."""
        self._unregister()
        for h in self._param_hooks:
            h.remove()
        self._param_hooks = []
        self._model_hook.remove()
        for module in self._model.modules():
            if isinstance(module, StepsInBackward):
                module.detach_fused_optimizer(self)


def _shared_parameters(model: nn.Module) -> dict[int, list[str]]:
    paths: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        paths.setdefault(id(p), []).append(name)
    return {k: v for k, v in paths.items() if len(v) > 1}


def _fused_by(param: torch.Tensor) -> FusedOptimizer | None:
    hooks = getattr(param, "_post_accumulate_grad_hooks", None) or {}
    return next((h.__self__ for h in hooks.values() if isinstance(getattr(h, "__self__", None), FusedOptimizer)), None)


def fused_optimizer_of(module: nn.Module) -> FusedOptimizer | None:
    """The fused optimizer of ``module``: the one :func:`fuse_optimizer` fused into it, or a ``ReversibleSequential``'s
    own (``fused_optimizer=``); ``None`` if it has none. A copy of a fused model (``copy.deepcopy``, ``torch.load``)
    is fused to a copy of the optimizer; this finds it."""
    for hook in module._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, _HookedFusedOptimizer):
            return owner
    own = getattr(module, "fused_optimizer", None)
    return own if isinstance(own, FusedOptimizer) else None


def fuse_optimizer(
    model: nn.Module, optimizer_factory: OptimizerFactory, *, max_grad_norm: float | None = None
) -> FusedOptimizer:
    """Fuse ``optimizer_factory``'s optimizer into ``model``'s backward pass and return it.

    Each trainable parameter gets its own optimizer ``optimizer_factory([param])`` and a post-accumulate-grad hook
    that steps it and frees ``param.grad`` the moment the gradient is complete; parameters inside a
    ``ReversibleSequential`` are stepped by its backward walk, layer by layer. After ``loss.backward()`` the model
    is updated and holds no gradients; ``optimizer.step()``/``zero_grad()`` on the returned object update nothing
    (``step()`` checks the loop, see the module docstring), schedulers take it as their optimizer, and
    ``.remove()`` undoes the fusion.

    ``max_grad_norm``: each parameter's gradient is clipped by its own norm to at most this before its step
    (per-parameter clipping: the global norm cannot be known before the first step; see the module docstring).
    ``torch.nn.utils.clip_grad_norm_`` on the fused parameters after the backward raises
    :class:`FusedOptimizerError` (their gradients are gone: it would clip nothing).

    Works on any module (plain ones, checkpointed ones, reversible sequences). Raises
    :class:`FusedOptimizerError` for tied parameters (naming their paths), for a factory that does not return an
    optimizer, for a model with no trainable parameter, and for parameters that are already fused. Gradient
    accumulation over several backward passes, loss scaling and global-norm clipping are not possible with a fused
    step.
    """
    if not isinstance(model, nn.Module):
        raise FusedOptimizerError(f"fuse_optimizer expects an nn.Module, got {type(model).__name__}")
    _refuse_fsdp_units(model, "fuse_optimizer")
    shared = _shared_parameters(model)
    if shared:
        paths = next(iter(shared.values()))
        raise FusedOptimizerError(
            f"fuse_optimizer: parameter shared by {', '.join(repr(p) for p in paths)} (tied weights); a fused step "
            f"cannot tell when its gradient is complete. Untie them, or train this model with an unfused optimizer"
        )
    named: list[tuple[str, nn.Parameter]] = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise FusedOptimizerError("fuse_optimizer: the model has no parameter that requires grad")
    for name, p in named:
        if _fused_by(p) is not None:
            raise FusedOptimizerError(
                f"fuse_optimizer: parameter {name!r} is already fused (an earlier fuse_optimizer on this model or on "
                f"a module inside it), and would be stepped twice per backward; call .remove() on that optimizer "
                f"first (revlib_xla.fused_optimizer_of(module) finds it)"
            )
    for module in model.modules():
        if isinstance(module, StepsInBackward) and module.fused_optimizer_factory is not None:
            raise FusedOptimizerError(
                f"fuse_optimizer: {type(module).__name__} was already built with fused_optimizer=...; use one or "
                f"the other"
            )
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and 0 < max_grad_norm < math.inf):
        raise FusedOptimizerError(f"fuse_optimizer: max_grad_norm={max_grad_norm!r}; give a positive finite number")
    fused = _HookedFusedOptimizer([n for n, _ in named], optimizer_factory, model)
    fused.max_grad_norm = max_grad_norm
    return fused
