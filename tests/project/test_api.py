"""The public API's boundary: ``revlib_xla.__all__`` is documented in one place, and nothing private is in it."""

import inspect
import subprocess
import sys
import types

import pytest

import revlib_xla


@pytest.mark.parametrize("name", revlib_xla.__all__)
def test_every_public_name_exists_is_documented_and_public(name):
    assert not name.startswith("_")
    obj = getattr(revlib_xla, name)
    # documented in one place: the package docstring names it (within ``...``)
    assert f"``{name}``" in revlib_xla.__doc__, f"{name} is not in revlib_xla's docstring"
    if isinstance(obj, types.ModuleType):
        assert obj.__name__ == f"revlib_xla.{name}" and (obj.__doc__ or "").strip(), name
    elif inspect.isclass(obj) or inspect.isfunction(obj):
        assert (vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__ or "").strip(), (
            f"{name}: no docstring"
        )
        assert not any(part.startswith("_") for part in obj.__module__.split(".")), f"{name} from {obj.__module__}"
        assert obj.__module__.startswith("revlib_xla."), f"{name} is {obj.__module__}'s, not revlib_xla's"
    else:  # RevLib's type aliases: named and described in the package docstring
        assert name.isupper(), f"{name}: a {type(obj).__name__} without a docstring of its own"


def test_all_lists_each_name_once_and_every_public_module():
    assert len(revlib_xla.__all__) == len(set(revlib_xla.__all__))
    public_modules = {"planner", "memory", "fewbit", "models", "core", "utils", "compat"}
    assert public_modules <= set(revlib_xla.__all__)
    assert public_modules <= set(dir(revlib_xla))


def test_modules_are_reachable_from_the_top_level():
    """``revlib_xla.memory.eager_peak`` after a bare ``import revlib_xla`` (a fresh interpreter, so that nothing
    imported the module before); ``fewbit`` is not imported until used."""
    code = (
        "import sys, revlib_xla\n"
        "assert 'revlib_xla.fewbit' not in sys.modules\n"
        "print(revlib_xla.memory.eager_peak.__name__, revlib_xla.fewbit.GELU.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["eager_peak", "GELU"]


def test_unknown_attribute_is_an_attribute_error():
    assert not hasattr(revlib_xla, "no_such_name")
    with pytest.raises(AttributeError, match="has no attribute 'recompute_engine'"):
        revlib_xla.recompute_engine  # noqa: B018


def test_fuse_optimizer_reaches_modules_through_the_steps_in_backward_protocol():
    """fuse_optimizer attaches its optimizer to every module implementing StepsInBackward (a ReversibleSequential
    or any other), detaches it on remove(), and refuses a module built with an optimizer of its own."""
    import torch
    from torch import nn

    from revlib_xla.fused_optimizer import StepsInBackward

    class Host(nn.Linear):
        fused_optimizer_factory = None

        def __init__(self):
            super().__init__(2, 2)
            self.calls = []

        def attach_fused_optimizer(self, optimizer):
            self.calls.append(("attach", optimizer))

        def detach_fused_optimizer(self, optimizer):
            self.calls.append(("detach", optimizer))

    host, rev = Host(), revlib_xla.ReversibleSequential(nn.Linear(2, 2))
    assert isinstance(host, StepsInBackward) and isinstance(rev, StepsInBackward)
    assert not isinstance(nn.Linear(2, 2), StepsInBackward)
    fused = revlib_xla.fuse_optimizer(nn.Sequential(host, rev), lambda p: torch.optim.SGD(p, lr=0.1))
    assert host.calls == [("attach", fused)] and rev.fused_optimizer is fused
    fused.remove()
    assert host.calls == [("attach", fused), ("detach", fused)] and rev.fused_optimizer is None
    own = revlib_xla.ReversibleSequential(nn.Linear(2, 2), fused_optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(revlib_xla.FusedOptimizerError, match="already built with fused_optimizer"):
        revlib_xla.fuse_optimizer(nn.Sequential(own), lambda p: torch.optim.SGD(p, lr=0.1))
