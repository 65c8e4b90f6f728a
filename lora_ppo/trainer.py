"""The PPO loop: rollout -> KL-shaped rewards -> GAE -> clipped updates, with logging,
samples, evaluation and saving. Sole owner of the optimizer, scheduler and step counter.
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from lora_ppo import checkpoint, ppo_math
from lora_ppo.config import PPOConfig, Recipe, recipe_to_yaml, resume_differences
from lora_ppo.data import PromptStream, count_summary, load_prompt_sets
from lora_ppo.errors import RecipeError
from lora_ppo.memory import PhasePeaks, run_peak_gb
from lora_ppo.model import compute_dtype, dequantized_4bit_layers
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
    nonfinite: list[str] = []  # minibatches dropped by the NaN/inf guard, by quantity
    policy_norm = value_norm = torch.zeros(())
    with roles.gradient_checkpointing(gradient_checkpointing):
        for _epoch in range(cfg.num_epochs):
            order = torch.randperm(batch, generator=generator).to(input_ids.device)
            for mb_start in range(0, batch, minibatch_size):
                mb = order[mb_start : mb_start + minibatch_size]
                token_count = mask[mb].sum().clamp(min=1)
                normalizer = token_count if cfg.loss_aggregation == "token" else len(mb)
                ratio_sum = torch.zeros(())
                bad: Optional[str] = None
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
                    if bad is None and not torch.isfinite(loss.detach()):
                        bad = "loss/policy"
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
                        if bad is None and not torch.isfinite(vf_loss.detach()):
                            bad = "loss/value"
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
                if bad is None and not torch.isfinite(policy_norm):
                    bad = "policy/grad_norm"
                if bad is None and value_params and not torch.isfinite(value_norm):
                    bad = "value/grad_norm"
                if bad is not None:
                    # A NaN/inf anywhere in this minibatch: drop its gradients, leave the adapters
                    # and the optimizer moments as they were.
                    optimizer.zero_grad(set_to_none=True)
                    nonfinite.append(bad)
                    if scheduler is not None:
                        scheduler.step()
                    continue
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if scheduler is not None:
                    scheduler.step()
    out = stats.means()
    out["guard/skipped_minibatches"] = float(len(nonfinite))
    if nonfinite:
        out["guard/quantity"] = nonfinite[0]
    out["policy/grad_norm"] = float(policy_norm)
    if with_critic:
        out["value/grad_norm"] = float(value_norm)
    if cfg.ratio_threshold is not None:
        out["policy/skipped_minibatch_frac"] = skipped / max(1, minibatches)
        out["policy/scaled_minibatch_frac"] = scaled / max(1, minibatches)
    return out


def first_nonfinite(rollout: Rollout, adv: Advantages) -> Optional[str]:
    """The name of the first rollout or advantage quantity holding a NaN/inf on a real token
    (padding may hold anything), or None when all are finite."""
    mask = rollout.response_mask
    per_sequence = {"rewards/scores": rollout.scores, "rewards/shaped_scores": adv.scores}
    per_token = {
        "logprobs/old": rollout.old_logprobs, "logprobs/ref": rollout.ref_logprobs, "values": rollout.values,
        "rewards/per_token": adv.rewards, "advantages": adv.advantages, "returns": adv.returns,
    }
    for name, tensor in per_sequence.items():
        if not torch.isfinite(tensor).all():
            return name
    for name, tensor in per_token.items():
        if tensor is not None and not torch.isfinite(tensor[mask]).all():
            return name
    return None


class TrainingHalted(RuntimeError):
    """Too many updates in a row were skipped for NaN/inf; a checkpoint was saved first."""


class PPOTrainer:
    """Build every part of a PPO run from a recipe, then `train()`.

    Args:
        recipe: a validated `Recipe`.
        reward_fn: optional Python reward `f(prompts, completions) -> list[float]`; overrides
            the recipe's reward section (handy from Python).
        progress: show a progress bar.
        resume: "auto" (the newest complete checkpoint under output_dir/checkpoints/) or a
            checkpoint folder, to continue a run exactly where that checkpoint left it.
    """

    def __init__(
        self, recipe: Recipe, reward_fn: Optional[Callable] = None, progress: bool = True,
        resume: Optional[str | Path] = None,
    ):
        from lora_ppo.model import load_base_model, load_tokenizer
        from lora_ppo.rewards import build_reward, build_side_metrics

        self.recipe = recipe
        self.recipe_yaml = recipe_to_yaml(recipe)
        self.progress = progress
        self.output_dir = Path(recipe.train.output_dir)
        self.resume_from: Optional[Path] = None
        if resume is not None:
            self.resume_from = checkpoint.resolve_resume(self.output_dir, resume)
            self._check_resumable_recipe()
        else:
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
        self.last_bad = ""
        self.consecutive_skips = 0  # steps in a row whose update the NaN/inf guard skipped
        self.eval_before: Optional[dict[str, float]] = None
        self.last_metrics: dict = {}
        self.resume_lines: Optional[tuple[int, int]] = None  # (metrics, samples) lines to keep
        self._stop_requested = False
        if self.resume_from is not None:
            checkpoint.load_checkpoint(self, self.resume_from)
            log.info("resuming from %s (step %d)", self.resume_from, self.step)

    # ---- output files -----------------------------------------------------------------------

    def _check_output_dir(self) -> None:
        if (self.output_dir / METRICS_FILE).exists() and not self.recipe.train.overwrite:
            raise RecipeError(
                f"train.output_dir: {str(self.output_dir)!r} already holds a run; "
                "choose another folder or set train.overwrite=true"
            )

    def _check_resumable_recipe(self) -> None:
        """Refuse a resume whose recipe changes anything a step computes (model, adapters, sizes)."""
        import yaml

        run_dir = self.resume_from.parent.parent
        saved_path = run_dir / RECIPE_FILE
        if not saved_path.is_file():
            raise RecipeError(f"--resume: {saved_path} is missing; cannot check the recipe matches")
        saved = yaml.safe_load(saved_path.read_text(encoding="utf-8"))
        differences = resume_differences(saved, self.recipe)
        if differences:
            raise RecipeError(
                f"--resume: the recipe differs from the run's {saved_path} in fields a resumed run cannot "
                f"change: {', '.join(differences)}"
            )

    def _prepare_output_dir(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if self.resume_lines is not None:
            # Lines a killed run wrote after its last checkpoint are replayed by the resumed run.
            for name, keep in zip((METRICS_FILE, SAMPLES_FILE), self.resume_lines):
                _truncate_lines(self.output_dir / name, keep)
            (self.output_dir / SUMMARY_FILE).unlink(missing_ok=True)
        else:
            for name in (METRICS_FILE, SAMPLES_FILE, SUMMARY_FILE):
                (self.output_dir / name).unlink(missing_ok=True)
        (self.output_dir / RECIPE_FILE).write_text(self.recipe_yaml, encoding="utf-8")

    def save_checkpoint(self) -> Path:
        """A full-state checkpoint at checkpoints/step-N/ (keeping the newest train.keep_last)."""
        folder = self.output_dir / checkpoint.CHECKPOINTS_DIR / f"step-{self.step}"
        return checkpoint.save_checkpoint(self, folder, keep_last=self.recipe.train.keep_last)

    @contextmanager
    def _stop_signals(self) -> Iterator[None]:
        """Ctrl-C / SIGTERM: the first finishes the current step, then saves and stops; a second
        abandons the step at once (the newest checkpoint is then the place to resume from)."""
        import signal

        def handler(signum, frame):
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True
            print("\nstopping after this step to save a checkpoint (again to abandon the step)", file=sys.stderr)

        previous = {}
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def _append_jsonl(self, name: str, record: dict) -> None:
        with open(self.output_dir / name, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def save_adapters(self, folder: Path) -> Path:
        """Write policy/ (and value/, with a critic) adapter folders under `folder`, atomically."""
        return checkpoint.save_final_adapters(self, folder)

    # ---- the loop ---------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Mean held-out score (and side metrics) with a fixed sampling seed."""
        r = self.recipe
        rollout_cfg = r.rollout
        if r.data.eval_batch_size is not None:
            rollout_cfg = rollout_cfg.model_copy(update={"batch_size": r.data.eval_batch_size})
        with self.dequantized_once():
            return evaluate_prompts(
                self.roles, self.tokenizer, self.eval_prompts.prompts, rollout_cfg, self.reward_fn,
                self.side_metrics, r.data.chat_template, seed=r.train.seed,
                samples_per_prompt=r.data.eval_samples_per_prompt,
            )

    def dequantized_once(self):
        """With `model.dequantize_per_step`, the 4-bit layers dequantized once for the duration
        (each training step and each evaluation run inside one; a nullcontext otherwise)."""
        if not self.recipe.model.dequantize_per_step:
            return nullcontext()
        return dequantized_4bit_layers(self.roles.peft, compute_dtype(self.recipe.model))

    def train_step(self) -> tuple[dict[str, float], Rollout]:
        """One PPO iteration: rollout, advantages, update. Returns (metrics, rollout)."""
        with self.dequantized_once():
            return self._train_step()

    def _train_step(self) -> tuple[dict[str, float], Rollout]:
        r = self.recipe
        t_start = time.perf_counter()
        k = r.rollout.samples_per_prompt
        # Each prompt k times in a row: group baselines (RLOO / GRPO) rely on the grouping.
        prompts = [p for p in self.stream.next_batch(r.rollout.batch_size // k) for _ in range(k)]
        peaks = PhasePeaks()
        rollout = collect_rollout(
            self.roles, self.tokenizer, prompts, r.rollout, self.reward_fn, self.side_metrics,
            r.data.chat_template, with_values=r.uses_critic, with_reference=r.adapters.reference_enabled,
            peaks=peaks,
        )
        mask = rollout.response_mask
        moments = self.score_moments
        scores = self._shape_scores(rollout.scores, mask.sum(dim=1))
        adv = compute_advantages(rollout, r.ppo, self.kl_coef, scores, k)
        bad = first_nonfinite(rollout, adv)
        t_update = time.perf_counter()
        if bad is None:
            with peaks.phase("update"):
                update = ppo_update(
                    self.roles, self.optimizer, self.scheduler, rollout, adv, r.ppo,
                    r.minibatch_size, r.micro_batch_size, r.rollout.temperature,
                    r.model.gradient_checkpointing, self.generator, kl_coef=self.kl_coef,
                )
            bad = update.pop("guard/quantity", None)
        else:
            # The whole update is skipped: the adapters, the optimizer and the running score
            # moments stay as they were; the lr schedule still counts the updates.
            self.score_moments = moments
            updates = r.ppo.num_epochs * r.ppo.num_minibatches
            update = {"guard/skipped_minibatches": float(updates)}
            if self.scheduler is not None:
                for _ in range(updates):
                    self.scheduler.step()
        t_end = time.perf_counter()
        self.step += 1
        if bad is None:
            self.consecutive_skips = 0
        else:
            self.consecutive_skips += 1
            self.last_bad = f"non-finite {bad} at step {self.step}"
            log.warning(
                "step %d: non-finite %s, update skipped (%d in a row, limit %d)",
                self.step, bad, self.consecutive_skips, r.train.max_consecutive_skips,
            )

        kl_per_seq = adv.kl.sum(dim=1)
        n_tokens = int(rollout.attention_mask.sum())
        kl_coef_used = self.kl_coef
        if r.ppo.target_kl is not None and bad is None:
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
            "guard/skipped": float(bad is not None),
            "guard/consecutive_skips": float(self.consecutive_skips),
            **update,
            "response/length": mask.sum(dim=1).float().mean().item(),
            "response/stopped_frac": rollout.stopped.float().mean().item(),
            "lr/policy": self.optimizer.param_groups[0]["lr"],
            **{f"time/{k}": v for k, v in rollout.timings.items()},
            "time/update": t_end - t_update,
            "time/step": t_end - t_start,
            "tokens_per_s": n_tokens / max(t_end - t_start, 1e-9),
            "memory/peak_gb": run_peak_gb(),
            # Per phase: GPU max_memory_allocated, or the CPU process's peak resident memory.
            **{f"memory/{name}_gb": gb for name, gb in peaks.peaks_gb.items()},
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
        if self.eval_before is None:
            # A resumed run reuses the evaluation its first part made, so its summary matches.
            self.eval_before = self.evaluate() if r.train.eval and self.eval_prompts.prompts else {}
        before = self.eval_before
        bar = tqdm(total=r.train.steps, initial=self.step, desc="PPO", disable=not self.progress,
                   dynamic_ncols=True, file=sys.stderr)
        try:
            with self._stop_signals():
                while self.step < r.train.steps:
                    self._one_step(bar)
        finally:
            bar.close()
        last = self.last_metrics
        self.save_adapters(self.output_dir / "final")
        after = self.evaluate() if r.train.eval and self.eval_prompts.prompts else {}
        summary = {
            "steps": self.step,
            "heldout_score_before": before.get("score"),
            "heldout_score_after": after.get("score"),
            "heldout_score_se_before": before.get("score_se"),
            "heldout_score_se_after": after.get("score_se"),
            **{f"heldout_{k}_before": v for k, v in before.items() if k not in ("score", "score_se")},
            **{f"heldout_{k}_after": v for k, v in after.items() if k not in ("score", "score_se")},
            "final_kl": last.get("objective/kl"),
            "wall_time_s": time.perf_counter() - t0,
            "peak_memory_gb": run_peak_gb(),
            "output_dir": str(self.output_dir),
        }
        (self.output_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2), encoding="utf-8")
        return summary

    def _one_step(self, bar) -> None:
        """One step with its logging, samples, guard and checkpoint."""
        r = self.recipe
        last, rollout = self.train_step()
        self.last_metrics = last
        self._append_jsonl(METRICS_FILE, last)
        if r.train.sample_every and (self.step % r.train.sample_every == 0 or self.step == r.train.steps):
            for i in range(min(SAMPLES_PER_LOG, len(rollout.prompts))):
                self._append_jsonl(SAMPLES_FILE, {
                    "step": self.step, "prompt": rollout.prompts[i],
                    "completion": rollout.completions[i], "score": rollout.scores[i].item(),
                })
        if self.consecutive_skips >= r.train.max_consecutive_skips:
            # Skipped updates left the adapters and optimizer moments at the last good update.
            folder = self.save_checkpoint()
            raise TrainingHalted(
                f"step {self.step}: {self.consecutive_skips} updates in a row skipped for NaN/inf "
                f"({self.last_bad}); the last good state is saved in {folder}"
            )
        if r.train.save_every and self.step % r.train.save_every == 0 and self.step < r.train.steps:
            self.save_checkpoint()
        bar.update(1)
        bar.set_postfix(score=f"{last['objective/scores']:.3f}", kl=f"{last['objective/kl']:.3f}")
        if self.step % r.train.log_every == 0 and not self.progress:
            print(
                f"step {self.step}/{r.train.steps}  score {last['objective/scores']:.3f}  "
                f"kl {last['objective/kl']:.3f}  {last['time/step']:.1f}s", file=sys.stderr,
            )
        if self._stop_requested:
            folder = self.save_checkpoint()
            print(f"interrupted at step {self.step}: checkpoint saved to {folder}", file=sys.stderr)
            raise KeyboardInterrupt


def _truncate_lines(path: Path, keep: int) -> None:
    """Keep the first `keep` lines of a text file (a missing file stays missing)."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        lines = f.readlines()[:keep]
    with open(path, "wb") as f:
        f.writelines(lines)


def format_summary(summary: dict) -> str:
    """A few human lines for the end of a run."""
    def fmt(x):
        return "n/a" if x is None else f"{x:.3f}"

    def with_se(when: str) -> str:
        se = summary.get(f"heldout_score_se_{when}")
        return fmt(summary.get(f"heldout_score_{when}")) + ("" if se is None else f" (± {se:.3f})")

    lines = [f"held-out mean score: {with_se('before')} -> {with_se('after')}"]
    for key in summary:
        if (key.startswith("heldout_") and key.endswith("_before")
                and key not in ("heldout_score_before", "heldout_score_se_before")):
            name = key[len("heldout_") : -len("_before")]
            lines.append(f"held-out {name}: {fmt(summary[key])} -> {fmt(summary.get(f'heldout_{name}_after'))}")
    lines += [
        f"final KL: {fmt(summary.get('final_kl'))}",
        f"wall time: {summary['wall_time_s']:.0f} s, peak memory: {summary['peak_memory_gb']:.2f} GB",
        f"adapters: {summary['output_dir']}/final/policy and final/value",
    ]
    return "\n".join(lines)
