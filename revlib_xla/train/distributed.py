"""``revlib-xla train`` under ``torchrun``: several processes train one model on slices of every batch.

``torchrun --nproc_per_node=N -m revlib_xla.cli train --config FILE`` starts N processes with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in their environment. Each one:

* joins the process group through that environment, with the backend its device family reduces with (``gloo`` on
  the CPU, ``nccl`` on CUDA: :attr:`revlib_xla.backends.base.Backend.process_group_backend`), on its own device
  (``cuda:LOCAL_RANK``);
* builds the same weights (drawn from ``train.seed`` on the host, as one process does) and trains them as
  replicas whose gradients ``DistributedDataParallel`` averages (with its gradient buckets, reduced while the
  backward runs; the reversible and planned backwards accumulate each layer's gradients as plain autograd does, so
  the buckets fill in the same way). FSDP2 per block is used from Python (:mod:`revlib_xla.fsdp`): the CLI's
  checkpoints hold whole tensors;
* draws the same global batch as one process and trains on its slice (rank ``r`` of ``N`` takes rows
  ``r*B/N .. (r+1)*B/N``): the mean loss of equal slices, averaged over the processes, is the mean over the batch,
  so N processes end with the weights one process reaches on the whole batch;
* logs, shows progress and writes checkpoints on rank 0 only; every rank resumes from the same checkpoint.

What is refused, before any weight moves: a batch that the processes (times ``optim.grad_accum_steps``) cannot
split evenly, ``strategy.fused_optimizer`` (a fused step reads the process's own gradient, before the processes
average it), ``strategy.offload.params``, and a device family without a process-group backend (XLA: TPU pods train
through SPMD in one process).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .. import backend
from .config import RunConfig
from .strategy import StrategyError, language_model, lm_loss

__all__ = [
    "Processes",
    "launched_rank",
    "join_processes",
    "distribute",
    "per_process_step",
    "DataParallelLM",
    "SilentLogger",
]


def launched_rank() -> int:
    """This process's rank as ``torchrun`` set it (0 when not launched by it), readable before the process group
    exists: the CLI announces a run and its result once, from rank 0."""
    return int(os.environ.get("RANK", "0"))


@dataclasses.dataclass(frozen=True)
class Processes:
    """This process's place among the processes of a run."""

    rank: int
    world: int
    local_rank: int
    initialized_here: bool  # this module started the process group (and ends it)

    @property
    def main(self) -> bool:
        """Rank 0: the process that logs and writes checkpoints."""
        return self.rank == 0

    def slice(self, tokens: Tensor) -> Tensor:
        """This rank's rows of a global batch."""
        return tokens.chunk(self.world)[self.rank]

    def mean(self, value: Tensor) -> Tensor:
        """The mean of ``value`` over the processes (the global batch's loss from the slices' losses)."""
        total = value.detach().clone()
        torch.distributed.all_reduce(total)
        return total / self.world

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is set in any process (a stop request reaches the processes at different steps; they
        must stop after the same one)."""
        value = torch.tensor([int(flag)])
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        return bool(value.item())

    def end(self) -> None:
        if self.initialized_here and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _world_from_env() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise StrategyError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number of processes") from None


def join_processes(cfg: RunConfig, device: torch.device) -> tuple[Processes | None, torch.device]:
    """Join the process group ``torchrun`` describes in the environment (``WORLD_SIZE`` > 1), refusing what several
    processes cannot run; returns this process's place (``None`` for a single process) and its device."""
    world = _world_from_env()
    if world <= 1:
        return None, device
    s = cfg.strategy
    accum = cfg.optim.grad_accum_steps
    if cfg.data.batch_size % (world * accum):
        raise StrategyError(
            f"data.batch_size={cfg.data.batch_size}: {world} processes"
            + (f" with optim.grad_accum_steps={accum}" if accum > 1 else "")
            + f" each train on an equal slice of every batch, so it must be a multiple of {world * accum}"
        )
    if s.fused_optimizer:
        raise StrategyError(
            f"strategy.fused_optimizer=true under {world} processes: a fused step updates each parameter from this "
            f"process's own gradient during the backward, before the processes average it, and the replicas would "
            f"drift apart; use strategy.fused_optimizer=false (optimizer.step() after the averaged backward)"
        )
    if s.offload.params:
        raise StrategyError(
            f"strategy.offload.params=true under {world} processes is not supported; keep the parameters on the "
            f"device (strategy.offload.params=false), or run one process"
        )
    family = backend.backend_for(device)
    if family.process_group_backend is None:
        raise StrategyError(
            f"{world} processes on {device.type}: this device family does not train with several processes here "
            f"(TPU pods train in one process through SPMD); run one process, or train.device=cpu/cuda"
        )
    rank, local_rank = launched_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    device = family.process_device(device, local_rank)
    started = not torch.distributed.is_initialized()
    if started:
        torch.distributed.init_process_group(family.process_group_backend, init_method="env://")
    return Processes(rank, world, local_rank, started), device


class DataParallelLM(nn.Module):
    """The model trained through ``DistributedDataParallel``: ``loss`` runs DDP's forward (which its gradient
    averaging needs), ``lm`` holds the weights a checkpoint saves, evaluation runs the model itself."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.lm = language_model(model)
        self.model = model
        self.ddp = nn.parallel.DistributedDataParallel(_Loss(model))

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    def loss(self, tokens: Tensor) -> Tensor:
        return self.ddp(tokens) if torch.is_grad_enabled() else lm_loss(self.model, tokens)


class _Loss(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor) -> Tensor:
        return lm_loss(self.model, tokens)


def distribute(model: nn.Module, processes: Processes | None) -> nn.Module:
    """``model`` trained by ``processes`` (unchanged for a single process)."""
    return model if processes is None else DataParallelLM(model)


def per_process_step(step: Callable[[Tensor], Tensor], processes: Processes | None) -> Callable[[Tensor], Tensor]:
    """``step`` on this process's slice of each global batch, returning the global batch's loss."""
    if processes is None:
        return step
    found = processes
    return lambda tokens: found.mean(step(found.slice(tokens)))


class SilentLogger:
    """The metrics logger of ranks other than 0: they log nothing (rank 0 logs the run)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> SilentLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def step(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {}

    def eval(self, *args: Any, **kwargs: Any) -> None:
        return None

    def message(self, *args: Any, **kwargs: Any) -> None:
        return None
