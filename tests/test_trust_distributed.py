"""The rebuild check under torch.distributed: where the data of one process alone cannot be rebuilt, every process
of the data-parallel group raises the same ReversibleError in the first step, and none waits for the others until
the collective's timeout (two gloo processes on the CPU, one spawn)."""

from __future__ import annotations

import datetime
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

WORLD = 2
GLOO_TIMEOUT_S = 20  # a process left waiting in a collective fails after this (the default is 30 minutes)


def _worker(rank: int, initfile: str, out: str, exact: bool) -> None:
    from revlib_xla import ReversibleError, ReversibleSequential
    from revlib_xla.reversible import stream_range_error

    timeout = datetime.timedelta(seconds=GLOO_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"file://{initfile}", rank=rank, world_size=WORLD, timeout=timeout)
    result: dict[str, Any] = {}
    try:
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 4)) for _ in range(2)]
        model = nn.parallel.DistributedDataParallel(ReversibleSequential(*blocks, split_dim=-1, exact=exact))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        if exact:  # rank 1's stream overflows the fixed-point grid
            x = x * (1e12 if rank == 1 else 1.0)
        else:  # float32 streams: inputs of 1 are rebuilt to ~1e-7; inputs of 1e-6 under blocks whose outputs are
            # ~0.3 are rebuilt to the blocks' rounding (~3e-8), a relative error of ~3e-2, far over float32's 1e-4
            x = x * (1e-6 if rank == 1 else 1.0)
        try:
            model(x).square().sum().backward()
            result["outcome"] = "no error"
            result["grads_finite"] = all(bool(p.grad.isfinite().all()) for p in model.parameters())
            result["range_error"] = str(stream_range_error(model))
        except ReversibleError as exc:
            result["outcome"] = ("ReversibleError", str(exc))
        except Exception as exc:  # e.g. the collective's timeout: a hang before the fix
            result["outcome"] = (type(exc).__name__, str(exc)[:300])
    except Exception:
        result["outcome"] = ("setup", traceback.format_exc())
    finally:
        torch.save(result, f"{out}.{rank}")
        dist.destroy_process_group()


def _run(exact: bool) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        initfile, out = str(Path(tmp) / "rendezvous"), str(Path(tmp) / "result")
        context = mp.start_processes(
            _worker, args=(initfile, out, exact), nprocs=WORLD, start_method="spawn", join=False
        )
        start = time.monotonic()
        while not context.join(timeout=1):
            if time.monotonic() - start > 300:  # a waiting process fails after GLOO_TIMEOUT_S; this is the backstop
                for process in context.processes:
                    process.kill()
                pytest.fail("the processes hang")
        return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(WORLD)]


@pytest.mark.slow  # two spawned processes (importing torch) and a gloo rendezvous
def test_only_one_ranks_data_cannot_be_rebuilt_and_every_rank_raises_the_same_error():
    """Before: rank 1 raised from its backward and rank 0 waited in DDP's gradient all-reduce until the timeout."""
    results = [r["outcome"] for r in _run(exact=False)]
    assert results[0][0] == "ReversibleError", results
    assert results[1] == results[0]  # the same message: the same (largest) error, in the first step
    assert "does not rebuild its input" in results[0][1]


@pytest.mark.slow  # two spawned processes (importing torch) and a gloo rendezvous
def test_only_one_ranks_exact_stream_overflows_and_no_rank_waits():
    """Exact streams in a data-parallel group: rank 1's stream overflows; raising there alone would leave rank 0
    in the gradient all-reduce. Instead rank 1's outputs are NaN, every rank's averaged gradients are NaN (a
    training loop stops on them), and stream_range_error names the layer on the rank at fault only."""
    results = _run(exact=True)
    assert [r["outcome"] for r in results] == ["no error", "no error"], results
    assert [r["grads_finite"] for r in results] == [False, False]
    assert results[0]["range_error"] == "None"
    assert "produced a value" in results[1]["range_error"]
