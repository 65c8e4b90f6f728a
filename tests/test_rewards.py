"""Reward sources: builtin lexicons, Python functions, and a sequence classifier with its own
tokenizer; bad reward output is caught with the function named."""

from __future__ import annotations

import math
from pathlib import Path
import sys
from typing import Optional

import pytest
import torch

from lora_ppo.config import ModelConfig, RewardConfig
from lora_ppo.errors import RecipeError
from lora_ppo.rewards import (
    RewardBatch,
    RewardError,
    build_reward,
    build_side_metrics,
    score_completions,
)
from tests.reward_fns import count_letter_e


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


def plain_forward_scores(folder: Path, texts: list[str], label: int) -> list[float]:
    """Each text alone through the saved classifier and its own tokenizer: logit `label`."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    with torch.no_grad():
        return [model(**tok(text, return_tensors="pt")).logits[0, label].item() for text in texts]


def test_classifier_reward_uses_its_own_tokenizer(tiny_classifier_dir):
    fn = build_reward(RewardConfig(kind="classifier", model=str(tiny_classifier_dir), quantization="none"))
    prompts, completions = ["the film", "a film"], [" good great", " bad"]
    scores = score_completions(fn, RewardBatch(prompts, completions))
    expected = plain_forward_scores(tiny_classifier_dir, [p + c for p, c in zip(prompts, completions)], label=1)
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
    from lora_ppo.rewards import check_reward_columns

    needs = RewardConfig(kind="function", function="tests.reward_fns:needs_solution")
    with pytest.raises(RecipeError, match=r"reward.function: needs_solution needs column 'solution', which "
                                          r"'data.jsonl' does not have \(columns besides the prompt: answer\)"):
        check_reward_columns(needs, ["answer"], "data.jsonl")
    check_reward_columns(needs, ["solution"], "data.jsonl")
    with pytest.raises(RecipeError, match="reward.answer_column: column 'answer' not in 'd' "):
        check_reward_columns(RewardConfig(kind="math_answer", answer_column="answer"), ["solution"], "d")
    mixed = RewardConfig(sources=[{"kind": "vader"}, {"kind": "function", "function": "tests.reward_fns:needs_solution"}])
    with pytest.raises(RecipeError, match="needs column 'solution'"):
        check_reward_columns(mixed, [], "d")
    from tests.reward_fns import needs_solution  # given from Python, in place of the recipe's vader

    with pytest.raises(RecipeError, match="needs_solution needs column 'solution'"):
        check_reward_columns(RewardConfig(kind="vader"), ["answer"], "d", reward_fn=needs_solution)
    with pytest.raises(RecipeError, match="^reward.kind: python: this run trained on a Python reward object "
                                          r"\(local\) given as PPOTrainer"):
        check_reward_columns(RewardConfig(kind="python", name="local"), [], "d")


def test_side_metrics_are_scored_beside_a_reward_given_from_python():
    """`reward.also_log` still scores with a Python reward function; only the function is optimised
    (its scores: two e's in each text)."""
    from lora_ppo.rewards import build_reward_sources

    cfg = RewardConfig(kind="exact_match", answer_column="answer", also_log=["textblob", "vader"])
    sources = build_reward_sources(cfg, ModelConfig(), reward_fn=count_letter_e)
    texts = ["a wonderful, great film", "a terrible, awful film"]
    said = sources.score(RewardBatch(["", ""], texts))
    assert said.total == [2.0, 2.0] and list(said.by_source) == ["count_letter_e"]
    textblob, vader = build_reward(RewardConfig(kind="textblob")), build_reward(RewardConfig(kind="vader"))
    assert said.side == {"textblob": textblob(["", ""], texts), "vader": vader(["", ""], texts)}


def test_math_answer_and_exact_match_rewards(tiny_tokenizer):
    rows = _rows(tiny_tokenizer)  # answers "0", "1", "2"
    math = build_reward(RewardConfig(kind="math_answer", answer_column="answer"))
    assert score_completions(math, RewardBatch.from_rows(rows, ["It is 0.", "#### 10", "2 or 3? 2"])) == [1, 0, 1]
    bonus = build_reward(RewardConfig(kind="math_answer", answer_column="answer", format_bonus=0.1))
    assert score_completions(bonus, RewardBatch.from_rows(rows, ["#### 0", "\\boxed{7}", "2"])) == [1.1, 0.1, 1.0]
    exact = build_reward(RewardConfig(kind="exact_match", answer_column="answer"))
    assert score_completions(exact, RewardBatch.from_rows(rows, [" 0 ", "1.0", "2"])) == [1.0, 0.0, 1.0]
    conversations = _rows(tiny_tokenizer, conversation=True)  # completions are one-message lists
    assert score_completions(exact, RewardBatch.from_rows(conversations, [" 0 ", "1.0", "2"])) == [1.0, 0.0, 1.0]
    assert score_completions(math, RewardBatch.from_rows(conversations, ["It is 0.", "#### 10", "2"])) == [1, 0, 1]


def test_a_batch_of_one_row_keeps_its_columns(tiny_tokenizer):
    batch = RewardBatch.from_rows(_rows(tiny_tokenizer, n=1), ["a"])
    assert batch.columns == {"answer": ["0"], "source": ["test"]}


def test_kind_none_scores_every_completion_zero():
    """`reward.kind: none`: an environment gives the rewards, the recipe's source adds nothing."""
    fn = build_reward(RewardConfig(kind="none"))
    assert score_completions(fn, RewardBatch(["a", "b", "c"], ["d", "e", "f"])) == [0.0, 0.0, 0.0]


def test_a_reward_adapter_scores_every_row_once_in_micro_batches():
    """The reward adapter reads the policy's own tokens, `batch_size` rows at a time; a batch of
    text alone (no tokens) is refused with the source named."""
    from lora_ppo.rewards import AdapterReward

    sizes = []

    def score_sequences(input_ids, attention_mask):  # tells ids from mask, and each row from the others
        sizes.append(input_ids.shape[0])
        return (input_ids * attention_mask).sum(dim=1).float() + 100 * attention_mask.sum(dim=1)

    ids = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]])
    mask = torch.tensor([[1, 1], [0, 1], [1, 1], [1, 0], [1, 1]])
    adapter = AdapterReward(score_sequences, batch_size=2)
    batch = RewardBatch(["p"] * 5, ["c"] * 5, model_input=(ids, mask))
    assert score_completions(adapter, batch) == [203.0, 104.0, 211.0, 107.0, 219.0]  # 1+2+200, 4+100, ...
    assert sizes == [2, 2, 1]
    with pytest.raises(RewardError, match="^reward function adapter raised RuntimeError: a reward adapter "
                                          "scores tokens, and this batch holds only text$"):
        score_completions(adapter, RewardBatch(["p"], ["c"]))


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


def test_weighted_sources_mix_and_each_is_named_in_its_errors(tiny_tokenizer):
    from lora_ppo.rewards import RewardError, build_reward_sources

    cfg = RewardConfig(sources=[
        {"kind": "function", "function": "tests.reward_fns:count_letter_e", "weight": 2.0},
        {"kind": "exact_match", "answer_column": "answer", "weight": -1.0, "name": "matches"},
    ])
    sources = build_reward_sources(cfg, ModelConfig())
    rows = _rows(tiny_tokenizer)  # answers "0", "1", "2"
    said = sources.score(RewardBatch.from_rows(rows, ["eee", "1", "e"]))
    assert said.by_source == {"count_letter_e": [3.0, 0.0, 1.0], "matches": [0.0, 1.0, 0.0]}
    assert said.total == [6.0, -1.0, 2.0]
    broken = build_reward_sources(RewardConfig(sources=[{"kind": "vader"}, {
        "kind": "function", "function": "tests.reward_fns:wrong_count", "name": "judge"}]), ModelConfig())
    with pytest.raises(RewardError, match="reward function judge returned 1 scores for 3 completions"):
        broken.score(RewardBatch.from_rows(rows, ["a", "b", "c"]))


@pytest.fixture(scope="module")
def templated_classifier_dir(tiny_classifier_dir, tmp_path_factory):
    """The tiny classifier, with a chat template of its own (as reward models have)."""
    import shutil

    from transformers import AutoTokenizer

    folder = Path(shutil.copytree(tiny_classifier_dir, tmp_path_factory.mktemp("templated") / "rm"))
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
    tok.save_pretrained(folder)
    return folder


def test_classifier_scores_the_conversation_in_its_own_template(templated_classifier_dir, tiny_tokenizer):
    """The classifier sees the dataset's prompt as the user turn and the completion as the
    assistant turn, in its own template: never the policy's chat markup."""
    fn = build_reward(RewardConfig(kind="classifier", model=str(templated_classifier_dir), quantization="none"))
    assert fn.text("the film", " good") == "[user] the film [assistant]  good "
    conversation = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "a film"}]
    assert fn.text(conversation, [{"role": "assistant", "content": "great"}]) == \
        "[system] be kind [user] a film [assistant] great "
    rows = _rows(tiny_tokenizer)  # their text is wrapped in the policy's <|im_start|> template
    seen = []
    original = fn.text
    fn.text = lambda prompt, completion: seen.append(prompt) or original(prompt, completion)
    score_completions(fn, RewardBatch.from_rows(rows, ["good", "bad", "film"]))
    assert seen == ["question 0", "question 1", "question 2"]


def test_classifier_truncation_keeps_the_scored_end(tiny_classifier_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    fn = build_reward(RewardConfig(kind="classifier", model=str(tiny_classifier_dir), quantization="none",
                                   max_length=4))
    long_text = "the film " * 10
    [score] = score_completions(fn, RewardBatch(["" ], [long_text + "good great"]))
    tok = AutoTokenizer.from_pretrained(tiny_classifier_dir)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_classifier_dir)
    ids = tok(long_text + "good great")["input_ids"][-4:]  # the end survives, the start goes
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0, 1].item()
    assert score == pytest.approx(expected, abs=1e-5)


def test_classifier_loads_in_4bit_like_the_policy(tiny_classifier_dir):
    import bitsandbytes as bnb

    fn = build_reward(RewardConfig(kind="classifier", model=str(tiny_classifier_dir)), ModelConfig(quantization="4bit"))
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in fn.model.modules())
    prompts, completions = ["the film", "a film"], [" good great", " bad"]
    scores = score_completions(fn, RewardBatch(prompts, completions))
    with torch.no_grad():  # the loaded 4-bit model's own forward on each text alone, label 1's logit
        expected = [fn.model(**fn.tokenizer(p + c, return_tensors="pt")).logits[0, 1].item()
                    for p, c in zip(prompts, completions)]
    assert scores == pytest.approx(expected, abs=1e-5)
    plain = build_reward(RewardConfig(kind="classifier", model=str(tiny_classifier_dir), quantization="none"),
                         ModelConfig(quantization="4bit"))
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in plain.model.modules())


def test_a_classifier_saved_in_4bit_scores_in_the_recipes_dtype(tiny_classifier_dir, tmp_path):
    """A classifier checkpoint saved quantized (bfloat16 compute) loaded for a float32 recipe scores as
    the same weights quantized at load in float32: the same 4-bit codes, every other weight cast."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    plain, saved = tmp_path / "plain", tmp_path / "saved-in-4bit"
    tokenizer = AutoTokenizer.from_pretrained(tiny_classifier_dir)
    for folder in (plain, saved):
        tokenizer.save_pretrained(folder)
    # bfloat16 values, so the weights saved in bfloat16 lose nothing against the plain ones
    AutoModelForSequenceClassification.from_pretrained(tiny_classifier_dir).to(torch.bfloat16).save_pretrained(plain)
    build_reward(RewardConfig(kind="classifier", model=str(plain), dtype="bfloat16"),
                 ModelConfig(quantization="4bit")).model.save_pretrained(saved)
    batch = RewardBatch(["the film", "a film"], [" good great", " bad"])
    scores = {}
    for folder in (plain, saved):
        fn = build_reward(RewardConfig(kind="classifier", model=str(folder), dtype="float32"),
                          ModelConfig(quantization="4bit"))
        assert all(p.dtype == torch.float32 for p in fn.model.parameters() if p.is_floating_point())
        scores[folder] = score_completions(fn, batch)
    assert scores[saved] == scores[plain]


CLASSIFIER_WORDS = ["[PAD]", "[UNK]", "good", "bad", "film", "a", "the", "great", "awful"]


def _save_classifier(folder: Path, model, first_token: Optional[str] = None) -> Path:
    """Save `model` with a word-level tokenizer over CLASSIFIER_WORDS ([PAD] is 0) beside it;
    `first_token`: a special token after them, which the tokenizer puts before every text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = CLASSIFIER_WORDS + ([first_token] if first_token else [])
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if first_token:
        tok.post_processor = processors.TemplateProcessing(single=f"{first_token} $A",
                                                           special_tokens=[(first_token, len(words) - 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


def test_a_classifier_saved_without_pad_token_id_scores_a_batch_as_each_text_alone(tmp_path):
    """Sequence classifiers find the last real token by `config.pad_token_id`: the tokenizer's
    pad token fills it in, so a padded batch scores each text as it scores alone."""
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        LlamaConfig,
        LlamaForSequenceClassification,
    )

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(CLASSIFIER_WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=2)
    folder = _save_classifier(tmp_path / "rm", LlamaForSequenceClassification(config))
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    assert model.config.pad_token_id is None  # the case under test: only the tokenizer knows its pad token
    fn = build_reward(RewardConfig(kind="classifier", model=str(folder), quantization="none", batch_size=3))
    texts = ["good", "the film was great", "a bad awful film a"]  # 1, 4 and 5 tokens ("was" is [UNK])
    scores = score_completions(fn, RewardBatch([""] * 3, texts))
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():  # each text alone: no padding, so no pad token is needed
        expected = [model(**tok(t, return_tensors="pt")).logits[0, 1].item() for t in texts]
    assert len({len(tok(t)["input_ids"]) for t in texts}) == 3
    assert scores == pytest.approx(expected, abs=1e-5)


def test_a_classifier_head_ending_in_a_bias_stays_unquantized_in_4bit(tmp_path):
    """transformers keeps unquantized only the module of the model's last weight; DeBERTa's last
    parameter is `classifier.bias`, so its head (pooler + classifier) must be named explicitly."""
    import bitsandbytes as bnb
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    torch.manual_seed(0)
    config = DebertaV2Config(vocab_size=len(CLASSIFIER_WORDS), hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=2, intermediate_size=64, num_labels=2, pad_token_id=0)
    folder = _save_classifier(tmp_path / "deberta", DebertaV2ForSequenceClassification(config))
    assert list(DebertaV2ForSequenceClassification(config).named_parameters())[-1][0] == "classifier.bias"
    saved = DebertaV2ForSequenceClassification.from_pretrained(folder)  # fp32, unquantized
    fn = build_reward(RewardConfig(kind="classifier", model=str(folder)), ModelConfig(quantization="4bit"))
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in fn.model.deberta.modules())  # the encoder is 4-bit
    for name in ("pooler.dense", "classifier"):
        head, original = fn.model.get_submodule(name), saved.get_submodule(name)
        assert type(head) is torch.nn.Linear, f"{name} is {type(head).__name__}"
        assert torch.equal(head.weight, original.weight) and torch.equal(head.bias, original.bias)
    texts = ["the film was great", "a bad awful film"]
    scores = score_completions(fn, RewardBatch([""] * 2, texts))
    with torch.no_grad():  # the 4-bit encoder's hidden states through the saved fp32 head
        enc = fn.tokenizer(texts, return_tensors="pt", padding=True)
        hidden = fn.model.deberta(**enc).last_hidden_state
        expected = saved.classifier(saved.pooler(hidden))[:, 1].tolist()
    assert scores == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("arch, expected_head", [
    ("llama", {"score"}),
    ("roberta", {"classifier"}),  # dense + out_proj, ending in out_proj.bias
    ("deberta-v2", {"pooler", "classifier"}),
])
def test_the_head_is_every_top_level_module_outside_the_base_model(arch, expected_head):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from lora_ppo.quantization import modules_kept_unquantized

    config = AutoConfig.for_model(arch, vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_labels=2)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    kept = set(modules_kept_unquantized(model))
    assert expected_head <= kept
    # Nothing of the base model beyond what transformers keeps by default (here: nothing).
    base = model.base_model_prefix
    assert not any(name == base or name.startswith(base + ".") for name in kept)


def test_a_model_that_is_its_own_base_keeps_no_head_and_quantizes_its_layers():
    """A bare decoder (no head around a base model) has no top-level module outside its base: its
    layers are what 4-bit quantizes."""
    from transformers import LlamaConfig, LlamaModel

    from lora_ppo.quantization import modules_kept_unquantized

    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    with torch.device("meta"):
        model = LlamaModel(config)
    assert "layers" not in modules_kept_unquantized(model)


def test_classifier_scores_the_label_asked_for_in_batches_of_its_size(tiny_classifier_dir):
    """`reward.label: 0` scores the first logit; `batch_size` 2 over three completions scores each
    as it scores alone; a label past the last logit is refused when the classifier loads."""
    fn = build_reward(RewardConfig(kind="classifier", model=str(tiny_classifier_dir), quantization="none",
                                   label=0, batch_size=2))
    prompts, completions = ["the film", "a film", "the"], [" good great", " bad", " awful film a good"]
    scores = score_completions(fn, RewardBatch(prompts, completions))
    expected = plain_forward_scores(tiny_classifier_dir, [p + c for p, c in zip(prompts, completions)], label=0)
    assert scores == pytest.approx(expected, abs=1e-5)
    with pytest.raises(RecipeError, match="^reward.label: 2 is out of range for a classifier with 2 labels$"):
        build_reward(RewardConfig(kind="classifier", model=str(tiny_classifier_dir), quantization="none", label=2))


def test_a_classifier_without_a_template_reads_the_special_tokens_its_tokenizer_adds(tmp_path):
    """Plain text gets what the classifier's tokenizer puts before any text (the [CLS] its head was
    trained to read); only a chat template, which writes its own, goes without."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(CLASSIFIER_WORDS) + 1, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, num_labels=2,
                         pad_token_id=0)
    folder = _save_classifier(tmp_path / "rm", LlamaForSequenceClassification(config), first_token="[CLS]")
    tok = AutoTokenizer.from_pretrained(folder)
    cls = tok.convert_tokens_to_ids("[CLS]")
    assert tok("the film")["input_ids"][0] == cls  # the case under test
    fn = build_reward(RewardConfig(kind="classifier", model=str(folder), quantization="none"))
    [score] = score_completions(fn, RewardBatch(["the film"], [" good"]))
    with torch.no_grad():
        expected = fn.model(**tok("the film good", return_tensors="pt")).logits[0, 1].item()
        without = fn.model(**tok("the film good", return_tensors="pt", add_special_tokens=False)).logits[0, 1].item()
    assert score == pytest.approx(expected, abs=1e-5) and score != pytest.approx(without, abs=1e-5)


def test_a_classifier_named_wrong_is_refused_before_the_policy_loads(tmp_path, tiny_classifier_dir):
    """`check_classifiers` reads the tokenizer, and the config (quantized: the head, found on the meta
    device, so a model that is no sequence classifier fails here, not after minutes of loading)."""
    import shutil

    from transformers import AutoTokenizer, ViTConfig

    from lora_ppo.rewards import check_classifiers

    def check(folder, quantization):
        check_classifiers(RewardConfig(kind="classifier", model=str(folder), quantization=quantization),
                          ModelConfig(quantization="4bit"))

    refused = "^reward.model: cannot load a sequence classifier from '{}': "
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_classifier_dir / name, weights_only / name)
    with pytest.raises(RecipeError, match=refused.format(weights_only)):
        check(weights_only, "none")
    tokenizer_only = tmp_path / "tokenizer-only"
    AutoTokenizer.from_pretrained(tiny_classifier_dir).save_pretrained(tokenizer_only)
    with pytest.raises(RecipeError, match=refused.format(tokenizer_only)):
        check(tokenizer_only, "none")
    image_model = tmp_path / "image-model"  # a config no sequence-classification class takes
    AutoTokenizer.from_pretrained(tiny_classifier_dir).save_pretrained(image_model)
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        image_model)
    check(image_model, "none")  # unquantized, the config alone is read: loading it says what is wrong
    with pytest.raises(RecipeError, match=refused.format(image_model)):
        check(image_model, None)  # the policy's 4-bit: the head is looked for
    check(tiny_classifier_dir, None)


def test_each_source_gets_the_policys_settings_and_the_adapter_its_scorer(tiny_classifier_dir):
    """A classifier source without settings of its own loads as the policy does (here unquantized,
    against the 4-bit default); an adapter source scores with the backbone's scorer."""
    import bitsandbytes as bnb

    from lora_ppo.rewards import build_reward_sources

    cfg = RewardConfig(sources=[{"kind": "classifier", "model": str(tiny_classifier_dir)},
                                {"kind": "adapter", "adapter": str(tiny_classifier_dir)}])
    ids, mask = torch.tensor([[4, 5], [6, 7]]), torch.ones(2, 2, dtype=torch.long)
    sources = build_reward_sources(cfg, ModelConfig(quantization="none"),
                                   adapter_scorer=lambda input_ids, attention_mask: input_ids[:, -1].float())
    classifier, adapter = (s.fn for s in sources.sources)
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in classifier.model.modules())
    assert score_completions(adapter, RewardBatch(["p", "q"], ["c", "d"], model_input=(ids, mask))) == [5.0, 7.0]


def test_the_user_code_clock_counts_the_outermost_call_of_the_main_thread_only():
    """A stop request gives up on a step stuck in user code: the clock says what runs and since
    when: the outermost call (a tool called inside a reward keeps the reward's start), never a
    call from another thread (a timed call's worker), and a tool's call counts by default."""
    import threading

    from lora_ppo.rewards import USER_CODE, run_within

    assert USER_CODE.since is None
    with USER_CODE.running("reward function judge"):
        started = USER_CODE.since
        with USER_CODE.running("tool search"):
            assert (USER_CODE.what, USER_CODE.since) == ("reward function judge", started)
        assert (USER_CODE.what, USER_CODE.since) == ("reward function judge", started)
    assert (USER_CODE.what, USER_CODE.since) == ("", None)

    seen = []
    worker = threading.Thread(target=lambda: seen.append(run_within(lambda: USER_CODE.since, None, "tool t")))
    worker.start()
    worker.join()
    assert seen == [None]
    assert run_within(lambda: USER_CODE.what, None, "tool search") == "tool search"
    assert run_within(lambda: USER_CODE.what, None, "a lexicon", user_code=False) == ""


def test_a_function_without_a_readable_signature_is_called_with_prompts_then_completions():
    """Some callables (C extensions) have no signature to read: called as fn(prompts, completions),
    and nothing is asked of the data's columns."""
    from lora_ppo.rewards import check_reward_columns

    class Compiled:
        __signature__ = "unreadable"  # inspect.signature raises TypeError, as for many C callables

        def __call__(self, prompts, completions):
            return [float(len(p)) for p in prompts]

    assert score_completions(Compiled(), RewardBatch(["a", "bbb"], ["cc", "d"])) == [1.0, 3.0]
    check_reward_columns(RewardConfig(kind="vader"), [], "d", reward_fn=Compiled())


def test_a_timed_reward_returns_its_scores_and_only_user_functions_count_as_user_code():
    """With reward.timeout_s a function that returns in time gives its scores; the clock counts a
    recipe's function, never the package's own sources (a lexicon, a classifier, an adapter)."""
    from lora_ppo.rewards import USER_CODE

    def users(prompts, completions):
        return [float(USER_CODE.what == "reward function users")] * len(completions)

    def packaged(prompts, completions):
        return [float(USER_CODE.since is None)] * len(completions)

    packaged.__module__ = "lora_ppo.rewards"
    batch = RewardBatch(["a", "b"], ["c", "d"])
    assert score_completions(users, batch, timeout_s=60.0) == [1.0, 1.0]
    assert score_completions(users, batch) == [1.0, 1.0]
    assert score_completions(packaged, batch) == [1.0, 1.0]


def test_a_timed_reward_is_waited_for():
    """The function returns only once the caller waits on it (seen in the main thread's stack),
    so what is tested is the wait, not how fast either thread runs."""
    import threading

    main, done = threading.main_thread().ident, threading.Event()
    caller_waits = threading.Event()

    def watch() -> None:
        while not done.is_set():
            frame = sys._current_frames().get(main)
            while frame is not None:
                if frame.f_code.co_name == "join" and frame.f_code.co_filename == threading.__file__:
                    caller_waits.set()
                    return
                frame = frame.f_back
            done.wait(0.001)

    def returns_once_waited_for(prompts, completions):
        caller_waits.wait()
        return [1.0] * len(completions)

    threading.Thread(target=watch, daemon=True).start()
    try:
        assert score_completions(returns_once_waited_for, RewardBatch(["a"], ["b"]), timeout_s=600.0) == [1.0]
    finally:
        done.set()
        caller_waits.set()
