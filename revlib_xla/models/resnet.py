"""ResNet-18/50/101 (He et al. 2015, the torchvision layout) written as one flat ``nn.Sequential``.

The planner (:class:`revlib_xla.Checkpointable`) schedules sequential models stage by stage; residual blocks are
single stages (their skip connection stays inside), and the stem is ``conv -> bn -> relu -> maxpool``. The ReLUs
are in place, as in torchvision; the planner merges an in-place first operation into the stage before it, so a
checkpointed input is never overwritten.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["BasicBlock", "Bottleneck", "resnet", "resnet18", "resnet50", "resnet101"]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a skip connection (ResNet-18/34)."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(inplanes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + skip)


class Bottleneck(nn.Module):
    """1x1, 3x3, 1x1 convolutions with a skip connection (ResNet-50/101/152; stride on the 3x3, as torchvision)."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(inplanes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + skip)


def _downsample(inplanes: int, outplanes: int, stride: int) -> nn.Module | None:
    if stride == 1 and inplanes == outplanes:
        return None
    return nn.Sequential(nn.Conv2d(inplanes, outplanes, 1, stride, bias=False), nn.BatchNorm2d(outplanes))


def resnet(
    block: type[BasicBlock | Bottleneck],
    layers: Sequence[int],
    num_classes: int = 1000,
    width: int = 64,
    in_channels: int = 3,
) -> nn.Sequential:
    """A ResNet as a flat ``nn.Sequential``: stem, ``sum(layers)`` residual blocks, pooling and the classifier.

    ``width`` scales every layer's channels (64 is the standard network); a small width gives a small model for
    tests with the same structure.
    """
    stem: list[nn.Module] = [
        nn.Conv2d(in_channels, width, 7, 2, 3, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    blocks: list[nn.Module] = []
    inplanes = width
    for stage, count in enumerate(layers):
        planes = width * 2**stage
        for index in range(count):
            blocks.append(block(inplanes, planes, 2 if index == 0 and stage > 0 else 1))
            inplanes = planes * block.expansion
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inplanes, num_classes)]
    model = nn.Sequential(*stem, *blocks, *head)
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
    return model


def resnet18(num_classes: int = 1000, width: int = 64, in_channels: int = 3) -> nn.Sequential:
    return resnet(BasicBlock, [2, 2, 2, 2], num_classes, width, in_channels)


def resnet50(num_classes: int = 1000, width: int = 64, in_channels: int = 3) -> nn.Sequential:
    return resnet(Bottleneck, [3, 4, 6, 3], num_classes, width, in_channels)


def resnet101(num_classes: int = 1000, width: int = 64, in_channels: int = 3) -> nn.Sequential:
    return resnet(Bottleneck, [3, 4, 23, 3], num_classes, width, in_channels)
