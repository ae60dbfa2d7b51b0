"""``torch.compile`` around the library's memory-saving models: the reversible Llama and the models
``revlib_xla.hf.memory_efficient`` converts (``plan`` runs ``Checkpointable``) give eager's loss and gradients
(float64: equal up to the rounding of reordered operations).

Dynamo runs every operator on fake tensors under ``FakeTensorMode``; the random-number and attention-cache rules at
the recompute engine's dispatch key sent such an operator back to themselves without end (a ``RecursionError`` on
every converted model) until they stepped aside below Python dispatch."""

import copy
import gc

import pytest
import torch
from conftest import max_rel_err, require_transformers

from revlib_xla.models.llama import build_llama, llama_config, next_token_loss

IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def _saving(saved):
    """Saved-tensor hooks adding the bytes of every tensor autograd saves to ``saved[0]``."""

    @torch.compiler.disable  # counted as it runs, not traced into the compiled graphs
    def pack(t):
        saved[0] += t.untyped_storage().nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _compare(model, loss_of, backend="aot_eager", steps=2):
    """``steps`` forward/backward passes of ``torch.compile(model)`` against an eager copy: losses and every
    gradient. Returns the bytes autograd saved in the last step's forward: ``(compiled, eager)``."""
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        saved = [[0], [0]]
        torch.manual_seed(step)  # the same random numbers (dropout) for both
        with _saving(saved[0]):
            got = loss_of(compiled)
        torch.manual_seed(step)
        with _saving(saved[1]):
            want = loss_of(ref)
        got.backward()
        want.backward()
        assert max_rel_err(got, want) <= 1e-13
        pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None]
        assert len(pairs) == len(list(ref.parameters()))
        for a, b in pairs:
            assert max_rel_err(a, b) <= 1e-12
    return saved[0][0], saved[1][0]


def test_random_and_attention_operators_run_on_fake_tensors_inside_a_recompute_scope():
    """What Dynamo does to every operator of a converted model: run it on fake tensors under FakeTensorMode with the
    Python dispatcher on, here
    inside the recompute engine's scope (its rules for random operators and attention are on). The rules used to
    send such an operator back to themselves until Python's recursion limit."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensorMode

    from revlib_xla.recompute import rng_scope

    with rng_scope("cpu") as reseed, FakeTensorMode(), enable_python_dispatcher():
        reseed(7)
        q = torch.empty(2, 2, 8, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
        dropped = torch.nn.functional.dropout(q, 0.5, training=True)
        noise = torch.randn(3, 4)
    assert out.shape == dropped.shape == q.shape and noise.shape == (3, 4)


def _native(form):
    torch.manual_seed(0)
    config = llama_config("llama-tiny", n_layers=1, dim=32, n_heads=2, n_kv_heads=1, ffn_dim=64)
    return build_llama(config, form).double().train()


@pytest.mark.slow
def test_native_reversible_llama_compiles_with_eager_gradients():
    """... and saves no more for the backward than the eager reversible form (the compiled graphs do not keep the
    blocks' activations)."""
    compiled, eager = _compare(_native("reversible"), lambda m: next_token_loss(m(IDS), IDS))
    assert 0 < compiled <= eager


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


@pytest.mark.parametrize("strategy", ["plan", "reversible", "momentum"])
def test_hf_conversions_compile_once_and_then_nothing_more(strategy):
    """``torch.compile`` of a converted model traces its frames in the first three steps and none after (the reversible
    and momentum stacks run eagerly inside, as graph breaks of their own: the two-stream stack was traced again at
    every call before, 2.4 s a step against 0.014 s eager); the graph breaks are few and the gradients are eager's
    (float64, several steps)."""
    require_transformers()
    from torch._dynamo.utils import counters

    from revlib_xla.hf import memory_efficient, model_from_config

    torch.manual_seed(0)
    model = model_from_config("llama-tiny", num_hidden_layers=3, dtype=torch.float64).train()
    memory_efficient(model, strategy)
    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def loss_of(m):
        out = next_token_loss(m(IDS, use_cache=False).logits, IDS)
        if isinstance(m, torch._dynamo.eval_frame.OptimizedModule):  # the frames Dynamo has traced (or tried to)
            graphs.append(counters["frames"]["total"])
        return out

    gc.collect()
    gc.disable()  # a finalizer of another test's garbage run mid-step is a frame Dynamo counts: not this model's
    try:
        _compare(model, loss_of, steps=6)
    finally:
        gc.enable()
    assert graphs[2] == graphs[-1], graphs  # nothing traced after the warm-up (the first steps measure, plan, check)
    breaks = sum(counters["graph_break"].values())
    assert breaks <= {"plan": 60, "reversible": 12, "momentum": 6}[strategy], dict(counters["graph_break"])
