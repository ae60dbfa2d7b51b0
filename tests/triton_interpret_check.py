"""Run by tests/test_kernels.py in a child process with TRITON_INTERPRET=1 (triton must be imported after it is
set: its library functions, tl.zeros among them, are defined as interpreted or compiled at import time).

Compares the Triton few-bit kernels with the pure-PyTorch reference, bit for bit, on every bit width, float32 /
bfloat16 / float16, sizes that need padding, and inf/NaN inputs. Prints one line per case; exits 1 on a mismatch.
"""
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from revlib_xla import fewbit, kernels  # noqa: E402
from revlib_xla.kernels import fewbit_reference as ref  # noqa: E402
from revlib_xla.kernels import fewbit_triton  # noqa: E402


def main() -> int:
    failures = 0
    for bits in (1, 2, 3, 4):
        table = fewbit.stepwise_table("gelu", bits)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for n in (1, 13, 4099):
                g = torch.Generator().manual_seed(n + bits)
                x, grad = torch.randn(n, generator=g) * 2, torch.randn(n, generator=g)
                if n > 8:
                    x[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
                x, grad = x.to(dtype), grad.to(dtype)
                expected_packed = ref.pack(ref.stepwise_codes(x, table.borders), bits)
                packed = fewbit_triton.encode_stepwise(x, table.borders, bits)
                levels = kernels.levels_tensor(table.levels, x.device, dtype)
                expected = ref.lookup(ref.unpack(expected_packed, bits, n), grad, levels)
                got = fewbit_triton.stepwise_grad(expected_packed, grad, levels, bits)
                as_int = torch.int32 if dtype == torch.float32 else torch.int16
                ok = (torch.equal(packed, expected_packed) and got.dtype == dtype
                      and torch.equal(got.view(as_int), expected.view(as_int)))
                print(f"bits={bits} {dtype} n={n}: {'bit-exact' if ok else 'MISMATCH'}")
                failures += not ok
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
