"""Roles on one real 4-bit backbone: reference = base, gradients stay in their own role,
left padding changes nothing, and a PPO update moves only the trainable adapters."""

from __future__ import annotations

import pytest
import torch

from lora_ppo.config import AdaptersConfig, ModelConfig, PPOConfig
from lora_ppo.model import load_base_model, load_tokenizer
from lora_ppo.roles import POLICY, REFERENCE, VALUE, RoleModel
from lora_ppo.rollout import Rollout, score_passes
from lora_ppo.update import UpdateSettings, compute_advantages, ppo_update

ATOL = 1e-5


@pytest.fixture(scope="module")
def model_cfg(tiny_model_dir):
    return ModelConfig(name=str(tiny_model_dir), quantization="4bit")


@pytest.fixture(scope="module")
def tokenizer(model_cfg):
    return load_tokenizer(model_cfg)


@pytest.fixture()
def roles(make_roles):
    return make_roles(seed=1, scale=0.5)


def _batch(tokenizer, prompts, response_len=5, seed=0):
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    g = torch.Generator().manual_seed(seed)
    response = torch.randint(3, len(tokenizer), (len(prompts), response_len), generator=g)
    ids = torch.cat([enc["input_ids"], response], dim=1)
    mask = torch.cat([enc["attention_mask"], torch.ones_like(response)], dim=1)
    return ids, mask, enc["input_ids"].shape[1]


def _bnb_4bit_layers(roles) -> list:
    import bitsandbytes as bnb

    return [m for m in roles.peft.modules() if isinstance(m, bnb.nn.Linear4bit)]


def _is_4bit(roles) -> bool:
    return bool(_bnb_4bit_layers(roles))


def test_backbone_is_real_4bit(roles):
    assert _is_4bit(roles)


@torch.no_grad()
def test_reference_equals_base_model_and_policy_differs(roles, model_cfg, tokenizer):
    ids, mask, start = _batch(tokenizer, ["This movie was", "The acting in this comedy"])
    with roles.as_role(REFERENCE):
        ref, _ = roles.response_logprobs(ids, mask, start, temperature=1.0)
    with roles.as_role(POLICY):
        pol, _ = roles.response_logprobs(ids, mask, start, temperature=1.0)
    base = load_base_model(model_cfg)
    logits = base(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    base_lp = torch.log_softmax(logits[:, start - 1 : -1].float(), -1).gather(-1, ids[:, start:, None]).squeeze(-1)
    torch.testing.assert_close(ref, base_lp, atol=ATOL, rtol=1e-5)
    assert (pol - base_lp).abs().max() > 1e-2


def test_policy_loss_backward_leaves_value_grads_untouched_and_vice_versa(roles, tokenizer):
    ids, mask, start = _batch(tokenizer, ["This movie was"])
    with roles.as_role(POLICY):
        lp, _ = roles.response_logprobs(ids, mask, start, 1.0)
    lp.sum().backward()
    assert all(p.grad is not None for p in roles.policy_parameters())
    assert all(p.grad is None for p in roles.value_parameters())

    for p in roles.policy_parameters():
        p.grad = None
    with roles.as_role(VALUE):
        values = roles.values(ids, mask, start)
    values.sum().backward()
    assert all(p.grad is None for p in roles.policy_parameters())
    assert all(p.grad is not None for p in roles.value_parameters())


def test_trainable_flags_survive_role_switches(roles, tokenizer):
    # PEFT's set_adapter freezes every adapter but the active one; both must stay trainable.
    for role in (VALUE, REFERENCE, POLICY, VALUE):
        with roles.as_role(role):
            pass
        assert all(p.requires_grad for p in roles.policy_parameters() + roles.value_parameters())


@torch.no_grad()
def test_left_padding_gives_same_logprobs_and_values(roles, tokenizer):
    short = "This movie was"
    longer = "I went to see this horror movie last weekend with my family and honestly"
    g = torch.Generator().manual_seed(3)
    response = torch.randint(3, len(tokenizer), (1, 6), generator=g)

    def score(prompts):
        enc = tokenizer(prompts, return_tensors="pt", padding=True)
        resp = response.expand(len(prompts), -1)
        ids = torch.cat([enc["input_ids"], resp], 1)
        mask = torch.cat([enc["attention_mask"], torch.ones_like(resp)], 1)
        start = enc["input_ids"].shape[1]
        with roles.as_role(POLICY):
            lp, ent = roles.response_logprobs(ids, mask, start, 0.7)
        with roles.as_role(VALUE):
            v = roles.values(ids, mask, start)
        return lp, ent, v

    alone = score([short])
    batched = score([longer, short])
    assert tokenizer([longer, short], padding=True)["attention_mask"][1][0] == 0  # really left-padded
    for a, b in zip(alone, batched):
        torch.testing.assert_close(a[0], b[1], atol=ATOL, rtol=1e-5)


def _rollout_for_update(roles, tokenizer):
    ids, mask, start = _batch(tokenizer, ["This movie was", "The acting in this film", "Honestly", "I"], 6)
    response_mask = torch.ones(4, 6, dtype=torch.bool)
    response_mask[1, 4:] = False  # a response that stopped early
    mask[1, start + 4 :] = 0
    old, ref, values = score_passes(roles, ids, mask, start, 1.0, forward_batch_size=2)
    scores = torch.tensor([1.0, -1.0, 0.5, 2.0])
    return Rollout(
        prompts=[""] * 4, completions=[""] * 4, query_ids=ids[:, :start], query_mask=mask[:, :start],
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


def test_4bit_backward_reaches_early_layers_after_inference(roles, tokenizer):
    # Regression: an inference pass must not switch bitsandbytes to a kernel without backward.
    ids, mask, start = _batch(tokenizer, ["This movie was"])
    with torch.no_grad(), roles.as_role(POLICY):
        roles.response_logprobs(ids, mask, start, 1.0)
    with roles.as_role(POLICY):
        lp, _ = roles.response_logprobs(ids, mask, start, 1.0)
    lp.sum().backward()
    first_layer_a = [p for n, p in roles.peft.named_parameters() if "layers.0." in n and "lora_A.policy" in n]
    assert first_layer_a and all(p.grad is not None and p.grad.abs().sum() > 0 for p in first_layer_a)


def test_gradient_checkpointing_gives_same_gradients(roles, tokenizer):
    ids, mask, start = _batch(tokenizer, ["This movie was", "The acting"])

    def grads(checkpointing: bool):
        for p in roles.policy_parameters():
            p.grad = None
        with roles.gradient_checkpointing(checkpointing), roles.as_role(POLICY):
            lp, _ = roles.response_logprobs(ids, mask, start, 1.0)
            lp.sum().backward()
        return [p.grad.clone() for p in roles.policy_parameters()]

    for a, b in zip(grads(False), grads(True)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_init_from_adapter_becomes_frozen_reference(roles, model_cfg, tokenizer, tmp_path):
    roles.save_adapter(POLICY, tmp_path / "sft")
    adapters = AdaptersConfig(policy={"r": 4, "alpha": 8, "init_from": str(tmp_path / "sft")}, value={"r": 4})
    assert adapters.reference_adapter_path == str(tmp_path / "sft")
    started = RoleModel(load_base_model(model_cfg), adapters)
    ids, mask, start = _batch(tokenizer, ["This movie was", "The acting"])
    with torch.no_grad():
        with roles.as_role(POLICY):
            sft_lp, _ = roles.response_logprobs(ids, mask, start, 1.0)
        with started.as_role(POLICY):
            pol_lp, _ = started.response_logprobs(ids, mask, start, 1.0)
        with started.as_role(REFERENCE):
            ref_lp, _ = started.response_logprobs(ids, mask, start, 1.0)
    torch.testing.assert_close(pol_lp, sft_lp, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(ref_lp, sft_lp, atol=ATOL, rtol=1e-5)
    assert not any(p.requires_grad for p in started._params[REFERENCE])
    # Training the policy copy leaves the reference where it started.
    with torch.no_grad():
        for p in started.policy_parameters():
            p.add_(0.1)
        with started.as_role(REFERENCE):
            ref_after, _ = started.response_logprobs(ids, mask, start, 1.0)
        with started.as_role(POLICY):
            pol_after, _ = started.response_logprobs(ids, mask, start, 1.0)
    torch.testing.assert_close(ref_after, sft_lp, atol=ATOL, rtol=1e-5)
    assert (pol_after - sft_lp).abs().max() > 1e-3


def test_dequantized_once_gives_same_logprobs_values_and_gradients(roles, tokenizer):
    # model.dequantize_per_step computes each 4-bit layer from one dequantized copy: what
    # bitsandbytes computes per pass, so logprobs, values and adapter gradients must not move.
    from lora_ppo.bnb_workarounds import dequantized_4bit_layers

    ids, mask, start = _batch(tokenizer, ["This movie was", "The acting in the remake"])

    def run():
        for p in roles.policy_parameters() + roles.value_parameters():
            p.grad = None
        with roles.as_role(POLICY):
            lp, ent = roles.response_logprobs(ids, mask, start, 0.7)
            lp.sum().backward()
        with roles.as_role(VALUE):
            values = roles.values(ids, mask, start)
            values.sum().backward()
        grads = [p.grad.clone() for p in roles.policy_parameters() + roles.value_parameters()]
        return lp.detach(), ent.detach(), values.detach(), grads

    plain = run()
    with dequantized_4bit_layers(roles.peft, torch.float32) as held_bytes:
        assert held_bytes > 0
        assert all("forward" in vars(m) for m in _bnb_4bit_layers(roles))
        cached = run()
    for a, b in zip(plain[:3], cached[:3]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(plain[3], cached[3]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # On exit every layer computes from its 4 bits again, and the base is unchanged.
    assert _is_4bit(roles)
    assert not any("forward" in vars(m) for m in _bnb_4bit_layers(roles))
    torch.testing.assert_close(run()[0], plain[0], atol=0, rtol=0)


def test_dequantized_once_is_undone_after_an_error(roles):
    from lora_ppo.bnb_workarounds import dequantized_4bit_layers

    with pytest.raises(KeyboardInterrupt):
        with dequantized_4bit_layers(roles.peft, torch.float32):
            raise KeyboardInterrupt
    assert not any("forward" in vars(m) for m in _bnb_4bit_layers(roles))
