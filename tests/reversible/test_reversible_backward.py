"""What the reversible backward does with each request for gradients (issue 15: 2.1, 2.4 and the gradient
accumulation item of 4).

* Where each gradient goes (``revlib_xla._grad_destination``): ``torch.autograd.grad(loss, x)`` and
  ``backward(inputs=[x])`` leave the weights of a fused model alone (``fused_optimizer=`` and ``fuse_optimizer``),
  and compute no weight gradient at all; ``torch.autograd.grad(loss, params)`` returns the ``no_savings``
  gradients and steps nothing.
* Each layer's parameter gradients go through the parameters' own ``AccumulateGrad`` as soon as the backward has
  passed the layer: tensor hooks, post-accumulate-grad hooks and hooks on the ``AccumulateGrad`` node fire exactly
  once per backward with the ``no_savings`` gradient, interleaved with the recomputation, with and without
  ``target_device``; with gradients already in ``.grad`` (micro-batches), the bytes created by a backward are
  about one layer's gradients, not a second copy of all of them.
* Gradients of gradients (``create_graph=True``) raise a ``ReversibleError`` that says what to use instead.
"""

import pytest
import torch
from conftest import max_rel_err, to_host
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import revlib_xla as revlib
from revlib_xla import MemoryModes, backends, memory

WIDTH = 4
DEPTH = 4
SGD = lambda params: torch.optim.SGD(params, lr=0.1)


def _blocks(width=WIDTH, depth=DEPTH):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(depth)]


def _dtype(device):
    return torch.float64 if device.type == "cpu" else torch.float32


def _tol(device):
    return 1e-10 if device.type == "cpu" else 1e-5


def _input(device):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(3, 2 * WIDTH, generator=gen, dtype=_dtype(device)).to(device).requires_grad_()


def _loss(model, x):
    out = model(x)
    return (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape).to(out.device)).sum()


def _reference(device, x):
    """Input and parameter gradients of the same model under plain autograd (``no_savings``)."""
    ref = revlib.ReversibleSequential(*_blocks(), memory_mode=MemoryModes.no_savings).to(device, _dtype(device))
    grads = torch.autograd.grad(_loss(ref, x), [x, *ref.parameters()])
    return to_host(grads[0]), to_host(grads[1:])


def _offload_kwargs(device, offload):
    return {"target_device": device} if offload else {}


def _fused(kind, device):
    if kind == "fused_optimizer":
        return revlib.ReversibleSequential(*_blocks(), fused_optimizer=SGD).to(device, _dtype(device))
    model = revlib.ReversibleSequential(*_blocks()).to(device, _dtype(device))
    revlib.fuse_optimizer(model, SGD)
    return model


# ---------------------------------------------------------------------------------------------------------------
# 1. Requests that are not a training backward step nothing

REQUESTS = {
    "backward": lambda loss, x, params: loss.backward(),
    "grad_x": lambda loss, x, params: torch.autograd.grad(loss, x),
    "grad_params": lambda loss, x, params: torch.autograd.grad(loss, params),
    "backward_inputs_x": lambda loss, x, params: loss.backward(inputs=[x]),
}


@pytest.mark.parametrize("request_", ["grad_x", "grad_params", "backward_inputs_x"])
@pytest.mark.parametrize("kind", ["fused_optimizer", "fuse_optimizer"])
@pytest.mark.slow
def test_fused_weights_unchanged_by_requests_that_are_not_training(device, kind, request_):
    x = _input(device)
    ref_x_grad, ref_param_grads = _reference(device, x)
    x.grad = None
    model = _fused(kind, device)
    params = list(model.parameters())
    before = [to_host(p).clone() for p in params]  # .cpu() of a cpu tensor is the tensor itself
    got = REQUESTS[request_](_loss(model, x), x, params)
    backends.sync(device)
    assert all(torch.equal(to_host(p), b) for p, b in zip(params, before)), "a weight was stepped"
    assert all(p.grad is None for p in params)
    if request_ == "grad_params":
        assert len(got) == len(ref_param_grads)
        assert max(max_rel_err(g, r) for g, r in zip(got, ref_param_grads)) <= _tol(device)
    else:
        x_grad = got[0] if request_ == "grad_x" else x.grad
        assert max_rel_err(x_grad, ref_x_grad) <= _tol(device)
    # the same model still trains: a plain backward steps every weight
    _loss(model, x).backward()
    backends.sync(device)
    assert not any(torch.equal(to_host(p), b) for p, b in zip(params, before))


@pytest.mark.parametrize("offload", [False, True], ids=["on_device", "target_device"])
def test_captured_parameter_gradients_equal_no_savings_unfused(device, offload):
    """``autograd.grad`` of some parameters only returns exactly those and leaves ``.grad`` untouched: one layer's
    (the walk stops after the last layer, 3), layer 0's (the walk goes through all), a mix across layers."""
    x = _input(device)
    _, ref = _reference(device, x)
    model = revlib.ReversibleSequential(*_blocks(), **_offload_kwargs(device, offload))
    model.to(dtype=_dtype(device)) if offload else model.to(device, _dtype(device))
    params = list(model.parameters())
    for picked in ([13], [1, 2], [0, 5, 14]):
        got = torch.autograd.grad(_loss(model, x), [params[k] for k in picked])
        assert max(max_rel_err(g, ref[k]) for g, k in zip(got, picked)) <= _tol(device)
    assert all(p.grad is None for p in params)
    if offload:  # an unfinished walk leaves no layer on the device
        assert not model.streamer.resident()


class _CountOps(TorchDispatchMode):
    """Counts calls of ``ops`` on tensors with at least one dimension (the first step's rebuild check casts its two
    scalar errors to float32: not a copy of data)."""

    def __init__(self, *ops):
        super().__init__()
        self.ops, self.count = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.ops and any(isinstance(a, torch.Tensor) and a.dim() > 0 for a in args):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _ops_in(request_, mode, *ops):
    torch.manual_seed(0)
    model = revlib.ReversibleSequential(*_blocks(), memory_mode=mode).double()
    x = _input(torch.device("cpu"))
    loss = _loss(model, x)
    with _CountOps(*ops) as counter:
        REQUESTS[request_](loss, x, list(model.parameters()))
    return counter.count


def _matmuls_in(request_, mode):
    return _ops_in(request_, mode, torch.ops.aten.mm, torch.ops.aten.addmm)


@pytest.mark.parametrize("request_", ["grad_x", "backward_inputs_x", "backward"])
def test_backward_computes_only_what_is_used_plus_the_recomputation(request_):
    """A backward costs the reversible mode what it costs plain autograd plus the recomputation of the block (both
    matmuls of each layer, needed to rebuild its input): an input gradient computes no weight gradient, and the
    input's two halves (split along dim 1, so not contiguous) are never copied."""
    plain = _matmuls_in(request_, MemoryModes.no_savings)
    assert plain == (2 if request_ != "backward" else 4) * DEPTH  # the input gradient, then the weight gradient
    assert _matmuls_in(request_, MemoryModes.autograd_function) == plain + 2 * DEPTH
    copies = (torch.ops.aten.copy_, torch.ops.aten.clone, torch.ops.aten._to_copy)
    assert _ops_in(request_, MemoryModes.autograd_function, *copies) == 0


def test_only_the_used_argument_gradient_is_computed():
    """A tensor argument is a gradient destination like a parameter: ``autograd.grad`` of it alone returns the
    ``no_savings`` gradient; ``autograd.grad`` of the input alone does not compute it."""

    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(WIDTH, WIDTH)

        def forward(self, x, shift):
            return torch.tanh(self.lin(x) + shift)

    def build(mode):
        torch.manual_seed(0)
        return revlib.ReversibleSequential(*[Shifted() for _ in range(DEPTH)], memory_mode=mode).double()

    x = _input(torch.device("cpu"))
    shift = torch.randn(WIDTH, dtype=torch.float64, requires_grad=True)
    plain, model = build(MemoryModes.no_savings), build(MemoryModes.autograd_function)
    (ref,) = torch.autograd.grad(plain(x, shift).square().sum(), shift)
    (got,) = torch.autograd.grad(model(x, shift).square().sum(), shift)
    assert max_rel_err(got, ref) <= 1e-10
    reductions = []  # the broadcast shift's gradient is a sum over the batch, which an input gradient never needs
    for m in (plain, model):
        loss = m(x, shift).square().sum()
        with _CountOps(torch.ops.aten.sum) as counter:
            torch.autograd.grad(loss, x)
        reductions.append(counter.count)
    assert reductions[1] == reductions[0], reductions


# ---------------------------------------------------------------------------------------------------------------
# 2. Each layer's gradients go through AccumulateGrad as the backward reaches it


@pytest.mark.parametrize("offload", [False, True], ids=["on_device", "target_device"])
def test_parameter_hooks_fire_once_per_backward_with_the_no_savings_gradient(device, offload):
    x = _input(device)
    _, ref = _reference(device, x)
    model = revlib.ReversibleSequential(*_blocks(), **_offload_kwargs(device, offload))
    model.to(dtype=_dtype(device)) if offload else model.to(device, _dtype(device))
    params = list(model.parameters())
    events, tensor_hook_grads = [], {}
    nodes = [torch.autograd.graph.get_gradient_edge(p).node for p in params]  # kept alive, as DDP does
    for k, (p, node) in enumerate(zip(params, nodes)):
        p.register_hook(
            lambda g, k=k: (events.append(("tensor", k)), tensor_hook_grads.setdefault(k, []).append(g)) and None
        )
        p.register_post_accumulate_grad_hook(lambda p, k=k: events.append(("accumulated", k)))
        node.register_hook(lambda grad_inputs, grad_outputs, k=k: events.append(("node", k)))
    for i, layer in enumerate(model):  # marks each layer's recomputation (its block runs in the backward)
        layer.block.register_forward_pre_hook(lambda *_, i=i: events.append(("block", i)))
    kinds = ("tensor", "accumulated", "node")
    for _ in range(2):  # the second backward accumulates onto the first's gradients
        loss = _loss(model, x)
        events.clear()
        loss.backward()
        backends.sync(device)
        per_layer = [sorted((kind, k) for k in range(4 * i, 4 * i + 4) for kind in kinds) for i in range(DEPTH)]
        assert sorted(e for e in events if e[0] != "block") == sorted(e for evs in per_layer for e in evs)
        assert [e for e in events if e[0] == "block"] == [("block", i) for i in reversed(range(DEPTH))]
        if offload and device.type != "cpu":
            # host parameters, device compute: the engine accumulates host gradients on the calling thread while
            # its device thread goes on with the next layer, so only "after its own layer" is certain
            assert all(events.index(e) > events.index(("block", i)) for i in range(DEPTH) for e in per_layer[i])
            continue
        groups = []  # what happened from each recomputation to the next
        for event in events:
            if event[0] == "block":
                groups.append([event])
            else:
                groups[-1].append(event)
        # layer i is recomputed, then each hook fires once for each of its 4 parameters, before layer i - 1
        assert [[g[0]] + sorted(g[1:]) for g in groups] == [
            [("block", i)] + per_layer[i] for i in reversed(range(DEPTH))
        ], events
    for k, p in enumerate(params):
        assert len(tensor_hook_grads[k]) == 2
        assert all(max_rel_err(g, ref[k]) <= _tol(device) for g in tensor_hook_grads[k])
        assert max_rel_err(p.grad, 2 * ref[k]) <= _tol(device)


def _created_in_second_backward(mode, **kwargs):
    """Bytes created (and alive at the peak) inside the second of two backward passes, with the first's gradients
    still in ``.grad``: 16 layers of Linear(512, 512)-GELU-Linear(512, 512), batch 8 (the issue's measurement)."""
    torch.manual_seed(0)
    model = revlib.ReversibleSequential(
        *[nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 512)) for _ in range(16)],
        memory_mode=mode,
        **kwargs,
    )
    x = torch.randn(8, 1024)
    model(x).square().mean().backward()
    loss = model(x).square().mean()
    peak = memory.eager_peak(lambda m, loss_: loss_.backward(), model, loss, zero_grad=False)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert peak.end.gradients == param_bytes  # accumulated into the existing .grad tensors
    return peak.total - 2 * param_bytes - loss.element_size(), param_bytes


@pytest.mark.parametrize("offload", [False, True], ids=["on_device", "target_device"])
def test_gradient_accumulation_holds_one_layers_gradients(offload):
    created, param_bytes = _created_in_second_backward(MemoryModes.autograd_function, **_offload_kwargs("cpu", offload))
    plain, _ = _created_in_second_backward(MemoryModes.no_savings)
    layer = param_bytes // 16
    print(
        f"\ncreated in the second backward: {created / param_bytes:.3f} x the parameters "
        f"(no_savings {plain / param_bytes:.3f}); one layer is {1 / 16:.4f}"
    )
    # One layer's gradients (accumulated before the next layer is recomputed) and its recomputation's activations
    # (2 x 8 x 512 floats each, small here); with target_device also the layer's streamed parameter copies (this
    # layer's and the next one's). Before, all 16 layers' gradients were alive at once (1.00 x the parameters).
    copies = 2 * layer if offload else 0
    assert created <= layer + copies + plain, (created, layer, plain)
    assert created >= layer  # the measurement sees the layer's gradients


# ---------------------------------------------------------------------------------------------------------------
# 3. Gradients of gradients


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("how", ["grad_x", "grad_params", "backward"])
def test_double_backward_raises_a_clear_error(device, how):
    x = _input(device)
    model = revlib.ReversibleSequential(*_blocks()).to(device, _dtype(device))
    loss = _loss(model, x)
    with pytest.raises(revlib.ReversibleError, match=r"create_graph=True.*memory_mode=MemoryModes.no_savings"):
        if how == "backward":
            loss.backward(create_graph=True)
        else:
            torch.autograd.grad(loss, x if how == "grad_x" else list(model.parameters()), create_graph=True)
    # what the message recommends gives a gradient penalty's second-order gradients
    ref = revlib.ReversibleSequential(*_blocks(), memory_mode=MemoryModes.no_savings).to(device, _dtype(device))
    (gx,) = torch.autograd.grad(_loss(ref, x), x, create_graph=True)
    gx.square().sum().backward()
    assert all(p.grad is not None for name, p in ref.named_parameters() if name.endswith("weight"))


def test_a_hook_that_changes_the_gradient_applies_once(device):
    """A tensor hook that rescales a parameter's gradient (as loss scaling or per-parameter clipping code does) is
    applied once: the recomputation's own vector-Jacobian product does not run the parameters' hooks."""
    x = _input(device)
    _, ref = _reference(device, x)
    model = revlib.ReversibleSequential(*_blocks()).to(device, _dtype(device))
    params = list(model.parameters())
    for p in params:
        p.register_hook(lambda g: 3 * g)
    _loss(model, x).backward()
    assert max(max_rel_err(p.grad, 3 * r) for p, r in zip(params, ref)) <= _tol(device)
