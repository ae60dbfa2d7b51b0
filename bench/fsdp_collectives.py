#!/usr/bin/env python
"""FSDP2's collectives per training step when the backward recomputes: all-gathers and reduce-scatters of
``fully_shard`` with one unit per block (plus the root), for the same blocks run

* ``plain``           - with plain autograd (``ReversibleSequential(memory_mode=no_savings)``: the same two-stream
  function, ``y1 = x0 + f(x1)``): the baseline;
* ``reversible``      - inside a ``ReversibleSequential`` (the backward rebuilds each layer and recomputes its block
  through the unit's ``__call__``, resharding held, the previous block prefetched: :mod:`revlib_xla.fsdp`);
* ``reversible-root`` - inside a ``ReversibleSequential`` with one unit around the whole model (no unit per block:
  every parameter unsharded through the forward and the backward);
* ``chain``           - a chain of the same blocks (each ending in ``tanh``) with plain autograd;
* ``plan-fast``, ``plan-min`` - the chain under ``Checkpointable`` with its fastest schedule (no recomputation) and
  its smallest one (rotor's schedule recomputes stages: each recomputation needs the block's parameters).

Two processes with gloo on the CPU, each on half of the batch; the counts are those of the second step (FSDP2
initialised), counted with :func:`revlib_xla.fsdp.counting_collectives`, and every variant's weights after the two
steps are checked against one process on the whole batch. Results go to
``bench/results/fsdp_collectives-cpu-gloo.{md,json}``.

Then the same through ``revlib-xla train`` (:func:`revlib_xla.train.loop.train`, ``strategy.data_parallel=fsdp2``,
a small Llama, 2 gloo processes): the collectives of each step (:func:`revlib_xla.fsdp.counted_steps`) of
``strategy=none`` (plain FSDP2), ``reversible`` and ``plan``, with the units each run shards.

Usage: ``python bench/fsdp_collectives.py [--blocks 6] [--width 64] [--out-dir DIR]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import revlib_xla as revlib
from revlib_xla.fsdp import counted_steps, counting_collectives, fsdp_module_type, fully_shard_function
from revlib_xla.train.distributed import agree_on_schedule

VARIANTS = ("plain", "reversible", "reversible-root", "chain", "plan-fast", "plan-min")
WORLD = 2
BATCH = 8
CLI_STRATEGIES = ("none", "reversible", "plan")
CLI_RUN = [
    "model.overrides={vocab_size: 256, dim: 64, n_layers: 4, n_heads: 4, n_kv_heads: 2, ffn_dim: 128}",
    "data.seq_len=32",
    "data.batch_size=8",
    "train.steps=3",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.progress=false",
    "train.device=cpu",
    "strategy.data_parallel=fsdp2",
]


def build(variant: str, blocks: int, width: int, batch: int) -> tuple[nn.Module, list[nn.Module]]:
    """The model of ``variant`` and the modules that become FSDP2 units before the root."""
    torch.manual_seed(0)

    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    if variant in ("plain", "reversible", "reversible-root"):
        made = [block() for _ in range(blocks)]
        mode = revlib.MemoryModes.no_savings if variant == "plain" else revlib.MemoryModes.autograd_function
        stack = revlib.ReversibleSequential(*made, memory_mode=mode)
        model = nn.Sequential(nn.Linear(width, 2 * width), stack, nn.Linear(2 * width, 1))
        return model, [] if variant == "reversible-root" else made
    stages = [revlib.atomic(nn.Sequential(block(), nn.Tanh())) for _ in range(blocks)]
    chain = nn.Sequential(nn.Linear(width, width), *stages)
    if variant == "chain":
        return nn.Sequential(chain, nn.Linear(width, 1)), stages
    planned = revlib.Checkpointable(chain, torch.zeros(batch, width))
    planned.compute_sequence(planned.min_memory() * 1.05 if variant == "plan-min" else None)
    return nn.Sequential(planned, nn.Linear(width, 1)), stages


def data(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, width, generator=generator), torch.randn(BATCH, 1, generator=generator)


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
    ((model(x) - y) ** 2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def worker(rank: int, initfile: str, out: str, blocks: int, width: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{initfile}", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    fully_shard = fully_shard_function()
    x, y = data(width)
    xs, ys = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
    results: dict[str, Any] = {}
    for variant in VARIANTS:
        model, units = build(variant, blocks, width, len(xs))
        for planned in [m for m in model.modules() if isinstance(m, revlib.Checkpointable)]:
            agree_on_schedule(planned)  # planned apart from each rank's own measurements: run one schedule
        for unit in units:
            fully_shard(unit, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train(model, xs, ys, optimizer)
        with counting_collectives() as count:
            train(model, xs, ys, optimizer)
        results[variant] = {
            "all_gathers": count.all_gathers,
            "reduce_scatters": count.reduce_scatters,
            "weights": [p.full_tensor().detach().clone() for p in model.parameters()],
        }
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def cli_worker(rank: int, initfile: str, out: str, root: str) -> None:
    """``revlib-xla train`` in this process of ``WORLD``, each step's collectives counted, per strategy."""
    import os

    from revlib_xla.train import loop
    from revlib_xla.train.config import load_config

    dist.init_process_group("gloo", init_method=f"file://{initfile}", rank=rank, world_size=WORLD)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    make_step = loop.make_step
    results: dict[str, Any] = {}
    for strategy in CLI_STRATEGIES:
        counts: list[Any] = []
        loop.make_step = lambda *a, **k: counted_steps(make_step(*a, **k), counts)  # type: ignore[assignment]
        cfg = load_config(None, [*CLI_RUN, f"strategy={strategy}", f"train.out_dir={root}/{strategy}"])
        result = loop.train(cfg)
        loop.make_step = make_step
        unit = fsdp_module_type()
        results[strategy] = {
            "units": sum(1 for m in result.model.modules() if unit is not None and isinstance(m, unit)),
            "steps": [(c.all_gathers, c.reduce_scatters, c.gathered, c.reduced) for c in counts],
            "losses": result.losses,
        }
    torch.save(results, f"{out}.{rank}")
    if dist.is_initialized():
        dist.destroy_process_group()


def cli_rows() -> list[dict[str, Any]]:
    """Per strategy: the units, the collectives of the last step (every rank counts the same) and the losses."""
    with tempfile.TemporaryDirectory() as tmp:
        initfile, out = str(Path(tmp) / "rendezvous"), str(Path(tmp) / "result")
        mp.start_processes(cli_worker, args=(initfile, out, tmp), nprocs=WORLD, start_method="spawn")
        ranks = [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(WORLD)]
    rows = []
    for strategy in CLI_STRATEGIES:
        steps = {tuple(r[strategy]["steps"][-1]) for r in ranks}
        assert len(steps) == 1, f"{strategy}: the ranks counted differently: {steps}"
        gathers, reductions, gathered, reduced = steps.pop()
        rows.append(
            {
                "strategy": strategy,
                "units": ranks[0][strategy]["units"],
                "all_gathers": gathers,
                "reduce_scatters": reductions,
                "gathered_elements": gathered,
                "reduced_elements": reduced,
                "losses": ranks[0][strategy]["losses"],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        initfile, out = str(Path(tmp) / "rendezvous"), str(Path(tmp) / "result")
        mp.start_processes(worker, args=(initfile, out, args.blocks, args.width), nprocs=WORLD, start_method="spawn")
        ranks = [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(WORLD)]
    rows = []
    x, y = data(args.width)
    for variant in VARIANTS:
        model, _ = build(variant, args.blocks, args.width, BATCH)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            train(model, x, y, optimizer)
        error = max(
            float((got - want.detach()).abs().max())
            for result in ranks
            for got, want in zip(result[variant]["weights"], model.parameters())
        )
        counts = {(r[variant]["all_gathers"], r[variant]["reduce_scatters"]) for r in ranks}
        assert len(counts) == 1, f"{variant}: the ranks counted differently: {counts}"
        gathers, reductions = counts.pop()
        rows.append({"variant": variant, "all_gathers": gathers, "reduce_scatters": reductions, "max_error": error})
    cli = cli_rows()
    base = {r["variant"]: r["all_gathers"] for r in rows}
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"cpu ({platform.processor() or platform.machine()}), {WORLD} processes, gloo",
        "torch": torch.__version__,
        "blocks": args.blocks,
        "width": args.width,
        "batch": BATCH,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fsdp_collectives-cpu-gloo.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "cli": cli}, indent=2)
    )
    lines = [
        "# FSDP2 collectives per training step, one unit per block",
        "",
        f"{meta['device']}; torch {meta['torch']}; {args.blocks} blocks of width {args.width} (MLP 4x), batch "
        f"{BATCH} split over the processes; the second of two SGD steps; {meta['date']}. Made by "
        f"`bench/fsdp_collectives.py`. Max error: largest |weight - one process on the whole batch| after 2 steps.",
        "",
        "| variant | all-gathers | vs its plain baseline | reduce-scatters | max error |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        baseline = "plain" if row["variant"].startswith("reversible") else "chain"
        versus = (
            "(baseline)"
            if row["variant"] in ("plain", "chain")
            else f"{row['all_gathers'] / base[baseline]:.2f}x {baseline}"
        )
        lines.append(
            f"| {row['variant']} | {row['all_gathers']} | {versus} | {row['reduce_scatters']} | "
            f"{row['max_error']:.1e} |"
        )
    plain = cli[0]
    lines += [
        "",
        "## Through `revlib-xla train` (`strategy.data_parallel=fsdp2`)",
        "",
        "A Llama of 4 layers (dim 64, vocab 256), batch 8 x 32 split over the 2 processes, AdamW; the third step. "
        "The plain and planned LMs have one unit per transformer block, the reversible LM one per attention and "
        "per MLP block (its layers), plus the root in each: the weights gathered (elements of the whole "
        "parameters) compare them; per unit, each is gathered twice a step (the root once) and reduced once.",
        "",
        "| strategy | units | all-gathers | reduce-scatters | elements gathered | vs none | elements reduced |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in cli:
        lines.append(
            f"| {row['strategy']} | {row['units']} | {row['all_gathers']} | {row['reduce_scatters']} | "
            f"{row['gathered_elements']} | {row['gathered_elements'] / plain['gathered_elements']:.2f}x | "
            f"{row['reduced_elements']} |"
        )
    (out_dir / "fsdp_collectives-cpu-gloo.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
