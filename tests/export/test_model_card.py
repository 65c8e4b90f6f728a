"""The export's README.md is a model card huggingface_hub parses: base model, library, tags."""

from __future__ import annotations

import pytest
from huggingface_hub import ModelCard

from lora_ppo.export import merge_and_export
from lora_ppo.model_card import base_model_id

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_merged_card_metadata(exported):
    folder, _ = exported
    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "transformers"
    assert card.data.tags == ["lora_ppo", "ppo", "rlhf"]
    assert card.data.base_model is None  # the tiny test model is a local folder, not a hub id
    assert card.text.lstrip().startswith("# PPO-trained policy, merged")


@pytest.mark.parametrize("model_name", ["builtin:smollm2-135m-instruct", SMOLLM2])
def test_adapter_card_names_the_hub_base_model(run_copy, tmp_path, model_name):
    recipe = run_copy / "recipe.yaml"
    # Only the card reads the model name: an adapter-only export loads no model.
    recipe.write_text(recipe.read_text().replace(f"name: {_model_name(recipe)}", f"name: {model_name}", 1))
    merge_and_export(run_copy, tmp_path / "out", adapter_only=True)
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert card.data.base_model == SMOLLM2 and card.data.library_name == "peft"
    assert card.data.tags == ["lora_ppo", "ppo", "rlhf"]
    assert f"- Base model: `{model_name}`" in card.text


def _model_name(recipe_path) -> str:
    import yaml

    return yaml.safe_load(recipe_path.read_text())["model"]["name"]


def test_base_model_id():
    assert base_model_id("builtin:smollm2-135m-instruct") == SMOLLM2
    assert base_model_id("builtin:unknown") is None
    assert base_model_id("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
    assert base_model_id("/models/llama") is None and base_model_id("./llama") is None
    assert base_model_id("a/b/c") is None
