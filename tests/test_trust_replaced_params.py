"""An optimizer built before :func:`revlib_xla.scan.stack_layers` holds the layers' replaced parameters: its step
raises, naming one, instead of leaving them un-updated forever (the model would silently stop learning)."""

import pytest
import torch
from torch import nn

import revlib_xla as revlib
from revlib_xla.reversible import ReplacedParameterError

WIDTH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.up(torch.tanh(x))


def _reversible() -> revlib.ReversibleSequential:
    torch.manual_seed(0)
    return revlib.ReversibleSequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)], scan=False)


def _checkpointable() -> revlib.Checkpointable:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), *[Block() for _ in range(3)], nn.Linear(WIDTH, 1))
    return revlib.Checkpointable(model, scan=True)


def _loss(module: nn.Module) -> torch.Tensor:
    x = torch.randn(4, 2 * WIDTH if isinstance(module, revlib.ReversibleSequential) else WIDTH)
    return module(x).square().mean()


@pytest.mark.parametrize("build", [_reversible, _checkpointable], ids=["reversible", "checkpointable"])
def test_an_optimizer_built_before_stacking_refuses_to_step(build):
    module = build()
    stale = torch.optim.SGD(module.parameters(), lr=0.1)
    revlib.scan.stack_layers(module)
    _loss(module).backward()
    with pytest.raises(ReplacedParameterError, match="stack_layers replaced.*build the optimizer after stack_layers"):
        stale.step()


@pytest.mark.parametrize("build", [_reversible, _checkpointable], ids=["reversible", "checkpointable"])
def test_an_optimizer_built_after_stacking_steps_every_stack(build):
    module = revlib.scan.stack_layers(build())
    fresh = torch.optim.SGD(module.parameters(), lr=0.1)
    before = [p.detach().clone() for p in module.parameters()]
    _loss(module).backward()
    fresh.step()
    fresh.step()  # the cached check: a second step of the same optimizer
    moved = [not torch.equal(b, p) for b, p in zip(before, module.parameters())]
    assert all(moved), moved
    fresh.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    fresh.step()  # a new group is looked at again, and holds nothing replaced


def test_a_group_added_later_with_a_replaced_parameter_is_refused():
    module = _reversible()
    old = list(module.parameters())
    revlib.scan.stack_layers(module)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    opt.step()
    opt.add_param_group({"params": old[:1]})
    with pytest.raises(ReplacedParameterError, match=r"'0-0\.wrapped_module"):
        opt.step()
