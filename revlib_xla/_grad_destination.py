"""Where the running backward pass sends a leaf's gradient (internal: asked by the reversible walk and the planner).

A custom backward (the reversible walk, a fused optimizer step) must behave differently depending on what the
user asked autograd for:

* ``loss.backward()`` (or ``backward(inputs=[...])`` naming the leaf): the gradient is **accumulated** into
  ``leaf.grad``; this is a training backward, and a fused optimizer may step.
* ``torch.autograd.grad(loss, [..., leaf, ...])``: the gradient is **captured** and returned to the caller;
  ``leaf.grad`` is untouched and nothing may step.
* ``torch.autograd.grad(loss, x)`` (saliency, FGSM, gradient penalties) or ``backward(inputs=[x])``: the leaf's
  gradient is **unused**; computing it is wasted work, and stepping on it would change the weights of a model that
  was only asked for an input gradient.

The answer comes from the autograd engine's own record of the running graph task (the query torch's
``register_multi_grad_hook`` uses), so it is exact and costs a dictionary lookup.
"""

from __future__ import annotations

import enum

import torch

__all__ = ["GradDestination", "grad_destination", "node_destination"]


class GradDestination(enum.Enum):
    ACCUMULATE = "accumulate"  # into .grad (a training backward)
    CAPTURE = "capture"  # returned by torch.autograd.grad
    UNUSED = "unused"  # not asked for


_WILL_EXECUTE = getattr(torch._C, "_will_engine_execute_node", None)


def grad_destination(leaf: torch.Tensor) -> GradDestination:
    """What the running backward pass does with the gradient of ``leaf`` (a tensor that requires grad and has no
    ``grad_fn``). Call it from inside a backward (a ``torch.autograd.Function.backward`` or a tensor hook).

    Outside a backward pass, or on a torch without the engine query, the answer is ``ACCUMULATE`` (what a plain
    ``backward()`` does)."""
    if _WILL_EXECUTE is None or not leaf.requires_grad or leaf.grad_fn is not None:
        return GradDestination.ACCUMULATE
    return node_destination(torch.autograd.graph.get_gradient_edge(leaf).node)


def node_destination(node) -> GradDestination:
    """:func:`grad_destination` for the autograd node a gradient is sent to, e.g. an entry of a custom Function's
    ``ctx.next_functions`` (cheaper than going through the tensor). For a leaf's ``AccumulateGrad`` node the three
    answers mean what they mean for the leaf; for any other node, ``ACCUMULATE`` means that the engine will run it
    (the gradient sent there is used) and ``UNUSED`` that it will not. ``None`` (no node: the tensor needs no
    gradient) is ``UNUSED``."""
    if node is None:
        return GradDestination.UNUSED
    if _WILL_EXECUTE is None:
        return GradDestination.ACCUMULATE
    try:
        return GradDestination.ACCUMULATE if _WILL_EXECUTE(node) else GradDestination.UNUSED
    except RuntimeError as err:
        # The engine refuses to answer for a leaf's node exactly when torch.autograd.grad() is running and captures
        # that leaf's gradient (torch/csrc/autograd/python_engine.cpp).
        if "autograd.grad" in str(err):
            return GradDestination.CAPTURE
        if "only be called during the backward" in str(err) or "backward pass" in str(err):
            return GradDestination.ACCUMULATE
        raise
