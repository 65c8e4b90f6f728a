"""What a model needs, found from its config and checked against its forward: the logit
transform per config field, the refusal past the probe's limit, fused MoE experts and Linear
subclasses that bitsandbytes leaves unquantized."""

from __future__ import annotations

import pytest
import torch

from lora_ppo.errors import RecipeError
from lora_ppo.logprobs import LogitTransform
from lora_ppo.model_checks import (LOGIT_PATH_TOLERANCE, check_logit_path, logit_path_error, logit_transform_of,
                                   probe_ids)
from tests.architectures import COHERE_LOGIT_SCALE, GEMMA_SOFTCAP, GRANITE_LOGITS_SCALING, configs


@pytest.mark.parametrize("name, expected", [
    ("llama", LogitTransform()),
    ("gpt2", LogitTransform()),
    ("gemma2", LogitTransform(softcap=GEMMA_SOFTCAP)),
    ("gemma3", LogitTransform(softcap=GEMMA_SOFTCAP)),
    ("granite", LogitTransform(scale=1 / GRANITE_LOGITS_SCALING)),
    ("cohere", LogitTransform(scale=COHERE_LOGIT_SCALE)),
])
def test_the_transform_each_config_asks_for(name, expected):
    assert logit_transform_of(configs(320)[name]) == expected


def test_a_gemma3_multimodal_config_is_read_through_its_text_config():
    from transformers import Gemma3Config

    config = Gemma3Config(text_config={**configs(320)["gemma3"].to_dict(), "final_logit_softcapping": 7.0})
    assert logit_transform_of(config) == LogitTransform(softcap=7.0)


def test_the_probe_error_is_the_largest_log_softmax_difference():
    ids = probe_ids(50, torch.device("cpu"))
    assert ids.shape == (1, 16) and int(ids.max()) < 50 and len(set(ids[0].tolist())) > 8
    logits = torch.randn(1, 16, 50, generator=torch.Generator().manual_seed(0))
    shifted = logits + 3.0  # the same distribution
    assert logit_path_error(lambda x: logits, lambda x: shifted, ids) < 1e-5
    scaled = logits * 2
    by_hand = (torch.log_softmax(logits, -1) - torch.log_softmax(scaled, -1)).abs().max().item()
    assert logit_path_error(lambda x: logits, lambda x: scaled, ids) == pytest.approx(by_hand, rel=1e-6)


def test_the_refusal_names_the_model_type_and_the_numbers():
    limit = LOGIT_PATH_TOLERANCE[torch.float32]
    check_logit_path(limit, LogitTransform(), torch.float32, "llama")  # at the limit: fine
    check_logit_path(0.2, LogitTransform(), torch.bfloat16, "llama")  # bf16's own rounding: fine
    with pytest.raises(RecipeError) as raised:
        check_logit_path(2.5, LogitTransform(softcap=30.0), torch.float32, "gemma2")
    message = str(raised.value)
    assert message.startswith("model.name: a gemma2 model's logits do not match lora_ppo's logit path")
    assert "largest logprob difference 2.5" in message and "soft-cap 30" in message and "\n" not in message


def test_unquantized_parts_of_a_4bit_load_are_found(tmp_path, caplog):
    """Qwen3-MoE's fused experts (3-D) and Falcon's FalconLinear layers stay at full precision, and
    a quantized load says so (an unquantized one has nothing to say)."""
    from lora_ppo.config import ModelConfig
    from lora_ppo.model import load_base_model
    from lora_ppo.model_checks import fused_expert_parameters, unconverted_linears
    from tests.architectures import build_model
    from tests.conftest import build_tiny_tokenizer

    found, said = {}, {}
    for name in ("qwen3_moe", "falcon", "llama"):
        folder = tmp_path / name
        folder.mkdir()
        build_model(name, folder, len(build_tiny_tokenizer(folder)))
        caplog.clear()
        with caplog.at_level("WARNING", logger="lora_ppo.model"):
            model = load_base_model(ModelConfig(name=str(folder)))
        found[name] = (fused_expert_parameters(model), unconverted_linears(model))
        said[name] = [r.getMessage() for r in caplog.records if r.name == "lora_ppo.model"]
    assert [m.split(" (")[0] for m in said["qwen3_moe"]] == ["model.quantization 4bit leaves 4 fused MoE expert weights"]
    assert [m.split(" (")[0] for m in said["falcon"]] == ["model.quantization 4bit leaves 8 linear layers of a Linear subclass"]
    assert all("unquantized in float32: bitsandbytes converts exact nn.Linear layers only" in m
               for m in said["qwen3_moe"] + said["falcon"]) and said["llama"] == []
    caplog.clear()
    with caplog.at_level("WARNING", logger="lora_ppo.model"):
        load_base_model(ModelConfig(name=str(tmp_path / "falcon"), quantization="none"))
    assert not [r for r in caplog.records if r.name == "lora_ppo.model"]
    experts, _ = found["qwen3_moe"]
    # 2 layers x (gate_up [4, 64, 64] + down [4, 64, 32]) as the config gives them.
    assert experts == {f"model.layers.{i}.mlp.experts.{p}": n for i in range(2)
                       for p, n in (("gate_up_proj", 4 * 64 * 64), ("down_proj", 4 * 64 * 32))}
    _, falcon_linears = found["falcon"]
    assert len(falcon_linears) == 2 * 4 and all("transformer.h." in n for n in falcon_linears)
    assert found["llama"] == ({}, {})
