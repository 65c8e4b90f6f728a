"""The Triton kernel of `fused_4bit_decode`: x @ W.T for a few rows of x and an nf4 weight W, the
weight dequantized in registers. Imported only where it runs (Triton installed)."""

import triton
import triton.language as tl


@triton.jit
def nf4_linear_kernel(x_ptr, packed_ptr, absmax_ptr, code_ptr, pairs_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                      partial_ptr, M, N, K, slice_width,
                      NESTED: tl.constexpr, QBLOCK: tl.constexpr, BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PAIRED: tl.constexpr):
    """One program: output columns [pid_n * BLOCK_N, +BLOCK_N) over the inner slice
    [pid_k * slice_width, +slice_width), BLOCKS quantization blocks (QBLOCK values each) per
    iteration; writes its float32 partial sums to partial[pid_k, :M, columns]. PAIRED: each byte's
    two table values are looked up at once in `pairs_ptr` (256 64-bit words: the high nibble's
    float32 bits low, the low nibble's high), one load where `code_ptr` takes two."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    columns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of W
    rows = tl.arange(0, BLOCK_M)  # rows of x
    blocks = tl.arange(0, BLOCKS)  # an iteration's blocks
    pairs = tl.arange(0, QBLOCK // 2)  # the bytes of one block: values 2j (high nibble) and 2j + 1
    # A pair's place in the iteration, blocks one after another (as in memory): its values are the
    # inputs' 2p and 2p + 1.
    places = tl.arange(0, BLOCKS * (QBLOCK // 2))
    column_ok = columns < N
    row_ok = rows < M
    # Where each column's codes, scales and each row's inputs start; an iteration's offsets are added
    # per iteration (32-bit: `layer_unsupported` leaves weights of 2^31 values or more to bitsandbytes).
    column_codes = (packed_ptr + columns[:, None, None] * (K // 2) + blocks[None, :, None] * (QBLOCK // 2)
                    + pairs[None, None, :])  # [BLOCK_N, BLOCKS, QBLOCK/2]
    column_blocks = columns[:, None] * (K // QBLOCK) + blocks[None, :]  # [BLOCK_N, BLOCKS]
    row_inputs = x_ptr + rows[:, None] * K + 2 * places[None, :]  # [BLOCK_M, BLOCKS * QBLOCK/2]: values 2p
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * slice_width
    k_end = tl.minimum(k_start + slice_width, K)
    for k0 in range(k_start, k_end, BLOCKS * QBLOCK):
        # The last iteration of a slice may reach past its end: those blocks' inputs read as zeros.
        block_ok = column_ok[:, None] & (k0 + blocks[None, :] * QBLOCK < k_end)  # [BLOCK_N, BLOCKS]
        block = column_blocks + k0 // QBLOCK
        if NESTED:  # double quantization: a uint8 code of the 256-block's 8-bit table, plus offset
            scale_code = tl.load(absmax_ptr + block, mask=block_ok, other=0).to(tl.int32)
            scale = tl.load(code2_ptr + scale_code) * tl.load(absmax2_ptr + block // 256, mask=block_ok, other=0.0)
            scale = scale + tl.load(offset_ptr)
        else:
            scale = tl.load(absmax_ptr + block, mask=block_ok, other=0.0)
        scale = scale[:, :, None]
        packed = tl.load(column_codes + k0 // 2, mask=block_ok[:, :, None], other=0).to(tl.int32)
        if PAIRED:
            both = tl.load(pairs_ptr + packed)
            high_code = (both & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
            low_code = (both >> 32).to(tl.uint32).to(tl.float32, bitcast=True)
        else:
            high_code = tl.load(code_ptr + (packed >> 4))
            low_code = tl.load(code_ptr + (packed & 15))
        # As bitsandbytes dequantizes: table value x block scale in float32, then the compute dtype.
        high = (high_code * scale).to(x_ptr.dtype.element_ty)
        low = (low_code * scale).to(x_ptr.dtype.element_ty)
        high = tl.reshape(high, (BLOCK_N, BLOCKS * (QBLOCK // 2)))
        low = tl.reshape(low, (BLOCK_N, BLOCKS * (QBLOCK // 2)))
        input_ok = row_ok[:, None] & (k0 + 2 * places[None, :] < k_end)
        x_even = tl.load(row_inputs + k0, mask=input_ok, other=0.0)
        x_odd = tl.load(row_inputs + k0 + 1, mask=input_ok, other=0.0)
        if IEEE:  # float32 inputs: no TF32 rounding, as torch's float32 matmul
            acc += tl.dot(x_even, tl.trans(high), input_precision="ieee")
            acc += tl.dot(x_odd, tl.trans(low), input_precision="ieee")
        else:
            acc += tl.dot(x_even, tl.trans(high))
            acc += tl.dot(x_odd, tl.trans(low))
    out = partial_ptr + pid_k * M * N + rows[:, None] * N + columns[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & column_ok[None, :])
