"""Build the parts of a run from a recipe (tokenizer, prompts, reward, roles, optimizer), and the
held-out evaluation that needs nothing else. The trainer and the benchmarks share them."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from lora_ppo.config import PPOConfig, Recipe
from lora_ppo.data import PromptSet, load_prompt_sets
from lora_ppo.model import dequantized_once, load_base_model, load_tokenizer
from lora_ppo.rewards import RewardSources, build_reward_sources
from lora_ppo.roles import RoleModel
from lora_ppo.rollout import Sampler, evaluate_prompts

log = logging.getLogger(__name__)

# AdamW without weight decay (LoRA weights start at or near zero and should be free to move);
# eps 1e-5 as in the PPO reference implementations.
ADAM_EPS = 1e-5


@dataclass
class Parts:
    tokenizer: object
    train_prompts: PromptSet
    eval_prompts: PromptSet
    rewards: RewardSources
    roles: RoleModel
    optimizer: torch.optim.Optimizer
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler]

    def sampler(self, recipe: Recipe) -> Sampler:
        """How the policy samples in this run."""
        return Sampler(self.roles, self.tokenizer, recipe.rollout)


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build(recipe: Recipe, reward_fn: Optional[Callable] = None) -> Parts:
    """Everything a run needs, seeded with train.seed (the fresh adapters' initial weights come
    from it) and loaded in an order that fails fast: the tokenizer and the data (seconds) before
    the model weights (minutes for a large model).

    Args:
        reward_fn: a Python reward `f(prompts, completions) -> list[float]` that replaces the
            recipe's reward section.
    """
    seed_everything(recipe.train.seed)
    tokenizer = load_tokenizer(recipe.model)
    train_prompts, eval_prompts = load_prompt_sets(recipe.data, tokenizer, recipe.train.seed)
    rewards = build_reward_sources(recipe.reward, recipe.model.trust_remote_code, reward_fn)
    rewards.check_columns(train_prompts.columns, recipe.data.source)
    if not recipe.adapters.reference_enabled:
        log.warning("adapters.reference is 'none': no KL penalty; the policy may drift far from the base model")
    roles = RoleModel(load_base_model(recipe.model), recipe.adapters, with_value=recipe.uses_critic)
    optimizer, scheduler = build_optimizer(roles, recipe.ppo, recipe.train.steps)
    return Parts(tokenizer, train_prompts, eval_prompts, rewards, roles, optimizer, scheduler)


def build_optimizer(
    roles: RoleModel, cfg: PPOConfig, steps: int
) -> tuple[torch.optim.Optimizer, Optional[torch.optim.lr_scheduler.LRScheduler]]:
    """AdamW over the policy adapter (and the value adapter + head, at their own learning rate),
    and the linear decay to 0 over every optimizer step of the run when the recipe asks for it."""
    groups = [{"params": roles.policy_parameters(), "lr": cfg.learning_rate}]
    if roles.has_value:
        groups.append({"params": roles.value_parameters(), "lr": cfg.value_learning_rate or cfg.learning_rate})
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0, eps=ADAM_EPS)
    if cfg.lr_schedule != "linear":
        return optimizer, None
    total_updates = steps * cfg.num_epochs * cfg.num_minibatches
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: max(0.0, 1.0 - i / max(1, total_updates)))
    return optimizer, scheduler


def evaluate_heldout(parts: Parts, recipe: Recipe) -> dict[str, float]:
    """Mean held-out score (and side metrics) with its standard error, sampled with a fixed seed
    that leaves the training RNG untouched; {} when there are no held-out prompts."""
    if not parts.eval_prompts.rows:
        return {}
    sampler = parts.sampler(recipe)
    if recipe.data.eval_batch_size is not None:
        sampler = sampler.with_batch_size(recipe.data.eval_batch_size)
    with dequantized_once(parts.roles.peft, recipe.model):
        return evaluate_prompts(sampler, parts.eval_prompts.rows, parts.rewards, seed=recipe.train.seed,
                                samples_per_prompt=recipe.data.eval_samples_per_prompt)
