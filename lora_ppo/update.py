"""Advantages and the clipped PPO update: epochs x minibatches x micro-batches of policy and
value losses on the trainable adapters, with the NaN/inf guard, returning an `UpdateStats`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from lora_ppo import ppo_math
from lora_ppo.compiled_update import CompiledLayers
from lora_ppo.config import PPOConfig
from lora_ppo.distributed import World
from lora_ppo.padding import MicroBatch, micro_batches
from lora_ppo.roles import POLICY, VALUE, Role, RoleModel
from lora_ppo.rollout import Rollout


@dataclass(frozen=True)
class Advantages:
    """What the update needs besides the rollout. Per-token tensors are [B, T_resp], 0 on padding."""

    scores: torch.Tensor  # [B] shaped scores the optimiser sees
    rewards: torch.Tensor  # per-token rewards (KL-shaped when the penalty is in the reward)
    kl: torch.Tensor  # per-token KL estimate of the rollout policy to the reference
    advantages: torch.Tensor
    returns: Optional[torch.Tensor]  # value targets; None without a critic
    reward_kl_coef: float  # the KL coefficient inside the reward (0 when the penalty is a loss term)


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
        scores, rollout.old_logprobs, rollout.ref_logprobs, mask, reward_kl_coef, cfg.kl_estimator,
        rollout.turn_rewards,
    )
    if cfg.advantage_estimator == "gae":
        if cfg.whiten_rewards:
            rewards = ppo_math.masked_whiten(rewards, mask, shift_mean=False)
        advantages, returns = ppo_math.gae(rollout.values, rewards, mask, cfg.gamma, cfg.lam)
    else:
        # A sequence's return is its score (and an episode's turn rewards) minus its KL penalty;
        # every action token shares the advantage.
        sequence_rewards = scores - reward_kl_coef * kl.sum(dim=1)
        if rollout.turn_rewards is not None:
            sequence_rewards = sequence_rewards + torch.where(mask, rollout.turn_rewards, 0.0).sum(dim=1)
        per_sequence = ppo_math.group_advantages(sequence_rewards, group_size, cfg.advantage_estimator)
        advantages = torch.where(mask, per_sequence[:, None].expand_as(mask), torch.zeros_like(rewards))
        returns = None
    if cfg.whiten_advantages:
        advantages = ppo_math.masked_whiten(advantages, mask)
    return Advantages(scores, rewards, kl, advantages, returns, reward_kl_coef)


def first_nonfinite(rollout: Rollout, adv: Advantages) -> Optional[str]:
    """The name of the first rollout or advantage quantity holding a NaN/inf on a real token
    (padding may hold anything), or None when all are finite."""
    mask = rollout.response_mask
    per_sequence = {"rewards/scores": rollout.scores, "rewards/shaped_scores": adv.scores}
    if rollout.turn_rewards is not None:
        per_sequence["rewards/turns"] = rollout.turn_rewards.sum(dim=1)
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


@dataclass(frozen=True)
class UpdateStats:
    """One PPO update: token-weighted means over its micro-batches (None where the quantity does
    not exist: no critic, no KL loss term, no ratio threshold) and what the guard did."""

    skipped_minibatches: int  # minibatches dropped by the NaN/inf guard
    nonfinite: Optional[str] = None  # the first quantity that was NaN/inf, if any
    policy_loss: Optional[float] = None
    clipfrac: Optional[float] = None
    dual_clipfrac: Optional[float] = None
    approxkl: Optional[float] = None
    ratio: Optional[float] = None
    entropy: Optional[float] = None
    kl_loss: Optional[float] = None  # the KL penalty as a loss term (ppo.kl_penalty: loss)
    value_loss: Optional[float] = None
    value_clipfrac: Optional[float] = None
    policy_grad_norm: Optional[float] = None
    value_grad_norm: Optional[float] = None
    skipped_minibatch_frac: Optional[float] = None  # ppo.ratio_threshold: share skipped / scaled
    scaled_minibatch_frac: Optional[float] = None
    # The logprob self-check: |new - old| logprobs on the first minibatch, before any optimizer
    # step, where both come from the same weights and must agree up to rounding.
    logprob_max_diff: Optional[float] = None
    logprob_mean_diff: Optional[float] = None
    # Share of the positions the update's forwards computed that were padding (`ppo.trim_padding`).
    padding_frac: Optional[float] = None

    def as_metrics(self) -> dict[str, float]:
        """The grouped metric names of metrics.jsonl; quantities that do not exist are left out."""
        named = {
            "loss/policy": self.policy_loss, "policy/clipfrac": self.clipfrac,
            "policy/dual_clipfrac": self.dual_clipfrac, "policy/approxkl": self.approxkl,
            "policy/ratio": self.ratio, "policy/entropy": self.entropy, "loss/kl": self.kl_loss,
            "loss/value": self.value_loss, "value/clipfrac": self.value_clipfrac,
            "guard/skipped_minibatches": float(self.skipped_minibatches),
            "policy/grad_norm": self.policy_grad_norm, "value/grad_norm": self.value_grad_norm,
            "policy/skipped_minibatch_frac": self.skipped_minibatch_frac,
            "policy/scaled_minibatch_frac": self.scaled_minibatch_frac,
            "check/logprob_max_diff": self.logprob_max_diff, "check/logprob_mean_diff": self.logprob_mean_diff,
            "update/padding_frac": self.padding_frac,
        }
        return {key: value for key, value in named.items() if value is not None}


def read_floats(values: list) -> list[float]:
    """Python floats of 0-d tensors (and floats, passed through), read from the device in one
    transfer: each tensor's own read would wait for the GPU's queue to drain
    (docs/performance.md#the-updates-reads)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    # float32 -> float64 is exact: the same numbers float(tensor) gives, one read for all
    read = iter(torch.stack([t.detach().reshape(()).to(torch.float64) for t in tensors]).tolist())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]


@dataclass
class _TokenWeightedMeans:
    """Running weighted sums of per-micro-batch statistics: each key by the weight it was added
    with (real tokens; a loss under sequence aggregation, rows). Values may be 0-d tensors: they
    are read from the device together, when a mean or the sums are asked for."""

    sums: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    _pending: list[tuple[str, object, float]] = field(default_factory=list)

    def add(self, values: dict, weight: float) -> None:
        for key, value in values.items():
            self._pending.append((key, value, weight))
            self.weights[key] = self.weights.get(key, 0.0) + weight

    def _settle(self) -> None:
        """Fold the pending values into the sums, in the order they were added."""
        pending, self._pending = self._pending, []
        for (key, _, weight), value in zip(pending, read_floats([v for _, v, _ in pending])):
            self.sums[key] = self.sums.get(key, 0.0) + value * weight

    def mean(self, key: str) -> Optional[float]:
        self._settle()
        return self.sums[key] / max(self.weights[key], 1e-12) if key in self.sums else None

    def summed_over(self, world: World) -> "_TokenWeightedMeans":
        """The sums of every process's micro-batches (they all log the same keys)."""
        self._settle()
        if world.size == 1:
            return self
        keys = sorted(self.sums)
        totals = world.sum(torch.tensor([self.sums[k] for k in keys] + [self.weights[k] for k in keys],
                                        dtype=torch.float64, device=world.device)).tolist()
        return _TokenWeightedMeans(dict(zip(keys, totals[:len(keys)])), dict(zip(keys, totals[len(keys):])))


@dataclass
class LogprobCheck:
    """|new - old| logprobs over the real tokens of the update's first minibatch: the policy the
    update computes must be the one that sampled (same weights, ratio 1). A wrong logit transform,
    dropout, or a scoring pass that differs from the update's forward shows here at step 1.
    What `add` is given stays on the device until `over` reads it."""

    max_diff: float = 0.0
    diff_sum: float = 0.0
    tokens: float = 0.0
    _pending: list[tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=list)

    def add(self, new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
            tokens: Optional[float] = None) -> None:
        """`tokens`: the real tokens in `mask` where the caller counted them on the host."""
        tokens = float(mask.sum()) if tokens is None else tokens
        if tokens:
            diff = torch.where(mask, (new_logprobs.detach() - old_logprobs).abs(), 0.0)  # padding: 0
            self._pending.append((diff.max(), diff.sum(), tokens))  # max propagates a NaN

    def over(self, world: World) -> tuple[float, float]:
        """(max, mean) over every process's share."""
        pending, self._pending = self._pending, []
        read = read_floats([t for largest, total, _ in pending for t in (largest, total)])
        for i, (_, _, tokens) in enumerate(pending):
            largest = read[2 * i]
            # NaN stays NaN (Python's max would drop it): the alarm and the first-step stop see it.
            self.max_diff = largest if math.isnan(largest) or largest > self.max_diff else self.max_diff
            self.diff_sum += read[2 * i + 1]
            self.tokens += tokens
        if world.size == 1:
            return self.max_diff, self.diff_sum / max(self.tokens, 1.0)
        shares = world.gather((self.max_diff, self.diff_sum, self.tokens))
        return max(m for m, _, _ in shares), sum(s for _, s, _ in shares) / max(sum(t for _, _, t in shares), 1.0)


@dataclass(frozen=True)
class UpdateSettings:
    """The sizes and switches of one update besides `cfg` (they come from other recipe sections)."""

    minibatch_size: int
    micro_batch_size: int
    temperature: float  # the sampling temperature: new logprobs must be on the same scale
    gradient_checkpointing: bool
    roles_together: bool = False  # ppo.update_roles_together
    compiled_layers: Optional[CompiledLayers] = None  # ppo.compile_update: the compiled layer step


@dataclass(frozen=True)
class HostMasks:
    """The rollout's masks in host memory, read once per update: every count and column cut of a
    micro-batch comes from these, so no micro-batch waits for the GPU to say how long its rows are."""

    attention: torch.Tensor  # [B, P + T_resp]
    response: torch.Tensor  # [B, T_resp]

    @classmethod
    def of(cls, rollout: Rollout) -> "HostMasks":
        return cls(rollout.attention_mask.cpu(), rollout.response_mask.cpu())


def ppo_update(
    roles: RoleModel,
    optimizer: torch.optim.Optimizer,
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler],
    rollout: Rollout,
    adv: Advantages,
    cfg: PPOConfig,
    settings: UpdateSettings,
    kl_coef: float,
    generator: torch.Generator,
    world: World = World(),
) -> UpdateStats:
    """num_epochs x minibatches (in a seeded random order) of clipped policy and value losses.

    Losses are normalised by the whole minibatch's token (or sequence) count, so splitting a
    minibatch into micro-batches (gradient accumulation), or over processes (each takes its share
    of the rows; the gradients are summed before the step), does not change the update.
    """
    batch = rollout.response_ids.shape[0]
    means = _TokenWeightedMeans()
    check = LogprobCheck()
    nonfinite: list[str] = []
    minibatches = skipped = scaled = 0
    norms = (torch.zeros(()), torch.zeros(()))
    host = HostMasks.of(rollout)
    with roles.gradient_checkpointing(settings.gradient_checkpointing, settings.compiled_layers):
        for _epoch in range(cfg.num_epochs):
            order = torch.randperm(batch, generator=generator)  # on the host, as the counts are
            for rows in order.split(settings.minibatch_size):
                optimizer.zero_grad(set_to_none=True)
                mean_ratio, bad = minibatch_backward(roles, rollout, adv, rows, cfg, settings, kl_coef, means, world,
                                                     check if minibatches == 0 else None, host)
                world.sum_gradients(roles.policy_parameters() + roles.value_parameters())
                minibatches += 1
                action = ratio_threshold_action(cfg, mean_ratio)
                skipped += action == "skip"
                scaled += action == "scale"
                norms, bad = optimizer_step(roles, optimizer, scheduler, cfg, action, mean_ratio, bad)
                if bad is not None:
                    nonfinite.append(bad)
    means = means.summed_over(world)
    logprob_max_diff, logprob_mean_diff = check.over(world)
    with_critic = adv.returns is not None
    with_ratio_threshold = cfg.ratio_threshold is not None
    return UpdateStats(
        skipped_minibatches=len(nonfinite),
        nonfinite=nonfinite[0] if nonfinite else None,
        policy_loss=means.mean("loss/policy"), clipfrac=means.mean("clipfrac"),
        dual_clipfrac=means.mean("dual_clipfrac"), approxkl=means.mean("approxkl"), ratio=means.mean("ratio"),
        entropy=means.mean("entropy"), kl_loss=means.mean("loss/kl"), value_loss=means.mean("loss/value"),
        value_clipfrac=means.mean("value_clipfrac"),
        policy_grad_norm=float(norms[0]), value_grad_norm=float(norms[1]) if with_critic else None,
        skipped_minibatch_frac=skipped / max(1, minibatches) if with_ratio_threshold else None,
        scaled_minibatch_frac=scaled / max(1, minibatches) if with_ratio_threshold else None,
        logprob_max_diff=logprob_max_diff, logprob_mean_diff=logprob_mean_diff,
        padding_frac=means.mean("padding_frac"),
    )


def minibatch_backward(
    roles: RoleModel,
    rollout: Rollout,
    adv: Advantages,
    rows: torch.Tensor,
    cfg: PPOConfig,
    settings: UpdateSettings,
    kl_coef: float,
    means: _TokenWeightedMeans,
    world: World = World(),
    check: Optional[LogprobCheck] = None,
    host: Optional[HostMasks] = None,
) -> tuple[float, Optional[str]]:
    """Accumulate one minibatch's policy and value gradients, a micro-batch at a time; with
    several processes, this one's share of the minibatch's rows. `check`: the logprob self-check
    to add this minibatch's |new - old| logprobs to (the first minibatch of an update). `host`:
    the rollout's masks on the host (`HostMasks.of(rollout)`, made here when not given).

    The micro-batches only queue work: their statistics and loss checks stay on the device, and
    the one read from it is this minibatch's mean ratio and non-finite flags, at the end.

    Returns the minibatch's token-weighted mean ratio and the first non-finite loss (or None),
    both over every process.
    """
    host = host or HostMasks.of(rollout)
    device = rollout.response_ids.device
    rows = rows.cpu()
    token_count_host = max(int(host.response[rows].sum()), 1)  # for the logged shares
    # The losses' normaliser stays the device count it always was (the same rounding), queued, not read.
    token_count = rollout.response_mask[rows.to(device)].sum().clamp(min=1)
    normalizer = token_count if cfg.loss_aggregation == "token" else len(rows)
    with_critic = adv.returns is not None
    ratio_sum = torch.zeros((), device=device)
    finite: list[tuple[str, torch.Tensor]] = []  # (loss name, its finiteness), in the order computed
    mine = rows.tensor_split(world.size)[world.rank]
    for micro in micro_batches(mine, host.attention, host.response, rollout.input_ids, rollout.attention_mask,
                               rollout.response_start, settings.micro_batch_size, roles.packing, roles.trim_padding):
        idx, ids, am, positions = micro.rows, micro.input_ids, micro.attention_mask, micro.position_ids
        n_tokens = float(micro.responses(host.response[micro.host_rows]).sum())
        means.add({"padding_frac": 1.0 - micro.real_positions / micro.positions}, float(micro.positions))
        # Loss parts are shares of the minibatch loss; logged per token they are scaled back up.
        share = n_tokens / token_count_host if cfg.loss_aggregation == "token" else len(idx) / len(rows)
        share = max(share, 1e-12)
        part = _MicroBatch(roles, rollout, adv, micro, cfg, settings, kl_coef, normalizer, share, check, n_tokens)

        if with_critic and settings.roles_together and roles.mixed_batches[True]:
            # One forward and one backward for both trainable roles: each base weight read once.
            with roles.rows_as_roles((POLICY, VALUE), ids.shape[0]), adapters_cast_once(roles, settings, POLICY, VALUE):
                policy_hidden, value_hidden = roles.stacked_hidden_states(ids, am, 2, positions)
                loss, ratio = part.policy_loss(policy_hidden)
                vf_loss = part.value_loss(value_hidden)
                finite += part.finiteness(loss, vf_loss)
                (loss + cfg.vf_coef * vf_loss).backward()
        else:
            with roles.as_role(POLICY), adapters_cast_once(roles, settings, POLICY):
                loss, ratio = part.policy_loss(roles.hidden_states(ids, am, positions))
                finite += part.finiteness(loss, None)
                loss.backward()
            if with_critic:
                with roles.as_role(VALUE), adapters_cast_once(roles, settings, VALUE):
                    vf_loss = part.value_loss(roles.hidden_states(ids, am, positions))
                    finite += part.finiteness(None, vf_loss)
                    (cfg.vf_coef * vf_loss).backward()
        ratio_sum = ratio_sum + ratio * n_tokens
        # A micro-batch's logged loss is its own mean per token (or per response): weighted by its
        # tokens (or responses), the micro-batches' mean is the minibatch's loss whatever the split.
        losses = {k: v for k, v in part.stats.items() if k.startswith("loss/")}
        means.add(losses, n_tokens if cfg.loss_aggregation == "token" else float(len(idx)))
        means.add({k: v for k, v in part.stats.items() if k not in losses}, n_tokens)
    if world.size > 1:
        ratio_sum = world.sum(ratio_sum.to(world.device)).to(device)
    mean_ratio, *flags = read_floats([ratio_sum / token_count, *(flag for _, flag in finite)])
    bad = next((name for (name, _), ok in zip(finite, flags) if not ok), None)
    if world.size > 1:
        bads = [b for b in world.gather(bad) if b is not None]
        bad = bads[0] if bads else None
    return mean_ratio, bad


class _MicroBatch:
    """One micro-batch's losses from its roles' hidden states (of `micro`'s input, with `n_tokens` real
    response tokens), and the stats they log (0-d tensors, read later)."""

    def __init__(self, roles: RoleModel, rollout: Rollout, adv: Advantages,
                 micro: MicroBatch, cfg: PPOConfig, settings: UpdateSettings,
                 kl_coef: float, normalizer, share: float, check: Optional[LogprobCheck], n_tokens: float):
        self.roles, self.rollout, self.adv, self.micro, self.cfg = roles, rollout, adv, micro, cfg
        self.settings, self.kl_coef, self.normalizer, self.share = settings, kl_coef, normalizer, share
        self.check, self.n_tokens = check, n_tokens
        self.mask = self.per_token(rollout.response_mask)
        self.stats: dict[str, torch.Tensor] = {}

    def per_token(self, tensor: torch.Tensor) -> torch.Tensor:
        """This micro-batch's rows and response columns of a rollout's [B, T_resp] tensor."""
        return self.micro.responses(tensor[self.micro.rows])

    def policy_loss(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(clipped policy loss - entropy bonus [+ KL loss], mean ratio) from the policy's hidden states."""
        cfg, m, micro = self.cfg, self.mask, self.micro
        old_logprobs = self.per_token(self.rollout.old_logprobs)
        new_logprobs, entropy = (micro.laid_out(t) for t in self.roles.predicted_logprobs(
            micro.predicting(hidden), micro.targets, self.settings.temperature))
        if self.check is not None:
            self.check.add(new_logprobs, old_logprobs, m, self.n_tokens)
        pg_loss, pg_stats = ppo_math.policy_loss(
            new_logprobs, old_logprobs, self.per_token(self.adv.advantages), m, cfg.clip_eps,
            self.normalizer, cfg.dual_clip, cfg.loss_aggregation,
        )
        loss = pg_loss - cfg.entropy_coef * ppo_math.aggregate_loss(entropy, m, cfg.loss_aggregation, self.normalizer)
        self.stats.update({
            "loss/policy": pg_loss.detach() / self.share,
            "clipfrac": pg_stats["clipfrac"], "dual_clipfrac": pg_stats["dual_clipfrac"],
            "approxkl": pg_stats["approxkl"], "ratio": pg_stats["ratio"],
            "entropy": ppo_math.masked_mean(entropy.detach(), m),
        })
        if cfg.kl_penalty == "loss" and self.kl_coef > 0:
            kl_loss = ppo_math.kl_loss(
                new_logprobs, self.per_token(self.rollout.ref_logprobs), m, self.kl_coef, cfg.kl_estimator,
                self.normalizer, cfg.loss_aggregation,
            )
            loss = loss + kl_loss
            self.stats["loss/kl"] = kl_loss.detach() / self.share
        return loss, pg_stats["ratio"]

    def value_loss(self, hidden: torch.Tensor) -> torch.Tensor:
        """The (clipped) value loss from the value role's hidden states."""
        cfg = self.cfg
        new_values = self.micro.laid_out(self.roles.values_at(self.micro.predicting(hidden)))
        vf_loss, vf_stats = ppo_math.value_loss(
            new_values, self.per_token(self.rollout.values), self.per_token(self.adv.returns), self.mask,
            cfg.value_clip_eps if cfg.clip_value_loss else None, self.normalizer, cfg.loss_aggregation,
        )
        self.stats["loss/value"] = vf_loss.detach() / self.share
        self.stats["value_clipfrac"] = vf_stats["clipfrac"]
        return vf_loss

    @staticmethod
    def finiteness(policy: Optional[torch.Tensor], value: Optional[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """(loss name, whether it is finite) of the losses given, unread."""
        return [(name, torch.isfinite(loss.detach())) for name, loss in (("loss/policy", policy), ("loss/value", value))
                if loss is not None]


def adapters_cast_once(roles: RoleModel, settings: UpdateSettings, *trainable: Role) -> contextlib.AbstractContextManager:
    """Around a micro-batch's forward and backward: with `model.fused_lora`, the trainable roles' adapters
    cast to the compute dtype once (`Backbone.adapters_cast_once`). Compiled layers (`ppo.compile_update`)
    cast inside their own kernels, and a tensor that changes every call would be one more input to guard."""
    if settings.compiled_layers is not None:
        return contextlib.nullcontext()
    return roles.adapters_cast_once([roles.adapter_name(role) for role in trainable])


def ratio_threshold_action(cfg: PPOConfig, mean_ratio: float) -> Optional[str]:
    """"skip" or "scale" when the minibatch's mean ratio passes ppo.ratio_threshold (the policy
    drifted far from the rollout policy on it), else None."""
    if cfg.ratio_threshold is not None and mean_ratio > cfg.ratio_threshold:
        return cfg.ratio_threshold_action
    return None


def optimizer_step(
    roles: RoleModel,
    optimizer: torch.optim.Optimizer,
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler],
    cfg: PPOConfig,
    ratio_action: Optional[str],
    mean_ratio: float,
    bad: Optional[str],
) -> tuple[tuple[torch.Tensor, torch.Tensor], Optional[str]]:
    """Apply the ratio threshold, clip each adapter's gradient norm and step the optimizer,
    unless something is non-finite: then the gradients are dropped and the adapters and the
    optimizer moments stay as they were. The lr schedule counts the minibatch either way.

    Returns ((policy grad norm, value grad norm), the first non-finite quantity or None).
    """
    policy_params, value_params = roles.policy_parameters(), roles.value_parameters()
    if ratio_action == "skip":
        for p in policy_params:
            p.grad = None
    elif ratio_action == "scale":
        for p in policy_params:
            if p.grad is not None:
                p.grad.mul_(cfg.ratio_threshold / mean_ratio)
    policy_norm = torch.nn.utils.clip_grad_norm_(policy_params, cfg.max_grad_norm)
    value_norm = torch.nn.utils.clip_grad_norm_(value_params, cfg.max_grad_norm) if value_params else torch.zeros(())
    if bad is None and not torch.isfinite(policy_norm):
        bad = "policy/grad_norm"
    if bad is None and value_params and not torch.isfinite(value_norm):
        bad = "value/grad_norm"
    if bad is None:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return (policy_norm, value_norm), bad
