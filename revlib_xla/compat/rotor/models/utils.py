"""``rotor.models.utils``: helpers for writing models as sequences that ``Checkpointable`` can schedule."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["ReLUAtEnd"]


class ReLUAtEnd(nn.Module):
    """``module`` followed by an in-place ReLU, as one stage.

    An in-place ReLU as a stage of its own would overwrite its input, which the schedule may keep as a checkpoint;
    applied to the output of the stage that computes it, it overwrites a tensor only this stage made.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.relu_(self.module(*args, **kwargs))
