"""The chunked loss's head-weight gradient with bfloat16 products (bfloat16 weights, or float32 ones under autocast):
the chunks' gradients are summed in float32 and rounded once, as the unchunked product rounds its float32 sum once.

Before: autograd added the chunks' gradients of the bfloat16 head weight (or of autocast's cached bfloat16 copy of a
float32 one) in bfloat16, one rounding per chunk, so the error grew with the count of chunks: here 5.0e-3 at
64-position chunks against 3.4e-3 unchunked, both ways (1.65e-2 at larger sizes). Now 1.6e-3 with bfloat16 weights
(the chunks' float32 logit gradients are not rounded to bfloat16 before the product), 4.3e-5 under autocast (the
float32 weight's gradient is not rounded at all).
Reference: the same function at the same bfloat16 inputs, in float64."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import to_host

from revlib_xla import backend
from revlib_xla.models.llama import chunked_next_token_loss, next_token_loss

B, T, D, V, CHUNK = 2, 513, 64, 512, 64
N_CHUNKS = (T - 1) // CHUNK  # 8
U32 = 2.0**-24  # float32's unit roundoff: the error bound of one float32 addition, relative


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, D, generator=g).bfloat16()
    weight = (torch.randn(V, D, generator=g) * 0.05).bfloat16()
    tokens = torch.randint(0, V, (B, T), generator=g)
    tokens[1, :100] = -100  # a prompt: ignored targets are not counted
    return hidden, weight, tokens


def _grads(loss_fn, hidden, weight, tokens, device, autocast=False):
    """d loss / d (hidden, weight); ``autocast``: float32 tensors under autocast to bfloat16 (strategy.precision=bf16)
    instead of bfloat16 ones (strategy.param_dtype=bf16), the same bfloat16 products."""
    h = hidden.detach().to(device, torch.float32 if autocast else None).requires_grad_()
    w = weight.detach().to(device, torch.float32 if autocast else None).requires_grad_()
    kind = backend.backend_for(h).autocast_device_type
    with torch.autocast(kind, torch.bfloat16) if autocast else contextlib.nullcontext():
        loss = loss_fn(h, w, tokens.to(device))
    return to_host(torch.autograd.grad(loss, (h, w)))


def _whole(h, w, tokens):
    return next_token_loss(F.linear(h, w), tokens)


def _chunked(h, w, tokens):
    return chunked_next_token_loss(h, w, tokens, CHUNK)


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-weights", "autocast"])
def test_bf16_head_gradient_is_no_worse_chunked_than_whole(inputs, device, autocast):
    """Bound: the unchunked gradient's own error plus one float32 addition's rounding (2^-24, relative) per chunk.
    Both round the float32 product to bfloat16 once; bfloat16 additions (unit roundoff 2^-8) would add up to
    (chunks - 1) x 2^-8 more. The features' gradient does not depend on the chunking (each position is in one
    chunk): it equals the unchunked one, up to float32 summation order inside the matrix products."""
    hidden, weight, tokens = inputs
    reference = _grads(_whole, hidden.double(), weight.double(), tokens, "cpu")
    if autocast and backend.backend_for(device).autocast_device_type is None:
        pytest.skip(f"no autocast on {device}")
    if backend.backend_for(device).lazy and not autocast:
        pytest.skip("one XLA case (autocast: the same backward, its barriers, autocast turned off) is enough")
    whole = _grads(_whole, hidden, weight, tokens, device, autocast)
    chunked = _grads(_chunked, hidden, weight, tokens, device, autocast)
    assert chunked[1].dtype == whole[1].dtype == (torch.float32 if autocast else torch.bfloat16)
    bound = _rel(whole[1], reference[1]) + N_CHUNKS * U32
    assert _rel(chunked[1], reference[1]) <= bound
    torch.testing.assert_close(chunked[0], whole[0], rtol=2**-8, atol=0)
    if not autocast:  # backward() leaves the same gradients as autograd.grad
        h, w = hidden.detach().to(device).requires_grad_(), weight.detach().to(device).requires_grad_()
        _chunked(h, w, tokens.to(device)).backward()
        torch.testing.assert_close(to_host((h.grad, w.grad)), chunked, rtol=0, atol=0)


def test_bf16_chunked_loss_double_backward_is_no_worse_chunked_than_whole(inputs):
    """create_graph=True records the float32-accumulating backward: the first derivatives and the second ones (of
    their squared norms) are within the unchunked bfloat16 loss's error of float64's, as above."""
    hidden, weight, tokens = inputs

    def derivatives(loss_fn, h, w):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        first = torch.autograd.grad(loss_fn(h, w, tokens), (h, w), create_graph=True)
        second = torch.autograd.grad(sum(f.double().square().sum() for f in first), (h, w))
        return (*first, *second)

    reference = derivatives(_whole, hidden.double(), weight.double())
    whole, chunked = derivatives(_whole, hidden, weight), derivatives(_chunked, hidden, weight)
    for got, unchunked, want in zip(chunked, whole, reference):
        assert _rel(got, want) <= _rel(unchunked, want) + N_CHUNKS * U32
