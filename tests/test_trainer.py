"""Algorithm modes end to end on the tiny 4-bit model: RLOO / GRPO hold no value adapter,
the adaptive KL controller moves kl_coef, KL as a loss term, the ratio threshold skips a
drifted minibatch, and a reference-free run has zero KL."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import lora_ppo
from lora_ppo.config import PPOConfig
from lora_ppo.update import UpdateSettings, compute_advantages, ppo_update
from tests.conftest import prompt_rows, tiny_recipe_dict


def _train(tmp_path, tiny_model_dir, overrides):
    recipe = lora_ppo.recipe_from_dict(
        tiny_recipe_dict(tiny_model_dir, tmp_path / "run"), ["train.eval=false", *overrides]
    )
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    trainer.train()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return trainer, metrics


@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
def test_critic_free_modes_create_no_value_adapter(tmp_path, tiny_model_dir, estimator):
    trainer, metrics = _train(tmp_path, tiny_model_dir, [
        f"ppo.advantage_estimator={estimator}", "rollout.samples_per_prompt=2", "train.steps=2",
    ])
    assert not trainer.roles.has_value and trainer.roles.value_parameters() == []
    assert "value" not in trainer.roles.peft.peft_config
    assert len(trainer.parts.optimizer.param_groups) == 1
    assert all(m["algo/critic"] == 0.0 and "loss/value" not in m for m in metrics)
    assert (tmp_path / "run" / "final" / "policy" / "adapter_config.json").is_file()
    assert not (tmp_path / "run" / "final" / "value").exists()


def test_group_prompts_are_repeated_consecutively(tmp_path, tiny_model_dir):
    seen = []

    def reward(prompts, completions):
        seen.append(list(prompts))
        return [0.0] * len(prompts)

    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / "run"), [
        "train.eval=false", "train.steps=1", "ppo.advantage_estimator=rloo", "rollout.samples_per_prompt=2",
    ])
    lora_ppo.PPOTrainer(recipe, reward_fn=reward, progress=False).train()
    prompts = seen[0]
    assert len(prompts) == 4 and prompts[0] == prompts[1] and prompts[2] == prompts[3]


def test_critic_free_mode_needs_groups():
    with pytest.raises(lora_ppo.RecipeError, match="samples_per_prompt >= 2"):
        lora_ppo.recipe_from_dict({"ppo": {"advantage_estimator": "grpo"}})


def test_adaptive_kl_controller_moves_kl_coef(tmp_path, tiny_model_dir, monkeypatch):
    from lora_ppo import ppo_math

    measured = []  # the KL each step's controller is given: the batch's mean KL per response
    real = ppo_math.adaptive_kl_coef
    monkeypatch.setattr(ppo_math, "adaptive_kl_coef", lambda coef, kl, *rest: measured.append(kl) or real(coef, kl, *rest))
    _, metrics = _train(tmp_path, tiny_model_dir, [
        "ppo.target_kl=1e-6", "ppo.kl_horizon=10", "ppo.kl_coef=0.1", "ppo.kl_estimator=k3", "train.steps=3",
        "ppo.learning_rate=0.05",
    ])
    assert measured == pytest.approx([m["objective/kl"] for m in metrics], rel=1e-6, abs=1e-12)
    coefs = [m["objective/kl_coef"] for m in metrics]
    assert coefs[0] == 0.1
    # The error is clipped to +-0.2, so each step multiplies kl_coef by 1 +- 0.2 * 4 samples / 10:
    # down while the KL is below the target (step 1: policy == reference), up once above it.
    for before, after, m in zip(coefs, coefs[1:], metrics):
        expected = 1.08 if m["objective/kl"] > 1.2e-6 else 0.92 if m["objective/kl"] < 0.8e-6 else None
        if expected:
            assert after == pytest.approx(before * expected)
    assert metrics[1]["objective/kl"] > 1.2e-6 and coefs[2] > coefs[1]


def test_kl_coef_min_keeps_the_controller_from_lowering_the_coefficient(tmp_path, tiny_model_dir):
    # A target no KL reaches: without a floor every step lowers kl_coef by 8%; with one it stays put.
    _, metrics = _train(tmp_path, tiny_model_dir, [
        "ppo.target_kl=1e6", "ppo.kl_horizon=10", "ppo.kl_coef=0.1", "ppo.kl_coef_min=0.1", "train.steps=3",
    ])
    assert [m["objective/kl_coef"] for m in metrics] == [0.1, 0.1, 0.1]


@pytest.mark.parametrize("penalty", ["reward", "loss"])
def test_reference_none_has_zero_kl_and_no_kl_penalty(tmp_path, tiny_model_dir, caplog, penalty):
    with caplog.at_level("WARNING"):
        _, metrics = _train(tmp_path, tiny_model_dir, ["adapters.reference=none", "train.steps=2",
                                                       "ppo.learning_rate=0.05", f"ppo.kl_penalty={penalty}"])
    assert "no KL penalty" in caplog.text
    assert all(m["objective/kl"] == 0.0 and m["objective/kl_coef"] == 0.0 for m in metrics)
    # Without a reference a KL loss would pull the policy back to its last rollout: there is none.
    assert all("loss/kl" not in m for m in metrics)


def test_smoke_kl_loss_term_with_every_shaping_option_on(tmp_path, tiny_model_dir):
    """Smoke test: KL as a loss term with every option on trains two steps; the KL is a loss, not a reward."""
    _, metrics = _train(tmp_path, tiny_model_dir, [
        "ppo.kl_penalty=loss", "ppo.kl_estimator=k3", "ppo.dual_clip=3.0", "ppo.clip_value_loss=false",
        "ppo.loss_aggregation=sequence", "ppo.score_norm=true", "ppo.score_clip=2.0", "ppo.length_penalty=0.01",
        "ppo.whiten_rewards=true", "ppo.entropy_coef=0.01", "train.steps=2", "ppo.learning_rate=0.05",
    ])
    assert all(torch.isfinite(torch.tensor(v)) for m in metrics for v in m.values())
    # The penalty is a loss term: the reward carries no KL, and the loss term is logged instead.
    assert metrics[1]["objective/kl"] > 0
    for m in metrics:
        assert m["objective/non_score_reward"] == 0.0
        assert m["objective/rlhf_reward"] == pytest.approx(m["objective/scores"], abs=1e-6)
    # Step 1 samples from a policy equal to the reference (LoRA B starts at zero): no KL yet.
    assert abs(metrics[0]["objective/kl"]) < 1e-6 and metrics[1]["loss/kl"] > 0


def test_kl_in_the_reward_is_reported_as_the_non_score_reward(tmp_path, tiny_model_dir):
    _, metrics = _train(tmp_path, tiny_model_dir, ["ppo.kl_coef=0.2", "train.steps=2", "ppo.learning_rate=0.05"])
    m = metrics[1]
    assert m["objective/kl"] != 0 and "loss/kl" not in m
    assert m["objective/non_score_reward"] == pytest.approx(-0.2 * m["objective/kl"], rel=1e-5)
    assert m["objective/rlhf_reward"] == pytest.approx(m["objective/scores"] - 0.2 * m["objective/kl"], rel=1e-5)


def test_ratio_threshold_skips_a_drifted_minibatch(tmp_path, tiny_model_dir):
    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / "run"), ["train.eval=false"])
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    from lora_ppo.rollout import collect_rollout

    parts = trainer.parts
    rows = prompt_rows(parts.tokenizer, ["This movie", "The plot", "I", "Honestly"])
    rollout = collect_rollout(parts.sampler(recipe), rows, parts.rewards)
    # Pretend the rollout policy gave every token e^-1 of its probability: ratio = e > 2.
    drifted = dataclasses.replace(rollout, old_logprobs=rollout.old_logprobs - 1.0)
    before_policy = [p.detach().clone() for p in trainer.roles.policy_parameters()]
    before_value = [p.detach().clone() for p in trainer.roles.value_parameters()]
    cfg = PPOConfig(num_epochs=1, num_minibatches=1, ratio_threshold=2.0, learning_rate=0.05)
    adv = compute_advantages(drifted, cfg, cfg.kl_coef, drifted.scores)
    settings = UpdateSettings(4, 4, recipe.rollout.temperature, gradient_checkpointing=False)
    stats = ppo_update(parts.roles, parts.optimizer, None, drifted, adv, cfg, settings, cfg.kl_coef,
                       torch.Generator().manual_seed(0))
    assert stats.skipped_minibatch_frac == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before_policy, trainer.roles.policy_parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(before_value, trainer.roles.value_parameters()))
