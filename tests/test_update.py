"""The PPO update on the real 4-bit tiny model: it moves the two trainable adapters and nothing
else, and its first pass sees exactly the rollout policy."""

from __future__ import annotations

import pytest
import torch

from lora_ppo.config import PPOConfig
from lora_ppo.roles import REFERENCE
from lora_ppo.rollout import Rollout, score_passes
from lora_ppo.update import UpdateSettings, compute_advantages, ppo_update
from tests.conftest import prompt_and_random_response, prompt_rows


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


@pytest.fixture()
def roles(make_roles):
    return make_roles(seed=1, scale=0.5)


def _rollout_for_update(roles, tokenizer):
    prompts = ["This movie was", "The acting in this film", "Honestly", "I"]
    ids, mask, start = prompt_and_random_response(tokenizer, prompts, 6)
    response_mask = torch.ones(4, 6, dtype=torch.bool)
    response_mask[1, 4:] = False  # a response that stopped early
    mask[1, start + 4 :] = 0
    old, ref, values = score_passes(roles, ids, mask, start, 1.0, forward_batch_size=2)
    scores = torch.tensor([1.0, -1.0, 0.5, 2.0])
    return Rollout(
        rows=prompt_rows(tokenizer, prompts), completions=[""] * 4, query_ids=ids[:, :start], query_mask=mask[:, :start],
        response_ids=ids[:, start:], response_mask=response_mask, old_logprobs=old, ref_logprobs=ref,
        values=values, raw_scores=scores, scores=scores, stopped=torch.tensor([False, True, False, False]),
    )


def test_ppo_update_moves_adapters_but_not_base_or_reference(roles, tokenizer):
    rollout = _rollout_for_update(roles, tokenizer)
    cfg = PPOConfig(num_epochs=1, num_minibatches=2, grad_accum_steps=2, learning_rate=1e-2)
    adv = compute_advantages(rollout, cfg, cfg.kl_coef, rollout.scores)
    snapshot = {n: p.detach().clone() for n, p in roles.peft.named_parameters()}
    head_before = roles.value_head.weight.detach().clone()
    with torch.no_grad(), roles.as_role(REFERENCE):
        ref_before, _ = roles.response_logprobs(rollout.input_ids, rollout.attention_mask, rollout.response_start, 1.0)
    optimizer = torch.optim.AdamW(
        [{"params": roles.policy_parameters()}, {"params": roles.value_parameters()}], lr=cfg.learning_rate
    )
    stats = ppo_update(roles, optimizer, None, rollout, adv, cfg, UpdateSettings(2, 1, 1.0, False), cfg.kl_coef,
                       torch.Generator().manual_seed(0))
    after = dict(roles.peft.named_parameters())
    changed = {n for n in snapshot if not torch.equal(snapshot[n], after[n].detach())}
    assert any("lora_B.policy" in n for n in changed)
    assert any("lora_B.value" in n for n in changed)
    assert not torch.equal(head_before, roles.value_head.weight.detach())
    # Only LoRA weights of the two trainable adapters move; the 4-bit base stays as loaded.
    assert all(".policy." in n or ".value." in n for n in changed), sorted(changed)[:5]
    with torch.no_grad(), roles.as_role(REFERENCE):
        ref_after, _ = roles.response_logprobs(rollout.input_ids, rollout.attention_mask, rollout.response_start, 1.0)
    torch.testing.assert_close(ref_before, ref_after, atol=0, rtol=0)
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.as_metrics().values())


@pytest.mark.parametrize("grad_accum_steps", [1, 2, 4])
def test_first_update_sees_rollout_logprobs(roles, tokenizer, grad_accum_steps):
    # One minibatch, one epoch: the update's logprobs are those of the rollout policy, so the
    # ratio is 1 and the approximate KL 0, whatever the micro-batch split.
    rollout = _rollout_for_update(roles, tokenizer)
    cfg = PPOConfig(num_epochs=1, num_minibatches=1, grad_accum_steps=grad_accum_steps)
    adv = compute_advantages(rollout, cfg, cfg.kl_coef, rollout.scores)
    optimizer = torch.optim.SGD(roles.policy_parameters() + roles.value_parameters(), lr=0.0)
    stats = ppo_update(roles, optimizer, None, rollout, adv, cfg, UpdateSettings(4, 4 // grad_accum_steps, 1.0, False),
                       cfg.kl_coef, torch.Generator().manual_seed(0))
    assert abs(stats.ratio - 1.0) < 1e-5
    assert stats.approxkl < 1e-10
    assert stats.clipfrac == 0.0


# ppo.max_kl on a rollout whose responses 0 and 2 have a KL to the reference of HIGH_KL (all on
# their last token) and responses 1 and 3 none: advantages of +1 on the high-KL responses and -1
# on the others move the policy toward the high-KL ones (the KL grows); the opposite signs
# move it away (the KL falls).
HIGH_KL = 4.0
ROLLOUT_KL = HIGH_KL / 2


def _max_kl_run(roles, tokenizer, toward_high_kl: bool, num_epochs: int, max_kl, roles_together: bool = False,
                rounding: float = 0.0):
    from dataclasses import replace

    rollout = _rollout_for_update(roles, tokenizer)
    mask = rollout.response_mask
    last = mask.long().sum(dim=1) - 1
    high = torch.tensor([True, False, True, False])
    kl = torch.zeros_like(rollout.old_logprobs)
    kl[torch.arange(4), last] = torch.where(high, HIGH_KL, 0.0)
    # `rounding`: old logprobs a little below the update's own, as generation's can be, on the
    # high-KL responses: before any step the estimated change is then positive, by rounding alone.
    old = rollout.old_logprobs - rounding * high[:, None]
    rollout = replace(rollout, old_logprobs=old, ref_logprobs=old - kl)
    cfg = PPOConfig(num_epochs=num_epochs, num_minibatches=1, learning_rate=1e-3, max_kl=max_kl)
    adv = compute_advantages(rollout, cfg, cfg.kl_coef, rollout.scores)
    per_row = torch.where(high == toward_high_kl, 1.0, -1.0)  # [B]
    adv = replace(adv, advantages=torch.where(mask, per_row[:, None].expand_as(mask), 0.0))
    optimizer = torch.optim.AdamW(
        [{"params": roles.policy_parameters()}, {"params": roles.value_parameters()}], lr=cfg.learning_rate
    )
    settings = UpdateSettings(4, 2, 1.0, False, roles_together)
    stats = ppo_update(roles, optimizer, None, rollout, adv, cfg, settings, cfg.kl_coef, torch.Generator().manual_seed(0))
    lora = {n: p.detach().clone() for n, p in roles.peft.named_parameters() if "lora_B" in n}
    return stats, lora


def _fresh_roles(make_roles):
    torch.manual_seed(0)  # LoRA A is initialised from the global RNG: the runs compared start equal
    return make_roles(seed=1, scale=0.5)


def _adapter(weights, name):
    return torch.cat([w.flatten() for n, w in sorted(weights.items()) if f".{name}." in n])


@pytest.mark.parametrize("roles_together", [False, True])
def test_max_kl_stops_the_policy_once_the_update_raises_the_kl_past_it(make_roles, tokenizer, roles_together):
    # The rollout is already above the ceiling (2 > 1.5): the first step raises the KL, so the
    # other three epochs leave the policy where that step put it; the value trains all four.
    stopped, stopped_lora = _max_kl_run(_fresh_roles(make_roles), tokenizer, True, 4, 1.5, roles_together)
    one_epoch, one_epoch_lora = _max_kl_run(_fresh_roles(make_roles), tokenizer, True, 1, None, roles_together)
    assert stopped.kl_stopped_minibatch_frac == 0.75
    assert stopped.ref_kl_estimate > ROLLOUT_KL
    torch.testing.assert_close(_adapter(stopped_lora, "policy"), _adapter(one_epoch_lora, "policy"), atol=1e-6, rtol=1e-5)
    assert not torch.equal(_adapter(stopped_lora, "value"), _adapter(one_epoch_lora, "value"))
    assert "policy/kl_stopped_minibatch_frac" in stopped.as_metrics()
    assert "policy/kl_stopped_minibatch_frac" not in one_epoch.as_metrics()


@pytest.mark.parametrize("rounding", [0.0, 1e-5])
def test_max_kl_lets_an_update_that_lowers_the_kl_go_on(make_roles, tokenizer, rounding):
    lowered, lowered_lora = _max_kl_run(_fresh_roles(make_roles), tokenizer, False, 4, 1.5, rounding=rounding)
    _, one_epoch_lora = _max_kl_run(_fresh_roles(make_roles), tokenizer, False, 1, None)
    assert lowered.kl_stopped_minibatch_frac == 0.0
    assert lowered.ref_kl_estimate < ROLLOUT_KL
    assert not torch.equal(_adapter(lowered_lora, "policy"), _adapter(one_epoch_lora, "policy"))
