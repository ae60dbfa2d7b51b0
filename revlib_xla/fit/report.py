"""Does a traced step fit a chip, and what fills its memory: the compiled peak, split into what backs each part.

:func:`compile_steps` compiles traced steps for one TPU chip deviceless (several per child process) and
:func:`fit_report` turns each result into a :class:`FitReport`. How each figure is obtained (:data:`FOOTNOTE`):

* ``total``: the HBM peak the TPU compiler plans for the step on one chip (``hbm_peak_bytes`` of
  :func:`revlib_xla.memory.tpu_memory`: its peak minus buffers in host memory); parameters and optimizer state
  updated in place are donated to their new values, as torch_xla does on a TPU, so they count once;
* ``parameters``, ``optimizer state``, ``inputs``: the bytes of the program's arguments with that role
  (:class:`~revlib_xla.fit.trace.TracedStep`), exact; ``other`` the rest of its arguments in HBM (buffers,
  scalars, and the compiler's padding of small arguments to its alignment);
* ``gradients, activations, temporaries``: the rest of the peak (``total`` minus the arguments in HBM): what the
  compiler keeps alive at the peak besides the step's inputs, i.e. gradients, activations kept for the backward
  pass, recomputed values, workspace and the step's unaliased outputs. The compiler's buffer assignment does not
  say which value is a gradient and which an activation, so they are not split;
* ``host``: bytes in host memory, not in HBM: what the compiler places there (offloaded activations), plus the
  state and master weights of an optimizer that steps on the host (``strategy.offload.optimizer``; its step's
  program is the forward and backward, its gradients outputs; :class:`~revlib_xla.fit.trace.HostStepping`).

When the v5e compiler finds the program larger than the chip it stops ("Ran out of memory in memory space hbm.
Used X of Y hbm"): the report then says that it does not fit and gives the compiler's X as a lower bound. A program
whose arguments alone exceed the chip is not compiled: it does not fit, and needs at least their bytes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from ..chips import Chip
from ..compiled.memory import CompiledMemory, TpuCompileError, tpu_memory_results
from ..compiled.worker import slice_topology
from ..units import format_bytes
from . import progress
from .trace import INPUTS, OPTIMIZER, PARAMETERS, TracedStep

__all__ = [
    "FitReport",
    "StepDoesNotFit",
    "compile_or_refuse",
    "fit_report",
    "compile_steps",
    "format_table",
    "parse_out_of_memory",
    "FOOTNOTE",
    "COMPILER_SOURCE",
]

Step = TypeVar("Step")  # what compile_or_refuse's tracers make: a TracedStep, or a run config for the GPU estimate

#: How a report's figures come about, printed under every table.
COMPILER_SOURCE = "from the TPU compiler (deviceless libtpu), not a TPU run"

FOOTNOTE = (
    "Figures per chip " + COMPILER_SOURCE + ". total = the compiler's HBM peak of the steady-state training step "
    "(parameters and optimizer state updated in place are donated, as torch_xla does). parameters, optimizer "
    "state, inputs = the bytes of the step's arguments of that kind (exact); gradients+activations+temporaries = "
    "total minus the arguments (the compiler does not say which live value is a gradient and which an "
    "activation); host = bytes in host memory (placed there by the compiler, or a host-stepped optimizer's state "
    "and master weights). '>=' : the compiler stopped at 'out of "
    "memory' and gives a lower bound."
)

_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_OOM = re.compile(r"Ran out of memory in memory space hbm\. Used ([0-9.]+)([KMGT]?) of ([0-9.]+)([KMGT]?) hbm")


def parse_out_of_memory(message: str) -> tuple[int, int] | None:
    """``(used, capacity)`` bytes from the TPU compiler's out-of-memory error, or ``None`` for another error. The
    compiler prints binary units (``G`` = GiB) rounded to two decimals."""
    match = _OOM.search(message)
    if match is None:
        return None
    used = float(match.group(1)) * _UNITS[match.group(2)]
    capacity = float(match.group(3)) * _UNITS[match.group(4)]
    return int(used), int(capacity)


@dataclasses.dataclass(frozen=True)
class FitReport:
    """One step on one chip. Bytes; ``total`` is ``None`` when the compiler refused the program for lack of
    memory, and ``at_least`` is then its lower bound (else ``at_least == total``). See the module docstring for
    how each part is obtained; ``source`` says where the figures come from."""

    chip: Chip
    label: str
    batch: int
    total: int | None
    at_least: int
    parameters: int
    optimizer: int
    inputs: int
    other: int
    temporaries: int | None
    host: int
    source: str = COMPILER_SOURCE
    error: str | None = None
    #: what the row's step decided that its figures alone do not say (the planner's schedule), printed under the table
    notes: tuple[str, ...] = ()
    #: the peak of each phase of the step (forward, backward, optimizer step), bytes, where they are known (the GPU
    #: estimate; the TPU compiler plans one program and does not say)
    phases: tuple[tuple[str, int], ...] = ()

    @property
    def peak_phase(self) -> str:
        """The phase that sets the peak, with each phase's peak: ``"optimizer step (forward 20.1 GiB, backward 35.2
        GiB, optimizer step 59.9 GiB)"``; ``"-"`` where phases are not known."""
        if not self.phases:
            return "-"
        top = max(self.phases, key=lambda item: item[1])[0]
        return f"{top} (" + ", ".join(f"{name} {format_bytes(n)}" for name, n in self.phases) + ")"

    @property
    def fits(self) -> bool:
        """Whether the step fits the chip's usable memory (:attr:`Chip.usable_bytes`)."""
        return self.total is not None and self.total <= self.chip.usable_bytes

    @property
    def headroom(self) -> int:
        """Usable memory left (negative: missing), from ``at_least`` when the total is unknown."""
        return self.chip.usable_bytes - self.at_least

    def row(self) -> dict[str, str]:
        """The report as table cells (binary units)."""

        def fmt(n: int | None) -> str:
            return "-" if n is None else format_bytes(n)

        return {
            "strategy": self.label,
            "batch": str(self.batch),
            "parameters": fmt(self.parameters),
            "optimizer state": fmt(self.optimizer),
            "inputs+other": fmt(self.inputs + self.other),
            "gradients+activations+temporaries": fmt(self.temporaries),
            "host": fmt(self.host),
            "total": fmt(self.total) if self.total is not None else ">= " + format_bytes(self.at_least),
            "peak in": self.peak_phase,
            "fits": "NO: the compiler rejects it"
            if self.error
            else ("yes" if self.fits else "NO") + f" ({format_bytes(self.chip.usable_bytes)})",
        }


#: Where a refused step's figures come from (:class:`StepDoesNotFit`).
PLANNER_SOURCE = "the planner's sizes (no schedule fits the budget the chip leaves; not compiled)"


class StepDoesNotFit(Exception):
    """Raised while tracing a step known not to fit before it is compiled: its planned checkpointing finds no
    schedule within the memory the chip leaves beside the parameters, gradients and optimizer state. ``at_least``:
    bytes per chip the step needs at least (that state and the smallest plan's activations), of which
    ``parameters`` and ``optimizer``."""

    def __init__(self, message: str, at_least: int, parameters: int, optimizer: int) -> None:
        super().__init__(message)
        self.at_least, self.parameters, self.optimizer = at_least, parameters, optimizer

    def report(self, chip: Chip, label: str = "", batch: int = 0) -> FitReport:
        """The step's :class:`FitReport`: it does not fit; ``at_least`` from the planner, not the compiler."""
        return FitReport(
            chip, label, batch, None, self.at_least, self.parameters, self.optimizer, 0, 0, None, 0, PLANNER_SOURCE
        )


def compile_or_refuse(
    tracers: Sequence[Callable[[], Step]],
    chip: Chip,
    labels: Sequence[str],
    batches: Sequence[int],
    compile_fn: Callable[[list[Step], Chip, list[str], list[int]], list[FitReport]],
) -> list[FitReport]:
    """Each step traced (``tracers``) and compiled together by ``compile_fn``, its report in its place; a step
    whose tracing refuses it (:class:`StepDoesNotFit`: e.g. no checkpointing plan fits) is reported as not fitting,
    without compiling."""
    reports: dict[int, FitReport] = {}
    traced, kept = [], []
    for k, trace in enumerate(tracers):
        progress.say(f"{labels[k]}, batch {batches[k]}: tracing the step")
        try:
            traced.append(trace())
            kept.append(k)
        except StepDoesNotFit as refused:
            reports[k] = refused.report(chip, labels[k], batches[k])
    if kept:
        names = ", ".join(f"{labels[k]} (batch {batches[k]})" for k in kept)
        how = "compiling deviceless (TPU compiler)" if chip.is_tpu else "running on fake tensors"
        with progress.waiting(f"{how} for {chip.name}: {names}"):
            made = compile_fn(traced, chip, [labels[k] for k in kept], [batches[k] for k in kept])
        reports.update(zip(kept, made))
    return [reports[k] for k in range(len(tracers))]


def fit_report(
    traced: TracedStep, chip: Chip, compiled: CompiledMemory | TpuCompileError, label: str = "", batch: int = 0
) -> FitReport:
    """The :class:`FitReport` of ``traced`` compiled for ``chip`` (``compiled``: the compiler's result or its
    error: out of memory gives the compiler's lower bound; any other error is kept in :attr:`FitReport.error`,
    and the step does not fit)."""
    if isinstance(compiled, TpuCompileError):
        oom = parse_out_of_memory(str(compiled))
        if oom is None:  # not a matter of size: the program as traced does not compile for a TPU
            return dataclasses.replace(arguments_exceed(traced, chip, label, batch), error=str(compiled))
        return dataclasses.replace(arguments_exceed(traced, chip, label, batch), at_least=oom[0])
    parameters = traced.argument_bytes(PARAMETERS)
    optimizer = traced.argument_bytes(OPTIMIZER)
    inputs = traced.argument_bytes(INPUTS)
    in_hbm = compiled.argument_bytes - compiled.host_argument_bytes
    # The compiler pads small arguments (scalars) to its alignment: that padding is counted with the others.
    other = in_hbm - parameters - optimizer - inputs
    return FitReport(
        chip,
        label,
        batch,
        total=compiled.hbm_peak_bytes,
        at_least=compiled.hbm_peak_bytes,
        parameters=parameters,
        optimizer=optimizer,
        inputs=inputs,
        other=other,
        temporaries=compiled.hbm_peak_bytes - in_hbm,
        host=compiled.host_bytes + traced.host_bytes,
        notes=traced.notes,
    )


def compile_steps(
    traced: Sequence[TracedStep],
    chip: Chip,
    labels: Sequence[str] = (),
    batches: Sequence[int] = (),
    timeout: float = 7200.0,
) -> list[FitReport]:
    """Compile ``traced`` steps for one TPU ``chip`` in one child process and report each (a program larger than
    the chip is reported as not fitting, not raised). Steps split over several chips (:attr:`TracedStep.partitions`,
    all the same) are compiled for a slice of that many, and reported per chip. ``timeout``: seconds for the
    compiler process (a full-size step of a billion-parameter model takes minutes per program on a small machine)."""
    if not chip.is_tpu or chip.topology_1chip is None:
        raise ValueError(f"{chip.name} is not a TPU chip: the TPU compiler cannot size programs for it")
    partitions = {t.partitions for t in traced}
    if len(partitions) > 1:
        raise ValueError(f"the steps are split over different numbers of chips ({sorted(partitions)}): size them apart")
    chips = partitions.pop() if partitions else 1
    topology = chip.topology_1chip if chips == 1 else slice_topology(chip.name, chips)
    labels = list(labels) or [""] * len(traced)
    batches = list(batches) or [0] * len(traced)
    # A program whose arguments alone exceed the chip cannot fit whatever the compiler does with the rest: it is
    # not compiled (the v5e compiler would refuse it; others, which enforce no limit, would spend minutes on it).
    hopeless = [t.argument_bytes() > chip.usable_bytes for t in traced]
    compiled = iter(
        tpu_memory_results(
            [t.stablehlo for t, h in zip(traced, hopeless) if not h],
            topology=topology,
            timeout=timeout,
            partitions=chips,
        )
    )
    reports = []
    for t, h, lab, b in zip(traced, hopeless, labels, batches):
        if h:
            reports.append(arguments_exceed(t, chip, lab, b))
        else:
            reports.append(fit_report(t, chip, next(compiled), lab, b))
    return reports


def arguments_exceed(traced: TracedStep, chip: Chip, label: str = "", batch: int = 0) -> FitReport:
    """The report of a step whose arguments (parameters, optimizer state, inputs) alone exceed the chip's usable
    memory: it does not fit, and needs at least their bytes (nothing compiled)."""
    parameters = traced.argument_bytes(PARAMETERS)
    optimizer = traced.argument_bytes(OPTIMIZER)
    inputs = traced.argument_bytes(INPUTS)
    other = traced.argument_bytes() - parameters - optimizer - inputs
    return FitReport(
        chip,
        label,
        batch,
        None,
        traced.argument_bytes(),
        parameters,
        optimizer,
        inputs,
        other,
        None,
        traced.host_bytes,
        notes=traced.notes,
    )


def format_table(reports: Sequence[FitReport], footnote: str = FOOTNOTE) -> str:
    """The reports as an aligned text table, with the footnote saying how each column is obtained."""
    if not reports:
        return footnote
    rows = [r.row() for r in reports]
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in columns) for r in rows]
    lines += [f"{r.label}: the TPU compiler rejects the step: {r.error}" for r in reports if r.error]
    notes = [f"{r.label}: {note}" for r in reports for note in r.notes]
    return "\n".join(lines) + "\n\n" + "".join(f"{note}\n" for note in notes) + ("\n" if notes else "") + footnote
