"""model.adapter_autocast: the adapters' matmuls in bfloat16 under torch.autocast, their float32
weights the optimizer's master copies. Checked on CPU in bfloat16 against PEFT's own path with the
adapters stored in bfloat16 (the computation autocast stands for), and through a PPO run."""

from __future__ import annotations

import logging

import pytest
import torch

import lora_ppo
from lora_ppo.alarms import LOGPROB_TOLERANCE
from lora_ppo.config import ModelConfig, recipe_from_dict
from lora_ppo.quantization import adapter_autocast_dtype
from lora_ppo.roles import POLICY
from tests.conftest import forward_and_grads, tiny_recipe_dict


@pytest.fixture(scope="module")
def roles(make_roles):
    """bf16 roles whose policy adapter changes the output (its B matrices randomised)."""
    return make_roles(seed=0, scale=0.5, perturbed=(POLICY,), compute_dtype="bfloat16")


def policy_forward(roles, tokenizer, autocast: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`forward_and_grads` as the policy, with or without autocast."""
    roles.autocast_dtype = torch.bfloat16 if autocast else None
    try:
        return forward_and_grads(roles, tokenizer, POLICY)
    finally:
        roles.autocast_dtype = None


def test_autocast_computes_what_adapters_stored_in_bfloat16_compute(roles, tiny_tokenizer):
    autocast_hidden, _, autocast_grads = policy_forward(roles, tiny_tokenizer, autocast=True)
    assert all(p.dtype == torch.float32 for p in roles.policy_parameters())  # master weights stay float32
    assert all(g.dtype == torch.float32 for g in autocast_grads)
    # The same adapters held in bfloat16: PEFT then skips its float32 casts and multiplies in bfloat16.
    params = roles.policy_parameters()
    saved = [p.data for p in params]
    for p in params:
        p.data = p.data.to(torch.bfloat16)
    try:
        bf16_hidden, _, bf16_grads = policy_forward(roles, tiny_tokenizer, autocast=False)
    finally:
        for p, data in zip(params, saved):
            p.data = data
    torch.testing.assert_close(autocast_hidden, bf16_hidden, rtol=0, atol=0)
    for autocast_grad, bf16_grad in zip(autocast_grads, bf16_grads):
        torch.testing.assert_close(autocast_grad, bf16_grad.float(), rtol=0, atol=0)


def test_autocast_is_as_close_to_float32_as_bfloat16_compute_is(roles, tiny_tokenizer, make_roles):
    """Against the same policy computed wholly in float32, the logprobs and gradients with autocast
    are within 1.25x the distance of today's bfloat16 path (bfloat16 base, float32 adapters): the
    adapters' bfloat16 adds little to the rounding bfloat16 compute already has (on this tiny
    random model 0.12 nats per token and 35% of the gradient's norm either way)."""
    exact = make_roles(perturbed=(), compute_dtype="float32")
    with torch.no_grad():
        for mine, theirs in zip(exact.policy_parameters(), roles.policy_parameters()):
            mine.copy_(theirs)
    autocast_hidden, autocast_logprobs, autocast_grads = policy_forward(roles, tiny_tokenizer, autocast=True)
    today_hidden, today_logprobs, today_grads = policy_forward(roles, tiny_tokenizer, autocast=False)
    _, exact_logprobs, exact_grads = policy_forward(exact, tiny_tokenizer, autocast=False)
    assert not torch.equal(autocast_hidden, today_hidden)  # the adapters really ran in another dtype

    def distance(logprobs, grads) -> tuple[float, float]:
        gradient_error = max(float((g - e).norm() / e.norm()) for g, e in zip(grads, exact_grads))
        return float((logprobs - exact_logprobs).abs().mean()), gradient_error

    autocast, today = distance(autocast_logprobs, autocast_grads), distance(today_logprobs, today_grads)
    assert autocast[0] <= 1.25 * today[0] and autocast[1] <= 1.25 * today[1], (autocast, today)


def test_autocast_is_on_only_where_computation_runs_in_bfloat16(tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="lora_ppo.quantization"):
        assert adapter_autocast_dtype(ModelConfig(name="m", compute_dtype="bfloat16", adapter_autocast=True)) \
            == torch.bfloat16
        assert adapter_autocast_dtype(ModelConfig(name="m", compute_dtype="float16", adapter_autocast=True)) is None
        assert adapter_autocast_dtype(ModelConfig(name="m", adapter_autocast=True)) is None  # auto: float32 on CPU
        assert adapter_autocast_dtype(ModelConfig(name="m", compute_dtype="bfloat16")) is None  # not asked
    assert [r.getMessage() for r in caplog.records] == [
        "model.adapter_autocast: the adapters' matmuls run in bfloat16 (float32 master weights)",
        "model.adapter_autocast: off (computation runs in float16, not bfloat16)",
        "model.adapter_autocast: off (computation runs in float32, not bfloat16)",
    ]


def test_a_ppo_run_with_autocast_samples_scores_and_updates_one_policy(tmp_path, tiny_model_dir):
    """Generation, scoring, the update and its recomputation all run the adapters under autocast:
    the update's first forward gives the scoring pass's logprobs (the self-check), generation's are
    within bfloat16 rounding of them, and the policy trains."""
    recipe = recipe_from_dict(tiny_recipe_dict(
        tiny_model_dir, tmp_path / "run", model={"compute_dtype": "bfloat16", "adapter_autocast": True,
                                                  "gradient_checkpointing": True},
        rollout={"logprobs_from_generation": False}, train={"steps": 2, "eval": False}))
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    assert trainer.roles.autocast_dtype == torch.bfloat16
    # Every call of one policy LoRA matrix, in each phase: was autocast on?
    lora_a = next(m for name, m in trainer.roles.peft.named_modules() if name.endswith("lora_A.policy"))
    calls = {"grad": [], "no_grad": []}
    lora_a.register_forward_pre_hook(lambda module, args: calls["grad" if torch.is_grad_enabled() else "no_grad"]
                                     .append(torch.is_autocast_enabled("cpu")))
    before = [p.detach().clone() for p in trainer.roles.policy_parameters()]
    metrics, _ = trainer.train_step()
    # generation's tokens + one scoring pass (no grad); the update's forwards and recomputations (grad)
    assert len(calls["no_grad"]) > recipe.rollout.max_new_tokens and len(calls["grad"]) >= 2
    assert all(calls["no_grad"]) and all(calls["grad"])
    assert metrics["check/logprob_mean_diff"] <= LOGPROB_TOLERANCE["bfloat16"]
    assert metrics["check/generation_logprob_diff"] <= LOGPROB_TOLERANCE["bfloat16"]
    after = trainer.roles.policy_parameters()
    assert all(p.dtype == torch.float32 for p in after)
    assert any(not torch.equal(b, a) for b, a in zip(before, after))
