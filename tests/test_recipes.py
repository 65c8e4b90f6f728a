"""Every shipped recipe loads and keeps the promises the README makes about it; the recipes for hub
models and datasets run end to end with tiny local stand-ins in the same formats."""

from __future__ import annotations

from pathlib import Path

import pytest

from lora_ppo.config import BUILTIN_PREFIX, load_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").rglob("*.yaml"))


def test_there_are_recipes():
    assert any(p.name == "quickstart.yaml" for p in RECIPES)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipe_loads(path):
    load_recipe(path, schema=None)  # a PPO or a reward-model recipe; a RecipeError here is the failure


MIXED_SOURCES = """
reward:
  sources:
    - {kind: vader, weight: 1.0, normalize: true}
    - {kind: math_answer, answer_column: answer, weight: 2.0}
    - {kind: function, function: tests.reward_fns:count_letter_e, weight: -0.1, name: letters}
  also_log: [textblob]
  timeout_s: 30
"""


@pytest.mark.parametrize("path", [*RECIPES, "mixed-sources"], ids=lambda p: getattr(p, "name", p))
def test_a_resolved_recipe_written_out_reads_back_equal(path, tmp_path):
    """A run writes its resolved recipe (every default filled in) to recipe.yaml; eval, generate,
    merge-and-export and --resume read it back. A mix of sources once failed its own check there."""
    from lora_ppo.config import recipe_to_yaml

    if path == "mixed-sources":
        path = tmp_path / "mixed.yaml"
        path.write_text(MIXED_SOURCES, encoding="utf-8")
    recipe = load_recipe(path, schema=None)
    written = tmp_path / "recipe.yaml"
    written.write_text(recipe_to_yaml(recipe), encoding="utf-8")
    assert load_recipe(written, schema=None) == recipe


def test_quickstart_model_and_prompts_are_builtin():
    # The README promises the quickstart downloads nothing.
    recipe = load_recipe(next(p for p in RECIPES if p.name == "quickstart.yaml"))
    names = [recipe.model.name, recipe.data.source, recipe.data.eval_source]
    assert all(name.startswith(BUILTIN_PREFIX) for name in names), names


def test_recipes_write_to_their_own_folders():
    # The quickstart sets train.overwrite: sharing a folder would erase another recipe's run.
    folders = [load_recipe(p, schema=None).train.output_dir for p in RECIPES]
    assert len(set(folders)) == len(folders), folders


def _jsonl(path: Path, rows: list[dict]) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _dataset_folder(root: Path, splits: dict[str, list[dict]], config: str | None = None) -> Path:
    """A local dataset folder in the hub's layout: a README declaring the splits (and config)."""
    lines = ["---", "configs:", f"- config_name: {config or 'default'}", "  data_files:"]
    for split, rows in splits.items():
        _jsonl(root / f"{split}.jsonl", rows)
        lines += [f"  - split: {split}", f"    path: {split}.jsonl"]
    (root / "README.md").write_text("\n".join(lines + ["---", ""]))
    return root


# Small sizes for one quick step; everything else (reward, prompt format, algorithm) as the recipe says.
SMALL = ["rollout.batch_size=4", "rollout.samples_per_prompt=2", "ppo.num_minibatches=1", "ppo.grad_accum_steps=2",
         "ppo.num_epochs=1", "rollout.max_new_tokens=8", "rollout.forward_batch_size=2", "data.eval_size=2",
         "data.eval_batch_size=4", "data.eval_split=test", "train.steps=1", "train.save_every=0",
         "model.gradient_checkpointing=false", "data.max_prompt_tokens=128"]  # the tiny model has 256 positions


def test_smoke_gsm8k_recipe_runs_end_to_end_on_a_local_stand_in(tmp_path, tiny_model_dir):
    """Smoke test: the GSM8K recipe trains a step; its held-out score is in the reward's range, its adapter saved."""
    # recipes/qwen2.5-0.5b_gsm8k.yaml with a tiny model and a dataset in GSM8K's format: config
    # `main`, `question` prompts, worked `answer`s ending in `#### N`.
    import lora_ppo

    def rows(start):
        return [{"question": f"Tom has {n} apples and buys 2 more. How many now?",
                 "answer": f"He has {n} + 2 = {n + 2} apples.\n#### {n + 2}"} for n in range(start, start + 6)]

    gsm8k = _dataset_folder(tmp_path / "gsm8k", {"train": rows(0), "test": rows(50)}, config="main")
    recipe = load_recipe(REPO / "recipes" / "qwen2.5-0.5b_gsm8k.yaml", [
        f"model.name={tiny_model_dir}", f"data.source={gsm8k}", f"data.eval_source={gsm8k}",
        f"train.output_dir={tmp_path / 'run'}", *SMALL,
    ])
    summary = lora_ppo.PPOTrainer(recipe, progress=False).train()
    assert summary["steps"] == 1 and 0.0 <= summary["heldout_score_before"] <= 1.1
    assert (tmp_path / "run" / "final" / "policy" / "adapter_model.safetensors").is_file()


def test_smoke_conversational_recipe_runs_end_to_end_on_a_local_stand_in(tmp_path, tiny_model_dir, tiny_classifier_dir):
    """Smoke test: the UltraFeedback recipe trains a step and logs a held-out score and a training score."""
    # recipes/qwen2.5-1.5b_ultrafeedback.yaml with a tiny model and classifier and a dataset in
    # TRL's prompt-only conversational format.
    import lora_ppo

    def rows(start):
        return [{"prompt": [{"role": "user", "content": f"Tell me about film number {n}."}]} for n in range(start, start + 6)]

    prompts = _dataset_folder(tmp_path / "ultrafeedback", {"train": rows(0), "test": rows(50)})
    recipe = load_recipe(REPO / "recipes" / "qwen2.5-1.5b_ultrafeedback.yaml", [
        f"model.name={tiny_model_dir}", f"reward.model={tiny_classifier_dir}", f"data.source={prompts}",
        f"data.eval_source={prompts}", f"train.output_dir={tmp_path / 'run'}", *SMALL,
    ])
    summary = lora_ppo.PPOTrainer(recipe, progress=False).train()
    assert summary["steps"] == 1 and summary["heldout_score_after"] is not None
    samples = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "objective/scores" in samples
