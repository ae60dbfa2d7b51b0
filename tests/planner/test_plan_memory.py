"""``plan``'s memory as measured: a step's peak (the host allocator's own events, ``memory.allocator_peak``) above the
weights and their gradients stays within the planner's budget, and with the fastest schedule (budget auto) it is
never above the plain model's. Through the CLI's model (``strategy=plan``) and ``revlib_xla.hf``; the tiny models
here, and at Llama-3.2-1B's width (hidden 2048, vocabulary 128256) in the slow tests."""

from __future__ import annotations

import pytest
import torch
from conftest import require_transformers

from revlib_xla.memory import allocator_peak
from revlib_xla.train.config import load_config
from revlib_xla.train.strategy import build_model

TINY = "model.overrides={vocab_size: 256, dim: 64, n_layers: 4, n_heads: 4, n_kv_heads: 2, ffn_dim: 256}"


def _cli_model(model_args, strategy, tokens, precision="fp32", budget="auto"):
    cfg = load_config(
        None,
        [
            *model_args,
            f"data.seq_len={tokens.shape[1]}",
            f"data.batch_size={tokens.shape[0]}",
            f"strategy.activations={strategy}",
            f"strategy.budget={budget}",
            f"strategy.precision={precision}",
            "chip.name=h100",
        ],
    )
    return build_model(cfg, "cpu")


def _cli_step(model, tokens, precision):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = model.loss(tokens)
    loss.backward()


def _rise(step, model, *args):
    """How far the allocator rose above the step's start, the gradients existing (as after the first step)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return allocator_peak(step, model, *args).increase


def _cli_peaks(model_args, tokens, precision, fractions):
    """The plain model's rise, then the plan's with budget auto, then at each fraction of the way from the smallest
    budget (+2 %) to the no-recomputation one: (budget, rise) pairs."""
    plain = _cli_model(model_args, "none", tokens, precision)
    plain_rise = _rise(_cli_step, plain, tokens, precision)
    del plain
    planned = _cli_model(model_args, "plan", tokens, precision)
    checkpointable = planned.planned
    auto = _rise(_cli_step, planned, tokens, precision)
    low, high = checkpointable.min_memory() * 1.02, checkpointable.no_checkpoint_memory()
    found = []
    for fraction in fractions:
        budget = low + fraction * (high - low)
        checkpointable.compute_sequence(budget)
        found.append((budget, _rise(_cli_step, planned, tokens, precision)))
    return plain_rise, auto, found


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cli_plan_keeps_its_budget_and_auto_is_never_above_plain(precision):
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    plain, auto, found = _cli_peaks([TINY], tokens, precision, (0.0, 0.5))
    assert auto <= plain, (auto, plain)
    for budget, rise in found:
        assert rise <= budget, (budget, rise)


def test_hf_plan_keeps_its_budget_and_auto_is_never_above_plain():
    require_transformers()
    from revlib_xla.hf import chunked_loss, memory_efficient, model_from_config

    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))

    def make():
        torch.manual_seed(0)
        model = model_from_config("llama-tiny")
        model.config.use_cache = False
        return model.train()

    def step(model):
        model(input_ids=tokens, labels=tokens).loss.backward()

    plain_rise = _rise(step, make())
    same_loss = make()
    chunked_loss(same_loss)  # as memory_efficient applies it
    same_loss_rise = _rise(step, same_loss)
    planned = memory_efficient(make(), "plan")
    auto = _rise(step, planned)
    # never above the plain model; with the same loss, above it by the executor's bookkeeping at most (a few
    # scalars: 512 bytes here)
    assert auto <= plain_rise and auto <= same_loss_rise + 4096, (auto, plain_rise, same_loss_rise)
    checkpointable = planned.revlib_xla_conversion.runner.checkpointable
    low, high = checkpointable.min_memory() * 1.02, checkpointable.no_checkpoint_memory()
    for budget in (low, (low + high) / 2):
        checkpointable.compute_sequence(budget)
        assert _rise(step, planned) <= budget


# ---------------------------------------------------------------------------------------------------------------
# Real width (Llama-3.2-1B: hidden 2048, 32 heads, 8 kv heads, MLP 8192, vocabulary 128256; 4 layers), in bfloat16.
# The steps run on fake tensors (revlib_xla.fit.gpu: nothing allocated; bfloat16 matrix products on this 2-core CPU
# run at 0.2 GFLOP/s) and their storages are counted as on real ones (the same counts: tests/fit/test_fit_gpu.py).


def _fake_rise(mode, step, model, tokens):
    from revlib_xla.memory import StorageTracker

    with mode:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        tracker = StorageTracker()
        tracker.track(model, tokens)
        with tracker:
            start = tracker.current()
            step(model)
            return tracker.peak() - start


def _fake_tokens(batch, seq):
    """A fake-tensor mode and a batch of ``batch`` x ``seq`` token ids in it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        tokens = torch.zeros(batch, seq, dtype=torch.int64)
    return mode, tokens


def _fake_cli_model(mode, tokens, strategy, precision):
    """The native llama-1b (4 of its 16 layers) as ``revlib-xla train`` builds it, on ``mode``'s fake host."""
    from revlib_xla.fit.gpu import _on_fake_host

    batch, seq = tokens.shape
    cfg = load_config(
        None,
        [
            "model.name=llama-1b",
            "model.overrides={n_layers: 4}",
            f"data.seq_len={seq}",
            f"data.batch_size={batch}",
            f"strategy.activations={strategy}",
            f"strategy.precision={precision}",
            "chip.name=h100",
        ],
    )
    model = build_model(cfg, "meta")
    _on_fake_host(model, mode)
    return model


def _fake_cli_step(tokens, precision):
    def step(model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            model.loss(tokens).backward()

    return step


def _fake_hf_model(mode, dtype, layers=4):
    """transformers Llama with Llama-3.2-1B's shape (``layers`` layers), on ``mode``'s fake host, training."""
    from revlib_xla.fit.gpu import _on_fake_host
    from revlib_xla.hf import model_from_config

    model = model_from_config("llama-3.2-1b", num_hidden_layers=layers, device="meta", dtype=dtype)
    model.config.use_cache = False
    _on_fake_host(model, mode)
    return model.train()


def _fake_hf_step(mode, tokens):
    def step(model):
        with mode:
            model(input_ids=tokens, labels=tokens).loss.backward()

    return step


def _transformers_checkpointing(model):
    """``model`` with transformers' own (non-reentrant) checkpointing and the chunked loss, as the plan has it."""
    from revlib_xla.hf import chunked_loss

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    chunked_loss(model)
    return model


def _assert_budgets_kept(mode, step, model, checkpointable, tokens, budgets):
    for budget in budgets:
        checkpointable.compute_sequence(budget)
        assert _fake_rise(mode, step, model, tokens) <= budget


def _from_smallest_to_no_recomputation(checkpointable, margin):
    low, high = checkpointable.min_memory() * margin, checkpointable.no_checkpoint_memory()
    return low, (low, (low + high) / 2, high)


def test_cli_plan_keeps_its_budget_at_llama_1b_width():
    """The native llama-1b (4 of its 16 layers), 1 x 2048 tokens, bf16 autocast: the measured peak within each
    budget from the smallest to the no-recomputation one, and budget auto at the plain model's peak. Before: the
    loss's transient was taken as 0 and the stages measured in float32, and plans peaked 3-15 % above their
    budgets (42 % at 4 x 1024)."""
    mode, tokens = _fake_tokens(1, 2048)
    step = _fake_cli_step(tokens, "bf16")
    plain = _fake_rise(mode, step, _fake_cli_model(mode, tokens, "none", "bf16"), tokens)
    planned = _fake_cli_model(mode, tokens, "plan", "bf16")
    with mode:
        step(planned)  # measured and planned at the first step (budget auto: an H100 less the state)
    assert _fake_rise(mode, step, planned, tokens) <= plain
    _, budgets = _from_smallest_to_no_recomputation(planned.planned, 1.02)
    _assert_budgets_kept(mode, step, planned, planned.planned, tokens, budgets)


@pytest.mark.slow
def test_hf_plan_keeps_its_budget_at_llama_3_2_1b_width():
    """transformers Llama with Llama-3.2-1B's shape (4 layers), bfloat16 weights, 1 x 2048 tokens: asked for
    transformers' checkpointing's activation bytes, and at the smallest budget, the plan stays within them; budget
    auto stays at the plain model's peak or below. Before: +18 % and +23 % (the tied head's weight gradient, which
    autograd holds until the input embedding's backward, 0.5 GiB, was not counted)."""
    require_transformers()
    from revlib_xla.hf import memory_efficient

    mode, tokens = _fake_tokens(1, 2048)
    step = _fake_hf_step(mode, tokens)
    plain = _fake_rise(mode, step, _fake_hf_model(mode, torch.bfloat16), tokens)
    theirs = _fake_rise(mode, step, _transformers_checkpointing(_fake_hf_model(mode, torch.bfloat16)), tokens)
    planned = memory_efficient(_fake_hf_model(mode, torch.bfloat16), "plan")
    step(planned)
    assert _fake_rise(mode, step, planned, tokens) <= plain
    checkpointable = planned.revlib_xla_conversion.runner.checkpointable
    _assert_budgets_kept(mode, step, planned, checkpointable, tokens, (theirs, checkpointable.min_memory() * 1.02))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "batch", "seq"),
    [(torch.bfloat16, 1, 512), (torch.bfloat16, 1, 1024), (torch.float32, 1, 1024), (torch.bfloat16, 4, 512)],
    ids=["bf16-1x512", "bf16-1x1024", "fp32-1x1024", "bf16-4x512"],
)
def test_hf_plan_keeps_its_budget_at_llama_3_2_1b_width_for_short_batches(dtype, batch, seq):
    """transformers Llama with Llama-3.2-1B's shape (4 layers, the real vocabulary), on fake tensors, at batches
    shorter than 2048 tokens: the measured peak within each budget from the smallest to the no-recomputation one,
    and budget auto never above the plain model. Before: at 1 x 512 in bfloat16 the plan at its smallest budget
    peaked 15 % above it (the chunked loss's backward scaled the float32 sum of the head's gradient into a second
    float32 tensor before casting it: 10 bytes per head weight where the planner counted 6), and at 1 x 1024 budget
    auto peaked 12 % (bfloat16) and 15 % (float32) above plain (the chunked loss, whose float32 sum of the head's
    gradient holds more than transformers' loss at these lengths, and each stage's input kept by the executor
    where nothing is recomputed)."""
    require_transformers()
    from revlib_xla.hf import memory_efficient

    mode, tokens = _fake_tokens(batch, seq)
    step = _fake_hf_step(mode, tokens)
    plain = _fake_rise(mode, step, _fake_hf_model(mode, dtype), tokens)
    planned = memory_efficient(_fake_hf_model(mode, dtype), "plan")
    assert _fake_rise(mode, step, planned, tokens) <= plain
    checkpointable = planned.revlib_xla_conversion.runner.checkpointable
    _, budgets = _from_smallest_to_no_recomputation(checkpointable, 1.01)
    _assert_budgets_kept(mode, step, planned, checkpointable, tokens, budgets)


@pytest.mark.slow
def test_hf_plan_runs_transformers_flops_near_their_bytes_and_fewer_above():
    """transformers Llama with Llama-3.2-1B's shape (4 layers), bfloat16, 1 x 2048 tokens, on fake tensors, FLOPs
    counted (FlopCounterMode): at 5 % above transformers' checkpointing's activation bytes the plan runs exactly
    its FLOPs (every layer checkpointed, each recomputation stopped at the last tensor its backward reads, as
    torch's non-reentrant checkpoint stops), within that budget; at 25 % above, fewer. Before: the executor ran its
    recomputations whole on fake tensors (+4 %), and priced stages by the time of dispatching fake operations."""
    require_transformers()
    from torch.utils.flop_counter import FlopCounterMode

    from revlib_xla.hf import memory_efficient

    mode, tokens = _fake_tokens(1, 2048)
    step = _fake_hf_step(mode, tokens)

    def flops(model):
        with FlopCounterMode(display=False) as counter:
            step(model)
        return counter.get_total_flops()

    theirs_model = _transformers_checkpointing(_fake_hf_model(mode, torch.bfloat16))
    theirs, theirs_flops = _fake_rise(mode, step, theirs_model, tokens), flops(theirs_model)
    planned = memory_efficient(_fake_hf_model(mode, torch.bfloat16), "plan")
    step(planned)
    checkpointable = planned.revlib_xla_conversion.runner.checkpointable
    checkpointable.compute_sequence(1.05 * theirs)
    assert _fake_rise(mode, step, planned, tokens) <= 1.05 * theirs
    assert flops(planned) == theirs_flops
    checkpointable.compute_sequence(1.25 * theirs)
    assert _fake_rise(mode, step, planned, tokens) <= 1.25 * theirs
    assert flops(planned) < theirs_flops


@pytest.mark.slow
@pytest.mark.parametrize(
    ("precision", "batch", "seq"),
    [("bf16", 1, 512), ("fp32", 1, 512), ("fp32", 4, 512), ("fp32", 2, 2048)],
    ids=["bf16-1x512", "fp32-1x512", "fp32-4x512", "fp32-2x2048"],
)
def test_cli_plan_keeps_its_budget_and_goes_below_plain_at_llama_1b_width(precision, batch, seq):
    """The native llama-1b (4 of its 16 layers, its tied 128256-token embedding), on fake tensors: the measured peak
    within each budget from the smallest to the no-recomputation one, budget auto never above the plain model, and
    the smallest budget below the plain model's peak. Before: the loss stage counted the logits' gradient that the
    chain counts, and the plan held the logits and their gradient besides (a caller's output, which the LM's own
    loss does not keep), so the smallest budget was 20-29 % above the plain model's peak at 4 x 512 and 2 x 2048 in
    float32; and a schedule that recomputes nothing, run as autograd's plain run, held the tied head's gradient
    through the backward (above its budget by 0.8 GiB at 1 x 512)."""
    mode, tokens = _fake_tokens(batch, seq)
    step = _fake_cli_step(tokens, precision)
    plain = _fake_rise(mode, step, _fake_cli_model(mode, tokens, "none", precision), tokens)
    planned = _fake_cli_model(mode, tokens, "plan", precision)
    with mode:
        step(planned)
    assert _fake_rise(mode, step, planned, tokens) <= plain
    low, budgets = _from_smallest_to_no_recomputation(planned.planned, 1.01)
    assert low < plain
    _assert_budgets_kept(mode, step, planned, planned.planned, tokens, budgets)
