"""TPU HBM of a stacked, scanned reversible step (revlib_xla.scan), compiled for TPU v5e without a TPU: per layer it
grows by the parameters and their gradients only, as the unrolled walk's does. The same for a stacked scanned run of
``Checkpointable(scan=True)`` stages (``stack_layers`` on it), plus the layer inputs the run keeps.

The TPU compiler runs float32 matrix multiplies on bfloat16 operands; a loop that only slices its weights out of
the stacks let it hoist the conversion out of both loops, a bfloat16 copy of every layer's weights kept through the
step (half the parameter bytes per layer). Every buffer in HBM (``hbm_only``), so that the peak is the whole step's
live set."""

import importlib.util

import pytest
import torch
from torch import nn

import revlib_xla as revlib
from revlib_xla import backends, memory

WIDTH = 128  # a multiple of the TPU's 128 lanes: float32 weights and biases take their logical bytes, unpadded
DEPTHS = (8, 16)  # multiples of the 8 sublanes: a stacked bias [depth, WIDTH] is not padded either


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


LAYER_BYTES = sum(p.numel() for p in _block().parameters()) * 4  # float32


def _step(model, x):
    model(x).square().mean().backward()


@pytest.fixture(scope="module")
def compiled():
    if not backends.xla_available():
        pytest.skip("torch_xla is not installed (pip install 'revlib_xla[xla]')")
    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed (pip install 'revlib_xla[tpu-compile]')")
    texts, keys = [], []
    for depth in DEPTHS:
        torch.manual_seed(0)
        model = revlib.scan.stack_layers(
            revlib.ReversibleSequential(*[_block() for _ in range(depth)], scan=True, verify_inverse=False)
        )
        texts.append(memory.step_stablehlo(_step, model, torch.randn(64, 2 * WIDTH)))
        keys.append(("reversible", depth))
        texts.append(memory.step_stablehlo(_step, _checkpointed(depth), torch.randn(ROWS, WIDTH)))
        keys.append(("checkpointed", depth))
    return dict(zip(keys, memory.tpu_memory_many(texts, "v5e", cache=False, hbm_only=True)))


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = _block()

    def forward(self, x):
        return x + self.f(x)


ROWS = 8  # the checkpointed run's input: one [ROWS, WIDTH] float32 tile, kept per layer by the scanned run


def _checkpointed(depth: int) -> nn.Module:
    """A stacked ``Checkpointable(scan=True)`` of residual layers (one scanned stage), run with its forward
    checkpointed and recomputed in the backward (a fixed schedule: no measuring)."""
    from revlib_xla.planner import Chain, Op, Schedule, simulate

    checkpointed = revlib.scan.stack_layers(
        revlib.Checkpointable(nn.Sequential(*[_Residual() for _ in range(depth)]), scan=True)
    )
    chain = Chain([1.0], [1.0] * 2, [1.0] * 2, [1.0] * 2, [0.0], [0.0] * 2)
    ops = [Op("CF", 0), Op("L", 1), Op("Fe", 0), Op("B", 0)]
    checkpointed.chain, checkpointed.sequence = chain, Schedule(tuple(ops), *simulate(chain, ops), chain)
    return checkpointed


def test_stacked_float32_hbm_grows_by_parameters_and_gradients_only(compiled):
    low, high = (compiled["reversible", d] for d in DEPTHS)
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


def test_stacked_checkpointed_run_hbm_grows_by_parameters_gradients_and_kept_inputs(compiled):
    """Without stacked storage the run stacks a copy of its parameters per pass and unstacks its gradients: about
    four times the parameter bytes per layer (bench/results/scan_compile-xla-cpu.md, checkpointed-scan)."""
    low, high = (compiled["checkpointed", d] for d in DEPTHS)
    layers = DEPTHS[1] - DEPTHS[0]
    assert high.argument_bytes - low.argument_bytes == layers * LAYER_BYTES
    assert high.output_bytes - low.output_bytes == layers * LAYER_BYTES
    kept = ROWS * WIDTH * 4  # a layer's input, kept by the run for its backward
    assert high.live_temporary_bytes - low.live_temporary_bytes <= layers * kept, (
        low.live_temporary_bytes,
        high.live_temporary_bytes,
    )
    assert high.hbm_peak_bytes - low.hbm_peak_bytes <= layers * (2 * LAYER_BYTES + kept)
