"""The @triton.jit kernels behind :mod:`.fewbit_triton` (imported on first use: importing triton here, at module
level, is what lets ``TRITON_INTERPRET=1`` interpret them). Each program handles ``BLOCK_GROUPS`` packing groups,
one group per lane, looping over the planes of the layout (:mod:`.fewbit_reference`); consecutive lanes read
consecutive elements. No ``tl.sum``/``tl.zeros``-style library @jit functions: the interpreter only interprets
those when triton itself was imported with ``TRITON_INTERPRET=1``."""

import triton
import triton.language as tl


@triton.jit
def encode_kernel(
    x_ptr,
    borders_ptr,
    out_ptr,
    n,
    groups,
    NUM_BORDERS: tl.constexpr,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BYTES: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    NAN_HIGH: tl.constexpr,
):
    group = tl.program_id(0) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    in_range = group < groups
    value = group * 0
    for j in tl.static_range(GROUP_SIZE):
        index = j * groups + group
        inside = in_range & (index < n)
        x = tl.load(x_ptr + index, mask=inside, other=0.0).to(tl.float32)
        code = group * 0
        for k in tl.static_range(NUM_BORDERS):
            if NAN_HIGH:
                code += 1 - (x <= tl.load(borders_ptr + k)).to(tl.int32)  # NaN is above every border
            else:
                code += (x > tl.load(borders_ptr + k)).to(tl.int32)
        code = tl.where(inside, code, 0)
        value = value | (code << (j * BITS))
    for i in tl.static_range(BYTES):
        tl.store(out_ptr + i * groups + group, ((value >> (8 * i)) & 255).to(tl.uint8), mask=in_range)


@triton.jit
def grad_kernel(
    packed_ptr,
    grad_ptr,
    levels_ptr,
    out_ptr,
    n,
    groups,
    BITS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BYTES: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    BF16_BITS: tl.constexpr,
    SELECT_ZERO: tl.constexpr,
):
    group = tl.program_id(0) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    in_range = group < groups
    value = group * 0
    for i in tl.static_range(BYTES):
        byte = tl.load(packed_ptr + i * groups + group, mask=in_range, other=0).to(tl.int32)
        value = value | (byte << (8 * i))
    for j in tl.static_range(GROUP_SIZE):
        index = j * groups + group
        inside = in_range & (index < n)
        code = (value >> (j * BITS)) & ((1 << BITS) - 1)
        level = tl.load(levels_ptr + code, mask=inside, other=0.0)
        grad = tl.load(grad_ptr + index, mask=inside, other=0.0).to(tl.float32)
        product = grad * level
        if SELECT_ZERO:
            product = tl.where(level == 0.0, 0.0, product)
        if BF16_BITS:
            # Round to nearest even by hand and store the bfloat16 bits (out_ptr is an int16 view): the same on
            # the GPU and in the interpreter, whose float32 -> bfloat16 conversion truncates. NaN stays a quiet
            # NaN (the carry of the rounding could turn a NaN with a large payload into an infinity or a zero).
            raw = product.to(tl.int32, bitcast=True)
            rounded = (raw + 0x7FFF + ((raw >> 16) & 1)) >> 16
            rounded = tl.where(product != product, 0x7FC0, rounded)
            tl.store(out_ptr + index, rounded.to(tl.int16), mask=inside)
        else:
            tl.store(out_ptr + index, product.to(out_ptr.dtype.element_ty), mask=inside)
