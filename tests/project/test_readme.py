"""The README and the manuals under ``docs/`` work as written.

Every ```python block of README.md and docs/*.md runs, as written, on the CPU. Blocks run in the order they appear;
the blocks of one section (a ``## `` heading and its subsections, in one file) share one namespace, so a block may
use what an earlier block of its section defined. A block whose first line says ``# needs CUDA``, ``# needs a TPU``
or ``# needs torch_xla`` is skipped, visibly, where that is missing (with the rest of its section, which may build
on it). The test finds whatever blocks the files hold: nothing here lists them. A section whose code runs on CUDA
where it can (a ``# needs CUDA`` block, or code that names ``cuda``) carries ``(cuda)`` in its test id, so that
``pytest -k cuda`` (bench/gpu_check.py on a GPU) runs it with the CUDA cases.

The README's command blocks (```bash) run in order, as a new user types them, in a copy of the repository's files
(no ``runs/``, no caches) with the environment's ``revlib-xla`` on the ``PATH``: each command must exit 0 without a
traceback. What cannot run here (installs from the network, a Google Cloud VM, the test suite itself) is set aside
by :data:`NOT_RUN`, each with why and what checks it instead; a command that matches nothing there runs.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from revlib_xla import backends

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: the files whose python blocks run: the front page, then the manuals
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
_NEEDS = {
    "cuda": torch.cuda.is_available,
    "a tpu": lambda: False,
    "torch_xla": lambda: backends.xla_available() and importlib.util.find_spec("libtpu") is not None,
}
_NAMES = {"cuda": "CUDA", "a tpu": "a TPU", "torch_xla": "torch_xla and libtpu"}


class Block(NamedTuple):
    line: int
    code: str


def fenced_blocks(text: str, languages: tuple[str, ...] = ("python",), name: str = "README.md"):
    """Section title -> its fenced blocks in one of ``languages``, in order."""
    sections: dict[str, list[Block]] = {}
    section, block, start, fence = "(before any section)", None, 0, False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if block is None and not fence and line.startswith("## "):
            section = line[3:].strip()
        elif block is None and not fence and stripped.startswith("```"):
            if stripped[3:] in languages:
                block, start = [], number + 1
            else:
                fence, start = True, number + 1
        elif fence and stripped == "```":
            fence = False
        elif block is not None and stripped == "```":
            sections.setdefault(section, []).append(Block(start, "\n".join(block) + "\n"))
            block = None
        elif block is not None:
            block.append(line)
    assert block is None and not fence, f"{name}: the fenced block at line {start} is never closed"
    return sections


def python_blocks(text: str) -> dict[str, list[Block]]:
    """Section title -> its ```python blocks, in order."""
    return fenced_blocks(text, ("python",))


def missing_hardware(block: Block):
    """What is missing ('CUDA', 'a TPU', 'torch_xla and libtpu') when the block's first line says it needs that
    and this machine has none, else None."""
    first = block.code.strip().splitlines()[0].lower() if block.code.strip() else ""
    need = re.match(r"#\s*needs\s+(cuda|a tpu|torch_xla)\b", first)
    if need and not _NEEDS[need.group(1)]():
        return _NAMES[need.group(1)]
    return None


def runs_cuda(blocks: list[Block]) -> bool:
    """Whether a section's code runs on CUDA where there is a GPU: a block marked ``# needs CUDA``, or code that
    names ``cuda`` (``torch.cuda.is_available()``, ``device="cuda"``)."""
    return any(re.search(r"\bcuda\b", block.code, re.IGNORECASE) for block in blocks)


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


#: "file: section" -> that section's python blocks, README.md first, then docs/*.md
SECTIONS = {
    f"{_name(path)}: {section}": blocks
    for path in DOCUMENTS
    for section, blocks in fenced_blocks(path.read_text(encoding="utf-8"), ("python",), _name(path)).items()
}


def section_id(section: str) -> str:
    return f"{section} (cuda)" if runs_cuda(SECTIONS[section]) else section


def test_blocks_are_found_by_section_and_hardware_marks_are_read():
    text = (
        "# t\n## One\n```python\nx = 1\n```\n```bash\nls\n```\n### Sub\n```python\n# needs a TPU\ny = x\n```\n"
        "## Two\n```python\n# Needs CUDA: a GPU\n```\n"
    )
    sections = python_blocks(text)
    assert list(sections) == ["One", "Two"]
    assert sections["One"] == [Block(4, "x = 1\n"), Block(11, "# needs a TPU\ny = x\n")]
    assert missing_hardware(sections["One"][0]) is None and missing_hardware(sections["One"][1]) == "a TPU"
    assert missing_hardware(sections["Two"][0]) == (None if torch.cuda.is_available() else "CUDA")
    assert runs_cuda(sections["Two"]) and not runs_cuda(sections["One"])
    assert runs_cuda([Block(1, "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n")])


def test_the_readme_and_the_manuals_have_python_blocks():
    readme = [name for name in SECTIONS if name.startswith("README.md: ")]
    assert len(readme) >= 1 and sum(len(blocks) for blocks in SECTIONS.values()) >= 20


@pytest.mark.parametrize("section", list(SECTIONS), ids=section_id)
@pytest.mark.slow
def test_readme_section_runs(section, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # whatever a block writes lands in a temporary directory
    namespace: dict[str, object] = {"__name__": "__readme__"}
    name = section.split(": ", 1)[0]
    for block in SECTIONS[section]:
        missing = missing_hardware(block)
        if missing:
            pytest.skip(
                f"{name} line {block.line} needs {missing}, which this machine lacks (and so does the "
                f"rest of its section)"
            )
        exec(compile(block.code, f"{name}:{block.line}", "exec"), namespace)


# -- the README's commands, in order ---------------------------------------------------------------------------------

#: Commands of the README's ```bash blocks that this test does not run: (pattern, why, what checks it instead).
NOT_RUN: list[tuple[str, str]] = [
    (r"git clone ", "clones from the network: this test runs in a copy of the repository's files instead"),
    (
        r"pip install ",
        "installs from the network: CI's two environments are installed from this repository the same way "
        "(`make venv`: the pinned stack with every extra; `make venv-newer`: torch's CPU build and `.[test]`)",
    ),
    (r"make (test|test-all|test-fast|test-slow|test-newer)\b", "the test suite itself, which CI runs"),
    (r"make docs\b", "`make lint` (part of `make test`) builds the site with mkdocs --strict"),
    (
        r"make demo\b",
        "builds `.venv` first; its two commands run in `make test-all`: "
        "test_make_demo_runs_the_cli_then_the_depth_table",
    ),
]


def command_lines(text: str) -> list[tuple[int, str]]:
    """The commands of a document's ```bash blocks, in order: (line, command), a command continued with ``\\``
    joined into one, comments and blank lines left out."""
    commands: list[tuple[int, str]] = []
    for blocks in fenced_blocks(text, ("bash", "sh")).values():
        for block in blocks:
            pending, first = "", 0
            for offset, line in enumerate(block.code.splitlines()):
                code = line if pending else line.split("  #", 1)[0]
                if not pending and (not code.strip() or code.lstrip().startswith("#")):
                    continue
                first = first if pending else block.line + offset
                if pending:
                    code = code.lstrip()
                if code.rstrip().endswith("\\"):
                    pending += code.rstrip()[:-1].rstrip() + " "
                    continue
                commands.append((first, (pending + code).split("  #", 1)[0].strip()))
                pending = ""
    return commands


def not_run(command: str) -> str | None:
    """Why :data:`NOT_RUN` sets ``command`` aside, or None when it runs."""
    return next((why for pattern, why in NOT_RUN if re.match(pattern, command)), None)


def test_command_lines_are_read_in_order_with_continuations_and_comments():
    text = (
        "# t\n```bash\nls -a   # list\n# a comment\n\necho a \\\n    b  # joined\n```\n"
        "```python\nx = 1\n```\n## S\n```sh\npip install x\n```\n"
    )
    assert command_lines(text) == [(3, "ls -a"), (6, "echo a b"), (14, "pip install x")]
    assert not_run("pip install -e '.[hf]'") and not_run("make test-all") and not not_run("revlib-xla train")


def _copy_of_the_repository(into: Path) -> Path:
    """The repository's tracked files as they are now (edits included), without runs/, caches or build outputs."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


@pytest.mark.slow
def test_the_readme_commands_run_in_order_on_a_fresh_copy(tmp_path):
    """Each command of the README's ```bash blocks, in order, as a new user types them: exit status 0, no traceback,
    and no PJRT warning from a command that does not use XLA. Later commands see what earlier ones wrote (the runs'
    folders), as a user's would."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the repository's git checkout (to list its files)")
    work = _copy_of_the_repository(tmp_path / "clone")
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "PYTHONPATH")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(work)  # the copy's code, whatever the environment's install points at
    ran, skipped = [], []
    for line, command in command_lines(README.read_text(encoding="utf-8")):
        why = not_run(command)
        if why:
            skipped.append(command)
            continue
        assert command.startswith("revlib-xla "), f"README.md line {line}: {command!r} matches nothing in NOT_RUN"
        done = subprocess.run(
            ["bash", "-o", "pipefail", "-c", command], cwd=work, env=env, capture_output=True, text=True, timeout=900
        )
        where = f"README.md line {line}: {command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        assert done.returncode == 0, where
        assert "Traceback" not in done.stderr, where
        if "memory" not in command and "plan" not in command.split()[1:2]:
            assert "PJRT_DEVICE" not in done.stderr, where
        ran.append(command)
    assert any(c.startswith("revlib-xla train") for c in ran) and skipped, (ran, skipped)
    assert (work / "runs" / "cpu-smoke" / "checkpoints" / "latest").exists()


@pytest.mark.slow
def test_make_demo_runs_the_cli_then_the_depth_table(tmp_path):
    """``make demo``, on the environment this test runs in: its train command, then the depth table."""
    if shutil.which("make") is None or shutil.which("git") is None:
        pytest.skip("needs make and git")
    work = _copy_of_the_repository(tmp_path / "clone")
    prefix = Path(sys.executable).parent.parent
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(work)
    done = subprocess.run(
        ["make", "-o", f"{prefix}/.installed", f"VENV={prefix}", "demo"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (work / "runs" / "demo" / "checkpoints" / "latest").exists()


def test_every_relative_link_of_the_readme_and_the_manuals_leads_to_a_file():
    """Links to the repository's files (results, configs, code, notebooks, other manuals) resolve where the page
    is; anchors between pages are checked by ``make docs`` (mkdocs --strict, part of ``make lint``)."""
    broken = []
    for path in DOCUMENTS:
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            if not (path.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{_name(path)}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_config_sections_named_in_the_cli_manual_and_help_are_the_schemas():
    """docs/cli.md and ``revlib-xla train``'s docstring name the config's sections, counted and in order, as the
    typed schema has them."""
    from revlib_xla.cli import train as train_cli
    from revlib_xla.train.config import RunConfig

    sections = list(RunConfig.model_fields)
    words = {5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}
    manual = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert f"A config is YAML with {words[len(sections)]} sections" in manual
    paragraph = manual.split("A config is YAML with", 1)[1].split("Overrides are", 1)[0]
    named = [n for n in dict.fromkeys(re.findall(r"`(\w+)`", paragraph)) if n in sections]
    assert named == sections, named
    doc = " ".join((train_cli.__doc__ or "").split())
    assert f"{words[len(sections)]} sections (" + ", ".join(f"``{s}``" for s in sections) in doc, doc[:300]


def test_the_layout_page_names_every_module_and_only_paths_that_exist():
    """docs/layout.md has a row for each module and package of ``revlib_xla/`` (a row names ``revlib_xla/x/`` or
    ``revlib_xla/x.py``, or ``x.py`` after a ``revlib_xla/`` path in its first cell), and every path it names is
    there."""
    page = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    first_cells = [line.split("|")[1] for line in page.splitlines() if line.startswith("| `")]
    named: set[str] = set()
    for cell in first_cells:
        paths = re.findall(r"`([^`]+)`", cell)
        base = "revlib_xla" if paths and paths[0].startswith("revlib_xla/") else ""
        for path in paths:
            full = path if "/" in path or not base else f"{base}/{path}"
            assert (ROOT / full).exists(), f"docs/layout.md names {path!r} ({full}), which does not exist"
            named.add(full.rstrip("/"))
    package = ROOT / "revlib_xla"
    modules = {
        f"revlib_xla/{entry.name}"
        for entry in package.iterdir()
        if (entry.suffix == ".py" or (entry.is_dir() and (entry / "__init__.py").exists()))
    }
    assert not modules - named, f"modules without a row in docs/layout.md: {sorted(modules - named)}"
