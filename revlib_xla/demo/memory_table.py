"""The demo's memory table: one training step of the model at several depths, in the three flavours of
:func:`revlib_xla.models.build_lm`, measured eagerly (:func:`eager_memory`) and compiled for a TPU without one
(:class:`TpuColumn`), printed and plotted. Re-exported by :mod:`revlib_xla.demo`."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from .. import backends
from ..models import FLAVOUR_LABELS, FLAVOURS, ByteTransformerLM, build_lm, lm_loss
from .data import DemoConfig


@dataclasses.dataclass(frozen=True)
class MemoryRow:
    """One depth and flavour of the memory table, in bytes (``tpu_hbm`` is ``None`` when the TPU compile was not
    available). ``params_grads`` is the bytes of the parameters and their gradients (fp32)."""

    depth: int
    flavour: str
    eager_peak: int
    params_grads: int
    tpu_hbm: int | None


def _fwd_bwd(model: ByteTransformerLM, tokens: torch.Tensor) -> torch.Tensor:
    loss = lm_loss(model(tokens), tokens)
    loss.backward()
    return loss


def _table_tokens(config: DemoConfig) -> torch.Tensor:
    generator = torch.Generator().manual_seed(config.seed)
    return torch.randint(0, 256, (config.table_batch, config.seq_len), generator=generator)


def _table_model(config: DemoConfig, depth: int, flavour: str) -> ByteTransformerLM:
    torch.manual_seed(config.seed)
    return build_lm(config.model_config(depth), flavour)


def eager_memory(
    config: DemoConfig, depths: Sequence[int], flavours: Sequence[str] = FLAVOURS
) -> dict[tuple[int, str], tuple[int, int]]:
    """``(eager peak, parameter + gradient bytes)`` of one training step (forward + backward, batch
    ``config.table_batch``) per ``(depth, flavour)``, from :func:`revlib_xla.memory.eager_peak` on the CPU.

    PyTorch's ``MemTracker`` counts tensor storages, so the figures are exact and the same on CPU and CUDA (up to
    the CUDA allocator's 512-byte rounding).
    """
    from .. import memory

    tokens = _table_tokens(config)
    out = {}
    for depth in depths:
        for flavour in flavours:
            model = _table_model(config, depth, flavour)
            peak = memory.eager_peak(_fwd_bwd, model, tokens)
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            out[depth, flavour] = (peak.total, 2 * params)
    return out


class TpuColumn:
    """The TPU column of the memory table, computed in the background.

    :meth:`start` traces every step with torch_xla right away (:func:`revlib_xla.memory.step_stablehlo`; a few
    seconds) and hands the StableHLO to the deviceless TPU compiler (:func:`revlib_xla.memory.tpu_memory_many`, a
    child process) on a background thread, so the compile overlaps with whatever runs next (training);
    :meth:`result` waits for it. Failures (no torch_xla, jax or libtpu) are not raised: :meth:`result` returns
    ``None`` and :attr:`reason` says why.
    """

    def __init__(self, keys: list[tuple[int, str]], generation: str):
        self.keys = keys
        self.generation = generation
        self.reason: str | None = None
        self._result: dict[tuple[int, str], int] | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def start(
        cls, config: DemoConfig, depths: Sequence[int], flavours: Sequence[str] = FLAVOURS, generation: str = "v5e"
    ) -> TpuColumn:
        column = cls([(d, f) for d in depths for f in flavours], generation)
        try:
            texts = column._trace(config)
        except Exception as exc:  # missing torch_xla, or a tracing failure: the table goes on without TPU figures
            column.reason = f"{type(exc).__name__}: {exc}"
            return column
        column._thread = threading.Thread(target=column._compile, args=(texts,), name="tpu-compile", daemon=True)
        column._thread.start()
        return column

    def _trace(self, config: DemoConfig) -> list[str]:
        from .. import memory

        if not backends.xla_available():
            raise memory.MissingDependencyError("the TPU column needs torch_xla: pip install 'revlib_xla[xla]'")
        backends.device_for("xla")  # initialise the XLA runtime (see the note in main)
        tokens = _table_tokens(config)
        texts = []
        for depth, flavour in self.keys:
            try:
                texts.append(memory.step_stablehlo(_fwd_bwd, _table_model(config, depth, flavour), tokens))
            except RuntimeError as exc:
                if "device_ready_queues_" in str(exc):
                    raise RuntimeError(
                        "an XLA backward pass failed because a backward pass ran in this process before the XLA "
                        "device was initialised (PyTorch's autograd engine then has no queue for it); call "
                        "revlib_xla.backends.device_for('xla') before the first backward pass"
                    ) from None
                raise
        return texts

    def _compile(self, texts: list[str]) -> None:
        from .. import memory

        try:
            compiled = memory.tpu_memory_many(texts, self.generation)
            self._result = {key: result.hbm_peak_bytes for key, result in zip(self.keys, compiled)}
        except Exception as exc:  # reported, not raised: the eager part of the table still stands
            self.reason = f"{type(exc).__name__}: {exc}"

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def result(self) -> dict[tuple[int, str], int] | None:
        """HBM peak bytes per ``(depth, flavour)``, waiting for the compile; ``None`` if it failed (see
        :attr:`reason`)."""
        if self._thread is not None:
            self._thread.join()
        return self._result


def memory_table(
    config: DemoConfig,
    depths: Sequence[int],
    flavours: Sequence[str] = FLAVOURS,
    tpu: bool = True,
    generation: str = "v5e",
) -> tuple[list[MemoryRow], str | None]:
    """Memory of one training step (forward + backward, batch ``config.table_batch``) per depth and flavour.

    Eager peak: :func:`eager_memory`. TPU: the HBM peak that the TPU compiler plans for the step traced by torch_xla,
    compiled for one chip of a TPU ``generation`` without a TPU (:class:`TpuColumn`). Returns the rows and, when the
    TPU column could not be produced, the reason.
    """
    column = TpuColumn.start(config, depths, flavours, generation) if tpu else None
    eager = eager_memory(config, depths, flavours)
    return _rows(eager, column)


def _rows(
    eager: dict[tuple[int, str], tuple[int, int]], column: TpuColumn | None
) -> tuple[list[MemoryRow], str | None]:
    tpu = column.result() if column is not None else None
    rows = [
        MemoryRow(depth, flavour, peak, params_grads, None if tpu is None else tpu[depth, flavour])
        for (depth, flavour), (peak, params_grads) in eager.items()
    ]
    return rows, column.reason if column is not None else None


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def format_memory_table(rows: Sequence[MemoryRow], generation: str = "v5e") -> str:
    """The table as text: one line per depth; eager peak and TPU HBM peak (MiB) for each flavour, and the
    parameter + gradient bytes for reference."""
    flavours = [f for f in FLAVOURS if any(r.flavour == f for r in rows)]
    depths = sorted({r.depth for r in rows})
    by_key = {(r.depth, r.flavour): r for r in rows}
    labels = [FLAVOUR_LABELS[f] for f in flavours]
    widths = [max(len(label), 8) for label in labels]
    group = "  ".join(f"{label:>{w}}" for label, w in zip(labels, widths))
    titles = ("eager peak, MiB", f"TPU {generation} HBM peak, MiB")
    lines = [
        f"{'':5}   {titles[0]:^{len(group)}}   {titles[1]:^{len(group)}}",
        f"{'depth':>5}   {group}   {group}   {'params+grads':>12}",
    ]
    lines.append("-" * len(lines[1]))
    for depth in depths:
        eager = "  ".join(f"{_mib(by_key[depth, f].eager_peak):>{w}}" for f, w in zip(flavours, widths))
        tpu = "  ".join(f"{_mib(by_key[depth, f].tpu_hbm):>{w}}" for f, w in zip(flavours, widths))
        lines.append(f"{depth:>5}   {eager}   {tpu}   {_mib(by_key[depth, flavours[0]].params_grads):>12}")
    return "\n".join(lines)


def plot_memory_table(
    rows: Sequence[MemoryRow], path: str | os.PathLike[str], config: DemoConfig, generation: str = "v5e"
) -> Path:
    """Save the table as a PNG: eager peak and TPU HBM peak against depth, one line per flavour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depths = sorted({r.depth for r in rows})
    by_key = {(r.depth, r.flavour): r for r in rows}
    flavours = [f for f in FLAVOURS if any(r.flavour == f for r in rows)]
    styles = {"no_savings": ("tab:red", "o"), "checkpoint": ("tab:orange", "s"), "reversible": ("tab:blue", "^")}
    panels = [
        ("eager peak (PyTorch MemTracker)", "eager_peak"),
        (f"TPU {generation} HBM peak (TPU compiler, deviceless)", "tpu_hbm"),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharex=True)
    for ax, (title, field) in zip(axes, panels):
        for flavour in flavours:
            values = [getattr(by_key[d, flavour], field) for d in depths]
            if any(v is None for v in values):
                continue
            color, marker = styles.get(flavour, (None, "o"))
            ax.plot(depths, [v / 2**20 for v in values], marker=marker, color=color, label=FLAVOUR_LABELS[flavour])
        params = [by_key[d, flavours[0]].params_grads / 2**20 for d in depths]
        ax.plot(depths, params, linestyle=":", color="gray", label="params + grads")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("depth (transformer layers)")
        ax.set_ylabel("MiB")
        ax.set_xscale("log", base=2)
        ax.set_xticks(depths, [str(d) for d in depths])
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if not ax.lines or len(ax.lines) == 1:
            ax.text(0.5, 0.5, "not available", transform=ax.transAxes, ha="center", va="center")
        ax.legend(fontsize=8)
    fig.suptitle(
        f"Memory of one training step (forward + backward) of the byte-level transformer LM: width "
        f"{config.width} x 2 streams, batch {config.table_batch} x {config.seq_len} bytes, fp32",
        fontsize=10,
    )
    fig.tight_layout()
    out = Path(path)
    if out.parent != Path(""):
        out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
