"""fewbit.RandomizedLinear, convert_linear and map_module (issue 4).

* Exact forward, exact input and bias gradients; the weight gradient is exactly (S G)^T (S X) for the sketch S drawn
  (computed independently in float64), S has the second moment of the identity (exact for Rademacher, to 5e-3 over
  2e6 Gaussian draws), and averaged over many draws the estimate converges to the exact gradient at the rate its
  own spread predicts.
* What it saves, measured: at most ``r + 1 %`` of the input ``nn.Linear`` saves.
* FewBit's README conversion (``map_module(model, lambda m: convert_linear(m, RandomizedLinear, ...))``) works and
  keeps the weights and state-dict keys.
"""

import importlib

import pytest
import torch
from conftest import max_rel_err, to_host
from torch import nn

from revlib_xla import fewbit
from revlib_xla.fewbit.util import convert_linear, map_module
from revlib_xla.memory import saved_bytes

rl = importlib.import_module("revlib_xla.fewbit.randomized_linear")  # the package exports a function of that name


def _pair(device, ratio=0.3, bias=True, matmul="gaussian"):
    torch.manual_seed(0)
    plain = nn.Linear(24, 16, bias=bias).to(device)
    rand = convert_linear(plain, fewbit.RandomizedLinear, proj_dim_ratio=ratio, matmul=matmul)
    return plain, rand


@pytest.mark.parametrize("matmul", ["gaussian", "rademacher"])
@pytest.mark.slow
def test_forward_and_input_gradient_exact_weight_gradient_unbiased(device, matmul):
    plain, rand = _pair(device, matmul=matmul)
    assert rand.weight is plain.weight and isinstance(rand, fewbit.RandomizedLinear)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 10, 24, generator=g).to(device).requires_grad_(True)
    dy = torch.randn(4, 10, 16, generator=g).to(device)

    y = plain(x)
    exact = torch.autograd.grad(y, [x, plain.weight, plain.bias], dy)
    trials = 60 if device.type == "xla" else 400
    estimates = []
    torch.manual_seed(2)
    for _ in range(trials):
        out = rand(x)
        assert torch.equal(to_host(out), to_host(y))
        dx, dw, db = torch.autograd.grad(out, [x, rand.weight, rand.bias], dy)
        assert max_rel_err(dx, exact[0]) < 1e-6 and max_rel_err(db, exact[2]) < 1e-6
        estimates.append(to_host(dw).double())
    estimates = torch.stack(estimates)
    true = to_host(exact[1]).double()
    mean_sq_err_single = ((estimates - true) ** 2).sum(dim=(1, 2)).mean()
    err_of_mean = ((estimates.mean(0) - true) ** 2).sum()
    # Unbiased: E|mean - true|^2 = E|single - true|^2 / trials. A biased estimator stays at its bias^2.
    assert err_of_mean < 3 * mean_sq_err_single / trials, (float(err_of_mean), float(mean_sq_err_single))
    assert estimates[0].ne(estimates[1]).any()  # a fresh sketch per step


@pytest.mark.parametrize("matmul", ["gaussian", "rademacher"])
def test_weight_gradient_is_the_sketched_product(device, matmul, monkeypatch):
    """For the sketch S it drew, the weight gradient is (S G)^T (S X), computed here in float64 from S, X and G; the
    backward redraws the forward's S exactly. Deterministic: a bias of 1 % cannot hide in sampling noise."""
    drawn = []
    real = rl._sketch
    monkeypatch.setattr(rl, "_sketch", lambda *args: drawn.append(real(*args)) or drawn[-1])
    _, rand = _pair(device, matmul=matmul)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 10, 24, generator=g)
    dy = torch.randn(4, 10, 16, generator=g)
    (dw,) = torch.autograd.grad(rand(x.to(device)), [rand.weight], dy.to(device))
    assert len(drawn) == 2 and torch.equal(to_host(drawn[0]), to_host(drawn[1]))
    s = to_host(drawn[0]).double()
    assert s.shape == (int(0.3 * 40), 40)
    expected = (s @ dy.reshape(40, 16).double()).t() @ (s @ x.reshape(40, 24).double())
    assert max_rel_err(dw, expected) < 1e-5


@pytest.mark.parametrize("matmul", ["gaussian", "rademacher"])
def test_sketch_second_moment_is_the_identity(matmul):
    """E[S^T S] = I makes the estimate unbiased: entries of mean 0 and variance 1/k. Rademacher entries are
    +-1/sqrt(k) exactly; Gaussian ones are checked over 2e6 draws (the mean of k S^2 has standard deviation
    sqrt(2 / 2e6) = 1e-3, so a 1 % error in the variance is 10 of them)."""
    k, n = 1000, 2000
    s = rl._sketch(matmul, k, n, 123, torch.empty((), dtype=torch.float64))
    assert s.shape == (k, n) and s.dtype == torch.float64
    if matmul == "rademacher":
        assert torch.equal(s.abs(), torch.full_like(s, 1 / k**0.5))
        assert abs(float(s.sign().mean())) < 5 * (1 / (k * n)) ** 0.5
    else:
        assert abs(float((s * s).mean() * k) - 1) < 5e-3
        assert abs(float(s.mean() * k**0.5)) < 5 * (1 / (k * n)) ** 0.5


def test_saved_bytes_at_most_ratio_of_linear(device):
    x = torch.randn(8, 64, 96).to(device).requires_grad_(True)
    for ratio in (0.2, 0.3, 0.5):
        plain = nn.Linear(96, 80).to(device)
        rand = convert_linear(plain, fewbit.RandomizedLinear, proj_dim_ratio=ratio)
        params = list(plain.parameters())
        linear = saved_bytes(lambda: plain(x), exclude=params)
        assert linear == x.numel() * 4
        sketched = saved_bytes(lambda: rand(x), exclude=params)
        assert sketched <= (ratio + 0.01) * linear, (ratio, sketched / linear)
        assert sketched == int(ratio * 8 * 64) * 96 * 4


def test_state_dict_and_readme_conversion():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 2))
    keys = list(model.state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converter = lambda x: convert_linear(x, fewbit.RandomizedLinear, proj_dim_ratio=0.1)  # FewBit's README
    new = map_module(model, converter)
    assert new is model and list(new.state_dict()) == keys
    assert all(torch.equal(before[k], v) for k, v in new.state_dict().items())
    assert [type(m) for m in new.modules()].count(fewbit.RandomizedLinear) == 3
    assert "proj_dim_ratio=0.1" in repr(new[0])
    # fn(module, path) and a pattern: only the nested block is converted
    seen = []
    other = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 16)))
    map_module(
        other,
        lambda m, path: seen.append(path) or convert_linear(m, fewbit.RandomizedLinear, proj_dim=4),
        patt=r"1\..*",
    )
    assert seen == ["1.0"] and type(other[0]) is nn.Linear and type(other[1][0]) is fewbit.RandomizedLinear


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="exactly one of proj_dim_ratio"):
        fewbit.RandomizedLinear(4, 4)
    with pytest.raises(ValueError, match=r"proj_dim_ratio must be in \(0, 1\]"):
        fewbit.RandomizedLinear(4, 4, proj_dim_ratio=1.5)
    with pytest.raises(ValueError, match="matmul must be one of"):
        fewbit.RandomizedLinear(4, 4, proj_dim_ratio=0.5, matmul="dct")
    layer = fewbit.RandomizedLinear(4, 4, proj_dim_ratio=0.5)
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="in_features=4"):
        layer(torch.ones(2, 5))
    with pytest.raises(TypeError, match="must return an nn.Module"):
        map_module(nn.Sequential(nn.Linear(2, 2)), lambda m: None)


def test_autocast_matches_linear_forward_and_input_gradient():
    torch.manual_seed(0)
    plain = nn.Linear(24, 16)
    rand = convert_linear(plain, fewbit.RandomizedLinear, proj_dim_ratio=0.5)
    x = torch.randn(32, 24, requires_grad=True)
    results = []
    for layer in (plain, rand):
        with torch.autocast("cpu", torch.bfloat16):
            out = layer(x)
        dx, dw = torch.autograd.grad(out.float().pow(2).sum(), [x, layer.weight])
        results.append((out, dx, dw))
    (out, dx, dw), (rout, rdx, rdw) = results
    assert rout.dtype == out.dtype == torch.bfloat16 and torch.equal(rout, out)
    assert rdx.dtype == torch.float32 and torch.equal(rdx, dx) and rdw.dtype == dw.dtype == torch.float32
