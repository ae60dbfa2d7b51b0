"""The package's import graph, read from its source with ``ast`` (every ``import`` statement: module-level,
function-local and under ``TYPE_CHECKING``, relative and absolute): no cycle among ``revlib_xla``'s modules, and no
import from a lower layer to a higher one (:data:`LAYERS`). Importing ``a.b.c`` runs the packages ``a.b`` on the way,
so an import of a submodule is also an import of its packages (the root package ``revlib_xla`` excepted: it imports
nothing at import time)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "revlib_xla"

# Bottom to top: a module may import from its own layer (without a cycle) and from the layers below. A module's layer
# is that of its longest prefix listed.
LAYERS: list[tuple[str, ...]] = [
    # foundations: errors, containers, units, the chip table, the device capability interface and its backends (and
    # the switches of tracing without running), kernels, compiled sizing (the deviceless compile worker, liveness, the
    # cache, CompiledMemory, the StableHLO of a step and the roles of its arguments)
    (
        "errors",
        "chips",
        "_tree",
        "_grad_destination",
        "_replaced_params",
        "units",
        "backends",
        "kernels",
        "compiled",
    ),
    # the building blocks the engines compose: recompute replay, FSDP2 units, offload, the optimizers (fused into the
    # backward, stepped on the host), the LM losses, few-bit activations and compressed saved activations
    (
        "recompute",
        "fsdp",
        "offload",
        "optim",
        "fused_optimizer",
        "losses",
        "fewbit",
        "intermediates",
    ),
    # reversible sequences (their engine, checks, scan and stacking)
    ("reversible",),
    # measuring memory
    ("memory",),
    # the planner (cost model, solver, schedules, executor with its early stops and attention cache, sizing) and
    # Checkpointable; offloading whole models
    ("planner", "offload_model"),
    # models and RevLib's façade modules over the layers above (core: revlib.core's names; utils: revlib.utils's,
    # which include MomentumNet, a model), sharding for TPU pods
    ("models", "core", "utils", "sharding"),
    # training: runs (train), will it fit without the chip (fit), HF models (hf), the demo's data and model
    ("train", "fit", "hf", "demo"),
    # front doors: the CLI, compatibility façades, deprecated module paths
    (
        "cli",
        "compat",
        "backend",
        "early_stop",
        "attention_cache",
        "scan",
        "checkpointable",
        "coupling",
        "fixed_point",
        "tpu_compile",
        "hlo_liveness",
        "compile_cache",
    ),
]

# Known, to remove (their own issue's work): each an edge (importer, imported) that breaks the rules above today.
# A new cycle or upward import fails; so does an entry here that no longer occurs (remove it then).
KNOWN: set[tuple[str, str]] = set()


def _known(module: str, target: str) -> bool:
    """Whether the edge is a known exception: to the module named, or into it (its package's submodules)."""
    return any(module == a and (target == b or target.startswith(b + ".")) for a, b in KNOWN)


def modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Every module of ``package`` under ``root``: dotted name -> (file, whether it is a package's ``__init__``)."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    """importer -> {imported module: the line of the first import}, for every import statement in the source."""
    found = modules(root, package)
    graph: dict[str, dict[str, int]] = {}
    for module, (path, is_package) in found.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, is_package, node.level, node.module)
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in found]
            else:
                continue
            for target in targets:
                if target != package and not target.startswith(package + "."):
                    continue
                while target not in found and "." in target:  # a name imported from a module: the module
                    target = target.rsplit(".", 1)[0]
                parts = target.split(".")
                for k in range(2, len(parts) + 1):  # the packages on the way run too (not the root, not our own)
                    step = ".".join(parts[:k])
                    if step in found and step != module and not module.startswith(step + "."):
                        edges.setdefault(step, node.lineno)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]], ignore: bool = False) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module (Tarjan)."""
    edges = {m: [t for t in sorted(ts) if not (ignore and _known(m, t))] for m, ts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    found = []
    for component in components:  # a path around the component, from its first module back to it
        inside = set(component)
        start = min(component)
        path, seen = [start], {start}
        while True:
            nxt = next(
                t
                for t in edges[path[-1]]
                if t in inside and (t == start or t not in seen) and _reaches(edges, t, start, inside)
            )
            path.append(nxt)
            if nxt == start:
                break
            seen.add(nxt)
        found.append(path)
    return found


def _reaches(edges: dict[str, list[str]], a: str, b: str, inside: set[str]) -> bool:
    todo, seen = [a], {a}
    while todo:
        v = todo.pop()
        if v == b:
            return True
        for w in edges[v]:
            if w in inside and w not in seen:
                seen.add(w)
                todo.append(w)
    return False


def layer_of(module: str, package: str = PACKAGE) -> int | None:
    name = module[len(package) + 1 :]
    best: tuple[int, int] | None = None
    for level, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), level)
    return None if best is None else best[1]


def upward(graph: dict[str, dict[str, int]]) -> list[str]:
    bad = []
    for module, edges in graph.items():
        mine = layer_of(module)
        for target, line in edges.items():
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine and not _known(module, target):
                bad.append(f"{module} (layer {mine}) imports {target} (layer {theirs}) at line {line}")
    return bad


@pytest.fixture(scope="module")
def graph():
    return import_graph(ROOT, PACKAGE)


def test_every_module_has_a_layer(graph):
    unplaced = [m for m in graph if m != PACKAGE and layer_of(m) is None]
    assert not unplaced, f"modules missing from LAYERS in {__file__}: {unplaced}"


def test_no_import_cycle(graph):
    found = cycles(graph, ignore=True)
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_no_import_from_a_lower_layer_to_a_higher_one(graph):
    bad = upward(graph)
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def test_known_exceptions_still_occur(graph):
    """An exception that no longer occurs is removed from KNOWN, so that it cannot come back unnoticed."""
    gone = [(a, b) for a, b in KNOWN if b not in graph.get(a, {})]
    assert not gone, f"remove from KNOWN: {gone}"


def test_the_checks_see_cycles_and_upward_imports_hidden_in_functions(tmp_path):
    """The checker itself, on a small package: a cycle through a function-local relative import, another through
    ``import pkg.sub`` under ``TYPE_CHECKING``, and an import of a submodule running its package."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.sub.d\n")
    (pkg / "sub" / "__init__.py").write_text("from .d import y\n")
    (pkg / "sub" / "d.py").write_text("from ..c import z\n")
    (pkg / "e.py").write_text("from .a import b as _b\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.e"] == {"pkg.a": 1}
    assert graph["pkg.c"] == {"pkg.sub": 3, "pkg.sub.d": 3}
    assert sorted(cycles(graph)) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.c", "pkg.sub", "pkg.sub.d", "pkg.c"]]


#: The most lines a module of the package may have: past it, split the module along its concepts (one concept per
#: module), keeping its public names importable from the old path.
MAX_LINES = 650


def test_no_module_is_too_long():
    long = {
        path.relative_to(ROOT).as_posix(): n
        for path, _ in modules(ROOT, PACKAGE).values()
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them along their concepts): " + ", ".join(
        f"{path} ({n} lines)" for path, n in sorted(long.items())
    )
