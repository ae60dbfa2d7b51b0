"""``Checkpointable(scan=True)``: a run of identical stages runs as one stage with rematerialisation inside
(revlib_xla.scan.ScannedStages): the plain model's gradients (float64 on cpu, layer by layer; float32 on XLA, two
while loops, against the unscanned Checkpointable), one layer compiled whatever the depth, one compile per step after
the first, and clear errors where it cannot apply."""

import warnings

import pytest
import torch
from conftest import max_rel_err
from torch import nn

import revlib_xla as revlib
from revlib_xla import backends
from revlib_xla.planner import Chain, Op, Schedule, simulate
from revlib_xla.planner.scanned import ScannedStages

WIDTH = 16


class Block(nn.Module):
    """A pre-norm residual MLP block, as a transformer's."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.dropout = nn.Dropout(p)

    def forward(self, x):
        return x + self.dropout(self.down(torch.tanh(self.up(self.norm(x)))))


def _model(depth: int, seed: int = 0, p: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), *[Block(p) for _ in range(depth)], nn.Linear(WIDTH, 1))


def _grads(model, module, x):
    module(x).square().sum().backward()
    return [p.grad for p in model.parameters()], x.grad


def _x(dtype=torch.float64):
    return torch.randn(8, 4, WIDTH, dtype=dtype, generator=torch.Generator().manual_seed(1)).requires_grad_()


# Stage 1 (the scanned run) checkpointed in the forward and recomputed with autograd in the backward: what the
# planner picks when keeping the layers' inputs costs more than the budget allows.
RECOMPUTED = (("Fe", 0), ("CF", 1), ("Fe", 2), ("L", 3), ("B", 2), ("Fe", 1), ("B", 1), ("B", 0))


# Every stage's input and the run's layers' inputs kept: the fastest plan.
KEPT = (("Fe", 0), ("Fe", 1), ("Fe", 2), ("L", 3), ("B", 2), ("B", 1), ("B", 0))


def _schedule(chain, ops) -> Schedule:
    ops = [Op(kind, i) for kind, i in ops]
    return Schedule(tuple(ops), *simulate(chain, ops), chain)


def _recomputed(chain) -> Schedule:
    return _schedule(chain, RECOMPUTED)


def test_scanned_run_equals_the_plain_model_on_cpu():
    """Scanned stages hold a planned stage's place: whether the run's layers' inputs are kept (the fastest plan) or
    the run's forward is recomputed from its checkpoint, the gradients are plain autograd's."""
    reference = _model(5).double()
    expected, dx_ref = _grads(reference, reference, _x())
    model = _model(5).double()
    checkpointed = revlib.Checkpointable(model, scan=True)
    kinds = [type(s) for s in checkpointed.stages]
    assert kinds == [nn.Linear, ScannedStages, nn.Linear] and len(checkpointed.stages[1].layers) == 5
    checkpointed.measure(_x())
    chain = checkpointed.chain
    assert chain.cbw[2] == 5 * chain.cw[1]  # what the run keeps with autograd: its layers' inputs
    for schedule in (checkpointed.compute_sequence(), _recomputed(chain)):
        checkpointed.sequence = schedule
        model.zero_grad(set_to_none=True)
        found, dx = _grads(model, checkpointed, _x())
        assert max_rel_err(dx, dx_ref) < 1e-12
        for g, g_ref in zip(found, expected):
            assert max_rel_err(g, g_ref) < 1e-12
        # torch.autograd.grad of one parameter, as the plain model gives it
        (g,) = torch.autograd.grad(checkpointed(_x()).square().sum(), [model[2].up.weight])
        assert max_rel_err(g, expected[[n for n, _ in model.named_parameters()].index("2.up.weight")]) < 1e-12
    # a second backward through a retained graph (Checkpointable runs the forward phase again): twice the gradients
    model.zero_grad(set_to_none=True)
    out = checkpointed(_x()).square().sum()
    out.backward(retain_graph=True)
    out.backward()
    for p, g_ref in zip(model.parameters(), expected):
        assert max_rel_err(p.grad, 2 * g_ref) < 1e-12


def test_scan_true_errors():
    with pytest.raises(
        ValueError,
        match=r"scan=True\): no two consecutive stages are identical.*stage 1 \(Linear\) differs from stage 0",
    ):
        revlib.Checkpointable(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4), nn.Linear(4, 4)), scan=True)
    with pytest.raises(ValueError, match=r"options and saved_dtypes name stages by index"):
        revlib.Checkpointable(_model(2), scan=True, saved_dtypes=[torch.bfloat16])
    bn = nn.Sequential(*[nn.BatchNorm1d(4) for _ in range(3)])
    with pytest.raises(ValueError, match=r"stage 0 \(BatchNorm1d\): its module 'itself' is in training mode"):
        revlib.Checkpointable(bn, scan=True)
    dropout = revlib.Checkpointable(_model(3, p=0.5), scan=True)
    with pytest.raises(Exception, match=r"draw random numbers \(dropout\).*pass scan=False"):
        dropout(_x(torch.float32)).sum().backward()
    wider = revlib.Checkpointable(nn.Sequential(*[nn.Linear(4, 4) for _ in range(2)], nn.Linear(4, 2)), scan=True)
    assert type(wider.stages[0]) is ScannedStages
    with pytest.raises(TypeError, match=r"the layers' input must be one tensor"):
        wider.stages[0]((torch.ones(4), torch.ones(4)))


def _xla():
    if not backends.xla_available():
        pytest.skip("torch_xla is not installed (pip install 'revlib_xla[xla]')")
    import torch_xla

    return backends.device_for("xla"), torch_xla


def _executor(depth: int):
    """The stages of ``Checkpointable(scan=True)`` run with the run recomputed in the backward, by
    :class:`revlib_xla.planner.ScheduleExecutor` (no measuring: on XLA that compiles every stage several times)."""
    model = _model(depth)
    stages = revlib.Checkpointable(model, scan=True).stages
    chain = Chain([1.0] * 3, [1.0] * 4, [1.0] * 4, [1.0] * 4, [0.0] * 3, [0.0] * 4)  # the schedule's shape only
    return model, revlib.planner.ScheduleExecutor(nn.Sequential(*stages), _recomputed(chain))


@pytest.mark.slow
def test_scanned_run_on_xla_compiles_one_layer_and_equals_the_plain_model():
    """The same loops and matrix products whatever the depth (2 and 4 layers: one layer compiled), no compile after
    the first steps, and the plain model's gradients on XLA, with the run's forward recomputed in the backward."""
    device, torch_xla = _xla()
    import torch_xla.debug.metrics as met

    counts, compiles = {}, []
    for depth in (2, 4):
        model, executor = _executor(depth)
        model.to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for step in range(3 if depth == 4 else 1):
            met.clear_all()
            opt.zero_grad(set_to_none=True)
            x = _x(torch.float32).detach().to(device)
            executor(x).square().sum().backward()
            grads = [p.grad for p in model.parameters()]
            if step == 0:
                hlo = torch_xla._XLAC._get_xla_tensors_hlo(grads)
                counts[depth] = (hlo.count(" while("), hlo.count(" dot("))
            if depth == 2:
                break  # traced, not run
            if step == 0:
                reference = _model(depth).to(device)
                reference(x).square().sum().backward()
                torch_xla.sync()  # one execution for every gradient (each read alone would run the step again)
                # float32, the same operations in another order (a loop body, fused apart): rounding only
                for g, g_ref in zip(grads, reference.parameters()):
                    assert max_rel_err(g.cpu(), g_ref.grad.cpu()) < 1e-5
            opt.step()
            torch_xla.sync()
            data = met.metric_data("CompileTime")
            compiles.append(0 if data is None else data[0])
    # the run's forward without autograd (CF), again keeping its layers' inputs (Fe), its backward: three loops
    assert counts[2][0] == counts[4][0] == 3
    assert counts[2][1] == counts[4][1] > 0
    assert compiles[0] >= 1 and compiles[-1] == 0, compiles


def _stacked(depth: int, dtype=torch.float64):
    model = _model(depth).to(dtype)
    return model, revlib.scan.stack_layers(revlib.Checkpointable(model, scan=True))


def _unstacked_grads(model, expected):
    """Each stack's gradient compared layer by layer with the plain model's gradients (by the unstacked keys)."""
    found = dict(model.named_parameters())
    errors = {}
    for attr, layers in model._stage_stacks.stacks.items():
        for t, keys in enumerate(layers):
            errors[keys[0]] = max_rel_err(found[attr].grad[t], expected[keys[0]])
    for name, p in found.items():
        if name in expected:
            errors[name] = max_rel_err(p.grad, expected[name])
    return errors


def test_stacked_runs_equal_the_plain_model_on_cpu():
    """stack_layers on a Checkpointable(scan=True): one [layers, ...] parameter per layer parameter, held by the
    model; the plain model's gradients (kept inputs and recomputed run), state-dict keys and values, loading a plain
    checkpoint, an optimizer step, eval mode, and clear errors."""
    reference = _model(4).double()
    reference(_x()).square().sum().backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    model, checkpointed = _stacked(4)
    assert [n for n, _ in model.named_parameters() if n.startswith("stacked_")] == [
        f"stacked_1_{n}" for n in ("norm_weight", "norm_bias", "up_weight", "up_bias", "down_weight", "down_bias")
    ]
    assert model.stacked_1_up_weight.shape == (4, 2 * WIDTH, WIDTH)
    assert revlib.scan.layer_shape(model.stacked_1_up_weight, checkpointed) == (2 * WIDTH, WIDTH)
    assert revlib.scan.layer_shape(model[0].weight, checkpointed) == (WIDTH, WIDTH)
    assert not list(model[2].parameters())  # the layers hold none: the stacks are the parameters
    # the same keys, order and values as the plain model's (the checkpoint of a stacked model loads unstacked)
    state = model.state_dict()
    assert list(state) == list(reference.state_dict())
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
    assert list(checkpointed.state_dict()) == [f"model.{k}" for k in state]
    checkpointed.chain = Chain([1.0] * 3, [1.0] * 4, [1.0] * 4, [1.0] * 4, [0.0] * 3, [0.0] * 4)  # no measuring
    for schedule in (_schedule(checkpointed.chain, KEPT), _recomputed(checkpointed.chain)):
        checkpointed.sequence = schedule
        model.zero_grad(set_to_none=True)
        checkpointed(_x()).square().sum().backward()
        errors = _unstacked_grads(model, expected)
        assert len(errors) == len(expected) and max(errors.values()) < 1e-12, errors
    (g,) = torch.autograd.grad(checkpointed(_x()).square().sum(), [model.stacked_1_up_weight])
    assert max_rel_err(g[1], expected["2.up.weight"]) < 1e-12
    # a gradient of a gradient (create_graph=True: the run's layers again with autograd, on slices of the stacks)
    penalties = []
    for module, weight in ((reference, reference[2].up.weight), (checkpointed, model.stacked_1_up_weight)):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Checkpointable: a backward with create_graph=True")
            (g,) = torch.autograd.grad(module(_x()).square().sum(), [weight], create_graph=True)
        penalties.append(torch.autograd.grad((g if g.ndim == 2 else g[1]).square().sum(), [weight])[0])
    assert max_rel_err(penalties[1][1], penalties[0]) < 1e-12
    # an optimizer over the stacks takes the plain model's step
    for module in (reference, checkpointed):
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        for _ in range(2):
            opt.zero_grad()
            module(_x()).square().sum().backward()
            opt.step()
    for k, v in reference.state_dict().items():
        assert max_rel_err(model.state_dict()[k], v) < 1e-12, k
    # eval mode runs the stages (the layers hold no parameters of their own)
    checkpointed.eval(), reference.eval()
    with torch.no_grad():
        assert max_rel_err(checkpointed(_x()), reference(_x())) < 1e-12
    # a plain checkpoint loads into the stacks; a stacked model's loads into a plain one
    other = _model(4, seed=5).double()
    model.load_state_dict(other.state_dict())
    assert torch.equal(model.stacked_1_up_weight[3], other[4].up.weight)
    reference.load_state_dict(model.state_dict())
    assert torch.equal(reference[4].up.weight, other[4].up.weight)
    # layer by layer writes go into the stacks (nested contexts place the parameters once)
    with revlib.scan.layer_parameters(model), revlib.scan.layer_parameters(model), torch.no_grad():
        model[3].down.bias.fill_(2.0)
    assert torch.equal(model.stacked_1_down_bias[2], torch.full((WIDTH,), 2.0, dtype=torch.float64))
    assert not list(model[3].parameters())
    with pytest.raises(RuntimeError, match=r"stacked \(stack_layers on the Checkpointable.*call the Checkpointable"):
        model(_x())
    with pytest.raises(ValueError, match=r"stack_layers: the Checkpointable's scanned runs are stacked already"):
        revlib.scan.stack_layers(checkpointed)
    with pytest.raises(ValueError, match=r"stack_layers: the Checkpointable has no scanned run.*scan=True"):
        revlib.scan.stack_layers(revlib.Checkpointable(_model(2)))


def test_stacked_runs_on_xla_equal_the_plain_model():
    """On XLA the stacked run's loops read the stacks and their gradients are the loop's output: the plain model's
    gradients (float32, another order of the same operations: rounding only)."""
    device, torch_xla = _xla()
    reference = _model(3).to(device)
    x = _x(torch.float32).detach().to(device)
    reference(x).square().sum().backward()
    model, checkpointed = _stacked(3, torch.float32)
    checkpointed.to(device)
    checkpointed.chain = Chain([1.0] * 3, [1.0] * 4, [1.0] * 4, [1.0] * 4, [0.0] * 3, [0.0] * 4)
    checkpointed.sequence = _recomputed(checkpointed.chain)
    checkpointed(x).square().sum().backward()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([p.grad for p in model.parameters()])
    assert hlo.count(" while(") == 3  # the run's forward (CF), again keeping its layers' inputs (Fe), its backward
    torch_xla.sync()
    expected = {n: p.grad.cpu() for n, p in reference.named_parameters()}
    errors = _unstacked_grads(model.cpu(), expected)
    assert len(errors) == len(expected) and max(errors.values()) < 1e-5, errors


# -- where a user could break it ---------------------------------------------------------------------------------------
# ``Checkpointable(model, scan=True)`` (runs of identical stages as one ScannedStages stage), checked where a user
# could break it: double backward, GradScaler, stages returning tuples, and stages whose running statistics change
# after the model was wrapped (float64 on cpu against the plain model, elementwise).
NORM_WIDTH = 8


class NormBlock(nn.Module):
    def __init__(self, norm: type[nn.Module] = nn.LayerNorm) -> None:
        super().__init__()
        self.norm = norm(NORM_WIDTH)
        self.up, self.down = nn.Linear(NORM_WIDTH, 2 * NORM_WIDTH), nn.Linear(2 * NORM_WIDTH, NORM_WIDTH)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def _pair(norm=nn.LayerNorm, depth=3):
    """(the plain model, a copy of it wrapped by Checkpointable(scan=True) with its blocks scanned), float64."""
    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Linear(NORM_WIDTH, NORM_WIDTH), *[NormBlock(norm) for _ in range(depth)], nn.Linear(NORM_WIDTH, 1)
    ).double()
    copy = nn.Sequential(
        nn.Linear(NORM_WIDTH, NORM_WIDTH), *[NormBlock(norm) for _ in range(depth)], nn.Linear(NORM_WIDTH, 1)
    ).double()
    copy.load_state_dict(plain.state_dict())
    return plain, copy


def _norm_x():
    return torch.randn(6, NORM_WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()


def test_double_backward_through_scanned_stages_equals_the_plain_model():
    """create_graph=True: the gradient of a function of the first gradient (a gradient penalty)."""
    plain, model = _pair()
    wrapped = revlib.Checkpointable(model, scan=True)
    assert any(isinstance(s, ScannedStages) for s in wrapped.stages)
    results = []
    for module, params in ((plain, list(plain.parameters())), (wrapped, list(model.parameters()))):
        x = _norm_x()
        (dx,) = torch.autograd.grad(module(x).square().sum(), x, create_graph=True)
        results.append(torch.autograd.grad(dx.square().sum(), params))
    for got, want in zip(results[1], results[0]):
        assert max_rel_err(got, want) < 1e-12


def test_grad_scaler_over_scanned_stages_gives_the_plain_gradients():
    plain, model = _pair()
    wrapped = revlib.Checkpointable(model, scan=True)
    plain(_norm_x()).square().sum().backward()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.scale(wrapped(_norm_x()).square().sum()).backward()
    scaler.unscale_(optimizer)
    for got, want in zip(model.parameters(), plain.parameters()):
        assert max_rel_err(got.grad, want.grad) < 1e-12


class Pair(nn.Module):
    """A stage of two streams: takes and returns a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(NORM_WIDTH, NORM_WIDTH)

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
        wrapped((_norm_x(), _norm_x()))


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
        torch.testing.assert_close(wrapped(_norm_x()), plain(_norm_x()), rtol=1e-12, atol=0)
    wrapped.train()
    with pytest.raises(
        Exception,
        match=r"layer 0 \(NormBlock\): its module 'norm' is in training mode with buffers.*"
        r"Pass scan=False",
    ):
        wrapped(_norm_x()).square().sum().backward()
    assert int(model[1].norm.num_batches_tracked) == 0
