"""grad_destination: what the running backward does with a leaf's gradient, read from inside a custom backward."""

from typing import ClassVar

import pytest
import torch

from revlib_xla._grad_destination import GradDestination, grad_destination

A, C, U = GradDestination.ACCUMULATE, GradDestination.CAPTURE, GradDestination.UNUSED


class _Probe(torch.autograd.Function):
    """y = x * w; its backward records where the engine sends x's and w's gradients."""

    seen: ClassVar[list] = []

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        _Probe.seen.append((grad_destination(ctx.leaves[0]), grad_destination(ctx.leaves[1])))
        return g * w, g * x


def _run(request):
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)

    def apply():
        out = _Probe.apply(x, w)
        out.grad_fn.leaves = (x, w)  # the ctx is the node: hand it the leaves to ask about
        return out.sum()

    _Probe.seen.clear()
    request(apply, x, w)
    assert len(_Probe.seen) == 1
    return _Probe.seen[0]


@pytest.mark.parametrize(
    "request_, expected",
    [
        (lambda f, x, w: f().backward(), (A, A)),
        (lambda f, x, w: f().backward(inputs=[x]), (A, U)),
        (lambda f, x, w: f().backward(inputs=[w]), (U, A)),
        (lambda f, x, w: torch.autograd.grad(f(), x), (C, U)),
        (lambda f, x, w: torch.autograd.grad(f(), w), (U, C)),
        (lambda f, x, w: torch.autograd.grad(f(), [x, w]), (C, C)),
        (lambda f, x, w: torch.autograd.grad(f(), [x], create_graph=True), (C, U)),
    ],
    ids=["backward", "backward-inputs-x", "backward-inputs-w", "grad-x", "grad-w", "grad-both", "grad-x-create-graph"],
)
def test_destination_of_each_leaf(request_, expected):
    assert _run(request_) == expected


def test_outside_a_backward_is_accumulate():
    assert grad_destination(torch.randn(2, requires_grad=True)) is A
