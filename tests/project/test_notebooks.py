"""The Colab notebooks (``colab/*.ipynb``) run top to bottom, on the CPU, with small sizes.

Each notebook has one code cell tagged ``parameters`` holding its sizes for Colab; :data:`NOTEBOOKS` gives the
small ones CI runs with, which are injected as a cell right after it (papermill's convention, done here with
nbclient alone). Cells tagged ``skip-execution`` (the Colab-only ``%pip install``) are skipped. The kernel inherits
this process's environment with ``PJRT_DEVICE=CPU`` and matplotlib's Agg backend. A notebook whose library part is
not there yet (a module of a parallel branch) is skipped with a reason naming the module, only while it is missing.

The repository holds notebooks without outputs: :func:`test_notebooks_are_committed_without_outputs` fails on any
output, execution count or per-run metadata (``make lint`` also runs ``nbstripout --verify``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]
COLAB = ROOT / "colab"

REPOSITORY = "https://github.com/revlib-xla/revlib_xla"
"""Where the notebooks are published (a placeholder until the project's home is public): the install cells clone or
pip-install it, and the "Open in Colab" badges of docs/notebooks.md point at its ``colab/`` folder through
:data:`COLAB_URL`."""
COLAB_URL = "https://colab.research.google.com/github/" + REPOSITORY.removeprefix("https://github.com/")
COLAB_URL += "/blob/main/colab/{name}"

CELL_TIMEOUT = 240
"""Seconds one cell may run in CI before the kernel is interrupted and the test fails."""


REPO_ROOT = "<the repository root>"
"""A CI parameter value replaced by this checkout's root directory."""
TMP_DIR = "<a fresh temporary directory>"
"""A CI parameter value replaced by a fresh directory (what a notebook writes goes there, not into the checkout)."""


@dataclasses.dataclass(frozen=True)
class Notebook:
    name: str
    parameters: dict[str, Any]  # the CI sizes, each a name assigned in the notebook's `parameters` cell
    requires: tuple[str, ...] = ()  # library modules it needs; while one is missing, its run is skipped


NOTEBOOKS = [
    Notebook("quickstart.ipynb", {"depths": [2, 4, 8], "width": 16, "tokens": 64}),
    Notebook("fewbit.ipynb", {"activations": ["gelu", "tanh"], "elements": 2**16, "width": 32, "rows": 128}),
    Notebook(
        "huggingface.ipynb",
        {
            "model_name": None,
            "tiny_layers": 2,
            "batch": 2,
            "seq_len": 64,
            "steps": 12,
            "lr": 3e-3,
            "corpus_chars": 200_000,
        },
        requires=("transformers", "revlib_xla.hf"),
    ),
    Notebook(
        "tpu_v5e.ipynb",
        {
            "repo": REPO_ROOT,
            "config": "tpu_configs/cpu-smoke.yaml",
            "strategies": "none,reversible",
            "max_batch": False,
            "steps": 4,
            "log_every": 1,
            "out_dir": TMP_DIR,
        },
        # revlib-xla memory traces with torch_xla and compiles with libtpu (absent from make test-newer's env)
        requires=("revlib_xla.cli.train", "revlib_xla.cli.memory", "torch_xla", "jax", "libtpu"),
    ),
    Notebook(
        "planner.ipynb", {"width": 32, "depth": 2, "seq_len": 32, "batch": 2, "fractions": [0.0, 1.0], "sweep": 4}
    ),
]


def _read(name: str) -> Any:
    return nbformat.read(COLAB / name, as_version=4)


def _tagged(nb: Any, tag: str) -> list[Any]:
    return [cell for cell in nb.cells if tag in cell.get("metadata", {}).get("tags", [])]


def _with_parameters(nb: Any, parameters: dict[str, Any]) -> Any:
    """``nb`` with a cell assigning ``parameters`` right after its ``parameters`` cell, whose names it must assign
    (a misspelt CI parameter would otherwise run the notebook at its full Colab size)."""
    (cell,) = _tagged(nb, "parameters")
    assigned = {
        target.id
        for node in ast.parse(cell.source).body
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    unknown = set(parameters) - assigned
    assert not unknown, f"CI parameters {sorted(unknown)} are not assigned in the parameters cell ({sorted(assigned)})"
    source = "# Parameters injected by tests/project/test_notebooks.py\n" + "".join(
        f"{key} = {value!r}\n" for key, value in parameters.items()
    )
    injected = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(nb.cells.index(cell) + 1, injected)
    return nb


def _missing(modules: tuple[str, ...]) -> list[str]:
    missing = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            missing.append(module)
    return missing


def execute(nb: Any, parameters: dict[str, Any], monkeypatch: pytest.MonkeyPatch, cwd: Path = COLAB) -> Any:
    """Run notebook ``nb`` with ``parameters`` injected in a fresh python3 kernel started in ``cwd``; the executed
    notebook, or ``nbclient.exceptions.CellExecutionError`` naming the failing cell."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    client = nbclient.NotebookClient(
        _with_parameters(nb, parameters),
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(cwd)}},
        skip_cells_with_tag="skip-execution",
    )
    return client.execute()


def _outputs_text(nb: Any) -> str:
    text = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            text.append(output.get("text", "") or "".join(output.get("data", {}).get("text/plain", "")))
    return "\n".join(text)


@pytest.mark.slow  # a kernel start, torch's import and the notebook: 10 s or more on a loaded 2-core machine
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[n.name for n in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(notebook: Notebook, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = _missing(notebook.requires)
    if missing:
        pytest.skip(f"{notebook.name} needs {', '.join(missing)}, not installed here")
    start = time.perf_counter()
    where = {REPO_ROOT: str(ROOT), TMP_DIR: str(tmp_path)}
    parameters = {
        key: where.get(value, value) if isinstance(value, str) else value for key, value in notebook.parameters.items()
    }
    nb = execute(_read(notebook.name), parameters, monkeypatch)
    elapsed = time.perf_counter() - start
    executed = [cell for cell in nb.cells if cell.cell_type == "code" and cell.get("execution_count")]
    skipped = _tagged(nb, "skip-execution")
    assert len(executed) + len(skipped) == sum(cell.cell_type == "code" for cell in nb.cells)
    print(f"{notebook.name}: {len(executed)} cells in {elapsed:.1f} s")


def test_every_notebook_is_run_in_ci() -> None:
    assert sorted(n.name for n in NOTEBOOKS) == sorted(p.name for p in COLAB.glob("*.ipynb"))


@pytest.mark.parametrize("name", sorted(p.name for p in COLAB.glob("*.ipynb")))
def test_notebooks_are_committed_without_outputs(name: str) -> None:
    nb = _read(name)
    for i, cell in enumerate(nb.cells):
        where = f"{name} cell {i}"
        assert not cell.get("outputs"), f"{where} has outputs: clear them (nbstripout colab/*.ipynb)"
        assert cell.get("execution_count") is None, f"{where} has an execution count"
        assert not {"papermill", "colab", "outputId", "execution"} & set(cell.metadata), f"{where}: {cell.metadata}"
    assert "papermill" not in nb.metadata and "widgets" not in nb.metadata


@pytest.mark.parametrize("name", sorted(p.name for p in COLAB.glob("*.ipynb")))
def test_notebook_conventions(name: str) -> None:
    """One parameters cell; every pip install is Colab-only, skipped in CI and keeps the runtime's torch/torch_xla;
    the kernel is python3; the install source is the repository."""
    nb = _read(name)
    assert nb.metadata.kernelspec.name == "python3"
    assert len(_tagged(nb, "parameters")) == 1
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not re.search(r"pip install", cell.source):
            continue
        where = f"{name} cell {i}"
        assert "skip-execution" in cell.metadata.get("tags", []), f"{where}: a pip install must be skip-execution"
        assert '"google.colab" in sys.modules' in cell.source, f"{where}: a pip install must be Colab-only"
        assert "-c /tmp/keep-runtime.txt" in cell.source, f"{where}: pip must keep the runtime's torch as it is"
        for dist in ("torch", "torch_xla"):
            assert f'"{dist}"' in cell.source, f"{where}: {dist} is not pinned to the runtime's version"
        assert REPOSITORY in cell.source, where


def test_the_notebooks_page_links_every_notebook_from_colab() -> None:
    page = (ROOT / "docs" / "notebooks.md").read_text()
    for path in sorted(COLAB.glob("*.ipynb")):
        badge = f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({COLAB_URL.format(name=path.name)})"
        assert badge in page, f"docs/notebooks.md has no Colab badge for {path.name}: {badge}"


def test_injected_parameters_must_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AssertionError, match="not assigned in the parameters cell"):
        _with_parameters(_read("quickstart.ipynb"), {"widht": 8})


def test_the_runner_injects_parameters_skips_install_cells_and_fails_on_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v4 = nbformat.v4

    def notebook() -> Any:
        cells = [
            v4.new_code_cell("raise SystemExit('an install cell ran')", metadata={"tags": ["skip-execution"]}),
            v4.new_code_cell("size = 1000", metadata={"tags": ["parameters"]}),
            v4.new_code_cell(
                "import os, sys\n"
                "print(size, os.environ['PJRT_DEVICE'], os.getcwd(), sys.executable)\n"
                "assert size < 10, size"
            ),
        ]
        return v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}})

    out = execute(notebook(), {"size": 3}, monkeypatch, cwd=tmp_path)
    # the kernel is this interpreter (so `make test-newer` runs the notebooks on the newer torch)
    assert _outputs_text(out).split() == ["3", "CPU", str(tmp_path), sys.executable]
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="1000 CPU") as failed:
        execute(notebook(), {}, monkeypatch, cwd=tmp_path)
    assert failed.value.ename == "AssertionError"
