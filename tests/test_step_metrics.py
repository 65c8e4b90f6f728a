"""One PPO step's record (lora_ppo/metrics.py) from a rollout and advantages written out here, every
number worked by hand: the scores' means, the KL summed per response then averaged, its penalty in
the reward, response lengths, the stopped share, throughput, the critic's numbers, each reward
source's mean."""

from __future__ import annotations

import pytest
import torch

from lora_ppo.metrics import step_metrics
from lora_ppo.update import Advantages, UpdateStats
from tests.test_score_shaping import rollout_of


def record(rollout, kl, *, reward_kl_coef=0.1, returns=None, **kwargs):
    """The step record of `rollout` with per-token KL `kl` (the other advantage tensors are 0)."""
    zeros = torch.zeros_like(kl)
    adv = Advantages(scores=rollout.scores * 2, rewards=zeros, kl=kl, advantages=zeros, returns=returns,
                     reward_kl_coef=reward_kl_coef)
    settings = dict(kl_coef=0.1, skipped=False, consecutive_skips=0, lr=1e-4, update_s=1.5, step_s=4.0,
                    phase_peaks_gb={"generate": 1.25}, perf={"perf/update_tflops": 3.0})
    return step_metrics(7, rollout, adv, UpdateStats(skipped_minibatches=0), **{**settings, **kwargs})


def test_the_scores_kl_and_its_penalty_lengths_and_throughput_by_hand():
    """Two responses of 3 and 1 tokens (of 3), the second not stopped; per-token KL 0.2, 0.3, 0.5
    and 0.4."""
    rollout = rollout_of([1.0, -0.5], lengths=[3, 1], width=3, raw_scores=[2.0, 0.0], stopped=[True, False])
    rollout = type(rollout)(**{**vars(rollout), "timings": {"generate": 2.0}})
    kl = torch.tensor([[0.2, 0.3, 0.5], [0.4, 0.0, 0.0]])
    m = record(rollout, kl, kl_coef=0.07, skipped=True, consecutive_skips=2)

    assert m["step"] == 7
    assert m["objective/scores"] == pytest.approx((1.0 - 0.5) / 2)
    assert m["objective/raw_scores"] == pytest.approx((2.0 + 0.0) / 2)
    assert m["objective/shaped_scores"] == pytest.approx((2.0 - 1.0) / 2)
    assert m["objective/kl"] == pytest.approx((1.0 + 0.4) / 2)  # per response 1.0 and 0.4
    assert m["objective/kl_coef"] == 0.07  # the step's, not the reward's 0.1
    assert m["objective/non_score_reward"] == pytest.approx(-(0.1 * 1.0 + 0.1 * 0.4) / 2)
    assert m["objective/rlhf_reward"] == pytest.approx(((1.0 - 0.1) + (-0.5 - 0.04)) / 2)
    assert (m["guard/skipped"], m["guard/consecutive_skips"]) == (1.0, 2.0)
    assert m["response/length"] == pytest.approx((3 + 1) / 2)
    assert m["response/stopped_frac"] == pytest.approx(0.5)
    assert (m["lr/policy"], m["time/generate"], m["time/update"], m["time/step"]) == (1e-4, 2.0, 1.5, 4.0)
    assert m["tokens_per_s"] == pytest.approx((2 + 4) / 4.0)  # real tokens, the two 1-token prompts included
    assert (m["memory/generate_gb"], m["perf/update_tflops"]) == (1.25, 3.0)
    assert m["algo/critic"] == 1.0 and "value/mean" not in m  # values held, no returns given


def test_a_kl_in_the_loss_adds_no_penalty_to_the_reward():
    rollout = rollout_of([1.0, 3.0], lengths=[2, 2])
    m = record(rollout, torch.tensor([[0.5, 0.5], [1.0, 1.0]]), reward_kl_coef=0.0)
    assert m["objective/kl"] == pytest.approx(1.5)
    assert (m["objective/non_score_reward"], m["objective/rlhf_reward"]) == (0.0, pytest.approx(2.0))


def test_the_critics_numbers_over_real_tokens_only():
    """values 1, 2, 3 | 5 (padding 9, 9), returns 1, 3, 2 | 7: the mean value over the 4 real
    tokens, and the explained variance 1 - Var(returns - values) / Var(returns)."""
    rollout = rollout_of([0.0, 0.0], lengths=[3, 1], width=3)
    rollout = type(rollout)(**{**vars(rollout), "values": torch.tensor([[1.0, 2.0, 3.0], [5.0, 9.0, 9.0]])})
    returns = torch.tensor([[1.0, 3.0, 2.0], [7.0, 0.0, 0.0]])
    m = record(rollout, torch.zeros(2, 3), returns=returns)
    assert m["value/mean"] == pytest.approx((1 + 2 + 3 + 5) / 4)
    errors, targets = [0.0, 1.0, -1.0, 2.0], [1.0, 3.0, 2.0, 7.0]

    def variance(xs):
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / len(xs)

    assert m["value/explained_var"] == pytest.approx(1 - variance(errors) / variance(targets), rel=1e-5)


def test_each_sources_mean_only_when_the_score_mixes_several_and_the_side_scores_always():
    one = rollout_of([1.0, 0.0], source_scores={"vader": [1.0, 0.0]})
    assert "objective/vader" not in record(one, torch.zeros(2, 1))
    mixed = rollout_of([1.0, 0.0], source_scores={"vader": [1.0, 0.5], "length": [0.2, 0.0]})
    mixed = type(mixed)(**{**vars(mixed), "side_scores": {"format": [1.0, 0.0]}})
    m = record(mixed, torch.zeros(2, 1))
    assert (m["objective/vader"], m["objective/length"], m["objective/format"]) == \
        (pytest.approx(0.75), pytest.approx(0.1), pytest.approx(0.5))
    assert "objective/format" in record(type(one)(**{**vars(one), "side_scores": {"format": [1.0, 1.0]}}),
                                        torch.zeros(2, 1))


def test_without_a_critic_the_record_says_so():
    rollout = rollout_of([1.0, 0.0])
    rollout = type(rollout)(**{**vars(rollout), "values": None})
    m = record(rollout, torch.zeros(2, 1))
    assert m["algo/critic"] == 0.0 and "value/explained_var" not in m
