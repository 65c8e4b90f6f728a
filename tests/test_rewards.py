"""Reward sources: builtin lexicons, Python functions, and a sequence classifier with its own
tokenizer; bad reward output is caught with the function named."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from lora_ppo.config import RewardConfig
from lora_ppo.errors import RecipeError
from lora_ppo.rewards import (
    RewardBatch,
    RewardError,
    build_reward,
    build_side_metrics,
    score_completions,
)


def test_vader_prefers_positive_text():
    fn = build_reward(RewardConfig(kind="vader"))
    good, bad = fn(["", ""], ["a wonderful, great film", "a terrible, awful film"])
    assert good > 0.5 and bad < -0.5


def test_textblob_side_metric():
    side = build_side_metrics(RewardConfig(also_log=["textblob"]))
    good, bad = side["textblob"](["", ""], ["a wonderful, great film", "a terrible, awful film"])
    assert good > 0 > bad


def test_function_reward_is_imported_by_name():
    fn = build_reward(RewardConfig(kind="function", function="tests.reward_fns:count_letter_e"))
    assert fn(["p"], ["eee"]) == [3.0]


@pytest.mark.parametrize("spec, message", [
    ("tests.no_such_module:f", "cannot import module 'tests.no_such_module'"),
    ("tests.reward_fns:nope", "has no callable named 'nope'"),
])
def test_bad_function_spec(spec, message):
    with pytest.raises(RecipeError, match=message):
        build_reward(RewardConfig(kind="function", function=spec))


def test_score_completions_checks_what_comes_back():
    from tests import reward_fns

    with pytest.raises(RewardError, match="wrong_count returned 1 scores for 2 completions"):
        score_completions(reward_fns.wrong_count, RewardBatch(["a", "b"], ["c", "d"]))
    with pytest.raises(RewardError, match="raises raised RuntimeError: reward server is down"):
        score_completions(reward_fns.raises, RewardBatch(["a"], ["c"]))

    def nan_reward(prompts, completions):
        return [0.0, math.nan]

    with pytest.raises(RewardError, match="nan for prompt index 1: 'b'"):
        score_completions(nan_reward, RewardBatch(["a", "b"], ["c", "d"]))


def test_classifier_reward_uses_its_own_tokenizer(tiny_classifier_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    fn = build_reward(RewardConfig(kind="classifier", model=str(tiny_classifier_dir)))
    prompts, completions = ["the film", "a film"], [" good great", " bad"]
    scores = score_completions(fn, RewardBatch(prompts, completions))
    tok = AutoTokenizer.from_pretrained(tiny_classifier_dir)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_classifier_dir)
    with torch.no_grad():
        expected = [model(**tok(p + c, return_tensors="pt")).logits[0, 1].item() for p, c in zip(prompts, completions)]
    assert scores == pytest.approx(expected, abs=1e-5)


def test_classifier_label_out_of_range(tiny_classifier_dir):
    with pytest.raises(RecipeError, match="reward.label: 5 is out of range"):
        build_reward(RewardConfig(kind="classifier", model=str(tiny_classifier_dir), label=5))


def test_classifier_missing_folder(tmp_path):
    with pytest.raises(RecipeError, match="reward.model"):
        build_reward(RewardConfig(kind="classifier", model=str(tmp_path / "nothing")))


def test_a_reward_module_is_imported_only_when_the_recipe_names_it():
    cfg = RewardConfig(kind="vader", function="tests.reliability.never_imported:boom")
    build_reward(cfg)
    assert "tests.reliability.never_imported" not in sys.modules


def _rows(tokenizer, n=3, conversation=False):
    from lora_ppo.data import PromptFormat, PromptRow

    fmt = PromptFormat(tokenizer, chat_template=True)
    rows = []
    for i in range(n):
        prompt = [{"role": "user", "content": f"question {i}"}] if conversation else f"question {i}"
        text, ids = fmt.render(prompt)
        rows.append(PromptRow(prompt, text, ids, {"answer": str(i), "source": "test"}))
    return rows


def test_functions_are_called_as_trl_calls_them(tiny_tokenizer):
    """Keywords: untemplated prompts, completions (a one-message list for conversations),
    completion_ids, and each column with one value per completion."""
    seen = {}

    def reward(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, answer=answer, kwargs=kwargs)
        return [1.0] * len(completions)

    text_rows = _rows(tiny_tokenizer)
    score_completions(reward, RewardBatch.from_rows(text_rows, ["a", "b", "c"], [[1], [2, 3], [4]]))
    assert seen["prompts"] == ["question 0", "question 1", "question 2"]  # never the templated text
    assert seen["completions"] == ["a", "b", "c"] and seen["ids"] == [[1], [2, 3], [4]]
    assert seen["answer"] == ["0", "1", "2"] and seen["kwargs"] == {"source": ["test"] * 3}

    conversation_rows = _rows(tiny_tokenizer, conversation=True)
    score_completions(reward, RewardBatch.from_rows(conversation_rows, ["a", "b", "c"], [[1], [2], [3]]))
    assert seen["prompts"][0] == [{"role": "user", "content": "question 0"}]
    assert seen["completions"][1] == [{"role": "assistant", "content": "b"}]


def test_two_argument_and_trl_written_functions_work_unchanged(tiny_tokenizer):
    from tests import reward_fns

    batch = RewardBatch.from_rows(_rows(tiny_tokenizer, conversation=True), ["ab", "c", "def"])
    assert score_completions(reward_fns.trl_style, batch) == [2.0, 1.0, 3.0]

    def positional(p, c):  # other parameter names: called positionally
        return [float(len(x)) for x in c]

    assert score_completions(positional, RewardBatch.from_rows(_rows(tiny_tokenizer), ["ab", "c", "def"])) == [2, 1, 3]


def test_a_function_that_needs_a_missing_column_is_refused_before_training():
    from lora_ppo.rewards import RewardSources
    from tests import reward_fns

    with pytest.raises(RecipeError, match=r"reward.function: needs_solution needs column 'solution', which "
                                          r"'data.jsonl' does not have \(columns besides the prompt: answer\)"):
        RewardSources(reward_fns.needs_solution).check_columns(["answer"], "data.jsonl")
    RewardSources(reward_fns.needs_solution).check_columns(["solution"], "data.jsonl")
    with pytest.raises(RecipeError, match="reward.answer_column: column 'answer' not in 'd' "):
        build_reward_sources_for("math_answer", "answer").check_columns(["solution"], "d")


def build_reward_sources_for(kind, column):
    from lora_ppo.rewards import build_reward_sources

    return build_reward_sources(RewardConfig(kind=kind, answer_column=column))


def test_math_answer_and_exact_match_rewards(tiny_tokenizer):
    rows = _rows(tiny_tokenizer)  # answers "0", "1", "2"
    math = build_reward(RewardConfig(kind="math_answer", answer_column="answer"))
    assert score_completions(math, RewardBatch.from_rows(rows, ["It is 0.", "#### 10", "2 or 3? 2"])) == [1, 0, 1]
    bonus = build_reward(RewardConfig(kind="math_answer", answer_column="answer", format_bonus=0.1))
    assert score_completions(bonus, RewardBatch.from_rows(rows, ["#### 0", "\\boxed{7}", "2"])) == [1.1, 0.1, 1.0]
    exact = build_reward(RewardConfig(kind="exact_match", answer_column="answer"))
    assert score_completions(exact, RewardBatch.from_rows(rows, [" 0 ", "1.0", "2"])) == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("conversation", [False, True])
def test_columns_follow_their_prompt_through_shuffling_batching_and_groups(tmp_path, tiny_model_dir, conversation):
    """Every completion's column values are its own prompt's, in the order the trainer shuffled,
    batched and grouped (RLOO: each prompt twice in a row), and prompts arrive untemplated."""
    import json

    import lora_ppo
    from tests import reward_fns
    from tests.conftest import tiny_recipe_dict

    data = tmp_path / "rows.jsonl"
    with open(data, "w") as f:
        for k in range(12):
            prompt = [{"role": "user", "content": f"Item {k}"}] if conversation else f"Item {k}"
            f.write(json.dumps({"prompt": prompt, "key": k, "label": f"L{k}", "unused": True}) + "\n")
    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(
        tiny_model_dir, tmp_path / "run", data={"source": str(data), "eval_size": 2, "chat_template": True},
        reward={"kind": "function", "function": "tests.reward_fns:records_columns"},
        ppo={"advantage_estimator": "rloo", "num_minibatches": 1}, rollout={"samples_per_prompt": 2},
        train={"steps": 2, "eval": True, "sample_every": 0},
    ))
    reward_fns.SEEN.clear()
    lora_ppo.PPOTrainer(recipe, progress=False).train()
    training_calls = [call for call in reward_fns.SEEN if len(call["key"]) == 4]
    assert len(training_calls) == 2
    for call in reward_fns.SEEN:
        for prompt, key, label in zip(call["prompts"], call["key"], call["label"]):
            text = prompt[0]["content"] if conversation else prompt
            assert text == f"Item {key}" and label == f"L{key}"
        assert call["extra"] == ["unused"]
        if conversation:
            assert all(c[0]["role"] == "assistant" for c in call["completions"])
    for call in training_calls:
        assert call["key"][0::2] == call["key"][1::2]  # each prompt twice in a row
    # Two steps of two prompts each, shuffled: not simply the file's order.
    assert [c["key"][0::2] for c in training_calls] != [[0, 1], [2, 3]]
