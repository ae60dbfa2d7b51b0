"""``fewbit.util``'s names (``from revlib_xla.fewbit.util import convert_linear, map_module``)."""

from .conversion import convert_linear, map_module

__all__ = ["convert_linear", "map_module"]
