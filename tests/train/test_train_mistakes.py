"""Runs and checkpoints that survive the mistakes people make: broken or partial checkpoints are passed over (with a
warning naming them) for the newest whole one, never silently restarting from step 0; one run per out_dir; a loss
that goes NaN stops the run and keeps finite checkpoints (or, opted in, skips the step); nothing left behind."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from revlib_xla.cli import main
from revlib_xla.train import checkpoint as ck
from revlib_xla.train import loop, strategy
from revlib_xla.train.config import ConfigError, load_config
from revlib_xla.train.loop import train

TINY = [
    "model.overrides={vocab_size: 256, dim: 32, n_layers: 2, n_heads: 2, n_kv_heads: 1, ffn_dim: 64}",
    "data.seq_len=16",
    "data.batch_size=4",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    "train.eval_every=0",
    "train.progress=false",
    "train.device=cpu",
    "train.checkpoint_every=2",
    "train.log_every=1",
]


def _cfg(out_dir, *extra):
    return load_config(None, [*TINY, f"train.out_dir={out_dir}", *extra])


def _steps_logged(out_dir):
    return [json.loads(line)["step"] for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def _weights(directory):
    return load_file(Path(directory) / "model.safetensors")


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """A run of 6 steps killed after step 5, with checkpoints at steps 2 and 4 (``latest`` names step 4); its
    metrics.jsonl holds steps 1 to 5."""
    root = tmp_path_factory.mktemp("four")
    out = root / "run"
    train(_cfg(out, "train.steps=6"), crash_after=5)
    train(_cfg(root / "whole", "train.steps=6"))  # the uninterrupted run: what resuming must end with
    assert ck.latest_checkpoint(out / "checkpoints").name == "step_00000004"
    assert _steps_logged(out) == [1, 2, 3, 4, 5]
    return out


def _copy(run, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(run, target)
    return target


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _flip(path, where=0.5, count=1):
    """``count`` bytes in the middle of ``path`` changed in place: its size stays (issue 39, case 1: resumed
    silently when the manifest held byte sizes only)."""
    data = bytearray(path.read_bytes())
    at = int(len(data) * where)
    for k in range(count):
        data[at + k] ^= 0xFF
    path.write_bytes(bytes(data))


BREAKS = {
    # case 1: a broken `latest`
    "latest names a missing directory": lambda c: (c / "latest").write_text("step_00000009\n"),
    "latest names a directory without its state": lambda c: (c / "step_00000004" / "state.pt").unlink(),
    "latest is empty": lambda c: (c / "latest").write_text(""),
    # case 5: a checkpoint's file truncated or empty
    "truncated weights": lambda c: _truncate(c / "step_00000004" / "model.safetensors"),
    "empty optimizer file": lambda c: (c / "step_00000004" / "optimizer.pt").write_bytes(b""),
    "optimizer file cut by 1 byte": lambda c: _truncate(c / "step_00000004" / "optimizer.pt", keep=0.9999),
    # a byte changed in place, the size kept
    "two bytes of the weights flipped": lambda c: _flip(c / "step_00000004" / "model.safetensors", 0.9, 2),
    "one byte of the optimizer state flipped": lambda c: _flip(c / "step_00000004" / "optimizer.pt", 0.95),
}


@pytest.mark.parametrize("broken", ["latest names a missing directory", "truncated weights"])
def test_a_broken_latest_resumes_from_the_newest_whole_checkpoint(four_steps, tmp_path, broken):
    """Cases 1 and 5 end to end: the run resumes from the newest whole checkpoint (step 4 when only `latest` is
    broken, step 2 when step 4's weights are truncated) with a warning naming what it passed over, ends with the
    weights of an uninterrupted run, and logs each step once (the killed run had logged step 5)."""
    out = _copy(four_steps, tmp_path)
    BREAKS[broken](out / "checkpoints")
    expected = 4 if broken.startswith("latest") else 2
    with pytest.warns(UserWarning, match="resume: passed over checkpoint") as caught:
        resumed = train(_cfg(out, "train.steps=6"))
    assert resumed.start_step == expected and resumed.final_step == 6
    said = " ".join(str(w.message) for w in caught)
    assert ("latest" if expected == 4 else "step_00000004: model.safetensors") in said, said
    assert _steps_logged(out) == [1, 2, 3, 4, 5, 6]
    whole = four_steps.parent / "whole"
    final = [_weights(run / "checkpoints" / "step_00000006") for run in (out, whole)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[1])


@pytest.fixture(scope="module")
def saved_twice(tmp_path_factory):
    """Checkpoints of a small model at steps 2 and 4 (``latest`` names step 4)."""
    root = tmp_path_factory.mktemp("saved")
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    for step in (2, 4):
        ck.save_checkpoint(root, model, opt, ck.Checkpoint(step, {}, {}), "")
    return root


@pytest.mark.parametrize("broken", list(BREAKS))
def test_resume_passes_over_each_kind_of_broken_checkpoint_naming_it(saved_twice, tmp_path, broken):
    root = tmp_path / "checkpoints"
    shutil.copytree(saved_twice, root)
    BREAKS[broken](root)
    model = torch.nn.Linear(4, 4)
    found, restored, skipped = ck.find_resumable(root, model, torch.optim.AdamW(model.parameters()))
    expected = 4 if broken.startswith("latest") and "without" not in broken else 2
    assert found == root / f"step_0000000{expected}" and restored.step == expected
    named = {
        "latest names a missing directory": "step_00000009 (named by latest): the directory does not exist",
        "latest names a directory without its state": "step_00000004: state.pt is missing",
        "latest is empty": "latest: empty or unreadable",
        "truncated weights": "step_00000004: model.safetensors has",
        "empty optimizer file": "step_00000004: optimizer.pt has 0 bytes",
        "optimizer file cut by 1 byte": "step_00000004: optimizer.pt has",
        "two bytes of the weights flipped": "step_00000004: model.safetensors is not what was written (its SHA-256",
        "one byte of the optimizer state flipped": "step_00000004: optimizer.pt is not what was written",
    }[broken]
    assert len(skipped) == 1 and skipped[0].startswith(named), skipped
    assert ck.latest_checkpoint(root) in (None, root / "step_00000004")


def test_with_no_whole_checkpoint_the_run_refuses_instead_of_starting_over(four_steps, tmp_path, capsys):
    out = _copy(four_steps, tmp_path)
    for step in ("step_00000002", "step_00000004"):
        (out / "checkpoints" / step / "model.safetensors").write_bytes(b"")
    args = ["train", "--config", "tpu_configs/cpu-smoke.yaml", *TINY, f"train.out_dir={out}", "train.steps=6"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "none can be resumed from" in err and "train.resume=false" in err, err
    assert "step_00000002: model.safetensors has 0 bytes" in err and "step_00000004" in err
    assert _steps_logged(out) == [1, 2, 3, 4, 5]  # nothing was overwritten
    # train.resume=false starts over and sets the earlier run's files aside, named
    assert main([*args, "train.resume=false"]) == 0
    assert "moved aside" in capsys.readouterr().out
    assert _steps_logged(out) == [1, 2, 3, 4, 5, 6]
    aside = sorted(p.name for p in out.iterdir() if ".replaced-" in p.name)
    assert [name.split(".replaced-")[0] for name in aside] == ["checkpoints", "metrics"]


def test_another_strategys_folder_and_a_finished_run_are_said_in_one_line(four_steps, tmp_path, capsys):
    """Resuming a folder another strategy wrote: one line naming the settings that differ and both ways out. A
    finished run started again with train.steps at or below its step: says so, exits 0, trains and writes nothing."""
    out = _copy(four_steps.parent / "whole", tmp_path)  # 6 steps, checkpoints at 4 and 6
    args = ["train", "--config", "tpu_configs/cpu-smoke.yaml", *TINY, f"train.out_dir={out}"]
    assert main([*args, "train.steps=8", "strategy=reversible"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "strategy.activations: 'none' -> 'reversible'" in err, err
    assert f"train.out_dir={out}-reversible" in err and "train.resume=false" in err, err
    before = _weights(out / "checkpoints" / "step_00000006")
    assert main([*args, "train.steps=4", "train.progress=true"]) == 0
    printed = capsys.readouterr()
    assert "nothing left to do: the run already reached train.steps=4 (its checkpoint is at step 6)" in printed.out
    assert "no step trained: step 6 of train.steps=4 was reached (loss " in printed.out, printed.out
    assert "step/s" not in printed.err, printed.err  # no progress bar for no step
    assert _steps_logged(out) == [1, 2, 3, 4, 5, 6]
    assert ck.latest_checkpoint(out / "checkpoints").name == "step_00000006"
    after = _weights(out / "checkpoints" / "step_00000006")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_killed_save_leaves_nothing_behind_and_a_failed_run_no_empty_metrics(four_steps, tmp_path, monkeypatch):
    """Case 10: the temporary directory of a save killed midway (another process's) is removed at the next start;
    a run that fails before its first step leaves no empty metrics.jsonl."""
    out = _copy(four_steps, tmp_path)
    stale = out / "checkpoints" / ".tmp-step_00000006-999999999"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    (out / "checkpoints" / ".latest-999999999").write_text("step_00000006\n")
    train(_cfg(out, "train.steps=5"))
    assert not [p.name for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]

    def failing_step(*args, **kwargs):
        def step(tokens):
            raise RuntimeError("the first step failed (injected)")

        return step

    monkeypatch.setattr(loop, "make_step", failing_step)
    fresh = tmp_path / "fresh"
    with pytest.raises(RuntimeError, match="injected"):
        train(_cfg(fresh, "train.steps=3"))
    assert not (fresh / "metrics.jsonl").exists()
    assert not (fresh / "run.lock").exists()  # released on the way out


def test_a_resumed_checkpoint_of_a_fused_optimizer_run_is_refused_by_name(tmp_path, capsys):
    """Case 5: a fused-optimizer run resumed without the fused optimizer (a KeyError before)."""
    fused = ["strategy.fused_optimizer=true", "optim.grad_clip=0"]
    args = ["train", "--config", "tpu_configs/cpu-smoke.yaml", *TINY, f"train.out_dir={tmp_path}", "train.steps=2"]
    assert main([*args, *fused]) == 0
    capsys.readouterr()
    assert main([*args, "train.steps=4", "optim.grad_clip=0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a fused optimizer" in err, err
    assert "strategy.fused_optimizer: True -> False" in err and "train.resume=false" in err


def test_a_full_disk_names_the_checkpoint_and_keeps_the_previous(tmp_path, monkeypatch):
    """Case 5: torch.save on a full disk raises "enforce fail ... unexpected pos"; the error names the checkpoint
    and the previous one, which stays `latest`."""
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters())
    state = ck.Checkpoint(1, {}, {})
    first = ck.save_checkpoint(tmp_path, model, opt, state, "")

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(ck.torch, "save", full)
    with pytest.raises(
        ck.CheckpointError, match=r"writing checkpoint .*step_00000002 failed .*GiB free.*unexpected pos"
    ):
        ck.save_checkpoint(tmp_path, model, opt, ck.Checkpoint(2, {}, {}), "")
    assert ck.latest_checkpoint(tmp_path) == first and not (tmp_path / "step_00000002").exists()


def test_a_second_run_on_the_same_out_dir_refuses_and_a_dead_runs_lock_is_taken_over(tmp_path, capsys):
    """Case 2: while a process holds the run lock, a second run refuses (no step, no file touched); once that
    process is gone its lock is stale and the next run takes it over, saying so."""
    from revlib_xla.train.rundir import LOCK

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid}))  # its lock
        args = ["train", "--config", "tpu_configs/cpu-smoke.yaml", *TINY, f"train.out_dir={tmp_path}", "train.steps=2"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"in use by another run (process {holder.pid} on" in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK]
    finally:
        holder.kill()
        holder.wait()
    assert main(args) == 0
    assert f"took over the stale run lock of process {holder.pid}" in capsys.readouterr().out
    assert _steps_logged(tmp_path) == [1, 2] and not (tmp_path / LOCK).exists()


def test_divergence_stops_the_run_naming_the_step_and_keeps_finite_checkpoints(tmp_path, capsys):
    """Case 3: a learning rate far too large makes the loss NaN within a few steps; the run stops with a one-line
    error naming the step (exit 1), and every checkpoint left holds finite weights (none was rotated away for a
    NaN one)."""
    args = ["train", "--config", "tpu_configs/cpu-smoke.yaml", *TINY, f"train.out_dir={tmp_path}"]
    args += ["train.steps=30", "optim.lr=1e12", "optim.warmup_steps=0", "train.checkpoint_every=1"]
    assert main([*args, "train.keep_checkpoints=2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the run stopped" in err and "train.nonfinite=skip" in err, err
    step = int(err.split("error: step ")[1].split(":")[0])
    assert 1 < step < 30 and ("the loss is NaN" in err or "the gradient norm is" in err or "inf" in err), err
    kept = ck.checkpoint_steps(tmp_path / "checkpoints")
    assert kept and ck.latest_checkpoint(tmp_path / "checkpoints") == kept[0]
    assert [int(p.name.split("_")[1]) for p in kept] == [step - 1, step - 2][: len(kept)]
    for path in kept:
        assert all(torch.isfinite(t).all() for t in _weights(path).values()), path


def test_weights_holding_nan_are_never_saved(tmp_path):
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters())
    first = ck.save_checkpoint(tmp_path, model, opt, ck.Checkpoint(1, {}, {}), "", keep=1)
    with torch.no_grad():
        model.weight[1, 2] = float("inf")
    with pytest.raises(ck.NonFiniteWeights, match=r"weight holds 1 non-finite value\(s\) \(inf\)"):
        ck.save_checkpoint(tmp_path, model, opt, ck.Checkpoint(2, {}, {}), "", keep=1)
    assert ck.checkpoint_steps(tmp_path) == [first] and ck.latest_checkpoint(tmp_path) == first


def test_skip_policy_drops_the_update_of_a_nan_step_and_trains_on(tmp_path, monkeypatch):
    """train.nonfinite=skip: step 3's loss is made NaN; its update is dropped (weights and optimizer state after
    step 3 equal those after step 2), the run continues and ends with finite weights."""
    real = strategy.lm_loss
    calls = []

    def nan_at_third(model, tokens):
        calls.append(1)
        loss = real(model, tokens)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(strategy, "lm_loss", nan_at_third)
    result = train(
        _cfg(tmp_path, "train.steps=5", "train.checkpoint_every=1", "train.keep_checkpoints=9", "train.nonfinite=skip")
    )
    assert result.skipped_steps == [3] and result.final_step == 5 and result.losses[5] == result.losses[5]
    before, after = (tmp_path / "checkpoints" / f"step_0000000{n}" for n in (2, 3))
    a, b = _weights(before), _weights(after)
    assert all(torch.equal(a[k], b[k]) for k in a)
    opt = [torch.load(d / "optimizer.pt", weights_only=False)["state"] for d in (before, after)]
    assert all(torch.equal(opt[0][n]["exp_avg"], opt[1][n]["exp_avg"]) for n in opt[0])
    assert not torch.equal(a["norm.weight"], _weights(tmp_path / "checkpoints" / "step_00000004")["norm.weight"])


@pytest.mark.parametrize(
    "override", ["optim.lr=.inf", "optim.lr=.nan", "optim.eps=.inf", "optim.grad_clip=.inf", "optim.weight_decay=.inf"]
)
def test_non_finite_hyperparameters_are_refused(override):
    with pytest.raises(ConfigError, match=f"{override.split('=')[0]}=(nan|inf).*finite"):
        load_config(None, [override])


def _uint32_tokens(tmp_path):
    path = tmp_path / "ids32.bin"
    np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint32).tofile(path)
    return path


def _binary_config(tmp_path):
    path = tmp_path / "config.bin"
    path.write_bytes(bytes(range(256)) * 4)
    return path


def _twice_config(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("optim:\n  lr: 3.0e-3\n  warmup_steps: 2\n  lr: 3.0\n")
    return path


@pytest.mark.parametrize(
    "make, overrides, expected",
    [
        (_binary_config, [], "is not a text file (not UTF-8)"),
        (_twice_config, [], "the key 'lr' is given twice in one mapping (lines 2 and 4); give each key once"),
        (None, ["model.overrides={dim: 32, dim: 64}"], "the key 'dim' is given twice"),
        (None, ["train.out_dir=FILE"], "is a file, not a directory"),
        (None, ["train.out_dir=FILE/run"], "train.out_dir='FILE/run': the directory cannot be created"),
        (
            _uint32_tokens,
            ["data.kind=tokens", "data.path=MADE"],
            "looks like a file of uint32 ids. Set data.token_dtype",
        ),
        (
            None,
            ["model.hf_config=gpt2-tiny", "model.overrides={}", "data.seq_len=512"],
            "data.seq_len=512 is longer than the 256 positions of the learned position embeddings",
        ),
    ],
    ids=[
        "binary config",
        "duplicated yaml key",
        "duplicated key in override",
        "out_dir a file",
        "out_dir under a file",
        "uint32 tokens as uint16",
        "gpt2 beyond its positions",
    ],
)
def test_bad_input_is_one_line_through_the_cli(tmp_path, capsys, make, overrides, expected):
    """Cases 8 and 9: each was an internal traceback (UnicodeDecodeError, FileExistsError, IndexError in the
    embedding) or silently accepted (the last duplicated key wins; every other uint16 id is 0)."""
    if "gpt2" in " ".join(overrides):
        pytest.importorskip("transformers")
    made = make(tmp_path) if make else None
    file = tmp_path / "a-file"
    file.write_text("")
    config = str(made) if make in (_binary_config, _twice_config) else "tpu_configs/cpu-smoke.yaml"
    overrides = [o.replace("MADE", str(made)).replace("FILE", str(file)) for o in overrides]
    if not any(o.startswith("train.out_dir") for o in overrides):
        overrides.append(f"train.out_dir={tmp_path / 'run'}")
    code = main(["train", "--config", config, *TINY, *overrides])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("revlib-xla train: error: ") and err.count("\n") == 1, err
    assert expected.replace("FILE", str(file)) in err, err


def test_an_unknown_chip_is_said_before_anything_is_built_or_announced(tmp_path, capsys, monkeypatch):
    """A wrong chip.name was reported only after the model was built and "writing to ..." was printed."""
    monkeypatch.setattr(strategy, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    code = main(
        ["train", "--config", "tpu_configs/cpu-smoke.yaml", *TINY, f"train.out_dir={tmp_path}", "chip.name=V5E"]
    )
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and not any(tmp_path.iterdir()), (out, err)
    assert err == (
        "revlib-xla train: error: chip.name='V5E' is not a known chip (did you mean 'v5e'?); choose one of v4, v5e, "
        "v5p, v6e, h100, h200, a100-40gb, a100-80gb, l4, t4\n"
    )


@pytest.mark.parametrize(
    "change, said",
    [
        ("train.seed=7", "train.seed: 0 -> 7"),
        ("data.batch_size=2", "data.batch_size: 4 -> 2"),
        ("data.seq_len=8", "data.seq_len: 16 -> 8"),
        ("strategy.precision=bf16", "strategy.precision: 'fp32' -> 'bf16'"),
    ],
)
def test_resuming_with_a_changed_seed_batch_length_or_precision_is_refused_by_name(
    four_steps, tmp_path, capsys, change, said
):
    """Issue 39, case 2: a resumed run with another seed (or batch, sequence length, precision) mixed two runs
    without a word, its final config.yaml saying the new seed. Refused, naming the change and the ways out; with
    train.resume_changed=true it continues from the checkpoint, and the log says with what."""
    out = _copy(four_steps, tmp_path)
    with pytest.raises(ck.CheckpointMismatch, match=r"other settings \(" + re.escape(said) + r"\).*mix two runs"):
        train(_cfg(out, "train.steps=6", change))
    assert _steps_logged(out) == [1, 2, 3, 4, 5]  # nothing was trained or written
    done = train(_cfg(out, "train.steps=6", change, "train.resume_changed=true"))
    assert done.start_step == 4 and done.final_step == 6
    assert (
        "train.resume_changed=true: resumed from step_00000004 with other settings (" + said in capsys.readouterr().out
    )


def test_skip_gives_up_on_steps_that_stay_nan_without_advising_what_is_set(tmp_path, monkeypatch):
    """Issue 39, case 7: when train.nonfinite=skip gives up (every step NaN), the error advised setting
    train.nonfinite=skip, which was set; it names the steps and advises a lower learning rate instead."""
    from revlib_xla.train.loop import MAX_SKIPPED_IN_A_ROW, DivergedError

    real = strategy.lm_loss
    monkeypatch.setattr(strategy, "lm_loss", lambda model, tokens: real(model, tokens) * float("nan"))
    with pytest.raises(DivergedError) as raised:
        train(_cfg(tmp_path, f"train.steps={MAX_SKIPPED_IN_A_ROW + 2}", "train.nonfinite=skip"))
    message = str(raised.value)
    assert f"{MAX_SKIPPED_IN_A_ROW} steps in a row" in message and "lower optim.lr" in message, message
    assert "set train.nonfinite=skip" not in message, message


def test_two_runs_taking_over_a_stale_lock_at_once_leave_one_holder(tmp_path):
    """Issue 39, case 3: with a dead run's lock in place, two restarts raced: both ended up holding the lock (the
    second deleted the first's fresh lock as stale). The lock is a flock now: the first takes it over (said so),
    the second is refused naming the first; once the first releases it, the next one takes it."""
    from revlib_xla.train.rundir import LOCK, RunDirError, RunLock

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    first, second = RunLock(tmp_path), RunLock(tmp_path)
    first.acquire()
    assert first.taken_over == f"process {dead.pid} on {socket.gethostname()} (no longer running)"
    with pytest.raises(RunDirError, match=rf"in use by another run \(process {os.getpid()} on"):
        second.acquire()
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()  # the first's lock, intact
    first.release()
    assert not (tmp_path / LOCK).exists()
    second.acquire()
    second.release()


def test_a_killed_runs_lock_is_let_go_by_the_kernel(tmp_path):
    """A run killed with SIGKILL while holding the lock: its flock goes with the process; the next run takes the
    lock (the file it left says who held it)."""
    from revlib_xla.train.rundir import LOCK, RunLock

    script = (
        "import sys, time\n"
        "from revlib_xla.train.rundir import RunLock\n"
        f"RunLock({str(tmp_path)!r}).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        from revlib_xla.train.rundir import RunDirError

        with pytest.raises(RunDirError, match=rf"process {holder.pid} on"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / LOCK).exists()
    lock = RunLock(tmp_path)
    lock.acquire()
    assert lock.taken_over is not None and str(holder.pid) in lock.taken_over
    lock.release()


def test_a_read_only_out_dir_is_one_line(tmp_path, capsys, monkeypatch):
    """Issue 39, case 6: an existing train.out_dir where the run lock cannot be written gave an OSError traceback."""
    import errno

    from revlib_xla.train import rundir

    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).endswith(rundir.LOCK):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(rundir.os, "open", read_only)
    args = ["train", "--config", "tpu_configs/cpu-smoke.yaml", *TINY, f"train.out_dir={tmp_path}", "train.steps=1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Read-only file system" in err and "give a writable train.out_dir" in err, err


@pytest.mark.parametrize("nonfinite", ["stop", "skip"])
def test_an_exact_stream_overflow_goes_through_train_nonfinite(tmp_path, capsys, nonfinite):
    """Issue 39, case 4: with optim.lr=1e6 the reversible stack's exact streams overflow at step 2, and the run
    ended in a raw FixedStreamError traceback naming no step, even under skip. ``stop``: a DivergedError naming the
    step, the layer and the checkpoint state; ``skip``: the step's update dropped and said so, until the skips in a
    row give up."""
    from revlib_xla.train.loop import MAX_SKIPPED_IN_A_ROW, DivergedError

    cfg = _cfg(tmp_path, "strategy=reversible", "optim.lr=1e6", "train.steps=12", f"train.nonfinite={nonfinite}")
    with pytest.raises(DivergedError) as raised:
        train(cfg)
    message = str(raised.value)
    if nonfinite == "stop":
        assert re.match(r"step \d+: the exact reversible streams overflowed \(ReversibleSequential: layer ", message)
        assert "the run stopped" in message and "train.nonfinite=skip" in message, message
    else:
        assert f"{MAX_SKIPPED_IN_A_ROW} steps in a row" in message, message
        said = capsys.readouterr().out
        assert re.search(r"step \d+: the exact reversible streams overflowed \(.*\): update skipped", said), said
