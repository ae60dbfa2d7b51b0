"""Thin facades for code written against rotor, fairscale and FewBit: the same names, over revlib_xla's own API.

========================================================  ===============================================
the original                                              revlib_xla
========================================================  ===============================================
``import rotor``; ``rotor.Checkpointable(model, ...)``    ``from revlib_xla.compat import rotor``
``rotor.models.resnet101()``                              ``rotor.models.resnet101()``
``from rotor.models.utils import ReLUAtEnd``              ``from revlib_xla.compat.rotor.models.utils import ReLUAtEnd``
``from fairscale.experimental.nn.offload import ...``     ``from revlib_xla.compat.fairscale import OffloadModel``
``import fewbit``; ``from fewbit.util import ...``        ``from revlib_xla import fewbit``; ``revlib_xla.fewbit.util``
========================================================  ===============================================

RevLib needs no facade here: ``import revlib_xla as revlib`` (with ``revlib_xla.core`` and ``revlib_xla.utils``) is
RevLib's API. Every name is the native object (``compat.rotor.Checkpointable is revlib_xla.Checkpointable``), so
what the README says of the native API holds for it.
"""

from .. import fewbit
from . import fairscale, rotor

__all__ = ["rotor", "fairscale", "fewbit"]
