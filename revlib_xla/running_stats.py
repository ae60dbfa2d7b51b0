"""Normalization running statistics across recomputation.

A recomputed forward (checkpointing, reversible rebuilds) runs a batch-norm layer in training mode a second time,
which would update its running mean and variance twice per step. Both the reversible core and the planner's
executor wrap each recomputation in :func:`frozen_running_stats`, so the statistics are those of the plain model.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import nn

__all__ = ["tracks_running_stats", "norms_with_running_stats", "frozen_running_stats"]


def tracks_running_stats(module: nn.Module) -> bool:
    """Whether ``module`` is a normalization layer that updates running statistics (BatchNorm, InstanceNorm with
    ``track_running_stats=True``)."""
    return isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats


def norms_with_running_stats(module: nn.Module) -> List[nn.Module]:
    """Every submodule of ``module`` (itself included) that updates running statistics."""
    return [m for m in module.modules() if tracks_running_stats(m)]


class frozen_running_stats:  # noqa: N801 - used as a context manager, named like one
    """Within the block, normalization layers of ``norms`` in training mode leave their running statistics as they
    are: their momentum is 0 (the update keeps the old value; the batch statistics still normalize) and their
    batch counter is put back at exit.

    The buffers are not snapshotted and copied back: batch norm saves its running statistics for the backward, so
    writing to them between a recomputation and its backward would fail autograd's version check.
    """

    def __init__(self, norms: Sequence[nn.Module]) -> None:
        self.norms = [m for m in norms if m.training]
        self.saved: List[tuple] = []

    def __enter__(self) -> "frozen_running_stats":
        self.saved = [(m, m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone())
                      for m in self.norms]
        for m in self.norms:
            m.momentum = 0.0
        return self

    def __exit__(self, *exc) -> None:
        for m, momentum, count in self.saved:
            m.momentum = momentum
            if count is not None:
                with torch.no_grad():
                    m.num_batches_tracked.copy_(count)
        self.saved = []
