"""Use what a run trained: load a run folder (its final/) or a checkpoint folder into the parts its
recipe builds, with the trained policy adapter in place; evaluate it (`lora-ppo eval`) or sample
from it beside the reference (`lora-ppo generate`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from lora_ppo import checkpoint
from lora_ppo.agents.episodes import run_episodes, transcript_text
from lora_ppo.config import Recipe, SFTDataConfig, SFTRecipe, load_recipe
from lora_ppo.data import (TOO_LONG, PromptRow, first_training_row, load_rows, prepare_rows, text_prompt_format,
                           trained_on_conversations)
from lora_ppo.errors import RecipeError
from lora_ppo.evaluation import Evaluation
from lora_ppo.model import dequantized_once, model_context
from lora_ppo.parts import Parts, build, evaluate_policy
from lora_ppo.rewards import check_reward_columns
from lora_ppo.roles import POLICY, REFERENCE
from lora_ppo.run_dir import RUN_ENTRIES, find_checkpoint

# Prompts of a --prompts file may be longer than the training limit, but not without bound (and
# never past what the model's context leaves beside the new tokens).
MAX_PROMPT_TOKENS = 4096

log = logging.getLogger(__name__)


@dataclass
class Trained:
    recipe: Recipe
    folder: Path  # the checkpoint the policy adapter came from
    step: Optional[int]
    parts: Parts
    conversational: bool  # the run trained on conversations: text prompts given now go through the chat template


def load_trained(source: str | Path, with_prompts: bool = True, with_rewards: bool = True) -> Trained:
    """The run's recipe and parts, with the policy adapter of `source` (a run folder: its final/;
    or a checkpoint folder) loaded. Raises RecipeError for a missing or unusable checkpoint.

    `with_prompts` / `with_rewards` False: the run's data / reward are not loaded (`generate`, and
    `eval --prompts`, on a run copied to a machine without its data or its reward's code). With
    both False an SFT run loads too, as `sft_sampling_recipe` samples it; else it is refused."""
    found = find_checkpoint(source)
    recipe = load_recipe(found.run.recipe, schema=None)
    if isinstance(recipe, SFTRecipe) and not (with_prompts or with_rewards):
        ppo = sft_sampling_recipe(recipe, found.folder / POLICY)
        parts = build(ppo, with_prompts=False, with_rewards=False)  # the adapter loads as the policy's start
        return Trained(ppo, found.folder, found.step, parts, sft_on_conversations(recipe.data))
    if isinstance(recipe, SFTRecipe):
        raise RecipeError(f"{source}: an SFT run has no reward to evaluate (its held-out loss is in summary.json, "
                          "its answers in `lora-ppo report`); generate takes it, eval takes a PPO run")
    if not isinstance(recipe, Recipe):
        raise RecipeError(f"{source}: a reward-model run; eval and generate take a PPO run")
    parts = build(recipe, with_prompts=with_prompts, with_rewards=with_rewards)
    checkpoint.load_adapters(found.folder, parts.roles, (POLICY,))
    conversational = any(isinstance(row.prompt, list) for row in parts.train_prompts.rows[:1]) if with_prompts \
        else trained_on_conversations(recipe.data)
    return Trained(recipe, found.folder, found.step, parts, conversational)


def sft_sampling_recipe(sft: SFTRecipe, policy: Path) -> Recipe:
    """The PPO recipe that samples an SFT run's adapter `policy` as its report does: greedily (top-k
    1), up to its data.eval_max_new_tokens, its prompts formatted by its data section, and the bare
    base model (no adapter at all) as the reference to compare with."""
    return Recipe(
        model=sft.model, adapters={"policy": {"init_from": str(policy)}, "reference": "disable"},
        reward={"kind": "none"}, train={"seed": sft.train.seed},
        # generate gives each prompt its own room (prompt_room); the context check needs a number
        data={"chat_template": sft.data.chat_template, "system_prompt": sft.data.system_prompt, "max_prompt_tokens": 1},
        rollout={"max_new_tokens": sft.data.eval_max_new_tokens, "top_k": 1},
    )


def sft_on_conversations(cfg: SFTDataConfig) -> bool:
    """Whether an SFT run's prompts went through the chat template: with data.chat_template, and for
    conversations (a messages column, or a prompt or completion given as turns), read off the data
    source's first row; False, with a warning, when the source can no longer be read."""
    if cfg.format == "text":
        return False
    if cfg.chat_template or cfg.format == "messages":
        return True
    found = first_training_row(cfg)
    if found is None:
        return False
    first, columns = found
    if cfg.format == "auto" and cfg.messages_column in columns:
        return True
    return any(isinstance(first.get(column), list) for column in (cfg.prompt_column, cfg.completion_column))


def check_records_file(out: Path, source: str | Path) -> None:
    """Refuse, before anything loads, an `eval --out` file that cannot take the records: a folder,
    or a file of the run being evaluated (its checkpoints, metrics, held-out records), which the
    records would replace."""
    out = Path(out).expanduser()
    if out.is_dir():
        raise RecipeError(f"--out: {out} is a folder; name the file to write")
    run = find_checkpoint(source).run
    root, target = run.root.resolve(), out.parent.resolve() / out.name
    inside = [folder.resolve() for folder in (run.checkpoints, run.final)]
    if any(folder in target.parents for folder in inside) or (target.parent == root and target.name in RUN_ENTRIES):
        raise RecipeError(f"--out: {out} is a file of the run {run.root}; name one outside its records")


def prompts_from_file(trained: Trained, path: str) -> list[PromptRow]:
    """The prompts of a file (any form data.source takes: text or conversations in the `prompt`
    column, or one per line in a .txt), formatted as the run formatted its prompts."""
    cfg = trained.recipe.data
    rows, _ = load_rows(path, "train", field_name="--prompts")
    fmt = text_prompt_format(trained.parts.tokenizer, cfg, trained.conversational)
    room = prompt_room(trained, trained.recipe.rollout.response_tokens, "rollout.max_new_tokens")
    prompts = prepare_rows(rows, cfg.prompt_column, fmt, room, path)
    if not prompts.rows:
        raise RecipeError(f"--prompts: no usable prompt in {path!r} (a prompt may have up to {room} tokens)")
    if prompts.dropped.get(TOO_LONG):
        log.warning("--prompts: %d of the prompts in %s have more than %d tokens and are left out (%s)",
                    prompts.dropped[TOO_LONG], path, room, _room_reason(trained, room))
    check_reward_columns(trained.recipe.reward, prompts.columns, path)  # an answer column the reward reads
    if trained.parts.episodes is not None:
        trained.parts.episodes.check_columns(prompts.columns, repr(path))
    return prompts.rows


def prompt_room(trained: Trained, new_tokens: int, field: str) -> int:
    """The most tokens a prompt given now may have: what the model's context leaves beside
    `new_tokens` (set by `field`), at most MAX_PROMPT_TOKENS. Past the context a model with a
    position table fails inside its forward."""
    context = model_context(trained.recipe.model)
    if context is None:
        return MAX_PROMPT_TOKENS
    if new_tokens >= context:
        raise RecipeError(f"{field}: {new_tokens} new tokens leave no room for a prompt in the model's "
                          f"context of {context} tokens")
    return min(MAX_PROMPT_TOKENS, context - new_tokens)


def _room_reason(trained: Trained, room: int) -> str:
    context = model_context(trained.recipe.model)
    if context is None or room == MAX_PROMPT_TOKENS:
        return "the limit on prompts given after training"
    return f"the model's context of {context} tokens less {context - room} new ones"


def evaluate_trained(trained: Trained, prompts: Optional[Sequence[PromptRow]] = None, samples: Optional[int] = None,
                     progress: Optional[object] = None) -> Evaluation:
    """The policy on `prompts` (default: the run's held-out prompts): reward, sources and side metrics,
    KL to the reference (when the run has one), response length and distinct-1/2."""
    if prompts is None and not trained.parts.eval_prompts.rows:
        raise RecipeError("eval: the run has no held-out prompts; give some with --prompts")
    return evaluate_policy(trained.parts, trained.recipe, prompts, samples, detailed=True, progress=progress)


def generate(trained: Trained, prompts: Sequence[str], compare_reference: bool = False,
             max_new_tokens: Optional[int] = None, seed: Optional[int] = None) -> list[dict]:
    """One completion per prompt from the trained policy (and from the reference beside it),
    sampled as the run samples (its temperature, top-k, top-p, stop token)."""
    import torch

    recipe, parts = trained.recipe, trained.parts
    sampler = parts.sampler(recipe)
    if max_new_tokens is not None:
        sampler = sampler.with_settings(max_new_tokens=max_new_tokens)
    field = "--max-new-tokens" if max_new_tokens is not None else "rollout.max_new_tokens"
    room = prompt_room(trained, sampler.cfg.response_tokens, field)
    fmt = text_prompt_format(parts.tokenizer, recipe.data, trained.conversational)
    prepared = prepare_rows([{"prompt": p} for p in prompts], "prompt", fmt, room, "the command line")
    if prepared.dropped.get(TOO_LONG):
        raise RecipeError(f"generate: a prompt has more than {room} tokens ({_room_reason(trained, room)})")
    if prepared.dropped:
        raise RecipeError("generate: a prompt is empty")
    rows = prepared.rows
    if parts.episodes is not None:
        parts.episodes.check_columns([], "a prompt given on the command line",
                                     "; `lora-ppo eval RUN --prompts FILE` takes prompts with their columns")
    roles = [POLICY, REFERENCE] if compare_reference else [POLICY]
    if compare_reference and not recipe.adapters.reference_enabled:
        raise RecipeError("--compare-reference: this run has no reference (adapters.reference: none)")
    out = [{"prompt": p} for p in prompts]
    with dequantized_once(parts.roles.peft, recipe.model):
        for role in roles:
            torch.manual_seed(recipe.train.seed if seed is None else seed)
            if parts.episodes is None:
                samples = sampler.sample(rows, role=role)
                texts = samples.completions
            else:  # the run's episodes: each one's turns after the prompt
                samples = run_episodes(sampler, rows, parts.episodes, role=role)
                texts = [transcript_text(messages) for messages in samples.transcripts]
            for record, text, length in zip(out, texts, samples.response_mask.sum(dim=1).tolist()):
                record[role] = text
                record[f"{role}_tokens"] = length  # the stop token included; an episode's action tokens
    return out
