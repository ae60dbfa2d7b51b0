"""The reversible backward's vector-Jacobian products go through torch's private engine entry point
(``torch.autograd.graph._engine_run_backward``), called with keywords only, and fall back to
``torch.autograd.grad`` on a torch without it. Both paths give plain autograd's gradients."""

import copy

import pytest
import torch
from conftest import max_rel_err
from torch import nn

import revlib_xla as revlib
from revlib_xla.reversible import engine

WIDTH = 6
LAYERS = 3


def _models():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)) for _ in range(LAYERS)]
    model = revlib.ReversibleSequential(*blocks, split_dim=-1).double()
    reference = copy.deepcopy(model)
    reference.memory_mode = revlib.MemoryModes.no_savings  # plain autograd through the same layers
    return model, reference


def _spy_on_the_engine_entry(monkeypatch, private):
    """Count the calls of the path under test; the private entry point's spy accepts keyword arguments only."""
    calls = []
    if private:
        real = engine._ENGINE_BACKWARD
        assert real is not None, "this torch has the private entry point: the test forces the fallback below"

        def spy(t_outputs, **kwargs):
            calls.append(sorted(kwargs))
            return real(t_outputs, **kwargs)

        monkeypatch.setattr(engine, "_ENGINE_BACKWARD", spy)
    else:
        monkeypatch.setattr(engine, "_ENGINE_BACKWARD", None)  # a torch without the private entry point
        real_grad = torch.autograd.grad

        def grad_spy(*args, **kwargs):
            calls.append("autograd.grad")
            return real_grad(*args, **kwargs)

        monkeypatch.setattr(torch.autograd, "grad", grad_spy)
    return calls


@pytest.mark.parametrize("private", [True, False], ids=["engine_entry", "fallback"])
def test_reversible_vjp_with_and_without_the_private_engine_entry(monkeypatch, private):
    model, reference = _models()
    x = torch.randn(5, 2 * WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    calls = _spy_on_the_engine_entry(monkeypatch, private)

    # backward(): parameter gradients accumulated, and the input's
    xs = [x.clone().requires_grad_() for _ in range(2)]
    model(xs[0]).square().sum().backward()
    assert len(calls) == LAYERS  # one VJP per layer, all through the path under test
    if private:
        expected = sorted(["grad_tensors", "keep_graph", "create_graph", "inputs", "allow_unreachable"])
        assert all(c == sorted([*expected, "accumulate_grad"]) for c in calls)
    reference(xs[1]).square().sum().backward()
    assert max_rel_err(xs[0].grad, xs[1].grad) <= 1e-12
    for p, r in zip(model.parameters(), reference.parameters()):
        assert max_rel_err(p.grad, r.grad) <= 1e-12

    # torch.autograd.grad of the input and the first layer's parameters: captured, nothing accumulated
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    wrt = [x.clone().requires_grad_(), *model[0].parameters()]
    ref_wrt = [x.clone().requires_grad_(), *reference[0].parameters()]
    got = torch.autograd.grad(model(wrt[0]).sin().sum(), wrt)
    want = torch.autograd.grad(reference(ref_wrt[0]).sin().sum(), ref_wrt)
    assert all(p.grad is None for p in model.parameters())
    for g, w in zip(got, want):
        assert max_rel_err(g, w) <= 1e-12
