"""``revlib-xla memory``: will the training step of a config fit a chip, per memory strategy, without the chip.

``revlib-xla memory --config tpu_configs/v5e-1.yaml --chip v5e [--chips N] [--max-batch] [--strategies
none,reversible] [--gpu h100] [key=value ...]``. The step ``revlib-xla train`` runs is traced at full size on
meta/zero-copy tensors (nothing allocated, nothing run) and compiled deviceless for one chip by the TPU compiler;
see :mod:`revlib_xla.fit`. With ``--chips N`` (or ``chip.chips``) the step is split over the config's ``mesh`` of
N chips (:mod:`revlib_xla.sharding`) and compiled for a slice of N by the SPMD partitioner: what each chip holds.

``--gpu NAME`` sizes the same step for that GPU instead (:mod:`revlib_xla.fit.gpu`: the eager step run on fake
tensors; no torch_xla, libtpu or jax needed), per strategy, ``--max-batch`` included; with ``--chip`` as well, for
the TPU chip and then the GPU.
"""

from __future__ import annotations

import argparse
from typing import Any

from . import UsageError, missing_modules

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``memory`` command's arguments."""
    parser.add_argument("--config", help="a run config (tpu_configs/*.yaml); default: the built-in defaults")
    parser.add_argument("--chip", help="the TPU chip: v4, v5e, v5p or v6e (default: the config's chip.name)")
    parser.add_argument(
        "--chips",
        type=int,
        help="chips the run is split over with the config's mesh (SPMD); figures are per chip (default: chip.chips)",
    )
    parser.add_argument(
        "--max-batch", action="store_true", help="find, per strategy, the largest batch (data.batch_size) that fits"
    )
    parser.add_argument(
        "--strategies",
        help="comma-separated strategies to compare; default: config (the config as written), none, checkpoint, "
        "reversible, plan, plan+fewbit, plan+fewbit+offload, reversible+offload, reversible+offload+bf16, "
        "reversible+fused; on a GPU (--gpu) also reversible+offload+bf16+stream (each gradient to the host as the "
        "backward produces it: eager devices only); also: reversible+offload+bf16+scan",
    )
    parser.add_argument(
        "--gpu",
        help="size the step for a GPU instead (h100, h200, a100-40gb, a100-80gb, l4, t4): an eager estimate that "
        "needs neither torch_xla nor libtpu; with --chip too, for both",
    )
    parser.add_argument("--limit", type=int, default=4096, help="the largest batch --max-batch tries (4096)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. data.seq_len=2048")


def _chosen(args: argparse.Namespace, gpu: bool = False) -> list:
    from ..fit.strategies import DEFAULT_COMPARISON, GPU_COMPARISON, strategy

    default = GPU_COMPARISON if gpu else DEFAULT_COMPARISON
    names = args.strategies.split(",") if args.strategies else ["config", *default]
    try:
        return [strategy(name) for name in names if name.strip()]
    except ValueError as exc:
        raise UsageError(f"--strategies: {exc}") from None


def _print_searches(searches: list, limit: int, footnote: str) -> None:
    """Each strategy's largest fitting batch, then the table of those batches' reports."""
    from ..fit.report import format_table
    from ..units import format_bytes

    print()
    width = max(len(s.label) for s in searches)
    for found in searches:
        best = found.best_report
        if best is None:
            failure = found.smallest_failure
            assert failure is not None
            text = f"does not fit at batch 1 (needs >= {format_bytes(failure.at_least)})"
        else:
            cap = f" (the search stopped at --limit {limit})" if found.capped else ""
            assert best.total is not None
            text = f"largest batch {found.best}: {format_bytes(best.total)}{cap}"
        print(f"  {found.label.ljust(width)}  {text}")
    shown = [s.best_report or s.smallest_failure for s in searches]
    print()
    print(format_table([r for r in shown if r is not None], footnote))


def _run_gpu(args: argparse.Namespace, gpu: Any, chosen: list) -> None:
    """The GPU's table (or largest batches), per strategy: :mod:`revlib_xla.fit.gpu`."""
    from ..fit.gpu import GPU_FOOTNOTE, GPU_SOURCE, gpu_max_batch, gpu_reports
    from ..fit.report import format_table
    from ..fit.strategies import load
    from ..units import format_bytes

    base = load(args.config, args.overrides, chosen[0])
    print(
        f"{base.model.name}, seq_len {base.data.seq_len}, precision {base.strategy.precision}, on one {gpu.name} "
        f"({format_bytes(gpu.hbm_bytes)}); {GPU_SOURCE}"
    )
    if args.max_batch:
        searches = [
            gpu_max_batch(
                lambda batch, s=s: load(args.config, args.overrides, s, batch), gpu, label=s.name, limit=args.limit
            )
            for s in chosen
        ]
        _print_searches(searches, args.limit, GPU_FOOTNOTE)
        return
    configs = [load(args.config, args.overrides, s) for s in chosen]
    print(f"batch {base.data.batch_size}\n")
    print(format_table(gpu_reports(configs, gpu, [s.name for s in chosen]), GPU_FOOTNOTE))


def run(args: argparse.Namespace) -> int:
    """Print the per-chip memory of each strategy (or its largest batch), with fits / does not fit."""
    from ..compiled.worker import slice_topology
    from ..fit import chips
    from ..fit.report import COMPILER_SOURCE, FOOTNOTE, format_table
    from ..fit.strategies import load, search_strategies, size_strategies, smallest_change, strategy
    from ..sharding import ShardingError, resolve_mesh
    from ..units import format_bytes

    if args.max_batch and args.limit < 1:
        raise UsageError(f"--limit {args.limit}: the largest batch --max-batch tries (>= 1)")
    if args.chips is not None:
        if args.chips < 1:
            raise UsageError(f"--chips {args.chips}: the number of chips the run is split over (>= 1)")
        args.overrides = [*args.overrides, f"chip.chips={args.chips}"]
    chosen = _chosen(args)
    gpu = None
    if args.gpu:
        try:
            gpu = chips.chip(args.gpu, "gpu")
        except ValueError as exc:
            raise UsageError(f"--gpu: {exc}") from None
        if not args.chip:  # the GPU alone: nothing is compiled for a TPU
            if args.chips is not None and args.chips > 1:
                raise UsageError(
                    f"--chips {args.chips}: --gpu sizes the step for one GPU; give --chip too to size a TPU slice"
                )
            _run_gpu(args, gpu, _chosen(args, gpu=True))
            return 0
    if args.chip:
        try:
            chips.chip(args.chip, "tpu")
        except ValueError as exc:
            raise UsageError(f"--chip: {exc}") from None
        # The chip sized for is the run's target too (plan auto's budget is the chip's memory).
        args.overrides = [*args.overrides, f"chip.name={args.chip.strip().lower()}"]
    base = load(args.config, args.overrides, strategy("config"))
    try:
        target = chips.chip(base.chip.name, "tpu")
    except ValueError as exc:
        raise UsageError(f"chip.name: {exc}") from None
    count = base.chip.chips
    try:
        mesh = resolve_mesh(base.mesh.axes(), count, backend_name=f"{count}-chip {target.name} slice")
        if count > 1:
            slice_topology(target.name, count)
    except (ShardingError, ValueError) as exc:
        raise UsageError(f"--chips {count}: {exc}") from None
    missing = missing_modules()
    if missing:
        raise UsageError(
            f"sizing for a TPU traces the step with torch_xla and compiles it with the TPU compiler, which needs "
            f"{', '.join(missing)} (not installed here): pip install 'revlib_xla[xla,tpu-compile]' (torch 2.9); "
            f"or size it for a GPU alone with --gpu NAME (no --chip), which needs none of them"
        )
    where = f"on one {target.name}" if count == 1 else f"per chip of {count} {target.name} chips (mesh {mesh})"
    header = (
        f"{base.model.name}, seq_len {base.data.seq_len}, precision {base.strategy.precision}, {where} "
        f"({format_bytes(target.hbm_bytes)} HBM, {format_bytes(target.usable_bytes)} usable); {COMPILER_SOURCE}"
    )
    print(header)
    if args.max_batch:
        searches = search_strategies(args.config, args.overrides, target, chosen, args.limit)
        _print_searches(searches, args.limit, FOOTNOTE)
    else:
        reports = size_strategies(args.config, args.overrides, target, chosen)
        print(f"batch {base.data.batch_size}\n")
        print(format_table(reports, FOOTNOTE))
        own = reports[0]
        if own.label == "config" and not own.fits:
            print(
                f"\nThe config does not fit one {target.name}: "
                f"{smallest_change(args.config, args.overrides, target, reports, args.limit)}."
            )
    if gpu is not None:
        print()
        _run_gpu(args, gpu, _chosen(args, gpu=True))
    return 0
