"""rotor, fairscale and FewBit code runs on revlib_xla's facades (revlib_xla.compat): each test is a user's snippet
in the original's style, checked against the plain model (outputs and gradients) or the native API."""

import copy

import torch
from conftest import max_rel_err
from torch import nn

import revlib_xla
from revlib_xla import compat


def _grads(model: nn.Module, x: torch.Tensor, out: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out.square().sum(), [x, *model.parameters()]))


def test_rotor_snippet_checkpointable_with_relu_at_end():
    from revlib_xla.compat import rotor
    from revlib_xla.compat.rotor.models.utils import ReLUAtEnd

    assert rotor.Checkpointable is revlib_xla.Checkpointable
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Flatten(),
        ReLUAtEnd(nn.Linear(12, 32)),
        ReLUAtEnd(nn.Linear(32, 32)),
        ReLUAtEnd(nn.Linear(32, 32)),
        nn.Linear(32, 4),
        nn.Softmax(dim=1),
    ).double()
    plain = copy.deepcopy(model)
    chk = rotor.Checkpointable(model, preserve_rng_state=False)
    x = torch.randn(16, 3, 4, dtype=torch.float64, requires_grad=True)
    chk.measure(x)  # rotor's manual trigger of the two steps
    chk.compute_sequence(chk.min_memory())  # the tightest budget: some stages are recomputed
    assert chk.get_expected_makespan() > chk.compute_sequence(chk.no_checkpoint_memory()).makespan
    chk.compute_sequence(chk.min_memory())
    out, want = chk(x), plain(x)
    assert max_rel_err(out, want) <= 1e-14
    for got, ref in zip(_grads(chk.model, x, out), _grads(plain, x, want)):
        assert max_rel_err(got, ref) <= 1e-12
    # ReLUAtEnd is its module followed by a ReLU, in place on the module's own output
    lin = nn.Linear(3, 3)
    v = torch.randn(2, 3)
    assert torch.equal(ReLUAtEnd(lin)(v), torch.relu(lin(v)))


def test_rotor_models_are_sequential_resnets():
    from revlib_xla.compat import rotor

    model = rotor.models.resnet18(num_classes=5, width=8)
    assert isinstance(model, nn.Sequential) and rotor.models.resnet18 is revlib_xla.models.resnet18
    assert rotor.models.resnet101 is revlib_xla.models.resnet101


def test_fairscale_snippet_offload_model():
    from revlib_xla.compat.fairscale import OffloadModel

    assert OffloadModel is revlib_xla.OffloadModel
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(4)]).double()
    plain = copy.deepcopy(model)
    offload_model = OffloadModel(
        model=model,
        device=torch.device("cpu"),
        offload_device=torch.device("cpu"),
        num_slices=2,
        checkpoint_activation=True,
        num_microbatches=2,
    )
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    out, want = offload_model(x), plain(x)
    assert max_rel_err(out, want) <= 1e-14
    for got, ref in zip(_grads(offload_model, x, out), _grads(plain, x, want)):
        assert max_rel_err(got, ref) <= 1e-12


def test_fewbit_snippet_converts_a_model_as_fewbit_does():
    """FewBit's README: ``fewbit.GELU(bits=3)`` in a model, and ``fewbit.util.map_module`` with
    ``convert_linear`` to swap in ``RandomizedLinear``."""
    fewbit = compat.fewbit
    from revlib_xla.fewbit.util import convert_linear, map_module

    assert fewbit is revlib_xla.fewbit
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), fewbit.GELU(bits=3), nn.Linear(16, 8))
    converted = map_module(
        copy.deepcopy(model), lambda m: convert_linear(m, fewbit.RandomizedLinear, proj_dim_ratio=0.5)
    )
    assert [type(m) for m in converted] == [fewbit.RandomizedLinear, fewbit.GELU, fewbit.RandomizedLinear]
    x = torch.randn(4, 8, requires_grad=True)
    out = model(x)  # exact forward: the few-bit GELU and the randomized linear change only gradients
    assert max_rel_err(out, nn.Sequential(model[0], nn.GELU(), model[2])(x)) <= 1e-6
    converted_out = converted(x)
    assert max_rel_err(converted_out, out) <= 1e-6
    # RandomizedLinear's input gradient is exact (only its weight gradient is sketched)
    (want,) = torch.autograd.grad(out.square().sum(), x)
    (got,) = torch.autograd.grad(converted_out.square().sum(), x)
    assert max_rel_err(got, want) <= 1e-5
