"""Shared fixtures: every numerical test runs on each device kind present (cpu, xla, cuda)."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("PJRT_DEVICE", "CPU")
# libtpu, wherever it loads (jax or torch_xla in a test's process, a deviceless compiler worker), writes two log
# files per process to $TPU_LOG_DIR, by default /tmp/tpu_logs, and never removes them: the suite's go to a directory
# of this process's, deleted when it exits (subprocesses inherit it).
if "TPU_LOG_DIR" not in os.environ:
    os.environ["TPU_LOG_DIR"] = tempfile.mkdtemp(prefix="revlib_xla_tests_tpu_logs_")
    atexit.register(shutil.rmtree, os.environ["TPU_LOG_DIR"], ignore_errors=True)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A CUDA jax (the JAX reference tests on a GPU machine) takes 75 % of the GPU at its first array by default, in each
# pytest-xdist worker that imports it; the torch cases of that worker and the other workers then run out of memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pytest
import torch

from revlib_xla import backends
from revlib_xla._tree import map_tensors

# torch's autograd engine sizes its per-device queues once, at the first backward pass of the process, from the
# device counts known then. XLA's count is known only once torch_xla's runtime has started, so start it before any
# CPU backward runs in this worker, or every later XLA backward fails with an engine INTERNAL ASSERT.
if backends.xla_available():
    backends.device_for("xla")

ALL_KINDS = ("cpu", "xla", "cuda")


def _skip_reason(kind):
    if kind == "xla" and not backends.xla_available():
        return "torch_xla is not installed (pip install 'revlib_xla[xla]')"
    if kind == "cuda" and not backends.cuda_available():
        return "no CUDA GPU on this machine"
    return None


@pytest.fixture(params=ALL_KINDS)
def device(request):
    """A torch.device of each kind; cuda is skipped with a visible reason when no GPU is present."""
    reason = _skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    return backends.device_for(request.param)


def to_host(t):
    """Bring a tensor (or the tensors in a nested structure) back to the CPU, syncing XLA first.

    On a lazy device, one sync of every live tensor comes first: ``.cpu()`` of an unsynced XLA tensor compiles and
    runs a graph for that tensor alone, so comparing a model's gradients one parameter at a time compiled the whole
    forward and backward once per parameter (one Reformer test took 15 minutes on a loaded CI machine)."""
    lazy = {x.device for x in backends.tensors_in(t) if backends.backend_for(x).lazy}
    for dev in lazy:
        backends.sync(dev)
    return map_tensors(lambda x: x.detach().cpu(), t)


def max_rel_err(a, b):
    """max |a - b| / max |b|, elementwise over the whole tensor (0 when both are 0)."""
    a, b = to_host(a).double(), to_host(b).double()
    denom = b.abs().max()
    diff = (a - b).abs().max()
    if denom == 0:
        return float(diff)
    return float(diff / denom)


class SeededUnits(torch.nn.Module):
    """The plain modules ``units`` run in turn, unit ``i`` drawing its random numbers as unit ``i`` of an engine
    call does (``Checkpointable``'s stages, ``OffloadModel``'s checkpointed slices; see revlib_xla.recompute): by
    default (``random_numbers() == "plain"`` on cpu and cuda) from torch's global generators, as the plain model
    draws; else from generators seeded with ``derive_seed(seed, i)``, ``seed`` drawn once per forward from torch's
    global generator. With plain autograd, this is the reference with the masks the engine draws."""

    def __init__(self, units):
        super().__init__()
        self.units = torch.nn.ModuleList(units)

    def forward(self, x):
        from revlib_xla.recompute import plain_random_numbers, rng_scope

        device = next(iter(backends.tensors_in(x))).device
        if plain_random_numbers(device):
            for unit in self.units:
                x = unit(x)
            return x
        seed = backends.draw_seed()
        for i, unit in enumerate(self.units):
            with rng_scope(device) as reseed:
                reseed(backends.derive_seed(seed, i))
                x = unit(x)
        return x


def require_transformers():
    """transformers, for a test module that needs it; otherwise the whole module is skipped with the reason (not
    installed, or a version that does not support this torch: transformers then imports, without its models)."""
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install -e '.[test]' installs the pinned version)"
    )
    if not transformers.is_torch_available():
        pytest.skip(
            f"transformers {transformers.__version__} does not support torch {torch.__version__}",
            allow_module_level=True,
        )
    return transformers


def _node_ids(name: str) -> list[str]:
    """The node ids (or their prefixes) listed in ``tests/NAME``, one per line, ``#`` comments skipped."""
    with open(os.path.join(os.path.dirname(__file__), name)) as f:
        return [line.strip() for line in f if line.strip() and not line.startswith("#")]


_CI_SLOW = _node_ids("ci_slow.txt")
_SLOW_MEASURED = set(_node_ids("slow_measured.txt"))


def pytest_collection_modifyitems(config, items):
    """Mark ``slow`` the tests measured slow without a mark of their own (tests/slow_measured.txt), and ``ci`` the
    slow tests that ``make test`` runs all the same (tests/ci_slow.txt: node ids or their prefixes)."""
    for item in items:
        if item.nodeid in _SLOW_MEASURED:
            item.add_marker(pytest.mark.slow)
        if any(item.nodeid.startswith(prefix) for prefix in _CI_SLOW):
            item.add_marker(pytest.mark.ci)
