"""check/kl_noise_floor: how far sampling (a KV-cached decode) and scoring (a full forward) round
apart on the sampled tokens, summed over a response: the size below which a KL per response is
rounding (bf16 on a GPU read -0.1 to -0.2 nats per response for a policy next to its reference)."""

from __future__ import annotations

import pytest
import torch

import lora_ppo
from lora_ppo.metrics import step_metrics
from lora_ppo.update import UpdateStats, compute_advantages
from lora_ppo.config import PPOConfig, recipe_from_dict
from tests.conftest import tiny_recipe_dict
from tests.test_score_shaping import rollout_of


def test_the_floor_is_the_mean_gap_times_the_response_length_by_hand():
    rollout = rollout_of([1.0, 0.0], lengths=[3, 1], width=3)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, 9.0, 9.0]])  # 9.0: padding, never read
    generation = torch.tensor([[-1.1, -2.0, -0.2], [-3.2, 0.0, 0.0]])
    rollout = type(rollout)(**{**vars(rollout), "old_logprobs": old, "ref_logprobs": old,
                               "generation_logprobs": generation})
    adv = compute_advantages(rollout, PPOConfig(), 0.05, rollout.scores)
    metrics = step_metrics(1, rollout, adv, UpdateStats(skipped_minibatches=0), kl_coef=0.05, skipped=False,
                           consecutive_skips=0, lr=1e-4, update_s=1.0, step_s=1.0, phase_peaks_gb={}, perf={})
    gap = (0.1 + 0.0 + 0.3 + 0.2) / 4  # the four real tokens
    assert metrics["check/generation_logprob_diff"] == pytest.approx(gap)
    assert metrics["check/kl_noise_floor"] == pytest.approx(gap * (3 + 1) / 2)  # mean response length 2


def test_the_floor_of_a_step_whose_responses_are_all_empty_is_zero():
    rollout = rollout_of([1.0, 0.0], lengths=[0, 0], width=1)
    rollout = type(rollout)(**{**vars(rollout), "generation_logprobs": torch.ones(2, 1)})
    adv = compute_advantages(rollout, PPOConfig(), 0.05, rollout.scores)
    metrics = step_metrics(1, rollout, adv, UpdateStats(skipped_minibatches=0), kl_coef=0.05, skipped=False,
                           consecutive_skips=0, lr=1e-4, update_s=1.0, step_s=1.0, phase_peaks_gb={}, perf={})
    assert (metrics["check/generation_logprob_diff"], metrics["check/kl_noise_floor"]) == (0.0, 0.0)


@pytest.mark.parametrize("from_generation", [False, True])
def test_a_run_logs_the_floor_where_a_scoring_pass_makes_the_old_logprobs(tmp_path, tiny_model_dir, from_generation):
    recipe = recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / "run", train={"steps": 1, "eval": False},
                                               rollout={"logprobs_from_generation": from_generation}))
    metrics, rollout = lora_ppo.PPOTrainer(recipe, progress=False).train_step()
    if from_generation:  # the old logprobs are generation's: nothing to compare
        assert rollout.generation_logprobs is None and "check/kl_noise_floor" not in metrics
        return
    # float32 on CPU: the two paths agree to ~1e-5 per token (docs/monitoring.md), never exactly 0
    # nor far apart.
    assert 0 < metrics["check/generation_logprob_diff"] < 1e-4
    assert metrics["check/kl_noise_floor"] == pytest.approx(
        metrics["check/generation_logprob_diff"] * metrics["response/length"])
