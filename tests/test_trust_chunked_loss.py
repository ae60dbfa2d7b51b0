"""chunked_next_token_loss against the whole logits' next_token_loss (float64, elementwise) where the chunks differ
in what they count: targets marked ``-100`` (cross entropy's ignore_index: padding, prompt tokens), a chunk longer
than the sequence, one position per chunk; and under ``torch.autograd.grad`` and double backward."""

import pytest
import torch
import torch.nn.functional as F

from revlib_xla.models.llama import chunked_next_token_loss, next_token_loss

B, T, D, V = 3, 11, 8, 13


@pytest.fixture(scope="module")
def case():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, D, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(V, D, dtype=torch.float64, generator=g, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    labels = tokens.clone()
    labels[0, 5:] = -100  # padding at the end of one sequence, a prompt at the start of another: chunks of four
    labels[2, :3] = -100  # positions count 10, 8 and 4 targets
    return hidden, weight, tokens, labels


@pytest.mark.parametrize("chunk", [1, 4, 50])
@pytest.mark.parametrize("ignored", [False, True], ids=["all-counted", "ignore-index"])
def test_chunked_loss_averages_over_the_counted_targets_as_the_whole_logits_do(case, chunk, ignored):
    """Before: the chunked mean divided by every target, ignored ones included (off by 1.34 here)."""
    hidden, weight, tokens, labels = case
    targets = labels if ignored else tokens
    whole = next_token_loss(F.linear(hidden, weight), targets)
    chunked = chunked_next_token_loss(hidden, weight, targets, chunk)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=0)
    for got, want in zip(torch.autograd.grad(chunked, (hidden, weight)), torch.autograd.grad(whole, (hidden, weight))):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


def test_chunked_loss_has_the_whole_logits_second_derivatives(case):
    """Double backward through the chunks' recomputation: the gradient of a function of the first gradient."""
    hidden, weight, tokens, _ = case
    results = []
    for loss in (next_token_loss(F.linear(hidden, weight), tokens), chunked_next_token_loss(hidden, weight, tokens, 4)):
        (first,) = torch.autograd.grad(loss, hidden, create_graph=True)
        results.append(torch.autograd.grad(first.square().sum(), weight)[0])
    torch.testing.assert_close(results[1], results[0], rtol=1e-12, atol=1e-15)
