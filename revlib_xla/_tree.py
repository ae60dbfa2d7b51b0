"""The one walker over nested values: ``torch.utils._pytree``, as ``torch.utils.checkpoint`` uses it.

Inputs and outputs of stages, blocks and steps may be tensors or tuples, lists, dicts, named tuples, ordered dicts
and classes registered with ``torch.utils._pytree.register_pytree_node``, nested. Every feature walks them through
these helpers so that they agree on what a leaf is and in which order leaves come.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["detached", "map_tensors", "tensor_leaves", "tree_flatten", "tree_leaves", "tree_unflatten"]

tree_flatten = pytree.tree_flatten
tree_unflatten = pytree.tree_unflatten
tree_leaves = pytree.tree_leaves


def _hides_tensors(leaf: Any) -> bool:
    """Whether a leaf pytree did not open (a subclass of list, tuple or dict it does not know) holds tensors."""
    if isinstance(leaf, dict):
        inner: Any = list(leaf.values())
    elif isinstance(leaf, (list, tuple)):
        inner = list(leaf)
    else:
        return False
    return any(isinstance(t, torch.Tensor) or _hides_tensors(t) for t in pytree.tree_leaves(inner))


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, in pytree order. A container pytree does not walk (a subclass of list, tuple or dict
    that is not registered) and that holds tensors is refused: its tensors would be missed silently."""
    leaves = pytree.tree_leaves(value)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) and _hides_tensors(leaf):
            raise TypeError(
                f"a value holds tensors inside a {type(leaf).__name__}, which torch.utils._pytree does not walk: use "
                f"a tuple, list or dict, or register the class with torch.utils._pytree.register_pytree_node"
            )
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` with every tensor ``t`` replaced by ``fn(t)``; other leaves and the structure are kept."""
    tensor_leaves(value)  # refuses containers whose tensors would be missed
    return pytree.tree_map_only(torch.Tensor, fn, value)


def detached(value: Any) -> Any:
    """``value`` with every tensor detached."""
    return map_tensors(torch.Tensor.detach, value)
