"""The optimizer step fused into the backward pass: each parameter is updated as soon as its gradient is complete,
and that gradient is freed at once, so a training step never holds more than a layer's worth of gradients.

Two ways in, one object (:class:`FusedOptimizer`) behind both:

* ``revlib_xla.fuse_optimizer(model, factory)`` works on any module. Like ``torch.distributed.fsdp.fully_shard``,
  it acts per parameter: a post-accumulate-grad hook on every trainable parameter steps that parameter's own
  optimizer (built by ``factory([param])``) and drops ``param.grad``. Anything that produces gradients through
  ordinary autograd leaves (plain modules, ``torch.utils.checkpoint``, the planner's ``Checkpointable``) works with
  it unchanged. Reversible sequences inside the model step their layers themselves, during their backward walk
  (their parameter gradients would otherwise all arrive together when the sequence's backward ends).
* ``ReversibleSequential(..., fused_optimizer=factory)`` (RevLib's API) builds one optimizer per layer and steps
  it inside the reversible backward, right after the layer's gradients are computed.

Why the results equal an unfused step bit for bit: torch's optimizers update each parameter from its own gradient
and its own state only (SGD, momentum, Adam, AdamW; no global-norm clipping), with the same kernels whatever the
grouping, and the steps run synchronously on the compute stream (cuda) or are traced into the same step graph
(xla), so nothing races with the next forward. Optimizers that couple parameters (gradient clipping by the global
norm, LAMB's trust ratio over groups, ZeRO) cannot be fused this way.

Shared (tied) parameters are refused: their gradient arrives in parts (one per use under reversible or
checkpointed backward), and a step on the first part would both be wrong and change a weight the rest of the
backward still reads.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

__all__ = ["OptimizerFactory", "FusedOptimizer", "FusedOptimizerError", "fuse_optimizer"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class FusedOptimizerError(ValueError):
    """A fused optimizer was asked for something it cannot do; the message names the parameter and the problem."""


class FusedOptimizer:
    """Per-group optimizers that are stepped during the backward pass (see the module docstring).

    ``groups`` are lists of parameters; ``factory(group)`` must return a ``torch.optim.Optimizer`` for each. The
    object looks enough like one optimizer for the training loop around it: ``param_groups`` (all groups' dicts, so
    learning-rate schedulers and manual ``lr`` changes reach every step), ``state_dict``/``load_state_dict``, and
    ``step()``/``zero_grad()``, which are no-ops because the work already happened in the backward.
    """

    def __init__(self, groups: Sequence[Sequence[nn.Parameter]], factory: OptimizerFactory,
                 names: Optional[Sequence[str]] = None):
        if not callable(factory):
            raise FusedOptimizerError(f"the fused optimizer factory must be callable (params -> torch.optim."
                                      f"Optimizer), got {type(factory).__name__}")
        self.names = list(names) if names is not None else [f"group {i}" for i in range(len(groups))]
        self.optimizers: List[torch.optim.Optimizer] = []
        self._of: Dict[int, int] = {}
        for gi, group in enumerate(groups):
            group = list(group)
            opt = factory(group)
            if not isinstance(opt, torch.optim.Optimizer):
                raise FusedOptimizerError(
                    f"the fused optimizer factory returned {type(opt).__name__} for {self.names[gi]}; it must return "
                    f"a torch.optim.Optimizer built on the parameters it is given, e.g. "
                    f"lambda params: torch.optim.SGD(params, lr=1e-3)")
            given = {id(p) for p in group}
            got = {id(p) for g in opt.param_groups for p in g["params"]}
            if got != given:
                raise FusedOptimizerError(
                    f"the optimizer the factory built for {self.names[gi]} does not hold exactly the parameters it was "
                    f"given ({len(got)} instead of {len(given)}); build it on the factory's argument")
            self.optimizers.append(opt)
            for p in group:
                self._of[id(p)] = gi
        self.params = [p for group in groups for p in group]
        self.steps_taken = 0  # optimizer steps run in backward passes (one per group and step)

    def covers(self, param: torch.Tensor) -> bool:
        return id(param) in self._of

    def step_params(self, params: Sequence[nn.Parameter], grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Give ``params`` their complete gradients ``grads``, step the optimizers that own them, and free the
        gradients. A gradient already in ``param.grad`` (left by the caller) is added, as autograd would."""
        owners: List[int] = []
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

        Autograd also runs the hook when a reversible sequence already stepped the parameter in its backward and
        passed no gradient on; there is nothing to do then."""
        if param.grad is not None:
            self._step_groups([self._of[id(param)]])

    def _step_groups(self, owners: Sequence[int]) -> None:
        for gi in owners:
            opt = self.optimizers[gi]
            opt.step()
            self.steps_taken += 1
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = None

    # -- looks like an optimizer ------------------------------------------------------------------------------------
    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:
        """No-op (the steps ran during backward); kept so an unchanged training loop still runs."""
        if closure is not None:
            raise FusedOptimizerError("a fused optimizer steps during backward and cannot take a closure")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op: fused steps free each gradient right after using it."""

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        states = state.get("optimizers")
        if not isinstance(states, list) or len(states) != len(self.optimizers):
            raise FusedOptimizerError(f"state_dict holds {len(states) if isinstance(states, list) else 'no'} "
                                      f"optimizer states, this fused optimizer has {len(self.optimizers)}")
        for opt, s in zip(self.optimizers, states):
            opt.load_state_dict(s)

    def __repr__(self) -> str:
        kind = type(self.optimizers[0]).__name__ if self.optimizers else "none"
        return f"FusedOptimizer({len(self.optimizers)} x {kind}, {len(self.params)} parameters)"


class _HookedFusedOptimizer(FusedOptimizer):
    """A :class:`FusedOptimizer` driven by post-accumulate-grad hooks; :meth:`remove` undoes :func:`fuse_optimizer`."""

    def __init__(self, groups, factory, names, model: nn.Module):
        super().__init__(groups, factory, names)
        self._model = model
        self._handles: List[Any] = []

    def remove(self) -> None:
        """Remove the hooks and detach reversible sequences from this optimizer (the model trains unfused again)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for module in self._model.modules():
            if getattr(module, "_attached_fused_optimizer", None) is self:
                module._attached_fused_optimizer = None


def _shared_parameters(model: nn.Module) -> Dict[int, List[str]]:
    paths: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        paths.setdefault(id(p), []).append(name)
    return {k: v for k, v in paths.items() if len(v) > 1}


def fuse_optimizer(model: nn.Module, optimizer_factory: OptimizerFactory) -> FusedOptimizer:
    """Fuse ``optimizer_factory``'s optimizer into ``model``'s backward pass and return it.

    Each trainable parameter gets its own optimizer ``optimizer_factory([param])`` and a post-accumulate-grad hook
    that steps it and frees ``param.grad`` the moment the gradient is complete; parameters inside a
    ``ReversibleSequential`` are stepped by its backward walk, layer by layer. After ``loss.backward()`` the model
    is updated and holds no gradients; ``optimizer.step()``/``zero_grad()`` on the returned object are no-ops, and
    ``.remove()`` undoes the fusion.

    Works on any module (plain ones, checkpointed ones, reversible sequences). Raises
    :class:`FusedOptimizerError` for tied parameters (naming their paths), for a factory that does not return an
    optimizer, and for a model with no trainable parameter. Gradient accumulation over several backward passes
    and global-norm clipping are not possible with a fused step.
    """
    if not isinstance(model, nn.Module):
        raise FusedOptimizerError(f"fuse_optimizer expects an nn.Module, got {type(model).__name__}")
    shared = _shared_parameters(model)
    if shared:
        paths = next(iter(shared.values()))
        raise FusedOptimizerError(
            f"fuse_optimizer: parameter shared by {', '.join(repr(p) for p in paths)} (tied weights); a fused step "
            f"cannot tell when its gradient is complete. Untie them, or train this model with an unfused optimizer")
    named: List[Tuple[str, nn.Parameter]] = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise FusedOptimizerError("fuse_optimizer: the model has no parameter that requires grad")
    fused = _HookedFusedOptimizer([[p] for _, p in named], optimizer_factory, [f"parameter {n!r}" for n, _ in named],
                                  model)
    for module in model.modules():
        if hasattr(module, "_attached_fused_optimizer"):  # a ReversibleSequential: steps its layers in its backward
            if getattr(module, "fused_optimizer_factory", None) is not None:
                fused.remove()
                raise FusedOptimizerError(
                    f"fuse_optimizer: {type(module).__name__} was already built with fused_optimizer=...; use one or "
                    f"the other")
            module._attached_fused_optimizer = fused
    for _, p in named:
        fused._handles.append(p.register_post_accumulate_grad_hook(fused.step_accumulated))
    return fused
