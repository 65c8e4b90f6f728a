"""recipes/pipeline/ end to end on the tiny model (a smoke test: sizes cut to a step or two, every
other field as shipped): train-sft, train-reward, then PPO from the SFT run folder with its adapter
as the reference and the reward run's adapter as the reward, all on one backbone."""

from __future__ import annotations

import json
from pathlib import Path

from lora_ppo.config import RewardRecipe, SFTRecipe, load_recipe

REPO = Path(__file__).resolve().parents[1]
PIPELINE = REPO / "recipes" / "pipeline"


def test_smoke_the_three_pipeline_recipes_chain_on_the_tiny_model(tmp_path, tiny_model_dir):
    import lora_ppo
    from lora_ppo.reward_training import RewardTrainer
    from lora_ppo.sft.trainer import SFTTrainer

    model = [f"model.name={tiny_model_dir}", "model.dequantize_per_step=false"]
    sft = load_recipe(PIPELINE / "sft.yaml", [*model, "data.split=train[:16]", "data.eval_size=4", "data.eval_samples=2",
                                              "data.eval_max_new_tokens=4", f"train.output_dir={tmp_path / 'sft'}"],
                      schema=SFTRecipe)
    SFTTrainer(sft, progress=False).train()
    reward = load_recipe(PIPELINE / "reward.yaml", [*model, "data.split=train[:16]", "data.eval_size=4",
                                                    f"train.output_dir={tmp_path / 'reward'}"], schema=RewardRecipe)
    RewardTrainer(reward, progress=False).train()
    ppo = load_recipe(PIPELINE / "ppo.yaml", [
        *model, f"adapters.policy.init_from={tmp_path / 'sft'}",
        f"reward.sources=[{{kind: adapter, adapter: {tmp_path / 'reward'}}}, "
        "{kind: math_answer, answer_column: answer, weight: 0.0, name: correct}]",
        "rollout.batch_size=4", "ppo.num_minibatches=2", "rollout.max_new_tokens=4", "data.eval_size=2",
        "data.eval_samples_per_prompt=1", "train.steps=1", f"train.output_dir={tmp_path / 'ppo'}"])
    summary = lora_ppo.PPOTrainer(ppo, progress=False).train()
    assert summary["steps"] == 1 and 0.0 <= summary["heldout_correct_after"] <= 1.0
    first = json.loads((tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()[0])
    assert "objective/adapter" in first and "objective/correct" in first
