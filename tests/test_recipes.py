"""Every shipped recipe validates, and the schema rejects what it should."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_ppo.config import load_recipe, recipe_from_dict
from lora_ppo.errors import RecipeError

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").rglob("*.yaml"))


def test_there_are_recipes():
    assert any(p.name == "quickstart.yaml" for p in RECIPES)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.rollout.batch_size % (recipe.ppo.num_minibatches * recipe.ppo.grad_accum_steps) == 0


def test_overrides_reach_nested_fields_and_parse_types():
    recipe = recipe_from_dict({}, ["ppo.kl_coef=0.2", "train.steps=7", "ppo.whiten_rewards=true",
                                   "adapters.policy.target_modules=[q_proj, v_proj]"])
    assert recipe.ppo.kl_coef == 0.2 and recipe.train.steps == 7 and recipe.ppo.whiten_rewards is True
    assert recipe.adapters.policy.target_modules == ["q_proj", "v_proj"]


def test_derived_sizes():
    recipe = recipe_from_dict({"rollout": {"batch_size": 16}, "ppo": {"num_minibatches": 2, "grad_accum_steps": 4}})
    assert (recipe.minibatch_size, recipe.micro_batch_size) == (8, 2)


def test_reference_resolution():
    assert recipe_from_dict({}).adapters.reference_adapter_path is None
    started = recipe_from_dict({"adapters": {"policy": {"init_from": "sft"}}})
    assert started.adapters.reference_adapter_path == "sft"
    assert recipe_from_dict({"adapters": {"policy": {"init_from": "sft"}, "reference": "disable"}}).adapters.reference_adapter_path is None


@pytest.mark.parametrize("data, field", [
    ({"rollout": {"top_p": 1.5}}, "rollout.top_p"),
    ({"ppo": {"gamma": 2}}, "ppo.gamma"),
    ({"train": {"output_dir": 3}}, "train.output_dir"),
    ({"reward": {"kind": "function", "function": "no_colon"}}, "module:function"),
    ({"model": "x"}, "model"),
    ({"model": {"quantization": "none", "dequantize_per_step": True}}, "model.dequantize_per_step"),
])
def test_errors_name_the_field(data, field):
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(data)
    assert field in str(err.value) and "\n" not in str(err.value)
