"""Hand-computed cases at the edges of ppo_math that the main cases do not reach: one-token
responses, empty rows, the dual-clip cap's value, value clipping around nonzero old values,
small variances and the floors that keep a division finite."""

from __future__ import annotations

import pytest
import torch

from lora_ppo.ppo_math import (
    aggregate_loss,
    explained_variance,
    gae,
    masked_whiten,
    policy_loss,
    shape_scores,
    value_loss,
)
from tests.math.test_ppo_math_options import t

TOL = dict(atol=1e-9, rtol=1e-9)


def test_gae_on_one_token_responses_is_reward_minus_value():
    """T_resp = 1: nothing follows, so A = r - V and the return is r."""
    values, rewards = t([[0.25], [-1.0]]), t([[1.0], [0.5]])
    advantages, returns = gae(values, rewards, torch.tensor([[True], [True]]), gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, t([[0.75], [1.5]]), **TOL)
    torch.testing.assert_close(returns, t([[1.0], [0.5]]), **TOL)


def test_sequence_aggregation_counts_an_empty_response_as_zero_not_nan():
    """A row with no real token (a response cut to nothing) adds 0 to the sum of per-row means."""
    per_token = t([[1.0, 3.0], [5.0, 7.0]])
    mask = torch.tensor([[True, True], [False, False]])
    # row 0: mean 2.0; row 1: 0; over 2 rows -> 1.0
    assert aggregate_loss(per_token, mask, "sequence").item() == pytest.approx(1.0)


@pytest.mark.parametrize("advantage,new,want,capped", [
    (-2.0, 1.5, 6.0, True),   # ratio e^1.5 = 4.48 > c = 3: -A r = 8.96 capped at -c A = 6
    (-0.5, 1.5, 1.5, True),   # -A r = 2.24 capped at 1.5
    (0.5, 1.5, -0.6, False),  # A > 0: clipped at -A (1 + eps) = -0.6, never dual-clipped
])
def test_the_dual_clip_cap_is_minus_c_times_the_advantage(advantage, new, want, capped):
    loss, stats = policy_loss(t([[new]]), t([[0.0]]), t([[advantage]]), torch.tensor([[True]]), clip_eps=0.2,
                              dual_clip=3.0)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert stats["dual_clipfrac"].item() == float(capped)


def test_value_clipping_is_around_each_tokens_old_value():
    """V_clip = V_old + clip(V - V_old, -eps, eps) with V_old != 0, per token:
    token 0: V 2.0, V_old 1.5, R 3.0 -> V_clip 1.7: max(1.0, 1.69) / 2 = 0.845 (clipped)
    token 1: V 0.4, V_old 0.5, R 0.0 -> inside the range: 0.16 / 2 = 0.08
    token 2: V -1.0, V_old -0.2, R -2.0 -> V_clip -0.4: max(1.0, 2.56) / 2 = 1.28 (clipped)"""
    mask = torch.tensor([[True, True, True]])
    loss, stats = value_loss(t([[2.0, 0.4, -1.0]]), t([[1.5, 0.5, -0.2]]), t([[3.0, 0.0, -2.0]]), mask,
                             value_clip_eps=0.2)
    assert loss.item() == pytest.approx((0.845 + 0.08 + 1.28) / 3, rel=1e-12)
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)


def test_explained_variance_with_a_variance_below_one():
    """Returns [0, 0.5, 1] (unbiased variance 0.25), values off by [0.1, -0.1, 0]: residual
    variance 0.01, so 1 - 0.01 / 0.25 = 0.96."""
    returns, values = t([[0.0, 0.5, 1.0]]), t([[-0.1, 0.6, 1.0]])
    out = explained_variance(values, returns, torch.tensor([[True, True, True]]))
    assert out.item() == pytest.approx(0.96, rel=1e-12)


def test_whitening_a_batch_whose_variance_is_the_epsilon():
    """x / sqrt(var + 1e-8) with an unbiased variance of exactly 1e-8: [0, d] with d = sqrt(2e-8)
    has mean d/2, variance d^2/2 = 1e-8, so the whitened values are (-d/2, d/2) / d = (-0.5, 0.5)."""
    d = 2e-8 ** 0.5
    out = masked_whiten(t([[0.0, d]]), torch.tensor([[True, True]]))
    torch.testing.assert_close(out, t([[-0.5, 0.5]]), atol=1e-7, rtol=0)


def test_score_normalisation_floors_a_tiny_std_at_1e_minus_4():
    """A running std of 1e-6 (scores that barely moved) divides by the floor sqrt(1e-8) = 1e-4."""
    out = shape_scores(t([1.0, 1.0002]), t([0.0, 0.0]), norm_mean=1.0001, norm_std=1e-6)
    torch.testing.assert_close(out, t([-1.0, 1.0]), atol=1e-6, rtol=0)


def test_score_normalisation_needs_both_the_mean_and_the_std():
    scores = t([1.0, 3.0])
    torch.testing.assert_close(shape_scores(scores, t([0.0, 0.0]), norm_mean=2.0, norm_std=None), scores, **TOL)
