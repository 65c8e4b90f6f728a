"""The device benchmarks build random models of a real model's shape straight into a pre-quantized
4-bit checkpoint (bench/random_models.py); a device session has minutes, so the builder is checked
here on a tiny shape: lora_ppo's own loading takes the checkpoint whole, as written."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))


def test_a_4bit_checkpoint_built_weight_by_weight_loads_as_written(tmp_path, tiny_model_dir, caplog):
    from random_models import build_random_4bit_model
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    from lora_ppo.bnb_workarounds import linear_4bit_layers
    from lora_ppo.config import ModelConfig
    from lora_ppo.model import load_base_model

    config_dir = tmp_path / "config"
    LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                initializer_range=0.02).save_pretrained(config_dir)
    folder = tmp_path / "model"
    build_random_4bit_model(config_dir, str(tiny_model_dir), folder)
    saved = {}
    for shard in folder.glob("*.safetensors"):
        saved.update(load_file(str(shard)))
    with caplog.at_level("WARNING"):
        model = load_base_model(ModelConfig(name=str(folder), quantization="4bit"))
    assert "missing" not in caplog.text.lower() and "newly initialized" not in caplog.text.lower()
    layers = dict((name, m) for name, m in model.named_modules() if m in linear_4bit_layers(model))
    assert len(layers) == 2 * 7  # every decoder linear layer came in quantized
    for name, layer in layers.items():
        assert torch.equal(layer.weight.data.view(-1), saved[f"{name}.weight"].view(-1))
        assert torch.equal(layer.weight.quant_state.absmax, saved[f"{name}.weight.absmax"])
        from bitsandbytes.functional import dequantize_4bit

        weight = dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
        assert weight.shape == (layer.out_features, layer.in_features)
        assert weight.std().item() == pytest.approx(0.02, rel=0.15)  # drawn as N(0, initializer_range)
    assert torch.equal(model.lm_head.weight.to(torch.bfloat16), saved["lm_head.weight"])
    assert torch.isfinite(model(input_ids=torch.tensor([[1, 5, 9]])).logits).all()


def test_the_lever_cost_bench_times_the_adapters_a_run_trains(tmp_path, tiny_model_dir, make_roles):
    """bench/lever_costs.py times the CPU optimizer over the adapter shapes it counts from the config
    and recipe (no model loaded): they must be the tensors a loaded run trains."""
    from lever_costs import adapter_tensors

    import lora_ppo
    from lora_ppo.model_shape import load_shape
    from tests.conftest import tiny_recipe_dict

    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / "run"))
    roles = make_roles()  # the same r=4 policy and value adapters, loaded
    trained = roles.policy_parameters() + roles.value_parameters()
    assert sorted(adapter_tensors(load_shape(str(tiny_model_dir)), recipe)) == sorted(p.numel() for p in trained)
