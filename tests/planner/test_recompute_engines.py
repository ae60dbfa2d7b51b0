"""One recompute engine (revlib_xla.recompute) behind the three features that run a forward again in the backward:
the reversible core, ``Checkpointable`` and ``OffloadModel(checkpoint_activation=True)``.

One stateful random block (dropout, and BatchNorm in training mode, whose forward updates its running statistics)
is trained through each of them, with and without CPU bfloat16 autocast, in both ways of drawing random numbers
(``revlib_xla.recompute.random_numbers``). Each must give the plain model's outputs, gradients and running statistics
under the same random numbers, and leave torch's global generator where the plain model leaves it. By default
(``"plain"``) the plain model is the modules themselves; with ``"own"`` it draws as the engines then do
(conftest.SeededUnits: one seed per forward from the global generator, unit ``i`` under ``derive_seed(seed, i)``).
For the reversible core the reference is ``memory_mode=no_savings`` (plain autograd through the same layers).
"""

import copy

import pytest
import torch
from conftest import SeededUnits, max_rel_err
from torch import nn

import revlib_xla as revlib
from revlib_xla import recompute

WIDTH = 8
UNITS = 3


class Float32Island(nn.Module):
    """A matmul kept in float32 under autocast, as models do for rotary embeddings or attention scores. Its backward
    computes in float32 when the gradient is taken outside autocast (as plain autograd takes it), and in bfloat16
    when a recomputation also takes the gradient under the forward's autocast state."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            return torch.tanh(x.to(self.weight.dtype) @ self.weight)


def _block(width):
    # No bias before the BatchNorm: its gradient is zero (the normalization removes it), so only rounding is left.
    return nn.Sequential(
        nn.Linear(width, width, bias=False), nn.BatchNorm1d(width), nn.Dropout(0.3), nn.Tanh(), Float32Island(width)
    )


def _reversible(dtype):
    model = revlib.ReversibleSequential(*[_block(WIDTH // 2) for _ in range(UNITS)], split_dim=-1).to(dtype)
    reference = copy.deepcopy(model)
    reference.memory_mode = revlib.MemoryModes.no_savings
    return model, reference


def _plain(units):
    """The plain model of ``units``, drawing random numbers as the engines do in the mode in force."""
    if recompute.random_numbers() == "own":
        return SeededUnits(copy.deepcopy(units))
    return nn.Sequential(*copy.deepcopy(units))


def _checkpointable(dtype):
    model = revlib.Checkpointable(nn.Sequential(*[_block(WIDTH) for _ in range(UNITS)]).to(dtype))
    model.measure(torch.randn(4, WIDTH, dtype=dtype))  # runs every stage: must leave the running statistics alone
    model.compute_sequence(model.min_memory() * 1.02)  # the tightest plan: most stages are recomputed
    return model, _plain(list(model.stages))


def _offload(dtype):
    model = revlib.OffloadModel(
        nn.Sequential(*[_block(WIDTH) for _ in range(UNITS)]).to(dtype),
        "cpu",
        num_slices=UNITS,
        checkpoint_activation=True,
    )
    return model, _plain(list(model.model_slices))


ENGINES = {"reversible": _reversible, "checkpointable": _checkpointable, "offload_model": _offload}

# (parameter dtype, autocast dtype or None, relative tolerance). float64: every path is exact up to the reversible
# core's subtraction (it rebuilds each input as y - f(x)). Under bfloat16 autocast the blocks compute in bfloat16:
# Checkpointable and OffloadModel recompute the same operations on the same inputs, while the reversible core's
# rebuilt inputs differ from the forward's in their float32 rounding, which a bfloat16 cast can move by one step
# (2**-8 relative) in a few elements. A recomputation that does not replay autocast is off by about 3e-2 there.
SETTINGS = {
    "float64": (torch.float64, None, {"reversible": 1e-10, "checkpointable": 1e-12, "offload_model": 1e-12}),
    "bf16_autocast": (
        torch.float32,
        torch.bfloat16,
        {"reversible": 1e-2, "checkpointable": 1e-6, "offload_model": 1e-6},
    ),
}


def _running_stats(model):
    return [t for m in model.modules() if isinstance(m, nn.BatchNorm1d) for t in m.buffers()]


def _step(model, x, autocast_dtype, seed):
    """One training step from ``torch.manual_seed(seed)``: output, loss backward (outside autocast, as usual), and
    the global generator's state after it."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = model(x)
    out.float().square().sum().backward()
    return out.detach(), torch.get_rng_state()


@pytest.fixture(params=recompute.RANDOM_NUMBERS)
def mode(request):
    with recompute.drawing(request.param):
        yield request.param


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_stateful_random_block_recomputes_as_the_plain_model_runs(engine, setting, mode):
    dtype, autocast_dtype, tolerances = SETTINGS[setting]
    tol = tolerances[engine]
    torch.manual_seed(0)
    model, reference = ENGINES[engine](dtype)
    model.train(), reference.train()
    params, ref_params = list(model.parameters()), list(reference.parameters())
    assert len(params) == len(ref_params) == 4 * UNITS
    data = torch.Generator().manual_seed(1)
    for step in range(2):  # the second step starts from the running statistics the first one left
        x = torch.randn(4, WIDTH, dtype=dtype, generator=data)
        out, rng = _step(model, x, autocast_dtype, seed=10 + step)
        ref_out, ref_rng = _step(reference, x, autocast_dtype, seed=10 + step)
        assert out.dtype == ref_out.dtype
        assert max_rel_err(out, ref_out) <= tol, (step, max_rel_err(out, ref_out))
        for k, (p, r) in enumerate(zip(params, ref_params)):
            assert max_rel_err(p.grad, r.grad) <= tol, (step, k, max_rel_err(p.grad, r.grad))
        stats, ref_stats = _running_stats(model), _running_stats(reference)
        assert len(stats) == len(ref_stats) == 3 * UNITS  # mean, var, num_batches_tracked per BatchNorm
        for k, (s, r) in enumerate(zip(stats, ref_stats)):
            assert max_rel_err(s, r) <= tol, (step, k, max_rel_err(s, r))
        assert all(int(s) == step + 1 for s in stats if s.dtype == torch.long)
        assert torch.equal(rng, ref_rng), step
        with torch.no_grad():  # an optimizer step, the same on both
            for p, r in zip(params, ref_params):
                p -= 0.1 * p.grad
                r -= 0.1 * r.grad


def _checkpointable_measured_in_step(dtype):
    """Measured and planned by its first call, inside the step's autocast region."""
    model = revlib.Checkpointable(nn.Sequential(*[_block(WIDTH) for _ in range(UNITS)]).to(dtype))
    return model, _plain(list(model.stages))


@pytest.mark.parametrize("engine", [*ENGINES, "checkpointable_measured_in_step"])
def test_under_autocast_with_the_backward_in_the_region_every_parameter_gets_its_gradient(engine, mode):
    """Autocast caches its weight casts for the whole region, and torch <= 2.9 caches one made under no_grad without
    its autograd history: a later run with autograd in the region reuses it and the weight gets no gradient,
    silently. The engines run modules without autograd inside the region (Checkpointable's measuring first call,
    a plan's forwards that store only their output, the reversible forward) and again with it (the first run
    after measuring; every recomputation when the backward is taken inside the region too): each gives the plain
    model's gradients, every parameter one."""
    factory = ENGINES.get(engine, _checkpointable_measured_in_step)
    tol = SETTINGS["bf16_autocast"][2].get(engine, 1e-6)
    torch.manual_seed(0)
    model, reference = factory(torch.float32)
    model.train(), reference.train()
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))
    grads = []
    for module in (model, reference):
        torch.manual_seed(10)
        module.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            module(x).float().square().sum().backward()
        grads.append([p.grad for p in module.parameters()])
    assert len(grads[0]) == len(grads[1]) == 4 * UNITS
    for k, (g, r) in enumerate(zip(*grads)):
        assert g is not None, k
        assert max_rel_err(g, r) <= tol, (k, max_rel_err(g, r))


def test_check_invertible_inside_an_autocast_region_leaves_no_weight_cast_for_the_step():
    """check_invertible runs the layers without autograd; inside the training step's autocast region (torch <= 2.9)
    its casts would be cached without their history and reused by the step's plain-autograd layers."""
    torch.manual_seed(0)
    model, reference = _reversible(torch.float32)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))
    model.eval(), reference.eval()  # no dropout: the check and the steps see the same function
    grads = []
    for module, check in ((model, True), (reference, False)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if check:
                revlib.check_invertible(module, x)
            module.memory_mode = revlib.MemoryModes.no_savings  # plain autograd through the layers
            module(x).float().square().sum().backward()
        grads.append([p.grad for p in module.parameters()])
    assert all(g is not None for g in grads[0])
    for g, r in zip(*grads):
        assert max_rel_err(g, r) <= 1e-6
