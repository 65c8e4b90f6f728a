"""SFT rows: each of TRL's formats becomes the tokens the model reads and the tokens the loss
predicts; assistant tokens come from the chat template (its `{% generation %}` markers, or what each
turn adds), checked on two templates with multi-turn conversations; bad and long rows are counted,
truncated or refused as the recipe says."""

from __future__ import annotations

import copy
import random

import pytest

from lora_ppo.config import SFTConfig, SFTDataConfig
from lora_ppo.errors import RecipeError
from lora_ppo.builtin_datasets import arithmetic_sft
from lora_ppo.sft.rows import RowTokenizer, detect_format, limit_length, load_sft_sets, prepare_sft_rows
from tests.sft_helpers import demonstration_rows, write_jsonl

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
    return altered(tiny_tokenizer, **({"chat_template": MARKED_TEMPLATE} if request.param == "marked" else {}))


def altered(tokenizer, **attributes):
    """A copy of `tokenizer` with these attributes set (another chat template, no stop token)."""
    changed = copy.deepcopy(tokenizer)
    for name, value in attributes.items():
        setattr(changed, name, value)
    return changed


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
    no_eos = altered(tiny_tokenizer, eos_token=None)
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
    # What the report samples from and shows stays the row's.
    assert (cut.prompt, cut.prompt_ids, cut.completion) == (row.prompt, row.prompt_ids, row.completion)
    assert limit_length(row, 8, "drop", "row 3") == (None, "too_long")
    assert limit_length(row, len(row.ids), "error", "row 3") == (row, None)
    with pytest.raises(RecipeError, match=rf"^data.max_length: row 3 has {len(row.ids)} tokens, more than 8"):
        limit_length(row, 8, "error", "row 3")
    prompt_only = limit_length(row, len(row.prompt_ids), "truncate", "row 3")
    assert prompt_only == (None, "too_long")  # nothing left to learn
    # Trained on every token, a row cut to its prompt keeps its targets, but no prompt to sample
    # from: an answer would have no room within data.max_length.
    every = tokenize(tiny_tokenizer, {"prompt": "The film was", "completion": " great and wonderful" * 4},
                     completion_only=False)
    cut, note = limit_length(every, len(every.prompt_ids), "truncate", "row 3")
    assert note == "truncated" and cut.ids == every.prompt_ids and cut.prompt_ids == ()
    cut, _ = limit_length(every, len(every.prompt_ids) + 1, "truncate", "row 3")
    assert cut.prompt_ids == every.prompt_ids


def test_formats_are_found_by_their_columns_and_a_missing_column_is_named():
    cfg = SFTDataConfig()
    assert detect_format(cfg, ["messages", "prompt"], "d") == "messages"
    assert detect_format(cfg, ["prompt", "completion", "text"], "d") == "prompt_completion"
    assert detect_format(cfg, ["text", "id"], "d") == "text"
    with pytest.raises(RecipeError, match=r"^data.format: auto finds neither .* \(columns: prompt, answer\)"):
        detect_format(cfg, ["prompt", "answer"], "d")
    with pytest.raises(RecipeError, match=r"^data: column 'completion' not in 'd' \(columns: prompt\)"):
        detect_format(SFTDataConfig(format="prompt_completion"), ["prompt"], "d")


@pytest.fixture
def bos_tokenizer(tiny_tokenizer):
    """The tiny tokenizer adding a BOS as Llama's does, with a template that writes it too (Llama 3's
    way): tokenizing a rendered conversation with special tokens would give two."""
    from tokenizers import processors

    tokenizer = altered(tiny_tokenizer, chat_template="{{ bos_token }}" + tiny_tokenizer.chat_template)
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_token_id)])
    assert tokenizer("film")["input_ids"][0] == tokenizer.bos_token_id  # the fixture does what it says
    return tokenizer


def test_a_tokenizer_that_adds_a_bos_gives_each_row_one_at_its_start(bos_tokenizer):
    bos, eos = bos_tokenizer.bos_token_id, bos_tokenizer.eos_token_id
    # A text row as the model read such text in pretraining: the BOS, the text, the stop token.
    text = tokenize(bos_tokenizer, {"text": "The film is a masterpiece."})
    assert text.ids == tuple(bos_tokenizer("The film is a masterpiece.")["input_ids"]) + (eos,)
    assert text.ids.count(bos) == 1 and text.ids[0] == bos
    # A text pair: the prompt as a PPO run renders it (with its BOS), the completion without one.
    pair = tokenize(bos_tokenizer, {"prompt": "The film was", "completion": " great"})
    answer = bos_tokenizer(" great", add_special_tokens=False)["input_ids"] + [eos]
    assert pair.ids == tuple(bos_tokenizer("The film was")["input_ids"] + answer) and pair.ids.count(bos) == 1
    # A conversation: the template writes the BOS; tokenizing its text must not add another.
    chat = tokenize(bos_tokenizer, {"messages": CONVERSATION})
    assert chat.ids == template_ids(bos_tokenizer, CONVERSATION) and chat.ids.count(bos) == 1
    assert chat.prompt_ids == template_ids(bos_tokenizer, CONVERSATION[:4], add_generation_prompt=True)


def test_a_text_that_ends_with_the_stop_token_keeps_one(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    row = tokenize(tiny_tokenizer, {"text": "The film is a masterpiece." + tiny_tokenizer.eos_token})
    assert row.ids == tuple(tiny_tokenizer("The film is a masterpiece.")["input_ids"]) + (eos,)


def test_a_conversational_completion_is_trained_from_where_the_prompt_ends(template_tokenizer):
    """As TRL's prompt-completion rows: nothing of the prompt rendered with its generation prompt is
    trained, even an assistant turn closing the prompt, or an assistant header the template marks."""
    row = tokenize(template_tokenizer, {"prompt": CONVERSATION[:3], "completion": [CONVERSATION[4]]})
    assert trained_text(template_tokenizer, row) == "Lovely music.<|im_end|>"
    header_marked = altered(template_tokenizer, chat_template=MARKED_TEMPLATE.replace(
        "<|im_start|>bot: {% generation %}", "{% generation %}<|im_start|>bot: "))
    row = tokenize(header_marked, {"prompt": CONVERSATION[:4], "completion": [CONVERSATION[4]]})
    assert trained_text(header_marked, row) == "Lovely music.<|im_end|>"


def test_assistant_turns_are_found_without_a_stop_token_in_the_template(tiny_tokenizer):
    """A template that ends turns with a blank line, not the tokenizer's stop token (a base model's
    own format), and a tokenizer without a stop token at all: each assistant turn is what it adds,
    never the user turn after it."""
    plain = altered(tiny_tokenizer, chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n"
                                                  "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    for tokenizer in (plain, altered(tiny_tokenizer, eos_token=None)):
        trained = trained_text(tokenizer, tokenize(tokenizer, {"messages": CONVERSATION}))
        assert "Wonderful acting." in trained and "Lovely music." in trained, trained
        assert not any(m["content"] in trained for m in CONVERSATION if m["role"] != "assistant"), trained


def test_long_answers_are_trained_whole_and_alone(template_tokenizer):
    """Answers longer than the turn headers: the stop token that ends each is searched after the
    answer, not in the turn before it."""
    long = [dict(m) for m in CONVERSATION]
    long[2]["content"] = "Wonderful acting, a script that never drags, and a lead who carries every single scene."
    long[4]["content"] = "Lovely music: a score I will remember long after the credits, and songs that fit."
    row = tokenize(template_tokenizer, {"messages": long})
    assert trained_text(template_tokenizer, row) == f"{long[2]['content']}<|im_end|>{long[4]['content']}<|im_end|>"


@pytest.mark.parametrize("template, message", [
    # The earlier answer replaced once a later turn follows (as templates that drop reasoning do).
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}\\n{% if m['role'] == 'assistant' and not loop.last %}"
     "[earlier]{% else %}{{ m['content'] }}{% endif %}<|im_end|>\\n{% endfor %}"
     "{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}", "renders earlier turns differently"),
    # Assistant turns left out altogether.
    ("{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\\n{{ m['content'] }}"
     "<|im_end|>\\n{% endif %}{% endfor %}", "writes nothing for an assistant turn"),
])
def test_a_template_whose_assistant_turns_cannot_be_found_is_refused(tiny_tokenizer, template, message):
    with pytest.raises(RecipeError, match=f"^data: the chat template {message}"):
        prepare_sft_rows([{"messages": CONVERSATION}], ["messages"], SFTDataConfig(max_length=256), SFTConfig(),
                         altered(tiny_tokenizer, chat_template=template), "d")


def test_held_out_demonstrations_come_from_their_own_source_split_and_config(tiny_tokenizer):
    """builtin:arithmetic_sft's small `addsub1` config: training reads its train split, the held-out
    set the first data.eval_size rows of its test split, both in the config data.name gives."""
    cfg = SFTDataConfig(source="builtin:arithmetic_sft", name="addsub1", eval_source="builtin:arithmetic_sft",
                        eval_split="test", eval_size=5, max_length=256)
    train, held_out = load_sft_sets(cfg, SFTConfig(), tiny_tokenizer, seed=0)

    def answers(rows):
        return [row["messages"][-1]["content"] for row in rows]

    assert [row.completion for row in train.rows] == answers(arithmetic_sft("addsub1", "train"))
    assert [row.completion for row in held_out.rows] == answers(arithmetic_sft("addsub1", "test")[:5])
    assert train.dropped == {} and held_out.dropped == {}


def test_without_a_held_out_source_the_seed_draws_the_held_out_rows(tmp_path, tiny_tokenizer):
    rows = demonstration_rows(20)
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    prompts = [row["prompt"] for row in rows]
    for seed in (0, 1):
        train, held_out = load_sft_sets(SFTDataConfig(source=str(data), eval_size=3, max_length=64), SFTConfig(),
                                        tiny_tokenizer, seed)
        order = list(range(20))
        random.Random(seed).shuffle(order)  # the held-out rows by hand: the first 3 of the seeded order
        held = sorted(order[:3])
        assert [row.prompt for row in held_out.rows] == [prompts[i] for i in held]
        assert [row.prompt for row in train.rows] == [p for i, p in enumerate(prompts) if i not in held]
    # At most a fifth of the rows are held out, whatever data.eval_size asks.
    _, held_out = load_sft_sets(SFTDataConfig(source=str(data), eval_size=10, max_length=64), SFTConfig(),
                                tiny_tokenizer, 0)
    assert len(held_out.rows) == 4


def test_a_source_without_usable_rows_says_why(tmp_path, tiny_tokenizer):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "  "}, {"prompt": "b", "completion": " "},
                                              {"prompt": 3, "completion": "c"}])
    with pytest.raises(RecipeError, match=r"^data.source: no usable rows in '.*d.jsonl' \(2 empty, 1 not_text\)$"):
        load_sft_sets(SFTDataConfig(source=str(data), eval_size=0, max_length=64), SFTConfig(), tiny_tokenizer, 0)


def test_a_held_out_source_that_cannot_be_read_is_named_as_such(tmp_path, tiny_tokenizer):
    data = write_jsonl(tmp_path / "d.jsonl", demonstration_rows(4))
    cfg = SFTDataConfig(source=str(data), eval_source=str(tmp_path / "missing.jsonl"), max_length=64)
    with pytest.raises(RecipeError, match=r"^data.eval_source: "):
        load_sft_sets(cfg, SFTConfig(), tiny_tokenizer, 0)
