"""revlib_xla.memory: saved-for-backward bytes, eager peaks (real and fake), compiled XLA:CPU and TPU memory.

Every number asserted here is exact and reproducible: storage sizes for the eager tools, compiler plans for XLA.
The TPU figures come from libtpu's deviceless compiler (no TPU is used).
"""

import dataclasses
import hashlib
import importlib.util
import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from revlib_xla import backends, memory
from revlib_xla.compiled import cache as compile_cache
from revlib_xla.compiled import memory as compiled_memory
from revlib_xla.memory import (
    CompiledMemory,
    EagerPeak,
    MissingDependencyError,
    SavedTensorCounter,
    StorageTracker,
    TpuCompileError,
    allocator_peak,
    eager_peak,
    saved_bytes,
    step_stablehlo,
    tensor_bytes,
    tpu_memory,
    tpu_memory_many,
    xla_cpu_memory,
)

F32 = 4


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def small_mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))


def train_step(model, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss


# ----------------------------------------------------------------------------------------------------------------
# Bytes saved for backward


def test_saved_bytes_of_mlp_are_what_linear_and_tanh_save(device):
    torch.manual_seed(0)
    model = small_mlp().to(device)
    x = torch.randn(8, 16).to(device)  # does not require grad
    with SavedTensorCounter() as counter:
        model(x)
    # Linear 1 saves its input x (for the weight gradient; not its weight: x needs no gradient);
    # Tanh saves its output h; Linear 2 saves its input h (the same tensor: counted once) and its weight.
    expected = 8 * 16 * F32 + 8 * 32 * F32 + 32 * 1 * F32
    assert counter.bytes == expected == 1664
    assert (counter.count, counter.packed) == (3, 4)
    # Deterministic, and the function form agrees.
    assert saved_bytes(model, x) == expected
    # Excluding parameters leaves the activations only (the saved weight is a view, W.t(), of the parameter).
    assert saved_bytes(model, x, exclude=model.parameters()) == expected - 32 * F32


def test_saved_bytes_dedup_by_storage():
    class SaveTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            out = a * 2
            ctx.save_for_backward(out, out, out.view(-1)[:5], a)
            return out

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    a = torch.randn(10, 10, requires_grad=True)
    with SavedTensorCounter() as counter:
        SaveTwice.apply(a)
    # One storage for out (saved twice and as a slice), one for a.
    assert (counter.bytes, counter.count, counter.packed) == (2 * 100 * F32, 2, 4)
    # Two distinct tensors of equal size are two storages.
    with SavedTensorCounter() as counter:
        SaveTwice.apply(a)
        SaveTwice.apply(a)
    assert (counter.bytes, counter.count) == (3 * 100 * F32, 3)
    counter.reset()
    assert (counter.bytes, counter.count, counter.packed) == (0, 0, 0)


# ----------------------------------------------------------------------------------------------------------------
# Eager peak


def eager_mlp():
    # Every storage a multiple of 512 bytes, so cuda's block rounding changes nothing.
    return nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 128))


@pytest.fixture
def eager_device(device):
    if backends.device_kind(device) == "xla":
        pytest.skip("eager_peak measures eager devices; XLA is covered by the compiled-memory tests")
    return device


def test_eager_peak_categories(eager_device):
    torch.manual_seed(0)
    model = eager_mlp().to(eager_device)
    x = torch.randn(32, 128, device=eager_device)
    params = nbytes(*model.parameters())
    peak = eager_peak(train_step, model, x)
    assert isinstance(peak, EagerPeak) and peak.device.startswith(eager_device.type)
    assert peak.parameters == params
    assert peak.other == nbytes(x) and peak.buffers == 0 and peak.optimizer == 0
    parts = (
        peak.parameters,
        peak.gradients,
        peak.activations,
        peak.temporaries,
        peak.optimizer,
        peak.buffers,
        peak.other,
    )
    assert peak.total == sum(parts)
    # Above what exists before the step: at least the hidden activation (32x256) is alive at the peak.
    assert peak.total >= params + nbytes(x) + 32 * 256 * F32
    # After the step: parameters, their gradients and the input remain (the loss is freed with the graph).
    assert peak.end.gradients == params
    assert peak.end.total == 2 * params + nbytes(x)
    assert f"eager peak on {eager_device.type}" in str(peak) and "after the step" in str(peak)
    # The same call gives the same bytes.
    assert eager_peak(train_step, model, x) == peak


def test_eager_peak_with_optimizer_counts_adam_state():
    torch.manual_seed(0)
    model = eager_mlp()
    x = torch.randn(32, 128)
    params = list(model.parameters())
    peak = eager_peak(train_step, model, x, optimizer=lambda m: torch.optim.Adam(m.parameters()))
    # exp_avg and exp_avg_sq per parameter, plus a float32 step counter each.
    assert peak.end.optimizer == 2 * nbytes(*params) + F32 * len(params)
    assert peak.end.gradients == nbytes(*params)


def test_eager_peak_fake_matches_real():
    torch.manual_seed(0)
    model = eager_mlp()
    x = torch.randn(32, 128)
    from_real_objects = eager_peak(train_step, model, x, fake=True)
    # The fake run worked on fake copies: the real model is untouched.
    assert all(type(p) is nn.Parameter and p.grad is None for p in model.parameters())
    from_factories = eager_peak(train_step, eager_mlp, lambda: torch.randn(32, 128), fake=True)
    real = eager_peak(train_step, model, x)
    assert from_real_objects.fake and not real.fake
    assert dataclasses.replace(from_real_objects, fake=False) == real
    assert dataclasses.replace(from_factories, fake=False) == real
    with pytest.raises(ValueError, match="factory"):
        eager_peak(train_step, model, x, fake=True, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_eager_peak_fake_explains_a_factory_that_moves_a_fake_module():
    """Newer torch (2.13) cannot move a module built under FakeTensorMode with ``.to`` ("Couldn't swap"); the error
    says to build on the device instead. Where torch can, the factory simply works."""

    def moved():
        return eager_mlp().to("cpu")

    try:
        peak = eager_peak(train_step, moved, lambda: torch.randn(32, 128), fake=True)
    except RuntimeError as err:
        assert "with torch.device(" in str(err) and "Couldn't swap" in str(err)
    else:
        assert peak == eager_peak(train_step, eager_mlp, lambda: torch.randn(32, 128), fake=True)


def test_eager_peak_fake_sizes_a_model_larger_than_memory_without_allocating():
    width, depth, batch = 8192, 8, 1024

    def big():
        return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    peak = eager_peak(train_step, big, lambda: torch.randn(batch, width), fake=True)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    params = depth * (width * width + width) * F32
    assert peak.parameters == params == 2_147_745_792
    assert peak.end.gradients == params
    assert peak.total > 4 * 2**30  # parameters + (most) gradients + the input: over 4 GiB ...
    assert grown_mib < 256, f"the fake run grew the process by {grown_mib:.0f} MiB"  # ... never allocated


def test_eager_peak_rejects_xla_tensors():
    if not backends.xla_available():
        pytest.skip("torch_xla is not installed")
    model = small_mlp().to(backends.device_for("xla"))
    with pytest.raises(ValueError, match="tpu_memory"):
        eager_peak(train_step, model, torch.randn(8, 16).to(backends.device_for("xla")))


def test_eager_peak_names_the_torch_it_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.distributed._tools.mem_tracker", None)  # import now fails
    with pytest.raises(RuntimeError, match=r"MemTracker \(torch >= 2\.5"):
        eager_peak(train_step, small_mlp(), torch.randn(8, 16))


def _compiled_backward_node(grad_fn):
    """The autograd node of AOTAutograd's compiled function (``CompiledFunctionBackward``) behind ``grad_fn``."""
    seen, stack = set(), [grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CompiledFunctionBackward":
            return node
        stack.extend(next_node for next_node, _ in node.next_functions)
    raise AssertionError("no CompiledFunctionBackward node: the step did not run compiled")


def test_saved_bytes_count_what_a_compiled_graph_saves():
    """Under ``torch.compile`` the saved-tensor hooks see exactly what AOTAutograd's partitioned forward saves
    (what ``activation_memory_budget`` decides), so bench/planner.py can size compiled steps with them.
    ``aot_eager_decomp_partition`` runs the same partitioner as inductor without a C++ compile."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64), nn.Tanh())
    x = torch.randn(32, 64)
    params = list(model.parameters())
    eager = saved_bytes(model, x, exclude=params)
    assert eager == nbytes(x) + 2 * 32 * 256 * F32 + 32 * 64 * F32  # the input and the three tanh outputs
    counted = {}
    try:
        for budget in (1.0, 0.0):
            torch._dynamo.reset()  # the budget is read when the graph is partitioned, at the first call
            compiled = torch.compile(model, backend="aot_eager_decomp_partition")
            with torch._functorch.config.patch(activation_memory_budget=budget):
                compiled(x).sum().backward()
            with SavedTensorCounter(exclude=params) as counter:
                out = compiled(x)
            node = _compiled_backward_node(out.grad_fn)
            param_storages = {p.untyped_storage().data_ptr() for p in params}
            saved = [t for t in node.saved_tensors if t.untyped_storage().data_ptr() not in param_storages]
            assert counter.bytes == tensor_bytes(saved)
            counted[budget] = counter.bytes
    finally:
        torch._dynamo.reset()
    assert counted[1.0] == eager  # nothing recomputed: the eager activations
    assert counted[0.0] == nbytes(x)  # recompute everything: only the input is kept


def test_allocator_peak_follows_allocations_and_frees_in_order():
    def allocate():
        first = torch.empty(1 << 20, dtype=torch.uint8)
        second = torch.empty(2 << 20, dtype=torch.uint8)
        del first
        return torch.empty(1 << 19, dtype=torch.uint8), second

    assert allocator_peak(allocate).increase == 3 << 20


def test_allocator_peak_retained_is_what_the_call_leaves_allocated():
    """``retained``: bytes the call allocated that outlive it (its result dropped), here a kept buffer."""
    kept = []

    def allocate():
        kept.append(torch.empty(3 << 20, dtype=torch.uint8))
        scratch = torch.empty(1 << 20, dtype=torch.uint8)
        return scratch

    found = allocator_peak(allocate)
    assert (found.increase, found.retained) == (4 << 20, 3 << 20)
    assert allocator_peak(lambda: torch.empty(1 << 20)).retained == 0  # the result is dropped


def test_storage_tracker_counts_storages_and_leaves_nothing_alive():
    """StorageTracker's level and peak on a forward and backward with autograd: each op's new storages, frees
    through weak references; and unlike MemTracker (whose module hooks hold the input's gradient accumulator,
    which holds the input, in a cycle the garbage collector cannot see) nothing it saw stays alive after it."""
    import gc
    import weakref

    from torch.distributed._tools.mem_tracker import MemTracker

    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh())
    act = 32 * 64 * F32

    def run(tracker_type):
        x = torch.randn(32, 64).requires_grad_()
        alive = weakref.ref(x)
        tracker = tracker_type()
        if isinstance(tracker, StorageTracker):
            tracker.track(model, x)
        else:
            tracker.track_external(model, x)
        with tracker:
            y = model(x)
            y.sum().backward()
        del x, y
        gc.collect()
        return tracker, alive() is not None

    tracker, kept = run(StorageTracker)
    assert not kept
    # what the forward kept (the linear's output freed once tanh has run, tanh's output saved), then the backward
    x = torch.randn(32, 64).requires_grad_()
    model.zero_grad(set_to_none=True)
    tracker = StorageTracker()
    tracker.track(model, x)
    with tracker:
        start = tracker.current()
        y = model(x)
        assert (tracker.current() - start, tracker.peak() - start) == (act, 2 * act)
        y.sum().backward()
        params = sum(p.numel() * F32 for p in model.parameters())
        del y
        assert tracker.current() - start == act + params  # x.grad and the parameters' gradients
    # gradients that exist before are named by track(model): accumulating into them allocates nothing new
    tracker = StorageTracker()
    tracker.track(model, x)
    with tracker:
        start = tracker.current()
        model(x).sum().backward()
        assert tracker.current() - start == 0
    assert run(MemTracker)[1], "MemTracker no longer keeps the input alive: the workaround could go"


def test_allocator_peak_agrees_with_eager_peak_on_an_eager_step(eager_device):
    """On an eager step the allocator's peak is MemTracker's activations + temporaries (gradients already exist,
    so the step accumulates into them; the input existed before the step and is MemTracker's "other"): the two
    yardsticks agree, so eager and compiled steps can share one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 64)).to(
        eager_device
    )
    x = torch.randn(256, 64, device=eager_device)
    train_step(model, x)  # .grad exists from here on
    tracked = eager_peak(train_step, model, x, zero_grad=False)
    counted = allocator_peak(train_step, model, x, device=eager_device).increase
    expected = tracked.activations + tracked.temporaries
    assert abs(counted - expected) <= 0.02 * expected + 8192, (counted, str(tracked))


# ----------------------------------------------------------------------------------------------------------------
# Compiled XLA memory

needs_xla = pytest.mark.skipif(not backends.xla_available(), reason="torch_xla is not installed")
needs_jax = pytest.mark.skipif(importlib.util.find_spec("jaxlib") is None, reason="jax/jaxlib are not installed")
needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (pip install 'revlib_xla[tpu-compile]')"
)
PINNED = compiled_memory._compile_helpers().versions() == {"jax": "0.7.1", "jaxlib": "0.7.1", "libtpu": "0.0.20"}

DEPTH, WIDTH, BATCH = 4, 128, 256


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.f, self.g = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.g(torch.tanh(self.f(x))))


class Net(nn.Module):
    """A stem (so the checkpointed blocks get an input that requires grad), then DEPTH blocks of two Linears."""

    def __init__(self, checkpointed):
        super().__init__()
        self.stem = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.checkpointed = checkpointed

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            if self.checkpointed:
                from torch_xla.utils.checkpoint import checkpoint  # puts barriers before each recomputation

                x = checkpoint(block, x)
            else:
                x = block(x)
        return x


class OffloadedTanh(torch.autograd.Function):
    """tanh that keeps its output for backward in host memory (annotations only the TPU compiler acts on)."""

    @staticmethod
    def forward(ctx, x):
        from torch_xla.experimental.stablehlo_custom_call import place_to_host

        y = torch.tanh(x)
        ctx.save_for_backward(place_to_host(y))
        return y

    @staticmethod
    def backward(ctx, dy):
        from torch_xla.experimental.stablehlo_custom_call import place_to_device

        (y,) = ctx.saved_tensors
        y = place_to_device(y)
        return dy * (1 - y * y)


class TanhStack(nn.Module):
    def __init__(self, offload, depth=4, width=256):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.offload = offload

    def forward(self, x):
        for layer in self.layers:
            x = OffloadedTanh.apply(layer(x)) if self.offload else torch.tanh(layer(x))
        return x


def traced(model, batch, width):
    torch.manual_seed(0)
    return step_stablehlo(train_step, model, torch.randn(batch, width))


@pytest.fixture(scope="module")
def texts():
    if not backends.xla_available():
        pytest.skip("torch_xla is not installed")
    torch.manual_seed(0)
    plain, ckpt = Net(False), Net(True)
    ckpt.load_state_dict(plain.state_dict())
    return {
        "plain": traced(plain, BATCH, WIDTH),
        "checkpointed": traced(ckpt, BATCH, WIDTH),
        "stack": traced(TanhStack(False), 512, 256),
        "offloaded": traced(TanhStack(True), 512, 256),
    }


@pytest.fixture(scope="module")
def v5e(texts):
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'revlib_xla[tpu-compile]')")
    names = list(texts)
    return dict(zip(names, tpu_memory_many([texts[n] for n in names], "v5e", cache=False)))  # one worker


@needs_xla
@needs_jax
def test_step_stablehlo_compiles_on_xla_cpu():
    torch.manual_seed(0)
    model = small_mlp()
    text = step_stablehlo(train_step, model, torch.randn(8, 16))
    assert "func.func @main" in text and text.count("stablehlo.dot_general") == 5  # 2 forward, 3 backward
    assert all(p.grad is None for p in model.parameters())  # the pending graph was dropped
    mem = xla_cpu_memory(text, cache=False)
    assert isinstance(mem, CompiledMemory) and mem.platform == "xla:cpu"
    params = nbytes(*model.parameters())
    assert mem.argument_bytes >= params + 8 * 16 * F32  # parameters and the input are graph arguments
    assert mem.output_bytes >= params + F32  # every gradient and the loss are outputs
    assert mem.host_bytes == 0 and mem.hbm_peak_bytes == mem.peak_bytes >= mem.argument_bytes
    assert mem.count_ops(r"dot\(") >= 3
    again = xla_cpu_memory(text, cache=False)
    assert again == mem and again.optimized_hlo == mem.optimized_hlo
    assert xla_cpu_memory(text) is xla_cpu_memory(text)  # cached in memory
    with pytest.raises(ValueError, match="backward"):
        step_stablehlo(lambda m, x: m(x).sum(), small_mlp(), torch.randn(8, 16))


@needs_xla
@needs_jax
def test_xla_cpu_merges_the_recompute_back(texts):
    # Why TPU numbers are needed: XLA:CPU drops the barriers before CSE, which merges the recomputed matmuls with
    # the forward ones - the checkpointed graph ends up with the plain graph's matmuls and no less memory.
    plain, ckpt = xla_cpu_memory(texts["plain"]), xla_cpu_memory(texts["checkpointed"])
    assert ckpt.count_ops(r"opt-barrier\(", "pre_optimization") == DEPTH
    assert ckpt.count_ops() == plain.count_ops()
    assert ckpt.peak_bytes >= plain.peak_bytes


@needs_xla
@needs_libtpu
@pytest.mark.slow
def test_tpu_v5e_checkpointing_lowers_hbm_peak_and_keeps_the_recompute(texts, v5e):
    plain, ckpt = v5e["plain"], v5e["checkpointed"]
    for mem in (plain, ckpt):
        assert mem.platform == "tpu" and mem.topology == "v5e:2x2" and mem.device_kind == "TPU v5 lite"
        assert mem.host_bytes == 0 and mem.hbm_peak_bytes == mem.peak_bytes > 0
        assert "from the TPU compiler" in str(mem)
    # The barriers torch_xla.utils.checkpoint emits are in the input and survive into the pre-optimization HLO ...
    assert ckpt.count_ops(r"stablehlo\.optimization_barrier", "stablehlo") == DEPTH
    assert ckpt.count_ops(r"opt-barrier\(", "pre_optimization") == DEPTH
    assert plain.count_ops(r"opt-barrier\(", "pre_optimization") == 0
    # ... so the TPU compiler keeps the recomputed matmuls (2 per block) and needs less HBM.
    assert ckpt.count_ops() == plain.count_ops() + 2 * DEPTH
    assert ckpt.hbm_peak_bytes < plain.hbm_peak_bytes
    if PINNED:
        assert (plain.peak_bytes, ckpt.peak_bytes) == (3_158_016, 2_571_776)
    # Deterministic: a second compile in a fresh worker gives the same numbers and the same optimized HLO.
    again = tpu_memory(texts["checkpointed"], "v5e", cache=False)
    assert again == ckpt and again.optimized_hlo == ckpt.optimized_hlo


@needs_xla
@needs_libtpu
def test_tpu_v5e_host_offload_moves_saved_activations_out_of_hbm(v5e):
    plain, offloaded = v5e["stack"], v5e["offloaded"]
    # Four saved 512x256 f32 tensors are annotated for host memory (place_to_host + place_to_device each) ...
    assert offloaded.count_ops(r"annotate_device_placement", "stablehlo") == 2 * 4
    assert offloaded.count_ops(r"_xla_buffer_placement=\"pinned_host\"", "pre_optimization") == 4
    assert plain.host_bytes == 0
    # ... and the TPU compiler plans them in host memory: the peak includes them, the HBM peak does not.
    assert offloaded.host_bytes == offloaded.host_temp_bytes == 4 * 512 * 256 * F32
    assert offloaded.hbm_peak_bytes == offloaded.peak_bytes - offloaded.host_bytes
    assert offloaded.hbm_peak_bytes < plain.hbm_peak_bytes < offloaded.peak_bytes
    if PINNED:
        assert (plain.hbm_peak_bytes, offloaded.hbm_peak_bytes) == (6_302_720, 4_729_856)


@needs_xla
@needs_libtpu
@pytest.mark.parametrize("generation,kind", [("v6e", "TPU v6 lite"), ("v5p", "TPU v5")])
@pytest.mark.slow
def test_tpu_other_generations_compile(texts, generation, kind):
    plain, ckpt = tpu_memory_many([texts["plain"], texts["checkpointed"]], generation)
    assert plain.device_kind == ckpt.device_kind == kind
    assert plain.topology == memory.TPU_GENERATIONS[generation]
    assert 0 < ckpt.hbm_peak_bytes < plain.hbm_peak_bytes
    assert ckpt.count_ops() == plain.count_ops() + 2 * DEPTH


@needs_xla
@needs_libtpu
@pytest.mark.slow
def test_tpu_results_are_cached_in_memory_and_on_disk(texts, tmp_path, monkeypatch):
    text = texts["plain"]
    memory.clear_compile_cache()
    first = tpu_memory(text, disk_cache=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1
    assert tpu_memory(text, disk_cache=tmp_path) is first  # in-memory hit
    memory.clear_compile_cache()

    def no_compiles(*args, **kwargs):
        raise AssertionError("should have been served from the disk cache")

    monkeypatch.setattr(compiled_memory, "_run_tpu_worker", no_compiles)
    from_disk = tpu_memory(text, disk_cache=tmp_path)
    assert from_disk == first and from_disk.optimized_hlo == first.optimized_hlo
    monkeypatch.setenv("REVLIB_XLA_CACHE", str(tmp_path))
    memory.clear_compile_cache()
    assert tpu_memory(text) == first  # $REVLIB_XLA_CACHE turns the disk cache on


@needs_libtpu
def test_tpu_compiler_errors_are_reported():
    with pytest.raises(TpuCompileError, match="rejected module 0"):
        tpu_memory("this is not StableHLO", cache=False)
    with pytest.raises(ValueError, match="unknown TPU generation"):
        tpu_memory("module {}", "v9z")


def test_tpu_worker_crash_reports_stderr_tail(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        print("libtpu: something went badly wrong", file=sys.stderr)
        sys.exit(3)
    """)
    )

    class FakeHelpers:
        __file__ = str(script)

        @staticmethod
        def tpu_environment(topology, hbm_only=False):
            return dict(os.environ)

    with pytest.raises(TpuCompileError, match=r"(?s)exit code 3.*something went badly wrong"):
        compiled_memory._run_tpu_worker(["module {}"], "v5e:2x2", 0, 60.0, FakeHelpers)


def test_missing_tpu_compiler_names_the_extra(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real_find_spec(name, *a)
    )
    monkeypatch.delenv("TPU_LIBRARY_PATH", raising=False)
    with pytest.raises(MissingDependencyError, match=r"libtpu.*pip install 'revlib_xla\[tpu-compile\]'"):
        tpu_memory("module {}")


# ----------------------------------------------------------------------------------------------------------------
# Bad arguments, frozen parameters, the engine's device queues, the disk cache and libtpu's log files (issue 15)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match=r"saved_bytes needs a function to run.*got int 42"):
        saved_bytes(42)
    with pytest.raises(TypeError, match=r"tpu_memory needs StableHLO text.*got NoneType"):
        tpu_memory(None)
    with pytest.raises(TypeError, match=r"tpu_memory_many \(module 1\) needs StableHLO text.*got bytes"):
        tpu_memory_many(["module {}", b"module {}"])
    with pytest.raises(TypeError, match=r"takes a list of StableHLO texts.*tpu_memory\(text\)"):
        tpu_memory_many("module {}")
    with pytest.raises(TypeError, match=r"xla_cpu_memory needs StableHLO text.*got NoneType"):
        xla_cpu_memory(None)


def test_eager_peak_counts_frozen_parameters_and_target_device_copies():
    import revlib_xla as revlib

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    model[0].requires_grad_(False)  # fine-tuning: a frozen first layer
    peak = eager_peak(train_step, model, torch.randn(8, 16))
    assert peak.parameters == nbytes(*model.parameters())
    assert peak.end.gradients == nbytes(*model[2].parameters())  # only the trainable layer gets gradients
    assert all(p.grad is None for p in model[0].parameters())
    blocks = [nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(3)]
    streamed = revlib.ReversibleSequential(*blocks, split_dim=-1, target_device="cpu")
    peak = eager_peak(train_step, streamed, torch.randn(4, 16))
    assert peak.end.gradients == nbytes(*streamed.parameters())


STEP_AFTER_A_CPU_BACKWARD = """
import hashlib, sys, torch
sys.path.insert(0, {tests!r})
from test_memory import small_mlp, train_step
from revlib_xla import memory
torch.manual_seed(0)
model, x = small_mlp(), torch.randn(8, 16)
train_step(model, x)                           # a CPU backward first: the engine sizes its queues without XLA
model.zero_grad(set_to_none=True)
print(hashlib.sha256(memory.step_stablehlo(train_step, model, x).encode()).hexdigest())
"""


@needs_xla
@pytest.mark.slow
def test_step_stablehlo_works_after_a_cpu_backward(tmp_path):
    """The README's memory snippet: a CPU step, then step_stablehlo. The child process starts no XLA runtime before
    its CPU backward (this worker's conftest does); the StableHLO equals this process's."""
    script = tmp_path / "step_after_cpu_backward.py"
    script.write_text(STEP_AFTER_A_CPU_BACKWARD.format(tests=str(Path(__file__).parent)))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PJRT_DEVICE="CPU"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    torch.manual_seed(0)
    model, x = small_mlp(), torch.randn(8, 16)
    expected = hashlib.sha256(step_stablehlo(train_step, model, x).encode()).hexdigest()
    assert done.stdout.split()[-1] == expected


IDENTITY_HLO = "module { func.func @main(%arg0: tensor<64xf32>) -> tensor<64xf32> { return %arg0 : tensor<64xf32> } }"


@needs_jax
@pytest.mark.parametrize("damage", ["truncated", "not json", "a list", "other key", "field missing", "wrong type"])
def test_disk_cache_recompiles_a_damaged_entry(tmp_path, monkeypatch, damage):
    compiles = []
    real = compiled_memory._compile_helpers().compile_for_cpu
    monkeypatch.setattr(
        compiled_memory._compile_helpers(), "compile_for_cpu", lambda text: compiles.append(1) or real(text)
    )
    memory.clear_compile_cache()
    first = xla_cpu_memory(IDENTITY_HLO, disk_cache=tmp_path)
    (path,) = tmp_path.glob("*.json")
    entry = json.loads(path.read_text())
    text = path.read_text()
    broken = {
        "truncated": text[: len(text) // 2],
        "not json": "\x00\xff",
        "a list": "[]",
        "other key": json.dumps({**entry, "key": "0" * 64}),
        "field missing": json.dumps({k: v for k, v in entry.items() if k != "peak_memory_in_bytes"}),
        "wrong type": json.dumps({**entry, "optimized_hlo": 3}),
    }[damage]
    path.write_bytes(broken.encode("utf-8", "surrogateescape") if damage != "not json" else b"\x00\xff")
    memory.clear_compile_cache()
    again = xla_cpu_memory(IDENTITY_HLO, disk_cache=tmp_path)
    assert again == first and len(compiles) == 2  # compiled again, never a KeyError
    rewritten = json.loads(path.read_text())  # and rewritten (the same but for the compile time)
    del entry["compile_seconds"]
    assert rewritten.pop("compile_seconds") > 0 and rewritten == entry
    memory.clear_compile_cache()
    assert xla_cpu_memory(IDENTITY_HLO, disk_cache=tmp_path) == first and len(compiles) == 2  # now a hit


def test_disk_cache_is_bounded_least_recently_used_first(tmp_path, monkeypatch):
    monkeypatch.setenv("REVLIB_XLA_CACHE_MAX_BYTES", "3KiB")
    valid = lambda entry: "payload" in entry
    for i, key in enumerate("abcd"):
        compile_cache.store(tmp_path, key, {"payload": "x" * 900})
        os.utime(tmp_path / f"{key}.json", (1000 + i, 1000 + i))  # written in the order a, b, c, d
    # four entries of ~920 bytes exceed 3 KiB: the least recently used one (a) was evicted
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == ["b", "c", "d"]
    assert compile_cache.load(tmp_path, "b", valid) is not None  # a read is a use: b is now the newest
    compile_cache.store(tmp_path, "e", {"payload": "x" * 900})
    assert sorted(p.stem for p in tmp_path.glob("*.json")) == ["b", "d", "e"]
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 3 * 1024
    compile_cache.store(tmp_path, "huge", {"payload": "x" * 5000})  # larger than the bound: not stored
    assert not (tmp_path / "huge.json").exists() and len(list(tmp_path.iterdir())) == 3
    monkeypatch.setenv("REVLIB_XLA_CACHE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="REVLIB_XLA_CACHE_MAX_BYTES='lots' is not a size.*512MiB"):
        compile_cache.max_bytes()
    monkeypatch.setenv("REVLIB_XLA_CACHE_MAX_BYTES", "2 GB")
    assert compile_cache.max_bytes() == 2 * 10**9
    monkeypatch.delenv("REVLIB_XLA_CACHE_MAX_BYTES")
    assert compile_cache.max_bytes() == compile_cache.DEFAULT_MAX_BYTES == 2**30
    monkeypatch.delenv("REVLIB_XLA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.directory_for(True) == tmp_path / "xdg" / "revlib_xla"
    assert compile_cache.directory_for(None) is None and compile_cache.directory_for(False) is None


@needs_libtpu
@pytest.mark.slow
def test_tpu_compile_leaves_no_log_files_behind(monkeypatch):
    """libtpu writes two log files per process to $TPU_LOG_DIR (default /tmp/tpu_logs, never cleaned): the worker's
    go into its temporary directory, which is deleted."""
    monkeypatch.delenv("TPU_LOG_DIR", raising=False)
    seen = {}
    real_run = subprocess.run

    def run(command, env, **kwargs):
        done = real_run(command, env=env, **kwargs)
        seen["dir"] = Path(env["TPU_LOG_DIR"])
        seen["files"] = list(seen["dir"].iterdir())
        return done

    monkeypatch.setattr(compiled_memory.subprocess, "run", run)
    tpu_memory(IDENTITY_HLO, cache=False)
    assert seen["files"], "libtpu wrote no log where TPU_LOG_DIR pointed"
    assert seen["dir"].name == "tpu_logs" and seen["dir"].parent.name.startswith("revlib_xla_tpu_")
    assert not seen["dir"].exists()  # deleted with the worker's temporary directory


def test_compile_timeout_reads_the_environment_and_refuses_a_bad_value(monkeypatch):
    from revlib_xla.memory import compile_timeout

    monkeypatch.delenv("REVLIB_XLA_COMPILE_TIMEOUT", raising=False)
    assert compile_timeout() == 600.0
    monkeypatch.setenv("REVLIB_XLA_COMPILE_TIMEOUT", "5400")
    assert compile_timeout() == 5400.0
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("REVLIB_XLA_COMPILE_TIMEOUT", bad)
        with pytest.raises(ValueError, match="REVLIB_XLA_COMPILE_TIMEOUT.*positive number of seconds"):
            compile_timeout()


@pytest.mark.parametrize(
    "old, new",
    [
        ("revlib_xla.tpu_compile", "revlib_xla.compiled.worker"),
        ("revlib_xla.hlo_liveness", "revlib_xla.compiled.liveness"),
        ("revlib_xla.compile_cache", "revlib_xla.compiled.cache"),
    ],
)
def test_old_compiled_module_paths_warn_and_give_the_same_objects(old, new, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: import from {new}"):
        shim = importlib.import_module(old)
    home = importlib.import_module(new)
    assert shim.__all__ and all(getattr(shim, name) is getattr(home, name) for name in shim.__all__)
    assert set(home.__all__) <= set(shim.__all__)  # every public name of the new home is still reachable here


def test_memory_reexports_the_compiled_names_and_the_units():
    from revlib_xla import compiled, units
    from revlib_xla.compiled import stablehlo

    homes = [compiled_memory, stablehlo, units]
    for name in memory.__all__:
        home = next((m for m in homes if name in m.__all__), memory)
        assert getattr(memory, name) is getattr(home, name), name
    assert memory.compile_timeout is compiled_memory.compile_timeout and memory.BYTE_UNITS is units.BYTE_UNITS
    assert compiled.__doc__ and memory.parse_bytes("1.5 KiB") == 1536.0 and memory.format_bytes(1536) == "1.50 KiB"
