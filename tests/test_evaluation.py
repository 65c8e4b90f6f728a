"""Held-out evaluation against numbers worked out by hand: each metric is the mean over prompts of
each prompt's mean, with the standard error across prompts; every completion is a record; the
sampling is seeded inside a forked random stream; distinct-n and the printed table."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from lora_ppo.config import RolloutConfig
from lora_ppo.data import PromptRow
from lora_ppo.evaluation import Evaluation, distinct_n, evaluate, format_evaluation, per_prompt_means
from lora_ppo.rewards import RewardSources, WeightedSource
from lora_ppo.rollout import Samples, left_pad
from tests.conftest import prompt_rows
from tests.test_agent_episodes_scripted import ScriptedPolicy, again_settings

PAD = 0


class RandomTokens:
    """A sampler that writes 1-4 random tokens (3..49) per row from torch's global stream, so the
    seed decides what it writes, and keeps what it wrote in order."""

    def __init__(self, batch_size: int, roles=None, temperature: float = 1.0):
        self.cfg = RolloutConfig(batch_size=batch_size, temperature=temperature)
        self.roles = roles or SimpleNamespace(lm_head=SimpleNamespace(weight=torch.zeros(1)))
        self.written: list[list[int]] = []
        self.batch_sizes: list[int] = []

    def sample(self, rows, record_logprobs=False, role=None, seeds=None) -> Samples:
        drawn = [torch.randint(3, 50, (int(torch.randint(1, 5, ())),)).tolist() for _ in rows]
        self.written += drawn
        self.batch_sizes.append(len(rows))
        width = max(len(ids) for ids in drawn)
        response = torch.tensor([ids + [PAD] * (width - len(ids)) for ids in drawn])
        mask = torch.tensor([[True] * len(ids) + [False] * (width - len(ids)) for ids in drawn])
        query_ids, query_mask = left_pad(rows, PAD, "cpu")
        return Samples(query_ids, query_mask, response, mask, torch.ones(len(rows), dtype=torch.bool),
                       [" ".join(map(str, ids)) for ids in drawn])


def _rows(n: int) -> list[PromptRow]:
    return [PromptRow(f"prompt {i}", f"prompt {i}", (1, 5 + i)) for i in range(n)]


def _count(prompts, completions, **_):
    return [float(len(c.split())) for c in completions]


def _sevenths(prompts, completions, **_):
    return [sum(int(t) for t in c.split()) % 7 / 7 for c in completions]


def _first(prompts, completions, completion_ids, **_):
    return [float(ids[0]) for ids in completion_ids]


def _mean_and_se(values: list[float], n_prompts: int) -> tuple[float, float]:
    per = len(values) // n_prompts
    means = [statistics.fmean(values[i * per:(i + 1) * per]) for i in range(n_prompts)]
    return statistics.fmean(means), statistics.stdev(means) / math.sqrt(n_prompts)


def _distinct_by_hand(sequences: list[list[int]], n: int) -> float:
    grams = [tuple(seq[i:i + n]) for seq in sequences for i in range(len(seq) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def test_each_metric_is_the_mean_of_the_prompts_means_with_its_standard_error():
    sampler = RandomTokens(batch_size=4)  # 6 completions: batches of 4 and 2
    rewards = RewardSources([WeightedSource("count", _count, 1.0), WeightedSource("sevenths", _sevenths, 2.0)],
                            side={"first": _first})
    evaluation = evaluate(sampler, _rows(3), rewards, seed=5, samples_per_prompt=2, with_text_stats=True)

    written = sampler.written
    assert sampler.batch_sizes == [4, 2] and len(written) == 6
    count = [float(len(ids)) for ids in written]
    sevenths = [sum(ids) % 7 / 7 for ids in written]
    expected = {"score": [c + 2 * s for c, s in zip(count, sevenths)], "count": count, "sevenths": sevenths,
                "first": [float(ids[0]) for ids in written], "length": count}
    scores = evaluation.scores
    for name, values in expected.items():
        mean, se = _mean_and_se(values, 3)
        assert scores[name] == pytest.approx(mean, rel=1e-12) and scores[f"{name}_se"] == pytest.approx(se, rel=1e-9)
    assert scores["distinct_1"] == pytest.approx(_distinct_by_hand(written, 1))
    assert scores["distinct_2"] == pytest.approx(_distinct_by_hand(written, 2))
    assert set(scores) == {*(k for name in expected for k in (name, f"{name}_se")), "distinct_1", "distinct_2"}

    # One record per completion, in order: prompt k // 2 and sample k % 2, with its own scores.
    assert [(r["prompt"], r["sample"]) for r in evaluation.records] == [
        (f"prompt {k // 2}", k % 2) for k in range(6)]
    for k, record in enumerate(evaluation.records):
        assert record["completion"] == " ".join(map(str, written[k]))
        assert {name: record[name] for name in ("score", "count", "sevenths", "first")} == pytest.approx(
            {name: expected[name][k] for name in ("score", "count", "sevenths", "first")})


def test_an_episodes_score_is_its_last_turn_scored_plus_the_environments_rewards(tiny_tokenizer):
    turns = ["Hello there, I think it is four.", "Fine, five."]
    last_turn = tiny_tokenizer(turns[1], add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]

    def tokens(prompts, completions, completion_ids, **_):
        return [float(len(ids)) for ids in completion_ids]

    def said_five(prompts, completions, **_):
        return [float(c == "Fine, five.") for c in completions]

    rows = prompt_rows(tiny_tokenizer, ["What is 2 plus 3?"], chat_template=True)
    evaluation = evaluate(ScriptedPolicy(tiny_tokenizer, turns, [True, True]), rows,
                          RewardSources.of(tokens, side={"said_five": said_five}), seed=0,
                          episodes=again_settings(max_turns=2, max_episode_tokens=None))
    # The sources score the last turn (its tokens, stop token included); the environment gave 0.5 a turn.
    assert evaluation.scores["score"] == len(last_turn) + 0.5 + 0.5
    assert evaluation.scores["said_five"] == 1.0
    (record,) = evaluation.records
    assert [m["content"] for m in record["transcript"] if m["role"] == "assistant"] == turns


def test_one_source_is_only_the_score_and_without_asking_no_text_stats():
    evaluation = evaluate(RandomTokens(batch_size=8), _rows(2), RewardSources.of(_count), seed=0)
    assert set(evaluation.scores) == {"score", "score_se"}
    assert set(evaluation.records[0]) == {"prompt", "sample", "completion", "score"}


def test_the_seed_decides_the_completions_and_the_callers_stream_is_untouched():
    def written(seed: int) -> list[list[int]]:
        sampler = RandomTokens(batch_size=2)
        evaluate(sampler, _rows(4), RewardSources.of(_count), seed=seed)
        return sampler.written

    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = written(7)
    assert torch.equal(torch.rand(3), expected_next)  # the training stream goes on as if nothing ran
    assert written(7) == first and written(8) != first


def test_the_kl_is_each_responses_sum_of_policy_minus_reference_logprobs(make_roles, tiny_tokenizer):

    roles = make_roles(perturbed=("policy",))
    sampler = RandomTokens(batch_size=4, roles=roles, temperature=0.7)
    rows = prompt_rows(tiny_tokenizer, ["This movie was", "The acting in this film", "Honestly"])
    evaluation = evaluate(sampler, rows, RewardSources.of(_count), seed=0, with_kl=True)

    kls = []
    with torch.no_grad():
        for row, response in zip(rows, sampler.written):  # one unpadded row at a time
            ids = torch.tensor([[*row.ids, *response]])
            roles.peft.set_adapter("policy")
            policy = torch.log_softmax(roles.peft(input_ids=ids).logits[0].double() / 0.7, dim=-1)
            with roles.peft.disable_adapter():
                reference = torch.log_softmax(roles.peft(input_ids=ids).logits[0].double() / 0.7, dim=-1)
            at = range(len(row.ids) - 1, ids.shape[1] - 1)  # the positions that predict the response
            kls.append(sum(float(policy[t, ids[0, t + 1]] - reference[t, ids[0, t + 1]]) for t in at))
    assert max(abs(k) for k in kls) > 1e-3  # the policy adapter moved the model
    mean, se = _mean_and_se(kls, 3)
    # fp32 passes over a padded batch against one unpadded row each: about 1e-6 per token apart
    assert evaluation.scores["kl"] == pytest.approx(mean, abs=1e-4)
    assert evaluation.scores["kl_se"] == pytest.approx(se, abs=1e-4)


def test_the_bar_advances_by_prompts_done():
    bar = SimpleNamespace(n=0.0, updates=[])
    bar.update = lambda k: (bar.updates.append(k), setattr(bar, "n", bar.n + k))
    evaluate(RandomTokens(batch_size=4), _rows(3), RewardSources.of(_count), seed=0, samples_per_prompt=2,
             progress=bar)
    assert bar.updates == [2.0, 1.0] and bar.n == 3


def test_no_prompts_give_zeros_and_no_records():
    rewards = RewardSources([WeightedSource("a", _count), WeightedSource("b", _count)], side={"first": _first})
    evaluation = evaluate(RandomTokens(batch_size=4), [], rewards, seed=0)
    assert evaluation.records == []
    assert evaluation.scores == {k: 0.0 for name in ("score", "a", "b", "first") for k in (name, f"{name}_se")}


def test_one_prompt_has_no_spread_to_speak_of():
    assert per_prompt_means([1.0, 2.0, 6.0], 1) == (3.0, 0.0)
    # Two prompts of two samples: means 1.5 and 5.0; their standard deviation is 3.5 / sqrt(2).
    mean, se = per_prompt_means([1.0, 2.0, 4.0, 6.0], 2)
    assert mean == pytest.approx(3.25) and se == pytest.approx(3.5 / math.sqrt(2) / math.sqrt(2))


def test_distinct_n_counts_n_grams_within_each_completion():
    # unigrams 1 2 1 2 3: three distinct of five; bigrams (1,2) (2,1) (1,2): two of three, none across rows
    assert distinct_n([[1, 2, 1, 2], [3]], 1) == pytest.approx(3 / 5)
    assert distinct_n([[1, 2, 1, 2], [3]], 2) == pytest.approx(2 / 3)
    assert distinct_n([[1], [2]], 2) == 0.0


def test_the_table_shows_each_metric_with_its_standard_error_and_the_count():
    records = [{"prompt": "p", "sample": s} for s in (0, 1)] + [{"prompt": "q", "sample": s} for s in (0, 1)]
    evaluation = Evaluation({"score": 0.25, "score_se": 0.125, "distinct_1": 0.5}, records)
    assert format_evaluation(evaluation, "held-out").splitlines() == [
        "held-out",
        "  score          0.250  (± 0.125)",
        "  distinct_1     0.500",
        "  4 completions of 2 prompts",
    ]
    one_each = Evaluation({"score": 1.0}, [{"prompt": p, "sample": 0} for p in "pqr"])
    assert format_evaluation(one_each, "t").splitlines()[-1] == "  3 completions of 3 prompts"
