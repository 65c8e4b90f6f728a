"""The libraries' notices: none from lora_ppo's own calls (no name a library is dropping), and none
from loading in the Python API, which shows what the CLI shows."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.conftest import tiny_recipe_dict

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("stage", ["ppo", "sft", "reward"])
def test_wrapping_the_model_with_peft_raises_no_deprecation_notice(tiny_model_dir, stage):
    from lora_ppo.config import AdaptersConfig, LoraSettings, ModelConfig, RewardAdapterSettings
    from lora_ppo.model import load_base_model
    from lora_ppo.roles import POLICY, RewardModel, RoleModel, SingleAdapterModel

    base = load_base_model(ModelConfig(name=str(tiny_model_dir)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # `is_gradient_checkpointing` is one
        warnings.simplefilter("error", DeprecationWarning)
        if stage == "ppo":
            RoleModel(base, AdaptersConfig(policy={"r": 4, "alpha": 8}, value={"r": 4, "alpha": 8}))
        elif stage == "sft":  # SFTModel's own wrapping is SingleAdapterModel's
            SingleAdapterModel(base, LoraSettings(r=4, alpha=8), POLICY)
        else:
            RewardModel(base, RewardAdapterSettings(r=4, alpha=8))


def test_parity_greedy_decoding_uses_the_cache_keyword_and_matches_generate(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from lora_ppo.parity import _greedy_continuations

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompts = [torch.tensor([5, 17, 42]), torch.tensor([9, 33])]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # `past_key_values` goes in transformers 5.40
        got = _greedy_continuations(model, prompts, new_tokens=4)
    for prompt, continued in zip(prompts, got):  # one row at a time: no padding involved
        expected = model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=4,
                                  min_new_tokens=4, do_sample=False, pad_token_id=0)[0]
        assert continued.tolist() == expected.tolist()


LOAD_ONLY = """
import lora_ppo, sys, json
recipe = lora_ppo.recipe_from_dict(json.loads(sys.argv[1]))
lora_ppo.PPOTrainer(recipe, progress=False)
print("loaded")
"""


def test_the_python_api_loads_without_library_notices(tmp_path, tiny_model_dir):
    """In a fresh interpreter: bitsandbytes' kernel notice comes at its first import."""
    import json

    recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", LOAD_ONLY, json.dumps(recipe)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded"
    for notice in ("Loading weights", "gemm_4bit", "Warning", "kernels"):
        assert notice not in done.stderr, done.stderr
