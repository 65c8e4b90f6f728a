"""Build the parts of a run from a recipe (tokenizer, prompts, reward, roles, optimizer), and the
held-out evaluation that needs nothing else. The trainer and the benchmarks share them."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from lora_ppo.agents.environment import load_environment
from lora_ppo.agents.episodes import EpisodeSettings
from lora_ppo.agents.tools import load_tools, template_renders_tools, tool_schemas, tools_system_message
from lora_ppo.builtin_model import portable_name
from lora_ppo.compiled_generation import StaticDecoder, compiled_generation_on
from lora_ppo.config import PPOConfig, Recipe, RolloutConfig
from lora_ppo.data import PromptRow, PromptSet, load_prompt_sets, resolved_eval_source
from lora_ppo.model import check_context, dequantized_once, load_base_model, load_tokenizer
from lora_ppo.optimizers import adamw
from lora_ppo.quantization import adapter_numerics, compute_dtype
from lora_ppo.rewards import RewardSources, build_reward_sources, check_classifiers, check_reward_columns
from lora_ppo.evaluation import Evaluation, evaluate
from lora_ppo.library_notices import quiet_loading
from lora_ppo.roles import RoleModel
from lora_ppo.rollout import Sampler

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
    episodes: Optional[EpisodeSettings] = None  # multi-turn: rollout.environment / rollout.tools
    decoder: Optional[StaticDecoder] = None  # rollout.compile: made (and logged) at the first sampler
    compile_decided: bool = False

    def sampler(self, recipe: Recipe, decode_steps: int = 0) -> Sampler:
        """How the policy samples in this run (`logprobs_from_generation: auto` decided by the
        dtype the model computes in; `rollout.compile` by the device and the decode steps the job
        takes, at the first call)."""
        float32 = compute_dtype(recipe.model) == torch.float32
        settings = {"logprobs_from_generation": recipe.logprobs_from_generation_on(float32)}
        if not self.compile_decided:
            self.compile_decided = True
            if compiled_generation_on(recipe.rollout, self.roles.lm_head.weight.device, decode_steps):
                self.decoder = StaticDecoder(self.roles.peft, recipe.sequence_tokens)
        return Sampler(self.roles, self.tokenizer, recipe.rollout.model_copy(update=settings), self.decoder)


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build(recipe: Recipe, reward_fn: Optional[Callable] = None, with_prompts: bool = True,
          with_rewards: bool = True) -> Parts:
    """Everything a run needs, seeded with train.seed (the fresh adapters' initial weights come
    from it) and loaded in an order that fails fast: the tokenizer and the data (seconds) before
    the model weights (minutes for a large model).

    Args:
        reward_fn: a Python reward `f(prompts, completions) -> list[float]` that replaces the
            recipe's reward section.
        with_prompts, with_rewards: False leaves the data (no prompt sets) or the reward (no
            source, no reward adapter, and no critic: nothing scores) out: what sampling a trained
            run on other prompts needs once its data or reward code is no longer where the recipe says.
    """
    seed_everything(recipe.train.seed)
    tokenizer = load_tokenizer(recipe.model)
    rollout = recipe.rollout
    field = "rollout.max_new_tokens" if not rollout.episodic else \
        "rollout.max_episode_tokens" if rollout.max_episode_tokens else "rollout.max_turns"
    check_context(recipe.model, recipe.data.max_prompt_tokens, rollout.response_tokens, field)
    train_prompts, eval_prompts = load_prompt_sets(recipe.data, tokenizer, recipe.train.seed) if with_prompts \
        else (PromptSet([]), PromptSet([]))
    if with_prompts and with_rewards:
        check_reward_columns(recipe.reward, train_prompts.columns + (["messages"] if rollout.episodic else []),
                             recipe.data.source, reward_fn)
    episodes = episode_settings(recipe.rollout, tokenizer)  # imported before the weights load: a typo fails fast
    if episodes is not None and with_prompts:
        held_out = resolved_eval_source(recipe.data) or recipe.data.source  # or split off the training set
        for prompts, source in ((train_prompts, recipe.data.source), (eval_prompts, held_out)):
            if prompts.rows:
                episodes.check_columns(prompts.columns, repr(source))
    if not recipe.adapters.reference_enabled:
        log.warning("adapters.reference is 'none': no KL penalty; the policy may drift far from the base model")
    reward_adapter = None if reward_fn is not None or not with_rewards else recipe.reward.adapter_path
    with_value = recipe.uses_critic and with_rewards  # sampling alone needs no critic (nor the reward it starts from)
    RoleModel.adapter_starts(recipe.adapters, reward_adapter, with_value)  # the adapter folders too: a typo fails fast
    if reward_fn is None and with_rewards:
        check_classifiers(recipe.reward, recipe.model)  # and a reward classifier's name
    with quiet_loading():  # the Python API shows what the CLI shows: no loading bar or kernel notice
        roles = RoleModel(load_base_model(recipe.model), recipe.adapters, with_value=with_value,
                          reward_adapter=reward_adapter, base_name=portable_name(recipe.model.name),
                          numerics=adapter_numerics(recipe.model), trim_padding=recipe.ppo.trim_padding,
                          packing=recipe.ppo.packing)
        # After the roles: a reward adapter lives on their backbone, and a classifier loads its weights.
        rewards = build_reward_sources(recipe.reward, recipe.model, reward_fn,
                                       roles.reward_scores if reward_adapter else None) if with_rewards \
            else RewardSources([])
    log_end_tokens(tokenizer, recipe.rollout, roles)
    optimizer, scheduler = build_optimizer(roles, recipe.ppo, recipe.train.steps)
    return Parts(tokenizer, train_prompts, eval_prompts, rewards, roles, optimizer, scheduler, episodes)


def log_end_tokens(tokenizer, cfg: RolloutConfig, roles: RoleModel) -> None:
    """Say where responses end when the model's generation config names end tokens beside the
    tokenizer's eos (an instruction model's end of turn), which a run stops at as generate() does."""
    stops = Sampler(roles, tokenizer, cfg).stop_ids
    if cfg.stop_token == "eos" and len(stops) > 1:
        log.info("rollout.stop_token eos: responses end at %s (the tokenizer's eos token and the end tokens the "
                 "model's generation config names)", ", ".join(tokenizer.convert_ids_to_tokens(list(stops))))


def episode_settings(cfg: RolloutConfig, tokenizer) -> Optional[EpisodeSettings]:
    """What multi-turn episodes talk to (the environment and the tools, imported), or None. Tools
    reach the model through its chat template, or, where the template ignores `tools=`, through
    the system message (said once in the log)."""
    if not cfg.episodic:
        return None
    tools = load_tools(cfg.tools)
    schemas = tool_schemas(list(tools.values())) if tools else None
    in_system = None
    if schemas and not template_renders_tools(tokenizer, schemas):
        in_system = tools_system_message(schemas)
        log.info("rollout.tools: the chat template ignores tools=, so their schemas go into the system message, "
                 "with the <tool_call> format the calls are read in (docs/agents.md)")
    return EpisodeSettings(
        max_turns=cfg.max_turns, max_episode_tokens=cfg.max_episode_tokens,
        environment=load_environment(cfg.environment) if cfg.environment else None,
        environment_name=cfg.environment or "", tools=tools,
        tool_schemas=schemas, tool_timeout_s=cfg.tool_timeout_s, tools_in_system=in_system,
    )


def build_optimizer(
    roles: RoleModel, cfg: PPOConfig, steps: int
) -> tuple[torch.optim.Optimizer, Optional[torch.optim.lr_scheduler.LRScheduler]]:
    """AdamW over the policy adapter (and the value adapter + head, at their own learning rate),
    its moments kept where `ppo.optimizer_state` says, and the linear decay to 0 over every optimizer step of the run when the recipe asks for it."""
    groups = [{"params": roles.policy_parameters(), "lr": cfg.learning_rate}]
    if roles.has_value:
        groups.append({"params": roles.value_parameters(), "lr": cfg.value_learning_rate or cfg.learning_rate})
    optimizer = adamw(groups, cfg.optimizer_state, ADAM_EPS)
    if cfg.lr_schedule != "linear":
        return optimizer, None
    total_updates = steps * cfg.num_epochs * cfg.num_minibatches
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: max(0.0, 1.0 - i / max(1, total_updates)))
    return optimizer, scheduler


def evaluate_policy(parts: Parts, recipe: Recipe, prompts: Optional[Sequence[PromptRow]] = None,
                    samples_per_prompt: Optional[int] = None, detailed: bool = False,
                    progress: Optional[object] = None, with_kl: bool = False) -> Evaluation:
    """The policy's score (and sources and side metrics) on `prompts` (default: the held-out ones)
    with standard errors, and every completion, sampled with a fixed seed that leaves the training
    RNG untouched; empty when there are no prompts. `with_kl` adds, with a reference, the KL to it;
    `detailed` adds that, response length and distinct-1/2."""
    rows = parts.eval_prompts.rows if prompts is None else list(prompts)
    if not rows:
        return Evaluation({}, [])
    sampler = parts.sampler(recipe)
    if recipe.data.eval_batch_size is not None:
        sampler = sampler.with_settings(batch_size=recipe.data.eval_batch_size)
    with dequantized_once(parts.roles.peft, recipe.model):
        return evaluate(sampler, rows, parts.rewards, seed=recipe.train.seed,
                        samples_per_prompt=samples_per_prompt or recipe.data.eval_samples_per_prompt,
                        with_text_stats=detailed, with_kl=(detailed or with_kl) and recipe.adapters.reference_enabled,
                        progress=progress, episodes=parts.episodes)
