"""The number formats of a model: the compute dtype a recipe's rule gives on this machine's
device, and the bitsandbytes quantization config. Used for the policy's base model and for a
classifier reward model alike."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from lora_ppo.config import ModelConfig
from lora_ppo.devices import bf16_supported, device_type

log = logging.getLogger(__name__)


def compute_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype for computation and for the unquantized parts (norms, embeddings, heads), by
    the recipe's rule for this machine (`ModelConfig.compute_dtype_name`): `auto` is float32 on
    CPU; on every accelerator bfloat16 where it computes in it, else float16."""
    kind = device_type()
    # The recipe's rule knows a GPU and a CPU; XPU and MPS follow the GPU rule.
    rule_device = "cpu" if kind == "cpu" else "cuda"
    return getattr(torch, cfg.compute_dtype_name(rule_device, bf16_supported(kind)))


@dataclass(frozen=True)
class AdapterNumerics:
    """How the LoRA adapters compute beside a 16-bit model: their matmuls autocast to `autocast_dtype`
    (`model.adapter_autocast`; None: in their own float32), or each LoRA layer as one addmm in the
    compute dtype (`fused`, `model.fused_lora`)."""

    autocast_dtype: Optional[torch.dtype] = None
    fused: bool = False


def adapter_numerics(cfg: ModelConfig) -> AdapterNumerics:
    """The recipe's adapter numerics on this machine (the autocast dtype decided and logged here)."""
    return AdapterNumerics(adapter_autocast_dtype(cfg), cfg.fused_lora)


def adapter_autocast_dtype(cfg: ModelConfig) -> Optional[torch.dtype]:
    """`model.adapter_autocast` on this machine, logged: bfloat16 where computation runs in it, else
    None (in float32 there is nothing to gain; float16 gradients would need loss scaling)."""
    if not cfg.adapter_autocast:
        return None
    dtype = compute_dtype(cfg)
    if dtype != torch.bfloat16:
        log.info("model.adapter_autocast: off (computation runs in %s, not bfloat16)", str(dtype).removeprefix("torch."))
        return None
    log.info("model.adapter_autocast: the adapters' matmuls run in bfloat16 (float32 master weights)")
    return dtype


def compute_in(model: torch.nn.Module, dtype: torch.dtype, name: str, field: str = "model.compute_dtype") -> None:
    """A checkpoint saved quantized (a hub's `...-bnb-4bit`: a base model or a reward classifier)
    loads its unquantized weights, and its 4-bit layers' compute dtype, as it was saved, whatever
    dtype `from_pretrained` is given (transformers 5): the recipe's `field` would be ignored, and with
    it the tolerances and memory counted for it. They are cast to `dtype` here, as a load that
    quantizes would have made them; the quantized codes stay (4-bit ones dequantize into `dtype`)."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None or not getattr(quantizer, "pre_quantized", False):
        return
    # Weights the model keeps in float32 at any dtype (transformers' `_keep_in_fp32_modules`) stay.
    kept = [*(getattr(model, "_keep_in_fp32_modules", None) or ()),
            *(getattr(model, "_keep_in_fp32_modules_strict", None) or ())]
    saved: set[torch.dtype] = set()
    for param_name, param in model.named_parameters():
        if not param.is_floating_point() or param.dtype == dtype:
            continue
        if param.dtype == torch.float32 and any(k in param_name.split(".") for k in kept):
            continue
        saved.add(param.dtype)
        param.data = param.data.to(dtype)
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:  # no bitsandbytes: no 4-bit layers
        Linear4bit = ()
    four_bit = [layer for layer in model.modules() if isinstance(layer, Linear4bit)]
    for layer in four_bit:
        if layer.compute_dtype != dtype:
            saved.add(layer.compute_dtype)
            layer.compute_dtype = dtype
            layer.weight.quant_state.dtype = dtype
    saved.discard(None)
    if saved:
        log.info("%s: %s was saved quantized to compute in %s; its unquantized weights%s now compute in %s",
                 field, name, ", ".join(sorted(str(d).removeprefix("torch.") for d in saved)),
                 " and 4-bit layers" if four_bit else "", str(dtype).removeprefix("torch."))


def modules_kept_unquantized(model: torch.nn.Module) -> list[str]:
    """The module names a quantized load of `model` (built on the meta device) keeps in compute
    dtype: what transformers keeps by default (the module of the last weight, tied and output
    embeddings) and every top-level module with weights outside the base model (a classifier's
    head: `score`, `classifier`, DeBERTa's `pooler`)."""
    from transformers.quantizers.base import get_keys_to_not_convert

    # Giving `llm_int8_skip_modules` replaces transformers' default list, so it is kept here too.
    kept = set(get_keys_to_not_convert(model))
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if isinstance(base, torch.nn.Module) and base is not model:
        kept |= {name for name, child in model.named_children()
                 if child is not base and next(child.parameters(), None) is not None}
    return sorted(kept)


def quantization_config(cfg: ModelConfig, keep_unquantized: Sequence[str] = ()):
    """The BitsAndBytesConfig for the recipe, or None for an unquantized base. `keep_unquantized`:
    module names to load in compute dtype instead of transformers' default choice (see
    `modules_kept_unquantized`); without any, `model.quantize_lm_head` keeps none (the LM head is
    quantized too), else transformers' default (it keeps the LM head)."""
    from transformers import BitsAndBytesConfig

    # bitsandbytes' name, for 4-bit too; absent keeps transformers' default, an empty list none.
    skip = {"llm_int8_skip_modules": list(keep_unquantized)} if keep_unquantized else \
        {"llm_int8_skip_modules": []} if cfg.quantize_lm_head else {}
    if cfg.quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=cfg.double_quant,
            bnb_4bit_compute_dtype=compute_dtype(cfg),
            **skip,
        )
    if cfg.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    return None
