"""The PPO update on the real 4-bit tiny model: it moves the two trainable adapters and nothing
else, and its first pass sees exactly the rollout policy."""

from __future__ import annotations

import pytest
import torch

from lora_ppo.config import PPOConfig
from lora_ppo.roles import REFERENCE
from lora_ppo.update import UpdateSettings, compute_advantages, ppo_update
from tests.conftest import rollout_for_update


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


@pytest.fixture()
def roles(make_roles):
    return make_roles(seed=1, scale=0.5)


def test_ppo_update_moves_adapters_but_not_base_or_reference(roles, tokenizer):
    rollout = rollout_for_update(roles, tokenizer)
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
    # Both minibatches were applied: the NaN/inf guard dropped none, so the moves above are the update's.
    assert stats.skipped_minibatches == 0 and stats.nonfinite is None


@pytest.mark.parametrize("grad_accum_steps", [1, 2, 4])
def test_first_update_sees_rollout_logprobs(roles, tokenizer, grad_accum_steps):
    # One minibatch, one epoch: the update's logprobs are those of the rollout policy, so the
    # ratio is 1 and the approximate KL 0, whatever the micro-batch split.
    rollout = rollout_for_update(roles, tokenizer)
    cfg = PPOConfig(num_epochs=1, num_minibatches=1, grad_accum_steps=grad_accum_steps)
    adv = compute_advantages(rollout, cfg, cfg.kl_coef, rollout.scores)
    optimizer = torch.optim.SGD(roles.policy_parameters() + roles.value_parameters(), lr=0.0)
    stats = ppo_update(roles, optimizer, None, rollout, adv, cfg, UpdateSettings(4, 4 // grad_accum_steps, 1.0, False),
                       cfg.kl_coef, torch.Generator().manual_seed(0))
    assert abs(stats.ratio - 1.0) < 1e-5
    assert stats.approxkl < 1e-10
    assert stats.clipfrac == 0.0
