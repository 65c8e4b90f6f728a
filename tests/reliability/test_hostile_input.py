"""Hostile datasets are counted and reported (or refused when nothing is left), and the package
is safe by default: no remote code, no pickled weights, no reward import it was not told to do."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from typer.testing import CliRunner

import lora_ppo
from lora_ppo.cli import app
from lora_ppo.config import ModelConfig, RewardConfig
from lora_ppo.rewards import build_reward
from tests.conftest import tiny_recipe_dict
from tests.reliability.conftest import write_recipe

PACKAGE = Path(lora_ppo.__file__).parent


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


def test_remote_code_is_off_unless_the_recipe_says_so():
    assert ModelConfig().trust_remote_code is False


def test_saved_state_is_only_loaded_with_weights_only():
    for path in PACKAGE.glob("*.py"):
        for call in re.findall(r"torch\.load\([^)]*\)", path.read_text()):
            assert "weights_only=True" in call, f"{path.name}: {call}"


def test_a_reward_module_is_imported_only_when_the_recipe_names_it():
    cfg = RewardConfig(kind="vader", function="tests.reliability.never_imported:boom")
    build_reward(cfg)
    assert "tests.reliability.never_imported" not in sys.modules
