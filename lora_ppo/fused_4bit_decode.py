"""A 4-bit linear layer for a decode step's few rows in one Triton kernel (`model.fused_4bit_decode`):
the weight's 4-bit codes are read and dequantized in registers, never written out in full.

bitsandbytes computes a 4-bit layer for more than a handful of rows by dequantizing the whole
weight to the compute dtype (4 bits read, 16 written, 16 read again) and then multiplying, or, for
some shapes, with its own fused kernel, which parallelises over output columns only: on an H100
its own dispatch prefers dequantize-then-multiply for most of an 8B model's layers at 16 rows. A
decode step of 16 rows is bound by memory traffic, so the layer's cost is those bytes. Here each
program reads a tile of output columns over one slice of the inner dimension (split-K, so even a
layer with few columns fills the card), dequantizes each 64-value block as bitsandbytes does
(code table value x the block's scale, in float32, rounded to the compute dtype) and multiplies;
the slices' float32 partial sums are added once at the end.

Triton runs on CUDA GPUs. On a CPU it runs only under Triton's interpreter (`TRITON_INTERPRET=1`,
slow; the tests use it), so `fused_decode_unavailable` says why it cannot run elsewhere, and the
layers keep bitsandbytes' forward.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import types
import weakref
from typing import Optional

import torch
from torch import nn

from lora_ppo.bnb_workarounds import linear_4bit_layers

log = logging.getLogger(__name__)

# The most rows (batch x new tokens) the kernel takes: a decode step's batch bucket. More rows (a
# prompt's prefill, scoring) are compute-bound, where dequantize-then-multiply is right.
MAX_ROWS = 64
# Output columns per program, and how many programs the split-K launch aims for per multiprocessor,
# so a layer with few output columns (an 8B model's key and value projections: 1,024) fills the card.
BLOCK_N = 64
PROGRAMS_PER_SM = 4
# Quantization blocks each program reads per loop iteration, and Triton's warps per program and
# software-pipelining stages (None: Triton's default). bench/nf4_decode_matmul.py sweeps them all.
BLOCKS_PER_ITERATION = 1
NUM_WARPS = 4
NUM_STAGES = None
# Look each byte's two table values up at once (`paired_codes`): half the lookups, each 8 bytes.
PAIRED_CODES = False
# Launch settings for one weight shape, (out_features, in_features) -> {name in lower case: value},
# over the defaults above: a device's best from bench/nf4_decode_matmul.py (its `fused_best`).
TUNED_LAUNCH: dict[tuple[int, int], dict[str, Optional[int]]] = {}
# Weight shapes (out_features, in_features) where bitsandbytes' own no-grad path measured faster
# than the kernel at its best (bench/nf4_decode_matmul.py): their layers keep bitsandbytes' forward.
BITSANDBYTES_FASTER: set[tuple[int, int]] = set()
LAUNCH_SETTINGS = ("BLOCK_N", "PROGRAMS_PER_SM", "BLOCKS_PER_ITERATION", "NUM_WARPS", "NUM_STAGES", "PAIRED_CODES")
# Each slice of the inner dimension holds at least this many quantization blocks, so a program's
# fixed costs (its partial sums' write, the final sum) stay small against its reads.
MIN_BLOCKS_PER_SLICE = 4
# The 8-bit code of bitsandbytes' double quantization (the scales' scales) has this block size.
NESTED_BLOCKSIZE = 256


def fused_decode_unavailable(device: torch.device) -> Optional[str]:
    """Why the fused kernel cannot run on `device` (None when it can)."""
    if importlib.util.find_spec("triton") is None:  # installed with torch's CUDA builds
        return "Triton is not installed"
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"Triton kernels need a CUDA GPU (this run is on {device.type})"


def layer_unsupported(layer: nn.Module) -> Optional[str]:
    """Why a bitsandbytes Linear4bit cannot take the fused kernel (None when it can)."""
    state = layer.weight.quant_state
    if state.quant_type != "nf4":
        return f"its quant type is {state.quant_type} (the kernel reads nf4)"
    if state.shape[1] % state.blocksize:
        return f"its input width {state.shape[1]} is not a multiple of its block size {state.blocksize}"
    if state.shape.numel() >= 2**31:
        return f"its {state.shape.numel()} values need 64-bit offsets (the kernel's are 32-bit)"
    if state.nested and state.state2.blocksize != NESTED_BLOCKSIZE:
        return f"its scales are quantized in blocks of {state.state2.blocksize}, not {NESTED_BLOCKSIZE}"
    if tuple(state.shape) in BITSANDBYTES_FASTER:
        return f"bitsandbytes measured faster at its shape {tuple(state.shape)} (BITSANDBYTES_FASTER)"
    return None


def fuse_4bit_decode(model: nn.Module, device: torch.device) -> int:
    """`model.fused_4bit_decode`: compute the model's 4-bit layers that take it with the fused
    kernel wherever a no-grad call has at most MAX_ROWS rows (a decode step's); other calls, and
    layers computing from a dequantized copy (`dequantized_4bit_layers`), are computed as before.
    Where the kernel cannot run on `device`, nothing changes. One log line says which; returns
    the number of layers patched."""
    why_not = fused_decode_unavailable(device)
    if why_not is not None:
        log.info("model.fused_4bit_decode: off (%s); the 4-bit layers keep bitsandbytes' forward", why_not)
        return 0
    layers = linear_4bit_layers(model)
    reasons = [layer_unsupported(layer) for layer in layers]
    for layer, why in zip(layers, reasons):
        if why is None:
            # One function for every layer: a compiled decode step sees the same code each step.
            layer.forward = types.MethodType(_fused_forward, layer)  # shadows the class's forward
    skipped = [why for why in reasons if why is not None]
    patched = len(layers) - len(skipped)
    log.info("model.fused_4bit_decode: %d of %d 4-bit layers decode with the fused kernel%s", patched, len(layers),
             f" (the others: {skipped[0]})" if skipped else "")
    return patched


def _fused_forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS or torch.is_grad_enabled():
        return type(layer).forward(layer, x)
    dtype = layer.compute_dtype or x.dtype
    state = layer.weight.quant_state
    out = quantized_linear(x.reshape(rows, x.shape[-1]).to(dtype), layer.weight.data, state, layer.bias)
    return out.reshape(*x.shape[:-1], state.shape[0]).to(x.dtype)


def quantized_linear(x: torch.Tensor, packed: torch.Tensor, state, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`nf4_linear` for x [M, K] and a weight as bitsandbytes holds it: its packed codes and their
    `QuantState` (double-quantized or not)."""
    nested = state.nested
    return torch.ops.lora_ppo.nf4_linear(
        x, packed, state.absmax, state.code, state.state2.absmax if nested else None,
        state.state2.code if nested else None, state.offset if nested else None, bias, state.shape[0],
        state.blocksize,
    )


def launch_settings(out_features: int, in_features: int) -> dict[str, Optional[int]]:
    """The kernel's launch settings for a weight of this shape: TUNED_LAUNCH's over the defaults."""
    defaults = {name.lower(): globals()[name] for name in LAUNCH_SETTINGS}
    return {**defaults, **TUNED_LAUNCH.get((out_features, in_features), {})}


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # Triton's interpreter: one program at a time anyway


def split_k(out_features: int, in_features: int, blocksize: int, multiprocessors: int, per_iteration: int = 1,
            block_n: Optional[int] = None, programs_per_sm: Optional[int] = None) -> tuple[int, int]:
    """(slices of the inner dimension, inner width per slice, a multiple of `blocksize` x
    `per_iteration`, so only the last slice ends inside an iteration): enough programs of `block_n`
    columns to run `programs_per_sm` per multiprocessor (the module's defaults where None), each
    slice at least MIN_BLOCKS_PER_SLICE quantization blocks."""
    blocks = in_features // blocksize
    tiles = -(-out_features // (block_n or BLOCK_N))
    wanted = max(1, -(-(programs_per_sm or PROGRAMS_PER_SM) * multiprocessors // tiles))
    slices = max(1, min(wanted, blocks // MIN_BLOCKS_PER_SLICE))
    blocks_per_slice = -(-blocks // slices)
    blocks_per_slice = -(-blocks_per_slice // per_iteration) * per_iteration
    return -(-blocks // blocks_per_slice), blocks_per_slice * blocksize


# `paired_codes`' tables, by the code table's address and the device they are read on, each with a weak
# reference to the code it was built from: once that tensor is gone, another may take its address.
_PAIRED_TABLES: dict[tuple[int, torch.device], tuple[weakref.ref, torch.Tensor]] = {}


def paired_codes(code: torch.Tensor, device: torch.device) -> Optional[torch.Tensor]:
    """The table a PAIRED_CODES launch reads: 256 64-bit words, word b the float32 bits of
    code[b >> 4] (low half) and of code[b & 15] (high half), so one load gives a byte's two values.
    Built once per code table and device, never inside a CUDA graph's capture: there, until it is
    built, None (the launch then looks the values up one by one)."""
    key = (code.data_ptr(), device)
    built = _PAIRED_TABLES.get(key)
    if built is None or built[0]() is None:  # none yet, or built from a code since freed (its address reused)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        bits = code.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        byte = torch.arange(256, device=code.device)
        _PAIRED_TABLES[key] = weakref.ref(code), (bits[byte >> 4] | (bits[byte & 15] << 32)).to(device)
    return _PAIRED_TABLES[key][1]


@torch.library.custom_op("lora_ppo::nf4_linear", mutates_args=())
def nf4_linear(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
               absmax2: Optional[torch.Tensor], code2: Optional[torch.Tensor], offset: Optional[torch.Tensor],
               bias: Optional[torch.Tensor], out_features: int, blocksize: int) -> torch.Tensor:
    """`x [M, K] @ W.T` for an nf4 weight W [out_features, K] stored as bitsandbytes packs it:
    `packed` two codes per byte (the first in the high nibble), `absmax` one scale per `blocksize`
    values in row-major order (uint8 codes of `code2` x `absmax2` + `offset` where double
    quantized). Plus `bias`, added to the float32 sums as a matmul's epilogue does. Returns
    [M, out_features] in x's dtype. A custom op, so a compiled decode step
    (and its CUDA graph) calls it as one opaque kernel launch."""
    from lora_ppo._nf4_kernel import nf4_linear_kernel

    M, K = x.shape
    launch = launch_settings(out_features, K)
    slices, slice_width = split_k(out_features, K, blocksize, _multiprocessors(x.device),
                                  launch["blocks_per_iteration"], launch["block_n"], launch["programs_per_sm"])
    partial = torch.empty((slices, M, out_features), dtype=torch.float32, device=x.device)
    nested = absmax2 is not None
    grid = (-(-out_features // launch["block_n"]), slices)
    pairs = paired_codes(code, x.device) if launch["paired_codes"] else None
    code = code.to(x.device)
    nf4_linear_kernel[grid](
        x.contiguous(), packed, absmax, code, code if pairs is None else pairs,
        absmax2 if nested else absmax, code2.to(x.device) if nested else code,
        offset.to(x.device) if nested else absmax,
        partial, M, out_features, K, slice_width,
        NESTED=nested, QBLOCK=blocksize, BLOCKS=launch["blocks_per_iteration"],
        BLOCK_M=max(16, 1 << (M - 1).bit_length()), BLOCK_N=launch["block_n"], IEEE=x.dtype == torch.float32,
        PAIRED=pairs is not None, num_warps=launch["num_warps"],
        **({} if launch["num_stages"] is None else {"num_stages": launch["num_stages"]}),
    )
    total = partial[0] if slices == 1 else partial.sum(0)
    if bias is not None:
        total = total + bias.to(x.dtype).float()  # bitsandbytes rounds the bias to the compute dtype first
    return total.to(x.dtype)


@nf4_linear.register_fake
def _(x, packed, absmax, code, absmax2, code2, offset, bias, out_features, blocksize):
    return x.new_empty((x.shape[0], out_features))
