"""What a training step leaves allocated for the next one: the weights (and buffers), their gradients where the step
keeps them, and the optimizer state, nothing more, for every activation strategy, through the CLI's step function and
through ``revlib_xla.hf.memory_efficient``.

Counted with the CPU allocator's own events (``revlib_xla.memory.allocator_peak``'s ``retained``: every allocation and
free through PyTorch's allocator while the model is built and trained, so tensors that only C++ holds, an autograd
graph kept alive by a hook's reference cycle say, are counted too), against the bytes of the weights, buffers,
gradients and AdamW state, within 2 % of the weights' bytes. The planner measured its stages under PyTorch's
``MemTracker``, whose module hooks kept every measured input and graph alive: a whole forward's activations, for
good."""

import gc

import pytest
import torch
from conftest import require_transformers

from revlib_xla.memory import allocator_peak, tensor_bytes
from revlib_xla.train.config import load_config
from revlib_xla.train.strategy import build_model, build_optimizer, make_step

STEPS = 3
STRATEGIES = ("none", "checkpoint", "reversible", "momentum", "plan")


def _held_by(model, optimizer):
    """Bytes of what a model and its optimizer hold by design: weights, buffers, gradients, optimizer state."""
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    grads = [p.grad for p in params if p.grad is not None]
    return tensor_bytes(params + list(model.buffers()) + grads + state), tensor_bytes(params)


def _left_after(train):
    """(bytes left allocated by ``train()``, bytes its model and optimizer hold by design, weights' bytes)."""
    kept = {}
    gc.collect()  # earlier tests' garbage is freed before, not inside, the window counted

    def run():
        kept["model"], kept["optimizer"] = train()
        gc.collect()

    left = allocator_peak(run).retained
    held, weights = _held_by(kept["model"], kept["optimizer"])
    return left, held, weights


@pytest.mark.parametrize("strategy, precision", [(s, "fp32") for s in STRATEGIES] + [("plan", "bf16")], ids=str)
def test_cli_step_leaves_weights_gradients_and_optimizer_state_only(strategy, precision):
    cfg = load_config(
        None,
        [
            "model.overrides={vocab_size: 256, dim: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, ffn_dim: 64}",
            "data.seq_len=32",
            "data.batch_size=4",
            f"strategy.activations={strategy}",
            f"strategy.precision={precision}",
            "train.device=cpu",
        ],
    )
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (4, 32), generator=g) for _ in range(STEPS)]

    def train():
        model = build_model(cfg, "cpu")
        optimizer = build_optimizer(cfg, model)
        step = make_step(cfg, model, optimizer)
        for batch in batches:
            step(batch)
        return model, optimizer

    left, held, weights = _left_after(train)
    assert abs(left - held) <= 0.02 * weights, (
        f"{strategy}: {left - held} bytes left allocated beyond weights, gradients and optimizer state "
        f"({(left - held) / weights:.2f}x the weights' bytes)"
    )


@pytest.mark.parametrize("strategy", ["none", "plan", "reversible", "momentum"])
def test_hf_training_leaves_weights_gradients_and_optimizer_state_only(strategy):
    require_transformers()
    from revlib_xla.hf import memory_efficient, model_from_config

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (4, 64), generator=g) for _ in range(STEPS)]

    def train():
        torch.manual_seed(0)
        model = model_from_config("llama-tiny")
        model.config.use_cache = False
        if strategy != "none":
            memory_efficient(model, strategy)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for batch in batches:
            model(input_ids=batch, labels=batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return model, optimizer

    left, held, weights = _left_after(train)
    assert abs(left - held) <= 0.02 * weights, (
        f"{strategy}: {left - held} bytes left allocated beyond weights, gradients and optimizer state "
        f"({(left - held) / weights:.2f}x the weights' bytes)"
    )
