"""RevNet (Gomez et al. 2017, "The Reversible Residual Network"): ResNets whose activations are not stored.

The activations are split along the channels into two streams ``(x1, x2)`` and each residual unit is
``y1 = x1 + F(x2); y2 = x2 + G(y1)``: two layers of :class:`revlib_xla.ReversibleSequential`, which rebuilds each
unit's input from its output in the backward pass. The first unit of a stage that halves the resolution or widens
the channels cannot be inverted; it is run by plain autograd, as in the paper: ``y1 = h(x1) + F(x2);
y2 = h(x2) + G(y1)``, with ``h`` average pooling and zero-padded channels (CIFAR, parameter free) or a strided 1x1
convolution (ImageNet). So activation memory grows with the number of stages, not with their depth.

``F`` and ``G`` are pre-activation residual functions (BN-ReLU-conv), basic (two 3x3 convolutions) or bottleneck
(1x1, 3x3, 1x1, stride on the first); the first unit of the network skips the leading BN-ReLU, which the stem has
just applied. The head is BN-ReLU, global average pooling and a linear classifier. BatchNorm needs nothing special:
the recomputation sees the running statistics the forward saw, and they are updated once per forward
(:mod:`revlib_xla.recompute`).

Sizes (the paper's Table 1; ``channels`` lists the stem, then each stage, both streams together; a bottleneck
stage's output has 4x its channels, as in the authors' code):

=============  ==========  ==========  =====================  =========  ==============================
name           block       units       channels               paper      here (10 / 1000 classes)
=============  ==========  ==========  =====================  =========  ==============================
revnet-38      basic       3-3-3       32-32-64-112           0.46M      464,890
revnet-110     basic       9-9-9       32-32-64-128           1.73M      1,729,194
revnet-164     bottleneck  9-9-9       32-32-64-128           1.75M      1,748,778
revnet-104     bottleneck  2-2-11-2    128-128-256-512-832    45.2M      45,428,072
=============  ==========  ==========  =====================  =========  ==============================

RevNet-104 follows the authors' released configuration (stem 7x7/2 convolution and 3x3/2 max pooling, 128
channels; bottleneck widths 64-128-256-416 per stream; a 1x1 projection per stream in each downsampling unit),
which counts 45.43M parameters, 0.5% above the paper's 45.2M; the CIFAR models match the table to its rounding.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..reversible import MemoryModes, ReversibleSequential
from ._named import check_images, named_config

__all__ = [
    "RevNetConfig",
    "REVNET_SIZES",
    "RevNet",
    "RevNetDownsample",
    "revnet_names",
    "revnet_config",
    "build_revnet",
]


@dataclasses.dataclass(frozen=True)
class RevNetConfig:
    """Shape of a :class:`RevNet`.

    Args:
        units: residual units per stage (each is two reversible layers, ``F`` and ``G``).
        channels: the stem's output channels, then each stage's channels, both streams together (even numbers);
            with ``bottleneck`` a stage's output has 4x as many and its 3x3 convolutions half as many per stream.
        bottleneck: bottleneck units (1x1, 3x3, 1x1) instead of basic ones (3x3, 3x3).
        strides: each stage's stride (applied by its first unit).
        num_classes: classifier outputs.
        in_channels: image channels.
        image_size: the nominal input resolution (32 for CIFAR, 224 for ImageNet); any multiple of
            :attr:`RevNet.downsampling` works.
        imagenet_stem: 7x7/2 convolution and 3x3/2 max pooling before the stages (ImageNet) instead of one 3x3
            convolution (CIFAR).
        memory_mode: ``MemoryModes.autograd_function`` (reversible, the default) or ``MemoryModes.no_savings``
            (plain autograd, the same function: the reference).
    """

    units: tuple[int, ...] = (3, 3, 3)
    channels: tuple[int, ...] = (32, 32, 64, 112)
    bottleneck: bool = False
    strides: tuple[int, ...] = (1, 2, 2)
    num_classes: int = 10
    in_channels: int = 3
    image_size: int = 32
    imagenet_stem: bool = False
    memory_mode: MemoryModes = MemoryModes.autograd_function

    def __post_init__(self) -> None:
        stages = len(self.units)
        if not stages or len(self.channels) != stages + 1 or len(self.strides) != stages:
            raise ValueError(
                f"RevNetConfig: units has {stages} stages, so channels needs {stages + 1} entries (the stem, then "
                f"each stage) and strides {stages}; got channels={self.channels}, strides={self.strides}"
            )
        for name in ("units", "channels", "strides"):
            if any(v < 1 for v in getattr(self, name)):
                raise ValueError(f"RevNetConfig.{name} must be positive, got {getattr(self, name)}")
        if any(c % 2 for c in self.channels):
            raise ValueError(
                f"RevNetConfig.channels={self.channels}: every entry is split into two streams, so each must be even"
            )
        for name in ("num_classes", "in_channels", "image_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"RevNetConfig.{name} must be positive, got {getattr(self, name)}")
        object.__setattr__(self, "memory_mode", MemoryModes(self.memory_mode))


def _conv(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False)


def _residual_function(config: RevNetConfig, cin: int, cout: int, stride: int, preact: bool) -> nn.Sequential:
    """``F`` or ``G`` of one stream: ``cin`` to ``cout`` channels, pre-activation, stride on the first conv."""
    layers: list[nn.Module] = [nn.BatchNorm2d(cin), nn.ReLU()] if preact else []
    if config.bottleneck:
        width = cout // 4
        layers += [_conv(cin, width, 1, stride), nn.BatchNorm2d(width), nn.ReLU(), _conv(width, width, 3)]
        layers += [nn.BatchNorm2d(width), nn.ReLU(), _conv(width, cout, 1)]
    else:
        layers += [_conv(cin, cout, 3, stride), nn.BatchNorm2d(cout), nn.ReLU(), _conv(cout, cout, 3)]
    return nn.Sequential(*layers)


class _PoolPad(nn.Module):
    """The CIFAR shortcut: average pooling by ``stride`` and ``pad`` zero channels on each side (no parameters)."""

    def __init__(self, stride: int, pad: int) -> None:
        super().__init__()
        self.stride, self.pad = stride, pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride > 1:
            x = F.avg_pool2d(x, self.stride)
        return F.pad(x, (0, 0, 0, 0, self.pad, self.pad)) if self.pad else x


class RevNetDownsample(nn.Module):
    """The non-reversible first unit of a stage: ``y1 = h1(x1) + F(x2); y2 = h2(x2) + G(y1)`` on a ``(B, C, H, W)``
    tensor whose channel halves are the streams; ``h`` changes the resolution and channels as ``F`` does."""

    def __init__(self, f: nn.Module, g: nn.Module, h1: nn.Module, h2: nn.Module) -> None:
        super().__init__()
        self.f, self.g, self.h1, self.h2 = f, g, h1, h2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=1)
        y1 = self.h1(x1) + self.f(x2)
        return torch.cat([y1, self.h2(x2) + self.g(y1)], dim=1)


class RevNet(nn.Module):
    """An image classifier, ``(B, in_channels, H, W) -> (B, num_classes)`` logits; build it with
    :func:`build_revnet` or from a :class:`RevNetConfig`.

    Attributes: ``stem``, ``stages`` (each an ``nn.Sequential`` of an optional :class:`RevNetDownsample` and a
    :class:`revlib_xla.ReversibleSequential` of the stage's remaining units), ``head``.
    """

    def __init__(self, config: RevNetConfig) -> None:
        super().__init__()
        self.config = config
        stem_channels = config.channels[0]
        stem: list[nn.Module] = [
            _conv(
                config.in_channels, stem_channels, 7 if config.imagenet_stem else 3, 2 if config.imagenet_stem else 1
            ),
            nn.BatchNorm2d(stem_channels),
            nn.ReLU(),
        ]
        if config.imagenet_stem:
            stem.append(nn.MaxPool2d(3, 2, 1))
        self.stem = nn.Sequential(*stem)
        expansion = 4 if config.bottleneck else 1
        stream = stem_channels // 2
        stages = []
        for index, (units, filters, stride) in enumerate(zip(config.units, config.channels[1:], config.strides)):
            out = filters * expansion // 2
            parts: list[nn.Module] = []
            first_preact = index > 0  # the stem has just applied BN-ReLU
            if stride != 1 or out != stream:
                f = _residual_function(config, stream, out, stride, first_preact)
                g = _residual_function(config, out, out, 1, True)
                h1, h2 = (_shortcut(config, stream, out, stride) for _ in range(2))
                parts.append(RevNetDownsample(f, g, h1, h2))
                units -= 1
                first_preact = True
            blocks = []
            for unit in range(units):
                blocks.append(_residual_function(config, out, out, 1, first_preact or unit > 0))
                blocks.append(_residual_function(config, out, out, 1, True))
            if blocks:
                parts.append(ReversibleSequential(*blocks, split_dim=1, memory_mode=config.memory_mode))
            stages.append(nn.Sequential(*parts))
            stream = out
        self.stages = nn.ModuleList(stages)
        width = 2 * stream
        self.head = nn.Sequential(
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(width, config.num_classes),
        )
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    @property
    def downsampling(self) -> int:
        """The factor by which the stages reduce the resolution; input heights and widths must be multiples."""
        return (4 if self.config.imagenet_stem else 1) * math.prod(self.config.strides)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        config = self.config
        why = f"the stages reduce the resolution {self.downsampling}x and the shortcuts need even sizes at each step"
        check_images("RevNet", images, config.in_channels, self.downsampling, config.image_size, why)
        x = self.stem(images)
        for stage in self.stages:
            x = stage(x)
        return self.head(x)


def _shortcut(config: RevNetConfig, cin: int, cout: int, stride: int) -> nn.Module:
    if config.bottleneck:
        return _conv(cin, cout, 1, stride)
    if cout < cin or (cout - cin) % 2:
        raise ValueError(
            f"RevNetConfig: a basic stage goes from {2 * cin} to {2 * cout} channels; its parameter-free shortcut "
            f"pads zero channels evenly, so the channels must grow by a multiple of 4"
        )
    return _PoolPad(stride, (cout - cin) // 2)


REVNET_SIZES: dict[str, RevNetConfig] = {
    "revnet-38": RevNetConfig(units=(3, 3, 3), channels=(32, 32, 64, 112)),
    "revnet-110": RevNetConfig(units=(9, 9, 9), channels=(32, 32, 64, 128)),
    "revnet-164": RevNetConfig(units=(9, 9, 9), channels=(32, 32, 64, 128), bottleneck=True),
    "revnet-104": RevNetConfig(
        units=(2, 2, 11, 2),
        channels=(128, 128, 256, 512, 832),
        bottleneck=True,
        strides=(1, 2, 2, 2),
        num_classes=1000,
        image_size=224,
        imagenet_stem=True,
    ),
}
"""The paper's RevNets (see the module docstring); CIFAR-100 is ``num_classes=100``."""


def revnet_names() -> list[str]:
    """The named RevNets, for the model registry."""
    return list(REVNET_SIZES)


def revnet_config(name: str, **overrides: object) -> RevNetConfig:
    """The config of RevNet ``name`` with ``overrides`` (RevNetConfig fields); unknown names or fields raise
    ValueError listing the choices."""
    return named_config("RevNet", REVNET_SIZES, name, overrides)


def build_revnet(name: str, **overrides: object) -> RevNet:
    """RevNet ``name`` (one of :func:`revnet_names`) with ``overrides``; builds under ``torch.device("meta")``."""
    return RevNet(revnet_config(name, **overrides))
