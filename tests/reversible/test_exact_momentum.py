"""The exact momentum stack (:mod:`revlib_xla.reversible.exact_momentum`): its memory-saving backward gives plain
autograd's gradients of its own function (elementwise, float64 and float32, with dropout), that function is the
MomentumNet of the blocks (against an independent float64 recursion) and tends to the plain residual stack as beta
goes to 0, the backward rebuilds the input bit for bit, and the memory it keeps grows per layer by the kept bits
alone."""

import copy

import pytest
import torch
from conftest import max_rel_err
from torch import nn

from revlib_xla import ReversibleError, memory
from revlib_xla.reversible.exact_momentum import (
    ExactMomentumStack,
    Momentum,
    StreamScale,
    _pack,
    _unpack,
    kept_bytes_per_layer,
    reference_forward,
)


class Residual(nn.Module):
    """A pre-norm MLP residual branch with dropout."""

    def __init__(self, width: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(width),
            nn.Linear(width, 2 * width),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(2 * width, width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def stack(depth=8, width=32, beta=2**-6, dtype=torch.float64, dropout=0.1):
    torch.manual_seed(0)
    return ExactMomentumStack([Residual(width, dropout) for _ in range(depth)], beta=beta).to(dtype)


def float_momentum(blocks, x, beta):
    """The MomentumNet recursion in floating point, written out (no grid): the first layer as it is, then
    ``v <- beta v + (1 - beta) r(x)``, ``x <- x + v``."""
    v = None
    for k, block in enumerate(blocks):
        r = block(x)
        v = r if k == 0 else beta * v + (1 - beta) * r
        x = x + v
    return x


@pytest.mark.parametrize("bits", range(1, 17))
def test_kept_bits_pack_and_unpack_exactly(bits):
    low = torch.randint(0, 2**bits, (3, 5, 7), generator=torch.Generator().manual_seed(bits))
    packed = _pack(low, bits)
    assert torch.equal(_unpack(packed, bits, low), low)
    assert packed.numel() * packed.element_size() == kept_bytes_per_layer(low.numel(), bits)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("beta", [2**-6, 0.5, 3 / 8, 2**-16])
def test_memory_saving_backward_equals_plain_autograd_of_the_same_function(dtype, beta):
    """Values bit for bit, gradients elementwise (float64: 1e-12; float32: within rounding of the same terms),
    dropout drawn alike (each layer's recomputation replays its random numbers)."""
    net = stack(beta=beta, dtype=dtype)
    ref = copy.deepcopy(net)
    x = torch.randn(4, 6, 32, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    torch.manual_seed(1)
    y = net(x)
    torch.manual_seed(1)
    y_ref = reference_forward(ref, x_ref)
    assert torch.equal(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert max_rel_err(x.grad, x_ref.grad) <= tol
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert max_rel_err(p.grad, q.grad) <= tol, name


def test_the_function_is_the_momentum_net_of_the_blocks_and_tends_to_the_residual_stack():
    """Against the floating-point recursion written out (float64, no dropout): outputs and gradients within the
    grid's rounding (2**-38 of the input's largest magnitude per addition); against the plain residual stack
    ``x + r(x)``: about beta apart."""
    for beta in (2**-6, 0.5):
        net = stack(beta=beta, dropout=0.0)
        x = torch.randn(4, 6, 32, dtype=torch.float64, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        blocks = copy.deepcopy(net.blocks)
        y, y_ref = net(x), float_momentum(blocks, x_ref, beta)
        assert max_rel_err(y, y_ref) <= 1e-9
        g = torch.randn_like(y)
        y.backward(g)
        y_ref.backward(g)
        assert max_rel_err(x.grad, x_ref.grad) <= 1e-9
        for p, q in zip(net.parameters(), blocks.parameters()):
            assert max_rel_err(p.grad, q.grad) <= 1e-9
    with torch.no_grad():
        net = stack(beta=2**-10, dropout=0.0)
        plain = x.detach()
        for block in net.blocks:
            plain = plain + block(plain)
        assert max_rel_err(net(x.detach()), plain) <= 2**-10


def test_the_backward_rebuilds_the_input_bit_for_bit_and_says_when_a_block_does_not_compute_the_same_again():
    net = stack(depth=6, beta=2**-7, dtype=torch.float32)
    net.verify = True
    x = torch.randn(4, 6, 32, requires_grad=True)
    net(x).square().sum().backward()  # the rebuilt input equals the forward's stream, bit for bit

    class Drifting(nn.Module):
        """Computes something else each call (a state the recomputation does not see again)."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.lin(x) * (1 + 1e-3 * self.calls)

    torch.manual_seed(0)
    bad = ExactMomentumStack([Drifting() for _ in range(3)], beta=2**-6)
    bad.verify = True
    with pytest.raises(ReversibleError, match="rebuilt the stack's input with different bits"):
        bad(torch.randn(4, 32, requires_grad=True)).sum().backward()


def test_a_second_backward_is_refused_in_words():
    net = stack(depth=3)
    y = net(torch.randn(2, 32, dtype=torch.float64, requires_grad=True)).sum()
    y.backward(retain_graph=True)
    with pytest.raises(ReversibleError, match="backward through the stack a second time"):
        y.backward()


def test_the_grid_follows_the_inputs_scale_small_and_large():
    """Activations of 1e-8 or of 1e6: the output equals the float64 recursion within 1e-9 (a fixed grid of
    2**-32 loses 1e-8 activations; a large one overflows)."""
    for scale in (1e-8, 1.0, 1e6):
        net = stack(depth=6, dropout=0.0)
        for p in net.parameters():
            p.data *= 1.0  # (the blocks' LayerNorm makes them scale-free inside; the residual sums follow x)
        x = torch.randn(4, 32, dtype=torch.float64) * scale
        with torch.no_grad():
            assert max_rel_err(net(x.requires_grad_()), float_momentum(net.blocks, x, net.beta)) <= 1e-9, scale


def test_a_stack_that_outgrows_its_grid_runs_again_on_a_coarser_one():
    """Blocks that multiply the stream by 2**30 overall: beyond the 24 bits of headroom, the eager forward notices
    from its bound and runs again on a coarser grid, with the same dropout masks; the layer-by-layer runs (plain
    autograd, no autograd) move to a coarser grid as they go. All equal the float64 recursion, gradients too, within
    the coarser grid's rounding of the input (2**-29 of its largest magnitude)."""

    class Grow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)
            self.drop = nn.Dropout(0.2)

        def forward(self, x):
            return self.drop(self.lin(x)) + 31 * x  # the stream grows 32 times per layer

    torch.manual_seed(0)
    net = ExactMomentumStack([Grow() for _ in range(6)], beta=2**-4).double()
    x = torch.randn(3, 16, dtype=torch.float64)
    outs = []
    for run in ("memory-saving", "plain autograd", "float64 recursion"):
        model = copy.deepcopy(net)
        inp = x.clone().requires_grad_()
        torch.manual_seed(3)
        if run == "memory-saving":
            y = model(inp)
        elif run == "plain autograd":
            y = reference_forward(model, inp)
        else:
            y = float_momentum(model.blocks, inp, model.beta)
        y.sum().backward()
        outs.append((y.detach(), inp.grad, [p.grad for p in model.parameters()]))
        with torch.no_grad():
            torch.manual_seed(3)
            outs[-1] += (model(x),)  # the no-autograd run
    assert outs[0][0].abs().max() / x.abs().max() > 2.0**28
    for y, x_grad, grads, no_grad in outs[:2]:
        assert max_rel_err(y, outs[2][0]) <= 1e-7
        assert max_rel_err(no_grad, outs[2][0]) <= 1e-7
        assert max_rel_err(x_grad, outs[2][1]) <= 1e-7
        assert all(max_rel_err(a, b) <= 1e-7 for a, b in zip(grads, outs[2][2]))


def test_a_block_output_that_is_not_finite_gives_nan_as_the_plain_stack_would():
    """No error: the output and every gradient are NaN, so a gradient scaler skips the step."""
    net = stack(depth=4, dropout=0.0, dtype=torch.float32)
    with torch.no_grad():
        net.blocks[2].net[1].weight[0, 0] = float("inf")
    x = torch.randn(4, 32, requires_grad=True)
    y = net(x)
    assert torch.isnan(y).all()
    y.sum().backward()
    assert torch.isnan(x.grad).all()
    assert all(torch.isnan(p.grad).all() for p in net.parameters() if p.grad is not None)


def test_beta_must_be_a_fraction_whose_dropped_bits_can_be_kept():
    assert Momentum.of(0.5) == Momentum(1, 1) and Momentum.of(3 / 8) == Momentum(3, 3)
    with pytest.raises(ReversibleError, match=r"beta=0.9 is not a fraction n / 2\*\*m"):
        Momentum.of(0.9)
    with pytest.raises(ReversibleError, match=r"beta must be in \(0, 1\)"):
        Momentum.of(1.0)


def test_what_the_forward_keeps_grows_per_layer_by_the_kept_bits_alone():
    """Bytes live after the forward (every storage, StorageTracker), less those before: per added layer, m / 8 bytes
    per element of the hidden state (6 bits here: 0.19x of a float32 checkpoint of the layer's input) and the
    4-byte largest block output of the range check; nothing else (the CPU generator's state, 5 KiB per layer, is
    kept too: it is not a tensor operation's output)."""
    batch, width = 512, 64

    def held(depth):
        torch.manual_seed(0)
        net = ExactMomentumStack([Residual(width, 0.0) for _ in range(depth)], beta=2**-6)
        x = torch.randn(batch, width, requires_grad=True)
        with memory.StorageTracker() as tracker:
            tracker.track(net, x)
            before = tracker.current()
            y = net(x)
            after = tracker.current()
        y.sum().backward()
        return after - before

    kept = kept_bytes_per_layer(batch * width, 6)
    assert kept == 6 * batch * width // 8
    assert held(8) - held(4) == 4 * (kept + 4)


def test_stream_scale_powers_of_two_are_exact():
    for dtype in (torch.float32, torch.float64):
        x = torch.tensor([3.0e-30, 0.02, 7.0, 1.0e30], dtype=dtype)
        for v in x:
            s = StreamScale.of(v.reshape(1))
            assert float(s.scale) * float(s.unscale) == 1.0
            assert float(s.scale) == 2.0 ** int(s.exponent)
