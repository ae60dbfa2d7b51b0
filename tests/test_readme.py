"""Every ```python block of README.md runs, as written, on the CPU (issue 15).

Blocks run in the order they appear; the blocks of one section (a ``## `` heading and its subsections) share one
namespace, so a block may use what an earlier block of its section defined. A block whose first line says
``# needs CUDA``, ``# needs a TPU`` or ``# needs torch_xla`` is skipped, visibly, where that is missing (with the
rest of its section, which may build on it). The test finds whatever blocks the README holds: nothing here lists them.
A section whose code runs on CUDA where it can (a ``# needs CUDA`` block, or code that names ``cuda``) carries
``(cuda)`` in its test id, so that ``pytest -k cuda`` (bench/gpu_check.py on a GPU) runs it with the CUDA cases.
"""

import importlib.util
import re
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from revlib_xla import backend

README = Path(__file__).resolve().parents[1] / "README.md"
_NEEDS = {
    "cuda": torch.cuda.is_available,
    "a tpu": lambda: False,
    "torch_xla": lambda: backend.xla_available() and importlib.util.find_spec("libtpu") is not None,
}
_NAMES = {"cuda": "CUDA", "a tpu": "a TPU", "torch_xla": "torch_xla and libtpu"}


class Block(NamedTuple):
    line: int
    code: str


def python_blocks(text: str) -> dict[str, list[Block]]:
    """Section title -> its ```python blocks, in order."""
    sections: dict[str, list[Block]] = {}
    section, block, start = "(before any section)", None, 0
    for number, line in enumerate(text.splitlines(), 1):
        if block is None and line.startswith("## "):
            section = line[3:].strip()
        elif block is None and line.strip() == "```python":
            block, start = [], number + 1
        elif block is not None and line.strip() == "```":
            sections.setdefault(section, []).append(Block(start, "\n".join(block) + "\n"))
            block = None
        elif block is not None:
            block.append(line)
    assert block is None, f"README.md: the ```python block at line {start} is never closed"
    return sections


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


SECTIONS = python_blocks(README.read_text(encoding="utf-8"))


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


def test_the_readme_has_python_blocks():
    assert sum(len(blocks) for blocks in SECTIONS.values()) >= 6


@pytest.mark.parametrize("section", list(SECTIONS), ids=section_id)
@pytest.mark.slow
def test_readme_section_runs(section, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # whatever a block writes lands in a temporary directory
    namespace: dict[str, object] = {"__name__": "__readme__"}
    for block in SECTIONS[section]:
        missing = missing_hardware(block)
        if missing:
            pytest.skip(
                f"README.md line {block.line} needs {missing}, which this machine lacks (and so does the "
                f"rest of its section)"
            )
        exec(compile(block.code, f"README.md:{block.line}", "exec"), namespace)
