"""``rotor.models``: ResNets as one flat ``nn.Sequential``, which ``Checkpointable`` schedules stage by stage."""

from ....models import resnet18, resnet50, resnet101
from . import utils

__all__ = ["resnet18", "resnet50", "resnet101", "utils"]
