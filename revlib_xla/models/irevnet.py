"""i-RevNet (Jacobsen, Smeulders and Oyallon 2018, "i-RevNet: Deep Invertible Networks"): a classifier whose
features are an invertible function of the image, ``model.inverse(model.features(x)) == x``.

Nothing is discarded before the classifier: the image is rearranged (space-to-depth, ``pixel_unshuffle``) instead
of convolved by a stem, the resolution is halved the same way instead of by strided pooling, and where a stage needs
more channels than the rearrangement gives, zero channels are appended (the *injective* i-RevNet; the inverse drops
them). Each block is one reversible layer, ``(x1, x2) -> (x2, x1 + F(x2))`` with ``F`` a pre-activation bottleneck
of three 3x3 convolutions; a stage is one :class:`revlib_xla.ReversibleSequential`, so activation memory does not
grow with the number of blocks. The first block of a strided stage computes ``F`` from its stream at the earlier
resolution (``pixel_shuffle`` undoes the rearrangement inside ``F``) with a strided convolution, as in the paper.

Sizes (``channels`` per stream and stage, ``blocks`` per stage):

* ``irevnet-301`` -- the paper's bijective ImageNet model (its i-RevNet (b)): 224x224 images rearranged 2x, stages
  of 6-16-72-6 blocks with 24-96-384-1536 channels, stride 2 each: the features have 3 x 224 x 224 values, as many
  as the image. 300 convolutions and the classifier; 125.1M parameters here (the paper lists 125M).
* ``irevnet-cifar`` -- the injective CIFAR model of the authors' code: 18-18-18 blocks, 16-64-256 channels, strides
  1-2-2, the 3 image channels padded to 32.
* ``irevnet-revlib`` -- the shape of RevLib's README iRevNet example: one stage of 3 blocks, 64 channels per stream
  at the full 224x224 resolution, ``F`` widened 4x inside, dropout 0.2, and a 3x3 convolution to 1000 classes per
  pixel: ``(1, 3, 224, 224) -> (1, 1000, 224, 224)``; here the 3 image channels are padded to 128 instead of
  convolved, so the features stay invertible.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..reversible import MemoryModes, ReversibleSequential
from ._named import check_images, named_config

__all__ = [
    "IRevNetConfig",
    "IREVNET_SIZES",
    "IRevNet",
    "IRevNetStage",
    "irevnet_names",
    "irevnet_config",
    "build_irevnet",
]


@dataclasses.dataclass(frozen=True)
class IRevNetConfig:
    """Shape of an :class:`IRevNet`.

    Args:
        blocks: reversible blocks per stage.
        strides: each stage's resolution reduction (1 or more), done by ``pixel_unshuffle`` (channels x stride^2).
        channels: each stage's channels per stream; at least what the rearrangement gives (the rest is zeros).
        init_ds: the image's space-to-depth factor before the first stage (1: none).
        hidden_ratio: the hidden channels of ``F`` as a fraction of the stream's (the paper's 1/4).
        dropout: dropout inside ``F`` (after its second convolution).
        num_classes: classifier outputs.
        in_channels: image channels.
        image_size: the nominal input resolution; inputs must be multiples of :attr:`IRevNet.downsampling`.
        head: ``"pool"``: BN-ReLU, global average pooling, linear (``(B, num_classes)``); ``"dense"``: a 3x3
            convolution to ``num_classes`` per pixel (``(B, num_classes, H', W')``).
        memory_mode: ``MemoryModes.autograd_function`` (reversible) or ``MemoryModes.no_savings`` (the reference).
    """

    blocks: tuple[int, ...] = (18, 18, 18)
    strides: tuple[int, ...] = (1, 2, 2)
    channels: tuple[int, ...] = (16, 64, 256)
    init_ds: int = 1
    hidden_ratio: float = 0.25
    dropout: float = 0.0
    num_classes: int = 10
    in_channels: int = 3
    image_size: int = 32
    head: Literal["pool", "dense"] = "pool"
    memory_mode: MemoryModes = MemoryModes.autograd_function

    def __post_init__(self) -> None:
        stages = len(self.blocks)
        if not stages or len(self.strides) != stages or len(self.channels) != stages:
            raise ValueError(
                f"IRevNetConfig: blocks, strides and channels need one entry per stage; got blocks={self.blocks}, "
                f"strides={self.strides}, channels={self.channels}"
            )
        for name in ("blocks", "strides", "channels"):
            if any(v < 1 for v in getattr(self, name)):
                raise ValueError(f"IRevNetConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("init_ds", "num_classes", "in_channels", "image_size", "hidden_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"IRevNetConfig.{name} must be positive, got {getattr(self, name)}")
        if self.head not in ("pool", "dense"):
            raise ValueError(f"IRevNetConfig.head must be 'pool' or 'dense', got {self.head!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"IRevNetConfig.dropout must be in [0, 1), got {self.dropout}")
        total = self.in_channels * self.init_ds**2
        for stage, (stride, channels) in enumerate(zip(self.strides, self.channels)):
            total *= stride**2
            if 2 * channels < total:
                raise ValueError(
                    f"IRevNetConfig: stage {stage} has {total} channels after its space-to-depth rearrangement but "
                    f"channels[{stage}]={channels} per stream holds only {2 * channels}; an invertible network cannot "
                    f"drop channels: make channels[{stage}] at least {-(-total // 2)}"
                )
            if channels % stride**2:
                raise ValueError(
                    f"IRevNetConfig: channels[{stage}]={channels} must be divisible by strides[{stage}]^2="
                    f"{stride**2}: the stage's first block undoes the rearrangement of its stream"
                )
            total = 2 * channels
        object.__setattr__(self, "memory_mode", MemoryModes(self.memory_mode))


class _Rearrange(nn.Module):
    """Invertible entry of a stage: ``pixel_unshuffle`` by ``factor`` then ``pad`` zero channels appended."""

    def __init__(self, factor: int, pad: int) -> None:
        super().__init__()
        self.factor, self.pad = factor, pad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.factor > 1:
            x = F.pixel_unshuffle(x, self.factor)
        return F.pad(x, (0, 0, 0, 0, 0, self.pad)) if self.pad else x

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        if self.pad:
            y = y[:, : y.shape[1] - self.pad]
        return F.pixel_shuffle(y, self.factor) if self.factor > 1 else y


class IRevNetStage(nn.Module):
    """One stage: the invertible rearrangement, then the reversible blocks (channel halves are the streams)."""

    def __init__(self, rearrange: _Rearrange, blocks: ReversibleSequential) -> None:
        super().__init__()
        self.rearrange, self.blocks = rearrange, blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.rearrange(x))

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return self.rearrange.inverse(self.blocks.inverse(y))


def _block(config: IRevNetConfig, channels: int, stride: int, first: bool) -> nn.Sequential:
    """``F`` of one block: its stream (at the earlier resolution when ``stride > 1``) to ``channels``."""
    hidden = max(1, int(channels * config.hidden_ratio))
    cin = channels // stride**2
    layers: list[nn.Module] = [nn.PixelShuffle(stride)] if stride > 1 else []
    if not first:
        layers += [nn.BatchNorm2d(cin), nn.ReLU()]
    layers += [nn.Conv2d(cin, hidden, 3, stride, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU()]
    layers += [nn.Conv2d(hidden, hidden, 3, 1, 1, bias=False), nn.Dropout(config.dropout)]
    layers += [nn.BatchNorm2d(hidden), nn.ReLU(), nn.Conv2d(hidden, channels, 3, 1, 1, bias=False)]
    return nn.Sequential(*layers)


class IRevNet(nn.Module):
    """An invertible image classifier: :meth:`features` maps ``(B, in_channels, H, W)`` to ``(B, 2 * channels[-1],
    H / downsampling, W / downsampling)`` invertibly (:meth:`inverse`), and :meth:`forward` applies the head."""

    def __init__(self, config: IRevNetConfig) -> None:
        super().__init__()
        self.config = config
        self.init = _Rearrange(config.init_ds, 0)
        total = config.in_channels * config.init_ds**2
        stages = []
        first = True
        for count, stride, channels in zip(config.blocks, config.strides, config.channels):
            rearrange = _Rearrange(stride, 2 * channels - total * stride**2)
            blocks = [_block(config, channels, stride, first)]
            blocks += [_block(config, channels, 1, False) for _ in range(count - 1)]
            stages.append(IRevNetStage(rearrange, ReversibleSequential(*blocks, memory_mode=config.memory_mode)))
            total, first = 2 * channels, False
        self.stages = nn.ModuleList(stages)
        self.head: nn.Module
        if config.head == "pool":
            self.head = nn.Sequential(
                nn.BatchNorm2d(total),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(total, config.num_classes),
            )
        else:
            self.head = nn.Conv2d(total, config.num_classes, 3, padding=1)

    @property
    def downsampling(self) -> int:
        """The factor by which the network reduces the resolution; input sizes must be multiples of it."""
        return self.config.init_ds * math.prod(self.config.strides)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """The invertible representation of ``images`` (what the head classifies)."""
        config = self.config
        why = f"the network rearranges pixels into channels {self.downsampling}x, invertibly only on whole blocks"
        check_images("IRevNet", images, config.in_channels, self.downsampling, config.image_size, why)
        x = self.init(images)
        for stage in self.stages:
            x = stage(x)
        return x

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))

    def inverse(self, features: torch.Tensor) -> torch.Tensor:
        """The images whose :meth:`features` are ``features``, in eval mode (in training mode BatchNorm would
        normalise with another batch's statistics and update its running statistics, and dropout is random)."""
        if self.training:
            raise RuntimeError(
                "IRevNet.inverse reconstructs with fixed BatchNorm statistics and no dropout: call model.eval() "
                "first (and model.train() again to continue training)"
            )
        x = features
        for stage in reversed(cast(list[IRevNetStage], list(self.stages))):
            x = stage.inverse(x)
        return self.init.inverse(x)


IREVNET_SIZES: dict[str, IRevNetConfig] = {
    "irevnet-301": IRevNetConfig(
        blocks=(6, 16, 72, 6),
        strides=(2, 2, 2, 2),
        channels=(24, 96, 384, 1536),
        init_ds=2,
        num_classes=1000,
        image_size=224,
    ),
    "irevnet-cifar": IRevNetConfig(),
    "irevnet-revlib": IRevNetConfig(
        blocks=(3,),
        strides=(1,),
        channels=(64,),
        hidden_ratio=4.0,
        dropout=0.2,
        num_classes=1000,
        image_size=224,
        head="dense",
    ),
}
"""The named i-RevNets (see the module docstring)."""


def irevnet_names() -> list[str]:
    """The named i-RevNets, for the model registry."""
    return list(IREVNET_SIZES)


def irevnet_config(name: str, **overrides: object) -> IRevNetConfig:
    """The config of i-RevNet ``name`` with ``overrides`` (IRevNetConfig fields); unknown names or fields raise
    ValueError listing the choices."""
    return named_config("i-RevNet", IREVNET_SIZES, name, overrides)


def build_irevnet(name: str, **overrides: object) -> IRevNet:
    """i-RevNet ``name`` (one of :func:`irevnet_names`) with ``overrides``; builds under ``torch.device("meta")``."""
    return IRevNet(irevnet_config(name, **overrides))
