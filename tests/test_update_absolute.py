"""Absolute tests of the PPO update (`lora_ppo/update.py`): advantages, one SGD step of
`ppo_update`, its logged stats and its helpers, each compared with numbers written out here.

The model is a stand-in for `RoleModel` with a handful of parameters: the policy is a table of
logits per response position, `theta [T_resp, V]` shared by every row, so the logprob of token k at
position j is `log_softmax(theta[j] / temperature)[k]`; the value at position j is `w[j] + c`
(`w` the "adapter", `c` the "head"). Every expected number is computed below with explicit
per-token formulas in plain Python loops (float64), never by calling `lora_ppo.ppo_math` or the
update; autograd only differentiates the hand-written loss. With plain SGD (no momentum, no weight
decay), one minibatch must move each parameter by exactly -lr x the (clipped) gradient of that loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from lora_ppo.config import PPOConfig
from lora_ppo.distributed import World
from lora_ppo.roles import POLICY, VALUE
from lora_ppo.rollout import Rollout
from lora_ppo.update import (
    Advantages,
    LogprobCheck,
    UpdateSettings,
    UpdateStats,
    _TokenWeightedMeans,
    compute_advantages,
    minibatch_backward,
    optimizer_step,
    ppo_update,
    ratio_threshold_action,
)

TOL = dict(atol=1e-6, rtol=1e-5)
DT = torch.float64
# torch.nn.utils.clip_grad_norm_ scales by max_norm / (norm + 1e-6) (its documented eps).
CLIP_EPS_OF_TORCH = 1e-6
WHITEN_EPS = 1e-8  # docs/algorithms.md, ppo_math: x / sqrt(unbiased var + 1e-8)
GRPO_EPS = 1e-6  # (R - mean) / (unbiased std + 1e-6)
SEED = 1  # the update's shuffle: rows [1, 3] then [2, 0], not the identity order
LR = 0.1
TEMPERATURE = 0.7

# ---- the fixed numbers -------------------------------------------------------------------------
# B = 4 rows, T_resp = 3, vocabulary V = 3, a prompt of P = 1 column. Row 1 stopped after 2 tokens,
# row 3 after 1: 9 real tokens out of 12 positions. Padding of the rollout tensors holds junk that
# must never count.
B, T, V, P = 4, 3, 3, 1
LENGTHS = [3, 2, 3, 1]
MASK = [[t < n for t in range(T)] for n in LENGTHS]
REAL = [[t for t in range(T) if MASK[i][t]] for i in range(B)]
PAD_ID = 0
TOKENS = [[0, 1, 2], [2, 0, PAD_ID], [1, 1, PAD_ID], [0, PAD_ID, PAD_ID]]
JUNK = -3.0

THETA0 = [[0.2, -0.3, 0.5], [0.0, 0.4, -0.1], [-0.2, 0.1, 0.3]]
W0 = [0.1, -0.2, 0.3]
C0 = 0.05

# The ratio new/old each real token has at the first forward (the stand-in's initial weights):
# old_logprobs = initial logprob - log(ratio), so every clipping branch is hit on purpose.
RATIOS = [[1.35, 0.6, 1.05], [0.7, 1.5], [0.95, 3.5, 1.1], [1.25]]
ADVANTAGES = [[0.8, -0.5, 0.3], [1.2, -0.9], [-0.4, -0.7, 0.6], [-1.1]]
# ref_logprobs = initial logprob + this (a reference away from both old and new)
REF_SHIFT = [[-0.3, 0.2, 0.1], [0.25, -0.15], [0.05, -0.4, 0.3], [0.2]]
OLD_VALUES = [[0.5, -0.1, 0.1], [-0.2, 0.2], [0.1, -0.3, 0.4], [0.0]]
RETURNS = [[1.0, -0.5, 0.6], [0.5, 0.1], [-0.4, 0.2, 0.9], [1.5]]
SCORES = [1.0, -0.5, 0.3, 2.0]


def hand_logprob(theta_row, token: int, temperature: float):
    """log softmax(theta_row / temperature)[token], written out."""
    z = [theta_row[k] / temperature for k in range(V)]
    log_norm = torch.log(sum(torch.exp(zk) for zk in z))
    return z[token] - log_norm


def hand_entropy(theta_row, temperature: float):
    z = [theta_row[k] / temperature for k in range(V)]
    log_norm = torch.log(sum(torch.exp(zk) for zk in z))
    return -sum(torch.exp(zk - log_norm) * (zk - log_norm) for zk in z)


def initial_logprob(i: int, t: int) -> float:
    return float(hand_logprob(torch.tensor(THETA0[t], dtype=DT), TOKENS[i][t], TEMPERATURE))


def padded(per_row: list[list[float]], fill: float = JUNK) -> torch.Tensor:
    """[B, T] from ragged per-row lists of the real tokens, `fill` on padding."""
    return torch.tensor([row + [fill] * (T - len(row)) for row in per_row], dtype=DT)


def default_old() -> list[list[float]]:
    return [[initial_logprob(i, t) - math.log(RATIOS[i][t]) for t in REAL[i]] for i in range(B)]


def default_ref() -> list[list[float]]:
    return [[initial_logprob(i, t) + REF_SHIFT[i][t] for t in REAL[i]] for i in range(B)]


def make_rollout(old=None, ref=None, old_values=OLD_VALUES, scores=SCORES, with_values=True, junk=JUNK) -> Rollout:
    old = default_old() if old is None else old
    ref = default_ref() if ref is None else ref
    response_mask = torch.tensor(MASK)
    scores_t = torch.tensor(scores, dtype=DT)
    return Rollout(
        rows=[None] * B, completions=[""] * B,
        query_ids=torch.ones(B, P, dtype=torch.long), query_mask=torch.ones(B, P, dtype=torch.long),
        response_ids=torch.tensor(TOKENS), response_mask=response_mask,
        old_logprobs=padded(old, junk), ref_logprobs=padded(ref, junk),
        values=padded(old_values, junk) if with_values else None,
        raw_scores=scores_t, scores=scores_t, stopped=torch.tensor([False, True, True, True]),
    )


def make_advantages(advantages=ADVANTAGES, returns=RETURNS, with_critic=True) -> Advantages:
    """An `Advantages` record with hand-chosen advantages and returns (0 on padding, as documented)."""
    zeros = torch.zeros(B, T, dtype=DT)
    return Advantages(torch.tensor(SCORES, dtype=DT), zeros, zeros, padded(advantages, 0.0),
                      padded(returns, 0.0) if with_critic else None, 0.0)


class TableRoles:
    """A differentiable stand-in for `RoleModel` with the methods the update uses.

    Under a role, `hidden_states` puts that role's table at the positions that predict each
    response token (position P - 1 + j predicts response token j): the policy's logits
    `theta[j]`, or the value `w[j] + c` in channel 0. So a loss computed under the wrong role
    gets the wrong numbers."""

    def __init__(self, theta=THETA0, w=W0, c=C0, with_value: bool = True):
        self.theta = torch.nn.Parameter(torch.tensor(theta, dtype=DT))
        self.w = torch.nn.Parameter(torch.tensor(w, dtype=DT))
        self.c = torch.nn.Parameter(torch.tensor(c, dtype=DT))
        self.with_value = with_value
        self.mixed_batches = {False: True, True: True}
        self.trim_padding = True  # as RoleModel by default: micro-batches without their unused columns
        self.packing = False  # as RoleModel by default
        self.checkpointing: list[bool] = []
        self.stacked_forwards = 0
        self._role: Optional[str] = None
        self._row_roles: Optional[list[str]] = None

    @contextlib.contextmanager
    def gradient_checkpointing(self, enabled: bool, compiled=None):
        self.checkpointing.append(enabled)
        yield

    def policy_parameters(self):
        return [self.theta]

    def value_parameters(self):
        return [self.w, self.c] if self.with_value else []

    @contextlib.contextmanager
    def as_role(self, role):
        previous, self._role = self._role, role
        try:
            yield
        finally:
            self._role = previous

    def adapter_name(self, role):
        return role

    def adapters_cast_once(self, adapter_names):  # no LoRA layers to cast for
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def rows_as_roles(self, roles, batch: int):
        self._row_roles = [role for role in roles for _ in range(batch)]
        try:
            yield
        finally:
            self._row_roles = None

    def _hidden(self, role, rows: int, length: int) -> torch.Tensor:  # [rows, length, V]
        if role == POLICY:
            table = self.theta  # [T, V]
        elif role == VALUE and self.with_value:
            table = torch.cat([(self.w + self.c)[:, None], torch.zeros(T, V - 1, dtype=DT)], dim=1)
        else:
            raise AssertionError(f"forward under role {role!r}")
        # The prompt is P columns; the response columns are all T, or fewer where the micro-batch's
        # rows stopped early (ppo.trim_padding): the table is laid out by response position.
        per_position = torch.cat([torch.zeros(P - 1, V, dtype=DT), table[: length - P], torch.zeros(1, V, dtype=DT)])
        return per_position.expand(rows, length, V)

    def hidden_states(self, ids, attention_mask, position_ids=None):
        assert self._row_roles is None and position_ids is None  # no packing here
        return self._hidden(self._role, ids.shape[0], ids.shape[1])

    def stacked_hidden_states(self, ids, attention_mask, copies: int, position_ids=None):
        rows = ids.shape[0]
        assert self._row_roles is not None and len(self._row_roles) == copies * rows and position_ids is None
        self.stacked_forwards += 1
        return [self._hidden(self._row_roles[k * rows], rows, ids.shape[1]) for k in range(copies)]

    def predicted_logprobs(self, predicting, targets, temperature: float):  # predicting: [B, T_resp, V]
        logp = torch.log_softmax(predicting / temperature, dim=-1)
        return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)

    def values_at(self, predicting):
        return predicting[..., 0]


# ---- the hand-written update -------------------------------------------------------------------


def hand_kl(logprob, ref_logprob, estimator: str):
    """Schulman's estimators of KL(policy || ref), with log r = ref - logprob."""
    d = logprob - ref_logprob
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return (math.exp(-d) if isinstance(d, float) else torch.exp(-d)) - 1.0 + d
    raise AssertionError(estimator)


def val(x) -> float:
    """A hand quantity as a plain number (no autograd history)."""
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


@dataclass
class Hand:
    """Copies of the stand-in's parameters and the rollout numbers, as the hand update sees them."""

    theta: torch.Tensor
    w: torch.Tensor
    c: torch.Tensor
    old: list[list[float]]
    ref: list[list[float]]
    adv: list[list[float]]
    old_values: list[list[float]]
    returns: Optional[list[list[float]]]

    @staticmethod
    def start(old=None, ref=None, adv=ADVANTAGES, returns=RETURNS) -> "Hand":
        return Hand(torch.tensor(THETA0, dtype=DT), torch.tensor(W0, dtype=DT), torch.tensor(C0, dtype=DT),
                    default_old() if old is None else old, default_ref() if ref is None else ref, adv,
                    OLD_VALUES, returns)


def hand_minibatch(h: Hand, rows: list[int], cfg: PPOConfig, kl_coef: float):
    """The minibatch's loss from explicit per-token formulas, its unclipped gradients and its stats.

    Returns (policy gradient [theta], value gradients [w, c] or None, stats, real-token count)."""
    theta = h.theta.clone().requires_grad_(True)
    w, c = h.w.clone().requires_grad_(True), h.c.clone().requires_grad_(True)
    tokens = [(i, t) for i in rows for t in REAL[i]]
    n_tokens = len(tokens)

    def aggregate(per_token: dict):
        if cfg.loss_aggregation == "token":  # every real token of the minibatch weighs the same
            return sum(per_token[k] for k in tokens) / n_tokens
        # every response weighs the same: the mean over its real tokens, averaged over the rows
        return sum(sum(per_token[(i, t)] for t in REAL[i]) / len(REAL[i]) for i in rows) / len(rows)

    lo, hi = 1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps
    pg, ent, kl, logratio, ratio, clipped, dual = {}, {}, {}, {}, {}, {}, {}
    for i, t in tokens:
        new = hand_logprob(theta[t], TOKENS[i][t], TEMPERATURE)
        ent[(i, t)] = hand_entropy(theta[t], TEMPERATURE)
        logratio[(i, t)] = val(new) - h.old[i][t]
        r = torch.exp(new - h.old[i][t])
        ratio[(i, t)] = val(r)
        a = h.adv[i][t]
        # max(-A r, -A clip(r)): the clipped branch is the larger one only when the ratio is
        # past the bound that the advantage's sign makes binding; there it is a constant.
        if a > 0 and val(r) > hi:
            loss, clipped[(i, t)] = torch.tensor(-a * hi, dtype=DT), True
        elif a < 0 and val(r) < lo:
            loss, clipped[(i, t)] = torch.tensor(-a * lo, dtype=DT), True
        else:
            loss, clipped[(i, t)] = -a * r, False
        dual[(i, t)] = cfg.dual_clip is not None and a < 0 and val(loss) > -cfg.dual_clip * a
        if dual[(i, t)]:
            loss = torch.tensor(-cfg.dual_clip * a, dtype=DT)
        pg[(i, t)] = loss
        kl[(i, t)] = hand_kl(new, h.ref[i][t], cfg.kl_estimator)

    pg_loss = aggregate(pg)
    policy_objective = pg_loss - cfg.entropy_coef * aggregate(ent)

    def mean(per_token: dict) -> float:  # over the minibatch's real tokens
        return sum(val(per_token[k]) for k in tokens) / n_tokens

    stats = {
        "policy_loss": val(pg_loss), "entropy": mean(ent), "ratio": mean(ratio),
        "clipfrac": mean(clipped), "dual_clipfrac": mean(dual),
        "approxkl": 0.5 * sum(logratio[k] ** 2 for k in tokens) / n_tokens,
    }
    if cfg.kl_penalty == "loss" and kl_coef > 0:
        kl_term = kl_coef * aggregate(kl)
        policy_objective = policy_objective + kl_term
        stats["kl_loss"] = val(kl_term)
    (g_theta,) = torch.autograd.grad(policy_objective, [theta])

    if h.returns is None:
        return [g_theta], None, stats, n_tokens
    vf, vclipped = {}, {}
    for i, t in tokens:
        new_v, old_v, ret = w[t] + c, h.old_values[i][t], h.returns[i][t]
        unclipped_sq = (new_v - ret) ** 2
        if cfg.clip_value_loss:
            d = val(new_v) - old_v
            if d > cfg.value_clip_eps:
                v_clip = torch.tensor(old_v + cfg.value_clip_eps, dtype=DT)
            elif d < -cfg.value_clip_eps:
                v_clip = torch.tensor(old_v - cfg.value_clip_eps, dtype=DT)
            else:
                v_clip = new_v
            clipped_sq = (v_clip - ret) ** 2
        else:
            clipped_sq = unclipped_sq
        vclipped[(i, t)] = val(clipped_sq) > val(unclipped_sq)
        vf[(i, t)] = 0.5 * (clipped_sq if vclipped[(i, t)] else unclipped_sq)
    vf_loss = aggregate(vf)
    stats["value_loss"] = val(vf_loss)
    stats["value_clipfrac"] = mean(vclipped)
    g_w, g_c = torch.autograd.grad(cfg.vf_coef * vf_loss, [w, c])
    return [g_theta], [g_w, g_c], stats, n_tokens


def hand_clip(grads: list[torch.Tensor], max_norm: float) -> tuple[list[torch.Tensor], float]:
    """Scale a group of gradients to norm at most max_norm; returns (clipped, norm before)."""
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    coef = min(1.0, max_norm / (norm + CLIP_EPS_OF_TORCH))
    return [g * coef for g in grads], norm


def hand_update(h: Hand, cfg: PPOConfig, kl_coef: float, minibatches: list[list[int]]) -> dict:
    """num_epochs = 1: each minibatch's SGD step at the parameters the previous one left.

    Returns the expected stats (token-weighted over minibatches, the losses under sequence
    aggregation weighted by responses; grad norms of the last one)."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    actions = []
    ratios = []
    first = minibatches[0]
    diffs = [abs(h.old[i][t] - initial_logprob(i, t)) for i in first for t in REAL[i]]
    for rows in minibatches:
        g_policy, g_value, stats, n = hand_minibatch(h, rows, cfg, kl_coef)
        for key, value in stats.items():
            by_rows = cfg.loss_aggregation == "sequence" and key.endswith("_loss")
            sums[key] = sums.get(key, 0.0) + value * (len(rows) if by_rows else n)
            weights[key] = weights.get(key, 0.0) + (len(rows) if by_rows else n)
        action = None
        if cfg.ratio_threshold is not None and stats["ratio"] > cfg.ratio_threshold:
            action = cfg.ratio_threshold_action
        actions.append(action)
        ratios.append(stats["ratio"])
        if action == "skip":
            g_policy = [torch.zeros_like(g) for g in g_policy]
        elif action == "scale":
            g_policy = [g * (cfg.ratio_threshold / stats["ratio"]) for g in g_policy]
        g_policy, policy_norm = hand_clip(g_policy, cfg.max_grad_norm)
        h.theta = h.theta - LR * g_policy[0]
        value_norm = None
        if g_value is not None:
            g_value, value_norm = hand_clip(g_value, cfg.max_grad_norm)
            h.w, h.c = h.w - LR * g_value[0], h.c - LR * g_value[1]
    expected = {key: total / weights[key] for key, total in sums.items()}
    expected["policy_grad_norm"] = policy_norm
    expected["value_grad_norm"] = value_norm
    expected["logprob_max_diff"] = max(diffs)
    expected["logprob_mean_diff"] = sum(diffs) / len(diffs)
    expected["minibatch_ratios"] = ratios  # not a stat: for tests that pick a threshold between them
    if cfg.ratio_threshold is not None:
        expected["skipped_minibatch_frac"] = actions.count("skip") / len(actions)
        expected["scaled_minibatch_frac"] = actions.count("scale") / len(actions)
    return expected


def run_update(roles: TableRoles, rollout: Rollout, adv: Advantages, cfg: PPOConfig, kl_coef: float,
               micro: Optional[int] = None, together: bool = False, checkpointing: bool = False) -> UpdateStats:
    minibatch = B // cfg.num_minibatches
    settings = UpdateSettings(minibatch, micro or minibatch, TEMPERATURE, checkpointing, together)
    optimizer = torch.optim.SGD(roles.policy_parameters() + roles.value_parameters(), lr=LR)
    return ppo_update(roles, optimizer, None, rollout, adv, cfg, settings, kl_coef,
                      torch.Generator().manual_seed(SEED))


def seeded_minibatches(num_minibatches: int) -> list[list[int]]:
    """The rows of each minibatch: the update's documented seeded order, split in equal parts."""
    order = torch.randperm(B, generator=torch.Generator().manual_seed(SEED)).tolist()
    size = B // num_minibatches
    return [order[k : k + size] for k in range(0, B, size)]


STAT_FIELDS = ["policy_loss", "clipfrac", "dual_clipfrac", "approxkl", "ratio", "entropy", "kl_loss", "value_loss",
               "value_clipfrac", "policy_grad_norm", "value_grad_norm", "logprob_max_diff", "logprob_mean_diff",
               "skipped_minibatch_frac", "scaled_minibatch_frac"]




def assert_matches_hand(roles: TableRoles, stats: UpdateStats, h: Hand, expected: dict, split: bool = False,
                        cfg: Optional[PPOConfig] = None) -> None:
    torch.testing.assert_close(roles.theta.detach(), h.theta, **TOL)
    if roles.with_value:
        torch.testing.assert_close(roles.w.detach(), h.w, **TOL)
        torch.testing.assert_close(roles.c.detach(), h.c, **TOL)
    for name in STAT_FIELDS:
        got, want = getattr(stats, name), expected.get(name)
        if want is None:
            assert got is None, f"{name}: {got} where the hand update has none"
        else:
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), name
    assert stats.skipped_minibatches == 0 and stats.nonfinite is None


# ---- compute_advantages ------------------------------------------------------------------------

GAMMA, LAM, KL_COEF = 0.9, 0.8, 0.1


def hand_whiten(per_row: list[list[float]], shift_mean: bool) -> list[list[float]]:
    """(x - mean) / sqrt(unbiased var + 1e-8) over the real tokens (+ mean back if not shift_mean)."""
    flat = [x for row in per_row for x in row]
    n = len(flat)
    mean = sum(flat) / n
    var = sum((x - mean) ** 2 for x in flat) / (n - 1)
    std = math.sqrt(var + WHITEN_EPS)
    return [[(x - mean) / std + (0.0 if shift_mean else mean) for x in row] for row in per_row]


def hand_token_kl(estimator: str) -> list[list[float]]:
    old, ref = default_old(), default_ref()
    return [[hand_kl(old[i][t], ref[i][t], estimator) for t in REAL[i]] for i in range(B)]


def hand_gae(values, rewards, gamma, lam):
    """delta_t = r_t + gamma V_{t+1} - V_t; A_t = delta_t + gamma lam A_{t+1}; V, A = 0 past the end."""
    advantages, returns = [], []
    for v, r in zip(values, rewards):
        n = len(r)
        a = [0.0] * n
        next_v = next_a = 0.0
        for t in reversed(range(n)):
            delta = r[t] + gamma * next_v - v[t]
            a[t] = delta + gamma * lam * next_a
            next_v, next_a = v[t], a[t]
        advantages.append(a)
        returns.append([a[t] + v[t] for t in range(n)])
    return advantages, returns


def assert_per_token(got: torch.Tensor, want: list[list[float]]) -> None:
    """Real tokens equal the hand values and padding is exactly 0."""
    torch.testing.assert_close(got.to(DT), padded(want, 0.0), **TOL)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("whiten_rewards", [False, True])
@pytest.mark.parametrize("whiten_advantages", [False, True])
def test_gae_advantages_and_returns_by_hand(estimator, whiten_rewards, whiten_advantages):
    """KL in the reward: r_t = -kl_coef * KL_t, + score at the last real token; then (optional,
    scale-only) reward whitening, GAE with gamma 0.9 != lam 0.8, (optional) advantage whitening."""
    cfg = PPOConfig(gamma=GAMMA, lam=LAM, kl_estimator=estimator, whiten_rewards=whiten_rewards,
                    whiten_advantages=whiten_advantages)
    rollout = make_rollout()
    kl = hand_token_kl(estimator)
    rewards = [[-KL_COEF * kl[i][j] + (SCORES[i] if j == len(REAL[i]) - 1 else 0.0) for j in range(len(REAL[i]))]
               for i in range(B)]
    if whiten_rewards:
        rewards = hand_whiten(rewards, shift_mean=False)
    advantages, returns = hand_gae(OLD_VALUES, rewards, GAMMA, LAM)
    if whiten_advantages:
        advantages = hand_whiten(advantages, shift_mean=True)

    adv = compute_advantages(rollout, cfg, KL_COEF, rollout.scores)

    assert adv.reward_kl_coef == KL_COEF
    torch.testing.assert_close(adv.scores, rollout.scores)
    assert_per_token(adv.kl, kl)
    assert_per_token(adv.rewards, rewards)
    assert_per_token(adv.advantages, advantages)
    assert_per_token(adv.returns, returns)


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    """The textbook special case, by hand: A_t = sum_{s >= t} r_s - V_t (no KL: kl_coef 0)."""
    cfg = PPOConfig(gamma=1.0, lam=1.0, whiten_advantages=False)
    adv = compute_advantages(make_rollout(), cfg, 0.0, torch.tensor(SCORES, dtype=DT))
    want = [[SCORES[i] - OLD_VALUES[i][t] for t in REAL[i]] for i in range(B)]
    assert_per_token(adv.advantages, want)
    assert_per_token(adv.returns, [[SCORES[i]] * len(REAL[i]) for i in range(B)])


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_as_a_loss_leaves_the_score_alone_in_the_reward(estimator):
    cfg = PPOConfig(gamma=GAMMA, lam=LAM, kl_penalty="loss", kl_estimator=estimator, whiten_advantages=False)
    adv = compute_advantages(make_rollout(), cfg, KL_COEF, torch.tensor(SCORES, dtype=DT))
    rewards = [[SCORES[i] if j == len(REAL[i]) - 1 else 0.0 for j in range(len(REAL[i]))] for i in range(B)]
    advantages, returns = hand_gae(OLD_VALUES, rewards, GAMMA, LAM)
    assert adv.reward_kl_coef == 0.0
    assert_per_token(adv.kl, hand_token_kl(estimator))  # still measured, for the logs
    assert_per_token(adv.rewards, rewards)
    assert_per_token(adv.advantages, advantages)
    assert_per_token(adv.returns, returns)


def hand_group_advantages(sequence_rewards: list[float], estimator: str, k: int = 2) -> list[float]:
    out = []
    for g in range(0, len(sequence_rewards), k):
        group = sequence_rewards[g : g + k]
        mean = sum(group) / k
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (k - 1))
        for x in group:
            if estimator == "rloo":
                out.append(x - (sum(group) - x) / (k - 1))
            else:
                out.append((x - mean) / (std + GRPO_EPS))
    return out


@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
@pytest.mark.parametrize("kl_penalty", ["reward", "loss"])
@pytest.mark.parametrize("whiten_advantages", [False, True])
def test_group_advantages_by_hand(estimator, kl_penalty, whiten_advantages):
    """R_i = score_i - kl_coef * sum_t KL_it (KL only with the penalty in the reward), a group
    baseline over the 2 consecutive samples of a prompt, shared by every real token."""
    cfg = PPOConfig(advantage_estimator=estimator, kl_penalty=kl_penalty, kl_estimator="k3",
                    whiten_advantages=whiten_advantages)
    rollout = make_rollout(with_values=False)
    kl = hand_token_kl("k3")
    coef = KL_COEF if kl_penalty == "reward" else 0.0
    sequence_rewards = [SCORES[i] - coef * sum(kl[i]) for i in range(B)]
    per_sequence = hand_group_advantages(sequence_rewards, estimator)
    advantages = [[per_sequence[i]] * len(REAL[i]) for i in range(B)]
    if whiten_advantages:
        advantages = hand_whiten(advantages, shift_mean=True)

    adv = compute_advantages(rollout, cfg, KL_COEF, rollout.scores, group_size=2)

    assert adv.returns is None
    assert adv.reward_kl_coef == coef
    assert_per_token(adv.kl, kl)
    assert_per_token(adv.advantages, advantages)


# ---- one ppo_update step -----------------------------------------------------------------------

UPDATE_CASES = {
    # both clipping branches (A > 0 past 1 + eps, A < 0 below 1 - eps), value clipping, vf_coef
    "clipped": dict(),
    "dual-clip": dict(dual_clip=3.0),
    "no-value-clip": dict(clip_value_loss=False),
    "entropy-bonus": dict(entropy_coef=0.3),
    "kl-loss-k1": dict(kl_penalty="loss", kl_estimator="k1", kl_coef=0.2),
    "kl-loss-k2": dict(kl_penalty="loss", kl_estimator="k2", kl_coef=0.2),
    "kl-loss-k3": dict(kl_penalty="loss", kl_estimator="k3", kl_coef=0.2),
    "grad-clip": dict(max_grad_norm=0.05),
    "sequence": dict(loss_aggregation="sequence", dual_clip=3.0, entropy_coef=0.3, kl_penalty="loss", kl_coef=0.2),
    "everything": dict(dual_clip=3.0, entropy_coef=0.3, kl_penalty="loss", kl_estimator="k3", kl_coef=0.2,
                       max_grad_norm=0.05, value_clip_eps=0.1, vf_coef=0.7, clip_eps=0.15),
}
BASE = dict(num_epochs=1, num_minibatches=1, clip_eps=0.2, value_clip_eps=0.2, vf_coef=0.5, max_grad_norm=1e6)


@pytest.mark.parametrize("case", list(UPDATE_CASES))
@pytest.mark.parametrize("micro,together", [(4, False), (1, False), (3, False), (4, True), (2, True)],
                         ids=["one-micro", "micro-1", "micro-3-1", "together", "together-micro-2"])
def test_one_sgd_step_is_minus_lr_times_the_hand_gradient(case, micro, together):
    """One minibatch, plain SGD: every parameter moves by -lr x the (per-group clipped) gradient
    of the hand-written loss, whatever the micro-batch split and whether the roles share a
    forward; every logged stat is its hand value."""
    cfg = PPOConfig(**{**BASE, **UPDATE_CASES[case]})
    kl_coef = cfg.kl_coef
    roles = TableRoles()
    h = Hand.start()
    expected = hand_update(h, cfg, kl_coef, seeded_minibatches(1))
    # the fixed numbers hit what the case is about
    assert 0 < expected["clipfrac"] < 1
    assert 0 < expected["value_clipfrac"] < 1 if cfg.clip_value_loss else expected["value_clipfrac"] == 0
    if cfg.dual_clip:
        assert expected["dual_clipfrac"] > 0
    if cfg.max_grad_norm < 1:
        assert expected["policy_grad_norm"] > cfg.max_grad_norm and expected["value_grad_norm"] > cfg.max_grad_norm

    stats = run_update(roles, make_rollout(), make_advantages(), cfg, kl_coef, micro, together, checkpointing=True)

    assert_matches_hand(roles, stats, h, expected, split=micro < B, cfg=cfg)
    assert roles.checkpointing == [True]


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("micro", [2, 1])
def test_two_minibatches_the_second_starts_where_the_first_stepped(aggregation, micro):
    """num_minibatches 2: two SGD steps, the second at the parameters the first left; each loss
    normalised by its own minibatch's real tokens (or rows); stats token-weighted over both; the
    grad norms are the last minibatch's; the logprob self-check covers the first minibatch only."""
    cfg = PPOConfig(**{**BASE, "num_minibatches": 2, "loss_aggregation": aggregation, "dual_clip": 3.0,
                       "entropy_coef": 0.3, "kl_penalty": "loss", "kl_estimator": "k3", "kl_coef": 0.2,
                       "max_grad_norm": 0.2})
    minibatches = seeded_minibatches(2)
    assert minibatches[0] != [0, 1]  # so an update that did not shuffle would show
    # the two minibatches hold different numbers of real tokens, so the normaliser matters
    assert len({sum(LENGTHS[i] for i in rows) for rows in minibatches}) == 2
    roles = TableRoles()
    h = Hand.start()
    expected = hand_update(h, cfg, cfg.kl_coef, minibatches)

    stats = run_update(roles, make_rollout(), make_advantages(), cfg, cfg.kl_coef, micro)

    assert_matches_hand(roles, stats, h, expected, split=micro < B // 2, cfg=cfg)


@pytest.mark.parametrize("action", ["skip", "scale"])
def test_ratio_threshold_skips_or_scales_the_policy_step_only(action):
    """Mean ratio 12/9 > threshold 1.2: `skip` leaves the policy where it was (the value still
    steps); `scale` multiplies the policy gradient by 1.2 / (12/9) before clipping."""
    cfg = PPOConfig(**{**BASE, "ratio_threshold": 1.2, "ratio_threshold_action": action, "entropy_coef": 0.3})
    roles = TableRoles()
    h = Hand.start()
    expected = hand_update(h, cfg, cfg.kl_coef, seeded_minibatches(1))
    assert expected["ratio"] == pytest.approx(12.0 / 9.0)

    stats = run_update(roles, make_rollout(), make_advantages(), cfg, cfg.kl_coef, micro=2)

    assert_matches_hand(roles, stats, h, expected)
    if action == "skip":
        torch.testing.assert_close(roles.theta.detach(), torch.tensor(THETA0, dtype=DT), atol=0, rtol=0)
        assert stats.policy_grad_norm == 0.0 and stats.skipped_minibatch_frac == 1.0
    else:
        assert stats.scaled_minibatch_frac == 1.0
    assert not torch.equal(roles.w.detach(), torch.tensor(W0, dtype=DT))


def test_ratio_threshold_above_the_mean_ratio_does_nothing():
    cfg = PPOConfig(**{**BASE, "ratio_threshold": 1.5, "ratio_threshold_action": "skip"})
    roles = TableRoles()
    h = Hand.start()
    expected = hand_update(h, cfg, cfg.kl_coef, seeded_minibatches(1))
    stats = run_update(roles, make_rollout(), make_advantages(), cfg, cfg.kl_coef)
    assert_matches_hand(roles, stats, h, expected)
    assert stats.skipped_minibatch_frac == 0.0 and stats.scaled_minibatch_frac == 0.0


def test_entropy_bonus_raises_the_entropy():
    """With zero advantages and no KL term the policy loss is -coef * entropy: a step must make
    every position's distribution flatter (and by exactly the hand gradient)."""
    zero = [[0.0] * len(REAL[i]) for i in range(B)]
    cfg = PPOConfig(**{**BASE, "entropy_coef": 0.5})
    roles = TableRoles()
    h = Hand.start(adv=zero)
    expected = hand_update(h, cfg, cfg.kl_coef, seeded_minibatches(1))
    stats = run_update(roles, make_rollout(), make_advantages(advantages=zero), cfg, cfg.kl_coef)
    assert_matches_hand(roles, stats, h, expected)
    for t in range(T):
        before = float(hand_entropy(torch.tensor(THETA0[t], dtype=DT), TEMPERATURE))
        after = float(hand_entropy(roles.theta.detach()[t], TEMPERATURE))
        assert after > before + 1e-4, t


def test_kl_loss_pulls_toward_the_reference_not_the_rollout_policy():
    """ref = the stand-in's initial policy, old elsewhere: the k3 KL to the reference is 0 with
    zero gradient at the start, so with zero advantages the policy must not move at all (a KL
    measured against the old logprobs would move it)."""
    zero = [[0.0] * len(REAL[i]) for i in range(B)]
    at_start = [[initial_logprob(i, t) for t in REAL[i]] for i in range(B)]
    cfg = PPOConfig(**{**BASE, "kl_penalty": "loss", "kl_estimator": "k3", "kl_coef": 0.5})
    roles = TableRoles()
    stats = run_update(roles, make_rollout(ref=at_start), make_advantages(advantages=zero), cfg, cfg.kl_coef)
    torch.testing.assert_close(roles.theta.detach(), torch.tensor(THETA0, dtype=DT), **TOL)
    assert stats.kl_loss == pytest.approx(0.0, abs=1e-12)
    assert stats.policy_grad_norm == pytest.approx(0.0, abs=1e-12)


def test_critic_free_update_has_no_value_step_or_stats():
    """RLOO / GRPO: no returns, no value parameters; the policy step is still the hand one."""
    cfg = PPOConfig(**{**BASE, "advantage_estimator": "rloo", "entropy_coef": 0.3})
    roles = TableRoles(with_value=False)
    h = Hand.start(returns=None)
    expected = hand_update(h, cfg, cfg.kl_coef, seeded_minibatches(1))
    stats = run_update(roles, make_rollout(with_values=False), make_advantages(with_critic=False), cfg,
                       cfg.kl_coef, micro=2)
    assert_matches_hand(roles, stats, h, expected)
    assert stats.value_loss is None and stats.value_grad_norm is None and stats.value_clipfrac is None


NONFINITE_JUNK = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30]


@pytest.mark.parametrize("junk", NONFINITE_JUNK, ids=str)
@pytest.mark.parametrize("kl", ["reward", "loss-k1"])
def test_junk_in_padding_changes_nothing(junk, kl):
    """NaN, inf or 1e30 in the padding of the old and reference logprobs and the rollout values:
    the step and every stat are still the hand ones (padding never counts, not even as 0 * NaN)."""
    extra = {"kl_penalty": "loss", "kl_estimator": "k1", "kl_coef": 0.2} if kl == "loss-k1" else {}
    cfg = PPOConfig(**{**BASE, **extra, "dual_clip": 3.0, "entropy_coef": 0.3, "max_grad_norm": 0.05})
    roles = TableRoles()
    h = Hand.start()
    expected = hand_update(h, cfg, cfg.kl_coef, seeded_minibatches(1))
    stats = run_update(roles, make_rollout(junk=junk), make_advantages(), cfg, cfg.kl_coef, micro=2, together=True)
    assert_matches_hand(roles, stats, h, expected)


@pytest.mark.parametrize("estimator,junk", [("k2", float("nan")), ("k3", float("nan")), ("k3", float("inf")),
                                            ("k3", 1e30)], ids=["k2-nan", "k3-nan", "k3-inf", "k3-1e30"])
def test_junk_in_reference_padding_leaves_the_kl_loss_step_unchanged(estimator, junk):
    cfg = PPOConfig(**{**BASE, "kl_penalty": "loss", "kl_estimator": estimator, "kl_coef": 0.2})
    roles = TableRoles()
    h = Hand.start()
    expected = hand_update(h, cfg, cfg.kl_coef, seeded_minibatches(1))
    rollout = dataclasses.replace(make_rollout(), ref_logprobs=padded(default_ref(), junk))
    stats = run_update(roles, rollout, make_advantages(), cfg, cfg.kl_coef)
    assert stats.nonfinite is None, f"the minibatch was dropped: {stats.nonfinite} is non-finite"
    assert_matches_hand(roles, stats, h, expected)


# ---- the pieces --------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_minibatch_backward_leaves_the_hand_gradients_and_mean_ratio(aggregation):
    """Rows [3, 1] (1 + 2 real tokens) in micro-batches of one row: the accumulated gradients are
    those of the minibatch loss normalised by the minibatch's 3 tokens (or 2 rows), unclipped."""
    cfg = PPOConfig(**{**BASE, "loss_aggregation": aggregation, "entropy_coef": 0.3, "kl_penalty": "loss",
                       "kl_coef": 0.2, "dual_clip": 3.0})
    rows = [3, 1]
    g_policy, g_value, want, _ = hand_minibatch(Hand.start(), rows, cfg, cfg.kl_coef)
    roles = TableRoles()
    means = _TokenWeightedMeans()
    check = LogprobCheck()
    settings = UpdateSettings(2, 1, TEMPERATURE, False)

    mean_ratio, bad = minibatch_backward(roles, make_rollout(), make_advantages(), torch.tensor(rows), cfg, settings,
                                         cfg.kl_coef, means, World(), check)

    assert bad is None
    assert mean_ratio == pytest.approx((1.25 + 0.7 + 1.5) / 3, rel=1e-9)
    torch.testing.assert_close(roles.theta.grad, g_policy[0], **TOL)
    torch.testing.assert_close(roles.w.grad, g_value[0], **TOL)
    torch.testing.assert_close(roles.c.grad, g_value[1], **TOL)
    for key, name in [("clipfrac", "clipfrac"), ("ratio", "ratio"), ("entropy", "entropy"),
                      ("approxkl", "approxkl"), ("value_clipfrac", "value_clipfrac")]:
        assert means.mean(key) == pytest.approx(want[name], rel=1e-5, abs=1e-6), key
    for key, name in [("loss/policy", "policy_loss"), ("loss/value", "value_loss"), ("loss/kl", "kl_loss")]:
        assert means.mean(key) == pytest.approx(want[name], rel=1e-5, abs=1e-6), key
    assert means.weights["ratio"] == 3
    diffs = [abs(math.log(r)) for r in (1.25, 0.7, 1.5)]
    assert check.over(World()) == pytest.approx((max(diffs), sum(diffs) / 3), rel=1e-9)


def test_sequence_aggregation_logs_the_minibatch_loss_whatever_the_micro_batches():
    """The logged loss is the loss the step minimised: under sequence aggregation, the mean over
    the minibatch's responses of each response's mean token loss, with one micro-batch or two."""
    cfg = PPOConfig(**{**BASE, "loss_aggregation": "sequence", "kl_penalty": "loss", "kl_coef": 0.2})
    expected = hand_update(Hand.start(), cfg, cfg.kl_coef, seeded_minibatches(1))
    stats = run_update(TableRoles(), make_rollout(), make_advantages(), cfg, cfg.kl_coef, micro=2)
    assert stats.policy_loss == pytest.approx(expected["policy_loss"], rel=1e-5, abs=1e-6)
    assert stats.value_loss == pytest.approx(expected["value_loss"], rel=1e-5, abs=1e-6)
    assert stats.kl_loss == pytest.approx(expected["kl_loss"], rel=1e-5, abs=1e-6)


def _roles_with_grads(g_theta, g_w, g_c) -> TableRoles:
    roles = TableRoles()
    for p, g in zip([roles.theta, roles.w, roles.c], [g_theta, g_w, g_c]):
        p.grad = torch.tensor(g, dtype=DT)
    return roles


G_THETA = [[0.3, -0.4, 0.0], [1.2, 0.0, -0.5], [0.0, 0.0, 0.0]]  # norm sqrt(0.09+0.16+1.44+0.25) = sqrt(1.94)
G_W, G_C = [0.6, -0.8, 0.0], 0.0  # value group norm 1.0


@pytest.mark.parametrize("action,max_norm", [(None, 0.5), (None, 10.0), ("skip", 0.5), ("scale", 0.5), ("scale", 10.0)])
def test_optimizer_step_clips_each_adapter_on_its_own(action, max_norm):
    """SGD lr 0.1 on hand gradients: the policy group (norm sqrt 1.94) and the value group
    (norm 1) each scaled to max_norm / (norm + 1e-6) when they exceed it; `scale` first
    multiplies the policy gradient by threshold / mean ratio = 1.2 / 2.0; `skip` drops it."""
    cfg = PPOConfig(**{**BASE, "max_grad_norm": max_norm, "ratio_threshold": 1.2,
                       "ratio_threshold_action": action or "skip"})
    roles = _roles_with_grads(G_THETA, G_W, G_C)
    optimizer = torch.optim.SGD(roles.policy_parameters() + roles.value_parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    (policy_norm, value_norm), bad = optimizer_step(roles, optimizer, scheduler, cfg, action, 2.0, None)

    factor = {None: 1.0, "skip": 0.0, "scale": 1.2 / 2.0}[action]
    g_theta = torch.tensor(G_THETA, dtype=DT) * factor
    want_policy_norm = math.sqrt(1.94) * factor
    want_policy_coef = min(1.0, max_norm / (want_policy_norm + CLIP_EPS_OF_TORCH))
    want_value_coef = min(1.0, max_norm / (1.0 + CLIP_EPS_OF_TORCH))
    assert bad is None
    assert float(policy_norm) == pytest.approx(want_policy_norm, rel=1e-9, abs=1e-12)
    assert float(value_norm) == pytest.approx(1.0, rel=1e-9)
    torch.testing.assert_close(roles.theta.detach(), torch.tensor(THETA0, dtype=DT) - LR * want_policy_coef * g_theta,
                               **TOL)
    torch.testing.assert_close(roles.w.detach(), torch.tensor(W0, dtype=DT)
                               - LR * want_value_coef * torch.tensor(G_W, dtype=DT), **TOL)
    assert all(p.grad is None for p in roles.policy_parameters() + roles.value_parameters())
    assert scheduler.last_epoch == 1


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_optimizer_step_drops_a_nonfinite_gradient_and_still_counts_the_schedule():
    cfg = PPOConfig(**BASE)
    roles = _roles_with_grads([[float("inf"), 0.0, 0.0], [0.0] * 3, [0.0] * 3], G_W, G_C)
    optimizer = torch.optim.SGD(roles.policy_parameters() + roles.value_parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    _, bad = optimizer_step(roles, optimizer, scheduler, cfg, None, 1.0, None)
    assert bad == "policy/grad_norm"
    torch.testing.assert_close(roles.theta.detach(), torch.tensor(THETA0, dtype=DT), atol=0, rtol=0)
    torch.testing.assert_close(roles.w.detach(), torch.tensor(W0, dtype=DT), atol=0, rtol=0)
    assert scheduler.last_epoch == 1


@pytest.mark.parametrize("threshold,action,mean_ratio,want", [
    (None, "skip", 5.0, None), (1.5, "skip", 1.6, "skip"), (1.5, "scale", 1.6, "scale"),
    (1.5, "skip", 1.5, None), (1.5, "scale", 1.4, None), (1.5, "skip", 0.2, None),
])
def test_ratio_threshold_action(threshold, action, mean_ratio, want):
    cfg = PPOConfig(ratio_threshold=threshold, ratio_threshold_action=action)
    assert ratio_threshold_action(cfg, mean_ratio) == want


def test_logprob_check_takes_real_tokens_only():
    check = LogprobCheck()
    mask = torch.tensor([[True, True, False], [True, False, False]])
    new = torch.tensor([[-1.0, -2.0, 50.0], [-0.5, 9.0, 9.0]], dtype=DT)
    old = torch.tensor([[-1.25, -1.5, 0.0], [-0.5, 0.0, 0.0]], dtype=DT)
    check.add(new, old, mask)
    check.add(new[1:], torch.tensor([[-0.4, 0.0, 0.0]], dtype=DT), mask[1:])
    # |diffs| 0.25, 0.5, 0.0, then 0.1
    assert check.over(World()) == pytest.approx((0.5, 0.85 / 4), rel=1e-9)
    assert LogprobCheck().over(World()) == (0.0, 0.0)


def test_update_stats_metric_names():
    stats = UpdateStats(skipped_minibatches=1, policy_loss=0.5, clipfrac=0.25, approxkl=0.01, ratio=1.1,
                        value_loss=2.0, policy_grad_norm=3.0, logprob_max_diff=1e-3)
    assert stats.as_metrics() == {
        "loss/policy": 0.5, "policy/clipfrac": 0.25, "policy/approxkl": 0.01, "policy/ratio": 1.1,
        "loss/value": 2.0, "guard/skipped_minibatches": 1.0, "policy/grad_norm": 3.0,
        "check/logprob_max_diff": 1e-3,
    }


def test_the_self_check_reports_nan_logprobs():
    """A NaN among the new logprobs is the check's to report: Python's max() would drop it."""
    check = LogprobCheck()
    mask = torch.tensor([[True, True, False]])
    check.add(torch.tensor([[-1.0, float("nan"), -2.0]]), torch.tensor([[-1.5, -1.0, 0.0]]), mask)
    check.add(torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-4.0, -1.0, 0.0]]), mask)
    largest, mean = check.over(World())
    assert math.isnan(largest) and math.isnan(mean)


# ---- what only some inputs reach ---------------------------------------------------------------


@pytest.mark.parametrize("action", ["skip", "scale"])
def test_ratio_threshold_fractions_are_shares_of_the_minibatches(action):
    """Two minibatches and a threshold between their mean ratios: one of the two acts, so the
    logged fraction is 1/2 and the other minibatch steps as usual."""
    settings = {**BASE, "num_minibatches": 2, "entropy_coef": 0.3}
    ratios = hand_update(Hand.start(), PPOConfig(**settings), 0.0, seeded_minibatches(2))["minibatch_ratios"]
    cfg = PPOConfig(**settings, ratio_threshold=sum(ratios) / 2, ratio_threshold_action=action)
    h = Hand.start()
    expected = hand_update(h, cfg, cfg.kl_coef, seeded_minibatches(2))
    assert expected[f"{'skipped' if action == 'skip' else 'scaled'}_minibatch_frac"] == 0.5

    roles = TableRoles()
    stats = run_update(roles, make_rollout(), make_advantages(), cfg, cfg.kl_coef, micro=1)

    assert_matches_hand(roles, stats, h, expected)


def test_gradients_left_on_the_parameters_do_not_leak_into_the_step():
    """A caller (or an earlier evaluation) that left gradients on the adapters: the update's
    first step is still -lr x the hand gradient."""
    cfg = PPOConfig(**BASE)
    roles = TableRoles()
    for p in roles.policy_parameters() + roles.value_parameters():
        p.grad = torch.full_like(p, 5.0)
    h = Hand.start()
    expected = hand_update(h, cfg, cfg.kl_coef, seeded_minibatches(1))

    stats = run_update(roles, make_rollout(), make_advantages(), cfg, cfg.kl_coef)

    assert_matches_hand(roles, stats, h, expected)


@pytest.mark.parametrize("probes,stacked", [
    ({False: True, True: True}, True),
    ({False: True, True: False}, False),  # mixed batches work without autograd only: one pass per role
    ({False: False, True: True}, True),
], ids=["both", "no-grad-only", "grad-only"])
def test_roles_share_a_forward_only_where_the_probe_with_autograd_passed(probes, stacked):
    """ppo.update_roles_together stacks the policy and value rows in one forward only when the
    load-time probe found mixed-adapter batches right with autograd (the update's case); the
    step is the hand one either way."""
    cfg = PPOConfig(**BASE)
    roles = TableRoles()
    roles.mixed_batches = probes
    h = Hand.start()
    expected = hand_update(h, cfg, cfg.kl_coef, seeded_minibatches(1))

    stats = run_update(roles, make_rollout(), make_advantages(), cfg, cfg.kl_coef, micro=2, together=True)

    assert_matches_hand(roles, stats, h, expected)
    assert (roles.stacked_forwards > 0) == stacked


@pytest.mark.parametrize("together", [False, True], ids=["one-pass-per-role", "together"])
@pytest.mark.parametrize("broken,name", [("returns", "loss/value"), ("advantages", "loss/policy")])
def test_a_nonfinite_loss_is_named_and_its_minibatch_dropped(broken, name, together):
    """A NaN return makes the value loss NaN, a NaN advantage the policy loss: the guard names
    that loss, skips the minibatch's step and leaves every parameter where it was."""
    returns = [row[:] for row in RETURNS]
    advantages = [row[:] for row in ADVANTAGES]
    {"returns": returns, "advantages": advantages}[broken][2][1] = float("nan")
    roles = TableRoles()

    stats = run_update(roles, make_rollout(), make_advantages(advantages, returns), PPOConfig(**BASE), 0.0,
                       micro=2, together=together)

    assert stats.nonfinite == name and stats.skipped_minibatches == 1
    torch.testing.assert_close(roles.theta.detach(), torch.tensor(THETA0, dtype=DT), atol=0, rtol=0)
    torch.testing.assert_close(roles.w.detach(), torch.tensor(W0, dtype=DT), atol=0, rtol=0)


@dataclass(frozen=True)
class RankZeroOfTwo(World):
    """Process 0 of a two-process run whose process 1 contributed `peer_tensor` to sums and
    `peer_object` to gathers (the collectives without a process group)."""

    peer_tensor: Optional[torch.Tensor] = None
    peer_object: object = None

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return values + self.peer_tensor

    def gather(self, obj):
        return [obj, self.peer_object]


def test_logged_means_add_up_both_processes_sums_and_weights():
    """Per key: (own sum + peer sum) / (own weight + peer weight); keys travel in sorted order,
    sums first, then weights."""
    means = _TokenWeightedMeans()
    means.add({"ratio": 1.5, "loss/policy": -0.25}, 4.0)  # sums 6.0 and -1.0, weights 4 and 4
    means.add({"loss/policy": 0.5}, 2.0)  # loss/policy: sum 0.0, weight 6
    # process 1, in sorted key order (loss/policy, ratio): sums 3.0, 1.0; weights 2.0, 1.0
    world = RankZeroOfTwo(rank=0, size=2, peer_tensor=torch.tensor([3.0, 1.0, 2.0, 1.0], dtype=torch.float64))

    total = means.summed_over(world)

    assert total.mean("loss/policy") == pytest.approx(3.0 / 8.0, rel=1e-12)
    assert total.mean("ratio") == pytest.approx(7.0 / 5.0, rel=1e-12)


@pytest.mark.parametrize("own,peer,want", [
    ((0.5, 0.75, 3.0), (0.9, 0.1, 1.0), (0.9, 0.85 / 4)),
    ((0.0, 0.0, 0.0), (0.3, 0.3, 1.0), (0.3, 0.3)),  # one real token in the whole run
    ((0.0, 0.0, 0.0), (0.0, 0.0, 0.0), (0.0, 0.0)),  # none at all
], ids=["both", "one-token", "none"])
def test_the_self_check_is_over_both_processes(own, peer, want):
    """The largest difference of either process, and the mean over all their real tokens."""
    check = LogprobCheck(*own)
    assert check.over(RankZeroOfTwo(rank=0, size=2, peer_object=peer)) == pytest.approx(want, rel=1e-12)
