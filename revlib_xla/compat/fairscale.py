"""fairscale's ``fairscale.experimental.nn.offload``: ``OffloadModel`` with fairscale's signature
(``OffloadModel(model, device, offload_device=..., num_slices=3, checkpoint_activation=False, num_microbatches=1)``)
is :class:`revlib_xla.OffloadModel`, which also runs on xla and cpu."""

from ..offload_model import OffloadModel, OffloadModelError

__all__ = ["OffloadModel", "OffloadModelError"]
