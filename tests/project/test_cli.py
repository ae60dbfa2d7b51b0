"""The ``revlib-xla`` dispatcher: subcommand lookup, usage errors as one line, exit codes."""

from __future__ import annotations

import argparse
import types

import pytest

from revlib_xla import cli


def _fake_command(monkeypatch: pytest.MonkeyPatch, name: str, run) -> None:
    module = types.ModuleType(f"revlib_xla.cli.{name}")

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--value", type=int, default=0)

    module.add_arguments = add_arguments  # type: ignore[attr-defined]
    module.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, f"revlib_xla.cli.{name}", module)


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert name in out


def test_unknown_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["trian"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'trian'" in capsys.readouterr().err


def test_subcommand_runs_with_its_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    _fake_command(monkeypatch, "plan", lambda args: seen.append(args.value) or 0)
    assert cli.main(["plan", "--value", "7"]) == 0
    assert seen == [7]


def test_usage_error_is_one_line_without_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(args: argparse.Namespace) -> int:
        raise cli.UsageError("unknown chip 'v9'; choose one of v4, v5e")

    _fake_command(monkeypatch, "memory", run)
    assert cli.main(["memory"]) == 2
    err = capsys.readouterr().err
    assert err == "revlib-xla memory: error: unknown chip 'v9'; choose one of v4, v5e\n"


def test_other_errors_are_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(args: argparse.Namespace) -> int:
        raise RuntimeError("a bug")

    _fake_command(monkeypatch, "memory", run)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["memory"])


def test_import_and_help_import_neither_torch_nor_torch_xla() -> None:
    """``import revlib_xla`` and ``revlib-xla [COMMAND] --help`` import neither torch nor torch_xla (so help answers
    at once, and nothing prints torch_xla's PJRT warning), in a fresh interpreter without ``PJRT_DEVICE``."""
    import os
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import revlib_xla\n"
        "heavy = lambda: sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'torch_xla', 'jax'})\n"
        "print('@@ import', heavy())\n"
        "from revlib_xla.cli import COMMANDS, main\n"
        "for argv in (['--help'], *([name, '--help'] for name in COMMANDS)):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as stop:\n"
        "        assert stop.code == 0, (argv, stop.code)\n"
        "    print('@@', argv[0], heavy())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("@@ ")]
    assert lines == [f"@@ {what} []" for what in ("import", "--help", *cli.COMMANDS)], done.stdout[-3000:]
    assert "PJRT" not in done.stderr, done.stderr
