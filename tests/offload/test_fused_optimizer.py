"""The optimizer step fused into the backward pass (issue 5, part 2).

* Determinism: over 10 steps the losses (and final weights) of a fused run equal the unfused run bit for bit, for
  SGD, SGD with momentum and AdamW, on every device present, through ``ReversibleSequential(fused_optimizer=...)``
  and through ``revlib_xla.fuse_optimizer`` on a plain model and on a model mixing plain and reversible parts.
* Gradients are freed as the backward goes: when any layer steps, no other layer holds a gradient.
* Memory: MemTracker's measured peak of a fused SGD step is at most 55 % of the unfused step's (16 blocks of
  width 512, the seed's example scaled to the CPU).
* XLA: the fused steps are traced into the training step's single graph: one execution per step and no compile
  after warm-up.
* Bad input: shared weights, a factory that does not return an optimizer, ``no_savings`` with a fused optimizer,
  fusing twice.
* Issue 15: only a training backward steps (``autograd.grad``, ``backward(inputs=...)``); learning-rate schedulers
  give the unfused weights bit for bit and resume mid-run; loss scaling is refused (before any weight moves under
  float16 autocast, at ``GradScaler.step`` otherwise); gradient accumulation is refused; ``.double()`` and
  ``.to(device)`` after steps, ``copy.deepcopy`` and ``torch.save`` of a fused model train as the unfused run does.
"""

import copy
import functools
import io
import warnings

import pytest
import torch
from conftest import to_host
from torch import nn

import revlib_xla as revlib
from revlib_xla import FusedOptimizerError, backends, memory

WIDTH = 8
DEPTH = 4
STEPS = 10

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}


def _block(width: int = WIDTH) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))


def _reversible(fused=None, seed=0):
    torch.manual_seed(seed)
    return revlib.ReversibleSequential(*[_block() for _ in range(DEPTH)], fused_optimizer=fused)


def _mixed(seed=0):
    """Plain layers around a reversible sequence: fuse_optimizer must handle both kinds of parameters."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(WIDTH, 2 * WIDTH),
        revlib.ReversibleSequential(*[_block() for _ in range(DEPTH)]),
        nn.Tanh(),
        nn.Linear(2 * WIDTH, WIDTH),
    )


def _plain(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(2 * WIDTH, 2 * WIDTH), nn.GELU()) for _ in range(DEPTH)])


def _batches(in_width, steps=STEPS):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(5, in_width, generator=gen) for _ in range(steps)]


def _train(model, device, optimizer, in_width, scheduler=None, batches=None):
    """Steps of forward, backward and (when ``optimizer`` is given) ``optimizer.step()`` (an unfused step, or a fused
    optimizer's check) and ``scheduler.step()``, one per batch (STEPS batches by default); losses and weights."""
    losses = []
    for x in _batches(in_width) if batches is None else batches:
        x = x.to(device)
        loss = (model(x) - x).abs().mean()
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step(float(loss.detach()))
        elif scheduler is not None:
            scheduler.step()
        backends.sync(device)
        losses.append(loss.detach())
    return torch.stack(to_host(losses)), [to_host(p) for p in model.parameters()]


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.slow
def test_reversible_fused_losses_equal_unfused_bit_for_bit(device, opt):
    factory = OPTIMIZERS[opt]
    unfused = _reversible().to(device)
    ref_losses, ref_weights = _train(unfused, device, factory(unfused.parameters()), 2 * WIDTH)
    fused = _reversible(fused=factory).to(device)
    losses, weights = _train(fused, device, None, 2 * WIDTH)
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    assert all(p.grad is None for p in fused.parameters()), "fused steps must free the gradients"
    assert fused.fused_optimizer.steps_taken == STEPS * DEPTH  # one optimizer per layer, stepped once per step


@pytest.mark.parametrize(
    "make, opt", [(_plain, "sgd_momentum"), (_mixed, "adamw")], ids=["plain-sgd_momentum", "plain_and_reversible-adamw"]
)
@pytest.mark.slow
def test_fuse_optimizer_equals_unfused_bit_for_bit(device, opt, make):
    factory = OPTIMIZERS[opt]
    unfused = make().to(device)
    ref_losses, ref_weights = _train(
        unfused, device, factory(unfused.parameters()), 2 * WIDTH if make is _plain else WIDTH
    )
    model = make().to(device)
    fused = revlib.fuse_optimizer(model, factory)
    losses, weights = _train(model, device, fused, 2 * WIDTH if make is _plain else WIDTH)  # step(): a no-op
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    assert fused.steps_taken == STEPS * len(list(model.parameters()))
    fused.remove()  # unfused again: gradients stay after backward
    model(torch.randn(2, 2 * WIDTH if make is _plain else WIDTH).to(device)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


class Checkpointed(nn.Module):
    """Each block under activation checkpointing (torch.utils.checkpoint, or torch_xla's on xla)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(2 * WIDTH, 2 * WIDTH), nn.GELU()) for _ in range(DEPTH))

    def forward(self, x):
        for b in self.blocks:
            x = backends.checkpoint(b, x)
        return x


def test_fuse_optimizer_composes_with_checkpointing():
    factory = OPTIMIZERS["adamw"]
    unfused = Checkpointed()
    ref_losses, ref_weights = _train(unfused, torch.device("cpu"), factory(unfused.parameters()), 2 * WIDTH)
    model = Checkpointed()
    fused = revlib.fuse_optimizer(model, factory)
    losses, weights = _train(model, torch.device("cpu"), None, 2 * WIDTH)
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    assert fused.steps_taken == STEPS * 2 * DEPTH


def _planned(seed=0):
    """The plain model under the planner's Checkpointable, at a budget that recomputes."""
    model = revlib.Checkpointable(_plain(seed), input=torch.randn(5, 2 * WIDTH))
    low, high = model.min_memory(), model.no_checkpoint_memory()
    schedule = model.compute_sequence(low + 0.1 * (high - low))
    assert schedule.counts().get("Fn", 0) + schedule.counts().get("CF", 0) > 0  # something is recomputed
    return model


@pytest.mark.slow
def test_fuse_optimizer_with_the_planners_checkpointable():
    """Checkpointable runs each stage's backward with autograd, so the per-parameter hooks step every stage as its
    gradients complete, in the planned schedule with recomputation (the smallest budget)."""
    factory = OPTIMIZERS["adamw"]
    planned = _planned

    unfused = planned()
    ref_losses, ref_weights = _train(unfused, torch.device("cpu"), factory(unfused.parameters()), 2 * WIDTH)
    model = planned()
    fused = revlib.fuse_optimizer(model, factory)
    losses, weights = _train(model, torch.device("cpu"), None, 2 * WIDTH)
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    assert fused.steps_taken == STEPS * len(list(model.parameters()))


def test_only_one_layers_gradients_exist_when_a_layer_steps():
    """The fused step runs inside the backward, and the gradients of the layers stepped before are already gone."""
    seen = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(sum(p.grad is not None for p in model.parameters()))
            return super().step(closure)

    model = _reversible(fused=lambda params: Recording(params, lr=0.1))
    loss = model(torch.randn(3, 2 * WIDTH)).square().mean()
    loss.backward()
    per_layer = len(list(model[0].parameters()))
    assert seen == [per_layer] * DEPTH


def test_learning_rate_changes_reach_every_fused_step():
    model = _reversible(fused=OPTIMIZERS["sgd"])
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 2 * WIDTH)).sum().backward()  # builds the optimizer at the first forward
    for group in model.fused_optimizer.param_groups:
        group["lr"] = 0.0
    after_first = [p.detach().clone() for p in model.parameters()]
    assert not any(torch.equal(a, b) for a, b in zip(before, after_first))
    model(torch.randn(3, 2 * WIDTH)).sum().backward()
    assert all(torch.equal(a, p) for a, p in zip(after_first, model.parameters()))
    state = model.fused_optimizer.state_dict()
    model.fused_optimizer.load_state_dict(state)
    assert len(state["optimizers"]) == DEPTH


# ---------------------------------------------------------------------------------------------------------------
# Memory: the seed's fused-optimizer example (Linear-ReLU-Linear blocks, SGD), scaled down to 16 blocks of width 512.


def _seed_block(width=512):
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


def _seed_step(model, x):
    loss = (model(x) - x).abs().mean()
    loss.backward()
    return loss


def test_fused_sgd_peak_is_at_most_55_percent_of_unfused(device):
    if device.type == "xla":
        pytest.skip("an XLA step's memory is decided by the compiler; eager peaks are measured on cpu and cuda")
    sgd = OPTIMIZERS["sgd"]
    x = torch.randn(1, 2 * 512, device=device)
    torch.manual_seed(0)
    unfused = revlib.ReversibleSequential(*[_seed_block() for _ in range(16)]).to(device)
    ref = memory.eager_peak(_seed_step, unfused, x, optimizer=sgd(unfused.parameters()))
    torch.manual_seed(0)
    fused = revlib.ReversibleSequential(*[_seed_block() for _ in range(16)], fused_optimizer=sgd).to(device)
    got = memory.eager_peak(_seed_step, fused, x)
    print(f"\nunfused: {ref}\nfused:   {got}\nratio {got.total / ref.total:.3f}")
    assert got.total <= 0.55 * ref.total, (got, ref)
    assert got.gradients + got.temporaries < 2 * (ref.parameters // 16) + (2 << 20)  # about one layer's gradients
    assert torch.equal(
        to_host(unfused[0].wrapped_module.wrapped_module[0].weight),
        to_host(fused[0].wrapped_module.wrapped_module[0].weight),
    )


# ---------------------------------------------------------------------------------------------------------------
# XLA: one graph per step, compiled once.


def test_xla_fused_steps_are_traced_into_the_single_step_graph():
    if not backends.xla_available():
        pytest.skip("torch_xla is not installed (pip install 'revlib_xla[xla]')")
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    dev = backends.device_for("xla")
    model = _reversible(fused=OPTIMIZERS["adamw"]).to(dev)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(5, 2 * WIDTH, generator=gen) for _ in range(5)]
    for i, x in enumerate(batches):
        if i == 2:  # warm-up: step 0 creates the optimizer state, step 1 uses it
            xm.wait_device_ops()
            met.clear_all()
        x = x.to(dev)
        loss = (model(x) - x).abs().mean()
        loss.backward()
        torch_xla.sync()
    xm.wait_device_ops()
    report = met.short_metrics_report()
    assert met.metric_data("CompileTime") is None, report
    assert met.metric_data("ExecuteTime")[0] == len(batches) - 2, report  # one graph per step, steps included


# ---------------------------------------------------------------------------------------------------------------
# Bad input


def test_shared_weights_are_refused():
    shared = _block()
    model = revlib.ReversibleSequential(shared, _block(), shared, fused_optimizer=OPTIMIZERS["sgd"])
    with pytest.raises(FusedOptimizerError, match="shared by layers layer 0 .*layer 2"):
        model(torch.randn(2, 2 * WIDTH))
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    with pytest.raises(FusedOptimizerError, match=r"shared by '0.weight', '1.weight'"):
        revlib.fuse_optimizer(tied, OPTIMIZERS["sgd"])


def test_factory_must_return_an_optimizer():
    with pytest.raises(FusedOptimizerError, match="returned list for parameter '0.weight'.*torch.optim.Optimizer"):
        revlib.fuse_optimizer(nn.Sequential(nn.Linear(2, 2)), lambda params: list(params))
    model = _reversible(fused=lambda params: None)
    with pytest.raises(FusedOptimizerError, match="returned NoneType for layer '0-0'"):
        model(torch.randn(2, 2 * WIDTH))
    with pytest.raises(FusedOptimizerError, match="must be a callable"):
        revlib.ReversibleSequential(_block(), fused_optimizer=torch.optim.SGD(_block().parameters(), lr=1))
    with pytest.raises(FusedOptimizerError, match="no_savings"):
        revlib.ReversibleSequential(
            _block(), memory_mode=revlib.MemoryModes.no_savings, fused_optimizer=OPTIMIZERS["sgd"]
        )
    with pytest.raises(FusedOptimizerError, match="does not hold exactly the parameters"):
        revlib.fuse_optimizer(nn.Linear(2, 2), lambda params: torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1))


# ---------------------------------------------------------------------------------------------------------------
# Only a training backward steps (issue 15, 2.1): autograd runs post-accumulate-grad hooks only when it accumulates
# into .grad.


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("make", [_plain, Checkpointed, _planned], ids=["plain", "torch_checkpoint", "checkpointable"])
def test_fuse_optimizer_steps_only_what_a_backward_accumulates(make):
    factory = OPTIMIZERS["sgd_momentum"]
    x = torch.randn(5, 2 * WIDTH, requires_grad=True)
    ref = make()
    ref_opt = factory(ref.parameters())
    model = make()
    fused = revlib.fuse_optimizer(model, factory)
    before = _weights(model)

    def loss_of(m):
        return (m(x) - 1).square().mean()

    # input gradient only (saliency, FGSM, gradient penalty): returned, no weight moves
    (got,) = torch.autograd.grad(loss_of(model), x)
    assert torch.equal(got, torch.autograd.grad(loss_of(ref), x)[0])
    # parameter gradients returned to the caller: nothing is accumulated, nothing steps
    got = torch.autograd.grad(loss_of(model), list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(got, torch.autograd.grad(loss_of(ref), list(ref.parameters()))))
    # backward(inputs=[x]): only x.grad
    loss_of(model).backward(inputs=[x])
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert fused.steps_taken == 0 and all(p.grad is None for p in model.parameters())
    assert torch.equal(x.grad, torch.autograd.grad(loss_of(ref), x)[0])
    # backward(inputs=[one weight]): that weight steps, as an unfused step after the same backward would
    first, first_ref = next(model.parameters()), next(ref.parameters())
    loss_of(model).backward(inputs=[first])
    loss_of(ref).backward(inputs=[first_ref])
    ref_opt.step()
    ref_opt.zero_grad()
    fused.step()
    assert fused.steps_taken == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert not torch.equal(first, before[0])


# ---------------------------------------------------------------------------------------------------------------
# Learning-rate schedulers (issue 15, 2.12): every scheduler takes the fused optimizer and reaches every step.

SCHEDULERS = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS),
    "one_cycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS),
    "linear_then_step": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.2, total_iters=3),
            torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        ],
        milestones=[3],
    ),
    "plateau": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=0.5),
}


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_schedulers_drive_a_fused_optimizer_as_an_unfused_one(sched, opt):
    factory, schedule = OPTIMIZERS[opt], SCHEDULERS[sched]
    unfused = _plain()
    ref_opt = factory(unfused.parameters())
    ref_sched = schedule(ref_opt)
    ref_losses, ref_weights = _train(unfused, torch.device("cpu"), ref_opt, 2 * WIDTH, ref_sched)
    model = _plain()
    fused = revlib.fuse_optimizer(model, factory)
    scheduler = schedule(fused)
    losses, weights = _train(model, torch.device("cpu"), fused, 2 * WIDTH, scheduler)
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    lrs = {group["lr"] for group in fused.param_groups}
    assert lrs == {ref_opt.param_groups[0]["lr"]}  # every inner optimizer at the scheduler's rate
    assert lrs != {ref_opt.defaults["lr"]}  # the schedule did change the rate
    assert len(fused.param_groups) == len(fused.optimizers) == len(list(model.parameters()))


def test_a_scheduler_drives_a_reversible_sequences_own_fused_optimizer():
    factory, schedule = OPTIMIZERS["adamw"], SCHEDULERS["one_cycle"]
    unfused = _reversible()
    ref_opt = factory(unfused.parameters())
    ref_losses, ref_weights = _train(unfused, torch.device("cpu"), ref_opt, 2 * WIDTH, schedule(ref_opt))
    model = _reversible(fused=factory)
    losses, weights = _train(
        model, torch.device("cpu"), model.fused_optimizer, 2 * WIDTH, schedule(model.fused_optimizer)
    )
    assert torch.equal(losses, ref_losses), (losses - ref_losses).abs().max()
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))


@pytest.mark.parametrize("sched", ["one_cycle", "linear_then_step"])
def test_fused_optimizer_and_scheduler_resume_mid_run(sched):
    """Model, fused optimizer and scheduler saved after 4 of 10 steps (torch.save of their state dicts) and loaded
    into fresh objects, built in the order torch documents (scheduler before the optimizer's load_state_dict):
    the 10 steps equal an unfused run without a break."""
    factory, schedule = OPTIMIZERS["adamw"], SCHEDULERS[sched]
    batches = _batches(2 * WIDTH)
    unfused = _plain()
    ref_opt = factory(unfused.parameters())
    ref_losses, ref_weights = _train(unfused, torch.device("cpu"), ref_opt, 2 * WIDTH, schedule(ref_opt), batches)

    model = _plain()
    fused = revlib.fuse_optimizer(model, factory)
    scheduler = schedule(fused)
    first, _ = _train(model, torch.device("cpu"), fused, 2 * WIDTH, scheduler, batches[:4])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": fused.state_dict(), "scheduler": scheduler.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = _plain(seed=5)
    resumed.load_state_dict(saved["model"])
    fused = revlib.fuse_optimizer(resumed, factory)
    scheduler = schedule(fused)
    fused.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    second, weights = _train(resumed, torch.device("cpu"), fused, 2 * WIDTH, scheduler, batches[4:])
    assert torch.equal(torch.cat([first, second]), ref_losses)
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))


# ---------------------------------------------------------------------------------------------------------------
# Loss scaling (issue 15, 2.2) cannot be fused: refused before any weight moves under float16 autocast, and at
# GradScaler.step; a disabled scaler (torch.cuda.amp's without CUDA) changes nothing.


@pytest.mark.parametrize("kind", ["fuse_optimizer", "reversible"])
def test_float16_autocast_backward_is_refused_before_any_weight_moves(kind):
    if kind == "reversible":
        model = _reversible(fused=OPTIMIZERS["sgd"])
    else:
        model = _plain()
        revlib.fuse_optimizer(model, OPTIMIZERS["sgd"])
    before = _weights(model)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(5, 2 * WIDTH)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (model(x).float() - x).square().mean()
    with pytest.raises(
        FusedOptimizerError,
        match="float16 autocast on cpu.*loss scaling cannot be fused.*bfloat16.*No weight was changed",
    ):
        scaler.scale(loss).backward()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bfloat16 needs no scaler, and trains fused
        loss = (model(x).float() - x).square().mean()
    loss.backward()
    assert not any(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def _grad_scaler(spelling, enabled=True):
    if spelling == "torch.amp":
        return torch.amp.GradScaler("cpu", enabled=enabled)
    with warnings.catch_warnings():  # deprecated spelling; it disables itself without CUDA and torch_xla
        warnings.simplefilter("ignore")
        return torch.cuda.amp.GradScaler(enabled=enabled)


@pytest.mark.parametrize("spelling", ["torch.amp", "torch.cuda.amp"])
def test_grad_scaler_step_on_a_fused_optimizer_is_refused(spelling):
    """float32 with a GradScaler: the backward cannot know that the loss was scaled, so the scaler's step is where
    it is refused (instead of torch's bare AssertionError), saying how many groups were stepped on scaled
    gradients."""
    scaler = _grad_scaler(spelling)
    if not scaler.is_enabled():
        pytest.skip(f"{spelling}.GradScaler disables itself on this machine (no CUDA, no torch_xla)")
    model = _plain()
    fused = revlib.fuse_optimizer(model, OPTIMIZERS["sgd"])
    x = torch.randn(5, 2 * WIDTH)
    scaler.scale((model(x) - x).square().mean()).backward()
    with pytest.raises(
        FusedOptimizerError,
        match=f"GradScaler.step.*cannot be fused.*stepped {2 * DEPTH} of "
        f"{2 * DEPTH} parameter groups on the scaled gradients",
    ):
        scaler.step(fused)
    scaler = _grad_scaler(spelling)
    scaler.scale((model(x) - x).square().mean()).backward()
    scaler.unscale_(fused)  # finds no gradient to unscale; the step after it is refused all the same
    with pytest.raises(FusedOptimizerError, match="GradScaler.step.*cannot be fused"):
        scaler.step(fused)


@pytest.mark.parametrize("spelling", ["torch.amp", "torch.cuda.amp"])
def test_a_disabled_grad_scaler_leaves_fused_training_unchanged(spelling):
    """``GradScaler(enabled=False)`` (the usual ``enabled=use_float16`` switch) scales nothing: the fused run equals
    the unfused one bit for bit."""
    scaler = _grad_scaler(spelling, enabled=False)
    factory = OPTIMIZERS["adamw"]
    unfused = _plain()
    _, ref_weights = _train(unfused, torch.device("cpu"), factory(unfused.parameters()), 2 * WIDTH)
    model = _plain()
    fused = revlib.fuse_optimizer(model, factory)
    for x in _batches(2 * WIDTH):
        scaler.scale((model(x) - x).abs().mean()).backward()
        scaler.step(fused)
        scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_weights))


# ---------------------------------------------------------------------------------------------------------------
# Gradient accumulation and clipping (issue 15, 2.3)


def test_gradient_accumulation_is_refused():
    model = _plain()
    fused = revlib.fuse_optimizer(model, OPTIMIZERS["sgd"])
    x = torch.randn(5, 2 * WIDTH)
    for _ in range(2):  # two micro-batches, then step(): the first step() finds each parameter stepped twice
        (model(x) - x).square().mean().backward()
    with pytest.raises(
        FusedOptimizerError,
        match=r"parameter '.*' is stepped 2 times between two step\(\) "
        r"calls.*gradient accumulation.*Call step\(\) after every backward",
    ):
        fused.step()
    (model(x) - x).square().mean().backward()
    fused.step()
    (model(x) - x).square().mean().backward()
    before = _weights(model)
    with pytest.raises(FusedOptimizerError, match="stepped 2 times.*this backward stops before stepping"):
        (model(x) - x).square().mean().backward()  # once step() is in the loop, refused before stepping again
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("kind", ["fuse_optimizer", "reversible"])
def test_clipping_after_a_fused_backward_is_refused_where_it_would_clip_nothing(kind):
    """clip_grad_norm_ reads .grad, which the fused step freed: torch would return 0 and clip nothing (the weights
    of such a run end far from one that clips); it raises, naming the parameter and what to do instead. Other
    parameters clip as with torch's own function."""
    x = torch.randn(5, 2 * WIDTH)
    if kind == "fuse_optimizer":
        model = _plain()
        revlib.fuse_optimizer(model, OPTIMIZERS["sgd"])
    else:
        model = _reversible(OPTIMIZERS["sgd"])
    (model(x) - x).square().mean().backward()
    for clip in (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_):
        with pytest.raises(
            FusedOptimizerError, match=r"clip_grad_norm_ on the parameters of a fused optimizer .*max_grad_norm"
        ):
            clip(model.parameters(), 1.0)
    other = _plain(seed=1)
    (other(x).sum() * 100).backward()
    grads = [p.grad.clone() for p in other.parameters()]
    norm = torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)
    assert torch.equal(norm, torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    assert all(torch.equal(p.grad, g * (1.0 / (norm + 1e-6)).clamp(max=1.0)) for p, g in zip(other.parameters(), grads))


@pytest.mark.parametrize("kind", ["fuse_optimizer", "reversible"])
def test_fused_per_group_clipping_equals_clipping_each_gradient_before_an_unfused_step(kind):
    """max_grad_norm: each group's gradients (a parameter's, or a reversible layer's) clipped by their own norm
    right before its step: bit for bit the unfused run that clips each group so before optimizer.step()."""
    max_norm = 0.05
    if kind == "fuse_optimizer":
        model, ref, width = _plain(), _plain(), 2 * WIDTH
        revlib.fuse_optimizer(model, OPTIMIZERS["adamw"], max_grad_norm=max_norm)
        groups = [[p] for p in ref.parameters()]
    else:
        model, ref, width = _reversible(OPTIMIZERS["adamw"]), _reversible(), 2 * WIDTH
        revlib.fused_optimizer_of(model).max_grad_norm = max_norm
        groups = [list(layer.parameters()) for layer in ref.children()]  # its fused groups: one per layer
    opts = [OPTIMIZERS["adamw"](g) for g in groups]
    clipped_any = False
    for x in _batches(width, steps=4):
        (model(x) - x).square().mean().mul(50).backward()
        (ref(x) - x).square().mean().mul(50).backward()
        for g, opt in zip(groups, opts):
            clipped_any |= float(torch.nn.utils.clip_grad.clip_grad_norm_(g, max_norm)) > max_norm  # torch's
            opt.step()
            opt.zero_grad()
    assert clipped_any  # the test clips something
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(FusedOptimizerError, match="max_grad_norm=inf"):
        revlib.fuse_optimizer(_plain(), OPTIMIZERS["sgd"], max_grad_norm=float("inf"))


# ---------------------------------------------------------------------------------------------------------------
# Converting, copying and pickling a fused model after its first step (issue 15, 3)


@pytest.mark.parametrize("kind", ["fuse_optimizer", "reversible"])
@pytest.mark.parametrize("conversion", ["double", "to_device"])
def test_converting_a_fused_model_after_adamw_steps(device, conversion, kind):
    """``.double()`` and ``.to(device)`` after two AdamW steps, then two more: torch's own optimizers fail on the
    first (state float32, parameters float64) and silently train nothing after the second across tensor types (cpu
    to xla makes new parameters). The fused optimizer casts its state as torch's load_state_dict does and follows
    new parameters, and equals torch's way: an optimizer on the converted parameters loaded from the old state."""
    if conversion == "double" and device.type != "cpu":
        pytest.skip("a dtype conversion is the same on every device; run on cpu")
    factory = OPTIMIZERS["adamw"]
    make = _reversible if kind == "reversible" else _plain
    dtype = torch.float64 if conversion == "double" else torch.float32
    batches = _batches(2 * WIDTH, 4)

    def convert_after_two_steps(model, optimizer):
        _train(model, torch.device("cpu"), optimizer, 2 * WIDTH, batches=batches[:2])
        model.to(device, dtype)  # new parameter tensors across tensor types (cpu to xla), the same ones otherwise

    unfused = make()
    ref_opt = factory(unfused.parameters())
    convert_after_two_steps(unfused, ref_opt)
    converted_opt = factory(unfused.parameters())
    converted_opt.load_state_dict(ref_opt.state_dict())
    ref_losses, ref_weights = _train(
        unfused, device, converted_opt, 2 * WIDTH, batches=[b.to(dtype) for b in batches[2:]]
    )
    model = make(fused=factory) if kind == "reversible" else make()
    fused = model.fused_optimizer if kind == "reversible" else revlib.fuse_optimizer(model, factory)
    convert_after_two_steps(model, fused)
    before = _weights(model)
    losses, weights = _train(model, device, fused, 2 * WIDTH, batches=[b.to(dtype) for b in batches[2:]])
    assert torch.equal(losses, ref_losses) and losses.dtype == dtype
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))
    assert not any(torch.equal(a, b) for a, b in zip(weights, to_host(before)))
    assert fused.steps_taken == 4 * len(fused.optimizers)
    assert {id(p) for p in fused.params} == {id(p) for p in model.parameters()}
    assert all(s["exp_avg"].device == device and s["exp_avg"].dtype == dtype for s in fused.state.values())


def _pickled(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("copier", [copy.deepcopy, _pickled], ids=["deepcopy", "torch_save"])
@pytest.mark.parametrize("kind", ["fuse_optimizer", "reversible"])
def test_a_copy_of_a_fused_model_trains_on_its_own(kind, copier):
    """A copy made after 3 steps (``copy.deepcopy``, or ``torch.save``/``torch.load`` of the model) is fused to a
    copy of the optimizer, state included: copy and original, each trained 3 more steps (the copy first), both equal
    an unfused run of 6 steps. The reversible sequence's factory must be picklable for torch.save (a partial)."""
    factory = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    batches = _batches(WIDTH, 6)
    unfused = _mixed() if kind == "fuse_optimizer" else _reversible()
    in_width = WIDTH if kind == "fuse_optimizer" else 2 * WIDTH
    batches = _batches(in_width, 6)
    ref_losses, ref_weights = _train(
        unfused, torch.device("cpu"), factory(unfused.parameters()), in_width, batches=batches
    )
    if kind == "fuse_optimizer":
        model = _mixed()
        fused = revlib.fuse_optimizer(model, factory)
    else:
        model = _reversible(fused=factory)
        fused = model.fused_optimizer
    assert revlib.fused_optimizer_of(model) is fused
    _train(model, torch.device("cpu"), fused, in_width, batches=batches[:3])
    clone = copier(model)
    clone_fused = revlib.fused_optimizer_of(clone)
    assert clone_fused is not fused and {id(p) for p in clone_fused.params} == {id(p) for p in clone.parameters()}
    before = _weights(model)
    clone_losses, clone_weights = _train(clone, torch.device("cpu"), clone_fused, in_width, batches=batches[3:])
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the original did not move
    losses, weights = _train(model, torch.device("cpu"), fused, in_width, batches=batches[3:])
    assert torch.equal(losses, ref_losses[3:]) and torch.equal(clone_losses, ref_losses[3:])
    assert all(torch.equal(a, b) and torch.equal(c, b) for a, c, b in zip(weights, clone_weights, ref_weights))


def test_fused_optimizer_state_dict_pickles():
    model = _plain()
    fused = revlib.fuse_optimizer(model, OPTIMIZERS["adamw"])
    _train(model, torch.device("cpu"), fused, 2 * WIDTH, batches=_batches(2 * WIDTH, 2))
    state = _pickled(fused.state_dict())
    other = revlib.fuse_optimizer(_plain(), OPTIMIZERS["adamw"])
    other.load_state_dict(state)
    assert all(torch.equal(a["exp_avg"], b["exp_avg"]) for a, b in zip(fused.state.values(), other.state.values()))


def test_fusing_a_model_twice_and_optimizer_only_methods_are_refused():
    model = _mixed()
    fused = revlib.fuse_optimizer(model, OPTIMIZERS["sgd"])
    with pytest.raises(FusedOptimizerError, match="parameter '0.weight' is already fused.*stepped twice.*remove"):
        revlib.fuse_optimizer(model, OPTIMIZERS["sgd"])
    with pytest.raises(FusedOptimizerError, match="parameter '0.0.wrapped_module.*already fused"):
        revlib.fuse_optimizer(model[1], OPTIMIZERS["sgd"])  # a part of an already fused model
    with pytest.raises(FusedOptimizerError, match="register_step_pre_hook.*each of fused.optimizers"):
        fused.register_step_pre_hook(lambda *args: None)
    with pytest.raises(FusedOptimizerError, match="fuse the model again"):
        fused.add_param_group({"params": [nn.Parameter(torch.ones(2))]})
    fused.remove()
    assert revlib.fused_optimizer_of(model) is None
    again = revlib.fuse_optimizer(model, OPTIMIZERS["sgd"])  # allowed once removed
    assert revlib.fused_optimizer_of(model) is again and model[1].fused_optimizer is again
