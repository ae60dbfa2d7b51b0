"""The project's own tooling: registered pytest markers, what `make test-fast` selects, and the pre-commit hooks'
ruff pin. Each check runs the real tool (pytest, make) in a subprocess on this checkout."""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Known slow tests (measured, see README "Testing") in a module that collects quickly.
SLOW = ["test_long_chain", "test_discretization_stays_within_the_limit", "test_optimal_against_exhaustive_search"]
FAST = ["test_extensions_lower_the_time"]


def _pytest(*args, cwd=ROOT):
    """pytest in a subprocess, without tests/conftest.py (which starts torch_xla's runtime): seconds, not tens."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--noconftest", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_markers_are_registered_and_strict(tmp_path):
    """`slow` is registered; under --strict-markers (setup.cfg's addopts) an unregistered mark is an error."""
    shown = _pytest("--markers")
    assert re.search(r"^@pytest\.mark\.slow: ", shown.stdout, re.M), shown.stdout[-2000:]
    (tmp_path / "test_marks.py").write_text(
        "import pytest\n\n@pytest.mark.slow\ndef test_a():\n    pass\n\n@pytest.mark.slwo\ndef test_b():\n    pass\n"
    )
    run = _pytest("-c", str(ROOT / "setup.cfg"), "--rootdir", str(tmp_path), "-q", str(tmp_path / "test_marks.py"))
    assert run.returncode != 0
    assert "'slwo' not found in `markers` configuration option" in run.stdout + run.stderr


def _test_fast_marker_expression():
    """The -m expression of `make test-fast`, read from make's dry run of the target."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    dry = subprocess.run(["make", "-n", "test-fast"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    line = next(line for line in dry.stdout.splitlines() if " pytest " in line)
    words = shlex.split(line)
    return words[words.index("-m", words.index("pytest")) + 1]


def test_make_test_fast_deselects_the_slow_tests():
    expression = _test_fast_marker_expression()
    assert expression == "not slow"
    module = "tests/planner/test_planner.py"
    source = (ROOT / module).read_text()
    assert all(f"\ndef {name}(" in source for name in SLOW + FAST)  # the tests exist
    run = _pytest("--collect-only", "-q", "-m", expression, module)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    fast = {line.split("::")[1].split("[")[0] for line in run.stdout.splitlines() if "::" in line}
    assert not set(SLOW) & fast
    assert set(FAST) <= fast
    deselected = re.search(r"\((\d+) deselected\)", run.stdout)
    assert deselected and int(deselected.group(1)) >= len(SLOW)


def test_pre_commit_ruff_is_the_pinned_ruff():
    """The pre-commit ruff hooks run the ruff version that constraints.txt pins (and `make lint` installs)."""
    config = (ROOT / ".pre-commit-config.yaml").read_text()
    rev = re.search(r"repo: https://github\.com/astral-sh/ruff-pre-commit\s+rev: v(\S+)", config)
    pin = re.search(r"^ruff==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert rev and pin
    assert rev.group(1) == pin.group(1)
    for hook in ("ruff-check", "ruff-format", "mypy"):
        assert re.search(rf"- id: {hook}\n", config), hook


def test_test_modules_have_unique_basenames_and_no_packages():
    """tests/ runs under pytest's default import mode (prepend, no ``__init__.py``): each module is imported by its
    basename from its own folder, so two modules of one basename in two folders would collide, and the helpers
    (``import fake_family``) and ``from conftest import`` rely on the folders not being packages."""
    modules = sorted((ROOT / "tests").rglob("*.py"))
    assert not [p for p in modules if p.name == "__init__.py"]
    names = [p.name for p in modules]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_the_ci_and_slow_lists_name_test_files_that_exist():
    """tests/ci_slow.txt and tests/slow_measured.txt select by node id (or its prefix): a line naming a moved or
    deleted file would silently select nothing."""
    for listing in ("ci_slow.txt", "slow_measured.txt"):
        lines = (ROOT / "tests" / listing).read_text().splitlines()
        ids = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
        assert ids, listing
        missing = sorted({i.split("::")[0] for i in ids if not (ROOT / i.split("::")[0]).is_file()})
        assert missing == [], f"{listing} names files that do not exist: {missing}"
