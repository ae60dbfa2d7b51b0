"""Reversible sequences: activation memory that does not grow with depth.

A reversible layer maps two streams ``(x0, x1)`` to ``(x1, coupling_forward(x0, f(x1)))`` ("half residual and
swap"); a RevNet block with functions F and G is two such layers. Because ``x0 = coupling_inverse(y1, f(y0))``,
the backward pass rebuilds every layer's input from its output, so nothing but the final output has to be kept.
With additive couplings the streams are exact by default (:mod:`revlib_xla.fixed_point`): integers on a fixed grid,
so the rebuild is bit for bit; the autograd nodes carry the streams' decoded values (for their gradients) and the
plan the integers (``_Plan.fixed_streams``).

Design (what differs from RevLib and why):

* No activation is saved: each layer is one autograd node that keeps only its parameters and tensor arguments,
  and the last one keeps the final two streams. Under XLA, lifetimes are decided by graph dataflow, and saving each
  layer's output would keep it alive until its backward (O(depth)). The backward of the last layer rebuilds its
  input from the saved output and hands it to the previous layer's backward, and so on down the sequence.
* A node per layer lets autograd accumulate each layer's parameter gradients through the parameters' own
  ``AccumulateGrad`` as soon as that layer is done (hooks, DDP and micro-batched accumulation see ordinary
  parameters, and only one layer's gradients are in flight); the engine says which gradients a backward uses
  (:mod:`revlib_xla._grad_destination`), so an input-gradient-only request computes no weight gradient and a fused
  optimizer steps only in a training backward.
* Before each layer's recomputation the backward places an optimization barrier over what it reads, so XLA cannot
  merge the recomputation with the forward (which would keep the forward's activations alive).
* Parameters and tensor arguments are explicit inputs of each layer's node, so they get gradients whether or not the
  input requires grad, and gradients of the other stream come from the coupling's own vector-Jacobian product.
  Gradients of gradients (``create_graph=True``) raise: the rebuilt inputs carry no autograd history.
* Each layer runs under a seed derived from one seed drawn per forward, with generators of its own (cpu, cuda; xla
  seeds the device), and the recomputation reuses it; the autocast state is captured at forward time and replayed;
  buffers a layer changes in its forward are given their earlier values for the recomputation (see
  :mod:`revlib_xla.recompute`). Only integers are kept per layer, plus those buffers, so nothing else grows with
  depth.

The package, one concept per module, imports going down this list only:

* :mod:`~revlib_xla.reversible.coupling`: couplings (how a block's output is merged into the other stream, and
  undone); :mod:`~revlib_xla.reversible.fixed_point`: exact streams; :mod:`~revlib_xla.reversible.rebuild_check`:
  the backward's measure of its rebuilt input;
* :mod:`~revlib_xla.reversible.layers`: one reversible layer, the memory modes, the checks of what a sequence is
  built from; :mod:`~revlib_xla.reversible.plan`: one call's plan and one layer's forward on it;
* :mod:`~revlib_xla.reversible.engine`: the per-layer autograd engine (the reversible backward);
  :mod:`~revlib_xla.reversible.invertibility`: the invertibility check; :mod:`~revlib_xla.reversible.repeat`:
  which layers repeat; :mod:`~revlib_xla.reversible.stacks`: stacked parameter storage;
  :mod:`~revlib_xla.reversible.layout`: what each iteration of a scan gets;
* :mod:`~revlib_xla.reversible.planning`: a call's preparation (the base of ``ReversibleSequential``);
  :mod:`~revlib_xla.reversible.scan`: repeating layers compiled as two loops;
* :mod:`~revlib_xla.reversible.sequential`: :class:`ReversibleSequential`, ``check_invertible``;
  :mod:`~revlib_xla.reversible.stacking`: ``stack_layers``.
"""

from .._replaced_params import ReplacedParameterError
from ..errors import ReversibleError
from ..offload import offload_tensor
from .invertibility import InvertibilityReport
from .layers import (
    DUAL_OR_QUAD_TENSOR,
    FUSED_OPTIMIZER,
    LAYERWISE_ARGS_KWARGS,
    MemoryModes,
    ReversibleModule,
    ReversibleModuleCache,
    ReversibleWrapper,
)
from .repeat import ScanUnsupported, repeat_period
from .sequential import LayerWalk, ReversibleSequential, check_invertible, stream_range_error
from .stacking import stack_layers
from .stacks import layer_parameters, layer_shape

__all__ = [
    "MemoryModes",
    "ReversibleModule",
    "ReversibleSequential",
    "ReversibleModuleCache",
    "ReversibleError",
    "check_invertible",
    "InvertibilityReport",
    "offload_tensor",
    "DUAL_OR_QUAD_TENSOR",
    "FUSED_OPTIMIZER",
    "LAYERWISE_ARGS_KWARGS",
    "ReversibleWrapper",
    "LayerWalk",
    "stream_range_error",
    # stacked parameter storage and the scan (formerly revlib_xla.scan)
    "stack_layers",
    "layer_parameters",
    "layer_shape",
    "repeat_period",
    "ReplacedParameterError",
    "ScanUnsupported",
]
