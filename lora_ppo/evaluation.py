"""Evaluate a policy on prompts: the mean reward (and each source's and side metric's) with its
standard error, and, on request, the KL to the reference, response length and distinct-1/2; every
completion is kept as a record, for the report and for `lora-ppo eval`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from lora_ppo.agents.episodes import EpisodeSettings, run_episodes
from lora_ppo.data import PromptRow
from lora_ppo.devices import fork_rng_args
from lora_ppo.rewards import RewardBatch, RewardSources
from lora_ppo.rollout import Sampler, masked_rows, score_passes

SE_SUFFIX = "_se"


@dataclass(frozen=True)
class Evaluation:
    """`scores`: name -> mean over prompts of each prompt's mean, and `<name>_se` its standard
    error across prompts; `records`: one dict per completion (prompt, sample, completion, scores)."""

    scores: dict[str, float]
    records: list[dict]


def per_prompt_means(values: Sequence[float], n_prompts: int) -> tuple[float, float]:
    """(mean, standard error) of the prompts' means; `values` hold each prompt's samples in a row."""
    means = torch.tensor(list(values), dtype=torch.float64).view(n_prompts, -1).mean(dim=1)  # [n_prompts]
    return means.mean().item(), (means.std().item() / n_prompts**0.5 if n_prompts > 1 else 0.0)


def distinct_n(sequences: Sequence[Sequence[int]], n: int) -> float:
    """Distinct-n (Li et al. 2016): unique n-grams over all n-grams, within each completion; 0 when
    there are none."""
    grams = [tuple(seq[i : i + n]) for seq in sequences for i in range(len(seq) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


@torch.no_grad()
def evaluate(
    sampler: Sampler,
    prompts: Sequence[PromptRow],
    rewards: RewardSources,
    seed: int,
    samples_per_prompt: int = 1,
    with_text_stats: bool = False,
    with_kl: bool = False,
    progress: Optional[object] = None,
    episodes: Optional[EpisodeSettings] = None,
) -> Evaluation:
    """Sample each prompt `samples_per_prompt` times with a fixed seed, inside a forked RNG (the
    same policy gets the same completions; the training RNG stream is left untouched), and score
    every completion with every source and side metric.

    Args:
        with_text_stats: also response length (tokens) and distinct-1/2 of the completions' tokens.
        with_kl: also the KL of the policy to the reference per response (sum of k1 over its tokens).
        progress: a tqdm-like bar, advanced by the prompts done.
        episodes: play multi-turn episodes with the recipe's environment or tools; a score is then
            the reward sources' plus every reward the environment gave, and a record keeps the
            episode's messages as `transcript`.
    """
    roles = sampler.roles
    device = roles.lm_head.weight.device
    rows = [p for p in prompts for _ in range(samples_per_prompt)]
    names = [s.name for s in rewards.sources] if len(rewards.sources) > 1 else []
    columns: dict[str, list[float]] = {"score": [], **{name: [] for name in [*names, *rewards.side]}}
    lengths, kls, records, token_ids = [], [], [], []
    with torch.random.fork_rng(**fork_rng_args(device)):
        torch.manual_seed(seed)
        for start in range(0, len(rows), sampler.cfg.batch_size):
            batch = rows[start : start + sampler.cfg.batch_size]
            if episodes is None:
                samples = sampler.sample(batch)
                ids = samples.completion_ids()
                said = rewards.score(RewardBatch.from_rows(batch, samples.completions, ids, samples.model_input()))
                columns["score"] += said.total
                text_ids = ids
            else:
                samples = run_episodes(sampler, batch, episodes)
                ids = samples.last_turn_ids
                reward_batch = RewardBatch.from_rows(batch, samples.completions, ids, samples.model_input())
                reward_batch.columns["messages"] = samples.transcripts
                said = rewards.score(reward_batch)
                columns["score"] += [s + r for s, r in zip(said.total, samples.turn_rewards.sum(dim=1).tolist())]
                # distinct-n over what the policy wrote in the whole episode, as length counts it
                text_ids = masked_rows(samples.response_ids, samples.response_mask)
            for name, values in {**said.by_source, **said.side}.items():
                if name in columns:
                    columns[name] += values
            token_ids += text_ids
            # action tokens of the whole response or episode, as training's response/length counts them
            lengths += samples.response_mask.sum(dim=1).float().tolist()
            if with_kl:
                input_ids, attention_mask = samples.model_input()
                old, ref, _ = score_passes(roles, input_ids, attention_mask, samples.query_ids.shape[1],
                                           sampler.cfg.temperature, sampler.cfg.forward_batch_size, with_values=False)
                kls += torch.where(samples.response_mask, old - ref, torch.zeros_like(old)).sum(dim=1).tolist()
            for i, row in enumerate(batch):
                index = start + i
                records.append({"prompt": row.prompt, "sample": index % samples_per_prompt,
                                "completion": samples.completions[i],
                                **{name: values[index] for name, values in columns.items()},
                                **({"transcript": samples.transcripts[i]} if episodes is not None else {})})
            if progress is not None:
                progress.update(len(batch) / samples_per_prompt)
    if not prompts:
        return Evaluation({key: 0.0 for name in columns for key in (name, f"{name}{SE_SUFFIX}")}, [])
    if with_text_stats:
        columns["length"] = lengths
    if with_kl:
        columns["kl"] = kls
    scores: dict[str, float] = {}
    for name, values in columns.items():
        scores[name], scores[f"{name}{SE_SUFFIX}"] = per_prompt_means(values, len(prompts))
    if with_text_stats:
        scores["distinct_1"], scores["distinct_2"] = distinct_n(token_ids, 1), distinct_n(token_ids, 2)
    return Evaluation(scores, records)


def format_evaluation(evaluation: Evaluation, title: str) -> str:
    """A table: each metric's mean and standard error over prompts, then the count."""
    scores = evaluation.scores
    names = [k for k in scores if not k.endswith(SE_SUFFIX)]
    width = max(len(n) for n in names) if names else 0
    lines = [title]
    for name in names:
        se = scores.get(f"{name}{SE_SUFFIX}")
        lines.append(f"  {name:<{width}}  {scores[name]:8.3f}" + (f"  (± {se:.3f})" if se is not None else ""))
    prompts = sum(1 for r in evaluation.records if r["sample"] == 0)
    lines.append(f"  {len(evaluation.records)} completions of {prompts} prompts")
    return "\n".join(lines)
