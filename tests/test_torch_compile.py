"""``torch.compile`` around the library's memory-saving models: the reversible Llama, ``Checkpointable`` and the models
``revlib_xla.hf.memory_efficient`` converts give eager's loss and gradients (float64: equal up to the rounding of
reordered operations).

Dynamo runs every operator on fake tensors under ``FakeTensorMode``; the random-number and attention-cache rules at
the recompute engine's dispatch key sent such an operator back to themselves without end (a ``RecursionError`` on
every converted model) until they stepped aside below Python dispatch."""

import copy

import pytest
import torch
from conftest import max_rel_err, require_transformers
from torch import nn

import revlib_xla as revlib
from revlib_xla.models.llama import build_llama, llama_config, next_token_loss

IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def _compare(model, loss_of, backend="aot_eager", steps=2):
    """``steps`` forward/backward passes of ``torch.compile(model)`` against an eager copy: losses and every
    gradient."""
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        torch.manual_seed(step)  # the same random numbers (dropout) for both
        got = loss_of(compiled)
        torch.manual_seed(step)
        want = loss_of(ref)
        got.backward()
        want.backward()
        assert max_rel_err(got, want) <= 1e-13
        pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None]
        assert len(pairs) == len(list(ref.parameters()))
        for a, b in pairs:
            assert max_rel_err(a, b) <= 1e-12


def _native(form):
    torch.manual_seed(0)
    config = llama_config("llama-tiny", n_layers=1, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    return build_llama(config, form).double().train()


def test_native_reversible_llama_compiles_with_eager_gradients():
    _compare(_native("reversible"), lambda m: next_token_loss(m(IDS), IDS))


def test_checkpointable_compiles_with_eager_gradients():
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.1), nn.Tanh()) for _ in range(4)]).double()
    x = torch.randn(4, 16, dtype=torch.float64)
    model = revlib.Checkpointable(net, x)
    model.compute_sequence(model.min_memory() * 1.01)  # the smallest schedule: recomputes, replays dropout
    _compare(model, lambda m: m(x).square().mean())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["reversible", "plan"])
def test_hf_conversions_compile_with_eager_gradients(strategy):
    require_transformers()
    from revlib_xla.hf import memory_efficient, model_from_config

    torch.manual_seed(0)
    model = model_from_config("llama-tiny", num_hidden_layers=1, dtype=torch.float64).train()
    memory_efficient(model, strategy)
    # the loss from the logits in float64 (given labels=, transformers computes it in float32)
    _compare(model, lambda m: next_token_loss(m(IDS, use_cache=False).logits, IDS), steps=1)
