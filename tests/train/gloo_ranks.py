"""Run a function in several gloo processes on the CPU and collect what each one records, for the tests of
several processes (tests/train/test_distributed.py, tests/train/test_fsdp2_cli.py).

The processes are started with ``torch.multiprocessing``'s spawn method and meet through a file rendezvous (no
network port); each runs ``cases(rank, results)`` with the process group joined, and an exception in it is recorded
as ``results["error"]``, which :func:`run_ranks` turns into a failure of the calling test.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Cases = Callable[[int, dict[str, Any]], None]

#: The tiny Llama run both files train under several processes (each adds its own keys).
TINY_RUN = [
    "model.overrides={vocab_size: 256, dim: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, ffn_dim: 64}",
    "data.seq_len=16",
    "data.batch_size=4",
    "optim.lr=3e-3",
    "optim.warmup_steps=1",
]


def _rank(rank: int, cases: Cases, world: int, initfile: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{initfile}", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    try:
        cases(rank, results)
    except Exception:  # reported to the parent, which fails the test with it
        results["error"] = traceback.format_exc()
    finally:
        torch.save(results, f"{out}.{rank}")
        dist.destroy_process_group()


def run_ranks(cases: Cases, world: int, directory: str | Path) -> list[dict[str, Any]]:
    """Each rank's results of ``cases`` (a module-level function: the spawned processes import it) run in ``world``
    processes; ``directory`` holds the rendezvous and results files."""
    initfile, out = str(Path(directory) / "rendezvous"), str(Path(directory) / "result")
    mp.start_processes(_rank, args=(cases, world, initfile, out), nprocs=world, start_method="spawn")
    results = [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world)]
    for result in results:
        assert "error" not in result, result["error"]
    return results
