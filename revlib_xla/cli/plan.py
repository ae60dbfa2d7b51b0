"""``revlib-xla plan``: the planner's checkpointing schedule for a config at a memory budget, with its predicted time
and memory, measured without a TPU (see :mod:`revlib_xla.fit.plan`).

``revlib-xla plan --config tpu_configs/v5e-1.yaml --budget 8GiB [--chip v5e] [key=value ...]``
"""

from __future__ import annotations

import argparse

from . import UsageError, missing_modules

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` command's arguments."""
    parser.add_argument("--config", help="a run config (tpu_configs/*.yaml); default: the built-in defaults")
    parser.add_argument(
        "--budget", required=True, help="the activations' memory budget: bytes or with a unit (8GiB, 6GB)"
    )
    parser.add_argument("--chip", help="the TPU chip the stages are sized for (default: the config's chip.name)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. data.seq_len=2048")


def run(args: argparse.Namespace) -> int:
    """Print the schedule."""
    from ..fit import chips
    from ..fit.plan import format_schedule, plan_config
    from ..planner import InfeasibleBudget
    from ..train.config import load_config  # type: ignore[import-not-found,unused-ignore]  # revlib_xla.train lands separately
    from ..units import format_bytes, parse_bytes

    try:
        budget = parse_bytes(args.budget, "--budget")
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    extra = ["strategy.activations=plan", f"strategy.budget={int(budget)}"]
    if args.chip:
        try:
            chips.chip(args.chip, "tpu")
        except ValueError as exc:
            raise UsageError(f"--chip: {exc}") from None
        extra.append(f"chip.name={args.chip.strip().lower()}")
    cfg = load_config(args.config, [*args.overrides, *extra])
    try:
        target = chips.chip(cfg.chip.name, "tpu")
    except ValueError as exc:
        raise UsageError(f"--chip: {exc}") from None
    missing = missing_modules()
    if missing:
        raise UsageError(
            f"the planner sizes each stage with torch_xla and the TPU compiler, which need {', '.join(missing)} (not "
            f"installed here): pip install 'revlib_xla[xla,tpu-compile]' (torch 2.9); or size the planned step for a "
            f"GPU without them: revlib-xla memory --gpu NAME --strategies plan"
        )
    print(
        f"{cfg.model.name}, batch {cfg.data.batch_size} x seq_len {cfg.data.seq_len}, budget "
        f"{format_bytes(int(budget))}; stages sized by the TPU compiler for {target.name} (deviceless libtpu), "
        f"not a TPU run"
    )
    try:
        planned = plan_config(cfg, budget)
    except InfeasibleBudget as exc:
        raise UsageError(f"--budget {args.budget}: {exc.naming('--budget')}") from None
    print(format_schedule(planned, target))
    return 0
