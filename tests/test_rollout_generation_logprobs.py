"""rollout.logprobs_from_generation: the old logprobs read off generation's own logits must be
the ones a scoring pass computes, on left-padded prompts, at a temperature, with stopped rows."""

from __future__ import annotations

import time

import pytest
import torch

from lora_ppo.config import ModelConfig, RolloutConfig
from lora_ppo.model import load_tokenizer
from lora_ppo.rollout import Sampler, collect_rollout, score_passes
from lora_ppo.rewards import RewardSources
from tests.conftest import prompt_rows
from tests.reward_fns import count_letter_e

PROMPTS = ["This movie was", "The acting in this film was quite", "Honestly", "I rented the sequel on a whim and"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(ModelConfig(name=str(tiny_model_dir)))


@pytest.fixture(scope="module")
def rows(tokenizer):
    return prompt_rows(tokenizer, PROMPTS)


@pytest.fixture(scope="module")
def roles(make_roles):
    return make_roles(seed=3, perturbed=("policy",))  # the policy must differ from the base


def _scored_old_logprobs(roles, samples, temperature):
    ids = torch.cat([samples.query_ids, samples.response_ids], dim=1)
    mask = torch.cat([samples.query_mask, samples.response_mask.long()], dim=1)
    return score_passes(roles, ids, mask, samples.query_ids.shape[1], temperature, forward_batch_size=4,
                        with_values=False, with_reference=False)[0]


def _stop_token_sampled_early(roles, tokenizer, rows, cfg) -> str:
    """A token the seeded sampler emits at step 2 of row 0, so a rerun with it as the stop token
    stops that row early (a random tiny model rarely samples its eos). The stop token changes
    nothing sampled before it, so the rerun draws the same tokens up to there."""
    torch.manual_seed(11)
    first = Sampler(roles, tokenizer, cfg.model_copy(update={"stop_token": None})).sample(rows)
    return tokenizer.convert_ids_to_tokens(int(first.response_ids[0, 2]))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recorded_logprobs_equal_a_scoring_pass(roles, tokenizer, rows, temperature):
    cfg = RolloutConfig(batch_size=4, max_new_tokens=6, temperature=temperature)
    cfg = cfg.model_copy(update={"stop_token": _stop_token_sampled_early(roles, tokenizer, rows, cfg)})
    torch.manual_seed(11)
    samples = Sampler(roles, tokenizer, cfg).sample(rows, record_logprobs=True)
    assert bool(samples.stopped[0]) and int(samples.response_mask[0].sum()) <= 3  # a stopped row is covered
    assert samples.logprobs.shape == samples.response_ids.shape
    scored = _scored_old_logprobs(roles, samples, temperature)
    m = samples.response_mask
    torch.testing.assert_close(samples.logprobs[m], scored[m], atol=1e-4, rtol=0)
    assert (samples.logprobs[~m] == 0).all()


def test_recording_does_not_change_what_is_sampled(roles, tokenizer, rows):
    cfg = RolloutConfig(batch_size=4, max_new_tokens=6, temperature=0.8)
    torch.manual_seed(5)
    plain = Sampler(roles, tokenizer, cfg).sample(rows)
    torch.manual_seed(5)
    recorded = Sampler(roles, tokenizer, cfg).sample(rows, record_logprobs=True)
    assert torch.equal(plain.response_ids, recorded.response_ids)
    assert plain.logprobs is None


def test_rollout_with_generation_logprobs_matches_a_rescored_rollout(roles, tokenizer, rows):
    base = dict(batch_size=4, max_new_tokens=6, temperature=0.9, forward_batch_size=3)
    torch.manual_seed(2)
    rescored = collect_rollout(Sampler(roles, tokenizer, RolloutConfig(**base)), rows, RewardSources.of(count_letter_e))
    torch.manual_seed(2)
    recorded = collect_rollout(Sampler(roles, tokenizer, RolloutConfig(**base, logprobs_from_generation=True)),
                               rows, RewardSources.of(count_letter_e))
    assert torch.equal(rescored.response_ids, recorded.response_ids)
    m = rescored.response_mask
    torch.testing.assert_close(recorded.old_logprobs[m], rescored.old_logprobs[m], atol=1e-4, rtol=0)
    torch.testing.assert_close(recorded.ref_logprobs, rescored.ref_logprobs)
    torch.testing.assert_close(recorded.values, rescored.values)


def test_top_k_and_top_p_sampling_still_record_full_vocabulary_logprobs(roles, tokenizer, rows):
    """Scoring ignores top-k/top-p (the logprobs are over the whole vocabulary at the sampling
    temperature); the recorded ones must be the same quantity."""
    cfg = RolloutConfig(batch_size=4, max_new_tokens=5, temperature=0.8, top_k=20, top_p=0.9, stop_token=None)
    torch.manual_seed(4)
    samples = Sampler(roles, tokenizer, cfg).sample(rows, record_logprobs=True)
    scored = _scored_old_logprobs(roles, samples, 0.8)
    torch.testing.assert_close(samples.logprobs, scored, atol=1e-4, rtol=0)


def test_auto_records_logprobs_where_the_model_computes_in_float32():
    from lora_ppo import estimate as est
    from lora_ppo.config import recipe_from_dict
    from lora_ppo.model_shape import ModelShape

    auto = recipe_from_dict({})
    assert auto.rollout.logprobs_from_generation == "auto"
    assert auto.logprobs_from_generation_on(float32=True) and not auto.logprobs_from_generation_on(float32=False)
    off = recipe_from_dict({"rollout": {"logprobs_from_generation": False}})
    assert not off.logprobs_from_generation_on(float32=True)
    # The estimate decides it the same way: in fp32 (cpu) the policy is not scored again.
    assert auto.scored_roles(float32=True) == auto.scored_roles(float32=False) - 1
    shape = ModelShape(64, 128, 2, 4, 2, 16, 320, True)
    assert est.score_bytes(shape, auto, 4, 8) < est.score_bytes(shape, off, 4, 8)


def test_a_run_on_cpu_records_logprobs_by_default(tiny_model_dir, tmp_path):
    from lora_ppo.config import Recipe
    from lora_ppo.parts import build
    from tests.conftest import tiny_recipe_dict

    recipe = Recipe(**tiny_recipe_dict(tiny_model_dir, tmp_path / "run"))
    assert build(recipe).sampler(recipe).cfg.logprobs_from_generation is True  # fp32 on CPU


def test_a_rollout_scores_the_reference_by_default_as_the_bare_base_model(roles, tokenizer, rows):
    """collect_rollout's defaults score the reference role: with adapters disabled, the base model's
    own forward, at the sampling temperature, on the tokens sampled."""
    torch.manual_seed(3)
    started = time.perf_counter()
    rollout = collect_rollout(Sampler(roles, tokenizer, RolloutConfig(batch_size=4, max_new_tokens=6, temperature=0.9)),
                              rows, RewardSources.of(count_letter_e))
    wall = time.perf_counter() - started
    assert set(rollout.timings) == {"generate", "score_forward", "reward"}
    assert all(0 <= seconds <= wall for seconds in rollout.timings.values())
    ids, mask, start = rollout.input_ids, rollout.attention_mask, rollout.response_start
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad(), roles.peft.disable_adapter():
        logits = roles.peft(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    by_hand = torch.log_softmax(logits[:, start - 1 : -1] / 0.9, dim=-1).gather(2, ids[:, start:, None])[..., 0]
    m = rollout.response_mask
    torch.testing.assert_close(rollout.ref_logprobs[m], by_hand[m], atol=1e-4, rtol=0)
    assert (rollout.old_logprobs - rollout.ref_logprobs)[m].abs().max() > 1e-3  # the policy is not the base
    # Rescored old logprobs, and generation's recorded beside them (check/generation_logprob_diff)
    torch.testing.assert_close(rollout.generation_logprobs[m], rollout.old_logprobs[m], atol=1e-4, rtol=0)
