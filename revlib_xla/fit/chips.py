"""The chip table, kept at :mod:`revlib_xla.chips` (data that training and sizing both read); this name stays so
``revlib_xla.fit.chips`` imports keep working."""

from ..chips import CHIPS, GPU_CHIPS, TPU_CHIPS, TPU_RESERVED_BYTES, Chip, GiB, chip

__all__ = ["Chip", "CHIPS", "TPU_CHIPS", "GPU_CHIPS", "chip", "TPU_RESERVED_BYTES", "GiB"]
