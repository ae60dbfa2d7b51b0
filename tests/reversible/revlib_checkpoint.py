"""A checkpoint saved by the real RevLib 1.7.2 (``tests/reversible/data/revlib_1_7_2_checkpoint.pt``): the model's
blocks, and the script that wrote it with what RevLib computes from it (output, input gradient, parameter
gradients), for ``tests/reversible/test_revlib_compat.py``.

Running it needs RevLib, which the project never installs; to regenerate::

    uv venv /tmp/revlib-env && uv pip install -p /tmp/revlib-env/bin/python --no-deps revlib==1.7.2
    PYTHONPATH=/tmp/revlib-env/lib/python3.11/site-packages .venv/bin/python tests/reversible/revlib_checkpoint.py
"""

from pathlib import Path

import torch
from torch import nn

PATH = Path(__file__).resolve().parent / "data" / "revlib_1_7_2_checkpoint.pt"


def blocks() -> list[nn.Module]:
    """What the test rebuilds: two RevNet blocks (four reversible layers) of small MLPs and convolutions."""
    return [
        nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Tanh()),
        nn.Sequential(nn.Conv2d(3, 5, 1), nn.GELU(), nn.Conv2d(5, 3, 1)),
        nn.Sequential(nn.GroupNorm(1, 3), nn.Conv2d(3, 3, 3, padding=1)),
        nn.Sequential(nn.Conv2d(3, 3, 1), nn.Sigmoid()),
    ]


def main() -> None:
    import revlib

    assert "revlib_xla" not in str(revlib.__file__), revlib.__file__
    torch.manual_seed(0)
    model = revlib.ReversibleSequential(*blocks()).double()
    # one SGD step, so the saved weights are not the initialization
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # (RevLib computes no parameter gradient for an input that does not require grad)
    model(torch.randn(2, 6, 5, 5, dtype=torch.float64, requires_grad=True)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

    x = torch.randn(2, 6, 5, 5, dtype=torch.float64, requires_grad=True)
    out = model(x)
    out.square().mean().backward()
    torch.save(
        {
            "revlib_version": "1.7.2",
            "state_dict": model.state_dict(),
            "input": x.detach(),
            "output": out.detach(),
            "input_grad": x.grad,
            "param_grads": {n: p.grad for n, p in model.named_parameters()},
        },
        PATH,
    )


if __name__ == "__main__":
    main()
