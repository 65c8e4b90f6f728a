"""The PPO loop: rollout -> KL-shaped rewards -> GAE -> clipped updates, with logging,
samples, evaluation and saving. Sole owner of the optimizer, scheduler and step counter.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from lora_ppo import ppo_math
from lora_ppo.config import PPOConfig, Recipe, recipe_to_yaml
from lora_ppo.data import PromptStream, count_summary, load_prompt_sets
from lora_ppo.errors import RecipeError
from lora_ppo.rollout import Rollout, collect_rollout, evaluate_prompts
from lora_ppo.roles import POLICY, VALUE, RoleModel

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
RECIPE_FILE = "recipe.yaml"
SUMMARY_FILE = "summary.json"
SAMPLES_PER_LOG = 4


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def peak_memory_gb() -> float:
    """Peak GPU memory allocated (GPU), or the process's peak resident memory (CPU), in GB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


@dataclass
class UpdateStats:
    """Token-weighted means over every micro-batch of one PPO update."""

    sums: dict[str, float] = field(default_factory=dict)
    weight: float = 0.0

    def add(self, values: dict[str, torch.Tensor | float], weight: float) -> None:
        for key, value in values.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value) * weight
        self.weight += weight

    def means(self) -> dict[str, float]:
        return {key: total / max(self.weight, 1e-12) for key, total in self.sums.items()}


@dataclass(frozen=True)
class Advantages:
    """What the update needs besides the rollout. Per-token tensors are [B, T_resp]."""

    scores: torch.Tensor  # [B] shaped scores the optimiser sees
    rewards: torch.Tensor  # per-token rewards (KL-shaped when the penalty is in the reward)
    kl: torch.Tensor  # per-token KL estimate, 0 on padding
    advantages: torch.Tensor
    returns: Optional[torch.Tensor]  # value targets; None without a critic


def compute_advantages(
    rollout: Rollout, cfg: PPOConfig, kl_coef: float, scores: torch.Tensor, group_size: int = 1
) -> Advantages:
    """KL-shaped rewards, then GAE (with the critic) or group baselines (RLOO / GRPO).

    Args:
        scores: [B] the rollout's scores after shaping (normalisation, clipping, length penalty).
        kl_coef: the current KL coefficient (fixed, or from the adaptive controller).
        group_size: samples per prompt, consecutive rows (RLOO / GRPO).
    """
    mask = rollout.response_mask
    # With the penalty as a loss term the reward carries the score alone.
    reward_kl_coef = kl_coef if cfg.kl_penalty == "reward" else 0.0
    rewards, kl = ppo_math.kl_shaped_rewards(
        scores, rollout.old_logprobs, rollout.ref_logprobs, mask, reward_kl_coef, cfg.kl_estimator
    )
    if cfg.advantage_estimator == "gae":
        if cfg.whiten_rewards:
            rewards = ppo_math.masked_whiten(rewards, mask, shift_mean=False)
        advantages, returns = ppo_math.gae(rollout.values, rewards, mask, cfg.gamma, cfg.lam)
    else:
        # A sequence's return is its score minus its KL penalty; every token shares the advantage.
        sequence_rewards = scores - reward_kl_coef * kl.sum(dim=1)
        per_sequence = ppo_math.group_advantages(sequence_rewards, group_size, cfg.advantage_estimator)
        advantages = torch.where(mask, per_sequence[:, None].expand_as(mask), torch.zeros_like(rewards))
        returns = None
    if cfg.whiten_advantages:
        advantages = ppo_math.masked_whiten(advantages, mask)
    return Advantages(scores, rewards, kl, advantages, returns)


def ppo_update(
    roles: RoleModel,
    optimizer: torch.optim.Optimizer,
    scheduler,
    rollout: Rollout,
    adv: Advantages,
    cfg: PPOConfig,
    minibatch_size: int,
    micro_batch_size: int,
    temperature: float,
    gradient_checkpointing: bool,
    generator: torch.Generator,
    kl_coef: float = 0.0,
) -> dict[str, float]:
    """num_epochs x minibatches x micro-batches of clipped policy and value losses.

    Losses are normalised by the whole minibatch's token (or sequence) count, so splitting
    a minibatch into micro-batches (gradient accumulation) does not change the update.
    """
    input_ids, attention_mask = rollout.input_ids, rollout.attention_mask
    mask = rollout.response_mask
    start = rollout.response_start
    batch = input_ids.shape[0]
    with_critic = rollout.values is not None and adv.returns is not None
    stats = UpdateStats()
    policy_params, value_params = roles.policy_parameters(), roles.value_parameters()
    value_clip_eps = cfg.value_clip_eps if cfg.clip_value_loss else None
    skipped = scaled = minibatches = 0
    policy_norm = value_norm = torch.zeros(())
    with roles.gradient_checkpointing(gradient_checkpointing):
        for _epoch in range(cfg.num_epochs):
            order = torch.randperm(batch, generator=generator).to(input_ids.device)
            for mb_start in range(0, batch, minibatch_size):
                mb = order[mb_start : mb_start + minibatch_size]
                token_count = mask[mb].sum().clamp(min=1)
                normalizer = token_count if cfg.loss_aggregation == "token" else len(mb)
                ratio_sum = torch.zeros(())
                optimizer.zero_grad(set_to_none=True)
                for micro_start in range(0, len(mb), micro_batch_size):
                    idx = mb[micro_start : micro_start + micro_batch_size]
                    ids, am, m = input_ids[idx], attention_mask[idx], mask[idx]
                    n_tokens = float(m.sum())

                    with roles.as_role(POLICY):
                        new_logprobs, entropy = roles.response_logprobs(ids, am, start, temperature)
                    pg_loss, pg_stats = ppo_math.policy_loss(
                        new_logprobs, rollout.old_logprobs[idx], adv.advantages[idx], m, cfg.clip_eps,
                        normalizer, cfg.dual_clip, cfg.loss_aggregation,
                    )
                    entropy_term = ppo_math.aggregate_loss(entropy, m, cfg.loss_aggregation, normalizer)
                    loss = pg_loss - cfg.entropy_coef * entropy_term
                    if cfg.kl_penalty == "loss" and kl_coef > 0:
                        loss = loss + ppo_math.kl_loss(
                            new_logprobs, rollout.ref_logprobs[idx], m, kl_coef, cfg.kl_estimator,
                            normalizer, cfg.loss_aggregation,
                        )
                    loss.backward()
                    ratio_sum = ratio_sum + pg_stats["ratio"] * n_tokens
                    step_stats = {
                        "loss/policy": pg_loss.detach(),
                        "policy/clipfrac": pg_stats["clipfrac"],
                        "policy/dual_clipfrac": pg_stats["dual_clipfrac"],
                        "policy/approxkl": pg_stats["approxkl"],
                        "policy/ratio": pg_stats["ratio"],
                        "policy/entropy": ppo_math.masked_mean(entropy.detach(), m),
                    }

                    if with_critic:
                        with roles.as_role(VALUE):
                            new_values = roles.values(ids, am, start)
                        vf_loss, vf_stats = ppo_math.value_loss(
                            new_values, rollout.values[idx], adv.returns[idx], m, value_clip_eps,
                            normalizer, cfg.loss_aggregation,
                        )
                        (cfg.vf_coef * vf_loss).backward()
                        step_stats["loss/value"] = vf_loss.detach()
                        step_stats["value/clipfrac"] = vf_stats["clipfrac"]
                    # Loss parts are already shares of the minibatch loss: summed, not averaged.
                    share = n_tokens / float(token_count) if cfg.loss_aggregation == "token" else len(idx) / len(mb)
                    for key in ("loss/policy", "loss/value"):
                        if key in step_stats:
                            step_stats[key] = step_stats[key] / max(share, 1e-12)
                    stats.add(step_stats, n_tokens)

                minibatches += 1
                mean_ratio = float(ratio_sum / token_count)
                if cfg.ratio_threshold is not None and mean_ratio > cfg.ratio_threshold:
                    # The policy has drifted far from the rollout policy on this minibatch.
                    if cfg.ratio_threshold_action == "skip":
                        for p in policy_params:
                            p.grad = None
                        skipped += 1
                    else:
                        for p in policy_params:
                            if p.grad is not None:
                                p.grad.mul_(cfg.ratio_threshold / mean_ratio)
                        scaled += 1
                policy_norm = torch.nn.utils.clip_grad_norm_(policy_params, cfg.max_grad_norm)
                if value_params:
                    value_norm = torch.nn.utils.clip_grad_norm_(value_params, cfg.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if scheduler is not None:
                    scheduler.step()
    out = stats.means()
    out["policy/grad_norm"] = float(policy_norm)
    if with_critic:
        out["value/grad_norm"] = float(value_norm)
    if cfg.ratio_threshold is not None:
        out["policy/skipped_minibatch_frac"] = skipped / max(1, minibatches)
        out["policy/scaled_minibatch_frac"] = scaled / max(1, minibatches)
    return out


class PPOTrainer:
    """Build every part of a PPO run from a recipe, then `train()`.

    Args:
        recipe: a validated `Recipe`.
        reward_fn: optional Python reward `f(prompts, completions) -> list[float]`; overrides
            the recipe's reward section (handy from Python).
        progress: show a progress bar.
    """

    def __init__(self, recipe: Recipe, reward_fn: Optional[Callable] = None, progress: bool = True):
        from lora_ppo.model import load_base_model, load_tokenizer
        from lora_ppo.rewards import build_reward, build_side_metrics

        self.recipe = recipe
        self.progress = progress
        self.output_dir = Path(recipe.train.output_dir)
        self._check_output_dir()
        seed_everything(recipe.train.seed)

        self.tokenizer = load_tokenizer(recipe.model)
        # Data before weights: a bad dataset fails in seconds, not after loading a model.
        self.train_prompts, self.eval_prompts = load_prompt_sets(recipe.data, self.tokenizer, recipe.train.seed)
        self.reward_fn = reward_fn or build_reward(recipe.reward, recipe.model.trust_remote_code)
        self.side_metrics = build_side_metrics(recipe.reward)
        if not recipe.adapters.reference_enabled:
            log.warning("adapters.reference is 'none': no KL penalty; the policy may drift far from the base model")
        base = load_base_model(recipe.model)
        self.roles = RoleModel(base, recipe.adapters, with_value=recipe.uses_critic)
        self.stream = PromptStream(self.train_prompts.prompts, recipe.train.seed)

        ppo = recipe.ppo
        groups = [{"params": self.roles.policy_parameters(), "lr": ppo.learning_rate}]
        if self.roles.has_value:
            groups.append({"params": self.roles.value_parameters(), "lr": ppo.value_learning_rate or ppo.learning_rate})
        self.optimizer = torch.optim.AdamW(groups, weight_decay=0.0, eps=1e-5)
        updates_per_step = ppo.num_epochs * ppo.num_minibatches
        total_updates = recipe.train.steps * updates_per_step
        if ppo.lr_schedule == "linear":
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda i: max(0.0, 1.0 - i / max(1, total_updates))
            )
        else:
            self.scheduler = None
        self.generator = torch.Generator().manual_seed(recipe.train.seed)
        self.step = 0
        self.kl_coef = ppo.kl_coef  # changes only under the adaptive controller (ppo.target_kl)
        self.score_moments = (0.0, 1.0, 0)  # running (mean, var, count) for ppo.score_norm

    # ---- output files -----------------------------------------------------------------------

    def _check_output_dir(self) -> None:
        if (self.output_dir / METRICS_FILE).exists() and not self.recipe.train.overwrite:
            raise RecipeError(
                f"train.output_dir: {str(self.output_dir)!r} already holds a run; "
                "choose another folder or set train.overwrite=true"
            )

    def _prepare_output_dir(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        for name in (METRICS_FILE, SAMPLES_FILE, SUMMARY_FILE):
            (self.output_dir / name).unlink(missing_ok=True)
        (self.output_dir / RECIPE_FILE).write_text(recipe_to_yaml(self.recipe), encoding="utf-8")

    def _append_jsonl(self, name: str, record: dict) -> None:
        with open(self.output_dir / name, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def save_adapters(self, folder: Path) -> Path:
        """Write policy/ (and value/, with a critic) adapter folders under `folder`, atomically
        (temp + rename)."""
        folder = Path(folder)
        staging = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        self.roles.save_adapter(POLICY, staging / POLICY)
        if self.roles.has_value:
            self.roles.save_adapter(VALUE, staging / VALUE)
        (staging / "trainer_state.json").write_text(json.dumps({"step": self.step}), encoding="utf-8")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
        return folder

    # ---- the loop ---------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Mean held-out score (and side metrics) with a fixed sampling seed."""
        r = self.recipe
        return evaluate_prompts(
            self.roles, self.tokenizer, self.eval_prompts.prompts, r.rollout, self.reward_fn,
            self.side_metrics, r.data.chat_template, seed=r.train.seed,
        )

    def train_step(self) -> tuple[dict[str, float], Rollout]:
        """One PPO iteration: rollout, advantages, update. Returns (metrics, rollout)."""
        r = self.recipe
        t_start = time.perf_counter()
        k = r.rollout.samples_per_prompt
        # Each prompt k times in a row: group baselines (RLOO / GRPO) rely on the grouping.
        prompts = [p for p in self.stream.next_batch(r.rollout.batch_size // k) for _ in range(k)]
        rollout = collect_rollout(
            self.roles, self.tokenizer, prompts, r.rollout, self.reward_fn, self.side_metrics,
            r.data.chat_template, with_values=r.uses_critic, with_reference=r.adapters.reference_enabled,
        )
        mask = rollout.response_mask
        scores = self._shape_scores(rollout.scores, mask.sum(dim=1))
        adv = compute_advantages(rollout, r.ppo, self.kl_coef, scores, k)
        t_update = time.perf_counter()
        update = ppo_update(
            self.roles, self.optimizer, self.scheduler, rollout, adv, r.ppo,
            r.minibatch_size, r.micro_batch_size, r.rollout.temperature,
            r.model.gradient_checkpointing, self.generator, kl_coef=self.kl_coef,
        )
        t_end = time.perf_counter()
        self.step += 1

        kl_per_seq = adv.kl.sum(dim=1)
        n_tokens = int(rollout.attention_mask.sum())
        kl_coef_used = self.kl_coef
        if r.ppo.target_kl is not None:
            self.kl_coef = ppo_math.adaptive_kl_coef(
                self.kl_coef, kl_per_seq.mean().item(), r.ppo.target_kl, r.ppo.kl_horizon, len(prompts)
            )
        metrics: dict[str, float] = {
            "step": self.step,
            "objective/scores": rollout.scores.mean().item(),
            "objective/raw_scores": rollout.raw_scores.mean().item(),
            "objective/shaped_scores": scores.mean().item(),
            "objective/kl": kl_per_seq.mean().item(),
            "objective/kl_coef": kl_coef_used,
            "objective/non_score_reward": (-kl_coef_used * kl_per_seq).mean().item(),
            "objective/rlhf_reward": (rollout.scores - kl_coef_used * kl_per_seq).mean().item(),
            # 1 with the value adapter as critic (GAE); 0 for RLOO / GRPO, which hold no value adapter.
            "algo/critic": float(r.uses_critic),
            **update,
            "response/length": mask.sum(dim=1).float().mean().item(),
            "response/stopped_frac": rollout.stopped.float().mean().item(),
            "lr/policy": self.optimizer.param_groups[0]["lr"],
            **{f"time/{k}": v for k, v in rollout.timings.items()},
            "time/update": t_end - t_update,
            "time/step": t_end - t_start,
            "tokens_per_s": n_tokens / max(t_end - t_start, 1e-9),
            "memory/peak_gb": peak_memory_gb(),
        }
        if r.uses_critic:
            metrics["value/explained_var"] = ppo_math.explained_variance(rollout.values, adv.returns, mask).item()
            metrics["value/mean"] = ppo_math.masked_mean(rollout.values, mask).item()
        for name, values in rollout.side_scores.items():
            metrics[f"objective/{name}"] = sum(values) / len(values)
        return metrics, rollout

    def _shape_scores(self, scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Running normalisation, clipping and length penalty, as the recipe asks."""
        ppo = self.recipe.ppo
        mean = std = None
        if ppo.score_norm:
            self.score_moments = ppo_math.update_running_moments(*self.score_moments, scores)
            mean, std = self.score_moments[0], self.score_moments[1] ** 0.5
        return ppo_math.shape_scores(scores, lengths, ppo.length_penalty, mean, std, ppo.score_clip)

    def train(self) -> dict:
        """Run the whole recipe; returns the summary (also written to summary.json)."""
        from tqdm.auto import tqdm

        r = self.recipe
        self._prepare_output_dir()
        t0 = time.perf_counter()
        dropped = count_summary(self.train_prompts)
        if dropped:
            log.warning("dropped prompts from %s: %s", r.data.source, dropped)
        before = self.evaluate() if r.train.eval and self.eval_prompts.prompts else {}
        bar = tqdm(total=r.train.steps, desc="PPO", disable=not self.progress, dynamic_ncols=True, file=sys.stderr)
        last: dict[str, float] = {}
        try:
            while self.step < r.train.steps:
                last, rollout = self.train_step()
                self._append_jsonl(METRICS_FILE, last)
                if r.train.sample_every and (self.step % r.train.sample_every == 0 or self.step == r.train.steps):
                    for i in range(min(SAMPLES_PER_LOG, len(rollout.prompts))):
                        self._append_jsonl(SAMPLES_FILE, {
                            "step": self.step, "prompt": rollout.prompts[i],
                            "completion": rollout.completions[i], "score": rollout.scores[i].item(),
                        })
                if r.train.save_every and self.step % r.train.save_every == 0 and self.step < r.train.steps:
                    self.save_adapters(self.output_dir / "checkpoints" / f"step-{self.step}")
                bar.update(1)
                bar.set_postfix(score=f"{last['objective/scores']:.3f}", kl=f"{last['objective/kl']:.3f}")
                if self.step % r.train.log_every == 0 and not self.progress:
                    print(
                        f"step {self.step}/{r.train.steps}  score {last['objective/scores']:.3f}  "
                        f"kl {last['objective/kl']:.3f}  {last['time/step']:.1f}s", file=sys.stderr,
                    )
        except KeyboardInterrupt:
            bar.close()
            folder = self.save_adapters(self.output_dir / "interrupted")
            print(f"interrupted at step {self.step}: adapters saved to {folder}", file=sys.stderr)
            raise
        bar.close()
        self.save_adapters(self.output_dir / "final")
        after = self.evaluate() if r.train.eval and self.eval_prompts.prompts else {}
        summary = {
            "steps": self.step,
            "heldout_score_before": before.get("score"),
            "heldout_score_after": after.get("score"),
            **{f"heldout_{k}_before": v for k, v in before.items() if k != "score"},
            **{f"heldout_{k}_after": v for k, v in after.items() if k != "score"},
            "final_kl": last.get("objective/kl"),
            "wall_time_s": time.perf_counter() - t0,
            "peak_memory_gb": peak_memory_gb(),
            "output_dir": str(self.output_dir),
        }
        (self.output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2), encoding="utf-8")
        return summary


def format_summary(summary: dict) -> str:
    """A few human lines for the end of a run."""
    def fmt(x):
        return "n/a" if x is None else f"{x:.3f}"

    lines = [
        f"held-out mean score: {fmt(summary.get('heldout_score_before'))} -> {fmt(summary.get('heldout_score_after'))}",
    ]
    for key in summary:
        if key.startswith("heldout_") and key.endswith("_before") and key != "heldout_score_before":
            name = key[len("heldout_") : -len("_before")]
            lines.append(f"held-out {name}: {fmt(summary[key])} -> {fmt(summary.get(f'heldout_{name}_after'))}")
    lines += [
        f"final KL: {fmt(summary.get('final_kl'))}",
        f"wall time: {summary['wall_time_s']:.0f} s, peak memory: {summary['peak_memory_gb']:.2f} GB",
        f"adapters: {summary['output_dir']}/final/policy and final/value",
    ]
    return "\n".join(lines)
