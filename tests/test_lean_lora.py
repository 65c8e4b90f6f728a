"""Every LoRA linear layer runs PEFT's arithmetic without PEFT's copy of the base output and, for a
power-of-two scale, without its multiply over the product (`fused_lora.lean_lora_forward`, always
on). Checked on CPU against PEFT's own forward on the same weights: the same numbers bit for bit,
forward and gradients, in float32 and bfloat16, on 4-bit and plain layers; the passes gone; and a
whole PPO run unchanged to the last bit."""

from __future__ import annotations

import json
from unittest.mock import patch

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lora_ppo
from lora_ppo.config import recipe_from_dict
from lora_ppo.roles import POLICY, REFERENCE, VALUE
from lora_ppo.fused_lora import pefts_forward
from tests.conftest import (adapter_tensors, deterministic_metrics, forward_and_grads, perturb_lora_b,
                            prompt_and_random_response, tiny_recipe_dict)


def both_ways(roles, tokenizer, role, checkpointing: bool):
    """`forward_and_grads` with PEFT's forward, then with lora_ppo's, on the same weights."""
    with roles.gradient_checkpointing(checkpointing):
        with pefts_forward(roles.peft):
            pefts = forward_and_grads(roles, tokenizer, role)
        return pefts, forward_and_grads(roles, tokenizer, role)


def assert_bit_for_bit(pefts, ours) -> None:
    (peft_hidden, peft_logprobs, peft_grads), (hidden, logprobs, grads) = pefts, ours
    assert torch.equal(hidden, peft_hidden) and torch.equal(logprobs, peft_logprobs)
    assert len(grads) == len(peft_grads)
    assert all(torch.equal(g, e) for g, e in zip(grads, peft_grads))


@pytest.mark.parametrize("alpha", [8, 6], ids=["scale-2", "scale-1.5"])
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("role", [POLICY, VALUE, REFERENCE])
def test_4bit_layers_give_pefts_numbers_bit_for_bit(make_roles, tiny_tokenizer, compute_dtype, alpha, role):
    """alpha 8 at rank 4: a scale of 2, folded into B's weight; 1.5 keeps PEFT's multiply. Each with
    gradient checkpointing (the forward run again inside the backward) and without."""
    adapters = {"r": 4, "alpha": alpha}
    roles = make_roles(seed=0, scale=0.5, compute_dtype=compute_dtype, policy=adapters, value=adapters)
    assert {m.scaling[POLICY] for m in roles.peft.modules() if hasattr(m, "lora_A")} == {alpha / 4}
    for checkpointing in (False, True):
        pefts, ours = both_ways(roles, tiny_tokenizer, role, checkpointing)
        assert_bit_for_bit(pefts, ours)
    if role != REFERENCE:  # the adapters change the numbers: the comparison covers them
        assert not torch.equal(ours[1], forward_and_grads(roles, tiny_tokenizer, REFERENCE)[1])
        assert len(ours[2]) > 0


def test_plain_layers_give_pefts_numbers_bit_for_bit(tiny_model_dir, tiny_tokenizer):
    """A model loaded without quantization: PEFT's plain `Linear`, which adds the float32 product to a
    bfloat16 output in float32 and casts the sum once."""
    from lora_ppo.config import AdaptersConfig, ModelConfig
    from lora_ppo.model import load_base_model
    from lora_ppo.roles import RoleModel

    base = load_base_model(ModelConfig(name=str(tiny_model_dir), quantization="none", compute_dtype="bfloat16"))
    roles = RoleModel(base, AdaptersConfig(policy={"r": 4, "alpha": 8}, value={"r": 4, "alpha": 8}))
    perturb_lora_b(roles, POLICY, 0, 0.5)
    assert not any("bnb" in type(m).__module__ for m in roles.peft.modules())
    assert_bit_for_bit(*both_ways(roles, tiny_tokenizer, POLICY, checkpointing=True))


class OpsInsideLoraLayers(TorchDispatchMode):
    """Counts the clones and multiplies computed inside LoRA layers' own forwards (their base layers
    excluded), with the largest tensor each multiply wrote."""

    def __init__(self, peft_model):
        super().__init__()
        from peft.tuners.lora import LoraLayer

        self.inside, self.clones, self.multiplies = [], 0, []

        def leave(*_) -> None:  # a forward hook that returned a value would replace the output
            self.inside.pop()

        self.handles = []
        for module in peft_model.modules():
            if isinstance(module, LoraLayer):
                self.handles += [module.register_forward_pre_hook(lambda *_: self.inside.append(True)),
                                 module.register_forward_hook(leave),
                                 module.base_layer.register_forward_pre_hook(lambda *_: self.inside.append(False)),
                                 module.base_layer.register_forward_hook(leave)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside and self.inside[-1]:
            if func is torch.ops.aten.clone.default:
                self.clones += 1
            elif func.overloadpacket is torch.ops.aten.mul:
                self.multiplies.append(out.numel())
        return out

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return super().__exit__(*exc)


def test_the_copy_and_the_products_multiply_are_gone(make_roles, tiny_tokenizer):
    """PEFT's 4-bit layers copy the base output and multiply the product (tokens x width) by the
    scale; lora_ppo's copy nothing and multiply only B's weight (rank x width)."""
    roles = make_roles(seed=0, scale=0.5, compute_dtype="float32")
    layers = [m for m in roles.peft.modules() if hasattr(m, "lora_A") and POLICY in m.lora_A]
    tokens = prompt_and_random_response(tiny_tokenizer, ["the film was", "a"], response_len=5)[0].numel()
    with pefts_forward(roles.peft), OpsInsideLoraLayers(roles.peft) as pefts:
        forward_and_grads(roles, tiny_tokenizer, POLICY)  # the inputs forward_and_grads makes, as above
    with OpsInsideLoraLayers(roles.peft) as ours:
        forward_and_grads(roles, tiny_tokenizer, POLICY)
    assert pefts.clones == len(layers) and ours.clones == 0
    assert sorted(pefts.multiplies) == sorted(tokens * m.out_features for m in layers)
    assert sorted(ours.multiplies) == sorted(m.lora_B[POLICY].weight.numel() for m in layers)


def test_a_ppo_run_is_pefts_to_the_last_bit(tmp_path, tiny_model_dir):
    """The tiny recipe's three steps (generation, scoring, updates with checkpointing) with PEFT's own
    forward and with lora_ppo's: every logged number and every trained weight equal."""
    from lora_ppo import fused_lora

    def run(name: str) -> tuple[list[dict], dict]:
        recipe = recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / name, train={"steps": 3},
                                                   model={"gradient_checkpointing": True}))
        lora_ppo.PPOTrainer(recipe, progress=False).train()
        return deterministic_metrics(tmp_path / name), adapter_tensors(tmp_path / name / "final" / "policy")

    ours = run("ours")
    with patch.object(fused_lora, "lean_lora_forward", lambda layer, x, *a, **k: fused_lora._pefts(layer, x, *a, **k)):
        pefts = run("pefts")
    assert json.dumps(ours[0]) == json.dumps(pefts[0])
    assert ours[1].keys() == pefts[1].keys() and all(torch.equal(ours[1][k], pefts[1][k]) for k in ours[1])
