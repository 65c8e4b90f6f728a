"""Hand-computed cases and loop references for the algorithm options: k2, loss aggregation,
dual-clip, KL as a loss, the adaptive KL controller, score shaping, RLOO and GRPO."""

from __future__ import annotations

import math

import pytest
import torch

from lora_ppo.ppo_math import (
    adaptive_kl_coef,
    aggregate_loss,
    group_advantages,
    kl_loss,
    policy_loss,
    shape_scores,
    update_running_moments,
    value_loss,
)

TOL = dict(atol=1e-6, rtol=1e-5)


def t(values):
    return torch.tensor(values, dtype=torch.float64)


MASK = torch.tensor([[True, True, True], [True, False, False]])
PER_TOKEN = t([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])


def test_token_aggregation_weighs_every_token():
    # (1 + 2 + 3 + 4) / 4 real tokens
    assert aggregate_loss(PER_TOKEN, MASK, "token").item() == pytest.approx(2.5)


def test_sequence_aggregation_weighs_every_sequence():
    # mean(1,2,3) = 2 and mean(4) = 4 -> (2 + 4) / 2 sequences
    assert aggregate_loss(PER_TOKEN, MASK, "sequence").item() == pytest.approx(3.0)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_aggregation_adds_up_over_micro_batches(aggregation):
    g = torch.Generator().manual_seed(0)
    per_token = torch.randn(6, 5, generator=g, dtype=torch.float64)
    lengths = torch.tensor([5, 1, 3, 2, 4, 5])
    mask = torch.arange(5)[None, :] < lengths[:, None]
    normalizer = mask.sum() if aggregation == "token" else 6
    whole = aggregate_loss(per_token, mask, aggregation, normalizer)
    parts = sum(aggregate_loss(per_token[i : i + 2], mask[i : i + 2], aggregation, normalizer) for i in (0, 2, 4))
    torch.testing.assert_close(parts, whole, **TOL)


def test_unknown_aggregation():
    with pytest.raises(ValueError, match="median"):
        aggregate_loss(PER_TOKEN, MASK, "median")


def test_dual_clip_caps_negative_advantage_loss():
    # A = -1, ratio = e^2 ~ 7.39: standard PPO loss = max(7.39, 1.2) = 7.39; dual-clip c = 3 caps it at 3.
    new, old, adv, mask = t([[2.0]]), t([[0.0]]), t([[-1.0]]), torch.tensor([[True]])
    plain, _ = policy_loss(new, old, adv, mask, clip_eps=0.2)
    capped, stats = policy_loss(new, old, adv, mask, clip_eps=0.2, dual_clip=3.0)
    assert plain.item() == pytest.approx(math.exp(2.0))
    assert capped.item() == pytest.approx(3.0)
    assert stats["dual_clipfrac"].item() == 1.0


def test_dual_clip_leaves_positive_advantages_and_small_ratios_alone():
    new, old, mask = t([[2.0, 0.1]]), t([[0.0, 0.0]]), torch.tensor([[True, True]])
    adv = t([[1.0, -1.0]])  # positive advantage with a big ratio; negative with a ratio near 1
    plain, _ = policy_loss(new, old, adv, mask, clip_eps=0.2)
    capped, stats = policy_loss(new, old, adv, mask, clip_eps=0.2, dual_clip=3.0)
    # Token 1: A = 1, ratio e^2 clipped to 1.2 -> -1.2; token 2: A = -1, ratio e^0.1 < 1.2 -> e^0.1.
    assert capped.item() == pytest.approx((-1.2 + math.exp(0.1)) / 2)
    torch.testing.assert_close(capped, plain, **TOL)
    assert stats["dual_clipfrac"].item() == 0.0


def test_value_loss_without_clipping():
    # 0.5 * (2 - 0)^2 = 2 although the clipped value (old 0 + 0.2) would give 0.5 * 1.8^2... max -> 2.
    new, old, ret, mask = t([[2.0]]), t([[0.0]]), t([[0.0]]), torch.tensor([[True]])
    clipped, _ = value_loss(new, old, ret, mask, value_clip_eps=0.2)
    plain, stats = value_loss(new, old, ret, mask, value_clip_eps=None)
    assert plain.item() == pytest.approx(2.0)
    assert clipped.item() == pytest.approx(2.0)  # unclipped branch is the max here
    new = t([[-0.5]])
    ret = t([[-1.0]])  # clipped value -0.2 is further from the return: 0.5 * 0.8^2 = 0.32
    assert value_loss(new, old, ret, mask, 0.2)[0].item() == pytest.approx(0.32)
    assert value_loss(new, old, ret, mask, None)[0].item() == pytest.approx(0.125)
    assert stats["clipfrac"].item() == 0.0


def test_kl_loss_k3_hand_case():
    # log r = ref - new = -1 - (-2) = 1: k3 = e^1 - 1 - 1 = 0.71828; two tokens, coef 0.5
    new, ref = t([[-2.0, -2.0]]), t([[-1.0, -1.0]])
    mask = torch.tensor([[True, True]])
    expected = 0.5 * (math.e - 2.0)
    assert kl_loss(new, ref, mask, 0.5, "k3").item() == pytest.approx(expected)
    # its gradient pushes the policy toward the reference: d/d new of 0.5 * mean(e^(ref - new) - 1 - (ref - new))
    # is 0.5 / 2 * (1 - e^1) per token, negative.
    new.requires_grad_(True)
    kl_loss(new, ref, mask, 0.5, "k3").backward()
    torch.testing.assert_close(new.grad, t([[0.25 * (1 - math.e), 0.25 * (1 - math.e)]]), **TOL)


def test_adaptive_kl_controller():
    # KL 2x target: error clipped to +0.2; 64 samples over horizon 640 -> x(1 + 0.02)
    assert adaptive_kl_coef(0.1, 12.0, 6.0, 640, 64) == pytest.approx(0.102)
    # KL half the target: error -0.5 clipped to -0.2 -> x(1 - 0.02)
    assert adaptive_kl_coef(0.1, 3.0, 6.0, 640, 64) == pytest.approx(0.098)
    # within the band: error 0.1 -> x(1 + 0.01)
    assert adaptive_kl_coef(0.1, 6.6, 6.0, 640, 64) == pytest.approx(0.101)
    # a floor stops the fall, not the rise
    assert adaptive_kl_coef(0.1, 3.0, 6.0, 640, 64, floor=0.1) == 0.1
    assert adaptive_kl_coef(0.1, 12.0, 6.0, 640, 64, floor=0.1) == pytest.approx(0.102)


def test_running_moments_match_all_data_at_once():
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(n, generator=g) * 3 + 1 for n in (5, 1, 8, 3)]
    state = (0.0, 1.0, 0)
    for b in batches:
        state = update_running_moments(*state, b)
    everything = torch.cat(batches).double()
    assert state[0] == pytest.approx(everything.mean().item(), abs=1e-9)
    assert state[1] == pytest.approx(everything.var(unbiased=False).item(), abs=1e-9)
    assert state[2] == 17


def test_shape_scores_order_norm_clip_length():
    scores, lengths = t([3.0, -5.0]), torch.tensor([10, 2])
    # normalise by mean 1, std 2 -> [1, -3]; clip 2 -> [1, -2]; minus 0.01 per token -> [0.9, -2.02]
    shaped = shape_scores(scores, lengths, length_penalty=0.01, norm_mean=1.0, norm_std=2.0, clip=2.0)
    torch.testing.assert_close(shaped, t([0.9, -2.02]), **TOL)
    torch.testing.assert_close(shape_scores(scores, lengths), scores, **TOL)


def _rloo_loop(rewards, k):
    out = []
    for i, r in enumerate(rewards):
        group = range((i // k) * k, (i // k) * k + k)
        others = [rewards[j] for j in group if j != i]
        out.append(r - sum(others) / len(others))
    return out


def _grpo_loop(rewards, k, eps=1e-6):
    out = []
    for i, r in enumerate(rewards):
        group = [rewards[j] for j in range((i // k) * k, (i // k) * k + k)]
        mean = sum(group) / k
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (k - 1))
        out.append((r - mean) / (std + eps))
    return out


def test_rloo_hand_case():
    # group (1, 2, 6): 1 - 4 = -3, 2 - 3.5 = -1.5, 6 - 1.5 = 4.5
    torch.testing.assert_close(group_advantages(t([1.0, 2.0, 6.0]), 3, "rloo"), t([-3.0, -1.5, 4.5]), **TOL)


def test_grpo_hand_case():
    # group (1, 3): mean 2, unbiased std sqrt(2)
    expected = t([-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6)])
    torch.testing.assert_close(group_advantages(t([1.0, 3.0]), 2, "grpo"), expected, **TOL)


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
def test_group_advantages_match_loop_reference(k, estimator):
    g = torch.Generator().manual_seed(k)
    rewards = torch.randn(4 * k, generator=g, dtype=torch.float64)
    reference = (_rloo_loop if estimator == "rloo" else _grpo_loop)(rewards.tolist(), k)
    torch.testing.assert_close(group_advantages(rewards, k, estimator), t(reference), **TOL)


def test_group_advantages_depend_only_on_their_group():
    rewards = t([1.0, 2.0, 6.0, 0.0, 0.0, 9.0])
    changed = rewards.clone()
    changed[3:] = t([-7.0, 40.0, 2.0])
    for estimator in ("rloo", "grpo"):
        torch.testing.assert_close(
            group_advantages(rewards, 3, estimator)[:3], group_advantages(changed, 3, estimator)[:3], **TOL
        )


def test_group_advantages_need_two_samples():
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(t([1.0, 2.0]), 1, "rloo")
