"""TPU HBM of a stacked, scanned reversible step (revlib_xla.scan), compiled for TPU v5e without a TPU: per layer it
grows by the parameters and their gradients only, as the unrolled walk's does.

The TPU compiler runs float32 matrix multiplies on bfloat16 operands; a loop that only slices its weights out of
the stacks let it hoist the conversion out of both loops, a bfloat16 copy of every layer's weights kept through the
step (half the parameter bytes per layer). Every buffer in HBM (``hbm_only``), so that the peak is the whole step's
live set."""

import importlib.util

import pytest
import torch
from torch import nn

import revlib_xla as revlib
from revlib_xla import backend, memory

WIDTH = 128  # a multiple of the TPU's 128 lanes: float32 weights and biases take their logical bytes, unpadded
DEPTHS = (8, 16)  # multiples of the 8 sublanes: a stacked bias [depth, WIDTH] is not padded either


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


LAYER_BYTES = sum(p.numel() for p in _block().parameters()) * 4  # float32


def _step(model, x):
    model(x).square().mean().backward()


@pytest.fixture(scope="module")
def compiled():
    if not backend.xla_available():
        pytest.skip("torch_xla is not installed (pip install 'revlib_xla[xla]')")
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'revlib_xla[tpu-compile]')")
    texts = []
    for depth in DEPTHS:
        torch.manual_seed(0)
        model = revlib.scan.stack_layers(
            revlib.ReversibleSequential(*[_block() for _ in range(depth)], scan=True, verify_inverse=False)
        )
        texts.append(memory.step_stablehlo(_step, model, torch.randn(64, 2 * WIDTH)))
    return dict(zip(DEPTHS, memory.tpu_memory_many(texts, "v5e", cache=False, hbm_only=True)))


def test_stacked_float32_hbm_grows_by_parameters_and_gradients_only(compiled):
    low, high = (compiled[d] for d in DEPTHS)
    layers = DEPTHS[1] - DEPTHS[0]
    # Arguments (parameters) and outputs (gradients) grow by exactly their logical bytes: nothing is padded.
    assert high.argument_bytes - low.argument_bytes == layers * LAYER_BYTES
    assert high.output_bytes - low.output_bytes == layers * LAYER_BYTES
    # The temporaries do not grow with depth: one layer's recomputation at a time. A bfloat16 copy of the weights
    # hoisted out of the loops would add half a layer's parameter bytes per layer.
    assert high.live_temporary_bytes - low.live_temporary_bytes <= layers * LAYER_BYTES // 16, (
        low.live_temporary_bytes,
        high.live_temporary_bytes,
    )
    assert high.hbm_peak_bytes - low.hbm_peak_bytes <= layers * (2 * LAYER_BYTES + LAYER_BYTES // 16)
