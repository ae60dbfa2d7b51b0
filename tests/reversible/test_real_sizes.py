"""Real widths and vocabularies on the CPU, at a tiny batch: what the fast tests check on small models, at the
sizes people train (Llama-3.2-1B: hidden 2048, vocabulary 128256; llama-8b's hidden 4096 on a slice of its layers).

All in one module so that one test worker runs them one after another (each holds a 1B model and its gradients,
up to ~10 GB). Gradients are compared through a digest of their bytes: no second copy of a 1B model's gradients."""

import hashlib

import pytest
import torch
from conftest import require_transformers
from torch import nn

from revlib_xla import MemoryModes
from revlib_xla.models import build_llama, llama_config

pytestmark = pytest.mark.slow


def digests(model: nn.Module) -> dict[str, str]:
    return {
        name: hashlib.blake2b(p.grad.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def assert_same_digests(got: dict[str, str], want: dict[str, str]) -> None:
    assert got.keys() == want.keys() and len(want) > 10
    differ = [name for name in want if got[name] != want[name]]
    assert not differ, f"{len(differ)} of {len(want)} gradients differ, e.g. {differ[:4]}"


# -- transformers models converted by revlib_xla.hf.memory_efficient(model, "reversible") -------------------------


def hf_step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out.loss.detach()


@pytest.mark.parametrize(
    "name,dtype,layers,tokens",
    [
        ("llama-3.2-1b", torch.float32, 2, 16),
        ("llama-3.2-1b", torch.bfloat16, 1, 8),  # (the vocabulary cut: see the docstring)
        ("qwen3-0.6b", torch.float32, 2, 16),
        ("gpt2-124m", torch.float32, 2, 16),
    ],
    ids=["llama-3.2-1b-fp32", "llama-3.2-1b-bf16", "qwen3-0.6b-fp32", "gpt2-124m-fp32"],
)
def test_hf_reversible_gradients_equal_no_savings_at_real_size(name, dtype, layers, tokens):
    """The published shape's width, heads and vocabulary (Llama-3.2-1B: hidden 2048, 32/8 heads, vocabulary 128256)
    on its first layers, random weights as transformers initialises them, a tiny batch (bfloat16 weights: one layer,
    8 tokens and a 1024-word vocabulary, as bfloat16 products are slow on CPUs without bf16 units; the head and the
    embedding are outside the reversible stack, whose width is the model's): the memory-saving backward's gradients are
    no_savings' (plain autograd through the same function), bit for bit, embedding and head included. Exactness
    does not depend on depth (each layer's integers are subtracted as they were added); the whole 16 layers at 64
    tokens, where floating-point streams are refused (rebuild error 3.6e-2), are recorded by
    ``bench/exact_streams.py hf`` (bench/results/exact_streams-cpu.md)."""
    require_transformers()
    from revlib_xla.hf import memory_efficient, model_from_config

    torch.manual_seed(0)
    overrides = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if name.startswith("gpt2") else {}
    if dtype == torch.bfloat16:  # the head's bfloat16 products at 128256 words take minutes on this CPU
        overrides["vocab_size"] = 1024
    model = model_from_config(name, dtype=dtype, num_hidden_layers=layers, **overrides).train()
    assert model.config.num_hidden_layers == layers
    memory_efficient(model, "reversible")
    net = model.revlib_xla_conversion.net
    assert net.exact_format(dtype) is not None  # exact streams, the default
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    net.memory_mode = MemoryModes.no_savings
    loss = hf_step(model, ids)
    want = digests(model)
    net.memory_mode = MemoryModes.autograd_function
    assert torch.equal(hf_step(model, ids), loss)
    assert_same_digests(digests(model), want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3-8b"])
def test_hf_momentum_at_real_width_keeps_the_function_and_gives_plain_autograds_gradients(name):
    """``memory_efficient(model, "momentum")`` at the published width and vocabulary (Llama-3.2-1B: hidden 2048,
    vocabulary 128256, 3 layers; Llama-3-8B: hidden 4096, 2 layers, its vocabulary cut to 1024 words to keep the
    head small on this CPU), random weights as built, float32, 1 x 16 tokens: the logits tend to the original
    model's linearly in beta (at 2**-6 within 4 beta of them, relative to their largest, at 2**-10 at least 8 times
    closer; random layers' residuals change more from one layer to the next than trained ones'); the memory-saving
    backward rebuilds the input bit for bit (``verify``) and its gradients equal plain autograd's through the same
    function (the layer-by-layer path), embedding and head included."""
    require_transformers()
    from revlib_xla.hf import memory_efficient, model_from_config, unconvert

    torch.manual_seed(0)
    layers, overrides = (3, {}) if name == "llama-3.2-1b" else (2, {"vocab_size": 1024})
    model = model_from_config(name, dtype=torch.float32, num_hidden_layers=layers, **overrides).train()
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        original = model.eval()(ids, use_cache=False).logits
        errors = {}
        for beta in (2**-10, 2**-6):  # the last one stays: trained below
            if beta != 2**-10:
                with pytest.warns(UserWarning, match="up to beta"):
                    unconvert(model, approximate=True)
            memory_efficient(model, "momentum", beta=beta).eval()
            errors[beta] = float((model(ids, use_cache=False).logits - original).abs().max() / original.abs().max())
    assert errors[2**-6] <= 4 * 2**-6 and errors[2**-10] <= errors[2**-6] / 8, errors
    model.revlib_xla_conversion.net.verify = True
    model.train()
    loss = hf_step(model, ids)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids, use_cache=False, output_hidden_states=True)  # plain autograd, layer by layer
    out.loss.backward()
    assert torch.equal(out.loss.detach(), loss)
    for n, p in model.named_parameters():
        scale = p.grad.abs().max()
        assert float((got[n] - p.grad).abs().max()) <= 1e-5 * float(scale), n


# -- the native Llama ------------------------------------------------------------------------------------------


def native(config, mode, **kw):
    with torch.device("meta"):
        lm = build_llama(config, "reversible", memory_mode=mode, **kw)
    lm.to_empty(device="cpu")
    lm.init_weights(seed=0)
    return lm


def native_step(lm, ids, autocast):
    lm.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = lm.loss(ids)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize(
    "size,overrides,autocast",
    [
        ("llama-1b", {"n_layers": 2, "vocab_size": 1024}, True),
        ("llama-1b", {"n_layers": 2}, False),
        ("llama-8b", {"n_layers": 1, "vocab_size": 1024}, False),
    ],
    ids=["llama-1b-bf16-autocast", "llama-1b-fp32", "llama-8b-slice-fp32"],
)
def test_native_llama_reversible_equals_no_savings_at_real_width(size, overrides, autocast):
    """Real layers of llama-1b (hidden 2048, GQA 32/8, FFN 8192) in float32 with its vocabulary (128256) and under
    bfloat16 autocast (a 1024-word vocabulary: the head's bfloat16 products at 128256 words take minutes on CPUs
    without bf16 units), and one real layer of llama-8b (hidden 4096, GQA 32/8, FFN 14336; the whole model builds
    on the meta device) in float32, 1 x 16 tokens: the reversible form's gradients equal no_savings' bit for bit."""
    with torch.device("meta"):
        build_llama(llama_config(size), "reversible")  # full size, nothing allocated
    config = llama_config(size, **overrides)
    ids = torch.randint(0, config.vocab_size, (1, 17), generator=torch.Generator().manual_seed(1))
    ref = native(config, MemoryModes.no_savings)
    loss = native_step(ref, ids, autocast=autocast)
    want = digests(ref)
    del ref
    lm = native(config, MemoryModes.autograd_function)
    assert torch.equal(native_step(lm, ids, autocast=autocast), loss)
    assert_same_digests(digests(lm), want)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_exact_reversible_training_equals_no_savings_step_for_step(autocast):
    """AdamW steps on bytes at hidden 1024 (16 heads; float32: 100 steps of 2 layers, 32 tokens; bf16 autocast,
    slow on CPUs without bf16 units: 25 steps of 1 layer, 16 tokens): the exact reversible form and no_savings lose
    the same loss at every step, to the bit."""
    layers, length, steps = (1, 16, 25) if autocast else (2, 32, 100)
    config = llama_config("llama-1b", dim=1024, n_layers=layers, n_heads=16, n_kv_heads=4, ffn_dim=2816, vocab_size=256)
    data = torch.tensor(list(open(__file__, "rb").read()[:20000]), dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(data) - length - 1, (steps,), generator=gen).tolist()
    batches = [data[s : s + length + 1].unsqueeze(0) for s in starts]
    losses = []
    for mode in (MemoryModes.no_savings, MemoryModes.autograd_function):
        lm = native(config, mode)
        opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
        run = []
        for ids in batches:
            run.append(native_step(lm, ids, autocast))
            opt.step()
        losses.append(torch.stack(run))
    assert torch.equal(losses[0], losses[1])
    window = 5 if autocast else 10  # (a quarter of the bf16 run's 25 steps)
    assert losses[0][-window:].mean() < 0.8 * losses[0][:window].mean()  # it trains
