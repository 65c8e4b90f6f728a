"""PEFT 0.22's renaming of transformers-4 MoE targets: skipped for targets that name the model's own
modules, kept for the leaf names an adapter trained on transformers 4 carries."""

from __future__ import annotations

import pytest
import torch

from tests.architectures import configs


conversion = pytest.importorskip("peft.utils.transformers_weight_conversion")  # PEFT 0.22 on


def _wrapped(name: str, targets, second=None, parameters=None) -> set[str]:
    """The modules LoRA wraps for `targets` on a tiny model of architecture `name` (meta device), or
    with `second`, for those targets in an adapter added after one on `targets`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from lora_ppo.peft_workarounds import targets_kept_as_named

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(configs(vocab=320)[name])
        with targets_kept_as_named():
            peft = get_peft_model(model, LoraConfig(r=4, target_modules=targets, target_parameters=parameters),
                                  adapter_name="first")
            if second is not None:
                peft.add_adapter("second", LoraConfig(r=4, target_modules=second))
    adapter = "first" if second is None else "second"
    return {n.split(".lora_A.")[0].removeprefix("base_model.model.") for n, _ in peft.named_parameters()
            if f".lora_A.{adapter}" in n}


def test_an_adapter_added_second_keeps_the_shared_expert_it_names():
    names = [f"model.layers.{i}.mlp.shared_expert.{m}" for i in range(2) for m in ("gate_proj", "up_proj", "down_proj")]
    assert _wrapped("qwen2_moe", names, second=names) == set(names)


@pytest.mark.parametrize("targets", [["q_proj", "down_proj"], ["model.layers.0.self_attn.q_proj", "down_proj"]])
def test_a_transformers_4_name_is_still_renamed_to_the_fused_experts(targets):
    """`down_proj` named every expert's down projection in transformers 4: PEFT 0.22 adapts the fused
    experts for it (one name the model lacks is enough for the whole config to be renamed)."""
    wrapped = _wrapped("qwen3_moe", targets)
    assert {f"model.layers.{i}.mlp.experts" for i in range(2)} <= {n.removesuffix(".base_layer") for n in wrapped}
    assert "model.layers.0.self_attn.q_proj" in wrapped


def test_an_adapter_of_expert_weights_alone_names_no_modules_and_loads():
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    wrapped = _wrapped("qwen3_moe", None, parameters=experts)
    assert {n.removesuffix(".base_layer") for n in wrapped} == {f"model.layers.{i}.mlp.experts" for i in range(2)}


def test_the_renaming_comes_back_afterwards():
    from lora_ppo.peft_workarounds import targets_kept_as_named

    before = conversion.convert_peft_config_for_transformers
    with pytest.raises(KeyError), targets_kept_as_named():
        assert conversion.convert_peft_config_for_transformers is not before
        raise KeyError("an adapter that failed to load")
    assert conversion.convert_peft_config_for_transformers is before
