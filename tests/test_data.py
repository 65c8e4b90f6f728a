"""Prompt loading from every supported file type, row filtering with counts, held-out
splits, and a seeded prompt order that can be resumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import lora_ppo
from lora_ppo.cli import app
from lora_ppo.config import DataConfig
from lora_ppo.data import (
    PromptStream,
    load_prompt_sets,
    load_prompt_texts,
    prepare_prompts,
)
from lora_ppo.errors import RecipeError
from lora_ppo.state import PromptPosition
from tests.conftest import tiny_recipe_dict, write_recipe

ROWS = ["This movie was", "The acting in this film", "Honestly, the sequel"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet", ".txt"])
def test_every_file_type_loads(tmp_path, suffix):
    import pandas as pd

    path = tmp_path / f"prompts{suffix}"
    frame = pd.DataFrame({"prompt": ROWS, "other": [1, 2, 3]})
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in frame.to_dict("records")))
    elif suffix == ".csv":
        frame.to_csv(path, index=False)
    elif suffix == ".parquet":
        frame.to_parquet(path)
    else:
        path.write_text("\n".join(ROWS) + "\n")
    assert load_prompt_texts(str(path), "train", "prompt") == ROWS


def test_missing_column_names_the_columns(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(RecipeError, match=r"data.prompt_column: column 'prompt' not in .* \(columns: text\)"):
        load_prompt_texts(str(path), "train", "prompt")


def test_unsupported_and_missing_files(tmp_path):
    with pytest.raises(RecipeError, match="file not found"):
        load_prompt_texts(str(tmp_path / "none.jsonl"), "train", "prompt")
    (tmp_path / "p.xml").write_text("<a/>")
    with pytest.raises(RecipeError, match="unsupported file type '.xml'"):
        load_prompt_texts(str(tmp_path / "p.xml"), "train", "prompt")


def test_bad_rows_are_dropped_and_counted(tokenizer):
    raw = ["fine prompt", "", "   ", None, 7, "word " * 100]
    prompt_set = prepare_prompts(raw, tokenizer, chat_template=False, max_prompt_tokens=16)
    assert prompt_set.prompts == ["fine prompt"]
    assert prompt_set.dropped == {"empty": 2, "not_text": 2, "too_long": 1}


def test_chat_template_wraps_prompts(tokenizer):
    prompt_set = prepare_prompts(["hello"], tokenizer, chat_template=True, max_prompt_tokens=64)
    assert prompt_set.prompts == ["<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"]


def test_held_out_split_is_seeded_and_disjoint(tokenizer):
    cfg = DataConfig(eval_source=None, eval_size=20)
    train_a, held_a = load_prompt_sets(cfg, tokenizer, seed=1)
    train_b, held_b = load_prompt_sets(cfg, tokenizer, seed=1)
    assert held_a.prompts == held_b.prompts and len(held_a.prompts) == 20
    assert not set(held_a.prompts) & set(train_a.prompts)
    assert len(train_a.prompts) == 300 - 20


def test_builtin_held_out_set_differs_from_training(tokenizer):
    train, held = load_prompt_sets(DataConfig(eval_size=32), tokenizer, seed=0)
    assert len(train.prompts) == 300 and len(held.prompts) == 32
    assert not set(train.prompts) & set(held.prompts)


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


def _rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_malformed_rows_are_counted_and_reported(tmp_path, tiny_model_dir, caplog):
    source = _rows(tmp_path / "p.jsonl", [
        {"prompt": "The movie was"}, {"prompt": "I think the film"}, {"other": "no prompt here"},
        {"prompt": ""}, {"prompt": "word " * 200},
    ])
    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(
        tiny_model_dir, tmp_path / "run", data={"source": str(source), "eval_size": 0},
        train={"steps": 1, "eval": False},
    ))
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    assert trainer.parts.train_prompts.prompts == ["The movie was", "I think the film"]
    trainer.train()
    assert "1 not text, 1 empty, 1 too long" in caplog.text


def test_no_usable_rows_refuses_to_start_in_one_line(tmp_path, tiny_model_dir):
    source = _rows(tmp_path / "p.jsonl", [{"other": "x"}, {"prompt": "  "}, {"prompt": "word " * 200}])
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "run")
    result = CliRunner().invoke(app, ["train", str(recipe), f"data.source={source}"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: data.source: no usable prompts in {str(source)!r} (1 not_text, 1 empty, 1 too_long)"
    ]
    assert not (tmp_path / "run").exists()
