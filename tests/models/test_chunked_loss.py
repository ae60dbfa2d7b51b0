"""The chunked next-token loss (LlamaLM.loss with loss_chunk, strategy.loss_chunk; chunked_next_token_loss): the
same loss and gradients as the whole logits tensor (float64, elementwise, cpu and xla), also where the chunks differ in
what they count and under double backward, a lower eager peak where the vocabulary dominates, strategy.loss_chunk's
default and refusals, and the head-weight gradient with bfloat16 products."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import to_host

from revlib_xla import backends, memory
from revlib_xla.models.llama import build_llama, chunked_next_token_loss, llama_config, next_token_loss
from revlib_xla.train.config import ConfigError, load_config
from revlib_xla.train.strategy import AUTO_LOSS_CHUNK, StrategyError, build_model, loss_chunk

SMALL = dict(vocab_size=97, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=64)


@pytest.mark.parametrize(
    "kind, form", [("cpu", "plain"), ("cpu", "reversible"), pytest.param("xla", "reversible", marks=pytest.mark.slow)]
)
def test_chunked_loss_and_gradients_equal_the_whole_logits(kind, form):
    """float64: the chunks' sums add the same terms in another order, so loss and gradients agree to rounding
    (1e-12 relative); chunks of 4 over 10 predicted positions (a ragged last chunk of 2)."""
    if not backends.device_available(kind):
        pytest.skip(f"no {kind} device")
    device = backends.device_for(kind)
    config = llama_config("llama-tiny", **SMALL, tie_embeddings=True)
    tokens = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(0))
    whole = build_llama(config, form).double()
    results = []
    for chunk in (0, 4):
        model = build_llama(config, form, loss_chunk=chunk).double()
        model.load_state_dict(whole.state_dict())
        model.to(device)
        loss = model.loss(tokens.to(device))
        loss.backward()
        results.append(to_host((loss, [p.grad for p in model.parameters()])))
    (loss, grads), chunked = results[0], results[1:]
    for other_loss, other_grads in chunked:
        torch.testing.assert_close(other_loss, loss, rtol=1e-12, atol=0)
        for g, h in zip(other_grads, grads):
            torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-15)
    with torch.no_grad():  # evaluation: no checkpointing, the same value
        model = build_llama(config, form, loss_chunk=4).double()
        model.load_state_dict(whole.state_dict())
        torch.testing.assert_close(model.loss(tokens), whole.loss(tokens), rtol=1e-12, atol=0)


def test_chunked_loss_lowers_the_eager_peak_by_the_logits():
    """Vocabulary 4096, 2 x 129 positions: the whole float32 logits are 4 MiB, and the step's peak holds them with
    their log-softmax and gradient; chunks of 16 positions hold an eighth of that at a time. Measured by tensor
    storages (MemTracker): the peak falls by at least two whole logits tensors."""
    config = llama_config("llama-tiny", **dict(SMALL, vocab_size=4096, max_seq_len=256), tie_embeddings=False)
    tokens = torch.randint(0, 4096, (2, 129), generator=torch.Generator().manual_seed(0))
    logits_bytes = 2 * 128 * 4096 * 4

    def peak(chunk):
        model = build_llama(config, "reversible", loss_chunk=chunk)
        return memory.eager_peak(lambda m, t: m.loss(t).backward(), model, tokens).total

    whole, chunked = peak(0), peak(16)
    assert whole - chunked > 2 * logits_bytes
    assert chunked < whole / 2


def test_loss_chunk_is_on_for_the_reversible_forms_and_refused_where_the_logits_are_whole():
    tiny = ["model.overrides={vocab_size: 256, dim: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, ffn_dim: 64}"]
    assert loss_chunk(load_config(None, [*tiny, "strategy=reversible"])) == AUTO_LOSS_CHUNK
    assert loss_chunk(load_config(None, [*tiny, "strategy=momentum"])) == AUTO_LOSS_CHUNK
    assert loss_chunk(load_config(None, [*tiny, "strategy=reversible", "chip.chips=4"])) == 0  # not over a mesh
    assert loss_chunk(load_config(None, [*tiny, "strategy=reversible"]), sharded=True) == 0
    for baseline in ("none", "checkpoint", "plan"):  # the torch_xla baselines stay as written; plan's logits are whole
        assert loss_chunk(load_config(None, [*tiny, f"strategy={baseline}"])) == 0
    model = build_model(load_config(None, [*tiny, "strategy=checkpoint", "strategy.loss_chunk=8"]), "meta")
    assert model.loss_chunk == 8
    with pytest.raises(
        StrategyError, match=r"loss_chunk=8: with strategy.activations=plan the logits .* strategy.loss_chunk=0"
    ):
        build_model(load_config(None, [*tiny, "strategy=plan", "strategy.loss_chunk=8"]), "meta")
    with pytest.raises(StrategyError, match=r"loss_chunk=8: with strategy.offload.params=true"):
        build_model(load_config(None, [*tiny, "strategy.offload.params=true", "strategy.loss_chunk=8"]), "meta")
    with pytest.raises(ConfigError, match=r"strategy.loss_chunk.*positive number of positions"):
        load_config(None, [*tiny, "strategy.loss_chunk=-2"])
    with pytest.raises(ValueError, match="chunk=0 must be a positive"):
        chunked_next_token_loss(torch.zeros(1, 3, 4), torch.zeros(5, 4), torch.zeros(1, 3, dtype=torch.long), 0)


# -- ignored targets, chunk lengths and second derivatives -------------------------------------------------------------
# chunked_next_token_loss against the whole logits' next_token_loss (float64, elementwise) where the chunks differ in
# what they count: targets marked ``-100`` (cross entropy's ignore_index: padding, prompt tokens), a chunk longer than
# the sequence, one position per chunk; and under ``torch.autograd.grad`` and double backward.
@pytest.fixture(scope="module")
def case():
    B, T, D, V = 3, 11, 8, 13
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


# -- bfloat16 products -------------------------------------------------------------------------------------------------
# The chunked loss's head-weight gradient with bfloat16 products (bfloat16 weights, or float32 ones under autocast):
# the chunks' gradients are summed in float32 and rounded once, as the unchunked product rounds its float32 sum once.
#
# Before: autograd added the chunks' gradients of the bfloat16 head weight (or of autocast's cached bfloat16 copy of a
# float32 one) in bfloat16, one rounding per chunk, so the error grew with the count of chunks: here 5.0e-3 at
# 64-position chunks against 3.4e-3 unchunked, both ways (1.65e-2 at larger sizes). Now 1.6e-3 with bfloat16 weights
# (the chunks' float32 logit gradients are not rounded to bfloat16 before the product), 4.3e-5 under autocast (the
# float32 weight's gradient is not rounded at all). Reference: the same function at the same bfloat16 inputs, in
# float64.
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
    kind = backends.backend_for(h).autocast_device_type
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
    if autocast and backends.backend_for(device).autocast_device_type is None:
        pytest.skip(f"no autocast on {device}")
    if backends.backend_for(device).lazy and not autocast:
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
