"""The Reformer-style LM: chunked feed-forward gives the unchunked plain model's loss and gradients, whatever the
chunk count, and its memory falls with the chunks."""

import dataclasses

import pytest
import torch
from conftest import max_rel_err

from revlib_xla import backends
from revlib_xla.memory import eager_peak
from revlib_xla.models import ByteTransformerLM, ReformerLM, TransformerConfig, build_reformer, lm_loss
from revlib_xla.models.reformer import ChunkedMLP, ReformerConfig, reformer_config

CONFIG = ReformerConfig(width=16, depth=2, heads=2, seq_len=24, dropout=0.1)


def _plain(config):
    """The unchunked model of the same shape under plain autograd: the reference."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(TransformerConfig)}
    return ByteTransformerLM(TransformerConfig(**fields), "no_savings")


def _loss_and_grads(model, tokens):
    torch.manual_seed(1)  # the same dropout masks in every model
    loss = model.loss(tokens) if isinstance(model, ReformerLM) else lm_loss(model(tokens), tokens)
    return loss.detach(), torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("chunks", [1, 3, 4])
@pytest.mark.parametrize("flavour", ["reversible", "no_savings", "checkpoint"])
def test_gradients_equal_the_unchunked_plain_model_whatever_the_chunks(flavour, chunks):
    """Dropout included: the checkpoint flavour's recomputation replays the forward's masks (recompute.checkpoint);
    it was refused with dropout before."""
    config = dataclasses.replace(CONFIG, ff_chunks=chunks)
    torch.manual_seed(0)
    model = ReformerLM(config, flavour).double()
    reference = _plain(config).double()
    reference.load_state_dict(model.state_dict())  # the same keys: weights load across the two
    tokens = torch.randint(0, 256, (2, CONFIG.seq_len))
    loss, grads = _loss_and_grads(model, tokens)
    ref_loss, ref_grads = _loss_and_grads(reference, tokens)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for (name, _), grad, ref in zip(model.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(grad, ref, rtol=1e-10, atol=1e-13, msg=name)


def test_chunked_reversible_model_matches_plain_on_each_device(device):
    torch.manual_seed(0)
    config = dataclasses.replace(CONFIG, ff_chunks=4, dropout=0.0)
    model = ReformerLM(config).to(device)
    reference = _plain(config).to(device)
    reference.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 256, (2, config.seq_len)).to(device)
    losses = []
    for m in (model, reference):  # .backward(): torch_xla's (reentrant) checkpoint refuses torch.autograd.grad
        losses.append(m.loss(tokens) if m is model else lm_loss(m(tokens), tokens))
        losses[-1].backward()
    assert max_rel_err(losses[0], losses[1]) < 1e-5
    for p, q in zip(model.parameters(), reference.parameters()):
        assert max_rel_err(p.grad, q.grad) < 1e-4


def test_chunks_are_checkpointed_where_the_backend_allows():
    """Eager devices checkpoint each chunk; torch_xla's reentrant checkpoint cannot run in the reversible backward."""
    assert backends.backend_for("cpu").checkpoint_in_partial_backward
    if backends.xla_available():
        assert not backends.backend_for(backends.device_for("xla")).checkpoint_in_partial_backward


@pytest.mark.slow
def test_peak_memory_falls_with_the_chunks():
    # The feed-forward's hidden activation (mlp_ratio * width = 512 features) dominates a layer: 16x the stream; a
    # small vocabulary keeps the logits below it.
    config = ReformerConfig(width=32, depth=2, heads=1, seq_len=128, mlp_ratio=16, vocab_size=32)
    batch = 4

    def peak(chunks):
        torch.manual_seed(0)
        model = ReformerLM(dataclasses.replace(config, ff_chunks=chunks))
        tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len))
        return eager_peak(lambda m, t: m.loss(t).backward(), model, tokens).total

    peaks = {chunks: peak(chunks) for chunks in (1, 2, 8)}  # measured: 3.99, 2.65, 1.57 MiB
    assert peaks[1] > peaks[2] > peaks[8]
    hidden = batch * config.seq_len * config.mlp_ratio * config.width * 4  # one hidden activation, float32
    assert peaks[1] - peaks[8] > 2 * hidden * 7 / 8  # the up projection's output and the GELU's, 7/8 of each


def test_named_sizes_meta_builds_and_errors():
    with torch.device("meta"):
        model = build_reformer("reformer-revlib")
    assert all(p.is_meta for p in model.parameters())
    assert model.config.ff_chunks == 16 and model.flavour == "reversible"
    mlps = [m for m in model.modules() if isinstance(m, ChunkedMLP)]
    assert len(mlps) == 6 and {m.chunks for m in mlps} == {16}
    tiny = build_reformer("reformer-tiny", flavour="no_savings", depth=1)
    assert tiny(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 256)
    with pytest.raises(ValueError, match="ff_chunks must be positive, got 0"):
        reformer_config("reformer-tiny", ff_chunks=0)
    with pytest.raises(ValueError, match="unknown Reformer model 'reformer'; expected one of reformer-tiny"):
        build_reformer("reformer")
    with pytest.raises(ValueError, match="unknown flavour 'rev'"):
        build_reformer("reformer-tiny", flavour="rev")
