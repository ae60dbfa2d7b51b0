"""What a recomputed forward sees again, in the three engines that recompute (the reversible core,
``Checkpointable``, ``OffloadModel(checkpoint_activation=True)``): the forward's random numbers (by default the plain
model's, drawn from torch's global generators; with ``random_numbers("own")`` the engine's own, even while other
threads draw from torch's global generators), and the forward's buffers (blocks with their own state, such as
``spectral_norm``'s power iteration), so that gradients and buffers after the step are the plain model's.

References are plain autograd on a copy of the same modules (``memory_mode=no_savings`` for the reversible core),
given the masks the engine's forward drew (read back from the dropout layers' inputs and outputs).
"""

import copy
import random
import sys
import threading

import pytest
import torch
from conftest import max_rel_err
from torch import nn

import revlib_xla as revlib
from revlib_xla import backends, recompute

WIDTH = 8
STEPS = 60


# ---------------------------------------------------------------------------------------------------------------
# Engines under test, each with a plain reference built from the same modules


def _block(p=0.5):
    # Tanh is zero only at 0, so every dropout input is nonzero and out / in reveals the mask.
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Dropout(p), nn.Linear(WIDTH, WIDTH), nn.Tanh())


def _reversible(blocks):
    return revlib.ReversibleSequential(*blocks, split_dim=-1)


def _reversible_reference(model):
    reference = copy.deepcopy(model)
    reference.memory_mode = revlib.MemoryModes.no_savings
    return reference


def _checkpointable(blocks):
    model = revlib.Checkpointable(nn.Sequential(*[m for b in blocks for m in b]).double())
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    model.measure(x)
    model.compute_sequence(model.min_memory() * 1.02)  # the tightest plan: most stages are recomputed
    return model


def _offload(blocks):
    return revlib.OffloadModel(
        nn.Sequential(*[m for b in blocks for m in b]).double(), "cpu", num_slices=3, checkpoint_activation=True
    )


def _plain_copy(model):
    """The modules of an engine as one plain nn.Sequential (a copy, so its buffers and gradients are its own)."""
    if isinstance(model, revlib.ReversibleSequential):
        return _reversible_reference(model)
    if isinstance(model, revlib.Checkpointable):
        return copy.deepcopy(model.model)
    return nn.Sequential(*copy.deepcopy([m for s in model.model_slices for m in s]))


ENGINES = {
    "reversible": (_reversible, 2 * WIDTH),
    "checkpointable": (_checkpointable, WIDTH),
    "offload_model": (_offload, WIDTH),
}


class _Masks:
    """Records the mask of every dropout call (forward and recomputation) of a model, in call order per layer."""

    def __init__(self, model):
        self.layers = [m for m in model.modules() if isinstance(m, nn.Dropout)]
        self.calls = [[] for _ in self.layers]
        for layer, calls in zip(self.layers, self.calls):
            layer.register_forward_hook(
                lambda m, inputs, out, calls=calls: calls.append((out / inputs[0] * (1 - m.p)).round().bool())
            )

    def clear(self):
        for calls in self.calls:
            calls.clear()


class _FixedMask(nn.Module):
    def __init__(self, p, mask):
        super().__init__()
        self.p, self.mask = p, mask

    def forward(self, x):
        return x * self.mask / (1 - self.p)


def _with_masks(plain, masks):
    """``plain`` with each dropout layer replaced by the mask the engine's forward drew in it."""
    model = copy.deepcopy(plain)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Dropout)]
    assert len(names) == len(masks.calls)
    for name, calls in zip(names, masks.calls):
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, _FixedMask(model.get_submodule(name).p, calls[0]))
    return model


def _build(engine, seed):
    """A model of ``engine`` (built, and for Checkpointable measured and planned, before any thread starts)."""
    torch.manual_seed(seed)
    return ENGINES[engine][0]([_block().double() for _ in range(3)])


def _train(model, engine, seed, steps, failures):
    """Train ``model`` for ``steps`` steps; after each backward, check that every recomputation drew the forward's
    masks and that the gradients are plain autograd's with those masks."""
    try:
        _checked_steps(model, engine, seed, steps, failures)
    except Exception as exc:  # a thread's exception would otherwise only be a warning
        failures.append(f"{engine}: {type(exc).__name__}: {exc}")


def _checked_steps(model, engine, seed, steps, failures):
    in_width = ENGINES[engine][1]
    masks = _Masks(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x = torch.randn(4, in_width, generator=data, dtype=torch.float64)
        plain = _plain_copy(model)
        masks.clear()
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()
        for calls in masks.calls:
            if any(not torch.equal(c, calls[0]) for c in calls[1:]):
                failures.append(f"{engine} step {step}: a recomputation drew other masks than the forward")
                return
        reference = _with_masks(plain, masks)
        reference.zero_grad(set_to_none=True)
        reference(x).square().sum().backward()
        err = max(max_rel_err(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters()))
        if not err <= 1e-10:
            failures.append(f"{engine} step {step}: gradients {err:.3g} off plain autograd with the same masks")
            return
        opt.step()


@pytest.mark.parametrize("engine", list(ENGINES))
@recompute.drawing("own")
def test_threads_replay_their_own_random_numbers(engine):
    """With the engines' own random numbers: two threads train their own model while a third draws from torch's
    global generator: every recomputation draws its forward's numbers and every step's gradients are plain
    autograd's with the forward's masks (the engines reseeded or restored the process-global generator per layer,
    so another thread's draws changed the recomputation's masks)."""
    failures, stop = [], threading.Event()

    def noise():
        while not stop.is_set():
            torch.rand(64)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [
            threading.Thread(target=_train, args=(_build(engine, seed), engine, seed, STEPS, failures))
            for seed in (1, 2)
        ]
        drawer = threading.Thread(target=noise)
        drawer.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()
        drawer.join()
        sys.setswitchinterval(switch)
    assert not failures, failures


@pytest.mark.parametrize("mode", recompute.RANDOM_NUMBERS)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_single_thread_replays_masks(engine, mode):
    """The same check without threads, for both ways of drawing: the recomputation draws the forward's masks and
    the gradients match."""
    failures = []
    with recompute.drawing(mode):
        _train(_build(engine, 3), engine, 3, 3, failures)
    assert not failures, failures


@pytest.mark.parametrize("engine", list(ENGINES))
def test_by_default_a_step_draws_the_plain_models_random_numbers(engine):
    """The default: from the same generator state, a step of each engine draws the dropout masks the plain model
    draws (so its gradients equal the plain model's, with no mask given), and leaves torch's generator where the
    plain model leaves it, over several steps."""
    model = _build(engine, 0)
    plain = _plain_copy(model)
    x = torch.randn(4, ENGINES[engine][1], dtype=torch.float64)
    for step in range(3):
        states = []
        for m in (model, plain):
            torch.manual_seed(100 + step)
            m.zero_grad(set_to_none=True)
            m(x).square().sum().backward()
            states.append(torch.get_rng_state())
        assert torch.equal(states[0], states[1]), step
        for p, q in zip(model.parameters(), plain.parameters()):
            assert max_rel_err(p.grad, q.grad) <= 1e-12, step


# ---------------------------------------------------------------------------------------------------------------
# Blocks with their own state: buffers changed by the forward, own generators, Python's random


class Counter(nn.Module):
    """Scales by a count of its calls, kept in a buffer that its forward changes in place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x)) * self.calls


class Noisy(nn.Module):
    """Multiplicative noise drawn from a generator the block owns."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.gen = torch.Generator().manual_seed(5)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * (1 + torch.rand(x.shape, generator=self.gen, dtype=x.dtype))


STATEFUL = {
    "spectral_norm": lambda: nn.Sequential(
        nn.utils.spectral_norm(nn.Linear(WIDTH, WIDTH)), nn.Tanh(), nn.utils.spectral_norm(nn.Linear(WIDTH, WIDTH))
    ),
    "parametrized_spectral_norm": lambda: nn.Sequential(
        nn.utils.parametrizations.spectral_norm(nn.Linear(WIDTH, WIDTH)),
        nn.Tanh(),
        nn.utils.parametrizations.spectral_norm(nn.Linear(WIDTH, WIDTH)),
    ),
    "counter": lambda: nn.Sequential(Counter(), nn.Linear(WIDTH, WIDTH)),
    "own_generator": lambda: nn.Sequential(Noisy(), nn.Linear(WIDTH, WIDTH)),
}


def _stateful_pair(engine, kind):
    """The engine's model and a plain reference with equal parameters, buffers and generators."""
    built = []
    for _ in range(2):
        torch.manual_seed(0)
        built.append([STATEFUL[kind]().double() for _ in range(3)])
    x = torch.randn(4, ENGINES[engine][1], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    if engine == "reversible":
        model = revlib.ReversibleSequential(*built[0], split_dim=-1, verify_inverse=True)
        reference = revlib.ReversibleSequential(*built[1], split_dim=-1, memory_mode=revlib.MemoryModes.no_savings)
    elif engine == "checkpointable":
        model = revlib.Checkpointable(nn.Sequential(*built[0]))
        model.measure(x)  # measuring runs every stage several times: it must leave their state as it was
        model.compute_sequence(model.min_memory() * 1.02)
        reference = nn.Sequential(*built[1])
    else:
        model = revlib.OffloadModel(nn.Sequential(*built[0]), "cpu", num_slices=3, checkpoint_activation=True)
        reference = nn.Sequential(*built[1])
    return model, reference, x


def _generators(model):
    return [m.gen.get_state() for m in model.modules() if isinstance(m, Noisy)]


@pytest.mark.parametrize("kind", list(STATEFUL))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_blocks_with_state_give_plain_gradients_and_state(engine, kind):
    """Blocks whose forward changes their buffers (spectral norm's power iteration, a call counter) or draws from
    their own generator: the recomputation sees the forward's values, and after each step the gradients, the
    buffers and the generators are the plain model's (the recomputation advanced them a second time)."""
    model, reference, x = _stateful_pair(engine, kind)
    for step in range(2):
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
            m(x + step).square().sum().backward()
        for k, (p, r) in enumerate(zip(model.parameters(), reference.parameters())):
            assert max_rel_err(p.grad, r.grad) <= 1e-10, (step, k)
        buffers = list(model.buffers())
        assert len(buffers) == len(list(reference.buffers()))
        for b, r in zip(buffers, reference.buffers()):
            assert max_rel_err(b, r) <= 1e-12, step
        assert all(torch.equal(a, b) for a, b in zip(_generators(model), _generators(reference)))


class Coin(nn.Module):
    def forward(self, x):
        return x if random.random() < 2 else -x


@pytest.mark.parametrize("engine", list(ENGINES))
def test_python_random_in_a_block_is_reported(engine):
    """Python's ``random`` cannot be replayed: a block drawing from it is reported at the first training forward,
    naming the engine."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), Coin()).double() for _ in range(2)]
    model = ENGINES[engine][0](blocks) if engine != "checkpointable" else revlib.Checkpointable(nn.Sequential(*blocks))
    x = torch.randn(4, ENGINES[engine][1], dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match=r"Python's random"):
        model(x).sum().backward()


@pytest.mark.parametrize("engine", list(ENGINES))
@recompute.drawing("own")
def test_a_step_takes_one_seed_from_the_global_generator(engine):
    """With the engines' own random numbers, a training step draws one seed from torch's global generator and
    otherwise leaves it alone: its dropout masks come from generators of its own, and nothing is reseeded or
    restored."""
    model = _build(engine, 0)
    x = torch.randn(4, ENGINES[engine][1], dtype=torch.float64)
    torch.manual_seed(11)
    backends.draw_seed()
    expected = torch.get_rng_state()
    torch.manual_seed(11)
    model(x).square().sum().backward()
    assert torch.equal(torch.get_rng_state(), expected)


def test_without_the_dispatch_rule_replay_falls_back_to_reseeding(monkeypatch):
    """On a torch whose dispatcher internals are missing, scopes reseed the global generators (single-threaded
    replay still exact, as torch's own checkpointing does) and put them back at exit."""
    from revlib_xla import recompute

    monkeypatch.setattr(recompute, "_installed", [None, ()])
    failures = []
    _train(_build("reversible", 4), "reversible", 4, 3, failures)
    assert not failures, failures
    torch.manual_seed(5)
    state = torch.get_rng_state()
    with recompute.rng_scope("cpu") as reseed:
        reseed(1)
        first = torch.rand(4)
        reseed(1)
        assert torch.equal(torch.rand(4), first)
    assert torch.equal(torch.get_rng_state(), state)
