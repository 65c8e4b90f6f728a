"""lora_ppo: RLHF with PPO on one 4-bit backbone (policy, reference, value, reward).

The public API is imported lazily, so `import lora_ppo.ppo_math` pulls in torch alone.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Recipe": "lora_ppo.config",
    "load_recipe": "lora_ppo.config",
    "recipe_from_dict": "lora_ppo.config",
    "RecipeError": "lora_ppo.errors",
    "PPOTrainer": "lora_ppo.trainer",
    "RoleModel": "lora_ppo.roles",
    "merge_and_export": "lora_ppo.export",
    "ExportReport": "lora_ppo.export",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lora_ppo' has no attribute {name!r}")
