"""The chunked next-token loss (LlamaLM.loss with loss_chunk, strategy.loss_chunk): the same loss and gradients as
the whole logits tensor (float64, elementwise, cpu and xla), a lower eager peak where the vocabulary dominates, and
strategy.loss_chunk's default and refusals."""

import pytest
import torch
from conftest import to_host

from revlib_xla import backend, memory
from revlib_xla.models.llama import build_llama, chunked_next_token_loss, llama_config
from revlib_xla.train.config import ConfigError, load_config
from revlib_xla.train.strategy import AUTO_LOSS_CHUNK, StrategyError, build_model, loss_chunk

SMALL = dict(vocab_size=97, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=64)


@pytest.mark.parametrize(
    "kind, form", [("cpu", "plain"), ("cpu", "reversible"), pytest.param("xla", "reversible", marks=pytest.mark.slow)]
)
def test_chunked_loss_and_gradients_equal_the_whole_logits(kind, form):
    """float64: the chunks' sums add the same terms in another order, so loss and gradients agree to rounding
    (1e-12 relative); chunks of 4 over 10 predicted positions (a ragged last chunk of 2)."""
    if not backend.device_available(kind):
        pytest.skip(f"no {kind} device")
    device = backend.device_for(kind)
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
