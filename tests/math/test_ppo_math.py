"""Hand-computed cases, padding invariance and gradient accumulation for `lora_ppo.ppo_math`."""

from __future__ import annotations

import math

import pytest
import torch

from lora_ppo.ppo_math import (
    WHITEN_EPS,
    explained_variance,
    gae,
    kl_estimate,
    kl_shaped_rewards,
    last_token_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    value_loss,
)

NAN = float("nan")
INF = float("inf")
TOL = dict(atol=1e-6, rtol=1e-5)
EXACT = dict(atol=0.0, rtol=0.0)
# What padding may hold after a careless producer: none of it may reach a real position.
GARBAGE = [NAN, INF, -INF, 1e30, -1e30]


def t64(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def mask_of(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


def random_lengths(generator: torch.Generator, B: int, T: int) -> list[int]:
    # Lengths 1..T, with the two extremes always present.
    lengths = torch.randint(1, T + 1, (B,), generator=generator).tolist()
    lengths[0], lengths[-1] = 1, T
    return lengths


def fill_padding(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    return torch.where(mask, x, torch.full_like(x, value))


# ---------------------------------------------------------------------------------------------
# masked reductions


def test_masked_sum_ignores_padding_even_nan_and_inf():
    values = t64([[1.0, 2.0, NAN], [4.0, INF, -INF]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    torch.testing.assert_close(masked_sum(values, mask), t64(7.0), **EXACT)


def test_masked_sum_empty_mask_is_zero():
    values = t64([[NAN, 1.0]])
    torch.testing.assert_close(masked_sum(values, torch.zeros(1, 2, dtype=torch.bool)), t64(0.0), **EXACT)


def test_masked_mean_hand_case_and_empty():
    values = t64([[1.0, 2.0, NAN], [4.0, INF, 5.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    torch.testing.assert_close(masked_mean(values, mask), t64(7.0 / 3.0), **TOL)
    empty = torch.zeros_like(mask)
    out = masked_mean(values, empty)
    assert torch.isfinite(out)
    torch.testing.assert_close(out, t64(0.0), **EXACT)


def test_masked_var_hand_case_unbiased():
    # Real values 1, 2, 4: mean 7/3, squared deviations 16/9 + 1/9 + 25/9 = 14/3, / (3 - 1) = 7/3.
    values = t64([[1.0, 2.0, NAN], [4.0, INF, 100.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    torch.testing.assert_close(masked_var(values, mask), t64(7.0 / 3.0), **TOL)


@pytest.mark.parametrize("n_valid", [0, 1])
def test_masked_var_fewer_than_two_is_zero(n_valid):
    values = t64([[3.0, NAN, INF]])
    mask = torch.tensor([[True, False, False]]) if n_valid else torch.zeros(1, 3, dtype=torch.bool)
    out = masked_var(values, mask)
    torch.testing.assert_close(out, t64(0.0), **EXACT)


def test_masked_whiten_hand_case():
    values = t64([[1.0, 2.0, NAN], [4.0, INF, 9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    std = math.sqrt(7.0 / 3.0 + WHITEN_EPS)
    expected = t64([[(1 - 7 / 3) / std, (2 - 7 / 3) / std, 0.0], [(4 - 7 / 3) / std, 0.0, 0.0]])
    torch.testing.assert_close(masked_whiten(values, mask), expected, **TOL)
    expected_no_shift = torch.where(mask, expected + 7.0 / 3.0, torch.zeros_like(expected))
    torch.testing.assert_close(masked_whiten(values, mask, shift_mean=False), expected_no_shift, **TOL)


def test_masked_whiten_gives_zero_mean_unit_variance_on_real_tokens():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(5, 9, generator=g, dtype=torch.float64) * 3 + 7
    mask = mask_of(random_lengths(g, 5, 9), 9)
    out = masked_whiten(values, mask)
    torch.testing.assert_close(masked_mean(out, mask), t64(0.0), **TOL)
    torch.testing.assert_close(masked_var(out, mask), t64(1.0), **TOL)
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_single_valid_entry_has_no_nan(shift_mean):
    values = t64([[5.0, NAN, INF], [-INF, 1e30, 2.0]])
    mask = torch.tensor([[True, False, False], [False, False, False]])
    out = masked_whiten(values, mask, shift_mean=shift_mean)
    assert torch.isfinite(out).all()
    expected = t64([[0.0 if shift_mean else 5.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected, **EXACT)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_no_valid_entries_is_all_zero(shift_mean):
    values = t64([[5.0, NAN, INF]])
    out = masked_whiten(values, torch.zeros(1, 3, dtype=torch.bool), shift_mean=shift_mean)
    torch.testing.assert_close(out, torch.zeros_like(values), **EXACT)


def test_masked_whiten_two_equal_entries_has_no_nan():
    # Variance exactly 0: the epsilon keeps the division finite.
    values = t64([[2.0, 2.0, NAN]])
    mask = torch.tensor([[True, True, False]])
    out = masked_whiten(values, mask)
    torch.testing.assert_close(out, torch.zeros_like(values), **EXACT)


# ---------------------------------------------------------------------------------------------
# KL estimates


def test_kl_estimate_k1_and_k3_hand_case():
    # p = 0.5 and p_ref = 0.25, then p = 0.25 and p_ref = 0.5; r = p_ref / p is 0.5, then 2.
    logprobs = t64([[math.log(0.5), math.log(0.25)]])
    ref = t64([[math.log(0.25), math.log(0.5)]])
    torch.testing.assert_close(kl_estimate(logprobs, ref, "k1"), t64([[math.log(2.0), -math.log(2.0)]]), **TOL)
    k3_expected = t64([[(0.5 - 1.0) - math.log(0.5), (2.0 - 1.0) - math.log(2.0)]])
    torch.testing.assert_close(kl_estimate(logprobs, ref, "k3"), k3_expected, **TOL)


def test_kl_estimate_equal_logprobs_is_zero():
    x = t64([[-1.0, -2.5, -0.1]])
    torch.testing.assert_close(kl_estimate(x, x.clone(), "k1"), torch.zeros_like(x), **EXACT)
    torch.testing.assert_close(kl_estimate(x, x.clone(), "k3"), torch.zeros_like(x), **EXACT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", [1e-9, 1e-6, 1e-3, 1.0, 10.0])
def test_kl_estimate_k3_is_nonnegative(dtype, scale):
    g = torch.Generator().manual_seed(1)
    logprobs = torch.randn(4000, generator=g, dtype=torch.float64).to(dtype) * scale
    ref = torch.randn(4000, generator=g, dtype=torch.float64).to(dtype) * scale
    k3 = kl_estimate(logprobs, ref, "k3")
    assert torch.isfinite(k3).all()
    assert (k3 >= 0).all()
    # And k1 does go negative somewhere (it is only unbiased, not pointwise positive).
    assert (kl_estimate(logprobs, ref, "k1") < 0).any()


def test_kl_estimate_k3_matches_its_formula():
    g = torch.Generator().manual_seed(2)
    logprobs = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 4
    r = torch.exp(ref) / torch.exp(logprobs)
    torch.testing.assert_close(kl_estimate(logprobs, ref, "k3"), (r - 1) - torch.log(r), **TOL)


def test_kl_estimate_k2_matches_its_formula():
    # k2 = (log r)^2 / 2 with r = p_ref / p: log r = -0.5 - (-1.5) = 1.0 -> 0.5; log r = -2 -> 2.0
    torch.testing.assert_close(kl_estimate(t64([-1.5, -0.5]), t64([-0.5, -2.5]), "k2"), t64([0.5, 2.0]), **TOL)


def test_kl_estimate_unknown_estimator_raises():
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(t64([0.0]), t64([0.0]), "k4")


# ---------------------------------------------------------------------------------------------
# last_token_index and shaped rewards


def test_last_token_index():
    mask = torch.tensor(
        [[True, True, True], [True, False, False], [False, False, False], [True, True, False]]
    )
    assert last_token_index(mask).tolist() == [2, 0, -1, 1]


def test_kl_shaped_rewards_hand_case_k1():
    scores = t64([10.0, 20.0])
    old = t64([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = t64([[-1.5, -2.0, -2.0], [-2.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    rewards, kl = kl_shaped_rewards(scores, old, ref, mask, kl_coef=0.1, estimator="k1")
    torch.testing.assert_close(kl, t64([[0.5, 0.0, 0.0], [1.0, 0.0, 0.0]]), **TOL)
    # Row 0: the score lands on index 1 (the last real token), never on index 2 (the first pad).
    torch.testing.assert_close(rewards, t64([[-0.05, 10.0, 0.0], [-0.1, 0.0, 20.0]]), **TOL)


def test_kl_shaped_rewards_k3_matches_its_formula():
    g = torch.Generator().manual_seed(3)
    B, T = 4, 6
    mask = mask_of([1, 3, 6, 4], T)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    scores = torch.randn(B, generator=g, dtype=torch.float64)
    rewards, kl = kl_shaped_rewards(scores, old, ref, mask, kl_coef=0.05, estimator="k3")
    r = torch.exp(ref - old)  # p_ref / p: k3 = (r - 1) - log r, written out rather than asked of kl_estimate
    expected_kl = torch.where(mask, (r - 1) - torch.log(r), torch.zeros_like(old))
    torch.testing.assert_close(kl, expected_kl, **TOL)
    assert (kl >= 0).all()
    expected = -0.05 * expected_kl
    for row, length in enumerate([1, 3, 6, 4]):
        expected[row, length - 1] += scores[row]
    torch.testing.assert_close(rewards, expected, **TOL)


def test_kl_shaped_rewards_empty_response_gets_no_score_and_no_error():
    scores = t64([1.0, 2.0])
    old = t64([[-1.0, -1.0], [-1.0, -1.0]])
    mask = torch.tensor([[True, False], [False, False]])
    rewards, kl = kl_shaped_rewards(scores, old, old.clone(), mask, kl_coef=0.1)
    torch.testing.assert_close(rewards, t64([[1.0, 0.0], [0.0, 0.0]]), **EXACT)
    torch.testing.assert_close(kl, torch.zeros_like(old), **EXACT)


def test_kl_shaped_rewards_does_not_modify_inputs():
    scores = t64([1.0])
    old = t64([[-1.0, -2.0]])
    ref = t64([[-1.0, -1.0]])
    mask = torch.tensor([[True, True]])
    copies = [x.clone() for x in (scores, old, ref, mask)]
    kl_shaped_rewards(scores, old, ref, mask, kl_coef=0.1)
    for x, c in zip((scores, old, ref, mask), copies):
        assert torch.equal(x, c)


# ---------------------------------------------------------------------------------------------
# GAE


def reference_gae(values, rewards, mask, gamma, lam):
    """Straightforward per-row, per-token GAE in Python floats (Schulman et al. 2016, eq. 16)."""
    B, T = values.shape
    advantages = torch.zeros(B, T, dtype=torch.float64)
    returns = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        length = int(mask[b].sum())
        next_value, next_advantage = 0.0, 0.0
        for t in reversed(range(length)):
            v = float(values[b, t])
            delta = float(rewards[b, t]) + gamma * next_value - v
            advantage = delta + gamma * lam * next_advantage
            advantages[b, t] = advantage
            returns[b, t] = advantage + v
            next_value, next_advantage = v, advantage
    return advantages, returns


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    rewards = t64([[1.0, 2.0, 3.0, 0.0], [0.0, 0.0, 5.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    values = t64([[0.5, 1.0, 1.5, 9.0], [1.0, 2.0, 3.0, 4.0], [2.0, 7.0, 7.0, 7.0]])
    mask = mask_of([3, 4, 1], 4)
    advantages, returns = gae(values, rewards, mask, gamma=1.0, lam=1.0)
    reward_to_go = t64([[6.0, 5.0, 3.0, 0.0], [5.0, 5.0, 5.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(returns, reward_to_go, **TOL)
    expected = torch.where(mask, reward_to_go - values, torch.zeros_like(values))
    torch.testing.assert_close(advantages, expected, **TOL)


def test_gae_hand_case_gamma_09_lam_08():
    # r = (1, 0, 2), V = (0.5, 0.4, 0.3), gamma * lam = 0.72:
    # delta_2 = 2 - 0.3 = 1.7                     A_2 = 1.7
    # delta_1 = 0 + 0.9 * 0.3 - 0.4 = -0.13       A_1 = -0.13 + 0.72 * 1.7 = 1.094
    # delta_0 = 1 + 0.9 * 0.4 - 0.5 = 0.86        A_0 = 0.86 + 0.72 * 1.094 = 1.64768
    # The trailing pad holds garbage that must not leak into the last real token.
    rewards = t64([[1.0, 0.0, 2.0, 0.0, 0.0]])
    values = t64([[0.5, 0.4, 0.3, 5.0, -3.0]])
    mask = mask_of([3], 5)
    advantages, returns = gae(values, rewards, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, t64([[1.64768, 1.094, 1.7, 0.0, 0.0]]), **TOL)
    torch.testing.assert_close(returns, t64([[2.14768, 1.494, 2.0, 0.0, 0.0]]), **TOL)


@pytest.mark.parametrize("seed", range(4))
def test_gae_matches_reference_loop_on_random_padded_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    mask = mask_of(random_lengths(g, B, T), T)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)  # garbage on padding too
    gamma = float(torch.rand((), generator=g)) * 0.5 + 0.5
    lam = float(torch.rand((), generator=g)) * 0.5 + 0.5
    advantages, returns = gae(values, rewards, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = reference_gae(values, rewards, mask, gamma, lam)
    torch.testing.assert_close(advantages, ref_adv, **TOL)
    torch.testing.assert_close(returns, ref_ret, **TOL)
    # returns = advantages + values on real tokens.
    torch.testing.assert_close(returns[mask], (advantages + values)[mask], **TOL)


def test_gae_float32_matches_reference():
    g = torch.Generator().manual_seed(11)
    B, T = 4, 7
    mask = mask_of(random_lengths(g, B, T), T)
    values = torch.randn(B, T, generator=g)
    rewards = torch.randn(B, T, generator=g)
    advantages, returns = gae(values, rewards, mask, gamma=0.99, lam=0.95)
    assert advantages.dtype == torch.float32
    ref_adv, ref_ret = reference_gae(values, rewards, mask, 0.99, 0.95)
    torch.testing.assert_close(advantages.double(), ref_adv, **TOL)
    torch.testing.assert_close(returns.double(), ref_ret, **TOL)


# ---------------------------------------------------------------------------------------------
# policy loss


# (advantage, ratio, taken branch): eps = 0.2.
POLICY_CASES = [
    (1.0, 1.5, "clipped"),  # A > 0, ratio > 1 + eps: -A * 1.2 = -1.2
    (-1.0, 0.5, "clipped"),  # A < 0, ratio < 1 - eps: -A * 0.8 = 0.8
    (1.0, 0.5, "unclipped"),  # A > 0, ratio < 1 - eps: -A * 0.5 = -0.5
    (-1.0, 1.5, "unclipped"),  # A < 0, ratio > 1 + eps: -A * 1.5 = 1.5
    (2.0, 1.1, "unclipped"),  # inside the trust region: -2.2
    (-3.0, 0.9, "unclipped"),  # inside the trust region: 2.7
]


@pytest.mark.parametrize("advantage, ratio, branch", POLICY_CASES)
def test_policy_loss_each_branch(advantage, ratio, branch):
    eps = 0.2
    old = t64([[-1.0]])
    new = (old + math.log(ratio)).requires_grad_(True)
    loss, stats = policy_loss(new, old, t64([[advantage]]), torch.tensor([[True]]), clip_eps=eps)
    clipped_ratio = min(max(ratio, 1 - eps), 1 + eps)
    expected = max(-advantage * ratio, -advantage * clipped_ratio)
    torch.testing.assert_close(loss, t64(expected), **TOL)
    torch.testing.assert_close(stats["clipfrac"], t64(1.0 if branch == "clipped" else 0.0), **EXACT)
    loss.backward()
    # d/dlogp of -A * exp(logp - old) is -A * ratio when unclipped; the clipped branch is flat.
    expected_grad = 0.0 if branch == "clipped" else -advantage * ratio
    torch.testing.assert_close(new.grad, t64([[expected_grad]]), **TOL)


def test_policy_loss_hand_case_batch_with_padding():
    eps = 0.2
    # Row 0: the first three cases; row 1: cases 4 and 5, then a pad holding garbage.
    ratios = t64([[1.5, 0.5, 0.5], [1.5, 1.1, 1.0]])
    advantages = t64([[1.0, -1.0, 1.0], [-1.0, 2.0, NAN]])
    old = t64([[-1.0, -2.0, -0.5], [-3.0, -1.0, -1.0]])
    new = (old + torch.log(ratios)).requires_grad_(True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    loss, stats = policy_loss(new, old, advantages, mask, clip_eps=eps)
    # Per token: -1.2, 0.8, -0.5, 1.5, -2.2 -> sum -1.6 over 5 tokens.
    torch.testing.assert_close(loss, t64(-1.6 / 5), **TOL)
    torch.testing.assert_close(stats["clipfrac"], t64(2 / 5), **TOL)
    log_ratios = [math.log(1.5), math.log(0.5), math.log(0.5), math.log(1.5), math.log(1.1)]
    torch.testing.assert_close(stats["approxkl"], t64(0.5 * sum(x * x for x in log_ratios) / 5), **TOL)
    torch.testing.assert_close(stats["ratio"], t64((1.5 + 0.5 + 0.5 + 1.5 + 1.1) / 5), **TOL)
    for value in stats.values():
        assert not value.requires_grad
    loss.backward()
    expected_grad = t64([[0.0, 0.0, -1.0 * 0.5 / 5], [1.0 * 1.5 / 5, -2.0 * 1.1 / 5, 0.0]])
    torch.testing.assert_close(new.grad, expected_grad, **TOL)


def test_policy_loss_explicit_token_count():
    old = t64([[-1.0, -1.0]])
    new = old + math.log(1.1)
    adv = t64([[1.0, 1.0]])
    mask = torch.tensor([[True, True]])
    loss, _ = policy_loss(new, old, adv, mask, clip_eps=0.2, token_count=8)
    torch.testing.assert_close(loss, t64(-2.2 / 8), **TOL)
    loss_t, _ = policy_loss(new, old, adv, mask, clip_eps=0.2, token_count=torch.tensor(8))
    torch.testing.assert_close(loss_t, t64(-2.2 / 8), **TOL)


def test_policy_loss_zero_advantage_is_not_clipped():
    old = t64([[-1.0, -1.0]])
    new = old + t64([[math.log(2.0), math.log(0.25)]])
    loss, stats = policy_loss(new, old, torch.zeros_like(old), torch.tensor([[True, True]]), clip_eps=0.2)
    torch.testing.assert_close(loss, t64(0.0), **EXACT)
    torch.testing.assert_close(stats["clipfrac"], t64(0.0), **EXACT)


# ---------------------------------------------------------------------------------------------
# value loss


# (new, old, return, taken branch): eps = 0.2.
VALUE_CASES = [
    (1.0, 0.0, 0.0, "unclipped"),  # V_clip = 0.2 is closer: max picks (1 - 0)^2 = 1
    (1.0, 0.0, 2.0, "clipped"),  # V_clip = 0.2: (0.2 - 2)^2 = 3.24 > 1
    (0.1, 0.0, 1.0, "unclipped"),  # inside: both 0.81
    (-1.0, 0.0, -3.0, "clipped"),  # V_clip = -0.2: (-0.2 + 3)^2 = 7.84 > 4
]


@pytest.mark.parametrize("new, old, ret, branch", VALUE_CASES)
def test_value_loss_each_branch(new, old, ret, branch):
    eps = 0.2
    new_t = t64([[new]]).requires_grad_(True)
    loss, stats = value_loss(new_t, t64([[old]]), t64([[ret]]), torch.tensor([[True]]), value_clip_eps=eps)
    v_clip = old + min(max(new - old, -eps), eps)
    expected = 0.5 * max((new - ret) ** 2, (v_clip - ret) ** 2)
    torch.testing.assert_close(loss, t64(expected), **TOL)
    torch.testing.assert_close(stats["clipfrac"], t64(1.0 if branch == "clipped" else 0.0), **EXACT)
    loss.backward()
    expected_grad = 0.0 if branch == "clipped" else new - ret
    torch.testing.assert_close(new_t.grad, t64([[expected_grad]]), **TOL)


def test_value_loss_hand_case_batch_with_padding():
    new = t64([[1.0, 1.0, INF], [0.1, -1.0, NAN]]).requires_grad_(True)
    old = t64([[0.0, 0.0, NAN], [0.0, 0.0, 1e30]])
    ret = t64([[0.0, 2.0, -INF], [1.0, -3.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    loss, stats = value_loss(new, old, ret, mask, value_clip_eps=0.2)
    # Per token 0.5, 1.62, 0.405, 3.92 -> 6.445 over 4 tokens.
    torch.testing.assert_close(loss, t64(6.445 / 4), **TOL)
    torch.testing.assert_close(stats["clipfrac"], t64(0.5), **TOL)
    assert not stats["clipfrac"].requires_grad
    loss.backward()
    grad = new.grad
    torch.testing.assert_close(grad[mask], t64([1.0 / 4, 0.0, -0.9 / 4, 0.0]), **TOL)


# ---------------------------------------------------------------------------------------------
# explained variance


def test_explained_variance_hand_cases():
    mask = torch.tensor([[True, True, True, True, False]])
    returns = t64([[1.0, 2.0, 3.0, 4.0, NAN]])
    torch.testing.assert_close(explained_variance(returns.clone(), returns, mask), t64(1.0), **TOL)
    torch.testing.assert_close(explained_variance(torch.zeros_like(returns), returns, mask), t64(0.0), **TOL)
    # returns - values = (0.5, -0.5, 0.5, -0.5): var 1/3; var(returns) = 5/3 -> 1 - 0.2 = 0.8.
    values = t64([[0.5, 2.5, 2.5, 4.5, INF]])
    torch.testing.assert_close(explained_variance(values, returns, mask), t64(0.8), **TOL)


def test_explained_variance_zero_variance_returns_is_zero_not_nan():
    returns = t64([[2.0, 2.0, 2.0, NAN]])
    values = t64([[1.0, 2.0, 3.0, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    out = explained_variance(values, returns, mask)
    assert torch.isfinite(out)
    torch.testing.assert_close(out, t64(0.0), **EXACT)


@pytest.mark.parametrize("n_valid", [0, 1])
def test_explained_variance_too_few_tokens_is_zero(n_valid):
    returns = t64([[2.0, 5.0]])
    mask = torch.tensor([[n_valid == 1, False]])
    out = explained_variance(t64([[0.0, 0.0]]), returns, mask)
    torch.testing.assert_close(out, t64(0.0), **EXACT)


# ---------------------------------------------------------------------------------------------
# padding invariance: whatever padding holds changes no real output and no loss


def random_batch(seed: int, B: int = 5, T: int = 8):
    g = torch.Generator().manual_seed(seed)
    mask = mask_of(random_lengths(g, B, T), T)
    batch = {
        "old": -torch.rand(B, T, generator=g, dtype=torch.float64) * 3,
        "ref": -torch.rand(B, T, generator=g, dtype=torch.float64) * 3,
        "new": -torch.rand(B, T, generator=g, dtype=torch.float64) * 3,
        "values": torch.randn(B, T, generator=g, dtype=torch.float64),
        "new_values": torch.randn(B, T, generator=g, dtype=torch.float64),
        "returns": torch.randn(B, T, generator=g, dtype=torch.float64),
        "advantages": torch.randn(B, T, generator=g, dtype=torch.float64),
        "rewards": torch.randn(B, T, generator=g, dtype=torch.float64),
    }
    scores = torch.randn(B, generator=g, dtype=torch.float64)
    return mask, scores, batch


def corrupt(batch: dict, mask: torch.Tensor, value: float) -> dict:
    return {k: fill_padding(v, mask, value) for k, v in batch.items()}


def assert_real_equal(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor):
    torch.testing.assert_close(a[mask], b[mask], **EXACT)


@pytest.mark.parametrize("garbage", GARBAGE)
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_padding_invariance_kl_shaped_rewards(garbage, estimator):
    mask, scores, clean = random_batch(0)
    dirty = corrupt(clean, mask, garbage)
    r0, kl0 = kl_shaped_rewards(scores, clean["old"], clean["ref"], mask, 0.1, estimator)
    r1, kl1 = kl_shaped_rewards(scores, dirty["old"], dirty["ref"], mask, 0.1, estimator)
    torch.testing.assert_close(r1, r0, **EXACT)  # padding is 0 in both
    torch.testing.assert_close(kl1, kl0, **EXACT)
    assert torch.equal(r1[~mask], torch.zeros_like(r1[~mask]))


@pytest.mark.parametrize("garbage", GARBAGE)
def test_padding_invariance_gae(garbage):
    mask, _, clean = random_batch(1)
    dirty = corrupt(clean, mask, garbage)
    a0, ret0 = gae(clean["values"], clean["rewards"], mask, 0.95, 0.9)
    a1, ret1 = gae(dirty["values"], dirty["rewards"], mask, 0.95, 0.9)
    assert_real_equal(a1, a0, mask)
    assert_real_equal(ret1, ret0, mask)
    # Padding outputs are exactly 0, never NaN.
    assert torch.equal(a1[~mask], torch.zeros_like(a1[~mask]))
    assert torch.equal(ret1[~mask], torch.zeros_like(ret1[~mask]))


@pytest.mark.parametrize("garbage", GARBAGE)
@pytest.mark.parametrize("shift_mean", [True, False])
def test_padding_invariance_masked_whiten(garbage, shift_mean):
    mask, _, clean = random_batch(2)
    dirty = corrupt(clean, mask, garbage)
    w0 = masked_whiten(clean["advantages"], mask, shift_mean=shift_mean)
    w1 = masked_whiten(dirty["advantages"], mask, shift_mean=shift_mean)
    torch.testing.assert_close(w1, w0, **EXACT)
    assert torch.equal(w1[~mask], torch.zeros_like(w1[~mask]))


@pytest.mark.parametrize("garbage", GARBAGE)
def test_padding_invariance_policy_loss(garbage):
    mask, _, clean = random_batch(3)
    dirty = corrupt(clean, mask, garbage)
    new0 = clean["new"].clone().requires_grad_(True)
    new1 = dirty["new"].clone().requires_grad_(True)
    l0, s0 = policy_loss(new0, clean["old"], clean["advantages"], mask, clip_eps=0.2)
    l1, s1 = policy_loss(new1, dirty["old"], dirty["advantages"], mask, clip_eps=0.2)
    torch.testing.assert_close(l1, l0, **EXACT)
    for key in s0:
        torch.testing.assert_close(s1[key], s0[key], **EXACT)
    l0.backward()
    l1.backward()
    assert_real_equal(new1.grad, new0.grad, mask)
    # No gradient (and no NaN) reaches padding: it would flow on into the model's parameters.
    assert torch.equal(new1.grad[~mask], torch.zeros_like(new1.grad[~mask]))


@pytest.mark.parametrize("garbage", GARBAGE)
def test_padding_invariance_value_loss(garbage):
    mask, _, clean = random_batch(4)
    dirty = corrupt(clean, mask, garbage)
    v0 = clean["new_values"].clone().requires_grad_(True)
    v1 = dirty["new_values"].clone().requires_grad_(True)
    l0, s0 = value_loss(v0, clean["values"], clean["returns"], mask, value_clip_eps=0.2)
    l1, s1 = value_loss(v1, dirty["values"], dirty["returns"], mask, value_clip_eps=0.2)
    torch.testing.assert_close(l1, l0, **EXACT)
    torch.testing.assert_close(s1["clipfrac"], s0["clipfrac"], **EXACT)
    l0.backward()
    l1.backward()
    assert_real_equal(v1.grad, v0.grad, mask)
    assert torch.equal(v1.grad[~mask], torch.zeros_like(v1.grad[~mask]))


@pytest.mark.parametrize("garbage", GARBAGE)
def test_padding_invariance_reductions_and_explained_variance(garbage):
    mask, _, clean = random_batch(5)
    dirty = corrupt(clean, mask, garbage)
    for fn in (masked_sum, masked_mean, masked_var):
        torch.testing.assert_close(fn(dirty["values"], mask), fn(clean["values"], mask), **EXACT)
    torch.testing.assert_close(
        explained_variance(dirty["values"], dirty["returns"], mask),
        explained_variance(clean["values"], clean["returns"], mask),
        **EXACT,
    )


# ---------------------------------------------------------------------------------------------
# gradient accumulation: micro-batches with the minibatch token count sum to the minibatch loss


SPLITS = [[3, 2, 3], [1, 7], [1, 1, 1, 1, 1, 1, 1, 1]]


@pytest.mark.parametrize("split", SPLITS)
def test_policy_loss_gradient_accumulation_equals_one_pass(split):
    mask, _, b = random_batch(6, B=8, T=9)
    # Make clipping happen on some tokens, in both directions.
    new_full = (b["old"] + torch.randn(8, 9, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 0.4)
    tokens = mask.sum()

    full = new_full.clone().requires_grad_(True)
    loss_full, _ = policy_loss(full, b["old"], b["advantages"], mask, clip_eps=0.2)
    loss_full.backward()

    accum = new_full.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for rows in torch.split(torch.arange(8), split):
        loss, _ = policy_loss(accum[rows], b["old"][rows], b["advantages"][rows], mask[rows], 0.2, token_count=tokens)
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, loss_full.detach(), **TOL)
    torch.testing.assert_close(accum.grad, full.grad, **TOL)
    assert full.grad.abs().sum() > 0

    # Sanity: the per-micro-batch mean (the default token count) would not match.
    naive = sum(
        policy_loss(new_full[rows], b["old"][rows], b["advantages"][rows], mask[rows], 0.2)[0]
        for rows in torch.split(torch.arange(8), split)
    )
    assert not torch.allclose(naive, loss_full.detach())


@pytest.mark.parametrize("split", SPLITS)
def test_value_loss_gradient_accumulation_equals_one_pass(split):
    mask, _, b = random_batch(8, B=8, T=9)
    tokens = mask.sum()

    full = b["new_values"].clone().requires_grad_(True)
    loss_full, _ = value_loss(full, b["values"], b["returns"], mask, value_clip_eps=0.2)
    loss_full.backward()

    accum = b["new_values"].clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for rows in torch.split(torch.arange(8), split):
        loss, _ = value_loss(accum[rows], b["values"][rows], b["returns"][rows], mask[rows], 0.2, token_count=tokens)
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, loss_full.detach(), **TOL)
    torch.testing.assert_close(accum.grad, full.grad, **TOL)
    assert full.grad.abs().sum() > 0
