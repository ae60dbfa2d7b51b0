"""``Checkpointable(model, scan=True)`` (runs of identical stages as one ScannedStages stage), checked where a user
could break it: double backward, GradScaler, stages returning tuples, and stages whose running statistics change
after the model was wrapped (float64 on cpu against the plain model, elementwise)."""

import pytest
import torch
from conftest import max_rel_err
from torch import nn

import revlib_xla as revlib
from revlib_xla.planner.scanned import ScannedStages

WIDTH = 8


class Block(nn.Module):
    def __init__(self, norm: type[nn.Module] = nn.LayerNorm) -> None:
        super().__init__()
        self.norm = norm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def _pair(norm=nn.LayerNorm, depth=3):
    """(the plain model, a copy of it wrapped by Checkpointable(scan=True) with its blocks scanned), float64."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(WIDTH, WIDTH), *[Block(norm) for _ in range(depth)], nn.Linear(WIDTH, 1)).double()
    copy = nn.Sequential(nn.Linear(WIDTH, WIDTH), *[Block(norm) for _ in range(depth)], nn.Linear(WIDTH, 1)).double()
    copy.load_state_dict(plain.state_dict())
    return plain, copy


def _x():
    return torch.randn(6, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()


def test_double_backward_through_scanned_stages_equals_the_plain_model():
    """create_graph=True: the gradient of a function of the first gradient (a gradient penalty)."""
    plain, model = _pair()
    wrapped = revlib.Checkpointable(model, scan=True)
    assert any(isinstance(s, ScannedStages) for s in wrapped.stages)
    results = []
    for module, params in ((plain, list(plain.parameters())), (wrapped, list(model.parameters()))):
        x = _x()
        (dx,) = torch.autograd.grad(module(x).square().sum(), x, create_graph=True)
        results.append(torch.autograd.grad(dx.square().sum(), params))
    for got, want in zip(results[1], results[0]):
        assert max_rel_err(got, want) < 1e-12


def test_grad_scaler_over_scanned_stages_gives_the_plain_gradients():
    plain, model = _pair()
    wrapped = revlib.Checkpointable(model, scan=True)
    plain(_x()).square().sum().backward()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.scale(wrapped(_x()).square().sum()).backward()
    scaler.unscale_(optimizer)
    for got, want in zip(model.parameters(), plain.parameters()):
        assert max_rel_err(got.grad, want.grad) < 1e-12


class Pair(nn.Module):
    """A stage of two streams: takes and returns a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(WIDTH, WIDTH)

    def forward(self, xs):
        a, b = xs
        return b, a + torch.tanh(self.f(b))


def test_stages_returning_tuples_are_refused_by_name_at_the_call():
    """A run of identical stages taking and returning tuples is grouped (same structure), and its first call names
    the problem and the way out."""
    torch.manual_seed(0)
    wrapped = revlib.Checkpointable(nn.Sequential(*[Pair() for _ in range(3)]).double(), scan=True)
    with pytest.raises(
        TypeError,
        match=r"ScannedStages \(3 x Pair, scanned\): the layers' input must be one tensor.*"
        r"got tuple; pass scan=False",
    ):
        wrapped((_x(), _x()))


def test_running_statistics_switched_on_after_wrapping_are_refused_at_the_call():
    """Blocks with BatchNorm, wrapped in eval mode (no running statistics change: scannable), then trained: a clear
    error at the call. Before: no error, and every layer's statistics were updated twice per step (by the forward
    and by the backward's recomputation: num_batches_tracked 2, running_mean 0.053 where the plain model has
    0.028). In eval mode the scanned blocks keep running, with the plain model's outputs."""
    plain, model = _pair(nn.BatchNorm1d)
    plain.eval(), model.eval()
    wrapped = revlib.Checkpointable(model, scan=True)
    assert any(isinstance(s, ScannedStages) for s in wrapped.stages)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(_x()), plain(_x()), rtol=1e-12, atol=0)
    wrapped.train()
    with pytest.raises(
        Exception,
        match=r"layer 0 \(Block\): its module 'norm' is in training mode with buffers.*"
        r"Pass scan=False",
    ):
        wrapped(_x()).square().sum().backward()
    assert int(model[1].norm.num_batches_tracked) == 0
