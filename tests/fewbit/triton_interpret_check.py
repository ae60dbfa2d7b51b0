"""Run by tests/fewbit/test_kernels.py in a child process with TRITON_INTERPRET=1 (triton must be imported after it is
set: its library functions, tl.zeros among them, are defined as interpreted or compiled at import time).

Compares the Triton few-bit kernels with the pure-PyTorch reference, bit for bit (a NaN has to be a NaN), on every
bit width, float32 / bfloat16 / float16, sizes that need padding, inf/NaN inputs and gradients, NaN coded high or
low, NaN levels and zero levels that select. Prints one line per case; exits 1 on a mismatch.
"""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch
import triton
import triton.language as tl

from revlib_xla import fewbit
from revlib_xla.kernels import fewbit_reference as ref
from revlib_xla.kernels import fewbit_triton


def same_bits_or_both_nan(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bit for bit, except that a NaN only has to be a NaN (its sign and payload are not specified)."""
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[expected.dtype]
    nan = expected.isnan()
    return (
        got.dtype == expected.dtype
        and torch.equal(got.isnan(), nan)
        and torch.equal(got.view(as_int)[~nan], expected.view(as_int)[~nan])
    )


UNTRUSTWORTHY = 3  # the exit status when the interpreter itself computes a trivial kernel wrong


@triton.jit
def _double(x_ptr, y_ptr, n, block: tl.constexpr):
    offsets = tl.program_id(0) * block + tl.arange(0, block)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 2, mask=offsets < n)


def interpreter_works() -> bool:
    """Whether this triton's interpreter doubles 13 numbers right. Triton 3.1's interpreter (torch 2.5's pin) reads
    zeros under numpy 2; the kernels cannot be judged there."""
    x = torch.arange(13, dtype=torch.float32)
    y = torch.full_like(x, -1.0)
    _double[(1,)](x, y, 13, block=16)
    return torch.equal(y, 2 * x)


def main() -> int:
    if not interpreter_works():
        import numpy

        print(f"triton {triton.__version__}'s interpreter computes a trivial kernel wrong (numpy {numpy.__version__})")
        return UNTRUSTWORTHY
    failures = 0
    for bits in (1, 2, 3, 4):
        table = fewbit.stepwise_table("gelu", bits)
        # NaN end levels (a call whose input held a NaN) and a zero level (select_zero: 0 even for an inf gradient)
        odd_levels = (float("nan"), 0.0) + tuple(table.levels[2:])
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for n in (1, 13, 4099):
                g = torch.Generator().manual_seed(n + bits)
                x, grad = torch.randn(n, generator=g) * 2, torch.randn(n, generator=g)
                if n > 8:
                    x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
                    grad[4:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38])
                x, grad = x.to(dtype), grad.to(dtype)
                ok = True
                for nan_high, levels, select_zero in ((False, table.levels, False), (True, odd_levels, True)):
                    expected_packed = ref.pack(ref.stepwise_codes(x, table.borders, nan_high), bits)
                    packed = fewbit_triton.encode_stepwise(x, table.borders, bits, nan_high)
                    levels_t = torch.tensor(levels, dtype=torch.float32)
                    if nan_high:  # a NaN whose payload would carry into the exponent when rounded to bfloat16
                        levels_t.view(torch.int32)[0] = 0x7FFFFFFF
                    expected = ref.lookup(ref.unpack(expected_packed, bits, n), grad, levels_t, select_zero=select_zero)
                    got = fewbit_triton.stepwise_grad(expected_packed, grad, levels_t, bits, select_zero)
                    ok &= torch.equal(packed, expected_packed) and same_bits_or_both_nan(got, expected)
                print(f"bits={bits} {dtype} n={n}: {'bit-exact' if ok else 'MISMATCH'}")
                failures += not ok
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
