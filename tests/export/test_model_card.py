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
    # The default export: the original base, fp32 weights; what it is comes before how to use it.
    assert "- Merged into: original base\n- Weights dtype: fp32\n" in card.text
    assert "merged into the original, unquantized base weights, saved as fp32." in card.text
    assert card.text.index("LoRA adapter from checkpoint") < card.text.index("## Use") < card.text.index(
        "from transformers import AutoModelForCausalLM")


@pytest.mark.parametrize("adapter, title, reads", [
    ("value", "# PPO-trained value adapter", "values = head(hidden).squeeze(-1)  # [B, T]"),
    ("reward", "# reward adapter", "score = head(hidden[:, -1]).squeeze(-1)  # [B]"),
])
def test_a_score_adapters_card_shows_how_its_head_is_read(run_copy, tmp_path, adapter, title, reads):
    final = run_copy / "final"
    if adapter == "reward":  # a reward-model run's checkpoint: the adapter and head under reward's names
        (final / "value").rename(final / "reward")
        (final / "reward" / "value_head.safetensors").rename(final / "reward" / "reward_head.safetensors")
    merge_and_export(run_copy, tmp_path / "out", adapter=adapter, adapter_only=True)
    text = ModelCard.load(tmp_path / "out" / "README.md").text
    assert text.lstrip().startswith(title + "\n")
    assert text.index(f"The `{adapter}` LoRA adapter with its score head") < text.index("## Use") < text.index(reads)


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
    # The builtin weights are a quantized file's, not the hub's: the card says which.
    converted = [ln for ln in card.text.splitlines() if ln.startswith("- Converted from: ")]
    if model_name.startswith("builtin:"):
        assert len(converted) == 1 and converted[0].endswith(f"a quantized copy of `{SMOLLM2}`")
    else:
        assert converted == []


def _model_name(recipe_path) -> str:
    import yaml

    return yaml.safe_load(recipe_path.read_text())["model"]["name"]


def test_base_model_id():
    assert base_model_id("builtin:smollm2-135m-instruct") == SMOLLM2
    assert base_model_id("builtin:unknown") is None
    assert base_model_id("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
    assert base_model_id("/models/llama") is None and base_model_id("./llama") is None
    assert base_model_id("a/b/c") is None


def test_a_local_folder_named_like_a_hub_id_is_no_base_model_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my-org" / "my-model").mkdir(parents=True)
    assert base_model_id("my-org/my-model") is None
    assert base_model_id("my-org/other-model") == "my-org/other-model"
