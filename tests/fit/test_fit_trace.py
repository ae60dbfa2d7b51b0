"""revlib_xla.fit: a training step traced at full size without allocating it, its donated buffers, its compiled
report against the chip (deviceless TPU compiler), and the chips table."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
from torch import nn

from revlib_xla import backends, memory
from revlib_xla.fit import CHIPS, chip, mark_aliases, stablehlo_arguments, trace_step
from revlib_xla.fit.report import FOOTNOTE, compile_steps, fit_report, format_table, parse_out_of_memory
from revlib_xla.fit.trace import INPUTS, OPTIMIZER, OTHER, PARAMETERS

needs_xla = pytest.mark.skipif(not backends.xla_available(), reason="torch_xla is not installed")
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (pip install 'revlib_xla[tpu-compile]')"
)


def compiles(test):
    """A test that compiles deviceless for a TPU: slow, and needs torch_xla and libtpu."""
    return pytest.mark.slow(needs_xla(needs_libtpu(test)))


WIDTH = 256


def mlp(width: int = WIDTH) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def make_step(model: nn.Module, optimizer: torch.optim.Optimizer | None):
    assert optimizer is not None

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def batch(rows: int, width: int = WIDTH) -> list[torch.Tensor]:
    return [torch.empty(rows, width, device="meta")]


def normalized(stablehlo: str) -> str:
    return re.sub(r"@IrToHlo\.\d+", "@main_module", stablehlo)


@needs_xla
def test_zero_copy_trace_is_the_ordinary_trace_with_every_argument_named():
    fast = trace_step(mlp(), adamw, make_step, batch(64))
    ordinary = trace_step(mlp(), adamw, make_step, batch(64), zero_copy=False)
    assert normalized(fast.stablehlo) == normalized(ordinary.stablehlo)
    assert fast.arguments == ordinary.arguments
    n_params = 2 * (WIDTH * WIDTH + WIDTH)
    assert fast.argument_bytes(PARAMETERS) == 4 * n_params
    assert fast.argument_bytes(OPTIMIZER) == 2 * 4 * n_params  # AdamW: exp_avg and exp_avg_sq
    assert fast.argument_bytes(INPUTS) == 4 * 64 * WIDTH
    assert all(a.shape == () for a in fast.arguments if a.role == OTHER)  # learning rate, betas, ... scalars
    # Every parameter and state tensor is donated to its new value, each to its own output.
    donated = [a for a in fast.arguments if a.output is not None]
    assert {a.role for a in donated} == {PARAMETERS, OPTIMIZER} and len(donated) == 4 + 8
    assert len({a.output for a in donated}) == len(donated)
    assert all(fast.outputs[a.output] == a.name for a in donated)
    assert fast.outputs[0] == "loss"
    assert fast.aliased_bytes == 3 * 4 * n_params


@needs_xla
def test_shared_parameters_are_one_argument():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 64, bias=False))
    model[1].weight = model[0].weight  # tied, as an LM's head and embedding

    def step_fn(model, optimizer):
        def step(tokens):
            loss = model(tokens).logsumexp(-1).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        return step

    traced = trace_step(model, adamw, step_fn, [torch.empty(4, 16, dtype=torch.int64, device="meta")])
    params = [a for a in traced.arguments if a.role == PARAMETERS]
    assert [(a.name, a.nbytes) for a in params] == [("0.weight", 64 * 32 * 4)]
    assert traced.argument_bytes(INPUTS) == 4 * 16 * 8


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@needs_xla
def test_a_large_model_is_traced_without_allocating_it():
    # 2 GiB of parameters + 4 GiB of AdamW state: traced, never allocated or run.
    width = 16384
    before = _resident_bytes()
    traced = trace_step(mlp(width), adamw, make_step, batch(8, width))
    grown = _resident_bytes() - before
    assert traced.argument_bytes(PARAMETERS) == 4 * 2 * (width * width + width)
    assert traced.argument_bytes(OPTIMIZER) == 2 * traced.argument_bytes(PARAMETERS)
    assert grown < 256 * 2**20, f"tracing grew the resident memory by {grown / 2**20:.0f} MiB"


@needs_xla
def test_a_step_that_reads_a_value_is_refused_not_run():
    def reads(model, optimizer):
        step = make_step(model, optimizer)
        return lambda x: step(x).item()

    with pytest.raises(RuntimeError, match=r"tried to run on the device while being traced.*\.item\(\)"):
        trace_step(mlp(), adamw, reads, batch(8))


def test_mark_aliases_writes_the_donation_attribute_and_keeps_other_attributes():
    text = (
        'module @m {\n  func.func @main(%arg0: tensor<4xf32>, %arg1: tensor<2x3xbf16> {mhlo.sharding = "{r}"}, '
        "%arg2: tensor<i64>) -> (tensor<4xf32>, tensor<2x3xbf16>) {\n    return %arg0, %arg1 : tensor<4xf32>, "
        "tensor<2x3xbf16>\n  }\n}\n"
    )
    marked = mark_aliases(text, {0: 1, 1: 0})
    assert "%arg0: tensor<4xf32> {tf.aliasing_output = 1 : i32}" in marked
    assert '%arg1: tensor<2x3xbf16> {tf.aliasing_output = 0 : i32, mhlo.sharding = "{r}"}' in marked
    assert "%arg2: tensor<i64>) ->" in marked
    assert stablehlo_arguments(text) == [((4,), "f32", 16), ((2, 3), "bf16", 12), ((), "i64", 8)]
    with pytest.raises(ValueError, match=r"no arguments \[7\]"):
        mark_aliases(text, {7: 0})


@compiles
def test_donated_buffers_count_once_and_without_the_aliases_twice():
    traced = trace_step(mlp(512), adamw, make_step, batch(128, 512))
    aliased, unaliased = memory.tpu_memory_many(
        [traced.stablehlo, traced.unaliased_stablehlo], hbm_only=True, liveness=True
    )
    arguments = aliased.argument_bytes  # the traced arguments, small ones padded to the compiler's alignment
    assert arguments == unaliased.argument_bytes
    assert traced.argument_bytes() <= arguments <= traced.argument_bytes() + 512 * len(traced.arguments)
    assert aliased.output_bytes == unaliased.output_bytes
    assert aliased.alias_bytes == traced.aliased_bytes and unaliased.alias_bytes == 0
    loss = aliased.output_bytes - aliased.alias_bytes  # the only output not donated (padded)
    assert 4 <= loss <= 1024
    # Donated: the peak is the arguments, the loss and what the step keeps alive meanwhile (gradients,
    # activations: the compiler's live peak of the other values), to within the compiler's alignment.
    kept = aliased.hbm_peak_bytes - arguments - loss
    assert aliased.live_peak_bytes <= kept <= aliased.live_peak_bytes + 4096
    assert kept < traced.aliased_bytes // 4
    # Without the aliases every parameter and state tensor is counted twice: as an argument and as an output.
    assert unaliased.hbm_peak_bytes >= arguments + aliased.output_bytes
    assert unaliased.hbm_peak_bytes - aliased.hbm_peak_bytes >= traced.aliased_bytes - kept
    report = compile_steps([traced], CHIPS["v5e"])[0]
    default = memory.tpu_memory(traced.stablehlo, "v5e")
    assert report.total == default.hbm_peak_bytes  # the report's figure is tpu_memory's on the same step


@compiles
def test_report_parts_add_up_rise_with_batch_and_say_how_they_are_obtained():
    small, large = (trace_step(mlp(512), adamw, make_step, batch(rows, 512)) for rows in (512, 4096))
    reports = compile_steps([small, large], CHIPS["v6e"], labels=["plain", "plain"], batches=[512, 4096])
    for traced, report in zip((small, large), reports):
        assert report.total is not None and report.temporaries is not None
        assert report.parameters + report.optimizer + report.inputs + report.other + report.temporaries == report.total
        assert report.parameters == traced.argument_bytes(PARAMETERS)
        assert report.fits and report.host == 0
    assert reports[1].total > reports[0].total
    assert reports[1].temporaries > reports[0].temporaries
    table = format_table(reports)
    assert "TPU compiler (deviceless libtpu), not a TPU run" in table and table.endswith(FOOTNOTE)


@compiles
def test_a_step_larger_than_the_chip_does_not_fit_and_the_compiler_limit_is_the_chips():
    # 8 GiB of parameters and 16 GiB of AdamW state: more than a v5e's 16 GiB, traced without allocating it.
    traced = trace_step(mlp(32768), adamw, make_step, batch(8, 32768))
    [report] = compile_steps([traced], CHIPS["v5e"])
    assert not report.fits and report.total is None
    state = traced.argument_bytes(PARAMETERS) + traced.argument_bytes(OPTIMIZER)
    assert abs(report.at_least - state) <= 0.005 * 2**30  # the compiler's "Used 24.00G", rounded
    assert report.headroom < 0
    assert report.row()["total"].startswith(">= ") and report.row()["fits"].startswith("NO")


def test_out_of_memory_message_parsing_and_the_v5e_limit():
    message = (
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 20.00G "
        "of 15.75G hbm. Exceeded hbm capacity by 4.25G."
    )
    used, capacity = parse_out_of_memory(message)
    assert used == 20 * 2**30 and capacity == int(15.75 * 2**30)
    assert capacity == CHIPS["v5e"].usable_bytes  # what the v5e compiler enforces
    assert parse_out_of_memory("INVALID_ARGUMENT: something else") is None
    rejected = fit_report(trace_like(), CHIPS["v5e"], memory.TpuCompileError("INVALID_ARGUMENT: something else"))
    assert not rejected.fits and rejected.total is None and "something else" in rejected.error
    assert rejected.row()["fits"].startswith("NO: the compiler rejects it")
    assert "the TPU compiler rejects the step: INVALID_ARGUMENT: something else" in format_table([rejected])


def trace_like():
    from revlib_xla.fit.trace import TracedStep

    return TracedStep("", "", (), ())


def test_chips_by_name_and_unknown_names():
    assert chip("V5E") is CHIPS["v5e"] and chip("h100", "gpu").hbm_bytes == 80 * 2**30
    assert {"v4", "v5e", "v5p", "v6e"} <= {c.name for c in CHIPS.values() if c.is_tpu}
    assert {"h100", "a100-40gb", "a100-80gb", "l4", "t4"} <= {c.name for c in CHIPS.values() if not c.is_tpu}
    assert all(c.topology_1chip for c in CHIPS.values() if c.is_tpu)
    with pytest.raises(ValueError, match=r"unknown TPU chip 'h100'; choose one of v4, v5e, v5p, v6e"):
        chip("h100", "tpu")
    with pytest.raises(ValueError, match=r"unknown chip 'v7'.*v5e.*h100"):
        chip("v7")


@pytest.mark.slow
@needs_xla
def test_llama_8b_is_traced_at_full_size_on_this_machine():
    from revlib_xla.models.llama import build_llama, llama_config, num_params

    config = llama_config("llama-8b")
    with torch.device("meta"):
        model = build_llama(config, "reversible")

    def step_fn(model, optimizer):
        def step(tokens):
            loss = model.loss(tokens)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        return step

    before = _resident_bytes()
    traced = trace_step(model, adamw, step_fn, [torch.empty(1, 2048, dtype=torch.int64, device="meta")])
    grown = _resident_bytes() - before
    assert traced.argument_bytes(PARAMETERS) == 4 * num_params(config)  # 8.03e9 parameters, 32 GB: not allocated
    assert traced.argument_bytes(OPTIMIZER) == 2 * 4 * num_params(config)
    assert grown < 2 * 2**30, f"tracing llama-8b grew the resident memory by {grown / 2**30:.2f} GiB"


def test_zero_copy_on_a_host_memory_device_is_the_tensor_itself():
    host = torch.arange(4.0)
    assert backends.zero_copy_device_tensor(host, "cpu") is host
    with backends.execution_forbidden("cpu"):  # nothing to forbid on an eager device
        assert float((host * 2).sum()) == 12.0
    with pytest.raises(NotImplementedError, match="cannot give host memory to a device tensor without copying"):
        backends.backend_for("cuda").zero_copy_device_tensor(host, torch.device("cuda"))


@needs_xla
def test_xla_zero_copy_device_data_shares_the_host_memory_and_names_its_argument():
    host = torch.arange(4.0)
    dev = backends.device_for("xla")
    data = backends.zero_copy_device_tensor(host, dev)
    host[0] = 42.0  # written after the device tensor was made: it reads the same memory, no copy was taken
    assert data.cpu().tolist() == [42.0, 1.0, 2.0, 3.0]
    pending = (data * data).neg()
    assert backends.program_arguments([pending]) == [backends.data_identity(data)]
    assert backends.program_arguments([data]) == [backends.data_identity(data)]
    with backends.execution_forbidden(dev), pytest.raises(RuntimeError, match="Unexpected execution"):
        pending.cpu()
    assert (data * data).neg().cpu().tolist() == [-1764.0, -1.0, -4.0, -9.0]  # allowed again after the block


@needs_xla
def test_a_host_stepped_optimizer_is_traced_as_its_device_part():
    """strategy.offload.optimizer (AdamW stepping on the host, ZeRO-Offload style): the traced program is the forward
    and backward, the gradients its outputs (sent to the host); no optimizer state and no weight update in it; the
    host state and master weights are the step's host bytes. Nothing is copied to the host while tracing."""
    from revlib_xla.fit.report import arguments_exceed
    from revlib_xla.train.config import load_config
    from revlib_xla.train.strategy import HostOptimizerState

    cfg = load_config(None, ["strategy.offload.optimizer=true"])

    def host_adamw(model: nn.Module) -> torch.optim.Optimizer:
        return HostOptimizerState(cfg, list(model.parameters()), annotate=False)

    fast = trace_step(mlp(), host_adamw, make_step, batch(64))
    ordinary = trace_step(mlp(), host_adamw, make_step, batch(64), zero_copy=False)
    assert normalized(fast.stablehlo) == normalized(ordinary.stablehlo)
    n_params = 2 * (WIDTH * WIDTH + WIDTH)
    assert fast.argument_bytes(PARAMETERS) == 4 * n_params and fast.argument_bytes(OPTIMIZER) == 0
    assert fast.outputs == ("loss", *(f"gradient to host {i}" for i in range(4)))
    assert fast.aliases == {}  # the weights come back from the host as new device data
    assert fast.host_bytes == ordinary.host_bytes == 3 * 4 * n_params  # fp32 master weights, exp_avg, exp_avg_sq
    assert arguments_exceed(fast, chip("v5e")).host == fast.host_bytes
