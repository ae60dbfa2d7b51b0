"""HuggingFace decoder stacks converted by ``utils.module_list_to_momentum_net`` (tiny configs, random weights, built
from configs: nothing is downloaded): training gives plain autograd's gradients, or a clear error."""

import copy

import pytest
import torch
from conftest import max_rel_err, require_transformers

from revlib_xla import MemoryModes, ReversibleError, reversible, utils

transformers = require_transformers()


def gpt2(depth):
    config = transformers.GPT2Config(
        n_layer=depth,
        n_embd=16,
        n_head=2,
        vocab_size=32,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config), "transformer", "h"


def llama(depth):
    config = transformers.LlamaConfig(
        num_hidden_layers=depth,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=32,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(config), "model", "layers"


def gpt_neox(depth):
    config = transformers.GPTNeoXConfig(
        num_hidden_layers=depth,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        vocab_size=32,
        max_position_embeddings=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return transformers.GPTNeoXForCausalLM(config), "gpt_neox", "layers"


MODELS = {"gpt2": gpt2, "llama": llama, "gpt_neox": gpt_neox}
IDS = torch.randint(0, 32, (2, 10), generator=torch.Generator().manual_seed(0))


def converted(name, depth, dtype=torch.float64, beta=0.5, **kw):
    """The same random model twice: run by the reversible backward, and by plain autograd (no_savings)."""
    torch.manual_seed(0)
    base, stack_name, attr = MODELS[name](depth)  # the layers are base.<stack_name>.<attr>
    models = []
    for mode in (MemoryModes.autograd_function, MemoryModes.no_savings):
        model = copy.deepcopy(base)
        stack = getattr(model, stack_name)
        setattr(
            stack,
            attr,
            utils.module_list_to_momentum_net(getattr(stack, attr), residual=True, beta=beta, memory_mode=mode, **kw),
        )
        models.append(model.to(dtype).train())
    return models


def grads(model, **kw):
    model.zero_grad(set_to_none=True)
    model(IDS, labels=IDS, **kw).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.slow
def test_training_with_the_kv_cache_on_is_refused(name, monkeypatch):
    """Issue 15 §2.13: with use_cache left at its default (True), every block wrote its keys and values into the
    cache in the forward and again in the recomputation: gradients 16-56 % off (here 100 %), silently."""
    rev, ref = converted(name, 3)
    with pytest.raises(ReversibleError, match=r"transformers DynamicCache.*use_cache=False"):
        rev(IDS, labels=IDS)
    want = grads(ref)  # plain autograd recomputes nothing: the cache is harmless there
    with torch.no_grad():  # nor does generation
        rev(IDS)
    # what the refusal prevents: without it, the gradients are wrong
    monkeypatch.setattr(reversible.sequential, "refuse_kv_caches", lambda *args: None)
    got = grads(rev)
    assert max(max_rel_err(got[n], want[n]) for n in want) > 0.5


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_equal_plain_autograd(name):
    rev, ref = converted(name, 3)
    got, want = grads(rev, use_cache=False), grads(ref, use_cache=False)
    assert got.keys() == want.keys() and len(got) > 10
    for n in want:
        assert max_rel_err(got[n], want[n]) <= 1e-10, n


@pytest.mark.slow
@pytest.mark.parametrize("exact", [False, None], ids=["float-streams", "exact-streams"])
def test_small_beta_in_float32_is_refused_where_it_would_be_wrong(exact):
    """Issue 15 §2.14 as reported (GPT-2 blocks, use_cache=False, beta 0.1, float32): refused at the first training
    forward where the input cannot be rebuilt, otherwise the gradients of plain autograd. Float streams lose the
    input from 8 blocks on (unchecked, the gradients are 100 % off); exact streams (the default) rebuild it bit for
    bit as long as the momentum stream, which grows by 1/beta per block, fits the grid (8 blocks here), and refuse
    at the first forward beyond, naming the layer."""
    refused = []
    for depth in (4, 8, 12, 24):
        rev, ref = converted("gpt2", depth, torch.float32, beta=0.1, exact=exact)
        try:
            got = grads(rev, use_cache=False)
        except ReversibleError as err:
            what = f"through all {2 * depth} layers" if exact is False else "produced a value of magnitude"
            assert what in str(err)
            refused.append(depth)
            continue
        want = grads(ref, use_cache=False)
        for n in want:
            if exact is None:
                assert torch.equal(got[n], want[n]), (depth, n)
            else:
                assert max_rel_err(got[n], want[n]) <= 1e-3, (depth, n)  # rebuilt within 1e-4, see test_reversible
    if exact is False:
        assert {8, 12, 24} <= set(refused)  # (4 blocks: 3e-4 here, refused too)
    else:
        assert set(refused) == {12, 24}
