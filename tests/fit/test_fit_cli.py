"""``revlib-xla memory`` and ``revlib-xla plan``: the step ``revlib-xla train`` runs, sized for a TPU chip without
one (deviceless compiles), per strategy; bad input as one-line errors (exit 2)."""

from __future__ import annotations

import importlib.util
import re

import pytest

from revlib_xla import backends
from revlib_xla.cli import main
from revlib_xla.fit.plan import compress_ops
from revlib_xla.planner import Op

needs_xla = pytest.mark.skipif(not backends.xla_available(), reason="torch_xla is not installed")
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (pip install 'revlib_xla[tpu-compile]')"
)


def compiles(test):
    """A test that compiles deviceless for a TPU: slow, and needs torch_xla and libtpu."""
    return pytest.mark.slow(needs_xla(needs_libtpu(test)))


SMOKE = "tpu_configs/cpu-smoke.yaml"
TINY = ["data.seq_len=32", "data.batch_size=2"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_operations_are_written_compressed():
    ops = [Op("CF", i) for i in range(6)] + [Op("Fe", 6), Op("Fe", 7), Op("L", 8), Op("B", 7), Op("B", 6)]
    for i in range(5, -1, -1):
        ops += [Op("Fe", i), Op("B", i)]
    assert compress_ops(ops) == "CF_0..5 Fe_6..7 L B_7..6 (Fe_i B_i) for i 5..0"
    assert compress_ops([Op("Fe", 0, 1), Op("Fe", 1, 1), Op("B", 1)]) == "Fe_0..1[1] B_1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--chips", "3"], "--chips 3: no v5e slice of 3 chips to compile for; choose one of 1, 4, 8, 16"),
        (["--chips", "4", "mesh.fsdp=8"], "--chips 4: mesh: mesh.data=1, mesh.fsdp=8, mesh.tensor=1 multiplies to 8"),
        (["--chip", "v9"], "--chip: unknown TPU chip 'v9'; choose one of v4, v5e, v5p, v6e"),
        (["--chip", "h100"], "--chip: unknown TPU chip 'h100'"),
        (["--gpu", "v5e"], "--gpu: unknown GPU chip 'v5e'; choose one of h100"),
        (["--strategies", "none,magic"], "--strategies: unknown strategy 'magic'; choose from config, none"),
        (["model.name=llama-99b"], "llama-99b"),
        (["--gpu", "h100", "--max-batch", "--limit", "0"], "--limit 0: the largest batch --max-batch tries (>= 1)"),
    ],
)
def test_memory_bad_input_is_one_line_with_exit_2(capsys, argv, message):
    code, _, err = run(capsys, "memory", "--config", SMOKE, *argv)
    assert code == 2 and message in err and "Traceback" not in err
    assert err.startswith("revlib-xla memory: error: ") and err.count("\n") == 1


def test_plan_bad_budget_is_one_line(capsys):
    code, _, err = run(capsys, "plan", "--config", SMOKE, "--budget", "lots")
    assert code == 2 and err.startswith("revlib-xla plan: error: --budget='lots': expected a number of bytes")
    code, _, err = run(capsys, "plan", "--config", SMOKE, "--budget", "1GiB", "--chip", "v9")  # the flag typed
    assert (
        code == 2 and err == "revlib-xla plan: error: --chip: unknown TPU chip 'v9'; choose one of v4, v5e, v5p, v6e\n"
    )


@compiles
def test_memory_prints_each_strategy_with_its_parts_and_the_verdict(capsys):
    code, out, err = run(capsys, "memory", "--config", SMOKE, "--strategies", "none,reversible", *TINY)
    assert code == 0, err
    lines = out.splitlines()
    assert "from the TPU compiler (deviceless libtpu), not a TPU run" in lines[0]
    rows = {line.split()[0]: line for line in lines if line.split()[:1] in (["none"], ["reversible"])}
    assert set(rows) == {"none", "reversible"}
    assert all("yes (15.75 GiB)" in row for row in rows.values())
    assert "gradients+activations+temporaries" in out and "total minus the arguments" in out


@compiles
def test_memory_max_batch_per_strategy(capsys):
    code, out, err = run(capsys, "memory", "--config", SMOKE, "--strategies", "none", "--max-batch", *TINY)
    assert code == 0, err
    assert "largest batch" in out or "does not fit" in out


@compiles
def test_plan_prints_the_schedule_with_its_predictions(capsys):
    code, out, err = run(capsys, "plan", "--config", SMOKE, "--budget", "3MiB", *TINY)  # least: 2.25 MiB
    assert code == 0, err
    assert "predicted time:" in out and "FLOP per step" in out and "predicted memory:" in out
    assert "stages:" in out and "operations (" in out
    code, _, err = run(capsys, "plan", "--config", SMOKE, "--budget", "1KiB", *TINY)
    assert code == 2 and "the smallest budget for this model and input is" in err
    assert "pass a larger --budget" in err and "mem_limit" not in err and "Checkpointable" not in err, err


def test_memory_without_torch_xla_says_what_to_install(capsys, monkeypatch):
    """Where torch_xla or the TPU compiler is missing (a CUDA or CPU-only install), one line says what to install."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    code, _, err = run(capsys, "memory", "--config", SMOKE, "--chip", "v5e")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert re.search(
        r"which needs (\S+, )*libtpu \(not installed here\): pip install 'revlib_xla\[xla,tpu-compile\]'", err
    )


def test_plan_without_torch_xla_says_what_to_install_and_what_works(capsys, monkeypatch):
    """``revlib-xla plan`` in a core install (no torch_xla, jax or libtpu; ``make test-newer`` runs it there as it
    is): one line, exit 2, naming what to install and the GPU estimate that needs none of them."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    code, out, err = run(capsys, "plan", "--config", SMOKE, "--budget", "8GiB", *TINY)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and out == "", (out, err)
    assert re.search(
        r"which need (\S+, )*libtpu \(not installed here\): pip install 'revlib_xla\[xla,tpu-compile\]'", err
    )
    assert "revlib-xla memory --gpu NAME --strategies plan" in err


def test_memory_help_lists_the_strategies_the_table_prints(capsys):
    """``memory --help`` named 7 strategies where the table printed 10: its default list is the table's rows, and
    with the rest it names every strategy ``--strategies`` accepts."""
    from revlib_xla.fit.strategies import DEFAULT_COMPARISON, GPU_COMPARISON, STRATEGIES

    with pytest.raises(SystemExit):
        main(["memory", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    found = re.search(
        r"to compare; default: (.*?); on a GPU \(--gpu\) also (\S+) \(.*?\); also: (.*?)(?: \(|$| --| -h| key=value)",
        text,
    )
    assert found, text
    default = [name.split(" (")[0] for name in found.group(1).split(", ")]
    gpu_only, also = found.group(2), found.group(3).split(", ")
    assert default == ["config", *DEFAULT_COMPARISON]
    assert sorted(GPU_COMPARISON) == sorted([*DEFAULT_COMPARISON, gpu_only])
    assert sorted(default + [gpu_only] + also) == sorted(STRATEGIES)


def test_a_stopped_sizing_deletes_its_temporary_folder_and_stops_its_compiler(tmp_path):
    """SIGTERM while the deviceless compiler runs (``revlib-xla memory`` killed, as ``timeout`` does): the command
    says so in one line and exits 143, its ``revlib_xla_tpu_*`` folder is gone and its compiler process stopped (both
    were left behind). A stand-in compiler that waits keeps it fast."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "waiting_compiler.py").write_text(
        "import os, sys, time\n"
        "def tpu_environment(topology, hbm_only=False):\n"
        "    return dict(os.environ)\n"
        "if __name__ == '__main__':\n"
        "    open(os.environ['COMPILER_PID'], 'w').write(str(os.getpid()))\n"
        "    time.sleep(120)\n"
    )
    script = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
        "import waiting_compiler\n"
        "from revlib_xla.compiled import memory\n"
        "from revlib_xla.cli import long_running\n"
        "with long_running('memory'):\n"
        "    memory._run_tpu_worker(['module'], 'v5e:2x2', 0, 120.0, waiting_compiler)\n"
    )
    temp, pid_file = tmp_path / "tmp", tmp_path / "compiler.pid"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp), "COMPILER_PID": str(pid_file)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        assert [p.name.startswith("revlib_xla_tpu_") for p in temp.iterdir()] == [True]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        compiler = int(pid_file.read_text()) if pid_file.exists() and pid_file.read_text() else None
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.splitlines()[-1] == "revlib-xla memory: stopped by SIGTERM", err
    assert list(temp.iterdir()) == []
    try:
        os.kill(compiler, 0)
    except ProcessLookupError:
        pass
    else:
        os.kill(compiler, signal.SIGKILL)
        pytest.fail("the compiler process was left running")
