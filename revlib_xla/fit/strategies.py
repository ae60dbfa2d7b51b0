"""A run config's training step, traced and sized per memory strategy: what ``revlib-xla memory`` compares.

The step is exactly the one ``revlib-xla train`` runs: the model of :func:`revlib_xla.train.strategy.build_model`
(built on ``meta``), its optimizer (:func:`~revlib_xla.train.strategy.build_optimizer`) and its step function
(:func:`~revlib_xla.train.strategy.make_step`), traced at full size by :func:`revlib_xla.fit.trace_step` on a
``(batch, seq_len)`` token batch. A strategy is a set of config overrides applied on top of the user's config
(:data:`STRATEGIES`), so everything else (precision, model size, sequence length) stays as configured.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..chips import Chip
from .report import FitReport, StepDoesNotFit, compile_or_refuse, compile_steps
from .search import BatchSearch, max_batch
from .trace import TracedStep, trace_step

__all__ = [
    "STRATEGIES",
    "Strategy",
    "strategy",
    "load",
    "trace_config",
    "size_strategies",
    "search_strategies",
    "smallest_change",
]


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A named memory strategy: the config overrides that select it and what it is, in words."""

    name: str
    overrides: tuple[str, ...]
    description: str


#: The strategies compared by default, cheapest in compute first.
STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("config", (), "the config as written"),
        Strategy("none", ("strategy.activations=none",), "plain torch_xla: autograd keeps every activation"),
        Strategy(
            "checkpoint", ("strategy.activations=checkpoint",), "torch_xla checkpointing of every transformer block"
        ),
        Strategy("reversible", ("strategy.activations=reversible",), "reversible two-stream blocks (RevLib style)"),
        Strategy("plan", ("strategy.activations=plan", "strategy.budget=auto"), "the planner's schedule, budget auto"),
        Strategy(
            "plan+fewbit",
            ("strategy.activations=plan", "strategy.budget=auto", "strategy.fewbit=2"),
            "plan auto with 2-bit FewBit derivatives of the MLP activation",
        ),
        Strategy(
            "reversible+offload",
            ("strategy.activations=reversible", "strategy.offload.optimizer=true"),
            "reversible, with AdamW stepping on the host over host master weights and state (ZeRO-Offload style)",
        ),
        Strategy(
            "reversible+offload+bf16",
            (
                "strategy.activations=reversible",
                "strategy.offload.optimizer=true",
                "strategy.precision=bf16",
                "strategy.param_dtype=bf16",
            ),
            "reversible with bfloat16 weights and gradients on the device; float32 master weights and AdamW on "
            "the host (ZeRO-Offload's mixed precision); the loss in chunks (strategy.loss_chunk=auto)",
        ),
        Strategy(
            "reversible+offload+bf16+stream",
            (
                "strategy.activations=reversible",
                "strategy.offload.optimizer=true",
                "strategy.offload.gradients=true",
                "strategy.precision=bf16",
                "strategy.param_dtype=bf16",
            ),
            "reversible+offload+bf16 with each gradient sent to the host as the backward produces it (no full set "
            "of gradients on the device); AdamW steps the float32 masters there, each weight as soon as its "
            "gradient is whole where no global-norm clipping needs them all",
        ),
        Strategy(
            "reversible+offload+bf16+scan",
            (
                "strategy.activations=reversible",
                "strategy.offload.optimizer=true",
                "strategy.precision=bf16",
                "strategy.param_dtype=bf16",
                "model.scan=true",
            ),
            "reversible+offload+bf16 with the layers stacked and run as one XLA loop (model.scan=true): one layer "
            "compiled whatever the depth",
        ),
        Strategy(
            "reversible+fused",
            (
                "strategy.activations=reversible",
                "strategy.fused_optimizer=true",
                "optim.grad_clip=0",
                "model.overrides.tie_embeddings=false",
            ),
            "reversible, each weight stepped in the backward pass (no full set of gradients); untied embeddings and "
            "no global-norm clipping, which a fused step cannot do",
        ),
        Strategy(
            "plan+fewbit+offload",
            (
                "strategy.activations=plan",
                "strategy.budget=auto",
                "strategy.fewbit=2",
                "strategy.offload.optimizer=true",
            ),
            "plan + fewbit, with AdamW stepping on the host over host master weights and state",
        ),
    )
}
DEFAULT_COMPARISON = (
    "none",
    "checkpoint",
    "reversible",
    "plan",
    "plan+fewbit",
    "plan+fewbit+offload",
    "reversible+offload",
    "reversible+offload+bf16",
    "reversible+fused",
)
#: The strategies compared on a GPU: the same, and the gradients streamed to the host, which needs an eager device
#: (on XLA a gradient exists only once the traced step runs)
GPU_COMPARISON = (*DEFAULT_COMPARISON[:-1], "reversible+offload+bf16+stream", DEFAULT_COMPARISON[-1])


def strategy(name: str) -> Strategy:
    """The strategy called ``name``; a ``ValueError`` naming the choices otherwise."""
    found = STRATEGIES.get(name.strip())
    if found is None:
        raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    return found


def load(config: str | None, overrides: Sequence[str], chosen: Strategy, batch: int | None = None) -> Any:
    """The run config (:func:`revlib_xla.train.config.load_config`) with the strategy's overrides (and
    ``data.batch_size=batch``) applied after the user's."""
    from ..train.config import load_config

    extra = list(chosen.overrides) + ([f"data.batch_size={batch}"] if batch is not None else [])
    return load_config(config, [*overrides, *extra])


def trace_config(cfg: Any) -> TracedStep:
    """The steady-state training step of run config ``cfg``, traced at full size without allocating it. Over
    ``chip.chips > 1`` chips, the step is split over the config's ``mesh`` of them
    (:func:`revlib_xla.sharding.shard_step`): compiled, its figures are per chip."""
    from ..planner import InfeasibleBudget
    from ..sharding import resolve_mesh, shard_step
    from ..train import strategy as train_strategy

    mesh = resolve_mesh(cfg.mesh.axes(), cfg.chip.chips, backend_name=f"{cfg.chip.chips}-chip {cfg.chip.name} slice")
    model = train_strategy.build_model(cfg, "meta")
    tokens = torch.empty(cfg.data.batch_size, cfg.data.seq_len, dtype=torch.int64, device="meta")
    try:
        traced = trace_step(
            model,
            lambda m: train_strategy.build_optimizer(cfg, m),
            lambda m, optimizer: train_strategy.make_step(cfg, m, optimizer),  # type: ignore[arg-type]
            [tokens],
        )
    except InfeasibleBudget as exc:  # the planner's smallest schedule exceeds what the chip leaves it
        raise _does_not_fit(cfg, exc) from None
    return shard_step(dataclasses.replace(traced, notes=plan_notes(model)), mesh)


def plan_notes(model: torch.nn.Module) -> tuple[str, ...]:
    """What the planner decided for each planned part of ``model`` (a ``Checkpointable`` whose schedule is made),
    in words: its budget, whether the schedule recomputes, and its activation bytes against storing everything.
    A plan whose budget holds every activation recomputes nothing: its step is the plain one, and its memory the
    same; this says so where a table would otherwise show two equal rows without a reason."""
    from ..planner import OPERATIONS, OpKind
    from ..planner.checkpointable import Checkpointable
    from ..units import format_bytes

    notes = []
    for part in model.modules():
        if not isinstance(part, Checkpointable) or part.sequence is None:
            continue
        schedule, stages = part.sequence, part.sequence.chain.length
        forwards = sum(n for kind, n in schedule.counts().items() if OPERATIONS[OpKind(kind)].first_forward)
        reruns = forwards - stages
        budget = part.mem_limit
        within = "its default budget" if budget is None else f"the budget of {format_bytes(round(budget))}"
        planned, everything = round(part.get_expected_memory()), round(part.no_checkpoint_memory())
        if reruns <= 0:
            notes.append(
                f"the planner keeps every activation of its {stages} stages ({format_bytes(planned)}, within "
                f"{within}): nothing is recomputed, so the step is the one without checkpointing"
            )
        else:
            notes.append(
                f"the planner's schedule runs {reruns} stage forward{'s' if reruns != 1 else ''} again in the backward "
                f"to keep the activations of its {stages} stages within {within}: {format_bytes(planned)} planned, "
                f"{format_bytes(everything)} to keep them all"
            )
    return tuple(notes)


def _does_not_fit(cfg: Any, exc: Any) -> StepDoesNotFit:
    """The :class:`StepDoesNotFit` of ``cfg``'s planned step whose smallest schedule needs ``exc.minimum`` bytes of
    activations: the parameters, gradients and optimizer state one chip holds come on top."""
    from ..train import strategy as train_strategy

    count = train_strategy.params_per_chip(cfg)
    held = count * train_strategy.state_bytes_per_param(cfg)
    parameters = count * train_strategy.weight_bytes_per_param(cfg)
    optimizer = count * train_strategy.optimizer_bytes_per_param(cfg)
    return StepDoesNotFit(str(exc), held + int(exc.minimum), parameters, optimizer)


def size_strategies(
    config: str | None, overrides: Sequence[str], chip: Chip, strategies: Sequence[Strategy]
) -> list[FitReport]:
    """Each strategy's step at the config's batch, compiled for ``chip`` (one compiler process for all)."""
    configs = [load(config, overrides, s) for s in strategies]
    tracers = [functools.partial(trace_config, cfg) for cfg in configs]
    labels, batches = [s.name for s in strategies], [cfg.data.batch_size for cfg in configs]
    return compile_or_refuse(tracers, chip, labels, batches, compile_steps)


def search_strategies(
    config: str | None, overrides: Sequence[str], chip: Chip, strategies: Sequence[Strategy], limit: int = 4096
) -> list[BatchSearch]:
    """Per strategy, the largest batch whose step fits ``chip`` (:func:`revlib_xla.fit.max_batch`)."""

    def tracer(chosen: Strategy) -> Callable[[int], TracedStep]:
        return lambda batch: trace_config(load(config, overrides, chosen, batch))

    return [max_batch(tracer(s), chip, label=s.name, limit=limit) for s in strategies]


def smallest_change(
    config: str | None, overrides: Sequence[str], chip: Chip, reports: Sequence[FitReport], limit: int = 4096
) -> str:
    """What to change so that a config that does not fit does: the first strategy (cheapest first) that fits at
    the config's batch; if none does, the largest batch that fits with the strategy needing the least memory;
    if not even batch 1 fits, why, in bytes."""
    for report in reports:
        if report.fits and report.label != "config":
            return f"strategy {report.label} fits at batch {report.batch} ({STRATEGIES[report.label].description})"
    leanest = min(reports, key=lambda r: r.at_least)
    found = max_batch(
        lambda b: trace_config(load(config, overrides, STRATEGIES[leanest.label], b)),
        chip,
        label=leanest.label,
        limit=min(limit, max(leanest.batch - 1, 1)),
    )
    if found.best:
        return f"strategy {leanest.label} with data.batch_size={found.best} fits"
    failure = found.smallest_failure
    assert failure is not None
    return (
        f"nothing fits on one {chip.name}: even batch 1 with strategy {leanest.label} needs at least "
        f"{failure.at_least / 2**30:.2f} GiB of {chip.usable_bytes / 2**30:.2f} GiB usable (parameters "
        f"{failure.parameters / 2**30:.2f} GiB, optimizer state {failure.optimizer / 2**30:.2f} GiB); use a "
        f"smaller model, a chip with more memory or strategy.offload.optimizer=true"
    )
