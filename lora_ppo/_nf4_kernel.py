"""The Triton kernel of `fused_4bit_decode`: x @ W.T for a few rows of x and an nf4 weight W, the
weight dequantized in registers. Imported only where it runs (Triton installed)."""

import triton
import triton.language as tl


@triton.jit
def nf4_linear_kernel(x_ptr, packed_ptr, absmax_ptr, code_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                      partial_ptr, M, N, K, slice_width,
                      NESTED: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """One program: output columns [pid_n * BLOCK_N, +BLOCK_N) over the inner slice
    [pid_k * slice_width, +slice_width), one quantization block (QBLOCK values) per iteration;
    writes its float32 partial sums to partial[pid_k, :M, columns]."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    columns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of W
    rows = tl.arange(0, BLOCK_M)  # rows of x
    pairs = tl.arange(0, QBLOCK // 2)  # the bytes of one block: values 2j (high nibble) and 2j + 1
    column_ok = columns < N
    row_ok = rows < M
    # Where each column's codes, scales and each row's inputs start; a block's offsets are added
    # per iteration (32-bit: `layer_unsupported` leaves weights of 2^31 values or more to bitsandbytes).
    column_codes = packed_ptr + columns[:, None] * (K // 2) + pairs[None, :]  # [BLOCK_N, QBLOCK/2]
    column_blocks = columns * (K // QBLOCK)  # [BLOCK_N]
    row_inputs = x_ptr + rows[:, None] * K + 2 * pairs[None, :]  # [BLOCK_M, QBLOCK/2]: values 2j
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * slice_width
    k_end = tl.minimum(k_start + slice_width, K)
    for k0 in range(k_start, k_end, QBLOCK):
        block = column_blocks + k0 // QBLOCK
        if NESTED:  # double quantization: a uint8 code of the 256-block's 8-bit table, plus offset
            scale_code = tl.load(absmax_ptr + block, mask=column_ok, other=0).to(tl.int32)
            scale = tl.load(code2_ptr + scale_code) * tl.load(absmax2_ptr + block // 256, mask=column_ok, other=0.0)
            scale = scale + tl.load(offset_ptr)
        else:
            scale = tl.load(absmax_ptr + block, mask=column_ok, other=0.0)
        packed = tl.load(column_codes + k0 // 2, mask=column_ok[:, None], other=0).to(tl.int32)
        # As bitsandbytes dequantizes: table value x block scale in float32, then the compute dtype.
        high = (tl.load(code_ptr + (packed >> 4)) * scale[:, None]).to(x_ptr.dtype.element_ty)
        low = (tl.load(code_ptr + (packed & 15)) * scale[:, None]).to(x_ptr.dtype.element_ty)
        x_even = tl.load(row_inputs + k0, mask=row_ok[:, None], other=0.0)
        x_odd = tl.load(row_inputs + k0 + 1, mask=row_ok[:, None], other=0.0)
        if IEEE:  # float32 inputs: no TF32 rounding, as torch's float32 matmul
            acc += tl.dot(x_even, tl.trans(high), input_precision="ieee")
            acc += tl.dot(x_odd, tl.trans(low), input_precision="ieee")
        else:
            acc += tl.dot(x_even, tl.trans(high))
            acc += tl.dot(x_odd, tl.trans(low))
    out = partial_ptr + pid_k * M * N + rows[:, None] * N + columns[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & column_ok[None, :])
