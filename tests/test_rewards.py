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
        score_completions(reward_fns.wrong_count, ["a", "b"], ["c", "d"])
    with pytest.raises(RewardError, match="raises raised RuntimeError: reward server is down"):
        score_completions(reward_fns.raises, ["a"], ["c"])

    def nan_reward(prompts, completions):
        return [0.0, math.nan]

    with pytest.raises(RewardError, match="nan for prompt index 1: 'b'"):
        score_completions(nan_reward, ["a", "b"], ["c", "d"])


@pytest.fixture(scope="module")
def tiny_classifier_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        LlamaConfig,
        LlamaForSequenceClassification,
        PreTrainedTokenizerFast,
    )

    folder = tmp_path_factory.mktemp("tiny-classifier")
    # Its own word-level tokenizer, unlike the policy's byte-level BPE: text is re-tokenized.
    words = ["[PAD]", "[UNK]", "good", "bad", "film", "a", "the", "great", "awful"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=2, pad_token_id=0)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    return folder


def test_classifier_reward_uses_its_own_tokenizer(tiny_classifier_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    fn = build_reward(RewardConfig(kind="classifier", model=str(tiny_classifier_dir)))
    prompts, completions = ["the film", "a film"], [" good great", " bad"]
    scores = score_completions(fn, prompts, completions)
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
