"""The PPO arithmetic as pure tensor functions: KL estimates, shaped rewards, GAE, losses.

Imports torch and nothing else, so it is testable in milliseconds. Every per-token tensor
is [B, T_resp] and `response_mask` is True on real response tokens (the stop token
included), False on padding after it.
"""

from __future__ import annotations

from typing import Optional

import torch

# A whitening over fewer than this many valid entries has no variance to divide by.
MIN_WHITEN_COUNT = 2
WHITEN_EPS = 1e-8


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` where `mask` is True; padding contributes exactly nothing (even NaN)."""
    return torch.where(mask, values, torch.zeros_like(values)).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the True positions of `mask`; 0 when the mask is empty."""
    count = mask.sum()
    return masked_sum(values, mask) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance over the True positions of `mask`; 0 with fewer than 2 of them."""
    count = mask.sum()
    if count < MIN_WHITEN_COUNT:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    mean = masked_mean(values, mask)
    centered_sq = (values - mean) ** 2
    return masked_sum(centered_sq, mask) / (count - 1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise to unit variance (and zero mean if `shift_mean`) over the True positions.

    With fewer than two valid entries there is no variance: the values are only centred
    (or returned unchanged) instead of dividing by zero, which is where NaNs came from
    in tiny batches. Padding positions are returned as 0.
    """
    count = mask.sum()
    mean = masked_mean(values, mask)
    if count < MIN_WHITEN_COUNT:
        whitened = values - mean if shift_mean else values
    else:
        var = masked_var(values, mask)
        whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
        if not shift_mean:
            whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros_like(whitened))


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token logprobs.

    J. Schulman, "Approximating KL divergence" (2020), with r = p_ref / p_policy:
    k1 = -log r (unbiased, can be negative per token), k2 = (log r)^2 / 2 (biased, >= 0,
    low variance), k3 = (r - 1) - log r (unbiased, >= 0).
    """
    log_ratio = logprobs - ref_logprobs  # [B, T_resp]
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r} (expected 'k1', 'k2' or 'k3')")


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real response token (action token) per row, [B]; -1 for an empty
    response. In an episode the mask has gaps (observation tokens), so not its count - 1."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device).expand_as(response_mask)
    return torch.where(response_mask, positions, torch.full_like(positions, -1)).amax(dim=1)


def kl_shaped_rewards(
    scores: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
    turn_rewards: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: -kl_coef * KL at each real token, plus the score at the last one.

    Ziegler et al. 2019, eq. 2. The score lands on the last *real* response token (the stop
    token when the response stopped), never on the first pad after it.

    Args:
        scores: [B] sequence-level reward.
        old_logprobs, ref_logprobs: [B, T_resp] logprobs of the sampled tokens.
        response_mask: [B, T_resp] True on real response tokens (in an episode: action tokens).
        turn_rewards: [B, T_resp] rewards an environment gave during an episode, each on its
            turn's last action token (0 elsewhere), added as they are.
    Returns:
        (rewards [B, T_resp], kl [B, T_resp]), both 0 on padding.
    """
    kl = kl_estimate(old_logprobs, ref_logprobs, estimator)
    kl = torch.where(response_mask, kl, torch.zeros_like(kl))
    rewards = -kl_coef * kl
    if turn_rewards is not None:
        rewards = rewards + torch.where(response_mask, turn_rewards.to(rewards.dtype), torch.zeros_like(rewards))
    last = last_token_index(response_mask)  # [B]
    has_tokens = last >= 0
    rows = torch.arange(scores.shape[0], device=scores.device)[has_tokens]
    rewards = rewards.clone()
    rewards[rows, last[has_tokens]] += scores[has_tokens].to(rewards.dtype)
    return rewards, kl


def gae(
    values: torch.Tensor,
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16).

    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}, with
    V and A taken as 0 past the last real token (the episode ends there). Steps where
    `response_mask` is False inside a row (an episode's observation tokens) are skipped: the
    action before them bootstraps from the value of the action after them.

    Args:
        values: [B, T_resp] value of the state before each response token.
        rewards: [B, T_resp] per-token rewards (0 on padding).
        response_mask: [B, T_resp] True on real response tokens.
    Returns:
        (advantages, returns), both [B, T_resp] and 0 on padding; returns = advantages + values.
    """
    mask = response_mask.to(values.dtype)
    # where, not a product with the mask: NaN * 0 is NaN, and it would flow back into the episode.
    values = torch.where(response_mask, values, torch.zeros_like(values))
    rewards = torch.where(response_mask, rewards, torch.zeros_like(rewards))
    T = values.shape[1]
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = (delta + gamma * lam * next_advantage) * mask[:, t]
        advantages[:, t] = advantage
        # A step that is not an action passes the next action's value and advantage back unchanged:
        # gamma and lam count action tokens only, so an episode's observation tokens are skipped,
        # and padding after the last action passes back the zeros the episode ended with.
        next_value = torch.where(response_mask[:, t], values[:, t], next_value)
        next_advantage = torch.where(response_mask[:, t], advantage, next_advantage)
    returns = (advantages + values) * mask
    return advantages, returns


def aggregate_loss(
    per_token: torch.Tensor,
    response_mask: torch.Tensor,
    aggregation: str = "token",
    normalizer: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T_resp] to a scalar.

    "token": sum over real tokens / `normalizer` (default: this batch's real tokens), so every
    token weighs the same. "sequence": each sequence's mean over its real tokens, summed, /
    `normalizer` (default: this batch's sequences), so every sequence weighs the same. Pass
    the whole minibatch's count as `normalizer` and micro-batches add up to the minibatch loss.
    """
    if aggregation == "token":
        if normalizer is None:
            normalizer = response_mask.sum()
        return masked_sum(per_token, response_mask) / normalizer
    if aggregation == "sequence":
        zeroed = torch.where(response_mask, per_token, torch.zeros_like(per_token))
        lengths = response_mask.sum(dim=1).clamp(min=1)
        if normalizer is None:
            normalizer = per_token.shape[0]
        return (zeroed.sum(dim=1) / lengths).sum() / normalizer
    raise ValueError(f"unknown loss aggregation {aggregation!r} (expected 'token' or 'sequence')")


def policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_eps: float,
    token_count: torch.Tensor | int | None = None,
    dual_clip: float | None = None,
    aggregation: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate objective (Schulman et al. 2017, eq. 7), as a loss to minimise.

    With `dual_clip` = c > 1 (Ye et al. 2020, "Mastering Complex Control in MOBA Games",
    eq. 5), the loss of a token with negative advantage is also capped at -c * A, so a huge
    ratio on a bad action cannot dominate the update.

    The loss is aggregated by `aggregate_loss` with `token_count` as its normalizer (tokens
    for "token", sequences for "sequence"); passing the whole minibatch's count makes
    gradient accumulation over micro-batches equal to one pass over the minibatch.

    Returns:
        (loss, stats) where stats has `clipfrac` (share of tokens where the clipped branch
        was taken), `approxkl` (0.5 * mean squared log-ratio), `ratio` (mean ratio) and
        `dual_clipfrac`, all detached.
    """
    # Padding is zeroed before any arithmetic: masking only the sum would still send a NaN
    # gradient (0 * inf, 0 * NaN) back to padded positions, and from there into the model.
    log_ratio = torch.where(response_mask, new_logprobs - old_logprobs, torch.zeros_like(new_logprobs))
    advantages = torch.where(response_mask, advantages, torch.zeros_like(advantages))
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(response_mask)
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual_clipped = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual_clipped, cap, per_token)
    loss = aggregate_loss(per_token, response_mask, aggregation, token_count)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((clipped > unclipped).to(per_token.dtype), response_mask),
            "dual_clipfrac": masked_mean(dual_clipped.to(per_token.dtype), response_mask),
            "approxkl": 0.5 * masked_mean(log_ratio.detach() ** 2, response_mask),
            "ratio": masked_mean(ratio.detach(), response_mask),
        }
    return loss, stats


def value_loss(
    new_values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    value_clip_eps: float | None,
    token_count: torch.Tensor | int | None = None,
    aggregation: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip within eps of V_old.

    The clipping is the PPO2 baselines variant ("N implementation details", detail 9);
    `value_clip_eps=None` turns it off (plain 0.5 * (V - R)^2). Aggregated like `policy_loss`.
    """
    # Zero the padding first, as in `policy_loss`, so that no NaN gradient reaches it.
    new_values = torch.where(response_mask, new_values, torch.zeros_like(new_values))
    old_values = torch.where(response_mask, old_values, torch.zeros_like(old_values))
    returns = torch.where(response_mask, returns, torch.zeros_like(returns))
    unclipped_sq = (new_values - returns) ** 2
    if value_clip_eps is None:
        clipped_sq = unclipped_sq
    else:
        clipped_values = old_values + torch.clamp(new_values - old_values, -value_clip_eps, value_clip_eps)
        clipped_sq = (clipped_values - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_sq, clipped_sq)
    loss = aggregate_loss(per_token, response_mask, aggregation, token_count)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped_sq > unclipped_sq).to(per_token.dtype), response_mask)}
    return loss, stats


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over real tokens; NaN-free (0 when Var(returns) is 0)."""
    var_returns = masked_var(returns, response_mask)
    if var_returns <= 0:
        return torch.zeros((), dtype=values.dtype, device=values.device)
    return 1.0 - masked_var(returns - values, response_mask) / var_returns


def kl_loss(
    new_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k3",
    token_count: torch.Tensor | int | None = None,
    aggregation: str = "token",
) -> torch.Tensor:
    """KL penalty as a loss term on the current policy (the GRPO placement, Shao et al. 2024,
    eq. 3), instead of inside the reward: kl_coef * aggregate(KL(new || ref))."""
    # Padding zeroed first, as in policy_loss: a NaN or huge reference logprob there would send a
    # NaN gradient (0 * inf) back through k2/k3.
    new_logprobs = torch.where(response_mask, new_logprobs, torch.zeros_like(new_logprobs))
    ref_logprobs = torch.where(response_mask, ref_logprobs, torch.zeros_like(ref_logprobs))
    kl = kl_estimate(new_logprobs, ref_logprobs, estimator)
    return kl_coef * aggregate_loss(kl, response_mask, aggregation, token_count)


def adaptive_kl_coef(kl_coef: float, current_kl: float, target_kl: float, horizon: int, n_steps: int,
                     floor: float = 0.0) -> float:
    """Ziegler et al. 2019, section 2.2: move kl_coef toward keeping the KL at `target_kl`.

    e = clip(KL / target - 1, -0.2, 0.2); kl_coef *= 1 + e * n_steps / horizon, where
    n_steps is the number of samples the KL was measured on; never below `floor`.
    """
    error = min(max(current_kl / target_kl - 1.0, -0.2), 0.2)
    return max(floor, kl_coef * (1.0 + error * n_steps / horizon))


def update_running_moments(
    mean: float, var: float, count: int, batch: torch.Tensor
) -> tuple[float, float, int]:
    """Fold a batch into a running mean and (population) variance (Chan et al. 1979)."""
    n = batch.numel()
    if n == 0:
        return mean, var, count
    batch = batch.double()
    batch_mean = batch.mean().item()
    batch_var = batch.var(unbiased=False).item()
    total = count + n
    delta = batch_mean - mean
    new_mean = mean + delta * n / total
    m2 = var * count + batch_var * n + delta**2 * count * n / total
    return new_mean, m2 / total, total


def shape_scores(
    scores: torch.Tensor,
    response_lengths: torch.Tensor,
    length_penalty: float = 0.0,
    norm_mean: float | None = None,
    norm_std: float | None = None,
    clip: float | None = None,
) -> torch.Tensor:
    """Sequence scores as the optimiser sees them: normalised by running statistics (if
    given), clipped to [-clip, clip], minus length_penalty per response token. [B]"""
    if norm_mean is not None and norm_std is not None:
        scores = (scores - norm_mean) / max(norm_std, WHITEN_EPS**0.5)
    if clip is not None:
        scores = scores.clamp(-clip, clip)
    return scores - length_penalty * response_lengths.to(scores.dtype)


def group_advantages(
    sequence_rewards: torch.Tensor, group_size: int, estimator: str, eps: float = 1e-6
) -> torch.Tensor:
    """Critic-free advantages from k samples per prompt (rows grouped consecutively). [B]

    "rloo": REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): each sample's
    baseline is the mean reward of the other k-1 samples of its prompt.
    "grpo": group-relative (Shao et al. 2024, eq. 4 outcome supervision): (R - mean) / (std + eps)
    within the prompt's group, std unbiased.
    """
    if group_size < 2:
        raise ValueError("group advantages need at least 2 samples per prompt")
    grouped = sequence_rewards.view(-1, group_size)  # [n_prompts, k]
    if estimator == "rloo":
        others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
        return (grouped - others_mean).reshape(-1)
    if estimator == "grpo":
        mean = grouped.mean(dim=1, keepdim=True)
        std = grouped.std(dim=1, keepdim=True, unbiased=True)
        return ((grouped - mean) / (std + eps)).reshape(-1)
    raise ValueError(f"unknown group estimator {estimator!r} (expected 'rloo' or 'grpo')")
