"""FewBit's few-bit activations and randomized linear layer, working on cpu, cuda and xla.

``from revlib_xla import fewbit`` replaces ``import fewbit``::

    model = nn.Sequential(nn.Linear(512, 2048), fewbit.GELU(bits=3), nn.Linear(2048, 512))
    converter = lambda m: fewbit.convert_linear(m, fewbit.RandomizedLinear, proj_dim_ratio=0.2)
    model = fewbit.map_module(model, converter)

* Activations (:mod:`.modules`, :mod:`.functional`): exact forward; the backward keeps ``bits`` bits per element
  and multiplies by the optimal piecewise-constant derivative (:mod:`.approximation`).
* :class:`RandomizedLinear`: exact forward and input gradient; unbiased weight gradient from a random sketch.
* :func:`map_module`, :func:`convert_linear`, :func:`convert_activation`: convert pretrained models.
"""

from . import functional
from .activations import PIECEWISE, SMOOTH, stepwise_table
from .approximation import SUPPORTED_BITS, StepwiseDerivative, optimal_stepwise
from .conversion import convert_linear, map_module
from .modules import (
    CELU,
    ELU,
    GELU,
    MODULES,
    SELU,
    FewBitActivation,
    Hardshrink,
    Hardsigmoid,
    Hardswish,
    Hardtanh,
    LeakyReLU,
    LogSigmoid,
    Mish,
    ReLU,
    ReLU6,
    Sigmoid,
    SiLU,
    Softplus,
    Softshrink,
    Softsign,
    Tanh,
    Tanhshrink,
    Threshold,
    activation,
    convert_activation,
)
from .randomized_linear import LinearGRP, RandomizedLinear, randomized_linear

__all__ = [
    "CELU",
    "ELU",
    "GELU",
    "Hardswish",
    "LogSigmoid",
    "Mish",
    "SELU",
    "Sigmoid",
    "SiLU",
    "Softplus",
    "Softsign",
    "Tanh",
    "Tanhshrink",
    "LeakyReLU",
    "ReLU",
    "Threshold",
    "Hardsigmoid",
    "Hardtanh",
    "ReLU6",
    "Hardshrink",
    "Softshrink",
    "FewBitActivation",
    "activation",
    "convert_activation",
    "MODULES",
    "SMOOTH",
    "PIECEWISE",
    "functional",
    "RandomizedLinear",
    "LinearGRP",
    "randomized_linear",
    "convert_linear",
    "map_module",
    "stepwise_table",
    "optimal_stepwise",
    "StepwiseDerivative",
    "SUPPORTED_BITS",
]
