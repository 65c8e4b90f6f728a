"""`lora-ppo estimate` on a train-sft recipe: the arithmetic on the hand-checked tiny shape of
tests/test_estimate.py, and the command's answer."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from lora_ppo import estimate as est
from lora_ppo.config import SFTRecipe, recipe_from_dict
from lora_ppo.cli import app
from tests.test_estimate import TINY


def test_sft_phases_by_hand():
    """A micro-batch of 4 rows x 16 tokens = 64 tokens, fp32 on CPU, no checkpointing: the values
    kept for backward, 2 (backward doubles them) x 2 layers x 64 x (10 x 64 + 4 x 128 + 2 x 32) x 4
    = 1245184 bytes; a checkpointed logits chunk of 64 positions, 5 x 64 x 320 x 4 = 409600; the
    largest weight dequantized, 64 x 128 x 4 = 32768; the heap backward keeps on CPU, 0.5 x 73728
    x 4 = 147456; the adapter's gradients, 8192 x 4. A held-out batch of 2 rows (32 tokens): 32 x
    (4 x 64 + 3 x 128) x 4 = 81920 for a layer, logits 3 x 32 x 320 x 4 = 122880, and the weight."""
    recipe = recipe_from_dict({"adapter": {"r": 4}, "data": {"max_length": 16, "eval_batch_size": 2},
                               "model": {"gradient_checkpointing": False},
                               "train": {"batch_size": 8, "grad_accum_steps": 2}}, schema=SFTRecipe)
    e = est.estimate_sft(TINY, recipe, device="cpu")
    static = 73728 * (0.5 + 1 / 64 + 4 / 16384) + 20800 * 4 + 8192 * 4 + 8192 * 8 + est.RUNTIME_BYTES["cpu"]
    assert sum(e.components.values()) == pytest.approx(static)
    assert e.phases["update"] == pytest.approx(static + 8192 * 4 + 1245184 + 409600 + 32768 + 147456)
    assert e.phases["evaluate"] == pytest.approx(static + 81920 + 122880 + 32768)
    # The greedy answers, 2 rows at once (eval_batch_size < eval_samples): keys and values of 2
    # layers x 32 wide for 16 + 64 tokens, 2 x 2 x 32 x 2 x 80 x 4 = 81920; a step's logits, 3 x 2 x
    # 320 x 4 = 7680; the prefill's layer, 32 x (4 x 64 + 3 x 128) x 4 = 81920, and the weight.
    assert e.phases["sample"] == pytest.approx(static + 81920 + 7680 + 81920 + 32768)
    no_samples = recipe.model_copy(update={"data": recipe.data.model_copy(update={"eval_samples": 0})})
    assert "sample" not in est.estimate_sft(TINY, no_samples, device="cpu").phases


def test_fused_lora_in_bfloat16_holds_the_adapter_cast_once():
    """bfloat16, the recipe above on a GPU: `model.fused_lora` keeps 0.59x of a layer's values for the
    backward, 2 x 2 layers x 64 x (10 x 64 + 4 x 128 + 2 x 32) x 2 x 0.41 = 255262.72 bytes less, and
    holds the adapter cast to bfloat16 with its gradient, 8192 x 2 x 2 = 32768 bytes more."""
    def update(fused: bool) -> float:
        recipe = recipe_from_dict({"adapter": {"r": 4}, "data": {"max_length": 16},
                                   "model": {"gradient_checkpointing": False, "compute_dtype": "bfloat16",
                                             "fused_lora": fused},
                                   "train": {"batch_size": 8, "grad_accum_steps": 2}}, schema=SFTRecipe)
        return est.estimate_sft(TINY, recipe, device="cuda").phases["update"]

    assert update(False) - update(True) == pytest.approx(4 * 64 * 1216 * 2 * 0.41 - 32768)


def test_estimate_answers_for_an_sft_recipe(tiny_model_dir, tmp_path):
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"name": str(tiny_model_dir)}, "adapter": {"r": 4},
                                      "data": {"max_length": 64}, "sft": {"packing": True}}))
    result = CliRunner().invoke(app, ["estimate", str(recipe), "--json", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert set(answer["phases_gb"]) == {"update", "evaluate", "sample"} and answer["peak_gb"] == max(answer["phases_gb"].values())
    small = CliRunner().invoke(app, ["estimate", str(recipe), "--gpu-gb", "0.01"])
    assert small.exit_code == 1 and "does NOT fit in 0.01 GB" in small.stdout
