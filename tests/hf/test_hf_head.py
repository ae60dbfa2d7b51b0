"""revlib_xla.hf's chunked causal-LM loss (revlib_xla.hf.head): the same loss and gradients as transformers'
ForCausalLMLoss on tiny models built from configs (float64, several chunks), with its keywords (ignore_index,
num_items_in_batch, shift_labels), gradients through the returned logits, autograd.grad, a frozen head, bfloat16
autocast with a gradient scaler; transformers' loss wherever the chunked one does not apply; a clear error for a
second derivative; and the bytes it saves, measured. Also: under autocast, every strategy's first training step
(which measures or checks the layers) gives the gradients of the next."""

import copy

import pytest
import torch
from conftest import max_rel_err, require_transformers

from revlib_xla import memory

transformers = require_transformers()

from revlib_xla.hf import HFConversionError, memory_efficient, model_from_config  # noqa: E402
from revlib_xla.hf import head as hf_head  # noqa: E402

DECODERS = ["gpt2-tiny", "llama-tiny", "qwen2-tiny", "qwen3-tiny", "mistral-tiny", "gpt-neox-tiny"]
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
IDS = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))  # 60 tokens: 4 chunks of 16


def tiny(name, dtype=torch.float64, **overrides):
    torch.manual_seed(0)
    fields = dict(NO_DROPOUT) if name == "gpt2-tiny" else {}
    fields.update(overrides)
    return model_from_config(name, num_hidden_layers=2, dtype=dtype, **fields).train()


def converted(ref, chunked=True):
    """ref's copy with the chunked loss (or transformers'), the layers run as they are (the fastest plan)."""
    model = memory_efficient(copy.deepcopy(ref), "plan", chunked_loss="always" if chunked else False)
    assert (model.revlib_xla_conversion.loss is not None) == chunked
    return model


def step(model, backward=lambda out: out.loss.backward(), **kw):
    model.zero_grad(set_to_none=True)
    out = model(IDS, use_cache=False, **{"labels": IDS, **kw})
    backward(out)
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads(got, want, tol):
    assert got.keys() == want.keys() and len(want) > 10
    for name in want:
        assert max_rel_err(got[name], want[name]) <= tol, name


def test_chunks_cover_the_tokens():
    assert hf_head.rows_per_chunk(60, 64, 256) == 16
    assert hf_head.rows_per_chunk(4096, 64, 256) == 512  # half the head input's bytes
    assert hf_head.rows_per_chunk(4096, 4096, 128256) == 65
    assert hf_head.rows_per_chunk(5, 64, 256) == 5


@pytest.mark.parametrize("name", DECODERS)
def test_the_chunked_loss_equals_transformers_loss_in_float64(name):
    """Several chunks; the head input's gradient is computed per row as transformers computes it, the weight's sums
    the chunks: every gradient agrees to float64 rounding. The loss is float32 in both (transformers upcasts), its
    chunks summed in another order."""
    ref = tiny(name)
    model = converted(ref)
    assert hf_head.rows_per_chunk(IDS.numel(), ref.config.hidden_size, 256) < IDS.numel()
    out, got = step(model)
    ref_out, want = step(ref)
    assert type(out.loss.grad_fn).__name__ == "_ChunkedCrossEntropyBackward"
    assert out.loss.dtype == ref_out.loss.dtype == torch.float32
    assert abs(out.loss.item() - ref_out.loss.item()) <= 1e-6 * ref_out.loss.item()
    assert max_rel_err(out.logits, ref_out.logits) <= 1e-12
    assert_grads(got, want, 1e-10)


@pytest.mark.parametrize(
    "keywords",
    [
        {"labels": torch.where(IDS % 3 == 0, -100, IDS)},
        {"num_items_in_batch": torch.tensor(37)},
        {"num_items_in_batch": 41},
        {"labels": None, "shift_labels": torch.roll(IDS, -1, dims=1)},
    ],
    ids=["ignore_index", "num_items_tensor", "num_items_int", "shift_labels"],
)
def test_transformers_loss_keywords_are_honoured(keywords):
    """Ignored tokens, the Trainer's num_items_in_batch (tensor or int) and pre-shifted labels."""
    ref = tiny("llama-tiny")
    model = converted(ref)
    if "shift_labels" in keywords:
        keywords = {**keywords, "labels": IDS}  # transformers computes the loss when labels is given
    out, got = step(model, **keywords)
    ref_out, want = step(ref, **keywords)
    assert abs(out.loss.item() - ref_out.loss.item()) <= 1e-6 * ref_out.loss.item()
    assert_grads(got, want, 1e-10)


def test_gradients_through_the_returned_logits_add_to_the_losss():
    ref = tiny("gpt2-tiny")  # its head shares the token embedding's weight

    def both(out):
        (out.loss + out.logits.square().mean()).backward()

    _, got = step(converted(ref), both)
    _, want = step(ref, both)
    assert_grads(got, want, 1e-10)


def test_autograd_grad_and_a_frozen_head():
    ref = tiny("llama-tiny")
    model = converted(ref)
    for m in (model, ref):
        m.lm_head.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    got = torch.autograd.grad(model(IDS, labels=IDS, use_cache=False).loss, params)
    want = torch.autograd.grad(ref(IDS, labels=IDS, use_cache=False).loss, ref_params)
    for g, w in zip(got, want, strict=True):
        assert max_rel_err(g, w) <= 1e-10


def test_a_second_derivative_is_refused_with_what_to_do():
    model = converted(tiny("llama-tiny"))
    loss = model(IDS, labels=IDS, use_cache=False).loss
    with pytest.raises(HFConversionError, match="chunked_loss=False"):
        torch.autograd.grad(loss, [model.lm_head.weight], create_graph=True)


def test_logits_changed_after_the_head_use_transformers_loss():
    """A forward hook that changes the logits (soft-capping, say): the chunked loss sees other logits than the
    head's output and runs transformers' loss, so the hook's change counts."""
    ref = tiny("llama-tiny")
    model = converted(ref)
    calls = []
    original = model.revlib_xla_conversion.loss.original

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    model.revlib_xla_conversion.loss.original = spy
    for m in (model, ref):
        m.lm_head.register_forward_hook(lambda mod, args, out: 30 * torch.tanh(out / 30))
    _, got = step(model)
    _, want = step(ref)
    assert calls == [1]
    assert_grads(got, want, 1e-10)
    calls.clear()
    with torch.no_grad():  # nothing needs a gradient: transformers' loss too
        model(IDS, labels=IDS, use_cache=False)
    assert calls == [1]


def test_float16_logits_use_transformers_loss():
    """A gradient scaler's scale must reach the float32 gradient before it is rounded to float16."""
    model = converted(tiny("llama-tiny", dtype=torch.float32))
    loss, vocab = model.revlib_xla_conversion.loss, model.config.vocab_size
    hidden = torch.randn(1, 4, model.config.hidden_size, requires_grad=True)
    assert loss._fused_input(model.lm_head(hidden), vocab) is hidden
    model.lm_head.half()
    assert loss._fused_input(model.lm_head(hidden.half()), vocab) is None


def test_under_bfloat16_autocast_with_a_grad_scaler():
    """The chunks' gradients are computed as transformers' backward computes them, outside the autocast region: the
    head input's gradient is the same per row, so every gradient below the head agrees to float32 rounding; the
    head's weight gradient sums bfloat16 chunk products in float32 (transformers: one bfloat16 product)."""
    ref = tiny("llama-tiny", dtype=torch.float32)
    model = converted(ref)
    grads = []
    for m in (model, ref):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(IDS, labels=IDS, use_cache=False).loss
        scaler.scale(loss).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    got, want = grads
    (head,) = [n for n, p in model.named_parameters() if p is model.lm_head.weight]
    assert max_rel_err(got[head], want[head]) <= 2**-7
    assert_grads({k: v for k, v in got.items() if k != head}, {k: v for k, v in want.items() if k != head}, 1e-5)


def test_the_loss_keeps_nothing_of_the_vocabularys_size_for_the_backward():
    """A 4096-token vocabulary at hidden 32. What the loss saves for the backward (counted by saved-tensor hooks):
    transformers' the float32 log-probabilities; the chunked one the gradients of the head's input and weight,
    nothing else. And the step's peak (MemTracker's eager peak, exact) drops by more than one float32 tensor of the
    logits' size: transformers' backward holds three at once (log-probabilities, their gradient, the logits'
    gradient), the chunked loss the logits and one chunk."""
    ref = tiny("llama-tiny", dtype=torch.float32, vocab_size=4096, hidden_size=32, intermediate_size=64)
    ids = torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(1))
    tokens, vocab, hidden = ids.numel(), 4096, 32

    def train_step(m):
        m(ids, labels=ids, use_cache=False).loss.backward()

    peaks, saved = {}, {}
    for chunked in (False, True):
        model = converted(ref, chunked)
        train_step(model)  # measures and plans
        model.zero_grad(set_to_none=True)
        peaks[chunked] = memory.eager_peak(train_step, model).total
        h = torch.randn(4, 64, hidden, requires_grad=True)
        logits = model.lm_head(h)
        saved[chunked] = memory.saved_bytes(
            model.loss_function, logits, ids, vocab, exclude=[h, logits, *model.parameters()]
        )
    assert saved[False] >= tokens * vocab * 4
    assert saved[True] == 4 * (tokens + vocab) * hidden
    assert peaks[False] - peaks[True] >= tokens * vocab * 4, peaks


def test_at_a_real_vocabulary_the_head_no_longer_dominates_the_peak():
    """Llama-3.2-1B's shapes (vocabulary 128256, hidden 2048; two of its layers), bfloat16, one 4096-token sequence,
    under transformers' own gradient checkpointing, sized on fake tensors (MemTracker under FakeTensorMode: nothing
    is allocated): transformers' loss peaks at 6.70 GiB, the chunked loss at 3.31 GiB. The saving is at least the
    float32 log-probabilities and the logits' float32 gradient (2 x 1.96 GiB) less what the chunked loss holds
    instead: its float32 sum of the weight's gradient and one chunk's bfloat16 product (1.47 GiB)."""
    tokens, vocab, hidden = 4096, 128256, 2048

    def build(chunked):
        def make():
            model = model_from_config("llama-3.2-1b", num_hidden_layers=2, dtype=torch.bfloat16).train()
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
            if chunked:
                assert hf_head.chunked_loss(model) is not None
            return model

        return make

    def train_step(m, ids):
        m(ids, labels=ids, use_cache=False).loss.backward()

    def ids():
        return torch.randint(0, vocab, (1, tokens))

    peaks = {c: memory.eager_peak(train_step, build(c), ids, fake=True).total for c in (False, True)}
    assert peaks[False] - peaks[True] >= 2 * tokens * vocab * 4 - vocab * hidden * 6, peaks


def test_at_a_real_vocabulary_the_loss_that_holds_less_runs():
    """Llama-3.2-1B's shapes (one layer, the real vocabulary), bfloat16, on fake tensors. The chunked loss holds the
    float32 sum of the head weight's gradient (1 GiB), transformers' loss float32 tensors of the logits' size: at
    512 tokens transformers' holds less, and runs (the step's peak is transformers'); at 2048 the chunked one does.
    Before, the chunked loss ran at every length and a 1 x 512 step peaked 14 % above transformers' loss."""
    vocab = 128256

    def build(chunked):
        def make():
            model = model_from_config("llama-3.2-1b", num_hidden_layers=1, dtype=torch.bfloat16).train()
            if chunked:
                assert hf_head.chunked_loss(model, always=chunked == "always") is not None
            return model

        return make

    def train_step(m, ids):
        m(ids, labels=ids, use_cache=False).loss.backward()

    for tokens, chosen in ((512, False), (2048, "always")):

        def ids(tokens=tokens):
            return torch.randint(0, vocab, (1, tokens))

        peaks = {c: memory.eager_peak(train_step, build(c), ids, fake=True).total for c in (False, True, "always")}
        assert peaks[True] == peaks[chosen], (tokens, peaks)
        assert peaks[True] < max(peaks[False], peaks["always"]), (tokens, peaks)
    assert not hf_head.chunking_pays(512, 2048, vocab, 2) and hf_head.chunking_pays(2048, 2048, vocab, 2)


def test_the_weight_gradient_is_scaled_and_rounded_once_in_blocks():
    """The loss's backward scales the float32 sum of the head's gradient a block of rows at a time (no second
    float32 tensor of the head's size): the same bits as scaling the whole sum and casting it."""
    from revlib_xla.losses import _scaled_into

    summed = torch.randn(37, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float32) * 3
    scale = torch.tensor(0.37)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(_scaled_into(summed, scale, dtype), (summed * scale).to(dtype))


@pytest.mark.parametrize("strategy", ["plan", "reversible", "momentum"])
@pytest.mark.parametrize("backward_in_region", [False, True], ids=["backward_after", "backward_inside"])
@pytest.mark.parametrize("hidden_states", [False, True], ids=["", "hidden_states"])
def test_under_autocast_the_first_step_gives_the_gradients_of_the_next(strategy, backward_in_region, hidden_states):
    """The first training step measures (plan) or checks (reversible, momentum) the layers, running them without
    autograd inside the caller's autocast region: on torch <= 2.9 that cached weight casts without their history,
    and a later run with autograd reused them. plan's first step gave its first layer no gradient, and so did
    reversible's with ``output_hidden_states`` (which runs the layers with plain autograd after the check). Without
    dropout and without an optimizer step between them, two steps on the same batch give the same gradients, every
    parameter one."""
    model = memory_efficient(tiny("llama-tiny", dtype=torch.float32), strategy)
    grads = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(IDS, labels=IDS, use_cache=False, output_hidden_states=hidden_states)
            loss = out.loss + sum(h.float().mean() for h in out.hidden_states) if hidden_states else out.loss
            if backward_in_region:
                loss.backward()
        if not backward_in_region:
            loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    first, second = grads
    assert all(g is not None for g in first.values()), [n for n, g in first.items() if g is None]
    for name in second:
        assert max_rel_err(first[name], second[name]) <= 1e-6, name


def test_logits_that_do_not_match_the_labels_get_transformers_own_error():
    """logits_to_keep=1 with a whole sequence of labels: the shapes disagree; transformers' loss raises its own
    error, as it does for the unconverted model."""
    ref = tiny("llama-tiny")
    model = converted(ref)
    errors = []
    for m in (model, ref):
        with pytest.raises(Exception) as info:
            m(IDS, labels=IDS, use_cache=False, logits_to_keep=1)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]
