"""SFT rows: each of TRL's formats becomes the tokens the model reads and the tokens the loss
predicts; assistant tokens come from the chat template (its `{% generation %}` markers, or what each
turn adds), checked on two templates with multi-turn conversations; bad and long rows are counted,
truncated or refused as the recipe says."""

from __future__ import annotations

import copy

import pytest

from lora_ppo.config import SFTConfig, SFTDataConfig
from lora_ppo.errors import RecipeError
from lora_ppo.sft.rows import RowTokenizer, detect_format, limit_length, prepare_sft_rows

# The tiny tokenizer's ChatML template has no markers: assistant tokens are what each turn adds.
# This one writes turns its own way and marks the assistant's with {% generation %}.
MARKED_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>bot: {% generation %}"
    "{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>bot: {% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "The film was great?"},
    {"role": "assistant", "content": "Wonderful acting."},
    {"role": "user", "content": "And the music?"},
    {"role": "assistant", "content": "Lovely music."},
]


@pytest.fixture(params=["chatml", "marked"])
def template_tokenizer(request, tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    if request.param == "marked":
        tokenizer.chat_template = MARKED_TEMPLATE
    return tokenizer


def template_ids(tokenizer, messages, **options) -> tuple[int, ...]:
    return tuple(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **options)["input_ids"])


def trained_text(tokenizer, row) -> str:
    return tokenizer.decode([t for t, target in zip(row.ids, row.targets) if target])


def untrained_text(tokenizer, row) -> str:
    return tokenizer.decode([t for t, target in zip(row.ids, row.targets) if not target])


def runs(flags) -> int:
    """How many separate stretches of True there are."""
    return sum(1 for i, flag in enumerate(flags) if flag and (i == 0 or not flags[i - 1]))


def tokenize(tokenizer, row: dict, completion_only: bool = True, **data):
    cfg = SFTDataConfig(**data)
    return RowTokenizer(tokenizer, cfg, SFTConfig(completion_only=completion_only),
                        detect_format(cfg, list(row), "d")).row(row)


def test_multi_turn_assistant_tokens_are_the_assistant_turns_and_their_stop_token(template_tokenizer):
    row = tokenize(template_tokenizer, {"messages": CONVERSATION})
    assert row.ids == template_ids(template_tokenizer, CONVERSATION)
    assert trained_text(template_tokenizer, row) == "Wonderful acting.<|im_end|>Lovely music.<|im_end|>"
    assert runs(row.targets) == 2
    rest = untrained_text(template_tokenizer, row)
    assert all(m["content"] in rest for m in CONVERSATION if m["role"] != "assistant")
    # A sample continues the conversation before the last answer, as a PPO prompt is rendered.
    assert row.prompt_ids == template_ids(template_tokenizer, CONVERSATION[:4], add_generation_prompt=True)
    assert row.ids[: len(row.prompt_ids)] == row.prompt_ids and row.completion == "Lovely music."
    assert row.prompt == CONVERSATION[:4]  # what the report shows before the sample


def test_without_completion_only_every_token_but_the_first_is_a_target(template_tokenizer):
    row = tokenize(template_tokenizer, {"messages": CONVERSATION}, completion_only=False)
    assert row.targets == (False,) + (True,) * (len(row.ids) - 1)


def test_a_conversational_prompt_trains_only_its_completion(template_tokenizer):
    row = tokenize(template_tokenizer, {"prompt": CONVERSATION[:4], "completion": [CONVERSATION[4]]})
    assert trained_text(template_tokenizer, row) == "Lovely music.<|im_end|>"  # not the prompt's own answer
    assert row.prompt == CONVERSATION[:4]


def test_a_text_pair_is_the_prompt_as_ppo_renders_it_then_the_completion_and_stop(tiny_tokenizer):
    row = tokenize(tiny_tokenizer, {"prompt": "The film was", "completion": " great"})
    prompt = tiny_tokenizer("The film was")["input_ids"]
    answer = tiny_tokenizer(" great", add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
    assert row.ids == tuple(prompt + answer) and row.prompt_ids == tuple(prompt)
    assert row.targets == (False,) * len(prompt) + (True,) * len(answer)
    full = tokenize(tiny_tokenizer, {"prompt": "The film was", "completion": " great"}, completion_only=False)
    assert full.targets == (False,) + (True,) * (len(prompt) + len(answer) - 1)


def test_a_text_pair_with_the_chat_template_is_a_user_and_an_assistant_turn(tiny_tokenizer):
    row = tokenize(tiny_tokenizer, {"prompt": "Rate it", "completion": "Great film."}, chat_template=True,
                   system_prompt="Be brief.")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Rate it"},
                {"role": "assistant", "content": "Great film."}]
    assert row.ids == template_ids(tiny_tokenizer, messages)
    assert trained_text(tiny_tokenizer, row) == "Great film.<|im_end|>"


def test_a_text_row_is_trained_whole_and_ends_with_the_stop_token(tiny_tokenizer):
    row = tokenize(tiny_tokenizer, {"text": "The film is a masterpiece."})
    assert row.ids == tuple(tiny_tokenizer("The film is a masterpiece.")["input_ids"] + [tiny_tokenizer.eos_token_id])
    assert row.targets == (False,) + (True,) * (len(row.ids) - 1) and row.prompt_ids == ()


def test_bad_rows_are_dropped_and_counted(tiny_tokenizer):
    rows = [
        {"prompt": "Fine", "completion": " good"},
        {"prompt": "Empty answer", "completion": "  "},
        {"prompt": None, "completion": " good"},
        {"prompt": "x", "completion": [{"role": "assistant"}]},
        {"prompt": [{"role": "narrator", "content": "x"}], "completion": "y"},
        {"prompt": "Long", "completion": " good" * 80},
    ]
    cfg = SFTDataConfig(max_length=32)
    out = prepare_sft_rows(rows, ["prompt", "completion"], cfg, SFTConfig(), tiny_tokenizer, "d")
    assert len(out.rows) == 1
    assert out.dropped == {"empty": 1, "not_text": 1, "message_without_role_or_content": 1, "unknown_role": 1,
                           "too_long": 1}
    no_answer = prepare_sft_rows([{"messages": CONVERSATION[:2]}], ["messages"], cfg, SFTConfig(), tiny_tokenizer, "d")
    assert no_answer.rows == [] and no_answer.dropped == {"no_target_token": 1}


def test_every_kept_row_has_a_target_after_its_first_token(tiny_tokenizer):
    """The loss reads targets from position 1 on (nothing precedes token 0): a row whose only
    target would be its first token has nothing to train and is dropped, never a 0-token step."""
    cfg = SFTDataConfig(max_length=32)
    # A tokenizer without an end-of-sequence token: a one-token text is its first token alone.
    no_eos = copy.deepcopy(tiny_tokenizer)
    no_eos.eos_token = None
    one_token = tiny_tokenizer.convert_ids_to_tokens(tiny_tokenizer("a")["input_ids"])[0]
    texts = prepare_sft_rows([{"text": one_token}, {"text": "The film."}], ["text"], cfg, SFTConfig(), no_eos, "d")
    assert [row.ids[0] for row in texts.rows] == [no_eos("The film.")["input_ids"][0]]
    assert texts.dropped == {"no_target_token": 1}
    # A conversation that opens with its answer has no prompt before it: dropped, named.
    first = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi."}]
    for completion_only in (True, False):
        opened = prepare_sft_rows([{"messages": first}, {"messages": CONVERSATION}], ["messages"],
                                  SFTDataConfig(max_length=256),
                                  SFTConfig(completion_only=completion_only), tiny_tokenizer, "d")
        assert len(opened.rows) == 1 and opened.dropped == {"assistant_turn_first": 1}
        assert all(row.targets[0] is False and any(row.targets) for row in opened.rows)


def test_long_rows_are_truncated_or_refused_as_the_recipe_says(tiny_tokenizer):
    row = tokenize(tiny_tokenizer, {"prompt": "The film was", "completion": " great and wonderful" * 4})
    cut, note = limit_length(row, 8, "truncate", "row 3")
    assert note == "truncated" and cut.ids == row.ids[:8] and cut.targets == row.targets[:8]
    assert limit_length(row, 8, "drop", "row 3") == (None, "too_long")
    assert limit_length(row, len(row.ids), "error", "row 3") == (row, None)
    with pytest.raises(RecipeError, match=rf"^data.max_length: row 3 has {len(row.ids)} tokens, more than 8"):
        limit_length(row, 8, "error", "row 3")
    prompt_only = limit_length(row, len(row.prompt_ids), "truncate", "row 3")
    assert prompt_only == (None, "too_long")  # nothing left to learn


def test_formats_are_found_by_their_columns_and_a_missing_column_is_named():
    cfg = SFTDataConfig()
    assert detect_format(cfg, ["messages", "prompt"], "d") == "messages"
    assert detect_format(cfg, ["prompt", "completion", "text"], "d") == "prompt_completion"
    assert detect_format(cfg, ["text", "id"], "d") == "text"
    with pytest.raises(RecipeError, match=r"^data.format: auto finds neither .* \(columns: prompt, answer\)"):
        detect_format(cfg, ["prompt", "answer"], "d")
    with pytest.raises(RecipeError, match=r"^data: column 'completion' not in 'd' \(columns: prompt\)"):
        detect_format(SFTDataConfig(format="prompt_completion"), ["prompt"], "d")
