"""FSDP2 (``torch.distributed.fsdp.fully_shard``) units inside a reversible backward: each block sharded on its own.

FSDP2 works through module hooks: a unit's pre-forward all-gathers its parameters (and swaps the module's sharded
parameters for unsharded ones), its post-forward reshards, a hook on its outputs all-gathers again for the backward,
and a function on its inputs reduce-scatters the gradients that autograd accumulated into the unsharded parameters.
The reversible forward runs the blocks without autograd, so none of the backward bookkeeping is set up there; it all
comes from the recomputation in the backward, which calls each block through its ``__call__``. For that to give
exact gradients and cost no more collectives than plain FSDP2, the recomputation of a layer:

* holds resharding (``set_reshard_after_forward(False, recurse=False)`` on the layer's units, restored after): the
  recomputed forward and its backward use one all-gather instead of two;
* accumulates the gradients of the unsharded parameters into their ``.grad`` (where FSDP2's post-backward takes
  them from and reduce-scatters them into the sharded parameters' ``.grad``) instead of returning them from the
  layer's autograd node;
* prefetches the previous layer's units explicitly (``set_modules_to_backward_prefetch``, restored after): FSDP2's
  default prefetch follows the post-forward order, which the recomputations append to, and would gather the wrong
  units.

Measured on 2 gloo processes (tests/train/test_distributed.py, bench/results/fsdp_collectives-cpu-gloo.md): as many
all-gathers and reduce-scatters per step as plain FSDP2 around the same blocks.

Layouts that cannot be made exact are refused at the forward, naming the module: a unit on a layer or on its
coupling wrapper (their ``forward`` never runs; shard the block), and a unit reached from several layers (FSDP2
unshards a unit once per backward; its second recomputation would run on sharded parameters).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "CollectiveCount",
    "FSDPLayoutError",
    "counted_steps",
    "counting_collectives",
    "fsdp_module_type",
    "fully_shard_function",
    "recomputing",
]


class FSDPLayoutError(ValueError):
    """FSDP2 units placed where a recomputing backward cannot run them exactly; the message names the module and the
    layout that works."""


def fsdp_module_type() -> type | None:
    """FSDP2's module class if torch's FSDP2 is loaded (its home moved in torch 2.6), else None. Looks only at
    loaded modules: a model can hold FSDP2 units only once FSDP2 was imported."""
    for name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        found = getattr(sys.modules.get(name), "FSDPModule", None)
        if isinstance(found, type):
            return found
    return None


def fully_shard_function() -> Any:
    """FSDP2's ``fully_shard`` (``torch.distributed.fsdp`` from torch 2.6, ``torch.distributed._composable.fsdp``
    before), or None where this torch has none."""
    try:
        from torch.distributed.fsdp import fully_shard

        return fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard

            return fully_shard
        except ImportError:
            return None


def _state(unit: nn.Module) -> Any:
    """The FSDP state a unit shares with the other modules of one ``fully_shard([...])`` call (the unit itself on a
    torch without the accessor)."""
    get = getattr(unit, "_get_fsdp_state", None)
    return unit if get is None else get()


@contextlib.contextmanager
def _held(units: Sequence[nn.Module], prefetch: Sequence[nn.Module] | None) -> Iterator[None]:
    """Run with ``units`` not resharding after their forward and prefetching ``prefetch`` in their backward (None:
    each itself, a no-op while it is unsharded: an empty list would mean FSDP2's default prefetch, which follows the
    post-forward order that recomputations append to, and gathers a unit the backward does not run next); both
    settings are put back after. FSDP2 has setters but no getters for them, so the previous values are read from its
    state where this torch keeps them (torch 2.5 .. 2.13), else the defaults are restored (reshard, default
    prefetch)."""
    saved = []
    for unit in units:
        state = _state(unit)
        group = getattr(state, "_fsdp_param_group", None)
        saved.append(
            (
                unit,
                state,
                group,
                getattr(group, "post_forward_mesh_info", True),
                getattr(state, "_auto_reshard_after_forward", None),
                list(getattr(state, "_states_to_backward_prefetch", ())),
            )
        )
        unit.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]  # an FSDPModule's method
        unit.set_modules_to_backward_prefetch([unit] if prefetch is None else list(prefetch))  # type: ignore[operator]
    try:
        yield
    finally:
        for unit, state, group, mesh_info, auto, prefetched in saved:
            if group is not None and hasattr(group, "post_forward_mesh_info"):
                group.post_forward_mesh_info = mesh_info
                if auto is not None:
                    state._auto_reshard_after_forward = auto
            else:
                unit.set_reshard_after_forward(True, recurse=False)  # type: ignore[operator]
            if hasattr(state, "_states_to_backward_prefetch"):
                state._states_to_backward_prefetch = prefetched
            else:
                unit.set_modules_to_backward_prefetch([])  # type: ignore[operator]


@dataclasses.dataclass
class LayerUnits:
    """The FSDP2 units one layer's recomputation runs, and which of its parameters they manage."""

    units: list[nn.Module]  # in the layer's module order
    managed: list[tuple[nn.Module, str, int]]  # (module, name, position) of the parameters the units manage
    positions: frozenset[int]  # their positions among the layer's parameters (ReversibleSequential's layer_params)
    previous: list[nn.Module]  # the units of the nearest earlier layer that has some: prefetched in the backward

    def split(self, used: Sequence[int]) -> list[int]:
        """Of the layer's parameter positions the backward uses, those whose gradients the layer's autograd node
        returns; FSDP2 reduce-scatters the others' from their unsharded parameters."""
        return [j for j in used if j not in self.positions]

    def recomputing(self, prefetch: bool) -> contextlib.AbstractContextManager[None]:
        """Around the layer's recomputation and gradient: resharding held, the previous layer prefetched (when the
        walk goes on to it)."""
        return _held(self.units, self.previous if prefetch and self.previous else None)

    def vjp(
        self, out: torch.Tensor, inputs: Sequence[torch.Tensor], grad: torch.Tensor, used: Sequence[int]
    ) -> list[torch.Tensor | None]:
        """The gradients of ``out`` (weighted by ``grad``) with respect to ``inputs`` (fresh leaves), while the
        gradients of the units' unsharded parameters at the ``used`` positions accumulate into their ``.grad``, for
        FSDP2's post-backward to reduce-scatter. One engine call: FSDP2 runs that post-backward inside it, once the
        layer's gradients are complete. Call after the recomputation, which left the units unsharded (resharding
        held), so the modules hold the unsharded parameters."""
        if not out.requires_grad:
            return [None] * len(inputs)
        wanted = set(used)
        unsharded = {id(p): p for m, name, j in self.managed if j in wanted and (p := m._parameters[name]) is not None}
        targets = [*inputs, *(p for p in unsharded.values() if p.requires_grad)]
        torch.autograd.backward(out, grad, inputs=targets)
        grads = [t.grad for t in inputs]
        for t in inputs:
            t.grad = None
        return grads


def recomputing(module: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Around a recomputation of ``module`` with autograd in a backward pass (a :class:`~revlib_xla.Checkpointable`
    stage): its FSDP2 units keep their parameters unsharded from the recomputed forward to their backward (one
    all-gather for both, not two) and prefetch nothing the backward does not run next."""
    unit_type = fsdp_module_type()
    units = [] if unit_type is None else [m for m in module.modules() if isinstance(m, unit_type)]
    return _held(units, None) if units else contextlib.nullcontext()


def layer_units(
    layers: Sequence[nn.Module],
    blocks: Sequence[nn.Module],
    names: Sequence[str],
    param_slots: Sequence[Sequence[tuple[nn.Module, str, int]]],
) -> list[LayerUnits | None] | None:
    """Per layer of a reversible sequence (``layers[i]`` runs ``blocks[i]`` through its ``__call__``), the FSDP2
    units its recomputation runs; None when no layer has one (FSDP2 not loaded, or no unit inside: a unit on the
    sequence or around it needs nothing, its parameters stay unsharded through the forward and the backward).

    Raises :class:`FSDPLayoutError` for a unit the reversible backward cannot run exactly."""
    unit_type = fsdp_module_type()
    if unit_type is None:
        return None
    found: list[list[nn.Module]] = []
    owner: dict[int, str] = {}  # id of an FSDP state -> the layer whose recomputation runs it
    for layer, block, name in zip(layers, blocks, names):
        inside = {id(m) for m in block.modules()}
        for sub_name, module in layer.named_modules():
            if isinstance(module, unit_type) and id(module) not in inside:
                where, role = (f"{name}.{sub_name}", "its coupling wrapper") if sub_name else (name, "a layer")
                raise FSDPLayoutError(
                    f"ReversibleSequential: the module {where!r} ({role}) is an FSDP2 unit "
                    f"(fully_shard), but the reversible layers never run its forward, so its parameters would stay "
                    f"sharded when the block runs. Shard the block itself: fully_shard(sequence[{name!r}].block) "
                    f"(or modules inside it)."
                )
        units = [m for m in block.modules() if isinstance(m, unit_type)]
        for unit in units:
            key = id(_state(unit))
            if key in owner and owner[key] != name:
                raise FSDPLayoutError(
                    f"ReversibleSequential: the FSDP2 unit {type(unit).__name__} is run by layer {owner[key]!r} and "
                    f"by layer {name!r}. The reversible backward recomputes each layer in a backward phase of its own, "
                    f"and FSDP2 unshards a unit once per backward: the second recomputation would run on sharded "
                    f"parameters. Give each layer its own modules (one fully_shard per block), or shard the whole "
                    f"sequence with one fully_shard(sequence)."
                )
            owner[key] = name
        found.append(units)
    if not any(found):
        return None
    result: list[LayerUnits | None] = []
    previous: list[nn.Module] = []
    for units, slots in zip(found, param_slots):
        if not units:
            result.append(None)
            continue
        under = {id(m) for unit in units for m in unit.modules()}
        managed = [(module, name, j) for module, name, j in slots if id(module) in under]
        result.append(LayerUnits(units, managed, frozenset(j for _, _, j in managed), previous))
        previous = units
    return result


@dataclasses.dataclass
class CollectiveCount:
    """FSDP2's all-gathers and reduce-scatters in this process while :func:`counting_collectives` is active (one
    per unit and call: a unit's parameters are gathered and their gradients reduced as one group), and the
    elements they gathered and reduced (whole parameters': what compares layouts whose units differ in size)."""

    all_gathers: int = 0
    reduce_scatters: int = 0
    gathered: int = 0
    reduced: int = 0


def _whole_numel(fsdp_param: Any) -> int:
    """The elements of the whole parameter an FSDP2 ``FSDPParam`` manages (its sharded ``DTensor``'s global
    shape; 0 where this torch keeps it elsewhere)."""
    sharded = getattr(fsdp_param, "sharded_param", None)
    return 0 if sharded is None else sharded.numel()


@contextlib.contextmanager
def counting_collectives() -> Iterator[CollectiveCount]:
    """Count FSDP2's all-gathers and reduce-scatters (a diagnostic, as in the tests and ``bench/fsdp_collectives.py``):
    wraps the functions FSDP2's parameter groups call for them, ``foreach_all_gather`` and ``foreach_reduce`` (torch
    2.5 .. 2.13). Raises ``RuntimeError`` on a torch whose FSDP2 has neither, rather than counting nothing."""
    groups = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_param_group") or sys.modules.get(
        "torch.distributed._composable.fsdp._fsdp_param_group"
    )
    names = ("foreach_all_gather", "foreach_reduce")
    if groups is None or not all(callable(getattr(groups, n, None)) for n in names):
        raise RuntimeError(
            "counting_collectives: this torch's FSDP2 has no foreach_all_gather/foreach_reduce to count (or FSDP2 is "
            "not imported yet: call fully_shard first)"
        )
    count = CollectiveCount()
    originals = {n: getattr(groups, n) for n in names}

    def counted(name: str, field: str, elements: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            params = args[0] if args else kwargs.get("fsdp_params", ())  # both take the unit's FSDPParams first
            setattr(count, field, getattr(count, field) + 1)
            setattr(count, elements, getattr(count, elements) + sum(_whole_numel(p) for p in params))
            return originals[name](*args, **kwargs)

        return call

    setattr(groups, "foreach_all_gather", counted("foreach_all_gather", "all_gathers", "gathered"))  # noqa: B010
    setattr(groups, "foreach_reduce", counted("foreach_reduce", "reduce_scatters", "reduced"))  # noqa: B010
    try:
        yield count
    finally:
        for name, original in originals.items():
            setattr(groups, name, original)


def counted_steps(step: Callable[..., Any], counts: list[CollectiveCount]) -> Callable[..., Any]:
    """``step`` (a training step, e.g. :func:`revlib_xla.train.strategy.make_step`'s) that appends FSDP2's
    all-gathers and reduce-scatters of each call to ``counts``, one :class:`CollectiveCount` per step (a
    diagnostic: how ``revlib-xla train`` is counted in tests/train/test_fsdp2_cli.py and
    ``bench/fsdp_collectives.py``)."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        with counting_collectives() as count:
            result = step(*args, **kwargs)
        counts.append(count)
        return result

    return counted
