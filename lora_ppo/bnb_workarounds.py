"""bitsandbytes workarounds: keep 4-bit layers on their differentiable kernel, and (optionally)
compute every 4-bit layer from one dequantized copy of its weight, made once for a run."""

from __future__ import annotations

import contextlib
import copy
import types
from typing import Iterator, Optional

import torch
from torch import nn

def keep_4bit_weights_differentiable(model: nn.Module) -> None:
    """Stop bitsandbytes from repacking 4-bit weights for its CPU inference kernel.

    On CPUs with AVX512-BF16, a Linear4bit in eval mode that sees an input without grad
    repacks its weight for `gemv_4bit`, and from then on every call (training ones too) goes
    through that kernel, which has no backward: gradients to earlier layers silently vanish.
    That kernel also rounds differently, so every load goes through here and all passes share
    one kernel. The flag only gates that repacking (these modules have no dropout), so keep it set.
    """
    for module in linear_4bit_layers(model):
        module.training = True


def eval_on_training_kernel(model: nn.Module) -> nn.Module:
    """`model.eval()` (no dropout anywhere) with its 4-bit layers kept on the kernel training
    uses: eval() resets their flag (see keep_4bit_weights_differentiable)."""
    model.eval()
    keep_4bit_weights_differentiable(model)
    return model


def dequantized_4bit_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """The bytes `dequantized_4bit_layers` would hold for `model`'s 4-bit layers."""
    return sum(_copy_bytes(module, dtype) for module in linear_4bit_layers(model))


def _copy_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """The bytes of one 4-bit layer's dequantized weight."""
    return module.weight.quant_state.shape.numel() * (module.compute_dtype or dtype).itemsize


# A 4-bit layer's attribute: its dequantized copy, (weight, bias), kept between contexts (`keep`).
KEPT_COPY = "_lora_ppo_kept_dequantized"


@contextlib.contextmanager
def dequantized_4bit_layers(model: nn.Module, dtype: torch.dtype, max_bytes: Optional[float] = None,
                            keep: bool = False) -> Iterator[float]:
    """Compute every 4-bit layer from one dequantized copy of its weight, for the duration; with
    `max_bytes`, only the layers whose copies fit that many bytes (in the model's order, a layer
    too large for what is left skipped), the rest from their 4 bits as before.

    bitsandbytes dequantizes a 4-bit weight in every forward and again in every backward
    pass (on CPU a large share of a small layer's time), and generating N tokens dequantizes
    the whole model N + 1 times. Inside this context each
    Linear4bit computes `linear(x, W)` with W dequantized once on entry, which is what
    bitsandbytes' CPU path computes anyway (dequantize to the input's dtype, then linear), so
    outputs and gradients are unchanged. The weights are held unquantized in `dtype` meanwhile;
    on exit the layers compute from 4 bits again, also after an error or Ctrl-C, and the copies
    are dropped, or with `keep` held on the layers for the next context (until
    `release_dequantized_copies`): the same tensors at the same addresses every step, where a
    compiled decode step's CUDA graphs read them (a new copy each step recorded the graphs again).
    Layers already dequantized by an enclosing context are left to it. Yields the bytes the copies
    take.
    """
    layers = linear_4bit_layers(model)
    if layers:  # so bitsandbytes is installed
        from bitsandbytes.functional import dequantize_4bit
    patched: list[tuple[nn.Module, Optional[types.MethodType]]] = []
    held = 0.0
    try:
        with torch.no_grad():
            for module in layers:
                # Straight into the layer's compute dtype, as bitsandbytes does per pass (a
                # bf16 checkpoint computed in fp32 is not rounded through bf16 first).
                layer_dtype = module.compute_dtype or dtype
                size = _copy_bytes(module, dtype)
                if max_bytes is not None and held + size > max_bytes:
                    continue
                held += size
                if is_dequantized(module):
                    continue
                copy_ = vars(module).get(KEPT_COPY)
                if copy_ is None or copy_[0].dtype != layer_dtype:
                    state = copy.copy(module.weight.quant_state)
                    state.dtype = layer_dtype
                    copy_ = (dequantize_4bit(module.weight.data, state),
                             None if module.bias is None else module.bias.to(layer_dtype))
                module._lora_ppo_dequantized = copy_
                if keep:
                    setattr(module, KEPT_COPY, copy_)
                # An instance attribute shadows the class's forward (or the fused decode's,
                # `model.fused_4bit_decode`, put back on exit). One function for every layer and
                # step: a compiled decode step (rollout.compile) sees the same code each step and
                # the weights as inputs, so it is not compiled again.
                patched.append((module, vars(module).get("forward")))
                module.forward = types.MethodType(_dequantized_forward, module)
        yield held
    finally:
        for module, previous in patched:
            if previous is None:
                del module.forward
            else:
                module.forward = previous
            del module._lora_ppo_dequantized


def release_dequantized_copies(model: nn.Module) -> None:
    """Drop the copies `dequantized_4bit_layers(..., keep=True)` kept on `model`'s layers."""
    for module in linear_4bit_layers(model):
        vars(module).pop(KEPT_COPY, None)


def linear_4bit_layers(model: nn.Module) -> list[nn.Module]:
    """The model's bitsandbytes 4-bit layers (none without bitsandbytes)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        return []
    return [module for module in model.modules() if isinstance(module, bnb.nn.Linear4bit)]


def first_4bit_layer(model: nn.Module):
    """The model's first bitsandbytes 4-bit layer, or None."""
    return next(iter(linear_4bit_layers(model)), None)


def is_dequantized(layer) -> bool:
    """Whether a 4-bit layer computes from its dequantized copy now (`dequantized_4bit_layers`)."""
    return layer is not None and "_lora_ppo_dequantized" in vars(layer)


def _dequantized_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight, bias = module._lora_ppo_dequantized
    return torch.nn.functional.linear(x.to(weight.dtype), weight, bias).to(x.dtype)
