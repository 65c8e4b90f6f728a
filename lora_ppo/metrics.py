"""The per-step metrics record written to metrics.jsonl, under grouped names
(`objective/`, `policy/`, `value/`, `response/`, `time/`, `memory/`, `perf/`, `guard/`)."""

from __future__ import annotations

from typing import Optional

from lora_ppo import ppo_math
from lora_ppo.config import Recipe
from lora_ppo.memory import run_peak_gb
from lora_ppo.perf import ModelFlops, StepWork, current_device_peak_tflops
from lora_ppo.roles import POLICY, REFERENCE, VALUE, RoleModel
from lora_ppo.rollout import Rollout
from lora_ppo.update import Advantages, UpdateStats


def step_metrics(
    step: int,
    rollout: Rollout,
    adv: Advantages,
    update: UpdateStats,
    *,
    kl_coef: float,
    skipped: bool,
    consecutive_skips: int,
    lr: float,
    update_s: float,
    step_s: float,
    phase_peaks_gb: dict[str, float],
    perf: dict[str, float],
) -> dict[str, float]:
    """One step's record. `kl_coef` is the coefficient the step used (the controller may have
    moved it since); the KL penalty counts in the reward only when it is a reward term."""
    mask = rollout.response_mask
    kl_per_seq = adv.kl.sum(dim=1)  # [B]
    kl_penalty = adv.reward_kl_coef * kl_per_seq  # [B], 0 when the KL is a loss term instead
    metrics: dict[str, float] = {
        "step": step,
        "objective/scores": rollout.scores.mean().item(),
        "objective/raw_scores": rollout.raw_scores.mean().item(),
        "objective/shaped_scores": adv.scores.mean().item(),
        "objective/kl": kl_per_seq.mean().item(),
        "objective/kl_coef": kl_coef,
        "objective/non_score_reward": (-kl_penalty).mean().item(),
        "objective/rlhf_reward": (rollout.scores - kl_penalty).mean().item(),
        # 1 with the value adapter as critic (GAE); 0 for RLOO / GRPO, which hold no value adapter.
        "algo/critic": float(rollout.values is not None),
        "guard/skipped": float(skipped),
        "guard/consecutive_skips": float(consecutive_skips),
        **update.as_metrics(),
        "response/length": mask.sum(dim=1).float().mean().item(),
        "response/stopped_frac": rollout.stopped.float().mean().item(),
        "lr/policy": lr,
        **{f"time/{name}": seconds for name, seconds in rollout.timings.items()},
        "time/update": update_s,
        "time/step": step_s,
        "tokens_per_s": int(rollout.attention_mask.sum()) / max(step_s, 1e-9),
        "memory/peak_gb": run_peak_gb(),
        # Per phase: GPU max_memory_allocated, or the CPU process's peak resident memory.
        **{f"memory/{name}_gb": gb for name, gb in phase_peaks_gb.items()},
        # Achieved TFLOP/s per phase (and the share of the device's peak where it is known).
        **perf,
        **rollout.episode_metrics,
    }
    if rollout.generation_logprobs is not None:
        # Sampling and scoring are two numerical paths (a KV-cached decode and a full forward): in
        # bf16 they round apart. Summed over a response, that gap is the size below which a KL
        # per response is rounding, not the policy moving (negative ones included).
        gap = (rollout.generation_logprobs - rollout.old_logprobs).abs()[mask]
        metrics["check/generation_logprob_diff"] = gap.mean().item() if gap.numel() else 0.0
        metrics["check/kl_noise_floor"] = metrics["check/generation_logprob_diff"] * metrics["response/length"]
    if adv.returns is not None:
        metrics["value/explained_var"] = ppo_math.explained_variance(rollout.values, adv.returns, mask).item()
        metrics["value/mean"] = ppo_math.masked_mean(rollout.values, mask).item()
    # Each reward source's own mean, when the score mixes several; the side metrics always.
    sources = rollout.source_scores if len(rollout.source_scores) > 1 else {}
    for name, values in {**sources, **rollout.side_scores}.items():
        metrics[f"objective/{name}"] = sum(values) / len(values)
    return metrics


def step_work(recipe: Recipe, roles: RoleModel, logprobs_from_generation: bool, processes: int) -> StepWork:
    """What each phase of this run's steps computes, for `perf/*`: the roles scored (and whether
    each reads logprobs), the update's epochs and roles, and the device's peak."""
    scored: dict[Optional[str], bool] = {}
    if not logprobs_from_generation:
        scored[POLICY] = True
    if recipe.adapters.reference_enabled:
        scored[REFERENCE if roles.reference_adapter else None] = True
    if recipe.uses_critic:
        scored[VALUE] = False
    return StepWork(ModelFlops.of(roles.peft, roles.lm_head), scored, recipe.ppo.num_epochs, recipe.uses_critic,
                    recipe.model.gradient_checkpointing, current_device_peak_tflops(roles.lm_head.weight.device),
                    processes)
