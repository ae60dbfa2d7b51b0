"""Module paths that moved: the old path still imports, warns that it is deprecated, and gives the same objects as
the new home (every public name of the new home included)."""

import importlib
import sys

import pytest

MOVED = [
    ("revlib_xla.backend", "revlib_xla.backends"),
    ("revlib_xla.early_stop", "revlib_xla.planner.early_stop"),
    ("revlib_xla.attention_cache", "revlib_xla.planner.attention_cache"),
]


@pytest.mark.parametrize("old, new", MOVED)
def test_old_module_paths_warn_and_give_the_same_objects(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: import from {new}"):
        shim = importlib.import_module(old)
    home = importlib.import_module(new)
    assert shim.__all__ and all(getattr(shim, name) is getattr(home, name) for name in shim.__all__)
    if new == "revlib_xla.backends":  # the facade's names (the backend classes and the registry were never there)
        home = importlib.import_module("revlib_xla.backends.facade")
    assert set(home.__all__) <= set(shim.__all__)  # every public name of the new home is still reachable here
