"""The machine and the number formats of a model: the device, the compute dtype a recipe's rule
gives here, and the bitsandbytes quantization config. Used for the policy's base model and for a
classifier reward model alike."""

from __future__ import annotations

import torch

from lora_ppo.config import ModelConfig


def compute_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype for computation and for the unquantized parts (norms, embeddings, heads), by
    the recipe's rule for this machine (`ModelConfig.compute_dtype_name`)."""
    on_gpu = torch.cuda.is_available()
    name = cfg.compute_dtype_name("cuda" if on_gpu else "cpu", on_gpu and torch.cuda.is_bf16_supported())
    return getattr(torch, name)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def quantization_config(cfg: ModelConfig):
    """The BitsAndBytesConfig for the recipe, or None for an unquantized base."""
    from transformers import BitsAndBytesConfig

    if cfg.quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=cfg.double_quant,
            bnb_4bit_compute_dtype=compute_dtype(cfg),
        )
    if cfg.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return None
