"""``revlib-xla train --config FILE [key=value ...]``: train a model from a config with a memory strategy.

The config is a YAML file of seven sections (``model``, ``strategy``, ``data``, ``optim``, ``chip``, ``mesh``,
``train``; see
:mod:`revlib_xla.train.config`); ``key=value`` overrides change any key (``train.steps=10``,
``strategy.offload.optimizer=true``), and ``strategy=NAME`` picks the activation strategy. Interrupted runs (SIGTERM,
Ctrl-C) save a checkpoint and exit 0; the same command resumes them.
"""

from __future__ import annotations

import argparse
import math

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train`` subcommand's arguments."""
    parser.add_argument("--config", required=True, help="a run config, e.g. tpu_configs/cpu-smoke.yaml")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides with YAML values (train.steps=10, optim.betas=[0.9,0.99]); strategy=reversible "
        "sets strategy.activations",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def run(args: argparse.Namespace) -> int:
    """Train; returns 0 when the run finished or was stopped by a signal after saving its checkpoint."""
    from ..train.config import dump_config, load_config

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    from ..train.distributed import launched_rank
    from ..train.loop import train
    from ..train.strategy import resolve_device

    device = resolve_device(cfg)
    s = cfg.strategy
    announce = launched_rank() == 0  # under torchrun, rank 0 speaks for the run
    if announce:
        print(
            f"revlib-xla train: {cfg.model.hf_config or cfg.model.name} on {device}, "
            f"strategy activations={s.activations}"
            + (f" fewbit={s.fewbit}" if s.fewbit else "")
            + "".join(f" offload.{k}" for k, v in s.offload.model_dump().items() if v)
            + (" fused_optimizer" if s.fused_optimizer else "")
            + f" precision={s.precision}; {cfg.train.steps} steps of {cfg.data.batch_size} x {cfg.data.seq_len} "
            f"tokens; writing to {cfg.train.out_dir}",
            flush=True,
        )
    result = train(cfg)
    if announce and result.nothing_left:
        loss = result.resumed_metrics.get("loss")
        print(
            f"no step trained: step {result.start_step} of train.steps={cfg.train.steps} was reached"
            + (f" (loss {loss:.4f})" if loss is not None and math.isfinite(loss) else "")
            + f"; checkpoint {result.checkpoint}"
        )
    elif announce and result.losses:
        print(
            f"loss {result.first_loss:.4f} (step {min(result.losses)}) -> {result.last_loss:.4f} (step "
            f"{max(result.losses)})"
            + (f"; validation {result.val_losses[max(result.val_losses)]:.4f}" if result.val_losses else "")
            + f"; {result.seconds:.1f} s; checkpoint {result.checkpoint}"
        )
    return 0
