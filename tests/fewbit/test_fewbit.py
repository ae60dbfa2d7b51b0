"""FewBit's few-bit activations (issue 4): exact forward, stepwise backward, packed codes, optimal borders.

* Every activation, on every device, in float32 / bfloat16 / float16: the forward equals PyTorch's on that device
  bit for bit; the input gradient equals ``grad * level[interval of x]`` computed independently
  (``torch.bucketize`` in float64 on the cpu); piecewise-linear activations' gradients equal PyTorch's cpu autograd
  elementwise, breakpoints included.
* What backward keeps, measured with saved-tensor hooks: ``bits/32`` of a float32 activation's bytes (+1 %).
* The borders are optimal: no perturbation lowers the weighted squared error; the built-in tables are what the
  optimiser computes; the documented error table is current and agrees with sampled gradients.
* XLA: the codes saved on xla equal the cpu codes bit for bit.
* Bad input: unsupported bit widths, integer tensors, activations with no few-bit form.
"""

import itertools
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import to_host
from torch import nn

from revlib_xla import fewbit
from revlib_xla.fewbit import activations as act
from revlib_xla.fewbit import approximation as approx
from revlib_xla.fewbit.error_table import DOC_FILE, gradient_error_markdown
from revlib_xla.kernels import fewbit_reference as ref
from revlib_xla.memory import saved_bytes

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# name -> (few-bit module, the torch module it replaces)
CASES = {
    "celu": (lambda b: fewbit.CELU(0.7, bits=b), lambda: nn.CELU(0.7)),
    "elu": (lambda b: fewbit.ELU(bits=b), lambda: nn.ELU()),
    "gelu": (lambda b: fewbit.GELU(bits=b), lambda: nn.GELU()),
    "gelu_tanh": (lambda b: fewbit.GELU("tanh", bits=b), lambda: nn.GELU("tanh")),
    "hardswish": (lambda b: fewbit.Hardswish(bits=b), lambda: nn.Hardswish()),
    "logsigmoid": (lambda b: fewbit.LogSigmoid(bits=b), lambda: nn.LogSigmoid()),
    "mish": (lambda b: fewbit.Mish(bits=b), lambda: nn.Mish()),
    "selu": (lambda b: fewbit.SELU(bits=b), lambda: nn.SELU()),
    "sigmoid": (lambda b: fewbit.Sigmoid(bits=b), lambda: nn.Sigmoid()),
    "silu": (lambda b: fewbit.SiLU(bits=b), lambda: nn.SiLU()),
    "softplus": (lambda b: fewbit.Softplus(bits=b), lambda: nn.Softplus()),
    "softsign": (lambda b: fewbit.Softsign(bits=b), lambda: nn.Softsign()),
    "tanh": (lambda b: fewbit.Tanh(bits=b), lambda: nn.Tanh()),
    "tanhshrink": (lambda b: fewbit.Tanhshrink(bits=b), lambda: nn.Tanhshrink()),
    "leaky_relu": (lambda b: fewbit.LeakyReLU(0.1), lambda: nn.LeakyReLU(0.1)),
    "relu": (lambda b: fewbit.ReLU(), lambda: nn.ReLU()),
    "threshold": (lambda b: fewbit.Threshold(0.5, -2.0), lambda: nn.Threshold(0.5, -2.0)),
    "hardsigmoid": (lambda b: fewbit.Hardsigmoid(), lambda: nn.Hardsigmoid()),
    "hardtanh": (lambda b: fewbit.Hardtanh(-2.0, 1.5), lambda: nn.Hardtanh(-2.0, 1.5)),
    "relu6": (lambda b: fewbit.ReLU6(), lambda: nn.ReLU6()),
    "hardshrink": (lambda b: fewbit.Hardshrink(0.5), lambda: nn.Hardshrink(0.5)),
    "softshrink": (lambda b: fewbit.Softshrink(0.5), lambda: nn.Softshrink(0.5)),
}
PIECEWISE_CASES = [n for n in CASES if n in fewbit.PIECEWISE]
SMOOTH_CASES = [n for n in CASES if n not in PIECEWISE_CASES]


def _inputs(dtype, n=3000, seed=0):
    """Normal samples, wide samples, and every breakpoint of the piecewise-linear activations, exactly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.cat(
        [
            torch.randn(n, generator=g),
            4 * torch.randn(n, generator=g),
            torch.tensor([-3.0, -2.0, -0.5, 0.0, 0.5, 1.5, 3.0, 6.0, -0.0, 20.0, -20.0]),
        ]
    )
    return x.to(dtype)


def _expected_stepwise_grad(x, grad, borders, levels):
    """grad * level of x's interval (b_{k-1}, b_k], computed independently on the cpu."""
    x64 = to_host(x).double()
    idx = torch.bucketize(x64, torch.tensor(borders, dtype=torch.float64), right=False)
    opmath = torch.float64 if x.dtype == torch.float64 else torch.float32
    lv = torch.tensor(levels, dtype=opmath)[idx]
    return (to_host(grad).to(opmath) * lv).to(x.dtype)


def _run(module, x, grad):
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    y.backward(grad)
    return to_host(y), to_host(x.grad)


@pytest.mark.parametrize("name", SMOOTH_CASES)
def test_smooth_forward_exact_backward_stepwise(device, name):
    make, make_torch = CASES[name]
    for dtype in DTYPES if device.type != "xla" else (torch.float32, torch.bfloat16):
        for bits in (1, 3) if device.type == "xla" else (1, 2, 3, 4):
            module = make(bits)
            x = _inputs(dtype).to(device)
            grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
            y, gx = _run(module, x, grad)
            assert torch.equal(y, to_host(make_torch()(x))), (name, dtype, bits)
            table = fewbit.stepwise_table(
                module.name, bits, act._params(module.name, act.SMOOTH[module.name].defaults, module.params)
            )
            expected = _expected_stepwise_grad(x, grad, table.borders, table.levels)
            assert torch.equal(gx, expected), (name, dtype, bits, (gx.double() - expected.double()).abs().max())


@pytest.mark.parametrize("name", PIECEWISE_CASES)
def test_piecewise_gradients_equal_torch_elementwise(device, name):
    make, make_torch = CASES[name]
    for dtype in DTYPES:
        x = _inputs(dtype).to(device)
        grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
        y, gx = _run(make(1), x, grad)
        y_ref, _ = _run(make_torch(), x, grad)
        # PyTorch's cpu kernels multiply in float32 and round once, as revlib_xla's lookup does on every device;
        # torch_xla's lowering rounds the slope to bfloat16/float16 first, so the cpu gradient is the reference.
        _, gx_ref = _run(make_torch(), to_host(x), to_host(grad))
        assert torch.equal(y, y_ref) and torch.equal(gx, gx_ref), (name, dtype)


_SPECIAL_INPUTS = (
    (float("nan"), float("inf"), -float("inf")),
    (float("nan"), 0.5, -0.5),
    (float("inf"), 0.5, -0.5),
    (-float("inf"), 0.5, -0.5),
)


def _non_finite_case(dtype, device, special, seed=5):
    """Finite inputs plus ``special`` (three values); a gradient with a NaN and an inf where the input is finite
    (at 0.3 and -0.7, -1 and 2: inside and outside every band)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(200, generator=g), torch.tensor([*special, 0.3, -0.7, -1.0, 2.0])]).to(dtype)
    grad = torch.randn(x.shape, generator=g)
    grad[-4:] = torch.tensor([float("nan"), float("inf"), float("nan"), -float("inf")])
    return x.to(device), grad.to(dtype).to(device)


@pytest.mark.parametrize("name", list(CASES))
def test_nan_and_inf_propagate_as_in_torch(device, name):
    """Where PyTorch's gradient is NaN or inf (a NaN input; +-inf for gelu, mish, silu, softsign; a NaN or inf
    incoming gradient), the few-bit gradient is not finite either, never a number in its place. Piecewise-linear
    activations equal PyTorch's gradient elementwise, NaN included. Smooth ones give ``grad * level`` with NaN coded
    where PyTorch's kernel sends it (the top interval where PyTorch's gradient at NaN is finite, else the lowest),
    and NaN over the whole end interval in which an input with a NaN PyTorch gradient was coded (the codes cannot
    tell it from the finite inputs there)."""
    make, make_torch = CASES[name]
    bits = 3 if name in SMOOTH_CASES else 1
    for dtype in (torch.float32, torch.bfloat16) if device.type != "xla" else (torch.float32,):
        for special in _SPECIAL_INPUTS:
            x, grad = _non_finite_case(dtype, device, special)
            _, gx = _run(make(bits), x, grad)
            x, grad = to_host(x), to_host(grad)
            _, torch_gx = _run(make_torch(), x, grad)
            where = (name, dtype, special)
            # never a number where PyTorch has none (an inf gradient through softsign's two terms is NaN in
            # PyTorch, inf here: neither is finite)
            assert (~torch.isfinite(gx))[~torch.isfinite(torch_gx)].all(), (where, gx[-7:], torch_gx[-7:])
            if name in PIECEWISE_CASES:
                torch.testing.assert_close(gx, torch_gx, rtol=0, atol=0, equal_nan=True, msg=str(where))
                continue
            module = make(bits)
            table = fewbit.stepwise_table(
                module.name, bits, act._params(module.name, act.SMOOTH[module.name].defaults, module.params)
            )
            top = len(table.levels) - 1
            code = torch.bucketize(x.double(), torch.tensor(table.borders, dtype=torch.float64))
            _, torch_at_nan = _run(make_torch(), torch.tensor([float("nan")]), torch.ones(1))
            code[torch.isnan(x)] = top if torch.isfinite(torch_at_nan).all() else 0
            expected = grad.float() * torch.tensor(table.levels, dtype=torch.float32)[code]
            from_input = torch.isnan(torch_gx) & torch.isfinite(grad)
            for end in (0, top):
                if (from_input & (code == end)).any():
                    expected[code == end] = float("nan")
            torch.testing.assert_close(gx, expected.to(dtype), rtol=0, atol=0, equal_nan=True, msg=str(where))
        # without non-finite inputs, the gradient is finite wherever the incoming one is
        finite = torch.isfinite(x)
        _, gx_finite = _run(make(bits), x[finite].to(device), grad[finite].to(device))
        assert torch.isfinite(gx_finite)[torch.isfinite(grad[finite])].all(), name


def test_functional_forms_match_modules():
    x = _inputs(torch.float32).requires_grad_(True)
    for name, cls in fewbit.MODULES.items():
        if name == "threshold":
            a, b = fewbit.functional.threshold(x, 0.5, -2.0), cls(0.5, -2.0)(x)
        else:
            a, b = getattr(fewbit.functional, name)(x, bits=1), cls(bits=1)(x)
        (ga,) = torch.autograd.grad(a.sum(), x)
        (gb,) = torch.autograd.grad(b.sum(), x)
        assert torch.equal(a, b) and torch.equal(ga, gb), name


# ---------------------------------------------------------------------------------------------------------------
# Bytes saved for backward


def test_saved_bytes_are_bits_per_element(device):
    x32 = torch.randn(64, 1024).to(device).requires_grad_(True)
    for dtype, ratio_of_bits in ((torch.float32, 1 / 32), (torch.bfloat16, 1 / 16), (torch.float16, 1 / 16)):
        x = x32.detach().to(dtype).requires_grad_(True)
        plain = saved_bytes(lambda: F.gelu(x))
        assert plain == x.numel() * x.element_size()
        for bits in (1, 2, 3, 4):
            few = saved_bytes(lambda: fewbit.GELU(bits=bits)(x))
            assert few <= (bits * ratio_of_bits + 0.01) * plain, (dtype, bits, few / plain)
            assert few == ref.packed_bytes(x.numel(), bits) + 2  # and two bools: NaN / inf seen at either end
        assert saved_bytes(lambda: fewbit.ELU(bits=3)(x)) == ref.packed_bytes(x.numel(), 3)  # NaN grad never
        relu = saved_bytes(lambda: fewbit.ReLU()(x))
        assert relu == x.numel() // 8


def test_packing_is_exact_for_odd_sizes():
    g = torch.Generator().manual_seed(3)
    for bits in (1, 2, 3, 4):
        for n in (1, 7, 8, 9, 1001):
            codes = torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.uint8)
            packed = ref.pack(codes, bits)
            assert packed.dtype == torch.uint8 and packed.numel() == ref.packed_bytes(n, bits)
            assert packed.numel() * 8 < bits * n + 8 * bits  # bits per element plus less than one group
            assert torch.equal(ref.unpack(packed, bits, n), codes.int())


def test_no_grad_saves_nothing():
    x = torch.randn(100, requires_grad=True)
    with torch.no_grad():
        assert saved_bytes(lambda: fewbit.GELU()(x)) == 0
    assert saved_bytes(lambda: fewbit.GELU()(x.detach())) == 0


# ---------------------------------------------------------------------------------------------------------------
# Optimality of the borders and levels


def _moments(name):
    spec = act.SMOOTH[name]
    kwargs = dict(act._params(name, spec.defaults, {}))
    return approx._Moments(approx.derivative_of(lambda t: spec.forward(t, **kwargs)), spec.kinks(**kwargs))


def _kinks(name):
    spec = act.SMOOTH[name]
    return spec.kinks(**dict(act._params(name, spec.defaults, {})))


def _error(moments, borders):
    return approx._levels_and_error(moments, np.asarray(borders, dtype=np.float64))[1]


@pytest.mark.parametrize("name", list(act.SMOOTH))
def test_no_perturbation_of_the_borders_lowers_the_error(name):
    moments = _moments(name)
    rng = np.random.default_rng(0)
    for bits in approx.SUPPORTED_BITS:
        table = fewbit.stepwise_table(name, bits)
        borders = np.array(table.borders)
        best = _error(moments, borders)
        assert best == pytest.approx(table.error, rel=1e-9, abs=1e-15)
        # the stored levels are the weighted means of f' over the stored borders' intervals (a level 1 % off fails)
        np.testing.assert_allclose(table.levels, approx._levels_and_error(moments, borders)[0], rtol=0, atol=1e-12)
        tol = 1e-13 * max(best, 1e-3)  # quadrature round-off
        trials = []
        for k in range(len(borders)):
            for delta in (1e-1, 1e-2, 1e-3, 1e-4, -1e-4, -1e-3, -1e-2, -1e-1):
                trials.append(borders + delta * np.eye(len(borders))[k])
        for scale in (1e-1, 1e-2, 1e-3):
            trials += [borders + scale * rng.standard_normal(len(borders)) for _ in range(10)]
        for trial in trials:
            if np.all(np.diff(trial) > 0):
                assert _error(moments, trial) >= best - tol, (name, bits, trial - borders)
        # The levels are the weighted means: moving any of them costs error too.
        derivative = moments.derivative
        for k in range(len(table.levels)):
            for delta in (1e-3, -1e-3):
                levels = np.array(table.levels)
                levels[k] += delta
                assert approx.weighted_error(derivative, borders, levels, _kinks(name)) > best


@pytest.mark.parametrize("name,bits", [("gelu", 3), ("selu", 4), ("hardswish", 4), ("tanh", 2), ("sigmoid", 1)])
def test_builtin_tables_are_what_the_optimiser_computes(name, bits):
    """The stored table is the optimum the optimiser finds on this machine, to the precision the optimiser fixes.

    Another CPU (or numpy build) sums the quadrature in another order, so J and its slopes differ in their last
    bits (~1e-16): the errors agree to that round-off; each border to the optimiser's stopping rule (no border moves
    by 1e-12: two runs end within 2e-12 of the optimum's position) plus one float32 step, since a border within
    2e-12 of a float32 rounding midpoint may round either way; the levels are the weighted means over the stored
    borders. tanh and sigmoid have two mirror-image optima: the optimiser's tie-break must pick the stored one.
    """
    spec = act.SMOOTH[name]
    kwargs = dict(act._params(name, spec.defaults, {}))
    fresh = approx.optimal_stepwise(lambda t: spec.forward(t, **kwargs), bits, spec.kinks(**kwargs))
    stored = fewbit.stepwise_table(name, bits)
    assert fresh.bits == stored.bits == bits and len(fresh.borders) == len(stored.borders) == 2**bits - 1
    round_off = approx._TIE * max(fresh.error, approx._ERROR_FLOOR)
    assert abs(fresh.error - stored.error) <= round_off, (fresh.error, stored.error)
    moments = _moments(name)
    levels, error = approx._levels_and_error(moments, np.array(stored.borders))
    assert abs(error - stored.error) <= round_off
    np.testing.assert_allclose(stored.levels, levels, rtol=0, atol=1e-12)
    f, s = np.array(fresh.borders), np.array(stored.borders)
    float32_step = np.spacing(np.maximum(np.abs(f), np.abs(s)).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(f - s) <= 2e-12 + float32_step), (f, s)
    stored_json = json.loads(act.TABLES_FILE.read_text())
    assert len(stored_json) == len(act.SMOOTH) * len(approx.SUPPORTED_BITS)


def test_non_default_parameters_get_their_own_optimal_table():
    table = fewbit.stepwise_table("elu", 2, (("alpha", 0.5),))
    assert table.borders != fewbit.stepwise_table("elu", 2).borders
    x = torch.randn(500, requires_grad=True)
    fewbit.ELU(0.5, bits=2)(x).sum().backward()
    expected = _expected_stepwise_grad(x.detach(), torch.ones(500), table.borders, table.levels)
    assert torch.equal(x.grad, expected)


def test_error_table_doc_is_current():
    assert DOC_FILE.read_text() == gradient_error_markdown()


@pytest.mark.parametrize("name", ["gelu", "silu", "tanh", "selu"])
def test_table_error_matches_sampled_gradients(name):
    x = torch.randn(2**20, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    exact = torch.tensor(approx.derivative_of(getattr(F, name) if name != "tanh" else torch.tanh)(x.numpy()))
    for bits in approx.SUPPORTED_BITS:
        xx = x.clone().requires_grad_(True)
        getattr(fewbit.functional, name)(xx, bits=bits).sum().backward()
        sampled = float((xx.grad - exact).norm() / exact.norm())
        assert sampled == pytest.approx(fewbit.stepwise_table(name, bits).relative_error, rel=0.03), (name, bits)


def test_gelu_errors_fall_with_bits():
    errors = [fewbit.stepwise_table("gelu", b).relative_error for b in approx.SUPPORTED_BITS]
    assert all(a > b for a, b in itertools.pairwise(errors))
    # each extra bit at least ~halves the error: the 2^bits levels are used, not 2^(bits-1)
    assert all(b < 0.6 * a for a, b in itertools.pairwise(errors))


# ---------------------------------------------------------------------------------------------------------------
# XLA: the saved codes are the cpu codes


def _saved_codes(module, x):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x.detach().clone().requires_grad_(True))
    assert saved[0].dtype == torch.uint8 and [t.dtype for t in saved[1:]] in ([], [torch.bool])
    return torch.cat([to_host(t).view(torch.uint8) for t in saved])  # the codes, then any NaN flags


@pytest.mark.slow
def test_xla_codes_equal_cpu_codes_bit_for_bit():
    from revlib_xla import backends

    if not backends.xla_available():
        pytest.skip("torch_xla is not installed (pip install 'revlib_xla[xla]')")
    xla = backends.device_for("xla")
    for name, (make, _) in CASES.items():
        for dtype in DTYPES:
            x = _inputs(dtype, n=999)
            for bits in (1, 2, 3, 4) if name in SMOOTH_CASES else (1,):
                cpu_codes = _saved_codes(make(bits), x)
                xla_codes = _saved_codes(make(bits), x.to(xla))
                assert torch.equal(cpu_codes, xla_codes), (name, dtype, bits)


# ---------------------------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="bits=5.*1, 2, 3 and 4"):
        fewbit.GELU(bits=5)
    with pytest.raises(ValueError, match="relu does not support bits=3.*two values"):
        fewbit.ReLU(bits=3)
    with pytest.raises(ValueError, match="bits=0"):
        fewbit.functional.tanh(torch.randn(3, requires_grad=True), bits=0)
    with pytest.raises(TypeError, match="floating-point.*torch.int64"):
        fewbit.GELU(bits=3)(torch.arange(4))
    with pytest.raises(ValueError, match="'softmax' has no few-bit form.*gelu"):
        fewbit.activation("softmax")
    with pytest.raises(TypeError, match="unexpected argument 'alpha'"):
        fewbit.GELU(alpha=1.0)
    with pytest.raises(TypeError, match="needs the argument 'value'"):
        fewbit.Threshold(0.5)
    with pytest.raises(ValueError, match="approximate"):
        fewbit.functional.gelu(torch.randn(2), approximate="fast")
    with pytest.raises(ValueError, match=r"few-bit elu: alpha=nan cannot be used.*finite number"):
        fewbit.ELU(alpha=float("nan"))
    with pytest.raises(ValueError, match=r"few-bit softplus: beta=inf cannot be used.*derivative table"):
        fewbit.functional.softplus(torch.randn(3, requires_grad=True), beta=float("inf"))
    with pytest.raises(ValueError, match=r"few-bit hardtanh: max_val=nan cannot be used.*comparison with NaN"):
        fewbit.Hardtanh(-1.0, float("nan"))
    with pytest.raises(TypeError, match="negative_slope must be a number, got str"):
        fewbit.LeakyReLU("0.1")


def test_activation_by_name_and_conversion_of_torch_modules():
    assert isinstance(fewbit.activation("gelu"), fewbit.GELU) and fewbit.activation("gelu").bits == 3
    assert fewbit.activation("relu").bits == 1
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU("tanh"), nn.Linear(8, 8), nn.LeakyReLU(0.2), nn.Softmax(-1))
    converted = fewbit.map_module(model, lambda m: fewbit.convert_activation(m, bits=2))
    assert isinstance(converted[1], fewbit.GELU) and converted[1].params == {"approximate": "tanh"}
    assert converted[1].bits == 2 and isinstance(converted[3], fewbit.LeakyReLU) and converted[3].bits == 1
    assert converted[3].params == {"negative_slope": 0.2} and isinstance(converted[4], nn.Softmax)


def test_table_made_inside_saved_tensor_hooks_ignores_them():
    from revlib_xla.utils import memory_efficient_intermediates

    params = (("alpha", 0.3),)
    with memory_efficient_intermediates(torch.bfloat16):
        inside = fewbit.stepwise_table("elu", 1, params)  # computed now, on first use
    outside = approx.optimal_stepwise(lambda t: F.elu(t, 0.3), 1, (0.0,))
    assert inside == outside
