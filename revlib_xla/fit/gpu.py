"""A run config's training step sized for a GPU without one: ``revlib-xla memory --gpu NAME``.

The step is the one ``revlib-xla train`` runs on cuda (:func:`revlib_xla.train.strategy.build_model`,
``build_optimizer``, ``make_step``), run on ``FakeTensor`` s of the host device (nothing is allocated, so a model of
any size is sized on a laptop; nothing needs torch_xla, libtpu or jax) as the eager program a GPU runs, and counted
by :class:`revlib_xla.memory.StorageTracker`: every tensor storage live at once, rounded to the CUDA caching
allocator's 512-byte blocks. The first step creates the optimizer state (and, for ``plan``, measures the stages);
the second, the steady state, is the one counted. What makes it the GPU's step rather than the host's:

* the config's ``chip.name`` is the GPU's (``plan``'s auto budget is that GPU's memory less the parameters,
  gradients and optimizer state);
* AdamW's step runs as ``optim.implementation`` chooses on cuda (``auto``: torch's fused kernel, no temporaries;
  ``foreach``, torch's own default there, makes temporaries the size of all gradients);
* with ``strategy.offload.optimizer`` the optimizer state and float32 master weights live in host memory (the
  ``host`` column) and the device's part of the step is the forward and backward.

What it does not count: the CUDA context and library workspaces (cuBLAS, cuDNN, a few hundred MiB), and the caching
allocator's reserve above what it hands out (fragmentation; ``revlib-xla train`` logs it as ``reserved_bytes``).
Kernels that allocate inside themselves (a fused attention's workspace) are counted by their outputs only, as on the
host. The same steps run on real host tensors (``estimate_step(cfg, fake=False)``) give the same storage peak, and
the host allocator's own peak within 10 % of it (tested at a small width; the storage count can read a little above
the allocator where a view of a tensor made before the count is first seen as new).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..chips import Chip
from ..memory import StorageTracker, tensor_bytes
from . import progress
from .report import FitReport, StepDoesNotFit
from .search import BatchSearch, max_batch
from .strategies import plan_notes

__all__ = ["GPU_SOURCE", "GPU_FOOTNOTE", "GpuStep", "for_gpu", "estimate_step", "gpu_reports", "gpu_max_batch"]

GPU_SOURCE = "an eager estimate on FakeTensors (tensor storages, 512-byte blocks), not a GPU run"

GPU_FOOTNOTE = (
    "Figures for one GPU, " + GPU_SOURCE + ": the steady-state step of `revlib-xla train` run on fake tensors "
    "(nothing allocated), every tensor storage live at once counted. total = that peak; parameters, optimizer "
    "state, inputs = their bytes; gradients+activations+temporaries = the rest of the peak (buffers in inputs+other); "
    "host = an offloaded optimizer's state, float32 master weights and the gradients it keeps until the step; peak "
    "in = the phase (forward, backward, optimizer step) that sets the peak, with each phase's. Not counted: the "
    "CUDA context and library workspaces (a few hundred MiB) and the caching allocator's reserve above what it "
    "hands out (fragmentation: `revlib-xla train` logs it as reserved_bytes); leave headroom for them."
)


@dataclasses.dataclass(frozen=True)
class GpuStep:
    """The estimated memory of one steady-state step (bytes): ``peak`` on the GPU, and the parts of it that are
    ``parameters``, ``optimizer`` state, ``inputs`` (the token batch) and ``buffers``; ``host``: an offloaded
    optimizer's state and master weights, in host memory; ``allocated``: for a step that ran
    (:func:`estimate_step` with ``fake=False``), the peak its host allocator handed out (else None)."""

    peak: int
    parameters: int
    optimizer: int
    inputs: int
    buffers: int
    host: int
    allocated: int | None = None
    notes: tuple[str, ...] = ()
    #: the peak of each phase (forward, backward, optimizer step; the device's bytes), in the step's order
    phases: tuple[tuple[str, int], ...] = ()

    def report(self, chip: Chip, label: str = "", batch: int = 0) -> FitReport:
        """As a :class:`~revlib_xla.fit.report.FitReport` row for ``chip`` (``fits``: the peak within its memory)."""
        held = self.parameters + self.optimizer + self.inputs + self.buffers
        return FitReport(
            chip,
            label,
            batch,
            total=self.peak,
            at_least=self.peak,
            parameters=self.parameters,
            optimizer=self.optimizer,
            inputs=self.inputs,
            other=self.buffers,
            temporaries=self.peak - held,
            host=self.host,
            source=GPU_SOURCE,
            notes=self.notes,
            phases=self.phases,
        )


def for_gpu(cfg: Any, gpu: Chip) -> Any:
    """``cfg`` retargeted at ``gpu`` (``chip.name``, one chip): what ``plan``'s auto budget and the MFU read."""
    return cfg.model_copy(update={"chip": cfg.chip.model_copy(update={"name": gpu.name, "chips": 1})})


def _on_fake_host(model: nn.Module, mode: Any) -> None:
    """Give ``model`` (built on ``meta``) fake host tensors of the same shapes and dtypes for its parameters and
    buffers, in place: a tensor shared by several modules (tied weights, the planner's stages) stays shared."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in made:
            with mode:
                value = torch.zeros(t.shape, dtype=t.dtype, device="cpu")
            made[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) if parameter else value
        return made[id(t)]

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = fake(p, True)  # type: ignore[assignment]
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake(b, False)


def _state_tensors(optimizer: Any) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]


@contextlib.contextmanager
def _device_part_only(optimizer: Any) -> Iterator[None]:
    """Within the block an offloaded optimizer's step does nothing on the device: it updates host state; streamed
    gradients are freed as they arrive and not sent (:meth:`revlib_xla.optim.HostOptimizer.gradients_dropped`)."""
    if getattr(optimizer, "stream", None) is not None:
        with optimizer.gradients_dropped():
            yield
        return
    optimizer.step = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del optimizer.step


def estimate_step(cfg: Any, fake: bool = True) -> GpuStep:
    """The memory of ``cfg``'s steady-state training step on a GPU (see the module docstring); ``cfg`` as
    :func:`for_gpu` makes it. Raises :class:`~revlib_xla.fit.report.StepDoesNotFit` when ``plan`` finds no
    schedule within the budget.

    ``fake=False`` runs the same steps on real host tensors (weights from ``train.seed``), to check the estimate
    against what a step that runs holds: :attr:`GpuStep.allocated` is then the peak of the bytes the host's
    allocator handed out during a third step (:func:`revlib_xla.memory.allocator_peak`) above what was allocated
    before it, plus the tensors the step starts from."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..memory import allocator_peak
    from ..planner import InfeasibleBudget
    from ..train import strategy as train_strategy
    from ..train.strategies.optimizer import implementation_flags, step_implementation
    from .strategies import _does_not_fit

    mode: Any = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    allocated = None
    try:
        if fake:
            model = train_strategy.build_model(cfg, "meta")
            _on_fake_host(model, mode)
        else:
            model = train_strategy.build_model(cfg, "cpu")
        with mode, warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning)
            optimizer = train_strategy.build_optimizer(cfg, model)
            flags = implementation_flags(step_implementation(cfg, "cuda"))  # what the step runs on cuda
            for group in optimizer.param_groups if not cfg.strategy.offload.optimizer else []:
                group.update({"foreach": None, "fused": None, **flags})
            report = train_strategy.StepReport()
            step = train_strategy.make_step(cfg, model, optimizer, report)
            tokens = torch.zeros(cfg.data.batch_size, cfg.data.seq_len, dtype=torch.int64)
            step(tokens)  # the optimizer state exists from here on (and the plan is measured)
            params = list(model.parameters())
            state = _state_tensors(optimizer)
            offloaded = bool(cfg.strategy.offload.optimizer)
            tracker = StorageTracker()
            tracker.track(model, tokens, *([] if offloaded else state))
            report.on_phase = tracker.phase
            with tracker, _device_part_only(optimizer) if offloaded else contextlib.nullcontext():
                step(tokens)
            report.on_phase = None
            if not fake:
                with _device_part_only(optimizer) if offloaded else contextlib.nullcontext():
                    rise = allocator_peak(step, tokens).increase
                allocated = rise + tensor_bytes([*params, *model.buffers(), tokens, *([] if offloaded else state)])
    except InfeasibleBudget as exc:  # no schedule within the budget the GPU leaves
        raise _does_not_fit(cfg, exc) from None
    except train_strategy.StrategyError as exc:
        if str(exc).startswith("strategy.budget=auto"):  # the state alone fills the GPU: no budget at all
            raise _does_not_fit(cfg, InfeasibleBudget(str(exc), 0.0)) from None
        raise
    host = 0
    if offloaded:
        masters = getattr(optimizer, "host", None)
        host = tensor_bytes(state) + (tensor_bytes(masters) if masters is not None else tensor_bytes(params))
        step_bytes = getattr(optimizer, "host_step_bytes", None)
        if step_bytes is not None:  # the gradients on the host until the step: one, or all of them (streamed)
            host += step_bytes()
    return GpuStep(
        peak=tracker.peak("cpu"),
        parameters=tensor_bytes(params),
        optimizer=0 if offloaded else tensor_bytes(state),
        inputs=tensor_bytes(tokens),
        buffers=tensor_bytes(list(model.buffers())),
        host=host,
        allocated=allocated,
        notes=plan_notes(model),
        phases=tuple(tracker.phase_peaks("cpu").items()),
    )


def gpu_reports(
    configs: Sequence[Any], gpu: Chip, labels: Sequence[str] = (), batches: Sequence[int] = ()
) -> list[FitReport]:
    """Each config's step estimated on ``gpu`` (:func:`estimate_step`) as a report; a ``plan`` step with no
    schedule within the budget as not fitting (its ``at_least`` from the planner)."""
    labels = list(labels) or [""] * len(configs)
    reports = []
    for cfg, label, batch in zip(configs, labels, list(batches) or [c.data.batch_size for c in configs]):
        progress.say(f"{label}, batch {batch}: running the step on fake tensors for {gpu.name}")
        try:
            reports.append(estimate_step(for_gpu(cfg, gpu)).report(gpu, label, batch))
        except StepDoesNotFit as refused:
            reports.append(dataclasses.replace(refused.report(gpu, label, batch), source=GPU_SOURCE))
    return reports


def gpu_max_batch(config_at: Any, gpu: Chip, label: str = "", limit: int = 4096) -> BatchSearch:
    """The largest batch whose step fits ``gpu`` (:func:`revlib_xla.fit.max_batch`'s search, each batch
    estimated by :func:`estimate_step`); ``config_at(batch)`` is the run config at that batch."""

    def estimate(configs: list[Any], chip: Chip, labels: list[str], batches: list[int]) -> list[FitReport]:
        return gpu_reports(configs, chip, labels, batches)

    return max_batch(config_at, gpu, label=label, limit=limit, compile_fn=estimate)
