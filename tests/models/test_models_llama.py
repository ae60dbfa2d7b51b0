"""The Llama-style LM (revlib_xla.models.llama): the plain form is HF's LlamaForCausalLM, the memory-saving forms give
their reference's gradients, the named sizes have the published parameter counts on the meta device, bad input is
refused clearly. Small shapes, float64 on CPU for exact gradient checks."""

import dataclasses
import math

import pytest
import torch
from conftest import SeededUnits, max_rel_err, require_transformers, to_host
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import revlib_xla
from revlib_xla import MemoryModes, backends, fewbit, memory
from revlib_xla.models import registry
from revlib_xla.models.llama import (
    LLAMA_SIZES,
    Form,
    LlamaConfig,
    LlamaLM,
    build_llama,
    llama_config,
    num_params,
    train_flops_per_token,
)

SMALL = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)


def small(**overrides) -> LlamaConfig:
    return LlamaConfig(**{**SMALL, **overrides})


def tokens(config: LlamaConfig, batch: int = 2, time: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, time), generator=torch.Generator().manual_seed(seed))


def grads(model: nn.Module, loss_of, seed: int = 5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and parameter gradients (by name) of one backward, the global RNG seeded first (dropout masks)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_of(model)
    loss.backward()
    result = loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}
    backends.sync()  # on XLA: run the step as one graph, not one graph per tensor read
    return result


def built(config: LlamaConfig, form="plain", seed: int = 1, **options) -> LlamaLM:
    model = build_llama(config, form, **options).double()
    model.init_weights(seed)
    return model


# ---------------------------------------------------------------------------------------------------------------
# The plain form is HF's Llama

transformers = require_transformers()


@pytest.fixture
def hf_rmsnorm_in_input_dtype(monkeypatch):
    """HF's LlamaRMSNorm computes in float32 whatever the input (float64 included); for a float64 comparison it is
    patched to the same formula in the input's dtype, which is what LlamaLM's RMSNorm does for float64."""
    from transformers.models.llama import modeling_llama

    def forward(self, hidden):
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


def hf_llama(config: LlamaConfig):
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_embeddings,
        attention_dropout=0.0,
        attn_implementation="sdpa",  # HF's eager attention takes the softmax in float32
    )
    return transformers.LlamaForCausalLM(hf_config).double()


@pytest.mark.parametrize(
    "n_kv_heads, tie", [(2, True), (4, False), (1, False)], ids=["gqa-tied", "mha-untied", "mqa-untied"]
)
def test_plain_form_is_hf_llama(hf_rmsnorm_in_input_dtype, n_kv_heads, tie):
    config = small(n_kv_heads=n_kv_heads, tie_embeddings=tie, rope_theta=10000.0)
    ours, theirs = built(config), hf_llama(config)
    ours.load_hf_state_dict(theirs.state_dict())
    x = tokens(config)
    assert max_rel_err(ours(x), theirs(x).logits) <= 1e-10

    def hf_loss(model):
        logits = model(x).logits
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, config.vocab_size), x[:, 1:].reshape(-1))

    loss, got = grads(ours, lambda m: m.loss(x))
    hf_loss_value, expected = grads(theirs, hf_loss)
    assert loss.dtype == torch.float64 and abs(float(loss - hf_loss_value)) <= 1e-10 * float(loss)
    mapping = ours.hf_key_map()
    assert len(mapping) == len(got) == len(list(ours.parameters()))
    for name, grad in got.items():
        assert max_rel_err(grad, expected[mapping[name]]) <= 1e-10, name


def test_hf_weights_load_into_every_form_under_the_same_names():
    config = small(tie_embeddings=False)
    source = built(config, seed=3)
    hf_names = {source.hf_key_map()[k]: v for k, v in source.state_dict().items()}
    for form in Form:
        model = built(config, form, seed=4)
        model.load_hf_state_dict(hf_names)
        for name, hf_name in model.hf_key_map().items():
            assert torch.equal(model.state_dict()[name], hf_names[hf_name]), (form, name)
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        model.load_hf_state_dict({k: v for k, v in hf_names.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\)"):
        model.load_hf_state_dict({**hf_names, "model.norm.weight": torch.ones(3)})


def test_a_seed_gives_the_same_weights_in_every_form():
    config = small(tie_embeddings=False)
    weights = []
    for form in Form:
        model = built(config, form, seed=7)
        weights.append({model.hf_key_map()[k]: v for k, v in model.state_dict().items()})
    for other in weights[1:]:
        assert other.keys() == weights[0].keys()
        assert all(torch.equal(other[k], weights[0][k]) for k in other)
    assert not torch.equal(built(config, seed=8).embed.weight, built(config, seed=7).embed.weight)


# ---------------------------------------------------------------------------------------------------------------
# Memory-saving forms


@pytest.mark.parametrize("form", ["reversible", "momentum"])
def test_memory_saving_forms_give_their_references_gradients_with_dropout(form):
    config = small(n_layers=3, dropout=0.2)
    saving = built(config, form, beta=0.8)
    reference = built(config, form, beta=0.8, memory_mode=MemoryModes.no_savings)
    assert saving.layers.memory_mode == MemoryModes.autograd_function
    x = tokens(config)
    loss, got = grads(saving, lambda m: m.loss(x))
    expected_loss, expected = grads(reference, lambda m: m.loss(x))
    assert abs(float(loss - expected_loss)) <= 1e-12 * float(loss)
    assert got.keys() == expected.keys()
    for name in got:
        assert max_rel_err(got[name], expected[name]) <= 1e-10, name
    # the masks were drawn: another seed gives another loss, and without dropout another again
    assert abs(float(grads(saving, lambda m: m.loss(x), seed=6)[0] - loss)) > 1e-6


def test_reversible_and_momentum_are_the_documented_functions():
    """Reversible: both streams start as the embedding, (x0, x1) -> (x1, x0 + attn(x1)) -> ..., averaged at the end;
    momentum: utils.momentum_net over the same branches, output beta**K times the second stream."""
    config = small(n_layers=2)
    x = tokens(config)
    for form in ("reversible", "momentum"):
        model = built(config, form, beta=0.7)
        h = model.embed(x)
        cos, sin = model.rotary(h)
        branches = [b for block in model.blocks for b in (block.attn, block.ffn)]
        if form == "reversible":
            x0, x1 = h, h
            for branch in branches:
                x0, x1 = x1, x0 + branch(x1, cos, sin)
            out = (x0 + x1) / 2
        else:
            p, q = h, h
            for k, branch in enumerate(branches):
                p = p + branch(0.7**k * q, cos, sin)
                q = q + (1 - 0.7) / 0.7 ** (k + 1) * p
            out = 0.7 ** len(branches) * q
        expected = nn.functional.linear(model.norm(out), model.embed.weight)
        assert max_rel_err(model(x), expected) <= 1e-12, form


def rebuild_error(model: LlamaLM, x: torch.Tensor, autocast: bool = False) -> float:
    """How exactly the backward would rebuild the stack's input from its output (relative, worst over depth)."""
    h = model.embed(x)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        report = revlib_xla.check_invertible(
            model.layers, h if model.form is Form.REVERSIBLE else (h, h), *model.rotary(h), tolerance=1e9
        )
    return report.worst


@pytest.mark.slow
@torch.no_grad()
def test_reversible_forms_rebuild_their_input_at_depth():
    """Floating-point streams (exact=False): init_weights scales the branches' output projections and (untied) gives
    the embedding unit scale, so the streams outweigh what is subtracted from them and 16 layers rebuild their input
    closely, also under bfloat16 autocast; HF's init (every weight N(0, 0.02)) loses more than two digits. Exact
    streams (the default) rebuild it bit for bit whatever the init, tied or not, also under autocast."""
    config = llama_config("llama-tiny", n_layers=16)
    x = tokens(config, batch=1, time=32)
    floats = {"exact": False}
    reversible, momentum = build_llama(config, "reversible", **floats), build_llama(config, "momentum", **floats)
    ours = rebuild_error(reversible, x)
    assert ours < 1e-6 and rebuild_error(reversible, x, autocast=True) < 5e-4
    assert rebuild_error(momentum, x) < 5e-5
    tied = build_llama(dataclasses.replace(config, tie_embeddings=True), "reversible", **floats)
    assert 10 * ours < rebuild_error(tied, x) < 1e-4
    for param in reversible.parameters():
        if param.dim() > 1:
            param.normal_(0.0, 0.02)
    assert rebuild_error(reversible, x) > 100 * ours
    exact_tied = build_llama(dataclasses.replace(config, tie_embeddings=True), "reversible")
    for param in exact_tied.parameters():
        if param.dim() > 1:
            param.normal_(0.0, 0.02)
    for model in (build_llama(config, "reversible"), build_llama(config, "momentum"), exact_tied):
        assert rebuild_error(model, x) == 0.0 and rebuild_error(model, x, autocast=True) == 0.0


def saved(model: LlamaLM, x: torch.Tensor) -> int:
    """Activation bytes autograd keeps for the loss's backward (parameters and buffers are there anyway)."""
    return memory.saved_bytes(lambda: model.loss(x), exclude=[*model.parameters(), *model.buffers()])


def test_reversible_activation_memory_does_not_grow_with_depth():
    x = tokens(small(), batch=2, time=16)
    by_form = {}
    for form in Form:
        by_form[form] = [saved(build_llama(small(n_layers=depth, dropout=0.1), form), x) for depth in (2, 4, 8)]
    for form in ("reversible", "momentum"):
        two, four, eight = by_form[form]
        assert two == four == eight, (form, by_form[form])
    two, four, eight = by_form["plain"]
    per_block = (four - two) / 2
    assert eight - two == 6 * per_block  # linear in depth
    # each block keeps at least its input, the attention and MLP inputs and the MLP's hidden features
    assert per_block >= 4 * x.numel() * (3 * 32 + 2 * 48)
    assert eight > 2 * by_form["reversible"][2]


def test_checkpointed_plain_form_gives_the_plain_gradients():
    config = small(n_layers=3, dropout=0.2)
    plain, checkpointed = built(config), built(config, checkpoint=True)
    assert all(block.checkpointed for block in checkpointed.layers)
    x = tokens(config)
    loss, got = grads(checkpointed, lambda m: m.loss(x))
    expected_loss, expected = grads(plain, lambda m: m.loss(x))
    assert abs(float(loss - expected_loss)) <= 1e-12 * float(loss)
    for name in got:
        assert max_rel_err(got[name], expected[name]) <= 1e-12, name
    assert saved(checkpointed, x) < saved(plain, x)


def test_as_sequential_under_checkpointable_gives_the_plain_gradients():
    config = small(n_layers=2, dropout=0.2)
    model = built(config)
    x = tokens(config)
    sequential = model.as_sequential()
    assert len(sequential) == config.n_layers + 2
    assert {id(p) for p in sequential.parameters()} == {id(p) for p in model.parameters()}
    model.eval()
    assert torch.equal(sequential(x), model(x))  # the same function (no dropout in eval mode)
    model.train()
    checkpointed = revlib_xla.Checkpointable(sequential, input=x)
    schedule = checkpointed.compute_sequence(1.05 * checkpointed.min_memory())
    assert schedule.counts().get("Fn", 0) + schedule.counts().get("CF", 0) > 0  # something is recomputed

    def loss_of(m):
        from revlib_xla.models.llama import next_token_loss

        return next_token_loss(m(x), x)

    loss, got = grads(checkpointed, loss_of)
    expected_loss, expected = grads(SeededUnits(checkpointed.stages), loss_of)  # the same masks, plain autograd
    assert abs(float(loss - expected_loss)) <= 1e-12 * float(loss)
    assert len(got) == len(expected) == len(list(model.parameters()))
    for (name, grad), (_, reference) in zip(got.items(), expected.items(), strict=True):
        assert max_rel_err(grad, reference) <= 1e-10, name
    with pytest.raises(ValueError, match="form='plain' for Checkpointable"):
        built(config, "reversible").as_sequential()


def test_fewbit_converts_the_mlp_silu_changing_only_the_backward():
    config = small(n_layers=2)
    for form in Form:
        model, converted = built(config, form), built(config, form)
        fewbit.map_module(converted, lambda m: fewbit.convert_activation(m, bits=3))
        acts = [block.ffn.mlp.act_fn for block in converted.blocks]
        assert all(isinstance(a, fewbit.SiLU) and a.bits == 3 for a in acts), acts
        assert sum(isinstance(m, nn.SiLU) for m in converted.modules()) == 0
        x = tokens(config)
        loss, got = grads(converted, lambda m: m.loss(x))
        expected_loss, expected = grads(model, lambda m: m.loss(x))
        assert abs(float(loss - expected_loss)) <= 1e-12 * float(loss), form  # forward unchanged
        name_of = {id(p): n for n, p in converted.named_parameters()}
        gate, norm = (name_of[id(p)] for p in (converted.blocks[0].ffn.mlp.gate_proj.weight, converted.norm.weight))
        assert 1e-6 < max_rel_err(got[gate], expected[gate]) < 0.2, form  # the SiLU's derivative is approximated
        assert max_rel_err(got[norm], expected[norm]) <= 1e-12, form  # after the last SiLU: as before
        assert all(max_rel_err(got[n], expected[n]) < 0.2 for n in got), form


# ---------------------------------------------------------------------------------------------------------------
# Sizes, meta device, initialisation

PUBLISHED = {"llama-1b": 1_235_814_400, "llama-3b": 3_212_749_824, "llama-8b": 8_030_261_248}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_sizes_build_on_meta_with_their_parameter_counts(name):
    config = llama_config(name)
    assert num_params(config) == PUBLISHED[name]
    for form in Form:
        with torch.device("meta"):
            model = build_llama(config, form)
        tensors = [*model.parameters(), *model.buffers()]
        assert all(t.is_meta for t in tensors), form
        assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name], form
        assert (model.head is None) == config.tie_embeddings


def test_every_named_size_counts_its_parameters():
    for name, config in LLAMA_SIZES.items():
        with torch.device("meta"):
            model = build_llama(config)
        assert sum(p.numel() for p in model.parameters()) == num_params(config), name
    assert 9e6 < num_params(LLAMA_SIZES["llama-tiny"]) < 11e6
    assert 110e6 < num_params(LLAMA_SIZES["llama-125m"]) < 140e6
    assert LLAMA_SIZES["llama-8b"].ffn_dim == 14336 and not LLAMA_SIZES["llama-8b"].tie_embeddings


@pytest.mark.parametrize("form", list(Form))
def test_a_training_step_traces_on_meta_and_fake_tensors(form):
    """What sizing without the hardware needs: the real step at the real width, no values (llama-1b's width and
    vocabulary, two layers)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = llama_config("llama-1b", n_layers=2)
    with torch.device("meta"):
        model = build_llama(config, form)
    loss = model.loss(torch.zeros(2, 64, dtype=torch.long, device="meta"))
    loss.backward()
    assert loss.is_meta and loss.shape == () and model.embed.weight.grad.shape == (config.vocab_size, config.dim)
    assert all(p.grad is not None and p.grad.is_meta for p in model.parameters())
    with FakeTensorMode():
        model = build_llama(config, form)
        model.loss(torch.zeros(2, 64, dtype=torch.long)).backward()
        assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


@pytest.mark.parametrize("form", list(Form))
def test_meta_build_materialises_with_to_empty_and_init_weights(form):
    config = llama_config("llama-tiny")
    with torch.device("meta"):
        model = build_llama(config, form)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    reference = build_llama(config, form)
    reference.init_weights(seed=0)
    assert model.state_dict().keys() == reference.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    assert torch.equal(model.rotary.cos, reference.rotary.cos) and torch.equal(model.rotary.sin, reference.rotary.sin)
    assert "rotary.cos" not in model.state_dict()
    with torch.no_grad():
        loss = model.loss(tokens(config, batch=2, time=64))
    assert abs(float(loss) - math.log(config.vocab_size)) < 0.15  # a near-uniform guess at initialisation


def test_train_flops_per_token_counts_the_matmuls_and_half_of_full_attention():
    config = small(n_layers=2, max_seq_len=32)
    model = build_llama(config)
    x = tokens(config, batch=2, time=32)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.loss(x).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    # mm: every linear layer and the head, forward and backward; bmm: the attention without its causal mask
    assert set(counts) == {"aten.mm", "aten.bmm"}
    assert train_flops_per_token(config, 32) * x.numel() == counts["aten.mm"] + counts["aten.bmm"] / 2
    matmul_8b = PUBLISHED["llama-8b"] - 128256 * 4096 - (2 * 32 + 1) * 4096  # less the embedding and the norms
    assert train_flops_per_token(llama_config("llama-8b"), 2048) == 6 * matmul_8b + 6 * 32 * 4096 * 2048


# ---------------------------------------------------------------------------------------------------------------
# Devices


def test_reversible_form_on_the_device_matches_cpu(device):
    if backends.is_host_memory(device):
        pytest.skip("the reference is the CPU run")
    config = small(n_layers=2)
    x = tokens(config)
    reference = build_llama(config, "reversible")
    reference.init_weights(seed=0)
    loss, expected = grads(reference, lambda m: m.loss(x))
    model = build_llama(config, "reversible").to(device)
    model.init_weights(seed=0)
    x_device = x.to(device)
    loss_device, got = grads(model, lambda m: m.loss(x_device))
    assert abs(float(to_host(loss_device)) - float(loss)) <= 1e-5 * float(loss)
    for name in expected:
        assert max_rel_err(got[name], expected[name]) <= 1e-4, name


def test_bf16_autocast_step_on_the_device_matches_cpu_float32(device):
    """Under bf16 autocast the projections are bf16; the rotary tables must not promote queries and keys back to
    float32 beside bf16 values (XLA's attention refused the step)."""
    config = small(n_layers=2)
    x = tokens(config)
    reference = build_llama(config, "plain")
    reference.init_weights(seed=0)
    expected = float(reference.loss(x))
    model = build_llama(config, "plain").to(device)
    model.init_weights(seed=0)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        loss = model.loss(x.to(device))
    loss.backward()
    assert abs(float(to_host(loss)) - expected) <= 2e-2 * expected
    assert all(p.grad is not None and bool(torch.isfinite(to_host(p.grad)).all()) for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------
# Registry and bad input


def test_registry_builds_the_named_sizes():
    assert model_names_include_llama()
    model = registry.build_model("llama-tiny", "reversible", n_layers=2, dropout=0.1)
    assert isinstance(model, LlamaLM) and model.form is Form.REVERSIBLE
    assert model.config == llama_config("llama-tiny", n_layers=2, dropout=0.1)
    momentum = registry.build_model("llama-tiny", form="momentum", n_layers=1, beta=0.5)
    assert momentum.beta == 0.5 and momentum.form is Form.MOMENTUM
    assert registry.build_model("llama-tiny", n_layers=1, checkpoint=True).blocks[0].checkpointed
    with pytest.raises(ValueError, match=r"unknown model 'llama-1B' \(did you mean 'llama-1b'\?\); expected one of"):
        registry.build_model("llama-1B")
    with pytest.raises(ValueError, match="already registered"):
        registry.register("llama-tiny", lambda form="plain": nn.Linear(1, 1))
    registry.register("test-linear", lambda form="plain", width=2: nn.Linear(width, 1))
    assert registry.build_model("test-linear", width=3).in_features == 3
    registry.register("test-linear", lambda form="plain": nn.Linear(1, 1), replace=True)
    assert "test-linear" in registry.model_names()


def model_names_include_llama() -> bool:
    return set(LLAMA_SIZES) <= set(registry.model_names())


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: llama_config("llama-2b"), r"unknown Llama size 'llama-2b'; expected one of llama-tiny, llama-125m"),
        (lambda: llama_config("llama-1b", hidden=3), r"unknown LlamaConfig field\(s\) hidden; expected some of vocab"),
        (lambda: small(dim=30), r"n_heads=4 does not divide dim=30"),
        (lambda: small(n_kv_heads=3), r"n_kv_heads=3 does not divide n_heads=4"),
        (lambda: small(dim=12, n_heads=4), r"head size dim // n_heads = 3 is odd"),
        (lambda: small(n_layers=0), r"LlamaConfig.n_layers must be a positive integer, got 0"),
        (lambda: small(dropout=1.0), r"dropout must be in \[0, 1\)"),
        (lambda: build_llama(small(), "revnet"), r"unknown Llama form 'revnet'; expected one of plain, reversible"),
        (lambda: build_llama(small(), "reversible", checkpoint=True), r"checkpoint=True applies to the plain form"),
        (lambda: build_llama(small(), memory_mode=MemoryModes.no_savings), r"memory_mode configure the reversible"),
    ],
)
def test_bad_configurations_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("form", list(Form))
def test_bad_tokens_are_refused(form):
    config = small()
    model = build_llama(config, form)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 97\) \(vocab_size\), got ids from 0 to 97"):
        model(torch.tensor([[0, 5, 97]]))
    with pytest.raises(ValueError, match=r"got ids from -1 to 5"):
        model(torch.tensor([[-1, 5]]))
    with pytest.raises(ValueError, match=r"sequence of 17 tokens is longer than max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match=r"integer token ids of shape \(batch, time\), got torch.float32"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"got torch.int64 of shape \(4,\)"):
        model(torch.zeros(4, dtype=torch.long))
