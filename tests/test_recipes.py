"""Every shipped recipe loads, and keeps the promises the README makes about it."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_ppo.config import BUILTIN_PREFIX, load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").rglob("*.yaml"))


def test_there_are_recipes():
    assert any(p.name == "quickstart.yaml" for p in RECIPES)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipe_loads(path):
    load_recipe(path)  # a RecipeError here is the failure


def test_quickstart_model_and_prompts_are_builtin():
    # The README promises the quickstart downloads nothing.
    recipe = load_recipe(next(p for p in RECIPES if p.name == "quickstart.yaml"))
    names = [recipe.model.name, recipe.data.source, recipe.data.eval_source]
    assert all(name.startswith(BUILTIN_PREFIX) for name in names), names


def test_recipes_write_to_their_own_folders():
    # The quickstart sets train.overwrite: sharing a folder would erase another recipe's run.
    folders = [load_recipe(p).train.output_dir for p in RECIPES]
    assert len(set(folders)) == len(folders), folders
