"""The scores the optimiser sees, against numbers computed here by hand: the missing-EOS penalty
on the rows that did not stop, per-source normalisation by each source's own running moments
before weighting, running score normalisation over steps (population variance, divided by the
standard deviation), clipping, the length penalty on real lengths, and refused non-finite rewards.

The trainer's shaping methods run on a bare `PPOTrainer` holding only what they read (recipe,
state, reward sources), so no model is loaded except for the one `collect_rollout` test."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from lora_ppo.config import Recipe, RolloutConfig
from lora_ppo.ppo_math import update_running_moments
from lora_ppo.rewards import RewardBatch, RewardError, RewardSources, WeightedSource
from lora_ppo.rollout import Rollout, Samples, collect_rollout, left_pad, truncate_at_stop
from lora_ppo.roles import POLICY
from lora_ppo.state import TrainState
from lora_ppo.trainer import PPOTrainer
from tests.conftest import prompt_rows

TOL = dict(atol=1e-6, rtol=1e-5)
EOS = PAD = 2


def never_called(prompts, completions):
    raise AssertionError("the trainer's shaping reads the rollout's scores, it never calls a source")


def shaper(ppo: dict | None = None, sources=()) -> PPOTrainer:
    """A PPOTrainer with only what `_shape_scores` and `_combined_scores` read."""
    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.recipe = Recipe(ppo=ppo or {})
    trainer.state = TrainState()
    trainer.parts = SimpleNamespace(rewards=RewardSources(list(sources) or [WeightedSource("only", never_called)]))
    return trainer


def rollout_of(scores, lengths=None, width=None, raw_scores=None, source_scores=None, stopped=None) -> Rollout:
    """A rollout whose only meaningful fields are its scores and response mask (`lengths` real
    tokens per row, padded to `width`)."""
    B = len(scores)
    lengths = lengths or [1] * B
    width = width or max(lengths)
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    zeros = torch.zeros(B, width)
    return Rollout(
        rows=[], completions=[""] * B, query_ids=torch.ones(B, 1, dtype=torch.long),
        query_mask=torch.ones(B, 1, dtype=torch.long), response_ids=torch.zeros(B, width, dtype=torch.long),
        response_mask=mask, old_logprobs=zeros, ref_logprobs=zeros, values=zeros,
        raw_scores=torch.tensor(raw_scores if raw_scores is not None else scores, dtype=torch.float32),
        scores=torch.tensor(scores, dtype=torch.float32),
        stopped=torch.tensor(stopped if stopped is not None else [True] * B),
        source_scores=source_scores or {},
    )


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# ---- running moments --------------------------------------------------------------------------


def test_update_running_moments_two_batches_by_hand():
    # Fresh state (0, 1, 0): the placeholder variance 1 carries no weight.
    mean, var, count = update_running_moments(0.0, 1.0, 0, t([1.0, 2.0, 3.0, 4.0]))
    assert (count, mean) == (4, 2.5)
    assert math.isclose(var, 1.25, rel_tol=1e-12)  # population variance: ((1.5² + 0.5²) * 2) / 4
    mean, var, count = update_running_moments(mean, var, count, t([10.0, 20.0]))
    # All six values at once: mean 40/6, E[x²] = 530/6, var = 530/6 - (40/6)² = 395/9.
    assert count == 6
    assert math.isclose(mean, 40 / 6, rel_tol=1e-12)
    assert math.isclose(var, 395 / 9, rel_tol=1e-12)


def test_score_norm_with_constant_scores_stays_finite():
    trainer = shaper({"score_norm": True})
    shaped = trainer._shape_scores(rollout_of([3.0, 3.0, 3.0, 3.0]))
    assert torch.isfinite(shaped).all()
    torch.testing.assert_close(shaped, t([0.0, 0.0, 0.0, 0.0]), **TOL)
    assert trainer.state.score_moments == (3.0, 0.0, 4)


def test_score_norm_uses_running_moments_over_steps_and_divides_by_the_std():
    trainer = shaper({"score_norm": True})
    first, second = [1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 2.0, 6.0]
    shaped = trainer._shape_scores(rollout_of(first))
    # Step 1: mean 2.5, population variance 1.25 -> std sqrt(1.25).
    torch.testing.assert_close(shaped, t([(s - 2.5) / math.sqrt(1.25) for s in first]), **TOL)
    shaped = trainer._shape_scores(rollout_of(second))
    # Step 2: the moments of all eight scores so far, this step's included.
    mean, var = statistics.fmean(first + second), statistics.pvariance(first + second)
    assert (mean, var) == (6.0, 35.25)  # 48 / 8; 570 / 8 - 6²
    torch.testing.assert_close(shaped, t([(s - mean) / math.sqrt(var) for s in second]), **TOL)
    m, v, n = trainer.state.score_moments
    assert n == 8 and math.isclose(m, mean, rel_tol=1e-12) and math.isclose(v, var, rel_tol=1e-12)


def test_score_norm_off_leaves_scores_and_moments_alone():
    trainer = shaper()
    torch.testing.assert_close(trainer._shape_scores(rollout_of([5.0, -2.0])), t([5.0, -2.0]), atol=0.0, rtol=0.0)
    assert trainer.state.score_moments == (0.0, 1.0, 0)


# ---- clipping and length penalty --------------------------------------------------------------


def test_length_penalty_counts_real_tokens_not_the_padded_width():
    trainer = shaper({"length_penalty": 0.1})
    # Real lengths 1, 4, 6, 2 in a batch padded to 8 columns.
    shaped = trainer._shape_scores(rollout_of([1.0, 1.0, 1.0, 1.0], lengths=[1, 4, 6, 2], width=8))
    torch.testing.assert_close(shaped, t([0.9, 0.6, 0.4, 0.8]), **TOL)


def test_score_clip_then_length_penalty():
    trainer = shaper({"score_clip": 1.0, "length_penalty": 0.1})
    shaped = trainer._shape_scores(rollout_of([-3.0, -0.5, 0.5, 3.0], lengths=[1, 2, 3, 4]))
    torch.testing.assert_close(shaped, t([-1.0 - 0.1, -0.5 - 0.2, 0.5 - 0.3, 1.0 - 0.4]), **TOL)


def test_score_clip_applies_after_normalisation():
    trainer = shaper({"score_norm": True, "score_clip": 1.0})
    scores = [0.0, 0.0, 0.0, 10.0]  # mean 2.5, population variance 18.75
    shaped = trainer._shape_scores(rollout_of(scores))
    std = math.sqrt(18.75)
    torch.testing.assert_close(shaped, t([-2.5 / std, -2.5 / std, -2.5 / std, 1.0]), **TOL)
    assert 2.5 / std < 1.0 < 7.5 / std  # only the last one is clipped


# ---- per-source normalisation -----------------------------------------------------------------


def two_sources():
    return [WeightedSource("judge", never_called, weight=2.0, normalize=True),
            WeightedSource("length", never_called, weight=-0.5)]


def mixed_rollout(judge, length, stopped, penalty):
    raw = [2.0 * j - 0.5 * n for j, n in zip(judge, length)]
    scores = [r - (0.0 if s else penalty) for r, s in zip(raw, stopped)]
    return rollout_of(scores, raw_scores=raw, source_scores={"judge": judge, "length": length}, stopped=stopped)


def test_normalised_source_uses_its_own_moments_before_weighting_and_keeps_the_eos_penalty():
    trainer = shaper(sources=two_sources())
    stopped, penalty = [True, False, True, False], 1.5
    judge1, length1 = [1.0, 3.0, 5.0, 7.0], [10.0, 0.0, 4.0, 2.0]
    shaped = trainer._shape_scores(mixed_rollout(judge1, length1, stopped, penalty))
    # judge: mean 4, population variance 5; length is not normalised; -1.5 where the row did not stop.
    expected = [2.0 * (j - 4.0) / math.sqrt(5.0) - 0.5 * n - (0.0 if s else penalty)
                for j, n, s in zip(judge1, length1, stopped)]
    torch.testing.assert_close(shaped, t(expected), **TOL)

    judge2, length2 = [2.0, 2.0, 2.0, 10.0], [1.0, 1.0, 1.0, 1.0]
    shaped = trainer._shape_scores(mixed_rollout(judge2, length2, stopped, penalty))
    mean, var = statistics.fmean(judge1 + judge2), statistics.pvariance(judge1 + judge2)
    assert (mean, var) == (4.0, 8.5)  # 32 / 8; 196 / 8 - 4²
    expected = [2.0 * (j - mean) / math.sqrt(var) - 0.5 * n - (0.0 if s else penalty)
                for j, n, s in zip(judge2, length2, stopped)]
    torch.testing.assert_close(shaped, t(expected), **TOL)
    assert set(trainer.state.source_moments) == {"judge"}
    m, v, n = trainer.state.source_moments["judge"]
    assert n == 8 and math.isclose(m, 4.0, rel_tol=1e-12) and math.isclose(v, 8.5, rel_tol=1e-12)
    assert trainer.state.score_moments == (0.0, 1.0, 0)  # ppo.score_norm is off


def test_normalised_sources_then_score_norm_on_the_total():
    trainer = shaper({"score_norm": True}, sources=two_sources())
    judge, length, stopped = [1.0, 3.0, 5.0, 7.0], [10.0, 0.0, 4.0, 2.0], [True, True, False, True]
    shaped = trainer._shape_scores(mixed_rollout(judge, length, stopped, 2.0))
    total = [2.0 * (j - 4.0) / math.sqrt(5.0) - 0.5 * n - (0.0 if s else 2.0)
             for j, n, s in zip(judge, length, stopped)]
    mean, var = statistics.fmean(total), statistics.pvariance(total)
    torch.testing.assert_close(shaped, t([(x - mean) / math.sqrt(var) for x in total]), **TOL)


def test_without_a_normalised_source_the_rollout_scores_are_used_as_they_are():
    sources = [WeightedSource("judge", never_called, weight=2.0), WeightedSource("length", never_called, weight=-0.5)]
    trainer = shaper(sources=sources)
    rollout = mixed_rollout([1.0, 3.0], [10.0, 0.0], [True, False], 1.5)
    torch.testing.assert_close(trainer._shape_scores(rollout), t([-3.0, 6.0 - 1.5]), **TOL)
    assert trainer.state.source_moments == {}


# ---- the missing-EOS penalty in the rollout ---------------------------------------------------


class FixedSampler:
    """Stands in for `Sampler`: returns the given samples instead of generating."""

    def __init__(self, roles, cfg: RolloutConfig, samples: Samples):
        self.roles, self.cfg, self.samples = roles, cfg, samples

    def sample(self, rows, record_logprobs=False, role=POLICY, seeds=None) -> Samples:
        return self.samples


@pytest.fixture(scope="module")
def roles(make_roles):
    return make_roles(seed=2)


@pytest.fixture(scope="module")
def fixed_samples(tiny_tokenizer):
    """Three prompts whose responses stop, run out of tokens (no stop), and stop."""
    rows = prompt_rows(tiny_tokenizer, ["This movie was", "The film is a", "A dull sequel"])
    query_ids, query_mask = left_pad(rows, PAD, "cpu")
    response_ids, response_mask, stopped = truncate_at_stop(
        torch.tensor([[40, 41, EOS, EOS], [50, 51, 52, 53], [EOS, EOS, EOS, EOS]]), (EOS,), PAD)
    assert stopped.tolist() == [True, False, True]
    samples = Samples(query_ids, query_mask, response_ids, response_mask, stopped,
                      tiny_tokenizer.batch_decode(response_ids, skip_special_tokens=True))
    return rows, samples


@pytest.mark.parametrize("penalty", [1.5, None])
def test_missing_eos_penalty_only_on_rows_that_did_not_stop(roles, fixed_samples, penalty):
    rows, samples = fixed_samples

    def per_row(prompts, completions):
        return [1.0, 2.0, 3.0]

    cfg = RolloutConfig(forward_batch_size=2, logprobs_from_generation=False, missing_eos_penalty=penalty)
    rollout = collect_rollout(FixedSampler(roles, cfg, samples), rows,
                              RewardSources.of(per_row))
    torch.testing.assert_close(rollout.raw_scores, t([1.0, 2.0, 3.0]), atol=0.0, rtol=0.0)
    expected = [1.0, 2.0 - 1.5, 3.0] if penalty is not None else [1.0, 2.0, 3.0]
    torch.testing.assert_close(rollout.scores, t(expected), atol=0.0, rtol=0.0)
    assert rollout.stopped.tolist() == [True, False, True]


# ---- non-finite rewards -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_reward_is_refused_naming_the_source(bad):
    def judge(prompts, completions):
        return [1.0, bad, 0.5]

    def fine(prompts, completions):
        return [0.0, 0.0, 0.0]

    batch = RewardBatch(prompts=["p0", "p1", "p2"], completions=["a", "b", "c"])
    sources = RewardSources([WeightedSource("fine", fine), WeightedSource("my_judge", judge, weight=0.5)])
    with pytest.raises(RewardError) as err:
        sources.score(batch)
    message = str(err.value)
    assert "my_judge" in message and "prompt index 1" in message and "'p1'" in message
    assert str(bad) in message and "\n" not in message


def test_non_finite_side_metric_is_refused_naming_it():
    def fine(prompts, completions):
        return [0.0, 0.0]

    def side(prompts, completions):
        return [float("nan"), 0.0]

    batch = RewardBatch(prompts=["p0", "p1"], completions=["a", "b"])
    with pytest.raises(RewardError, match=r"side_metric returned nan for prompt index 0"):
        RewardSources([WeightedSource("fine", fine)], side={"side_metric": side}).score(batch)
