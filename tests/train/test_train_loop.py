"""revlib_xla.train.loop and ``revlib-xla train``: bit-exact resume (cpu and xla), one compiled graph per step,
SIGTERM saves and exits 0, metrics, and user errors as one line through the CLI."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from revlib_xla import backends
from revlib_xla.cli import main
from revlib_xla.train.checkpoint import latest_checkpoint
from revlib_xla.train.config import load_config
from revlib_xla.train.loop import train
from revlib_xla.train.strategy import PHASES, language_model

ROOT = Path(__file__).resolve().parents[2]
# On the CPU wherever the machine has a GPU too (train.device=auto would pick it: the models below are compared
# with CPU references and CPU batches, and resumed bit for bit); a test on another device overrides it after TINY.
TINY = [
    "train.device=cpu",
    "model.overrides={vocab_size: 256, dim: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, ffn_dim: 64}",
    "data.seq_len=16",
    "data.batch_size=4",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    "train.eval_every=0",
    "train.progress=false",
]


def _records(out_dir):
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def _weights(result):
    return {n: t.detach().cpu() for n, t in language_model(result.model).state_dict().items()}


BF16_WEIGHTS = ["strategy.param_dtype=bf16", "strategy.precision=bf16", "strategy.offload.optimizer=true"]
SCAN = ["strategy=reversible", "model.scan=true"]


def _resumes_unscanned(scanned_dir, common):
    """The scanned run's step-4 checkpoint loaded into the unscanned model and optimizer, saved again: the same
    tensors under the same names (weights and every AdamW state tensor), so either layout resumes the other."""
    from revlib_xla.train.checkpoint import Checkpoint, load_checkpoint, save_checkpoint, weight_slices
    from revlib_xla.train.strategy import build_model, build_optimizer

    cfg = load_config(None, [c for c in common if c != "model.scan=true"])
    model = build_model(cfg)
    optimizer = build_optimizer(cfg, model)
    source = scanned_dir / "checkpoints/step_00000004"
    load_checkpoint(source, language_model(model), optimizer)
    again = save_checkpoint(scanned_dir / "again", language_model(model), optimizer, Checkpoint(4, {}, {}), "")
    a, b = load_file(source / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(".0-0." in k for k in a) and not any("stacked" in k for k in a)
    saved, resaved = (torch.load(d / "optimizer.pt", weights_only=False) for d in (source, again))
    params = {name for name, _, _ in weight_slices(language_model(model))}
    assert saved["by_name"] and saved["state"].keys() == resaved["state"].keys() == params
    for name, state in saved["state"].items():
        assert state.keys() == resaved["state"][name].keys()
        assert all(torch.equal(v, resaved["state"][name][k]) for k, v in state.items()), name
    groups = [[(set(g["params"]), g["weight_decay"], g["lr"]) for g in d["param_groups"]] for d in (saved, resaved)]
    assert groups[0] == groups[1]


@pytest.mark.parametrize(
    "strategy",
    [[], BF16_WEIGHTS, [*BF16_WEIGHTS, "strategy.offload.gradients=true"], SCAN],
    ids=["fp32", "bf16-weights", "bf16-streamed-gradients", "scan"],
)
@pytest.mark.parametrize("kind", ["cpu", pytest.param("xla", marks=pytest.mark.slow)])
def test_a_killed_and_resumed_run_ends_with_bit_identical_weights(tmp_path, kind, strategy):
    """bf16-weights: the checkpoint holds the float32 master weights (not their bfloat16 rounding), so the resumed
    run continues from the same masters and ends with the same bfloat16 weights and masters. scan: the stacked
    layers' checkpoint holds the unstacked names, and the optimizer state by name: an unscanned run resumes from
    it (and writes back the same tensors)."""
    if not backends.device_available(kind):
        pytest.skip(f"no {kind} device")
    common = [*TINY, *strategy, "train.steps=6", "train.checkpoint_every=2", f"train.device={kind}"]
    whole = train(load_config(None, [*common, f"train.out_dir={tmp_path / 'whole'}"]))
    resumed_cfg = load_config(None, [*common, f"train.out_dir={tmp_path / 'killed'}"])
    killed = train(resumed_cfg, crash_after=5)  # dies after step 5: the last checkpoint is step 4's
    assert killed.final_step == 5 and latest_checkpoint(tmp_path / "killed" / "checkpoints").name == "step_00000004"
    resumed = train(resumed_cfg)
    assert resumed.start_step == 4 and resumed.final_step == 6
    assert resumed.losses[6] == whole.losses[6]
    a, b = _weights(whole), _weights(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    if strategy == SCAN:
        _resumes_unscanned(tmp_path / "killed", common)
    if (
        strategy[: len(BF16_WEIGHTS)] == BF16_WEIGHTS
    ):  # the final checkpoints hold the float32 masters, equal, and the weights are their rounding
        final = [
            load_file(tmp_path / run / "checkpoints/step_00000006/model.safetensors") for run in ("whole", "killed")
        ]
        params = dict(language_model(whole.model).named_parameters())
        for name in params:
            master = final[0][name]
            assert master.dtype == torch.float32 and torch.equal(master, final[1][name]), name
            assert torch.equal(master.to(torch.bfloat16), a[name]), name
        flat = torch.cat([final[0][name].flatten() for name in params])
        assert (flat != flat.to(torch.bfloat16).float()).float().mean() > 0.9  # more precise than bfloat16
    if kind == "xla":
        assert whole.recompilations == 0  # one compiled graph per step after the warm-up steps
    else:
        assert whole.recompilations is None


def test_metrics_are_logged_as_json_lines_with_evaluation(tmp_path):
    cfg = load_config(
        None, [*TINY, "train.steps=4", "train.eval_every=2", "train.log_every=2", f"train.out_dir={tmp_path}"]
    )
    result = train(cfg)
    records = _records(tmp_path)
    expected = [("train", 1), ("train", 2), ("eval", 2), ("train", 4), ("eval", 4)]  # the first step, every 2nd
    assert [(r["kind"], r["step"]) for r in records] == expected
    first = records[1]
    assert first["loss"] == result.losses[2] and first["tokens_per_s"] > 0
    assert first["mfu"] is None  # on the CPU: no peak to measure against (not chip.name's v5e)
    assert first["lr"] == pytest.approx(2e-3)  # step 2 of a 2-step warmup: 2/3 of the rate
    assert records[2]["val_loss"] == result.val_losses[2]
    assert (tmp_path / "checkpoints" / "step_00000004" / "model.safetensors").is_file()
    assert not (tmp_path / "tb").exists() or "tensorboard" in sys.modules


def test_compilations_capability():
    assert backends.compilations("cpu") is None
    if not backends.xla_available():
        return
    device = backends.device_for("xla")
    before = backends.compilations(device)
    x = torch.arange(7.0, device=device) * 3.25 + torch.tensor(float(time.time_ns() % 1000), device=device)
    backends.sync(device)
    assert backends.compilations(device) == before + 1
    (x.detach() * 3.25).sum().item()
    after = backends.compilations(device)
    assert after > before


def _run_cli(*args):
    return subprocess.Popen(
        [sys.executable, "-m", "revlib_xla.cli", "train", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PJRT_DEVICE": "CPU"},
    )


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_exits_0_then_the_same_command_resumes(tmp_path):
    args = ["--config", "tpu_configs/cpu-smoke.yaml", *TINY, "train.device=cpu", "train.log_every=1"]
    args.append(f"train.out_dir={tmp_path}")
    proc = _run_cli(*args, "train.steps=10000", "train.checkpoint_every=0")
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        metrics = tmp_path / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    step = _records(tmp_path)[-1]["step"]
    assert f"SIGTERM: stopped after step {step} of 10000" in out + err
    assert latest_checkpoint(tmp_path / "checkpoints").name == f"step_{step:08d}"
    again = _run_cli(*args, f"train.steps={step + 2}")
    out, err = again.communicate(timeout=240)
    assert again.returncode == 0, err
    assert f"resumed from {tmp_path / 'checkpoints' / f'step_{step:08d}'} (step {step})" in out + err
    assert [r["step"] for r in _records(tmp_path)][-2:] == [step + 1, step + 2]


def _tokens_file(tmp_path):
    path = tmp_path / "tokens.bin"
    np.full(4000, 700, dtype=np.uint16).tofile(path)
    return path


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.stepz=3"], "unknown key 'train.stepz' (did you mean 'train.steps'"),
        (["train.steps=ten"], "train.steps='ten': Input should be a valid integer"),
        (["model.name=llama-2b"], "model.name='llama-2b' is not a known size"),
        (["strategy=reversible", "strategy.offload.params=true"], "cannot be combined with strategy.activations"),
        (["data.path=/no/such/corpus"], "data.path='/no/such/corpus': no such file or directory"),
        (["data.kind=tokens", "data.path=TOKENS"], "holds token id 700, but the model has vocab_size=256"),
        (["train.device=cuda"], "train.device='cuda': this machine has no cuda device"),
    ],
)
def test_bad_input_is_one_line_through_the_cli(tmp_path, capsys, overrides, expected):
    if "train.device=cuda" in overrides and backends.cuda_available():
        pytest.skip("this machine has a GPU")
    overrides = [o.replace("TOKENS", str(_tokens_file(tmp_path))) for o in overrides]
    code = main(["train", "--config", "tpu_configs/cpu-smoke.yaml", *overrides, f"train.out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("revlib-xla train: error: ") and err.count("\n") == 1, err
    assert expected in err


def test_print_config(capsys):
    assert main(["train", "--config", "tpu_configs/cpu-smoke.yaml", "strategy=plan", "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert "activations: plan" in printed and "vocab_size: 256" in printed


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        ["strategy=none"],
        ["strategy=reversible"],
        ["strategy=plan"],
        ["strategy.fewbit=2"],
        ["strategy.offload.params=true", "strategy.offload.optimizer=true", "strategy.offload.activations=true"],
    ],
    ids=" ".join,
)
def test_cpu_smoke_trains_through_the_cli_with_each_strategy(tmp_path, capsys, strategy):
    """`revlib-xla train --config tpu_configs/cpu-smoke.yaml` with each strategy: the loss falls (a few steps here;
    the whole run is `make demo`)."""
    few = ["train.steps=8", "optim.warmup_steps=2", "data.seq_len=64", "train.eval_every=0", "train.log_every=1"]
    args = ["train", "--config", "tpu_configs/cpu-smoke.yaml", *strategy, *few, "train.progress=false"]
    assert main([*args, "train.device=cpu", f"train.out_dir={tmp_path}"]) == 0
    losses = [r["loss"] for r in _records(tmp_path)]
    assert len(losses) == 8 and losses[0] == pytest.approx(np.log(256), abs=0.3)
    assert max(losses[-3:]) < losses[0] - 0.5, losses
    assert "loss " in capsys.readouterr().out


def test_each_logged_step_records_its_peak_and_reserved_bytes(tmp_path, monkeypatch):
    """metrics.jsonl's peak_bytes is the most allocated during the steps since the last record (the loop starts a
    peak before each window), reserved_bytes the most the allocator held, memory_bytes what stays allocated
    between steps; the progress bar shows the peak. The CPU has no allocator statistics (the fields are null
    there), so here the CPU backend reads them from a StorageTracker that counts every storage of the run."""
    from revlib_xla.memory import StorageTracker
    from revlib_xla.train.metrics import MetricsLogger, StepMemory

    tracker = StorageTracker()
    cpu = type(backends.backend_for(torch.device("cpu")))
    resets = []
    monkeypatch.setattr(cpu, "allocator_statistics", lambda self, d: True, raising=False)
    monkeypatch.setattr(cpu, "memory_allocated", lambda self, d: tracker.current("cpu"), raising=False)
    monkeypatch.setattr(cpu, "max_memory_allocated", lambda self, d: tracker.peak("cpu"), raising=False)
    monkeypatch.setattr(cpu, "max_memory_reserved", lambda self, d: None, raising=False)
    monkeypatch.setattr(
        cpu, "reset_peak_memory_stats", lambda self, d: (resets.append(1), tracker.reset_peak()), raising=False
    )
    cfg = load_config(None, [*TINY, "train.steps=3", f"train.out_dir={tmp_path}", "train.checkpoint_every=0"])
    with tracker:
        train(cfg)
    records = [r for r in _records(tmp_path) if r["kind"] == "train"]
    assert [r["step"] for r in records] == [1, 2, 3]
    # before the first step, after each record, after the final checkpoint; and the phases' own (PhasePeaks): at
    # each phase's start (3 a step) and where each record takes them
    assert len(resets) == 5 + 3 * len(PHASES) + 3
    logits = 4 * 16 * 256 * 4  # batch x positions x vocabulary, float32: alive at each step's peak
    for r in records:
        assert r["peak_bytes"] >= r["memory_bytes"] + logits and r["reserved_bytes"] is None
        assert list(r["phase_peak_bytes"]) == list(PHASES)
        assert r["peak_bytes"] == max(r["phase_peak_bytes"].values())  # the step's peak is its largest phase's
    # AdamW's state (two moments per weight) exists from the first step's end on: what stays between steps grows
    assert records[1]["memory_bytes"] == records[2]["memory_bytes"] > records[0]["memory_bytes"] - 1

    with MetricsLogger(tmp_path / "bar", 1, 0, 64, 1.0, 1e12, progress=True) as logger:
        record = logger.step(1, 2.0, 1e-3, 0.5, StepMemory(peak=3 * 2**30, reserved=4 * 2**30, between=2**30))
        assert logger.bar.postfix and "peak=3.00GiB" in logger.bar.postfix
    assert (record["peak_bytes"], record["reserved_bytes"], record["memory_bytes"]) == (3 * 2**30, 4 * 2**30, 2**30)


def test_the_log_gives_each_phases_peak_where_the_allocator_keeps_statistics(monkeypatch):
    """PhasePeaks over an allocator that keeps statistics (cuda's calls, counted here): each phase's peak is the
    allocator's peak between its start and the next phase's, the statistics restart at every phase, and the steps'
    peak is the largest phase's (the allocator's own peak, read at the end, covers only the last phase)."""
    from revlib_xla.train import metrics

    class Allocator:
        allocated = peak = 0

        def allocator_statistics(self, device):
            return True

        def max_memory_allocated(self, device):
            return self.peak

        def max_memory_reserved(self, device):
            return self.peak + 10

        def memory_allocated(self, device):
            return self.allocated

        def reset_peak_memory_stats(self, device):
            self.peak = self.allocated

        def to(self, level):
            self.allocated = level
            self.peak = max(self.peak, level)

    allocator = Allocator()
    monkeypatch.setattr(metrics.backends, "backend_for", lambda device: allocator)
    phases = metrics.PhasePeaks(torch.device("cpu"))
    metrics.start_peak(torch.device("cpu"))
    for forward, backward, step in ((50, 90, 70), (60, 80, 100)):  # two steps
        phases.mark("forward")
        allocator.to(forward)
        allocator.to(20)
        phases.mark("backward")
        allocator.to(backward)
        allocator.to(30)
        phases.mark("optimizer step")
        allocator.to(step)
        allocator.to(10)
    memory = metrics.step_memory(torch.device("cpu"), phases.take())
    assert memory.phases == {"forward": 60, "backward": 90, "optimizer step": 100}
    assert memory.peak == 100 and memory.reserved == 110 and memory.between == 10
    assert phases.take().peaks == {}  # taken: the next window starts empty
