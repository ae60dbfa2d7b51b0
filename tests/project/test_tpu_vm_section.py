"""The CLI manual's "Train on a Cloud TPU VM" (docs/cli.md): its table and commands agree with the configs in
tpu_configs/ and with the pinned stack (we have no TPU VM to run them on; this is what can be checked without one)."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHIP_OF_ACCELERATOR = {"v5litepod": "v5e", "v5p": "v5p", "v6e": "v6e", "v4": "v4"}


def _section() -> str:
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    start = text.index("## Train on a Cloud TPU VM")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def _rows() -> list[tuple[str, str, str, str]]:
    rows = re.findall(r"^\| `(tpu_configs/[\w.-]+\.yaml)` \| `([\w-]+)` \| `([\w.-]+)` \| (\w+)", _section(), re.M)
    assert rows, "the section's table lists no config"
    return rows


def test_every_tpu_config_is_in_the_table() -> None:
    listed = {row[0] for row in _rows()}
    shipped = {f"tpu_configs/{p.name}" for p in (ROOT / "tpu_configs").glob("*.yaml") if p.stem != "cpu-smoke"}
    assert listed == shipped


@pytest.mark.parametrize("row", _rows(), ids=lambda row: row[0])
def test_the_table_matches_the_config(row: tuple[str, str, str, str]) -> None:
    from revlib_xla.train.config import load_config

    path, accelerator, version, chip = row
    header = (ROOT / path).read_text(encoding="utf-8")
    create = re.search(r"gcloud compute tpus tpu-vm create .*", header)
    assert create is not None, f"{path} states no gcloud create command"
    assert f"--accelerator-type={accelerator}" in create.group(0)
    assert f"--version={version}" in create.group(0)
    assert CHIP_OF_ACCELERATOR[accelerator.rsplit("-", 1)[0]] == chip
    assert load_config(ROOT / path).chip.name == chip


def test_the_install_line_is_the_pinned_stack() -> None:
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    xla = setup["options.extras_require"]["xla"].split()
    constraints = (ROOT / "constraints.txt").read_text(encoding="utf-8")
    torch_pin = re.search(r"^torch==([\d.]+)$", constraints, re.M)
    assert torch_pin is not None
    install = re.search(r"^pip install torch==([\d.]+) 'torch_xla\[tpu\]==([\d.]+)'$", _section(), re.M)
    assert install is not None, "the section has no pip install line for torch and torch_xla"
    assert install.group(1) == torch_pin.group(1)
    assert f"torch_xla=={install.group(2)}" in xla
    for path, *_ in _rows():
        assert f"revlib-xla train --config {path}" in (ROOT / path).read_text(encoding="utf-8")
