"""Parameters off the device (issue 5, part 1): ``ReversibleSequential(..., target_device=...)`` and
``offload_tensor``.

The parameters stay on the host (cpu); each layer's copies are streamed to the target device one layer ahead.
On cpu the target is the cpu itself, with real copies, so which copies exist can be tracked; on xla the target is
the XLA device; on cuda (when lent) the GPU, whose allocator peak is checked too.

* Gradients equal those of the same model without offload: float64 bit for bit on cpu, float32 <= 1e-6 on xla and
  cuda; with dropout, a tensor argument that needs a gradient, and two forwards before one backward.
* Residency: at no point are more than two layers' copies alive on the device (the streamer tracks the storages
  of every copy it gave out, so a copy kept alive elsewhere counts); the tracker's control shows it counts leaks.
  On cuda the allocator's peak during a step stays within about two layers' parameters (and one layer's grads).
* Normalization statistics are updated once, on the host buffers; the fused optimizer steps the host parameters
  (its state stays on the host) with the same losses, bit for bit, as an unfused run without offload.
"""

import copy

import pytest
import torch
from conftest import max_rel_err, to_host
from torch import nn

import revlib_xla as revlib
from revlib_xla import ParameterStreamer, backends, offload_tensor

WIDTH = 8
DEPTH = 6


class Block(nn.Module):
    """Linear - GELU - Dropout - Linear, plus an optional tensor argument added to the output."""

    def __init__(self, width: int = WIDTH, p: float = 0.2):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x, bias=None):
        out = self.lin2(self.drop(nn.functional.gelu(self.lin1(x))))
        return out if bias is None else out + bias


def _models(device, dtype, **kwargs):
    """The same reversible model twice: without offload on ``device``, and with parameters on the cpu streamed
    to ``device``."""
    torch.manual_seed(0)
    blocks = [Block() for _ in range(DEPTH)]
    ref = revlib.ReversibleSequential(*copy.deepcopy(blocks), **kwargs).to(device=device, dtype=dtype)
    off = revlib.ReversibleSequential(*copy.deepcopy(blocks), target_device=device, **kwargs).to(dtype=dtype)
    return ref, off


def _two_forwards_one_backward(model, device, dtype):
    gen = torch.Generator().manual_seed(2)
    x1, x2 = (torch.randn(3, 2 * WIDTH, generator=gen, dtype=dtype).to(device) for _ in range(2))
    bias = torch.randn(WIDTH, generator=gen, dtype=dtype).to(device).requires_grad_()
    backends.manual_seed(device, 5)
    out1 = model(x1, bias=bias)
    out2 = model(x2, bias=bias)  # a second forward before the first backward: nothing kept on the module
    (out1.square().mean() + (out2 * x1).mean()).backward()
    backends.sync(device)
    return [to_host(out1), to_host(out2)], to_host(bias.grad), [to_host(p.grad) for p in model.parameters()]


@pytest.mark.parametrize("mode", ["reversible", "no_savings"])
@pytest.mark.slow
def test_gradients_equal_no_offload(device, mode):
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    memory_mode = revlib.MemoryModes.no_savings if mode == "no_savings" else revlib.MemoryModes.autograd_function
    ref, off = _models(device, dtype, memory_mode=memory_mode)
    ref_out, ref_bias, ref_grads = _two_forwards_one_backward(ref, device, dtype)
    out, bias, grads = _two_forwards_one_backward(off, device, dtype)
    assert all(p.device.type == "cpu" and p.grad.device.type == "cpu" for p in off.parameters())
    if dtype == torch.float64:
        assert all(torch.equal(a, b) for a, b in zip(out, ref_out))
        assert torch.equal(bias, ref_bias)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    else:
        assert max(max_rel_err(a, b) for a, b in zip(out, ref_out)) <= 1e-6
        assert max_rel_err(bias, ref_bias) <= 1e-6
        assert max(max_rel_err(a, b) for a, b in zip(grads, ref_grads)) <= 1e-6


@pytest.mark.slow
def test_at_most_two_layers_on_the_device(device):
    _, off = _models(device, torch.float32)
    x = torch.randn(4, 2 * WIDTH).to(device)
    off(x).sum().backward()  # builds the streamer
    streamer = off.streamer
    streamer.reset_stats()
    out = off(x)
    assert streamer.max_resident <= 2 and streamer.resident() == set()
    out.square().mean().backward()
    backends.sync(device)
    assert streamer.max_resident == 2, "one layer in use and the next one prefetched"
    assert streamer.transfers == 2 * DEPTH  # each layer copied once for the forward, once for the recomputation
    assert streamer.resident() == set()


def test_cuda_allocator_peak_holds_about_two_layers(device):
    if device.type != "cuda":
        pytest.skip("the allocator peak is a cuda measurement; cpu and xla track the copies (test above)")
    width, depth = 512, 8
    torch.manual_seed(0)
    model = revlib.ReversibleSequential(*[Block(width, p=0.0) for _ in range(depth)], target_device=device)
    layer_bytes = sum(p.numel() * p.element_size() for p in model[0].parameters())
    x = torch.randn(2, 2 * width, device=device)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model(x).square().mean().backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    # two persistent buffers of one layer each, one layer's gradients before they go to the host, and activations
    # of a batch of 2; all layers on the device would be depth * layer_bytes
    assert peak <= 4 * layer_bytes, (peak, layer_bytes)
    assert all(p.device.type == "cpu" and p.grad.device.type == "cpu" for p in model.parameters())


def test_deepcopy_after_use_leaves_the_streamer_behind():
    _, off = _models(torch.device("cpu"), torch.float64)
    x = torch.randn(3, 2 * WIDTH, dtype=torch.float64)
    torch.manual_seed(1)  # the same dropout masks in both calls
    off(x).sum().backward()
    twin = copy.deepcopy(off)
    assert off.streamer is not None and twin.streamer is None
    twin.zero_grad()
    torch.manual_seed(1)
    twin(x).sum().backward()
    assert twin.streamer.units[0][0] is twin[0].block.lin1.weight
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(off.parameters(), twin.parameters()))


def test_residency_tracker_counts_copies_kept_alive_elsewhere():
    """The control: a caller that keeps the copies it was given makes them count as resident."""
    units = [[torch.randn(3)] for _ in range(4)]
    streamer = ParameterStreamer(units, "cpu")
    kept = []
    for i in range(4):
        kept.append(streamer.fetch(i, prefetch=i + 1))
        streamer.release(i)
    assert streamer.max_resident == 4 and streamer.resident() == {0, 1, 2, 3}
    kept.clear()
    assert streamer.resident() == set()
    assert all(torch.equal(streamer.fetch(0)[0], units[0][0]) for _ in range(1))


def test_batchnorm_statistics_updated_once_on_the_host():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH)) for _ in range(3)]
    ref = revlib.ReversibleSequential(*copy.deepcopy(blocks)).double()
    off = revlib.ReversibleSequential(*copy.deepcopy(blocks), target_device="cpu").double()
    x = torch.randn(5, 2 * WIDTH, dtype=torch.float64)
    for model in (ref, off):
        model(x).sum().backward()
    for (name, a), b in zip(ref.named_buffers(), off.buffers()):
        assert torch.equal(a, b), name
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), off.parameters()))


@pytest.mark.slow
def test_fused_optimizer_with_offload_steps_host_parameters():
    sgd = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)
    torch.manual_seed(0)
    blocks = [Block(p=0.0) for _ in range(DEPTH)]
    ref = revlib.ReversibleSequential(*copy.deepcopy(blocks))
    off = revlib.ReversibleSequential(*copy.deepcopy(blocks), target_device="cpu", fused_optimizer=sgd)
    opt = sgd(ref.parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        x = torch.randn(3, 2 * WIDTH, generator=gen)
        ref_loss = (ref(x) - x).abs().mean()
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        loss = (off(x) - x).abs().mean()
        loss.backward()
        assert torch.equal(loss, ref_loss)
    states = [s for o in off.fused_optimizer.optimizers for s in o.state.values()]
    assert states and all(s["momentum_buffer"].device.type == "cpu" for s in states)


def test_offload_tensor_moves_forward_and_gradient(device):
    weight = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4).to(device)
    on_device = offload_tensor(weight, x)
    assert on_device.device == x.device
    (x @ on_device).sum().backward()
    assert weight.grad.device.type == "cpu"
    assert torch.allclose(weight.grad, to_host(x).sum(0, keepdim=True).t().expand(4, 4), atol=1e-6)
    assert offload_tensor(weight, weight) is weight
    with pytest.raises(TypeError, match="reference must be a tensor or a device"):
        offload_tensor(weight, 3)


def test_target_device_is_an_option_of_the_sequence():
    with pytest.raises(revlib.ReversibleError, match="options of the ReversibleSequential"):
        revlib.ReversibleModule(Block(), target_device="cpu")


@pytest.mark.slow
def test_xla_design_per_layer_graphs_hold_less_hbm_than_host_annotations():
    """Why target_device on XLA streams parameters into per-layer graphs instead of annotating them for host memory
    inside one step graph (TPU v5e, deviceless compile): the annotated parameters are still HBM arguments of the
    graph, while a per-layer graph holds one layer's. bench/offload_xla_design.py records the full-size numbers."""
    import importlib.util
    import sys
    from pathlib import Path

    if not backends.xla_available() or importlib.util.find_spec("libtpu") is None:
        pytest.skip("needs torch_xla and libtpu (pip install 'revlib_xla[xla,tpu-compile]')")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from offload_xla_design import measure

    depth = 4
    r = measure(width=128, depth=depth, batch=16)
    whole, annotated, layer = r["whole step"], r["whole step + place_to_host"], r["one layer (target_device)"]
    assert annotated["host_annotations"] > 0 and whole["host_annotations"] == layer["host_annotations"] == 0
    assert annotated["host_bytes"] > 0 and annotated["argument_bytes"] == whole["argument_bytes"]
    assert layer["argument_bytes"] < whole["argument_bytes"] / (depth - 1)
    assert layer["hbm_peak_bytes"] < annotated["hbm_peak_bytes"] < whole["hbm_peak_bytes"]


def test_inverse_and_invertibility_check_with_offload(device):
    ref, off = _models(device, torch.float32)
    off.eval()
    x = torch.randn(3, 2 * WIDTH).to(device)
    with torch.no_grad():
        y = off(x)
        assert max_rel_err(y, ref.eval()(x)) <= 1e-6
        assert max_rel_err(off.inverse(y), x) <= 1e-5
    report = revlib.check_invertible(off, x)
    assert report.worst <= 1e-4


def test_xla_host_placement_annotations_or_identity():
    """backends.place_on_host/place_on_device: annotations in the graph where asked (HLO checked, never executed
    here: PJRT CPU cannot run them), the tensor itself where they cannot execute (numerics unchanged)."""
    if not backends.xla_available():
        pytest.skip("torch_xla is not installed (pip install 'revlib_xla[xla]')")
    dev = backends.device_for("xla")
    x = torch.randn(4, 4).to(dev)
    assert not backends.host_placement_executes()  # this test runs on PJRT CPU
    same = backends.place_on_device(backends.place_on_host(x * 2))
    assert torch.equal(to_host(same), to_host(x) * 2)
    annotated = backends.place_on_device(backends.place_on_host(x * 3, annotate=True), annotate=True)
    text = backends.lazy_stablehlo([annotated])
    assert text.count("annotate_device_placement") == 2
    assert "pinned_host" in text and '"device"' in text
    del annotated  # dropped unexecuted
    cpu = torch.ones(2)
    assert backends.place_on_host(cpu, annotate=True) is cpu
