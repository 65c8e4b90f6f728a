"""Invariances of the whole PPO step on a real 4-bit tiny model: gradient accumulation, the
policy and value trained in one pass, padding, batch independence, ratio 1 before the first
update, and zero KL at step 0."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from lora_ppo.bnb_workarounds import dequantized_4bit_layers
from lora_ppo.config import AdaptersConfig, ModelConfig, PPOConfig, RolloutConfig
from lora_ppo.fused_lora import fuse_lora_layers
from lora_ppo.model import load_base_model, load_tokenizer
from lora_ppo.roles import POLICY, RoleModel
from lora_ppo.rollout import Rollout, Sampler, collect_rollout, score_passes
from lora_ppo.update import UpdateSettings, compute_advantages, ppo_update
from lora_ppo.rewards import RewardSources
from tests.conftest import prompt_rows
from tests.reward_fns import count_letter_e

TOL = dict(atol=2e-5, rtol=1e-4)
PROMPTS = ["This movie was", "The acting in this film was", "Honestly", "I rented the sequel on a whim and",
           "The plot", "My family loved it", "A dull sequel with", "The ending"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(ModelConfig(name=str(tiny_model_dir)))


@pytest.fixture()
def roles(make_roles):
    return make_roles(seed=7)


LENGTHS = [8, 3, 5, 1, 8, 6, 2, 7]


def _rollout(roles, tokenizer, temperature=1.0, seed=0, prompts=PROMPTS) -> Rollout:
    """A real sampled rollout, cut to varied response lengths (a random tiny model rarely
    samples its stop token) and rescored, as if the responses had stopped there."""
    torch.manual_seed(seed)
    cfg = RolloutConfig(batch_size=len(prompts), max_new_tokens=8, temperature=temperature,
                        forward_batch_size=3)
    rollout = collect_rollout(Sampler(roles, tokenizer, cfg), prompt_rows(tokenizer, prompts), RewardSources.of(count_letter_e))
    lengths = torch.tensor(LENGTHS[: len(prompts)])
    mask = torch.arange(rollout.response_ids.shape[1])[None, :] < lengths[:, None]
    ids = torch.where(mask, rollout.response_ids, torch.full_like(rollout.response_ids, tokenizer.pad_token_id))
    return _rescore(roles, dataclasses.replace(rollout, response_ids=ids, response_mask=mask), temperature)


def _snapshot(roles):
    return [p.detach().clone() for p in roles.policy_parameters() + roles.value_parameters()]


def _restore(roles, snapshot):
    with torch.no_grad():
        for p, saved in zip(roles.policy_parameters() + roles.value_parameters(), snapshot):
            p.copy_(saved)


def _update(roles, rollout, cfg, micro, lr=0.5, temperature=1.0, gradient_checkpointing=False, together=False):
    adv = compute_advantages(rollout, cfg, cfg.kl_coef, rollout.scores)
    optimizer = torch.optim.SGD(roles.policy_parameters() + roles.value_parameters(), lr=lr)
    settings = UpdateSettings(rollout.response_ids.shape[0] // cfg.num_minibatches, micro, temperature,
                              gradient_checkpointing, together)
    stats = ppo_update(roles, optimizer, None, rollout, adv, cfg, settings, cfg.kl_coef, torch.Generator().manual_seed(0))
    return stats, adv


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_gradient_accumulation_gives_the_same_update(roles, tokenizer, aggregation):
    rollout = _rollout(roles, tokenizer)
    assert len(set(rollout.response_mask.sum(1).tolist())) > 1  # varied lengths make this a real test
    cfg = PPOConfig(num_epochs=1, num_minibatches=1, loss_aggregation=aggregation, kl_coef=0.1)
    start = _snapshot(roles)
    _update(roles, rollout, cfg, micro=8)
    one_pass = _snapshot(roles)
    _restore(roles, start)
    _update(roles, rollout, cfg, micro=2)
    accumulated = _snapshot(roles)
    moved = max((a - s).abs().max().item() for a, s in zip(one_pass, start))
    assert moved > 1e-3
    for a, b in zip(one_pass, accumulated):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("gradient_checkpointing, dequantized, fused", [
    (False, False, False), (True, False, False), (False, True, False), (True, True, False), (True, False, True)],
    ids=["4bit-per-pass", "checkpointing-4bit-per-pass", "dequantized-per-step", "checkpointing-dequantized-per-step",
         "checkpointing-fused-lora"])
@pytest.mark.parametrize("kl_penalty", ["reward", "loss"])
def test_policy_and_value_trained_together_equal_one_pass_per_role(roles, tokenizer, gradient_checkpointing,
                                                                   dequantized, fused, kl_penalty):
    """ppo.update_roles_together: one forward and backward of the micro-batch under both adapters
    gives the update of a forward and backward per role (checkpointed layers recompute under the
    right adapter too); 2 epochs x 2 minibatches, so later minibatches start from moved weights.
    With `model.fused_lora` each fused layer splits the stacked rows by role and joins them again."""
    with torch.no_grad():  # the head starts at zero: no value gradient would reach the value adapter
        roles.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
    if fused:
        fuse_lora_layers(roles.peft)
    rollout = _rollout(roles, tokenizer)
    cfg = PPOConfig(num_epochs=2, num_minibatches=2, kl_coef=0.1, kl_penalty=kl_penalty, kl_estimator="k3")
    start = _snapshot(roles)
    context = dequantized_4bit_layers(roles.peft, torch.float32) if dequantized else contextlib.nullcontext()
    with context:
        stats_apart, _ = _update(roles, rollout, cfg, micro=2, gradient_checkpointing=gradient_checkpointing,
                                 together=False)
        apart = _snapshot(roles)
        _restore(roles, start)
        stats_together, _ = _update(roles, rollout, cfg, micro=2, gradient_checkpointing=gradient_checkpointing,
                                    together=True)
        together = _snapshot(roles)
    n_policy = len(roles.policy_parameters())
    for trained in (slice(0, n_policy), slice(n_policy, None)):  # both roles really moved
        assert max((a - s).abs().max().item() for a, s in zip(apart[trained], start[trained])) > 1e-3
    for a, b in zip(apart, together):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    metrics_apart, metrics_together = stats_apart.as_metrics(), stats_together.as_metrics()
    assert metrics_apart.keys() == metrics_together.keys()
    for key in metrics_apart:
        assert metrics_together[key] == pytest.approx(metrics_apart[key], abs=2e-5, rel=1e-4), key


def _pad(rollout: Rollout, left: int, right: int, pad_id: int) -> Rollout:
    """The same rollout with extra left padding on prompts and right padding on responses."""
    B = rollout.query_ids.shape[0]
    q_ids = torch.cat([torch.full((B, left), pad_id), rollout.query_ids], 1)
    q_mask = torch.cat([torch.zeros(B, left, dtype=rollout.query_mask.dtype), rollout.query_mask], 1)
    r_ids = torch.cat([rollout.response_ids, torch.full((B, right), pad_id)], 1)
    r_mask = torch.cat([rollout.response_mask, torch.zeros(B, right, dtype=torch.bool)], 1)
    return dataclasses.replace(rollout, query_ids=q_ids, query_mask=q_mask, response_ids=r_ids, response_mask=r_mask)


def _rescore(roles, rollout: Rollout, temperature: float = 1.0) -> Rollout:
    old, ref, values = score_passes(
        roles, rollout.input_ids, rollout.attention_mask, rollout.response_start, temperature, 3
    )
    return dataclasses.replace(rollout, old_logprobs=old, ref_logprobs=ref, values=values)


def test_padding_changes_no_logprob_advantage_loss_or_metric(roles, tokenizer):
    base = _rescore(roles, _rollout(roles, tokenizer))
    padded = _rescore(roles, _pad(base, left=3, right=2, pad_id=tokenizer.pad_token_id))
    T = base.response_ids.shape[1]
    m = base.response_mask
    for name in ("old_logprobs", "ref_logprobs", "values"):
        a, b = getattr(base, name), getattr(padded, name)[:, :T]
        torch.testing.assert_close(a[m], b[m], **TOL)
    cfg = PPOConfig(num_epochs=1, num_minibatches=1, kl_coef=0.1)
    adv_a = compute_advantages(base, cfg, cfg.kl_coef, base.scores)
    adv_b = compute_advantages(padded, cfg, cfg.kl_coef, padded.scores)
    torch.testing.assert_close(adv_a.advantages[m], adv_b.advantages[:, :T][m], **TOL)
    torch.testing.assert_close(adv_a.returns[m], adv_b.returns[:, :T][m], **TOL)
    start = _snapshot(roles)
    stats_a, _ = _update(roles, base, cfg, micro=4, lr=0.0)
    _restore(roles, start)
    stats_b, _ = _update(roles, padded, cfg, micro=4, lr=0.0)
    metrics_a, metrics_b = stats_a.as_metrics(), stats_b.as_metrics()
    assert metrics_a.keys() == metrics_b.keys()
    for key in metrics_a:
        assert metrics_a[key] == pytest.approx(metrics_b[key], abs=2e-5, rel=1e-4), key


def test_a_samples_advantages_do_not_depend_on_its_batchmates(roles, tokenizer):
    rollout = _rescore(roles, _rollout(roles, tokenizer))
    cfg = PPOConfig(whiten_advantages=False, kl_coef=0.1)
    full = compute_advantages(rollout, cfg, cfg.kl_coef, rollout.scores)
    # Score rows 0-2 on their own (a different batch shape and company), then compare.
    part = dataclasses.replace(
        rollout, query_ids=rollout.query_ids[:3], query_mask=rollout.query_mask[:3],
        response_ids=rollout.response_ids[:3], response_mask=rollout.response_mask[:3], scores=rollout.scores[:3],
    )
    part = _rescore(roles, part)
    alone = compute_advantages(part, cfg, cfg.kl_coef, part.scores)
    m = rollout.response_mask[:3]
    torch.testing.assert_close(alone.advantages[m], full.advantages[:3][m], **TOL)
    torch.testing.assert_close(alone.returns[m], full.returns[:3][m], **TOL)


@pytest.mark.parametrize("micro", [8, 4, 1])
def test_ratio_is_one_before_the_first_update_at_any_temperature(roles, tokenizer, micro):
    rollout = _rollout(roles, tokenizer, temperature=0.7)
    cfg = PPOConfig(num_epochs=1, num_minibatches=1)
    stats, _ = _update(roles, rollout, cfg, micro=micro, lr=0.0, temperature=0.7)
    assert abs(stats.ratio - 1.0) < 1e-5
    assert stats.approxkl < 1e-10


def test_kl_is_zero_at_step_zero_when_policy_starts_as_reference(tiny_model_dir, tokenizer, tmp_path):
    cfg = ModelConfig(name=str(tiny_model_dir))
    fresh = RoleModel(load_base_model(cfg), AdaptersConfig(policy={"r": 4}, value={"r": 4}, reference="disable"))
    rollout = _rollout(fresh, tokenizer)
    kl = compute_advantages(rollout, PPOConfig(), 0.1, rollout.scores).kl
    assert kl.abs().max().item() < 1e-6

    # Starting from a trained adapter: the reference is that adapter, so KL is 0 again.
    trained = RoleModel(load_base_model(cfg), AdaptersConfig(policy={"r": 4}, value={"r": 4}))
    with torch.no_grad():
        for p in trained.policy_parameters():
            p.add_(0.2)
    trained.save_adapter(POLICY, tmp_path / "sft")
    started = RoleModel(load_base_model(cfg), AdaptersConfig(policy={"init_from": str(tmp_path / "sft")}))
    rollout = _rollout(started, tokenizer)
    kl = compute_advantages(rollout, PPOConfig(), 0.1, rollout.scores).kl
    assert kl.abs().max().item() < 1e-6
    assert (rollout.old_logprobs != 0).any()
