"""Requirement 7: the activation memory of a reversible sequence does not grow with depth.

* Eager (cpu, cuda): the peak of forward + backward grows with depth by exactly the parameters and their gradients
  (PyTorch's ``MemTracker`` via :func:`revlib_xla.memory.eager_peak`, also under ``FakeTensorMode``; on cuda also
  the caching allocator's ``max_memory_allocated``), while ``no_savings`` grows by the activations too. RevLib's
  cache modes (``checkpoint``, ``autograd_graph``) run as the function mode and never peak above ``no_savings``.
* XLA: the whole training step is exported as StableHLO and compiled deviceless for TPU v5e (every buffer in HBM).
  Per added layer, the HBM peak grows by the parameters and their gradients and nothing else: the growth that
  scales with the batch (activations) and the growth that does not (parameter-sized buffers) are each about zero,
  while ``no_savings`` grows by more than two activations per layer. The optimized HLO still holds the
  recomputation (the optimization barriers stop CSE from merging it with the forward).
"""

import importlib.util

import pytest
import torch
from torch import nn

import revlib_xla as revlib
from revlib_xla import MemoryModes, backends, memory
from revlib_xla.compiled import liveness as hlo_liveness

WIDTH = 128  # features per stream


def block() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.Tanh(), nn.Linear(2 * WIDTH, WIDTH))


PARAM_BYTES_PER_LAYER = sum(p.numel() for p in block().parameters()) * 4  # float32


def model(
    depth: int, mode: MemoryModes = MemoryModes.autograd_function, exact: bool | None = None
) -> revlib.ReversibleSequential:
    torch.manual_seed(0)
    return revlib.ReversibleSequential(*[block() for _ in range(depth)], memory_mode=mode, exact=exact)


def train_step(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = m(x).square().mean()
    loss.backward()
    return loss


# ---------------------------------------------------------------------------------------------------------------
# Eager


@pytest.fixture
def eager_device(device):
    if device.type == "xla":
        pytest.skip("an XLA step's memory is decided by the compiler: see the TPU tests below")
    return device


def _on(device, build):
    """``build()`` with its tensors created on ``device`` (newer torch cannot move a fake module with ``.to``)."""
    with torch.device(device):
        return build()


def _peak(depth, mode, device, batch=512, fake=False, exact=None):
    if fake:
        return memory.eager_peak(
            train_step,
            lambda: _on(device, lambda: model(depth, mode, exact)),
            lambda: torch.randn(batch, 2 * WIDTH, device=device),
            fake=True,
        )
    m = model(depth, mode, exact).to(device)
    return memory.eager_peak(train_step, m, torch.randn(batch, 2 * WIDTH).to(device))


@pytest.mark.slow
def test_eager_peak_grows_only_by_parameters_and_gradients(eager_device):
    peaks = {d: _peak(d, MemoryModes.autograd_function, eager_device) for d in (4, 8, 16)}
    plain = {d: _peak(d, MemoryModes.no_savings, eager_device) for d in (4, 16)}
    for small, big in ((4, 8), (8, 16)):
        # exactly one more set of parameters and one more set of gradients per layer, nothing else
        assert peaks[big].total - peaks[small].total == 2 * (big - small) * PARAM_BYTES_PER_LAYER, (
            peaks[small],
            peaks[big],
        )
        assert peaks[big].activations + peaks[big].temporaries == peaks[small].activations + peaks[small].temporaries
    # no_savings also keeps every layer's activations (here about one hidden layer, two streams' worth, per layer;
    # not every gradient is live at its peak, so subtracting all of them undercounts a little)
    activation_per_layer = (plain[16].total - plain[4].total) / 12 - 2 * PARAM_BYTES_PER_LAYER
    assert activation_per_layer >= 1.9 * 512 * WIDTH * 4, activation_per_layer
    assert peaks[16].total < plain[16].total


def test_eager_peak_under_fake_tensors_equals_real(eager_device):
    """Sizing a reversible model without allocating it: FakeTensorMode gives the real step's bytes (the per-step
    seed of the dropout replay is drawn outside the fake mode)."""
    assert (
        _peak(8, MemoryModes.autograd_function, eager_device, fake=True).total
        == _peak(8, MemoryModes.autograd_function, eager_device).total
    )


@pytest.mark.filterwarnings("ignore:MemoryModes")
@pytest.mark.parametrize("mode", [MemoryModes.checkpoint, MemoryModes.autograd_graph])
@pytest.mark.slow
def test_cache_modes_never_peak_above_no_savings(eager_device, mode):
    """RevLib's cache modes run as autograd_function, whose peak is below no_savings' with float streams from 4
    layers on. Exact (fixed-point) streams hold 8-byte integers and decoded values: a larger constant, 8 half-streams
    (float32) more here (22.5 against 14.5), so below no_savings from 8 layers on at this width."""
    for exact, depths in ((False, (4, 16)), (None, (16,))):
        for depth in depths:
            cache_mode = _peak(depth, mode, eager_device, exact=exact).total
            assert cache_mode <= _peak(depth, MemoryModes.no_savings, eager_device).total, (exact, depth)
            assert cache_mode == _peak(depth, MemoryModes.autograd_function, eager_device, exact=exact).total


def test_cuda_allocator_peak_grows_only_by_parameters_and_gradients():
    if not backends.cuda_available():
        pytest.skip("no CUDA GPU on this machine")
    dev = backends.device_for("cuda")
    x = torch.randn(4096, 2 * WIDTH, device=dev)

    def increase(depth, mode):
        m = model(depth, mode).to(dev)
        return memory.cuda_peak(train_step, m, x, device=dev).increase

    rev = {d: increase(d, MemoryModes.autograd_function) for d in (8, 32)}
    plain = {d: increase(d, MemoryModes.no_savings) for d in (8, 32)}
    grads_per_layer = PARAM_BYTES_PER_LAYER  # the call allocates gradients, not parameters
    slack = 24 * 512 * 24  # allocator rounding: a few 512-byte blocks per gradient tensor
    assert rev[32] - rev[8] <= 24 * grads_per_layer + slack, rev
    assert plain[32] - plain[8] >= 24 * (grads_per_layer + 4096 * 2 * WIDTH * 4), plain


# ---------------------------------------------------------------------------------------------------------------
# XLA, compiled for TPU v5e without a TPU, with every buffer in HBM (hbm_only): by default the compiler also
# prefetches every layer's weights into VMEM (on-chip, ~128 MiB) when they fit, and the reported peak then counts
# that VMEM allocation, which grows by one parameter copy per layer without costing HBM.

TPU_WIDTH = 512  # compute-bound enough that XLA once put every weight-gradient matmul after the backward walk
TPU_BATCHES = (64, 256)
TPU_DEPTHS = (4, 8)


def tpu_block() -> nn.Module:
    return nn.Sequential(nn.Linear(TPU_WIDTH, TPU_WIDTH), nn.GELU(), nn.Linear(TPU_WIDTH, TPU_WIDTH))


TPU_PARAM_BYTES_PER_LAYER = sum(p.numel() for p in tpu_block().parameters()) * 4


def _v5e_results():
    if not backends.xla_available():
        pytest.skip("torch_xla is not installed (pip install 'revlib_xla[xla]')")
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'revlib_xla[tpu-compile]')")
    keys, texts = [], []
    for mode in (MemoryModes.autograd_function, MemoryModes.no_savings, "float streams"):
        for batch in TPU_BATCHES:
            for depth in TPU_DEPTHS:
                torch.manual_seed(1)
                kw = {"memory_mode": mode} if mode != "float streams" else {"exact": False}
                m = revlib.ReversibleSequential(*[tpu_block() for _ in range(depth)], **kw)
                texts.append(memory.step_stablehlo(train_step, m, torch.randn(batch, 2 * TPU_WIDTH)))
                keys.append((mode, batch, depth))
    results = dict(zip(keys, memory.tpu_memory_many(texts, "v5e", cache=False, hbm_only=True, liveness=True)))
    # the reversible step at the small batch again, compiled as a TPU compiles it by default (VMEM assignment on)
    default = [texts[keys.index((MemoryModes.autograd_function, TPU_BATCHES[0], depth))] for depth in TPU_DEPTHS]
    for depth, result in zip(TPU_DEPTHS, memory.tpu_memory_many(default, "v5e", cache=False, liveness=True)):
        results[("default", TPU_BATCHES[0], depth)] = result
    return results


@pytest.fixture(scope="module")
def v5e():
    return _v5e_results()


def _peak_beyond_arguments_and_outputs(result) -> int:
    """The HBM the step allocates besides its arguments (parameters, input) and outputs (gradients, loss)."""
    return result.hbm_peak_bytes - result.argument_bytes - result.output_bytes


def _live_set(result) -> int:
    """What the step keeps alive at once besides its arguments and outputs: unlike the allocations, this also
    counts values the compiler parks in an output's buffer before the output is written (gradients come last)."""
    return result.live_peak_bytes


def _growth_per_layer(results, mode, measure, batch):
    lo, hi = (results[(mode, batch, depth)] for depth in TPU_DEPTHS)
    return (measure(hi) - measure(lo)) / (TPU_DEPTHS[1] - TPU_DEPTHS[0])


def _split_growth(results, mode, measure):
    """Per added layer, the growth of ``measure`` split into what scales with the batch (activations, in
    half-streams: one stream of one layer) and what does not (parameter-sized buffers, in copies of one layer's
    parameters)."""
    small, big = TPU_BATCHES
    growth = {batch: _growth_per_layer(results, mode, measure, batch) for batch in TPU_BATCHES}
    row = TPU_WIDTH * 4  # bytes of one stream per sample
    half_streams = (growth[big] - growth[small]) / ((big - small) * row)
    param_copies = (growth[small] - half_streams * small * row) / TPU_PARAM_BYTES_PER_LAYER
    return half_streams, param_copies


@pytest.mark.slow
def test_tpu_v5e_hbm_peak_grows_only_by_parameters_and_gradients(v5e):
    for key, result in v5e.items():
        assert result.platform == "tpu" and result.host_bytes == 0 and result.hbm_only == (key[0] != "default")
    for name, measure in (("HBM peak", _peak_beyond_arguments_and_outputs), ("live set", _live_set)):
        half_streams, param_copies = _split_growth(v5e, MemoryModes.autograd_function, measure)
        print(
            f"\nreversible, {name} per added layer beyond parameters and gradients: {half_streams:.3f} "
            f"half-streams, {param_copies:.3f} parameter copies"
        )
        # Activations do not grow with depth (before each layer's gradients were put behind the next layer's
        # barrier: 1.5 half-streams per layer, the recomputed activations and output gradients of every layer kept
        # for the weight-gradient matmuls, which the compiler scheduled after the walk) ...
        assert abs(half_streams) <= 0.05, (name, half_streams)
        # ... and no parameter-sized buffer is kept per layer (issue 15: at most 0.1 of one layer's parameters)
        assert abs(param_copies) <= 0.1, (name, param_copies)
    # no_savings keeps each layer's activations (two streams' worth and more): above the reversible step with
    # floating-point streams at every depth here
    for batch in TPU_BATCHES:
        plain = _growth_per_layer(v5e, MemoryModes.no_savings, _live_set, batch)
        assert plain >= 2 * batch * TPU_WIDTH * 4, (batch, plain)
        for depth in TPU_DEPTHS:
            assert (
                v5e[("float streams", batch, depth)].hbm_peak_bytes
                < v5e[(MemoryModes.no_savings, batch, depth)].hbm_peak_bytes
            )


def test_tpu_v5e_exact_streams_cost_a_constant_beyond_float_streams(v5e):
    """Exact (fixed-point) streams hold 8-byte integers beside the decoded values: a constant number of
    half-streams more than float32 streams, the same at every depth (their growth per layer is the same)."""
    row = TPU_WIDTH * 4
    extra = {
        (batch, depth): (
            _peak_beyond_arguments_and_outputs(v5e[(MemoryModes.autograd_function, batch, depth)])
            - _peak_beyond_arguments_and_outputs(v5e[("float streams", batch, depth)])
        )
        / (batch * row)
        for batch in TPU_BATCHES
        for depth in TPU_DEPTHS
    }
    print(f"\nexact streams beyond float32 streams, in half-streams (batch, depth): {extra}")
    for batch in TPU_BATCHES:
        small, big = (extra[(batch, depth)] for depth in TPU_DEPTHS)
        assert abs(big - small) <= 1, extra  # a constant, not a per-layer cost (the compiler places buffers a
        # half-stream apart between depths; the growth per layer is asserted ~0 above)
        assert 0 <= small <= 12, extra


def test_tpu_v5e_default_peak_counts_weights_prefetched_into_vmem(v5e):
    """Compiled with VMEM assignment on (a TPU's default), the reported peak beyond arguments and outputs is the
    VMEM allocation's live peak, which grows by most of a parameter copy per layer: the compiler prefetches the
    layers' weights into VMEM (~128 MiB on chip) while they fit. The HBM values it keeps do not grow with depth."""
    lo, hi = (v5e[("default", TPU_BATCHES[0], depth)] for depth in TPU_DEPTHS)
    for result in (lo, hi):
        vmem = hlo_liveness.live_peak(result.buffer_assignment, memory_space=1).bytes
        # (constants, and the range check's extremes: two (lo, hi) pairs per layer, its addend's and its stream's)
        assert 0 <= _peak_beyond_arguments_and_outputs(result) - vmem <= 8192
    per_layer = (_peak_beyond_arguments_and_outputs(hi) - _peak_beyond_arguments_and_outputs(lo)) / (
        TPU_DEPTHS[1] - TPU_DEPTHS[0]
    )
    assert per_layer >= 0.5 * TPU_PARAM_BYTES_PER_LAYER, per_layer
    hbm_values = (_live_set(hi) - _live_set(lo)) / (TPU_DEPTHS[1] - TPU_DEPTHS[0])
    assert hbm_values <= 0.1 * TPU_PARAM_BYTES_PER_LAYER, hbm_values


def test_tpu_v5e_keeps_the_recomputation(v5e):
    for batch in TPU_BATCHES:
        for depth in TPU_DEPTHS:
            rev = v5e[(MemoryModes.autograd_function, batch, depth)]
            plain = v5e[(MemoryModes.no_savings, batch, depth)]
            # one barrier per layer is emitted, and the two recomputed matmuls of (almost) every layer survive
            assert rev.count_ops(r"opt-barrier\(", "pre_optimization") == depth
            assert plain.count_ops(r"opt-barrier\(", "pre_optimization") == 0
            assert rev.count_ops() - plain.count_ops() >= 2 * (depth - 1), (rev.count_ops(), plain.count_ops())


def test_backward_drops_the_saved_output_streams():
    """The backward frees the two saved output streams once it has rebuilt the last layer's input (RevLib's peak),
    unless the graph is retained: then they must outlive the backward, which costs exactly two streams more."""
    torch.manual_seed(0)
    model = revlib.ReversibleSequential(  # float streams: the saved streams are the outputs' own storage
        *[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(8)], split_dim=-1, exact=False
    )
    x = torch.randn(4, 8, 32, requires_grad=True)
    freed = memory.eager_peak(lambda m, inp: m(inp).mean().backward(), model, x)
    retained = memory.eager_peak(lambda m, inp: m(inp).mean().backward(retain_graph=True), model, x)
    assert retained.total - freed.total == 2 * x.numel() // 2 * x.element_size()
