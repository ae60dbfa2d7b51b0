"""Global-norm clipping and gradient accumulation under several processes, through ``revlib-xla train``: the
gradients the optimizer steps with equal one process's on the whole batch, elementwise.

A clip by each process's own shard norm (FSDP2's gradients are DTensors: each process holds 1/N of every gradient)
or a sum that misses a micro-batch would be a silent wrong update that AdamW's first steps hide (its update is
nearly invariant to a gradient's scale), so the gradients are compared where the optimizer reads them: a global
optimizer step pre-hook records them (whole tensors) in every run. Two gloo processes, one spawn, a DDP and an FSDP2
run of one step each, with ``optim.grad_accum_steps=2`` and a clip far below the gradients' norm (0.01: every
gradient is scaled). DDP all-reduces once per step (the micro-batches before the last run under ``no_sync``); FSDP2
reduce-scatters after every micro-batch, which keeps each process's gradients sharded between them.

Tolerance: float32; the processes add the batch's halves and micro-batches in another order than one process
(a few roundings, eps = 1.2e-7, per sum): rtol 1e-5 with atol 1e-8 (the clipped gradients are ~1e-3).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import TINY_RUN, run_ranks

from revlib_xla.fsdp import fully_shard_function

WORLD = 2
RUNS = ["ddp"] + (["fsdp2"] if fully_shard_function() is not None else [])
CLIP = 0.01

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _config(data_parallel: str, out: Path) -> Any:
    from revlib_xla.train.config import load_config

    return load_config(
        None,
        [
            *TINY_RUN,
            "strategy=reversible",
            f"strategy.data_parallel={data_parallel}",
            "optim.grad_accum_steps=2",
            f"optim.grad_clip={CLIP}",
            "train.steps=1",
            "train.eval_every=0",
            "train.checkpoint_every=0",
            "train.progress=false",
            "train.device=cpu",
            f"train.out_dir={out}",
        ],
    )


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)  # a DTensor (FSDP2): gathered from every process
    return (full() if full is not None else tensor).detach().clone()


def _recorded_train(cfg: Any) -> tuple[list[torch.Tensor], float]:
    """The gradients of every parameter the optimizer steps with (whole tensors, in its groups' order), and their
    global norm before the clip (the loop's logged grad norm is not needed: the clip's coefficient is in them)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from revlib_xla.train.loop import train

    grads: list[torch.Tensor] = []

    def record(optimizer: Any, args: Any, kwargs: Any) -> None:
        grads.extend(_whole(p.grad) for group in optimizer.param_groups for p in group["params"])

    handle = register_optimizer_step_pre_hook(record)
    try:
        result = train(cfg)
    finally:
        handle.remove()
    return grads, float(result.losses[1])


def _count_ddp_all_reduces(calls: list[int]) -> None:
    """Every DistributedDataParallel made in this process appends to ``calls`` at each bucket all-reduce (a comm hook
    that then all-reduces as DDP's default does)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    def counting(state, bucket):  # unannotated: DDP checks the annotation is dist.GradBucket, or none
        calls.append(1)
        return default_hooks.allreduce_hook(state, bucket)

    init = DistributedDataParallel.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.register_comm_hook(None, counting)

    DistributedDataParallel.__init__ = counted  # type: ignore[method-assign]  # this spawned process only


def _cases(rank: int, results: dict[str, Any]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    root = Path(os.environ["TRUST_CLIP_ROOT"])
    all_reduces: list[int] = []
    _count_ddp_all_reduces(all_reduces)
    for data_parallel in RUNS:
        results[data_parallel] = _recorded_train(_config(data_parallel, root / f"{data_parallel}-{rank}"))
    results["ddp all-reduces"] = len(all_reduces)


@pytest.mark.slow  # two spawned processes and one reference run
def test_clipped_accumulated_gradients_equal_one_process_on_the_whole_batch():
    with tempfile.TemporaryDirectory() as tmp:
        reference, loss = _recorded_train(_config("ddp", Path(tmp) / "one"))  # one process: no data parallelism
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in reference]))
        assert norm == pytest.approx(CLIP, rel=1e-5)  # the clip applied, to the global norm
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TRUST_CLIP_ROOT", tmp)
            ranks = run_ranks(_cases, WORLD, tmp)
    for rank, result in enumerate(ranks):
        # One step of 2 micro-batches: one all-reduce of the sum (the tiny model's gradients fill DDP's first 1 MB
        # bucket alone). Before: one per micro-batch (2), the first one's average wasted.
        assert result["ddp all-reduces"] == 1, rank
        for data_parallel in RUNS:
            grads, got_loss = result[data_parallel]
            assert got_loss == pytest.approx(loss, rel=1e-5), (rank, data_parallel)
            assert [g.shape for g in grads] == [g.shape for g in reference]
            for i, (got, want) in enumerate(zip(grads, reference)):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8, msg=lambda m: f"{data_parallel} {i}: {m}")
