"""PEFT workarounds: adapters added one after another on an MoE model keep the layers they name,
whatever PEFT 0.22's renaming of transformers-4 MoE targets makes of them."""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def targets_kept_as_named() -> Iterator[None]:
    """Add or load adapters without PEFT renaming targets that name modules the model has.

    PEFT 0.22 renames an adapter's targets from transformers-4 MoE names (Qwen2-MoE's and Mixtral's
    per-expert layers, and every model_type it converts alike) to transformers 5's fused experts. A
    layer it may keep as a module must be an nn.Linear; once the first adapter wrapped it in LoRA it is
    not, so every adapter after the first lost Qwen2-MoE's shared expert (named as a fused expert that
    does not exist, its weights dropped on load). A target that is the full name of a module of the
    model is no transformers-4 name: such configs (what lora_ppo writes, and PEFT 0.22 saves for
    `all-linear`) go in as written; others, such as an adapter trained on transformers 4, are still
    renamed.
    """
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # PEFT before 0.22: it renames nothing
        yield
        return
    rename = conversion.convert_peft_config_for_transformers

    def rename_unless_named(peft_config, model, conversions):
        targets = getattr(peft_config, "target_modules", None)
        if targets and not isinstance(targets, str):
            names = {name for name, _ in model.named_modules()}
            if all(target in names for target in targets):
                return None
        return rename(peft_config, model=model, conversions=conversions)

    conversion.convert_peft_config_for_transformers = rename_unless_named
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = rename
