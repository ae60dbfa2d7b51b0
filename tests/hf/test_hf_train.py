"""transformers models through ``revlib-xla train`` (``model.hf_config=``), and the planner's smallest schedule on
them against transformers' own gradient checkpointing (eager peak, measured)."""

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import require_transformers, to_host

transformers = require_transformers()

from safetensors.torch import load_file  # noqa: E402

from revlib_xla import backends, cli, memory  # noqa: E402
from revlib_xla.hf import memory_efficient, model_from_config  # noqa: E402
from revlib_xla.hf.layers import HFConversionError  # noqa: E402
from revlib_xla.planner import Op, simulate  # noqa: E402
from revlib_xla.train.config import load_config  # noqa: E402
from revlib_xla.train.strategy import StrategyError, build_model, flops_per_token, param_count  # noqa: E402

SMOKE = str(Path(__file__).resolve().parents[2] / "tpu_configs" / "cpu-smoke.yaml")
SMALL = ["data.batch_size=2", "data.seq_len=32", "train.eval_batches=1", "train.progress=false", "train.device=cpu"]


def test_cli_trains_a_transformers_config_with_the_planner(tmp_path, capsys):
    """Three steps of ``revlib-xla train`` on a built-in transformers config (the smoke file's LlamaConfig-named
    overrides translated): the loss is finite and every weight moved from the seed's initial weights."""
    args = [*SMALL, "model.hf_config=llama-tiny", "strategy=plan", "train.steps=3", "train.eval_every=3"]
    args += ["train.checkpoint_every=3", "train.log_every=1", f"train.out_dir={tmp_path}"]
    assert cli.main(["train", "--config", SMOKE, *args]) == 0
    assert "llama-tiny on cpu, strategy activations=plan" in capsys.readouterr().out
    losses = [json.loads(line).get("loss") for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [x for x in losses if x is not None]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    trained = load_file(tmp_path / "checkpoints" / "step_00000003" / "model.safetensors")
    initial = {n: p.detach() for n, p in build_model(load_config(SMOKE, args), "cpu").lm.named_parameters()}
    assert "model.layers.0.mlp.up_proj.weight" in trained  # transformers' own state-dict keys
    assert initial["model.layers.0.mlp.up_proj.weight"].shape == (384, 128)  # ffn_dim x dim, as the smoke file says
    common = [name for name in initial if name in trained]  # a tied weight is stored under one of its names
    assert len(common) >= len(initial) - 1
    moved = [name for name in common if not torch.equal(trained[name], initial[name])]
    assert moved == common


def test_strategies_apply_to_the_transformers_model_and_the_spec_counts_it():
    base = [*SMALL, "model.hf_config=gpt2-tiny", "model.overrides={}"]
    plain = build_model(load_config(SMOKE, base), "cpu")
    assert param_count(load_config(SMOKE, base)) == sum(p.numel() for p in plain.parameters())
    # GPT-2 tiny: 4 layers of 12 * 64^2 matmul weights, the tied head 256 x 64; attention 4 layers x 64 wide
    assert flops_per_token(load_config(SMOKE, base)) == 6 * (4 * 12 * 64 * 64 + 256 * 64) + 6 * 4 * 64 * 32
    for strategy, check in [
        ("checkpoint", lambda m: m.lm.transformer.gradient_checkpointing),
        ("reversible", lambda m: m.lm.revlib_xla_conversion.strategy == "reversible"),
        ("momentum", lambda m: m.lm.revlib_xla_conversion.net is not None),
    ]:
        assert check(build_model(load_config(SMOKE, [*base, f"strategy={strategy}"]), "cpu")), strategy
    # strategy.exact: reversible's fixed-point streams (default) or floating-point; momentum is exact by construction
    exact = build_model(load_config(SMOKE, [*base, "strategy=reversible"]), "cpu").lm.revlib_xla_conversion.net
    floating = build_model(load_config(SMOKE, [*base, "strategy=reversible", "strategy.exact=false"]), "cpu")
    assert exact.exact_format(torch.float32) is not None and exact.exact is None
    assert floating.lm.revlib_xla_conversion.net.exact is False
    with pytest.raises(StrategyError, match="'momentum' is exact by construction.*exact=False applies to"):
        build_model(load_config(SMOKE, [*base, "strategy=momentum", "strategy.exact=false"]), "cpu")
    # momentum's beta: the transformers form's default (2**-6) unless the run sets one
    assert (
        build_model(load_config(SMOKE, [*base, "strategy=momentum"]), "cpu").lm.revlib_xla_conversion.net.beta == 2**-6
    )
    set_beta = build_model(load_config(SMOKE, [*base, "strategy=momentum", "strategy.beta=0.25"]), "cpu")
    assert set_beta.lm.revlib_xla_conversion.net.beta == 0.25
    with pytest.raises(HFConversionError, match="exact= applies to strategy='reversible' and 'momentum', not 'plan'"):
        memory_efficient(model_from_config("gpt2-tiny"), "plan", exact=False)
    meta = build_model(load_config(SMOKE, [*base, "strategy=plan"]), "meta")
    assert all(p.is_meta for p in meta.parameters())


def test_cli_refuses_what_a_transformers_model_cannot_run(capsys):
    """Overrides the transformers config does not have, and the stage-streaming offload, are refused by name."""
    assert cli.main(["train", "--config", SMOKE, *SMALL, "model.hf_config=gpt2-tiny", "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("revlib-xla train: error: model.overrides: n_kv_heads (as num_key_value_heads)")
    assert "GPT2Config" in err and "\n" not in err
    cfg = load_config(SMOKE, [*SMALL, "model.hf_config=llama-tiny", "strategy.offload.params=true"])
    with pytest.raises(StrategyError, match=r"strategy.offload.params=true .* model.hf_config='llama-tiny'"):
        build_model(cfg, "cpu")


def train_step(m, ids):
    m(ids, labels=ids, use_cache=False).loss.backward()


def hf_checkpointed_and_planned(model, ids):
    """Copies of ``model`` with transformers' gradient checkpointing and converted to ``plan`` (measured and
    planned by one step)."""
    hf = copy.deepcopy(model)
    (getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable)()
    planned = memory_efficient(copy.deepcopy(model), "plan")
    train_step(planned, ids)
    return hf, planned


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_smallest_plan_peaks_no_higher_than_hf_checkpointing(name):
    """The planner's smallest schedule keeps no more than transformers' per-layer checkpointing at its peak (the
    end of the backward, where both hold the first layer's recomputation): the executor frees each stage's output
    before the stage's backward, does not hold the stack output's gradient through the backward phase, and releases
    each stage's input leaf with its gradient."""
    torch.manual_seed(0)
    fields = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0} if name.startswith("gpt2") else {}
    model = model_from_config(name, num_hidden_layers=4, **fields).train()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))

    hf, planned = hf_checkpointed_and_planned(model, ids)
    cp = planned.revlib_xla_conversion.checkpointable
    schedule = cp.compute_sequence(cp.min_memory())
    assert sum(op.kind.name == "CF" for op in schedule.ops) > 1  # layers are recomputed, more than once
    train_step(hf, ids)
    train_step(planned, ids)  # warm: the second and later steps allocate nothing of their own
    assert memory.eager_peak(train_step, planned, ids).total <= memory.eager_peak(train_step, hf, ids).total


@pytest.mark.slow
def test_plan_finds_hf_checkpointings_schedule_within_its_peak():
    """The planner's sizes of a transformers layer stack bound what the step measures, tightly enough that within
    transformers' checkpointing's measured peak the plan recomputes no more layers than it does: a layer's forward
    with autograd is charged its own transient memory (1 boundary, not the forward without autograd's 7), and the
    LM head and loss are the chain's loss stage (the logits, and what the chunked loss holds: the head input's
    gradient, the float32 sum of the weight's gradient, one chunk's float32 tensors), held on top of whatever the
    schedule keeps when the loss runs."""
    from revlib_xla.hf.head import chunk_bytes

    torch.manual_seed(0)
    depth, ids = 4, torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    model = model_from_config("llama-tiny", num_hidden_layers=depth).train()

    hf, planned = hf_checkpointed_and_planned(model, ids)
    cp = planned.revlib_xla_conversion.checkpointable
    chain = cp.chain
    hidden, tokens = model.config.hidden_size, ids.numel()  # vocabulary 256, float32
    assert chain.bwd_tmp[-1] == tokens * (256 + hidden) * 4 + chunk_bytes(tokens, hidden, 256) + 4 * 256 * hidden
    assert chain.grad_fwd_tmp is not None and chain.grad_fwd_tmp[0] < chain.fwd_tmp[0] / 4
    # transformers' schedule in the planner's terms: keep every layer's input, recompute each layer once
    hf_ops = [Op("CF", i) for i in range(depth)] + [Op("L", depth)]
    hf_ops += [op for i in reversed(range(depth)) for op in (Op("Fe", i), Op("B", i))]
    budget = 1.02 * (simulate(chain, hf_ops)[1] + cp.held_during_backward())  # 2 %: the solver's rounding
    counts = cp.compute_sequence(budget).counts()
    assert counts.get("CF", 0) + counts.get("Fn", 0) + counts.get("Fe", 0) - depth <= depth
    train_step(hf, ids)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = memory.eager_peak(train_step, planned, ids).total
    assert peak <= memory.eager_peak(train_step, hf, ids).total
    assert peak <= budget + 2 * weights  # the budget bounds all but parameters and their gradients
    cp.compute_sequence(cp.min_memory())
    assert memory.eager_peak(train_step, planned, ids).total <= cp.min_memory() + 2 * weights


needs_xla = pytest.mark.skipif(not backends.xla_available(), reason="torch_xla is not installed")


@pytest.mark.slow
@needs_xla
@pytest.mark.parametrize("strategy", ["none", "checkpoint"])
def test_the_training_step_on_xla_reads_nothing_from_the_device(strategy):
    """The loop's transformers model on XLA: its tied weights stay tied; forward and backward trace with execution
    forbidden (transformers' own mask building reads the position ids from the device, a second graph per step and
    what stopped ``revlib-xla memory`` from tracing: the model is given its causal mask), and its own checkpointing
    runs there (torch.utils.checkpoint has no ``torch.xla``); loss and gradients equal the CPU's."""
    cfg = load_config(SMOKE, [*SMALL, "model.hf_config=llama-tiny", "model.overrides={}", f"strategy={strategy}"])
    dev = backends.device_for("xla")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    cpu, xla = build_model(cfg, "cpu"), build_model(cfg, dev)
    assert xla.lm.lm_head.weight is xla.lm.model.embed_tokens.weight  # tied, as on the CPU (.to(xla) unties)
    want = cpu.loss(ids)
    want.backward()
    with backends.execution_forbidden(dev):
        loss = xla.loss(ids.to(dev))
        loss.backward()
    got, grads = to_host((loss.detach(), [q.grad for q in xla.parameters()]))  # one graph, run once
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want))
    for (name, p), g in zip(cpu.named_parameters(), grads, strict=True):
        assert torch.allclose(g, p.grad, rtol=1e-4, atol=1e-6), name


@pytest.mark.slow
@needs_xla
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_cli_memory_sizes_a_transformers_config_as_tpu_memory_does(capsys):
    """``revlib-xla memory`` with ``model.hf_config``: each strategy's total is the TPU compiler's HBM peak of the
    same traced step (``revlib_xla.memory.tpu_memory``), and transformers' own checkpointing needs less than none."""
    from revlib_xla.fit.strategies import load, strategy, trace_config

    args = ["data.seq_len=32", "data.batch_size=2", "model.hf_config=llama-tiny", "model.overrides={}"]
    assert cli.main(["memory", "--config", SMOKE, "--strategies", "none,checkpoint", *args]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama-tiny, seq_len 32, precision fp32, on one v5e")
    totals = {
        line.split()[0]: line.split()[-5:-3]
        for line in out.splitlines()
        if line.split()[:1] in (["none"], ["checkpoint"])
    }
    traced = trace_config(load(SMOKE, args, strategy("checkpoint")))
    want = memory.tpu_memory(traced.stablehlo, "v5e").hbm_peak_bytes
    assert " ".join(totals["checkpoint"]) == memory.format_bytes(want)
    none = memory.parse_bytes(" ".join(totals["none"]), "none")
    assert want < none
