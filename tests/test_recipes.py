"""Every shipped recipe validates (the schema itself is tested in test_config.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_ppo.config import load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").rglob("*.yaml"))


def test_there_are_recipes():
    assert any(p.name == "quickstart.yaml" for p in RECIPES)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.rollout.batch_size % (recipe.ppo.num_minibatches * recipe.ppo.grad_accum_steps) == 0
