"""Two threads training two reversible models at once: the rebuild check's and the recompute engine's state is per
thread (``threading.local``), so each thread's gradients are those of the same steps run one after the other
(float64; the CPU's autograd engine runs a backward on the thread that calls it). No dropout: both threads would
draw from torch's one global generator in an order the scheduler picks, so no sequential run has their masks."""

import threading

import torch
from torch import nn

from revlib_xla import ReversibleSequential

STEPS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def _train(seed: int, out: list, together: threading.Barrier | None = None) -> None:
    """STEPS steps of SGD on one model, recording each step's gradients; weights and data from a generator of its
    own (the global one is shared by the threads). ``together``: both threads run each forward, then each backward,
    at the same time (each forward leaves the rebuild check's first verdict and the engine's state pending while
    the other thread runs)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [Block() for _ in range(3)]
    with torch.no_grad():
        for p in (p for b in blocks for p in b.parameters()):
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    model = ReversibleSequential(*blocks, split_dim=-1).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        x = torch.randn(16, 8, dtype=torch.float64, generator=g)
        if together is not None:
            together.wait()
        loss = model(x).square().mean()
        if together is not None:
            together.wait()
        loss.backward()
        out.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()


def test_two_threads_train_as_one_after_the_other():
    sequential: dict[int, list] = {0: [], 1: []}
    for seed in (0, 1):
        _train(seed, sequential[seed])
    concurrent: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []
    together = threading.Barrier(2, timeout=60)

    def run(seed: int) -> None:
        try:
            _train(seed, concurrent[seed], together)
        except BaseException as exc:  # reported below: a thread's exception is otherwise only printed
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for seed in (0, 1):
        assert len(concurrent[seed]) == STEPS
        for got_step, want_step in zip(concurrent[seed], sequential[seed]):
            for got, want in zip(got_step, want_step):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
