"""``revlib-xla train`` under ``torchrun``: several processes train one model on slices of every batch.

``torchrun --nproc_per_node=N -m revlib_xla.cli train --config FILE`` starts N processes with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in their environment. Each one:

* joins the process group through that environment, with the backend its device family reduces with (``gloo`` on
  the CPU, ``nccl`` on CUDA: :attr:`revlib_xla.backends.base.Backend.process_group_backend`), on its own device
  (``cuda:LOCAL_RANK``);
* builds the same weights (drawn from ``train.seed`` on the host, as one process does) and splits the model as
  ``strategy.data_parallel`` says:

  - ``ddp`` (the default): replicas whose gradients ``DistributedDataParallel`` averages (with its gradient buckets,
    reduced while the backward runs; the reversible and planned backwards accumulate each layer's gradients as
    plain autograd does, so the buckets fill in the same way);
  - ``fsdp2``: FSDP2 (``fully_shard``) on each transformer block, then on the rest of the model as the root
    (:class:`ShardedLM`): each process holds 1/N of every weight, gradient and AdamW moment, and the reversible
    and planned backwards recompute each block through its unit (:mod:`revlib_xla.fsdp`);
* draws the same global batch as one process and trains on its slice (rank ``r`` of ``N`` takes rows
  ``r*B/N .. (r+1)*B/N``): the mean loss of equal slices, averaged over the processes, is the mean over the batch,
  so N processes end with the weights one process reaches on the whole batch;
* logs, shows progress and writes checkpoints on rank 0 only; every rank resumes from the same checkpoint.
  Checkpoints hold whole tensors either way (under ``fsdp2`` every rank gathers them, rank 0 writes them, and a
  resume splits them again: :func:`whole_state`), so a run resumes with any number of processes, sharded or not.

What is refused, before any weight moves: a batch that the processes (times ``optim.grad_accum_steps``) cannot
split evenly, ``strategy.fused_optimizer`` (a fused step reads the process's own gradient, before the processes
average it), ``strategy.offload.params``, and a device family without a process-group backend (XLA: TPU pods train
through SPMD in one process); under ``fsdp2`` also ``strategy.offload.optimizer`` (and so
``param_dtype=bf16``: its host AdamW keeps whole master weights; FSDP2's own ``MixedPrecisionPolicy`` is not wired
to the key yet), a ``model.hf_config`` model (no known blocks to shard), stacked (scanned) layers (one stack owns
every layer's weights, so FSDP2 could only gather them all at once; scan saves compile time on XLA, and on
cpu/cuda runs layer by layer anyway), and a torch without FSDP2.

Collectives per step (``revlib_xla.fsdp.counted_steps``, tests/train/test_fsdp2_cli.py): each unit's weights are
gathered twice a step (the root's once) and its gradients reduced once, for ``none``, ``reversible`` and ``plan``
alike; the reversible LM has two units per transformer block (its layers: attention and MLP), so it makes more,
smaller all-gathers of the same weights.

Each process still builds the whole model on its device before ``fully_shard`` splits it (under a mesh, SPMD
builds it piece by piece: :class:`revlib_xla.sharding.ShardedWriter`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import Tensor, nn

from .. import _tree, backends
from ..fsdp import fsdp_module_type, fully_shard_function
from ..planner.checkpointable import Checkpointable
from ..reversible import ReversibleSequential
from .config import RunConfig
from .strategies.activations import PlannedLM
from .strategies.base import StrategyError, language_model, lm_loss
from .strategies.sizing import world_from_env

__all__ = [
    "Processes",
    "launched_rank",
    "join_processes",
    "distribute",
    "agree_on_schedule",
    "per_process_step",
    "DataParallelLM",
    "ShardedLM",
    "whole_state",
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


def join_processes(cfg: RunConfig, device: torch.device) -> tuple[Processes | None, torch.device]:
    """Join the process group ``torchrun`` describes in the environment (``WORLD_SIZE`` > 1), refusing what several
    processes cannot run; returns this process's place (``None`` for a single process) and its device."""
    world = world_from_env()
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
    if s.data_parallel == "fsdp2":
        _check_fsdp2(cfg, world)
    family = backends.backend_for(device)
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


def _check_fsdp2(cfg: RunConfig, world: int) -> None:
    """Refuse what ``strategy.data_parallel=fsdp2`` cannot shard, before any weight moves."""
    where = f"strategy.data_parallel=fsdp2 under {world} processes"
    if fully_shard_function() is None:
        raise StrategyError(f"{where}: this torch {torch.__version__} has no FSDP2 (fully_shard); use ddp")
    if cfg.strategy.offload.optimizer:
        raise StrategyError(
            f"{where} with strategy.offload.optimizer=true: the host AdamW keeps a whole float32 master copy of every "
            f"weight, not this process's shard; use strategy.offload.optimizer=false (FSDP2 splits the AdamW state "
            f"over the processes already; param_dtype=bf16 needs the host optimizer, so keep param_dtype=fp32), or "
            f"strategy.data_parallel=ddp"
        )
    if cfg.model.hf_config is not None:
        raise StrategyError(
            f"{where}: model.hf_config={cfg.model.hf_config} has no known blocks to shard; use "
            f"strategy.data_parallel=ddp, or model.name=llama-*"
        )


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

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Forward and backward passes inside add to this process's gradients without averaging them over the
        processes: the micro-batches before the last (:func:`revlib_xla.train.strategy.make_step`), so that one
        all-reduce per step averages their sum."""
        return self.ddp.no_sync()


class _Loss(nn.Module):
    """The model's loss (or logits) as a module's forward: what DDP and FSDP2's root hooks run."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, logits: bool = False) -> Tensor:
        return self.model(tokens) if logits else lm_loss(self.model, tokens)


def _blocks(lm: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``lm`` that FSDP2 shards one by one: each reversible layer's block (its recomputation
    runs the block through its ``__call__``), or each block of a plain stack (also the planner's stages' blocks)."""
    layers = getattr(lm, "layers", None)
    if isinstance(layers, ReversibleSequential):
        if any(True for _ in layers.parameters(recurse=False)):
            raise StrategyError(
                "strategy.data_parallel=fsdp2: the layers' parameters are stacked (model.scan), so no block owns its "
                "own weights to shard; use model.scan=false, or strategy.data_parallel=ddp"
            )
        return [cast(nn.Module, layer.block) for layer in layers]
    if isinstance(layers, nn.ModuleList):
        return list(layers)
    raise StrategyError(
        f"strategy.data_parallel=fsdp2: {type(lm).__name__} has no `layers` of blocks to shard; use "
        f"strategy.data_parallel=ddp"
    )


class ShardedLM(nn.Module):
    """The model trained through FSDP2: ``fully_shard`` on each block of the LM, then on the rest of it (the root,
    around the loss so its hooks run for ``loss``); ``lm`` holds the (sharded) weights a checkpoint saves, through
    :func:`whole_state`."""

    def __init__(self, model: nn.Module, device: torch.device, world: int) -> None:
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard = fully_shard_function()
        mesh = init_device_mesh(device.type, (world,))
        self.lm = language_model(model)
        self.model = model
        for block in _blocks(self.lm):
            fully_shard(block, mesh=mesh)
        self.root = fully_shard(_Loss(model), mesh=mesh)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.root(tokens, logits=True)

    def loss(self, tokens: Tensor) -> Tensor:
        return self.root(tokens)


def distribute(model: nn.Module, processes: Processes | None, cfg: RunConfig) -> nn.Module:
    """``model`` trained by ``processes`` (unchanged for a single process), as ``strategy.data_parallel`` says. A
    planned model is planned again for the batch of one process (before sharding: the measurement runs its stages
    one by one, outside FSDP2's hooks), and every process takes rank 0's schedule (:func:`agree_on_schedule`)."""
    if processes is None:
        return model
    if isinstance(model, PlannedLM):
        micro_batch = cfg.data.batch_size // (processes.world * cfg.optim.grad_accum_steps)
        device = next(model.parameters()).device
        model.plan(torch.zeros(micro_batch, cfg.data.seq_len, dtype=torch.long, device=device))
        agree_on_schedule(model.planned)
    if cfg.strategy.data_parallel == "fsdp2":
        return ShardedLM(model, next(model.parameters()).device, processes.world)
    return DataParallelLM(model)


def agree_on_schedule(planned: Checkpointable) -> None:
    """Every process runs rank 0's schedule of ``planned`` (call in every process, after planning: a collective).
    Each process plans from its own measurements of the stages, whose times differ from process to process, so
    near a tie they can pick different schedules; processes on different schedules gather and reduce FSDP2's units
    (or DDP's buckets) in different orders and wait on each other forever."""
    found = [planned.sequence]
    torch.distributed.broadcast_object_list(found, src=0)
    planned.sequence = found[0]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        return None
    return DTensor


def _sharded(tensor: Tensor) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def _whole(tensor: Tensor) -> Tensor:
    """``tensor`` whole: a sharded ``DTensor`` gathered from every process (a collective), else itself."""
    return tensor.full_tensor() if _sharded(tensor) else tensor  # type: ignore[attr-defined]  # a DTensor's


def _split_like(target: Tensor, value: Tensor) -> Tensor:
    """``value`` (a whole tensor, the same in every process) sharded as ``target`` is."""
    from torch.distributed.tensor import distribute_tensor

    mesh = target.device_mesh  # type: ignore[attr-defined]  # a DTensor's
    return distribute_tensor(value.to(mesh.device_type), mesh, target.placements)  # type: ignore[attr-defined]


def _gathered(tensor: Tensor, keep: bool) -> Tensor:
    """``tensor`` whole on the host where ``keep`` (rank 0, which writes it); every process takes part in the
    gather, the others drop the result at once (no whole copy of the model in every process)."""
    whole = _whole(tensor.detach())
    return whole.to("cpu") if keep else whole.new_empty(0)


class _WholeWeights(nn.Module):
    """A sharded LM's parameters as whole host tensors under their names (a stand-in module for the checkpoint's
    reader and writer: only ``named_parameters``, ``named_buffers`` and ``state_dict`` are used): gathered to rank 0
    for saving, or empty for loading, and then :meth:`write_back` splits what was loaded into the sharded
    parameters."""

    def __init__(self, lm: nn.Module, loading: bool, keep: bool) -> None:
        super().__init__()
        whole: dict[int, nn.Parameter] = {}  # tied weights stay one tensor
        self._pairs = []
        for name, p in lm.named_parameters(remove_duplicate=False):
            if id(p) not in whole:
                value = torch.empty(p.shape, dtype=p.dtype) if loading else _gathered(p, keep)
                whole[id(p)] = nn.Parameter(value, requires_grad=False)
            self._pairs.append((name, p, whole[id(p)]))
        self._buffers_of = list(lm.named_buffers(remove_duplicate=False))

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        seen: set[int] = set()
        for name, _, whole in self._pairs:
            if remove_duplicate and id(whole) in seen:
                continue
            seen.add(id(whole))
            yield prefix + name, whole

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Tensor]]:
        for name, buffer in self._buffers_of:
            yield prefix + name, buffer

    def state_dict(  # type: ignore[override]  # the stand-in's whole tensors under the LM's names
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        out: dict[str, Any] = {} if destination is None else destination
        for name, _, whole in self._pairs:
            out[prefix + name] = whole if keep_vars else whole.detach()
        for name, buffer in self._buffers_of:
            out[prefix + name] = buffer
        return out

    def whole_of(self) -> dict[int, nn.Parameter]:
        """``id(sharded parameter)`` -> its whole stand-in."""
        return {id(p): whole for _, p, whole in self._pairs}

    def write_back(self) -> None:
        with torch.no_grad():
            done: set[int] = set()
            for _, p, whole in self._pairs:
                if id(p) not in done:
                    done.add(id(p))
                    p.copy_(_split_like(p, whole.to(p.dtype)))


class _WholeOptimizer(torch.optim.Optimizer):
    """A sharded model's optimizer seen with whole state tensors (a stand-in for the checkpoint's reader and writer:
    only ``state_dict`` and ``load_state_dict`` are used): the state is gathered to rank 0 when made for saving; a
    loaded state is split as each parameter is."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, loading: bool, keep: bool, whole_of: dict[int, nn.Parameter]
    ) -> None:
        # no Optimizer.__init__: a view of ``optimizer``
        self.inner = optimizer
        self.whole = {} if loading else _tree.map_tensors(lambda t: _gathered(t, keep), optimizer.state_dict())
        # the inner groups, each parameter replaced by its whole stand-in (what the checkpoint's names refer to)
        self.param_groups = [{**g, "params": [whole_of[id(p)] for p in g["params"]]} for g in optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return dict(self.whole)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        for param, state in self.inner.state.items():
            for key, value in state.items():
                if isinstance(value, Tensor) and value.shape == param.shape and not _sharded(value):
                    state[key] = _split_like(param, value)


@contextlib.contextmanager
def whole_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, loading: bool = False
) -> Iterator[tuple[nn.Module, torch.optim.Optimizer]]:
    """The LM and optimizer a checkpoint saves (or, with ``loading``, loads) with whole tensors. For a
    :class:`ShardedLM` (call in every process: collectives): for saving, gathered to rank 0's host; for loading,
    host tensors that the checkpoint fills and that are split into the sharded model and optimizer (on exit for
    the weights). Else ``language_model(model)`` and ``optimizer`` themselves."""
    lm = language_model(model)
    if not isinstance(model, ShardedLM):
        yield lm, optimizer
        return
    unit = fsdp_module_type()
    for module in model.modules():  # a forward without backward (evaluation) leaves the root's weights unsharded
        if unit is not None and isinstance(module, unit):
            cast(Any, module).reshard()  # FSDPModule's
    keep = torch.distributed.get_rank() == 0
    weights = _WholeWeights(lm, loading, keep)
    yield weights, _WholeOptimizer(optimizer, loading, keep, weights.whole_of())
    if loading:
        weights.write_back()


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
