"""Prompt data: every file type with text and conversational prompts, folders and globs, a
dataset with config names, split slicing, chat templates and system prompts, rows dropped and
counted per reason, held-out splits, and a seeded prompt order that can be resumed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import lora_ppo
from lora_ppo.cli import app
from lora_ppo.config import DataConfig
from lora_ppo.data import PromptFormat, PromptStream, load_prompt_sets, load_rows, prepare_rows, split_off
from lora_ppo.errors import RecipeError
from lora_ppo.state import PromptPosition
from tests.conftest import bos_first, tiny_recipe_dict, write_recipe

TEXTS = ["This movie was", "The acting in this film", "Honestly, the sequel"]
CONVERSATIONS = [
    [{"role": "user", "content": "Review this film."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Rate the sequel."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "A film?"}],
]


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


def _write(path: Path, rows: list[dict]) -> Path:
    import pandas as pd

    frame = pd.DataFrame(rows)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        frame.to_csv(path, index=False)
    elif path.suffix == ".parquet":
        frame.to_parquet(path)
    else:
        path.write_text("\n".join(row["prompt"] for row in rows) + "\n")
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet", ".txt"])
def test_text_prompts_load_from_every_file_type(tmp_path, suffix):
    rows = [{"prompt": text, "answer": str(i)} for i, text in enumerate(TEXTS)]
    loaded, columns = load_rows(str(_write(tmp_path / f"p{suffix}", rows)), "train")
    assert [row["prompt"] for row in loaded] == TEXTS
    if suffix != ".txt":  # one prompt a line: no other column
        assert columns == ["prompt", "answer"] and [str(row["answer"]) for row in loaded] == ["0", "1", "2"]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_conversational_prompts_load_and_go_through_the_chat_template(tmp_path, tokenizer, suffix):
    rows = [{"prompt": messages, "id": i} for i, messages in enumerate(CONVERSATIONS)]
    loaded, _ = load_rows(str(_write(tmp_path / f"p{suffix}", rows)), "train")
    prompts = prepare_rows(loaded, "prompt", PromptFormat(tokenizer, chat_template=False), 256, "p")
    assert [row.prompt for row in prompts.rows] == CONVERSATIONS  # as the dataset gives them
    assert prompts.rows[0].text == "<|im_start|>user\nReview this film.<|im_end|>\n<|im_start|>assistant\n"
    assert prompts.rows[2].text.count("<|im_start|>") == 4 and prompts.rows[2].columns == {"id": 2}
    assert list(prompts.rows[1].ids) == tokenizer(prompts.rows[1].text, add_special_tokens=False)["input_ids"]


def test_a_folder_or_glob_of_files_is_one_dataset(tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    _write(folder / "a.jsonl", [{"prompt": TEXTS[0]}])
    _write(folder / "b.jsonl", [{"prompt": TEXTS[1]}, {"prompt": TEXTS[2]}])
    assert [r["prompt"] for r in load_rows(str(folder), "train")[0]] == TEXTS
    assert [r["prompt"] for r in load_rows(str(folder / "b*.jsonl"), "train")[0]] == TEXTS[1:]
    with pytest.raises(RecipeError, match="no file matches"):
        load_rows(str(folder / "c*.jsonl"), "train")
    _write(folder / "c.csv", [{"prompt": "x"}])
    with pytest.raises(RecipeError, match="files of different types"):
        load_rows(str(folder), "train")


@pytest.fixture()
def dataset_with_configs(tmp_path) -> Path:
    """A local dataset folder with two configs and train/test splits, as hub datasets have
    (openai/gsm8k: config `main`, columns `question` and `answer`)."""
    root = tmp_path / "gsm8k-like"
    for config, offset in (("main", 0), ("socratic", 100)):
        for split, start, count in (("train", 0, 6), ("test", 50, 2)):
            (root / config).mkdir(parents=True, exist_ok=True)
            _write(root / config / f"{split}.jsonl", [
                {"question": f"What is {n} + 1?", "answer": f"{n} + 1 = {n + 1}\n#### {n + 1}"}
                for n in range(offset + start, offset + start + count)
            ])
    (root / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n"
        "  - split: test\n    path: main/test.jsonl\n"
        "- config_name: socratic\n  data_files:\n  - split: train\n    path: socratic/train.jsonl\n"
        "  - split: test\n    path: socratic/test.jsonl\n---\n"
    )
    return root


def test_a_dataset_config_name_and_split_slices(dataset_with_configs):
    rows, columns = load_rows(str(dataset_with_configs), "train", name="main")
    assert len(rows) == 6 and columns == ["question", "answer"] and rows[0]["question"] == "What is 0 + 1?"
    socratic, _ = load_rows(str(dataset_with_configs), "test[:1]", name="socratic")
    assert [r["question"] for r in socratic] == ["What is 150 + 1?"]
    with pytest.raises(RecipeError, match=r"data.source: cannot load .* \(data.name 'mian'\)"):
        load_rows(str(dataset_with_configs), "train", name="mian")


def test_recipe_with_config_name_reads_train_and_held_out_splits(dataset_with_configs, tokenizer):
    cfg = DataConfig(source=str(dataset_with_configs), name="main", prompt_column="question",
                     eval_source=str(dataset_with_configs), eval_split="test", eval_size=8)
    train, held_out = load_prompt_sets(cfg, tokenizer, seed=0)
    assert len(train.rows) == 6 and len(held_out.rows) == 2
    assert held_out.rows[0].prompt == "What is 50 + 1?" and held_out.rows[0].columns["answer"].endswith("#### 51")
    assert train.columns == ["answer"]


def test_builtin_splits_slice_like_hub_splits(tokenizer):
    rows, columns = load_rows("builtin:arithmetic", "train[:10]", name="add2")
    assert len(rows) == 10 and columns == ["prompt", "answer"]
    head, _ = load_rows("builtin:arithmetic", "train[:3]", name="add2")
    assert head == rows[:3]
    with pytest.raises(RecipeError, match="data.split: builtin:arithmetic has no split 'validation'"):
        load_rows("builtin:arithmetic", "validation", name="add2")
    with pytest.raises(RecipeError, match="data.name: builtin:movie_review_openers has no configs"):
        load_rows("builtin:movie_review_openers", "train", name="main")


def test_missing_column_names_the_columns(tmp_path, tokenizer):
    rows, _ = load_rows(str(_write(tmp_path / "p.jsonl", [{"text": "hi"}])), "train")
    with pytest.raises(RecipeError, match=r"data.prompt_column: column 'prompt' not in .* \(columns: text\)"):
        prepare_rows(rows, "prompt", PromptFormat(tokenizer, False), 64, "p.jsonl")


def test_unsupported_and_missing_files(tmp_path):
    with pytest.raises(RecipeError, match="file not found"):
        load_rows(str(tmp_path / "none.jsonl"), "train")
    (tmp_path / "p.xml").write_text("<a/>")
    with pytest.raises(RecipeError, match="p.xml: unsupported file type '.xml'"):
        load_rows(str(tmp_path / "p.xml"), "train")


def test_a_folder_holding_a_file_of_another_type_names_that_file(tmp_path):
    """`--prompts RUN_FOLDER` (or a data folder with a notes file) said only "unsupported file type
    '.yaml'", of a file the user never named."""
    _write(tmp_path / "a.jsonl", [{"prompt": "hi"}])
    (tmp_path / "recipe.yaml").write_text("model: {}\n")
    with pytest.raises(RecipeError) as err:
        load_rows(str(tmp_path), "train", field_name="--prompts")
    assert str(err.value) == (f"--prompts: {tmp_path / 'recipe.yaml'}: unsupported file type '.yaml' "
                              "(use .jsonl, .json, .csv, .parquet, .txt)")


def test_bad_rows_are_dropped_and_counted_per_reason(tokenizer):
    raw = [
        "fine prompt", "", "   ", None, 7, {"role": "user"}, "word " * 100,
        [{"role": "user", "content": "fine conversation"}],
        [],  # an empty conversation
        [{"role": "user"}],  # no content
        [{"content": "who am I"}],  # no role
        ["just text in a list"],
        [{"role": "narrator", "content": "once upon a time"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],  # nothing to answer
    ]
    prompts = prepare_rows([{"prompt": value} for value in raw], "prompt", PromptFormat(tokenizer, False), 48, "p")
    assert [row.prompt for row in prompts.rows] == ["fine prompt", [{"role": "user", "content": "fine conversation"}]]
    assert prompts.dropped == {"empty": 3, "not_text": 3, "too_long": 1, "message_without_role_or_content": 3,
                               "unknown_role": 1, "assistant_turn_last": 1}


def test_chat_template_and_system_prompt_wrap_text_prompts(tokenizer):
    plain = PromptFormat(tokenizer, chat_template=True).render("hello")[0]
    assert plain == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    with_system = PromptFormat(tokenizer, chat_template=True, system_prompt="Be kind.").render("hello")[0]
    assert with_system == "<|im_start|>system\nBe kind.<|im_end|>\n" + plain
    # A conversation with its own system message keeps it.
    own = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hello"}]
    assert "Be kind." not in PromptFormat(tokenizer, True, "Be kind.").render(own)[0]
    with pytest.raises(RecipeError, match="data.system_prompt: text prompts take a system prompt only with"):
        PromptFormat(tokenizer, chat_template=False, system_prompt="Be kind.").render("hello")


def test_too_long_for_the_template_says_what_the_template_costs(tokenizer, tmp_path):
    source = _write(tmp_path / "p.jsonl", [{"prompt": text} for text in TEXTS])
    cfg = DataConfig(source=str(source), eval_source=None, chat_template=True, system_prompt="You are a film critic.",
                     max_prompt_tokens=8)
    # the template around an empty user turn, written out
    empty_turn = ("<|im_start|>system\nYou are a film critic.<|im_end|>\n<|im_start|>user\n<|im_end|>\n"
                  "<|im_start|>assistant\n")
    overhead = len(tokenizer(empty_turn, add_special_tokens=False)["input_ids"])
    assert overhead > 8
    with pytest.raises(RecipeError) as err:
        load_prompt_sets(cfg, tokenizer, seed=0)
    assert str(err.value) == (f"data.source: no usable prompts in {str(source)!r} (3 too_long; data.max_prompt_tokens "
                              f"is 8 and the chat template alone adds {overhead} tokens)")


def test_a_plain_text_prompt_gets_the_tokenizers_bos_and_a_templated_one_only_what_the_template_writes(tokenizer):
    """For a tokenizer that puts BOS first (as Llama's do): text read as is gets it, as the model saw
    text in pretraining; a templated prompt gets none beyond what its template writes."""
    bos_tokenizer = bos_first(tokenizer)
    hello = tokenizer("hello", add_special_tokens=False)["input_ids"]
    assert PromptFormat(bos_tokenizer, False).render("hello")[1] == (bos_tokenizer.bos_token_id, *hello)
    templated = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    written = tokenizer(templated, add_special_tokens=False)["input_ids"]
    assert PromptFormat(bos_tokenizer, True).render("hello")[1] == tuple(written)


def test_a_prompt_of_exactly_max_prompt_tokens_is_kept_and_one_token_more_is_dropped(tokenizer):
    words = ["good"] * 12
    lengths = [len(tokenizer(" ".join(words[:n]))["input_ids"]) for n in range(1, 13)]
    limit = lengths[5]
    assert lengths[6] > limit  # one more word, at least one more token
    prompts = prepare_rows([{"prompt": " ".join(words[:6])}, {"prompt": " ".join(words[:7])}], "prompt",
                           PromptFormat(tokenizer, False), limit, "p")
    assert [len(row.ids) for row in prompts.rows] == [limit] and prompts.dropped == {"too_long": 1}


def test_rows_keep_the_conversation_they_were_rendered_from(tokenizer):
    """PromptRow.messages, what an episode starts from: the system prompt first, unless the
    conversation has one; None for text read without a template."""
    fmt = PromptFormat(tokenizer, True, "Be kind.")
    assert fmt.row("hello").messages == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hello"}]
    assert fmt.row(CONVERSATIONS[1]).messages == CONVERSATIONS[1]
    assert PromptFormat(tokenizer, False).row("hello").messages is None
    row = prepare_rows([{"prompt": CONVERSATIONS[0], "label": 1}], "prompt", fmt, 64, "p").rows[0]
    assert (row.messages, row.columns) == ([{"role": "system", "content": "Be kind."}, *CONVERSATIONS[0]], {"label": 1})


def test_the_held_out_split_is_a_seeded_draw_with_both_parts_in_their_order():
    """Not the first or last rows: seeds draw different held-out sets, each list keeps the
    original order, together they are every row; at most max_share of them, never all."""
    items = list(range(100))
    draws = {}
    for seed in range(4):
        kept, held = split_off(items, 10, seed)
        assert len(held) == 10 and sorted(kept + held) == items
        assert kept == sorted(kept) and held == sorted(held)
        assert held not in (items[:10], items[-10:])
        draws[seed] = tuple(held)
    assert len(set(draws.values())) == 4
    assert split_off(items, 10, 2) == split_off(items, 10, 2)
    held_counts = [len(split_off(items, size, 0, share)[1]) for size, share in ((500, 1.0), (50, 0.2), (5, 0.2))]
    assert held_counts == [99, 20, 5]
    assert split_off([7], 3, 0) == ([7], [])


def test_held_out_split_is_seeded_and_disjoint(tokenizer):
    cfg = DataConfig(eval_source=None, eval_size=20)
    train_a, held_a = load_prompt_sets(cfg, tokenizer, seed=1)
    train_b, held_b = load_prompt_sets(cfg, tokenizer, seed=1)
    assert held_a.rows == held_b.rows and len(held_a.rows) == 20
    assert not {r.prompt for r in held_a.rows} & {r.prompt for r in train_a.rows}
    assert len(train_a.rows) == 300 - 20


def test_builtin_held_out_set_differs_from_training(tokenizer):
    train, held = load_prompt_sets(DataConfig(eval_size=32), tokenizer, seed=0)
    assert len(train.rows) == 300 and len(held.rows) == 32
    assert not {r.prompt for r in train.rows} & {r.prompt for r in held.rows}


@pytest.mark.parametrize("config, sizes", [("addsub1", (78, 77)), ("add12", (900, 900))])
def test_small_arithmetic_spaces_are_split_in_disjoint_halves(config, sizes):
    train, _ = load_rows("builtin:arithmetic", "train", name=config)
    test, _ = load_rows("builtin:arithmetic", "test", name=config)
    assert (len(train), len(test)) == sizes

    def problem(row):
        return re.search(r"(\d+) ([+-]) (\d+)", row["prompt"]).groups()

    assert not {problem(r) for r in train} & {problem(r) for r in test}
    assert all(0 <= int(r["answer"]) for r in train + test)


def test_builtin_arithmetic_is_deterministic_with_answers_and_a_disjoint_test_split():
    train, _ = load_rows("builtin:arithmetic", "train")
    test, _ = load_rows("builtin:arithmetic", "test")
    assert len(train) == 4000 and len(test) == 256 and load_rows("builtin:arithmetic", "test")[0] == test
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for row in train[:200] + test:
        a, op, b = re.search(r"(\d+) ([+-]) (\d+)", row["prompt"]).groups()
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0


def test_prompt_stream_is_seeded_and_resumable_from_a_position():
    prompts = [f"p{i}" for i in range(7)]
    stream = PromptStream(prompts, seed=3)
    position = PromptPosition()
    first = []
    for _ in range(4):  # crosses a pass boundary
        batch, position = stream.take(3, position)
        first.append(batch)
    assert sorted(first[0] + first[1] + [first[2][0]]) == sorted(prompts)  # each prompt once per pass
    assert first[0] != prompts[:3] or first[1] != prompts[3:6]  # shuffled

    # A new stream (a resumed run) continues the same order from a saved position.
    _, after_two = stream.take(6, PromptPosition())
    resumed = PromptStream(prompts, seed=3)
    second_half = []
    for _ in range(2):
        batch, after_two = resumed.take(3, after_two)
        second_half.append(batch)
    assert second_half == first[2:]
    assert PromptStream(prompts, seed=4).take(7, PromptPosition())[0] != stream.take(7, PromptPosition())[0]


def test_each_pass_over_the_prompts_is_a_new_shuffle_of_all_of_them():
    """Passes differ (reshuffled, not the same order again), each holds every prompt once, and
    the position counts the passes."""
    prompts = [f"p{i}" for i in range(20)]
    stream = PromptStream(prompts, seed=3)
    first, position = stream.take(20, PromptPosition())
    second, position = stream.take(20, position)
    assert sorted(first) == sorted(second) == sorted(prompts) and first != second
    assert position == PromptPosition(1, 20)
    third, position = stream.take(1, position)
    assert position == PromptPosition(2, 1) and third[0] in prompts


def test_malformed_rows_are_counted_and_reported(tmp_path, tiny_model_dir, caplog):
    source = _write(tmp_path / "p.jsonl", [
        {"prompt": "The movie was"}, {"prompt": "I think the film"}, {"other": "no prompt here"},
        {"prompt": ""}, {"prompt": "word " * 200},
    ])
    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(
        tiny_model_dir, tmp_path / "run", data={"source": str(source), "eval_size": 0},
        train={"steps": 1, "eval": False},
    ))
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    assert [row.prompt for row in trainer.parts.train_prompts.rows] == ["The movie was", "I think the film"]
    trainer.train()
    assert "1 not text, 1 empty, 1 too long" in caplog.text


def test_no_usable_rows_refuses_to_start_in_one_line(tmp_path, tiny_model_dir):
    source = _write(tmp_path / "p.jsonl", [{"other": "x"}, {"prompt": "  "}, {"prompt": "word " * 200}])
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "run")
    result = CliRunner().invoke(app, ["train", str(recipe), f"data.source={source}"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: data.source: no usable prompts in {str(source)!r} (1 not_text, 1 empty, 1 too_long)"
    ]
    assert not (tmp_path / "run").exists()


def test_held_out_prompts_of_a_users_file_come_from_that_file(tmp_path, tiny_tokenizer, caplog):
    """`data.eval_source` left at its default: a user's dataset is split (seeded, logged), never
    evaluated on the quickstart's movie openers; the builtin source keeps its shipped companion."""
    import json
    import logging

    source = tmp_path / "support.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"ticket {i}: my order is late"}) + "\n" for i in range(20)))
    with caplog.at_level(logging.INFO, logger="lora_ppo.data"):
        train, held_out = load_prompt_sets(DataConfig(source=str(source), eval_size=4), tiny_tokenizer, seed=0)
    texts = {row.prompt for row in held_out.rows}
    assert len(texts) == 4 and all(t.startswith("ticket ") for t in texts)
    assert texts.isdisjoint(row.prompt for row in train.rows) and len(train.rows) == 16
    assert f"held-out prompts: 4 of {source}'s 20 usable ones, split off with seed 0" in caplog.text

    _, builtin_held_out = load_prompt_sets(DataConfig(eval_size=4), tiny_tokenizer, seed=0)
    import lora_ppo.builtin_prompts

    shipped = (Path(lora_ppo.builtin_prompts.__file__).parent / "movie_review_openers_heldout.txt").read_text()
    assert [row.prompt for row in builtin_held_out.rows] == shipped.splitlines()[:4]


@pytest.mark.parametrize("content, expected", [
    (b"", "is empty"),
    (b"\n  \n", "is empty"),
    # 0xe9 (latin-1 e-acute) follows the 15 bytes of `{"prompt": "caf`.
    (b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n', "line 2: not UTF-8 text (byte 0xe9 at column 16)"),
    # The line ends after its 29 characters where a comma or a brace was due.
    (b'{"prompt": "fine"}\n\n{"prompt": "no closing brace"\n', "line 3: not JSON (Expecting ',' delimiter at column 30)"),
    # After a byte-order mark the column counts from the text a editor shows, and names the bad byte.
    (b'\xef\xbb\xbf{"prompt": "caf\xe9"}\n', "line 1: not UTF-8 text (byte 0xe9 at column 16)"),
])
def test_a_broken_data_file_is_one_line_naming_the_file_and_line(tmp_path, content, expected):
    source = tmp_path / "prompts.jsonl"
    source.write_bytes(content)
    with pytest.raises(RecipeError) as raised:
        load_rows(str(source), "train")
    assert str(raised.value) == f"data.source: {source} {expected}"


@pytest.mark.parametrize("suffix, text", [
    (".jsonl", '{"prompt": "The film opens", "answer": "1"}\n{"prompt": "A quiet drama", "answer": "2"}\n'),
    (".json", '[{"prompt": "The film opens", "answer": "1"}, {"prompt": "A quiet drama", "answer": "2"}]'),
    (".csv", "prompt,answer\nThe film opens,1\nA quiet drama,2\n"),
    (".txt", "The film opens\nA quiet drama\n"),
])
def test_a_file_saved_with_a_byte_order_mark_reads_as_the_same_file_without_one(tmp_path, tiny_tokenizer, suffix,
                                                                                  text):
    """Windows editors (Notepad, PowerShell 5's utf8) start a UTF-8 file with U+FEFF: a .jsonl so
    saved was refused as "not JSON", and a .txt's first prompt began with the invisible character
    (its own tokens before the text)."""
    plain, marked = tmp_path / f"plain{suffix}", tmp_path / f"marked{suffix}"
    plain.write_text(text, encoding="utf-8")
    marked.write_text(text, encoding="utf-8-sig")
    assert marked.read_bytes()[:3] == b"\xef\xbb\xbf"
    rows, columns = load_rows(str(marked), "train")
    assert (rows, columns) == load_rows(str(plain), "train")
    assert rows[0]["prompt"] == "The film opens"
    fmt = PromptFormat(tiny_tokenizer, False)
    assert prepare_rows(rows, "prompt", fmt, 64, str(marked)).rows[0].ids == tuple(
        tiny_tokenizer("The film opens")["input_ids"])


def test_a_conversation_saved_as_json_text_is_refused_not_read_as_a_prompt(tmp_path, tiny_tokenizer):
    """A `messages` column that went through CSV holds JSON text: used as literal text the policy
    would learn to continue JSON. Such rows are dropped and counted by their reason."""
    import csv

    source = tmp_path / "chats.csv"
    with source.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["messages"])
        writer.writerow([json.dumps([{"role": "user", "content": "Where is my parcel?"}])])
        writer.writerow(["[1, 2] is a fine list to ask about"])  # text that merely starts like JSON
    rows, _ = load_rows(str(source), "train")
    prompts = prepare_rows(rows, "messages", PromptFormat(tiny_tokenizer, False), 64, str(source))
    assert [row.prompt for row in prompts.rows] == ["[1, 2] is a fine list to ask about"]
    assert prompts.dropped == {"conversation_as_json_text": 1}


def test_a_split_off_the_training_prompts_never_takes_more_than_a_fifth(tiny_tokenizer, tmp_path, caplog):
    """The default eval_size (64) against 65 prompts held out 64 and trained on 1 (the reward and
    SFT stages' splits already stopped at a fifth): now 13 held out, 52 to train on, and a warning."""
    import json
    import logging

    from lora_ppo.config import DataConfig

    source = tmp_path / "mine.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(65)))
    with caplog.at_level(logging.WARNING, logger="lora_ppo.data"):
        train, held_out = load_prompt_sets(DataConfig(source=str(source)), tiny_tokenizer, seed=0)
    assert (len(train.rows), len(held_out.rows)) == (52, 13)
    assert {r.prompt for r in train.rows}.isdisjoint(r.prompt for r in held_out.rows)
    assert caplog.messages == ["data.eval_size 64 would leave 1 of 65 prompts to train on: held out 13 (20%, the most "
                               "a split takes); data.eval_source names a held-out set of its own"]
