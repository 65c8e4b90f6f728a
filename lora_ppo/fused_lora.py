"""How lora_ppo computes PEFT's LoRA linear layers: PEFT's float32 arithmetic without two of its
passes (always), or one addmm in the compute dtype (`model.fused_lora`).

PEFT computes a LoRA layer as `base(x).clone() + (lora_B(lora_A(x.float())) * scale).to(dtype)`:
on a bfloat16 model with float32 adapters that is a copy of the base output, a float32 copy of
the input (saved for the backward, once per projection that reads it: q, k and v each keep their
own), and a scale, a cast and an add over the full output width, forward and backward. On a GPU
that elementwise work was 43% of the update's kernel time, and each of those operators is one
more launch from Python in an update bound by the host (bench/README.md).

Every layer drops the copy (nothing modifies the base output in place) and, where the scale is a
power of two (alpha = 2r, the default), multiplies B's weight (rank x width) by it instead of the
product (tokens x width): a power of two scales every product and every sum exactly, so the layer's
output and every gradient are PEFT's bit for bit (`lean_lora_forward`; the two passes' share of an
update's kernels on a GPU: bench/README.md).

With `model.fused_lora` the adapter's two small weights are cast to the input's dtype (r x width:
nothing next to an activation) and the second matmul adds its product, scaled, to the base output in
its epilogue: `addmm(base(x), x @ A.T, B.T, alpha=scale)` (`lora_addmm_forward`). Autograd
differentiates it as written, so the gradients are those of this expression; the float32 weights
stay the optimizer's master copies. In bfloat16 the adapter's product carries bfloat16 rounding, as
with `model.adapter_autocast`, and is rounded once where PEFT rounds it three times. In float32 it is
PEFT's result within rounding (tests/test_fused_lora.py).

Unsloth goes further with hand-written autograd functions and Triton kernels per MLP and
attention block; this keeps PEFT's modules, their state dicts and bitsandbytes' own 4-bit matmul
(and its dispatch per GPU), replacing only the arithmetic around the adapters.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import types
from collections import Counter
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# The model's list of the layers routed to `lora_addmm_forward` (`model.fused_lora`).
FUSED_LAYERS = "_lora_ppo_fused_layers"
# The model's list of every LoRA layer routed to either forward.
ROUTED_LAYERS = "_lora_ppo_routed_layers"
# A fused layer's attribute, inside `adapters_cast_once`: {adapter name: (down, up) in the compute dtype}.
CAST_COPIES = "_lora_cast_copies"


def lean_lora_forward(layer, x: torch.Tensor, *args, adapter_names: Optional[list[str]] = None,
                      **kwargs) -> torch.Tensor:
    """PEFT's forward of `layer`, bit for bit, without its copy of the base output (bitsandbytes' 4-bit
    layers) and, where the scale is a power of two, without its multiply over the product: B's weight
    is scaled instead (`_scaled_product`). Anything else PEFT's forward handles (per-row adapters,
    adapters off or merged, DoRA and other variants, a bias on the adapter, autocast, which skips
    PEFT's casts) goes to PEFT's forward."""
    if args or kwargs or adapter_names is not None or layer.disable_adapters or layer.merged \
            or torch.is_autocast_enabled():
        return _pefts(layer, x, *args, adapter_names=adapter_names, **kwargs)
    names = [name for name in layer.active_adapters if name in layer.lora_A]
    if any(name in layer.lora_variant or layer.lora_B[name].bias is not None for name in names):
        return _pefts(layer, x)
    result = layer.base_layer(x)
    dtype = result.dtype
    # PEFT's 4-bit layers cast each adapter's product to the output's dtype before adding it; its
    # plain linear layers add it in the promoted dtype and cast the sum once.
    cast_each = _is_4bit(layer)
    for name in names:
        x = layer._cast_input_dtype(x, layer.lora_A[name].weight.dtype)
        product = _scaled_product(layer, x, name)
        result = result + (product.to(dtype) if cast_each else product)
    return result if cast_each else result.to(dtype)


def _scaled_product(layer, x: torch.Tensor, name: str) -> torch.Tensor:
    """lora_B(lora_A(dropout(x))) * scale, as PEFT computes it. For a power-of-two scale, B's weight is
    multiplied instead of the product: multiplying by a power of two is exact in floating point, so
    every product and partial sum of the matmul, and of its backward, is PEFT's times the scale."""
    hidden = layer.lora_A[name](layer.lora_dropout[name](x))
    scale = layer.scaling[name]
    if math.frexp(scale)[0] == 0.5:  # a power of two (0.5 x 2^k)
        return F.linear(hidden, layer.lora_B[name].weight * scale)
    return layer.lora_B[name](hidden) * scale


def _is_4bit(layer) -> bool:
    linear_4bit = _linear_4bit_class()
    return linear_4bit is not None and isinstance(layer, linear_4bit)


@functools.cache
def _linear_4bit_class() -> Optional[type]:
    """PEFT's LoRA layer on a bitsandbytes 4-bit base (looked up once: every layer's forward asks)."""
    try:
        from peft.tuners.lora.bnb import Linear4bit
    except ImportError:  # PEFT without bitsandbytes
        return None
    return Linear4bit


def lora_addmm_forward(layer, x: torch.Tensor, *args, adapter_names: Optional[list[str]] = None,
                       **kwargs) -> torch.Tensor:
    """`layer`'s output: its base layer's, plus each active adapter's scaled product by addmm.
    `adapter_names` (PEFT's per-row adapters, one name per row: the roles stacked in one forward) in
    runs of rows, each computed as that adapter's own forward would be. Anything else PEFT's forward
    handles (adapters off or merged, DoRA and other variants, a bias on the adapter) goes to PEFT's
    forward."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return _pefts(layer, x, *args, adapter_names=adapter_names, **kwargs)
    runs = [(0, x.shape[0], layer.active_adapters)] if adapter_names is None else _runs(adapter_names)
    used = {name for *_, names in runs for name in names if name in layer.lora_A}
    if any(name in layer.lora_variant or layer.lora_B[name].bias is not None for name in used):
        return _pefts(layer, x, adapter_names=adapter_names)
    result = layer.base_layer(x)
    if not torch.is_grad_enabled() and result.is_contiguous():  # generation, scoring: add in place
        for start, end, names in runs:
            _with_adapters(layer, x[start:end], result[start:end], names, in_place=True)
        return result
    if len(runs) == 1:
        return _with_adapters(layer, x, result, runs[0][2])
    # Split, not sliced: a split's backward joins the pieces' gradients in one copy, where each slice's
    # fills a tensor of the full size with zeros and copies its piece in.
    sizes = [end - start for start, end, _ in runs]
    pieces = zip(x.split(sizes), result.split(sizes), (names for *_, names in runs))
    return torch.cat([_with_adapters(layer, rows, out, names) for rows, out, names in pieces])


def _with_adapters(layer, x: torch.Tensor, result: torch.Tensor, names, in_place: bool = False) -> torch.Tensor:
    """`result` (the base layer's output for `x`) plus the product of each adapter in `names` that
    this layer has, scaled, each added by one addmm in the output's dtype (`in_place`: into `result`)."""
    out = result.view(-1, result.shape[-1]) if in_place else result.reshape(-1, result.shape[-1])
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype != result.dtype:  # a base layer answering in another dtype: its output's, as PEFT adds
        rows = rows.to(result.dtype)
    copies = layer.__dict__.get(CAST_COPIES, {})
    for name in names:
        if name not in layer.lora_A:
            continue
        down, up = copies.get(name) or (None, None)  # [r, in], [out, r]
        if down is None or down.dtype != result.dtype:
            down, up = layer.lora_A[name].weight.to(result.dtype), layer.lora_B[name].weight.to(result.dtype)
        product = layer.lora_dropout[name](rows) @ down.t()
        if in_place:
            out.addmm_(product, up.t(), alpha=layer.scaling[name])
        else:
            out = torch.addmm(out, product, up.t(), alpha=layer.scaling[name])
    return out.view(result.shape)


class _CastTogether(torch.autograd.Function):
    """Copies of many tensors of one dtype in `dtype`, by one batched copy (a few kernels on a GPU,
    where a cast per tensor is a launch per tensor); their gradients come back the same way."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # an unused copy's gradient stays None, not a tensor of zeros
        ctx.source_dtype = tensors[0].dtype
        copies = [torch.empty_like(t, dtype=dtype) for t in tensors]
        torch._foreach_copy_(copies, list(tensors))
        return tuple(copies)

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        wanted = [i for i, grad in enumerate(grads) if grad is not None and ctx.needs_input_grad[i + 1]]
        back: list[Optional[torch.Tensor]] = [None] * len(grads)
        if wanted:
            cast = [torch.empty_like(grads[i], dtype=ctx.source_dtype) for i in wanted]
            torch._foreach_copy_(cast, [grads[i] for i in wanted])
            for i, grad in zip(wanted, cast):
                back[i] = grad
        return (None, *back)


@contextlib.contextmanager
def adapters_cast_once(layers: Sequence[torch.nn.Module], names: Sequence[str], dtype: torch.dtype) -> Iterator[None]:
    """Inside, the fused `layers` read the weights of their adapters in `names` from `dtype` copies made
    here by one batched cast, instead of casting both weights at every call: in the forward, again in
    a checkpointed layer's recomputation, and each gradient back in the backward, a kernel each (13%
    of an update's kernels at the 8B recipe's structure: bench/README.md). The values are the same casts. A forward
    and the backward that recomputes it must both run inside; the copies (the adapters' size in `dtype`)
    and their gradients live until the end."""
    pairs = [(layer, name) for layer in layers for name in names if name in layer.lora_A]
    weights = [w for layer, name in pairs for w in (layer.lora_A[name].weight, layer.lora_B[name].weight)]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, weight in enumerate(weights):
        if weight.dtype != dtype:
            by_dtype.setdefault(weight.dtype, []).append(i)
    if not by_dtype:  # nothing to cast: the layers' own weights are read
        yield
        return
    copies = list(weights)
    for indices in by_dtype.values():  # one batched cast per source dtype (usually just float32)
        for i, copy in zip(indices, _CastTogether.apply(dtype, *(weights[i] for i in indices))):
            copies[i] = copy
    for k, (layer, name) in enumerate(pairs):
        layer.__dict__.setdefault(CAST_COPIES, {})[name] = (copies[2 * k], copies[2 * k + 1])
    try:
        yield
    finally:
        for layer, _ in pairs:
            layer.__dict__.pop(CAST_COPIES, None)


def _runs(adapter_names: list[str]) -> list[tuple[int, int, tuple[str]]]:
    """(first row, end row, (adapter,)) for each run of rows with one adapter name, in row order (a
    name may come back after another: each run is computed alone)."""
    runs, start = [], 0
    for name, rows in itertools.groupby(adapter_names):
        end = start + len(list(rows))
        runs.append((start, end, (name,)))
        start = end
    return runs


def _pefts(layer, x: torch.Tensor, *args, adapter_names=None, **kwargs) -> torch.Tensor:
    """PEFT's own forward of `layer`."""
    if adapter_names is not None:
        kwargs["adapter_names"] = adapter_names
    return type(layer).forward(layer, x, *args, **kwargs)


def route_lora_layers(peft_model: torch.nn.Module, fused: bool = False) -> Counter:
    """Route every LoRA linear layer of `peft_model` (on a plain or bitsandbytes 4-bit base) through
    `lora_addmm_forward` (`fused`: `model.fused_lora`) or `lean_lora_forward`; other LoRA layers
    (embeddings, 8-bit, expert parameters) keep PEFT's. Returns how many layers of each kind were
    routed and kept; the fused routing logs it once."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    kinds: list[type] = [LoraLinear, *filter(None, [_linear_4bit_class()])]
    forward = lora_addmm_forward if fused else lean_lora_forward
    counts: Counter = Counter()
    routed = []
    for module in peft_model.modules():
        if not isinstance(module, LoraLayer):
            continue
        if type(module) in kinds:
            module.forward = types.MethodType(forward, module)  # shadows the class's forward
            routed.append(module)
        else:
            counts[f"PEFT's ({type(module).__name__})"] += 1
    counts["fused" if fused else "lean"] = len(routed)
    peft_model.__dict__[ROUTED_LAYERS] = routed  # plain lists: not registered as submodules again
    if fused:
        peft_model.__dict__[FUSED_LAYERS] = routed
        kept = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()) if kind != "fused")
        log.info("model.fused_lora: %d LoRA layers add their adapters by one addmm in the compute dtype%s",
                 counts["fused"], f"; kept {kept}" if kept else "")
    else:
        peft_model.__dict__.pop(FUSED_LAYERS, None)
    return counts


def fuse_lora_layers(peft_model: torch.nn.Module) -> Counter:
    """Route every LoRA linear layer of `peft_model` through `lora_addmm_forward` (`route_lora_layers`)."""
    return route_lora_layers(peft_model, fused=True)


def fused_layers(peft_model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of `peft_model` that `fuse_lora_layers` routed (kept by it: a walk of an 8B model's
    modules takes milliseconds, once per pass of the update)."""
    return peft_model.__dict__.get(FUSED_LAYERS, [])


def unfuse_lora_layers(peft_model: torch.nn.Module) -> None:
    """Every layer `fuse_lora_layers` routed back to the default, `lean_lora_forward`."""
    if peft_model.__dict__.get(FUSED_LAYERS):
        route_lora_layers(peft_model, fused=False)


@contextlib.contextmanager
def pefts_forward(peft_model: torch.nn.Module) -> Iterator[None]:
    """Inside, every layer `route_lora_layers` routed runs PEFT's own forward, then the routing it had
    (what the tests and bench/update_numerics.py compare lora_ppo's numbers with)."""
    fused = bool(peft_model.__dict__.pop(FUSED_LAYERS, None))
    for module in peft_model.__dict__.pop(ROUTED_LAYERS, []):
        del module.forward
    try:
        yield
    finally:
        route_lora_layers(peft_model, fused=fused)
