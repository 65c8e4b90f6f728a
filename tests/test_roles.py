"""Roles on one real 4-bit backbone: reference = base, gradients stay in their own role, role
switches keep the trainable flags, left padding changes nothing, and a policy started from an
adapter keeps that adapter frozen as its reference."""

from __future__ import annotations

import pytest
import torch

from lora_ppo.config import AdaptersConfig, ModelConfig
from lora_ppo.model import load_base_model
from lora_ppo.roles import POLICY, REFERENCE, VALUE, RoleModel
from tests.conftest import bnb_4bit_layers, prompt_and_random_response

ATOL = 1e-5


@pytest.fixture(scope="module")
def model_cfg(tiny_model_dir):
    return ModelConfig(name=str(tiny_model_dir), quantization="4bit")


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


@pytest.fixture()
def roles(make_roles):
    return make_roles(seed=1, scale=0.5)


def test_backbone_is_real_4bit(roles):
    assert bnb_4bit_layers(roles)


@torch.no_grad()
def test_reference_equals_base_model_and_policy_differs(roles, model_cfg, tokenizer):
    ids, mask, start = prompt_and_random_response(tokenizer, ["This movie was", "The acting in this comedy"])
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
    ids, mask, start = prompt_and_random_response(tokenizer, ["This movie was"])
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


def test_4bit_backward_reaches_early_layers_after_inference(roles, tokenizer):
    # Regression: an inference pass must not switch bitsandbytes to a kernel without backward.
    ids, mask, start = prompt_and_random_response(tokenizer, ["This movie was"])
    with torch.no_grad(), roles.as_role(POLICY):
        roles.response_logprobs(ids, mask, start, 1.0)
    with roles.as_role(POLICY):
        lp, _ = roles.response_logprobs(ids, mask, start, 1.0)
    lp.sum().backward()
    first_layer_a = [p for n, p in roles.peft.named_parameters() if "layers.0." in n and "lora_A.policy" in n]
    assert first_layer_a and all(p.grad is not None and p.grad.abs().sum() > 0 for p in first_layer_a)


def test_gradient_checkpointing_gives_same_gradients(roles, tokenizer):
    ids, mask, start = prompt_and_random_response(tokenizer, ["This movie was", "The acting"])

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
    ids, mask, start = prompt_and_random_response(tokenizer, ["This movie was", "The acting"])
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


@torch.no_grad()
def test_role_switches_set_what_peft_sets(roles, tokenizer):
    # lora_ppo sets the active adapter on each LoRA layer itself (lora_ppo/adapter_switch.py); a
    # forward after each switch must equal one after PEFT's own set_adapter / disable_adapter.
    from peft.tuners.tuners_utils import BaseTunerLayer

    assert roles._switch is not None
    ids, mask, _ = prompt_and_random_response(tokenizer, ["This movie was"])
    layers = [m for m in roles.peft.modules() if isinstance(m, BaseTunerLayer)]
    for role in (VALUE, POLICY, REFERENCE, VALUE):
        with roles.as_role(role):
            ours = roles.hidden_states(ids, mask)
            if role != REFERENCE:
                assert roles.peft.active_adapter == role and all(m.active_adapters == [role] for m in layers)
                roles.peft.set_adapter(role)
                peft_own = roles.hidden_states(ids, mask)
            else:
                assert all(m.disable_adapters for m in layers)
                with roles.peft.disable_adapter():
                    peft_own = roles.hidden_states(ids, mask)
        torch.testing.assert_close(ours, peft_own, atol=0, rtol=0)
        roles._fix_requires_grad()
    assert not any(m.disable_adapters for m in layers)


def plain_peft_model(model_dir, **lora):
    """The tiny model unquantized with one LoRA adapter on q_proj (PEFT's own wrapping, no roles)."""
    from peft import LoraConfig, get_peft_model

    base = load_base_model(ModelConfig(name=str(model_dir), quantization="none"))
    return get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], **lora))


def test_adapter_switch_leaves_modules_to_save_to_peft(tiny_untied_model_dir):
    # PEFT switches a `modules_to_save` copy (or trainable tokens) by a module walk of its own:
    # with one in the model, the roles switch through PEFT.
    from lora_ppo.adapter_switch import AdapterSwitch

    assert AdapterSwitch.of(plain_peft_model(tiny_untied_model_dir)) is not None
    assert AdapterSwitch.of(plain_peft_model(tiny_untied_model_dir, modules_to_save=["lm_head"])) is None


@pytest.mark.parametrize("attribute", ["_active_adapter", "_disable_adapters"])
def test_adapter_switch_leaves_a_peft_without_either_attribute_it_sets_to_peft(tiny_untied_model_dir, monkeypatch,
                                                                               attribute):
    # A PEFT whose LoRA layers lack one of the two attributes the switch writes (a later release
    # renaming it) switches through PEFT's own calls, not through a write its forward never reads.
    from peft.tuners.tuners_utils import BaseTunerLayer

    from lora_ppo.adapter_switch import AdapterSwitch

    model = plain_peft_model(tiny_untied_model_dir)
    monkeypatch.delattr(BaseTunerLayer, attribute)
    for layer in model.modules():
        if isinstance(layer, BaseTunerLayer):
            vars(layer).pop(attribute, None)
    assert AdapterSwitch.of(model) is None
