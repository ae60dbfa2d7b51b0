"""Device backends: the registry, each family's capabilities, a family added for a test, TorchTPU detection and
dispatch (with fakes: no TPU here), and a check that no module outside revlib_xla/backends/ compares device kinds."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from conftest import SeededUnits, max_rel_err
from fake_family import RecordingFamily, serving
from torch import nn

import revlib_xla as revlib
from revlib_xla import backends
from revlib_xla.backends import tpu as tpu_backend
from revlib_xla.backends import xla as xla_backend
from revlib_xla.compiled import memory as compiled_memory

PACKAGE = pathlib.Path(revlib.__file__).resolve().parent

# ----------------------------------------------------------------------------------------------------------------
# Device knowledge stays in the backend package

#: Device families named in string literals (compared lower-case: PJRT says "CPU" and "TPU").
DEVICE_KINDS = {"cpu", "cuda", "xla", "tpu", "meta", "mps", "xpu", "hpu", "privateuseone"}
#: ``torch.<name>`` namespaces that are one device family's API (or torch's API over accelerators).
DEVICE_NAMESPACES = {"cuda", "tpu", "xpu", "mps", "accelerator"}
#: Explicit exceptions: (module path relative to the package, what is flagged) -> why it is allowed.
ALLOWED = {
    ("kernels/fewbit_pallas.py", "import torch_xla.experimental.custom_kernel"): (
        "the Pallas kernels are torch_xla's bridge to TPU kernels; they run only where "
        "backends.kernel_platform(tensor) says 'pallas', which the xla backend decides"
    ),
}


def _names_a_kind(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.lower() in DEVICE_KINDS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_kind(e) for e in node.elts)
    return False


def device_kind_checks(source: str) -> list[tuple[int, str]]:
    """Where ``source`` branches on device kinds or uses a device family's API: comparisons (``==``, ``!=``,
    ``in``, ...) or ``match`` cases against a device-kind string, comparisons of a ``.type`` attribute,
    ``torch.cuda``/``torch.tpu``/``torch.accelerator``... and imports of torch_xla. Returns (line, what) pairs."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_names_a_kind(o) or (isinstance(o, ast.Attribute) and o.attr == "type") for o in operands):
                found.append((node.lineno, f"comparison {ast.unparse(node)}"))
        elif isinstance(node, ast.MatchValue) and _names_a_kind(node.value):
            found.append((node.lineno, f"match case {ast.unparse(node.value)}"))
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
            and node.attr in DEVICE_NAMESPACES
        ):
            found.append((node.lineno, f"torch.{node.attr}"))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] == "torch_xla"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch_xla":
            found.append((node.lineno, f"import {node.module}"))
    return found


def test_checker_finds_planted_device_checks():
    planted = textwrap.dedent(
        """
        import torch
        import torch_xla.core.xla_model as xm
        from torch_xla.utils.checkpoint import checkpoint

        def f(x, device, kind):
            if x.device.type == "xla":
                pass
            if device.type != "cuda":
                pass
            if kind in ("cpu", "meta"):
                pass
            if x.device.type in backends_of_interest:
                pass
            free, total = torch.cuda.mem_get_info(device)
            torch.accelerator.synchronize()
            if runtime == "TPU":
                pass
            match kind:
                case "tpu":
                    pass
        """
    )
    found = device_kind_checks(planted)
    lines = sorted({line for line, _ in found})
    assert lines == [3, 4, 7, 9, 11, 13, 15, 16, 17, 20], found
    assert (
        device_kind_checks("def f(x):\n    return backends.is_tracing_lazily(x) and x.dtype == torch.float32\n") == []
    )


def test_no_device_kind_checks_outside_the_backend_package():
    violations = []
    allowed_seen = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("backends/"):
            continue
        for line, what in device_kind_checks(path.read_text(encoding="utf-8")):
            if (relative, what) in ALLOWED:
                allowed_seen.add((relative, what))
            else:
                violations.append(f"revlib_xla/{relative}:{line}: {what}")
    assert violations == [], "ask revlib_xla.backends / backend_for(x) instead:\n" + "\n".join(violations)
    assert allowed_seen == set(ALLOWED), "an allowed exception no longer occurs: remove it from ALLOWED"


# ----------------------------------------------------------------------------------------------------------------
# The registry


def test_registry_dispatches_by_device_type():
    assert isinstance(backends.backend_for("cpu"), backends.CpuBackend)
    assert isinstance(backends.backend_for(torch.zeros(1)), backends.CpuBackend)
    assert isinstance(backends.backend_for(None), backends.CpuBackend)
    assert isinstance(backends.backend_for(torch.zeros(1, device="meta")), backends.MetaBackend)
    assert isinstance(backends.backend_for("cuda:1"), backends.CudaBackend)
    assert isinstance(backends.backend_for(torch.device("xla", 0)), backends.XlaBackend)
    assert list(backends.registered()) == ["cpu", "xla", "cuda", "meta", "tpu"]


def test_unknown_device_family_raises_naming_it_and_the_registered_ones():
    with pytest.raises(
        backends.UnknownDeviceError, match=r"device 'mps:0'.*cpu, cuda, meta, tpu, xla.*register\('mps'"
    ):
        backends.backend_for("mps:0")
    with pytest.raises(TypeError, match="a backend is a revlib_xla.backends.Backend"):
        backends.register("mps", object())  # type: ignore[arg-type]
    assert backends.device_available("mps") is torch.backends.mps.is_available()  # unregistered: torch's answer


def test_capabilities_of_the_eager_families():
    cpu, meta, cuda = (backends.backend_for(k) for k in ("cpu", "meta", "cuda"))
    assert (cpu.lazy, cpu.host_offload, cpu.takes_generators, cpu.autocast_device_type) == (
        False,
        backends.HostOffload.ALREADY_HOST,
        True,
        "cpu",
    )
    assert cuda.host_offload is backends.HostOffload.STREAM_COPY and cuda.autocast_device_type == "cuda"
    assert not meta.holds_data and not meta.takes_generators and meta.autocast_device_type is None
    assert (cpu.process_group_backend, cuda.process_group_backend, meta.process_group_backend) == ("gloo", "nccl", None)
    assert cpu.process_device(torch.device("cpu"), 1) == torch.device("cpu")
    assert backends.default_generator("cpu") is torch.default_generator
    assert backends.free_memory("cpu") is None and backends.sizing_generation("cpu", "v5e") is None
    assert backends.is_host_memory("cpu") and not backends.is_host_memory("meta") and not backends.is_host_memory("mps")
    t = torch.randn(3)
    assert backends.optimization_barrier([t, 1.0]) == [t, 1.0] and backends.optimization_barrier([]) == []
    assert backends.after(t, torch.ones(1)) is t
    copy = backends.to_host(t)
    assert copy.tensor is t and backends.to_device(copy) is t
    with pytest.raises(NotImplementedError, match="cannot show a compiled program's text"):
        cpu.program_text([t])
    with pytest.raises(ValueError, match="needs XLA tensors"):
        backends.lazy_stablehlo([t])


def test_allocator_peak_refuses_a_device_without_allocator_or_host_memory():
    with pytest.raises(ValueError, match="allocator_peak measures cpu and cuda, not meta"):
        revlib.memory.allocator_peak(lambda: None, device="meta")


@pytest.mark.parametrize(
    ("kind", "generation"),
    [
        ("TPU v5 lite", "v5e"),
        ("TPU v5e", "v5e"),
        ("v5litepod-8", "v5e"),
        ("TPU v6 lite", "v6e"),
        ("v6e-4", "v6e"),
        ("TPU v5p", "v5p"),
        ("TPU v5", "v5p"),
        ("TPU v4", None),
        ("NVIDIA H100 80GB HBM3", None),
        ("CPU", None),
        ("", None),
        (None, None),
    ],
)
def test_tpu_generation_from_the_runtimes_description(kind, generation):
    assert backends.generation_from_device_kind(kind) == generation


# ----------------------------------------------------------------------------------------------------------------
# torch_xla: lazy, in-place barrier wrapped, and "XLA" is not "a TPU"


@pytest.fixture
def xla_device():
    if not backends.xla_available():
        pytest.skip("torch_xla is not installed (pip install 'revlib_xla[xla]')")
    return backends.device_for("xla")


def test_xla_capabilities(xla_device):
    found = backends.backend_for(xla_device)
    assert found.lazy and found.program_text_available and not found.takes_generators
    assert found.host_offload is backends.HostOffload.MEMORY_SPACE_ANNOTATION
    x, y = torch.ones(3, device=xla_device), torch.zeros(3, device=xla_device)
    fenced = backends.optimization_barrier([x, y])
    assert fenced[0] is x and fenced[1] is y  # torch_xla's barrier is in place: the same tensors come back
    assert "stablehlo.optimization_barrier" in backends.lazy_stablehlo([x + 1, y])
    shifted = backends.after({"a": [x]}, torch.full((2,), 3.0, device=xla_device))
    assert shifted["a"][0] is not x and torch.equal(shifted["a"][0].cpu(), x.cpu())
    assert backends.tpu_generation(xla_device) is None  # PJRT CPU is not a TPU
    assert backends.free_memory(xla_device) is None


def test_xla_sizing_generation_comes_from_the_runtime_not_from_laziness(xla_device, monkeypatch):
    assert backends.sizing_generation(xla_device, "v6e") == "v6e"  # PJRT CPU traces for the TPU the user names
    assert backends.sizing_generation(xla_device, None) is None
    monkeypatch.setattr(xla_backend, "runtime_type", lambda: "CUDA")
    assert backends.sizing_generation(xla_device, "v5e") is None  # a torch_xla GPU run is not sized for a v5e
    monkeypatch.setattr(xla_backend, "runtime_type", lambda: "TPU")
    xm = xla_backend.xla_model()
    monkeypatch.setattr(xm, "xla_device_kind", lambda device=None: "TPU v6 lite")
    assert backends.tpu_generation(xla_device) == "v6e"
    assert backends.sizing_generation(xla_device, "v5e") == "v6e"  # the chip it runs on
    monkeypatch.setattr(xm, "xla_device_kind", lambda device=None: "TPU v4")
    assert backends.sizing_generation(xla_device, "v5e") == "v5e"  # no topology for a v4: the user's choice


def test_checkpointable_on_a_torch_xla_gpu_is_not_sized_for_a_tpu(xla_device, monkeypatch):
    """Checkpointable sizes stages with the TPU compiler only where the runtime traces for a TPU."""
    monkeypatch.setattr(xla_backend, "runtime_type", lambda: "CUDA")

    def no_tpu_compile(*args, **kwargs):
        raise AssertionError("a torch_xla GPU run was sized with the TPU compiler")

    monkeypatch.setattr(compiled_memory, "tpu_memory_many", no_tpu_compile)  # where the planner finds it
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).to(xla_device)
    checkpointed = revlib.Checkpointable(model, tpu_generation="v5e")
    chain = checkpointed.measure(torch.randn(4, 8).to(xla_device))
    assert chain.length == 3


# ----------------------------------------------------------------------------------------------------------------
# A family added for the test: one module (fake_family.py) and a registry entry


def test_a_new_family_serves_checkpointable_and_reversible_steps():
    """Registered for the CPU's device type, RecordingFamily serves every CPU tensor: the features ask it for
    barriers and random state (seeded per unit, as on XLA), and the gradients are the plain model's."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.3), nn.Tanh()) for _ in range(3)]
    model = nn.Sequential(*blocks).double()
    x = torch.randn(5, 6, dtype=torch.float64)
    with serving("cpu", RecordingFamily()) as family:
        checkpointed = revlib.Checkpointable(model)
        checkpointed.measure(x)
        checkpointed.compute_sequence(checkpointed.min_memory())
        assert checkpointed.sequence.counts().get("Fn", 0) + checkpointed.sequence.counts().get("CF", 0) > 0
        family.calls.clear()
        torch.manual_seed(1)
        checkpointed(x).square().sum().backward()
        got = [p.grad.clone() for p in model.parameters()]
        assert family.calls["optimization_barrier"] > 0 and family.calls["after"] > 0
        assert family.calls["get_rng_state"] > 0 and family.calls["manual_seed"] > 0
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        SeededUnits(checkpointed.stages)(x).square().sum().backward()  # the plain model, with the same masks
        for g, p in zip(got, model.parameters()):
            assert max_rel_err(g, p.grad) <= 1e-12

        torch.manual_seed(2)
        coupled = revlib.ReversibleSequential(*[nn.Linear(3, 3) for _ in range(4)]).double()
        plain = revlib.ReversibleSequential(
            *[nn.Linear(3, 3) for _ in range(4)], memory_mode=revlib.MemoryModes.no_savings
        ).double()
        plain.load_state_dict(coupled.state_dict())
        family.calls.clear()
        x2 = torch.randn(2, 6, dtype=torch.float64)
        coupled(x2).square().sum().backward()
        assert family.calls["optimization_barrier"] == 4  # one per layer inverted in the backward
        plain(x2).square().sum().backward()
        for a, b in zip(coupled.parameters(), plain.parameters()):
            assert max_rel_err(a.grad, b.grad) <= 1e-12
    assert isinstance(backends.backend_for("cpu"), backends.CpuBackend) and not isinstance(
        backends.backend_for("cpu"), RecordingFamily
    )


class _SmallDevice(RecordingFamily):
    """A family whose device reports little free memory."""

    def __init__(self, free: int) -> None:
        super().__init__()
        self.free = free

    def free_memory(self, device: torch.device) -> int | None:
        self.calls["free_memory"] += 1
        return self.free


def test_checkpointable_default_budget_is_what_the_backend_reports_free():
    """Without a mem_limit, Checkpointable plans for 90 % of the free memory its device's backend reports (cuda:
    ``mem_get_info``), and for the no-checkpoint peak where the backend cannot tell (the cpu)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)]).double()
    x = torch.randn(8, 16, dtype=torch.float64)
    checkpointed = revlib.Checkpointable(model)
    checkpointed.measure(x)
    checkpointed.compute_sequence()
    assert checkpointed.get_expected_memory() <= checkpointed.no_checkpoint_memory()
    low, high = checkpointed.min_memory(), checkpointed.no_checkpoint_memory()
    free = int((low + 0.3 * (high - low)) / 0.9)
    with serving("cpu", _SmallDevice(free)) as family:
        checkpointed.compute_sequence()
        assert family.calls["free_memory"] == 1
        assert checkpointed.get_expected_memory() <= 0.9 * free < high


# ----------------------------------------------------------------------------------------------------------------
# TorchTPU (experimental): detection, package verification and dispatch, with fakes


def _fake_distribution(root: pathlib.Path, home_page: str, author: str = "") -> pathlib.Path:
    """A ``torch-tpu`` distribution on disk providing the import name ``torch_tpu``, as pip would install it."""
    info = root / "torch_tpu-0.2.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: torch-tpu\nVersion: 0.2.0\nHome-page: {home_page}\nAuthor: {author}\n"
    )
    (info / "top_level.txt").write_text("torch_tpu\n")
    return root


@pytest.fixture
def fresh_verification():
    tpu_backend._verified.cache_clear()
    yield
    tpu_backend._verified.cache_clear()


@pytest.fixture
def tpu_accelerator(monkeypatch):
    """torch.accelerator reporting a TPU as the current accelerator."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: types.SimpleNamespace(type="tpu"))


def test_torchtpu_is_detected_only_through_torch_accelerator(tmp_path, monkeypatch, fresh_verification):
    monkeypatch.syspath_prepend(str(_fake_distribution(tmp_path, "https://github.com/google-pytorch/torch_tpu")))
    assert tpu_backend.torch_tpu_distribution().metadata["Name"] == "torch-tpu"
    assert not tpu_backend.torch_tpu_detected()  # no accelerator on this machine
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    assert not tpu_backend.torch_tpu_detected()
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: types.SimpleNamespace(type="tpu"))
    assert tpu_backend.torch_tpu_detected()


def test_torchtpu_without_the_package_is_not_detected(tpu_accelerator, fresh_verification):
    assert tpu_backend.torch_tpu_distribution() is None
    assert not tpu_backend.torch_tpu_detected()


def test_another_vendors_torch_tpu_is_refused(tmp_path, monkeypatch, tpu_accelerator, fresh_verification):
    monkeypatch.syspath_prepend(str(_fake_distribution(tmp_path, "https://github.com/sophgo/tpu-train", "sophgo")))
    with pytest.raises(tpu_backend.NotGooglesTorchTpu, match=r"torch-tpu \(home page .*sophgo.*not Google's TorchTPU"):
        tpu_backend.torch_tpu_detected()


def test_torchtpu_backend_dispatch_with_a_fake_torch_tpu(tmp_path, monkeypatch, tpu_accelerator, fresh_verification):
    monkeypatch.syspath_prepend(str(_fake_distribution(tmp_path, "", "Google LLC")))
    barriers = []

    def optimization_barrier(tensors):
        barriers.append(len(tensors))
        return [t.clone() for t in tensors]

    generator = torch.Generator()
    fake = types.SimpleNamespace(ops=types.SimpleNamespace(optimization_barrier=optimization_barrier))
    fake.default_generators = [generator]
    monkeypatch.setattr(torch, "tpu", fake, raising=False)
    family = backends.TpuBackend()
    assert not family.lazy and family.host_offload is backends.HostOffload.BLOCKING_COPY
    assert family.sizing_generation(torch.device("cpu"), "v5e") is None  # eager: measured, not compiled
    a, b = torch.ones(2), torch.zeros(2)
    fenced = family.optimization_barrier([a, b])
    assert barriers == [2] and fenced[0] is not a and torch.equal(fenced[0], a)  # out of place
    device = torch.device("cpu", 0)  # a stand-in: this process cannot make a "tpu" device
    family.manual_seed(device, 7)
    state = family.get_rng_state(device)
    first = torch.rand(3, generator=generator)
    family.set_rng_state(device, state)
    assert torch.equal(torch.rand(3, generator=generator), first)
    fake.default_generators = []
    with pytest.raises(RuntimeError, match="exposes no default generator"):
        family.get_rng_state(device)


def test_torchtpu_recomputes_with_torch_non_reentrant_checkpoint():
    """The upstream feature TorchTPU's recomputation relies on, run on the CPU: torch.utils.checkpoint
    (non-reentrant) through the backend gives plain autograd's gradients, parameters included."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)).double()
    x = torch.randn(3, 4, dtype=torch.float64)  # no input gradient: non-reentrant still reaches the parameters
    backends.TpuBackend().checkpoint(layer, x).square().sum().backward()
    got = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    layer(x).square().sum().backward()
    for g, p in zip(got, layer.parameters()):
        assert max_rel_err(g, p.grad) <= 1e-12


_TPU_PROCESS = """
import json, sys, types
import torch

torch.utils.rename_privateuse1_backend("tpu")  # what torch_tpu does; irreversible, hence this child process
sys.path.insert(0, sys.argv[1])
stats = {"allocated": 100, "peak": 100}
torch.accelerator.current_accelerator = lambda *a, **k: torch.device("tpu")
torch.accelerator.current_device_index = lambda: 0
torch.accelerator.synchronize = lambda device=None: None
torch.accelerator.memory_allocated = lambda index=None: stats["allocated"]
torch.accelerator.max_memory_allocated = lambda index=None: stats["peak"]
torch.accelerator.reset_peak_memory_stats = lambda index=None: stats.update(peak=stats["allocated"])

from revlib_xla import backends, backends, memory

def step():
    stats["peak"] += 4096

found = backends.backend_for(torch.device("tpu", 0))
peak = memory.allocator_peak(step, device="tpu:0")
print(json.dumps({
    "backend": type(found).__name__,
    "available": backends.device_available("tpu"),
    "default": str(backends.default_device()),
    "peak": [peak.increase, peak.device, peak.source],
}))
"""


def test_torchtpu_device_dispatch_in_a_child_process(tmp_path):
    """With ``"tpu"`` registered as PrivateUse1 (as torch_tpu does), torch.accelerator reporting it and Google's
    package installed: the registry serves tpu devices with the TorchTPU backend, the default device is the TPU,
    and allocator_peak reads torch.accelerator's statistics."""
    root = _fake_distribution(tmp_path, "https://github.com/google-pytorch/torch_tpu")
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _TPU_PROCESS, str(root)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["backend"] == "TpuBackend"
    assert result["available"] is True and result["default"] == "tpu:0"
    assert result["peak"] == [4096, "tpu:0", "torch.accelerator.max_memory_allocated"]


def test_a_tpu_is_found_without_importing_torch_xla_where_pjrt_would_run_on_the_cpu(monkeypatch, tmp_path):
    """``train.device=auto`` asks whether XLA has hardware: without ``PJRT_DEVICE``, a machine without libtpu or
    without a TPU device file answers no without importing torch_xla (seconds, and a PJRT warning); a TPU VM's device
    files (``/dev/accel0``, ``/dev/vfio/0``) with libtpu installed make PJRT default to the TPU, not the CPU."""
    import fnmatch
    import glob as glob_module
    import importlib.util

    files: list[str] = []
    monkeypatch.setattr(glob_module, "glob", lambda pattern: fnmatch.filter(files, pattern))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "libtpu" else None)
    monkeypatch.delenv("TPU_NAME", raising=False)
    assert not xla_backend.tpu_attached()
    for device_file in ("/dev/accel0", "/dev/vfio/0"):
        files[:] = [device_file]
        assert xla_backend.tpu_attached(), device_file
    files[:] = ["/dev/vfio/vfio"]  # the vfio control file alone is no TPU
    assert not xla_backend.tpu_attached()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    files[:] = ["/dev/accel0"]
    assert not xla_backend.tpu_attached()  # device files without libtpu: nothing for PJRT to run them with

    code = (
        "import sys\n"
        "from revlib_xla import backends\n"
        "print('@@', backends.default_device(), 'torch_xla' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "TPU_NAME")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    if not xla_backend.tpu_attached() and not torch.cuda.is_available():
        assert "@@ cpu False" in done.stdout, done.stdout
        assert "PJRT_DEVICE" not in done.stderr, done.stderr[-2000:]


def test_the_switches_of_tracing_without_running_live_in_backends_and_keep_their_old_names():
    """One home (backends.tracing), three switches that differ in span: the rebuild check's suspension is this
    thread's, the planner's stand-in inputs the process's; both nest; neither implies the other."""
    import threading

    from revlib_xla.backends import tracing
    from revlib_xla.planner import measure, sizing
    from revlib_xla.reversible import rebuild_check

    assert rebuild_check.suspended is tracing.checks_suspended and rebuild_check.armed is tracing.checks_armed
    assert sizing.without_execution is measure.without_execution is tracing.stand_in_inputs
    assert backends.execution_forbidden is tracing.execution_forbidden

    def elsewhere() -> tuple[bool, bool]:
        seen = []
        thread = threading.Thread(target=lambda: seen.append((tracing.checks_armed(), tracing.standing_in())))
        thread.start()
        thread.join()
        return seen[0]

    assert tracing.checks_armed() and not tracing.standing_in() and measure.executing()
    with tracing.checks_suspended():
        with tracing.checks_suspended():
            assert not rebuild_check.armed() and not tracing.standing_in()
        assert not tracing.checks_armed()
        assert elsewhere() == (True, False)  # another thread's forwards still arm the check
    assert tracing.checks_armed()
    with tracing.stand_in_inputs():
        with sizing.without_execution():
            assert tracing.standing_in() and not measure.executing() and tracing.checks_armed()
        assert tracing.standing_in()
        assert elsewhere() == (True, True)  # the whole process stands in
    assert not tracing.standing_in() and measure.executing()
    with tracing.execution_forbidden("cpu"):  # nothing to forbid on an eager device; the others stay off
        assert tracing.checks_armed() and not tracing.standing_in()
    x = measure.device_argument(torch.Size([2, 3]), torch.float32, torch.device("cpu"))
    assert x.shape == (2, 3) and not x.any()
