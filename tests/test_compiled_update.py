"""ppo.compile_update: the update's decoder layers as one compiled function give eager's update (bit
for bit in bfloat16, where Inductor rounds each intermediate as eager does; within float32 rounding
in float32, where it sums in another order), compile once for a run whatever the sequence lengths,
and hand over to eager with one log line when they cannot compile.

Compiling takes seconds per graph on CPU: the tests keep to a few graphs each."""

from __future__ import annotations

import logging

import pytest
import torch

import lora_ppo
from lora_ppo.compiled_update import CompiledLayers
from lora_ppo.config import PPOConfig
from lora_ppo.fused_lora import fuse_lora_layers
from lora_ppo.roles import RoleModel
from lora_ppo.update import UpdateSettings, compute_advantages, ppo_update
from lora_ppo.memory import peak_live_cpu_bytes
from tests.conftest import (TIMING_PREFIXES, clip_counts_within_a_token, prompt_and_random_response, prompt_rows,
                            rollout_for_update, scored_rollout, tiny_recipe_dict)

def bf16_roles(make_roles) -> RoleModel:
    torch.manual_seed(0)  # LoRA A's random init: the same for every copy
    return make_roles(seed=1, scale=0.5, compute_dtype="bfloat16")


def updated(roles, rollout, compiled, checkpointing: bool = True,
            together: bool = False, packing: bool = False) -> tuple[dict, list[torch.Tensor]]:
    cfg = PPOConfig(num_epochs=2, num_minibatches=2, grad_accum_steps=2, learning_rate=1e-2)
    adv = compute_advantages(rollout, cfg, cfg.kl_coef, rollout.scores)
    optimizer = torch.optim.AdamW([{"params": roles.policy_parameters()}, {"params": roles.value_parameters()}],
                                  lr=cfg.learning_rate)
    settings = UpdateSettings(2, 1, 1.0, gradient_checkpointing=checkpointing, roles_together=together,
                              compiled_layers=compiled)
    roles.packing = packing
    stats = ppo_update(roles, optimizer, None, rollout, adv, cfg, settings, cfg.kl_coef,
                       torch.Generator().manual_seed(0))
    weights = [p.detach().clone() for p in roles.policy_parameters() + roles.value_parameters()]
    return vars(stats), weights


@pytest.mark.parametrize("checkpointing, together, fused, packing",
                         [((True, False), False, False, False), ((True,), True, False, False),
                          ((True,), False, True, False), ((True,), False, False, True)],
                         ids=["checkpointing-then-not", "roles-together", "fused-lora", "packing"])
def test_a_compiled_bfloat16_update_is_eagers_bit_for_bit(make_roles, tiny_tokenizer, checkpointing, together, fused,
                                                         packing):
    """Each layout of the update, compiled, against eager. Checkpointing is eager, around the compiled
    layer: an update without it runs on the graphs compiled with it (`checkpointing` in turn, on the
    same compiled layers)."""
    torch._dynamo.reset()  # graphs compiled by an earlier test would be reused, and not counted here
    compiled = CompiledLayers()
    for each in checkpointing:
        eager_roles, compiled_roles = bf16_roles(make_roles), bf16_roles(make_roles)
        if fused:  # model.fused_lora: its layers compile too
            fuse_lora_layers(eager_roles.peft)
            fuse_lora_layers(compiled_roles.peft)
        rollout = rollout_for_update(eager_roles, tiny_tokenizer)
        eager_stats, eager_weights = updated(eager_roles, rollout, None, each, together, packing)
        compiled_stats, compiled_weights = updated(compiled_roles, rollout, compiled, each, together, packing)
        assert compiled.disabled is None
        # One graph per pass (a role, or both together), the first layer's included, whatever the
        # micro-batches' widths. The first micro-batch, trimmed, is 16 tokens wide, as wide as an attention
        # head: Dynamo's duck shaping gave that width graphs of its own (8 here, where the first layer
        # compiled apart too).
        assert compiled.graphs == (1 if together else 2)
        assert compiled_stats == eager_stats  # losses, ratios, entropy, grad norms, the logprob self-check
        for eager, compiled_weight in zip(eager_weights, compiled_weights):
            assert torch.equal(eager, compiled_weight)


def test_the_compiled_update_holds_no_more_memory_than_eagers(make_roles, tiny_tokenizer):
    """`auto` sizes micro-batches from eager's memory (`lora-ppo estimate`), so the compiled layers
    must not hold more: compiled with the checkpoint inside, one layer's recomputation held half as
    much again as eager's (bench/README.md) and ran out of memory where eager fit on the device."""
    prompts = ["This movie was", "The acting in this film", "Honestly", "I"]
    ids, mask, start = prompt_and_random_response(tiny_tokenizer, prompts, 96)
    eager_roles, compiled_roles = bf16_roles(make_roles), bf16_roles(make_roles)
    rollout = scored_rollout(eager_roles, ids, mask, start, prompt_rows(tiny_tokenizer, prompts))
    compiled = CompiledLayers()
    updated(compiled_roles, rollout, compiled)  # compiles (its own allocations are not the update's)
    eager_peak = peak_live_cpu_bytes(lambda: updated(eager_roles, rollout, None))
    compiled_peak = peak_live_cpu_bytes(lambda: updated(compiled_roles, rollout, compiled))
    assert compiled.disabled is None
    assert compiled_peak <= 1.02 * eager_peak, (compiled_peak, eager_peak)


def test_a_run_with_the_update_compiled_trains_as_one_without_and_compiles_once(tmp_path, tiny_model_dir):
    runs, widths = {}, set()
    for setting in (False, True):
        recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(
            tiny_model_dir, tmp_path / f"compile-{setting}", ppo={"compile_update": setting},
            train={"steps": 3, "eval": False}))
        trainer = lora_ppo.PPOTrainer(recipe, progress=False)
        runs[setting] = []
        for _ in range(3):
            metrics, rollout = trainer.train_step()
            runs[setting].append(metrics)
            widths.add(rollout.input_ids.shape[1])
    assert len(widths) > 1  # the steps' sequence lengths differ: the graphs serve them all
    for plain, compiled in zip(runs[False], runs[True]):
        # (the self-check's differences are rounding themselves: held to their bound below)
        same = {k: v for k, v in plain.items() if not k.startswith((*TIMING_PREFIXES, "check/logprob"))}
        assert set(same) <= set(compiled)
        same = clip_counts_within_a_token(compiled, same)
        # In float32 Inductor sums a norm's squares in another order than eager: ~1e-7 of a value per
        # operation, 3e-6 of the gradient norm after one update, and no more than 1e-4 after three.
        assert {k: compiled[k] for k in same} == pytest.approx(same, rel=1e-4, abs=1e-6)
        assert compiled["check/logprob_max_diff"] < 1e-5 and plain["check/logprob_max_diff"] < 1e-5
    graphs = [metrics["update/compiled_graphs"] for metrics in runs[True]]
    compile_s = [metrics["time/compile"] for metrics in runs[True]]
    assert graphs[0] == 2 and graphs[2] == graphs[1] == graphs[0]
    assert compile_s[0] > 0 and compile_s[2] == compile_s[1] == compile_s[0]
    assert compile_s[2] == trainer.update_settings.compiled_layers.compile_s  # the update's compiling, alone


def test_layers_that_cannot_compile_run_eager_with_one_log_line(make_roles, tiny_tokenizer, caplog):
    eager_roles, fallback_roles = bf16_roles(make_roles), bf16_roles(make_roles)
    rollout = rollout_for_update(eager_roles, tiny_tokenizer)
    failing = CompiledLayers()
    calls = []

    def cannot_compile(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("inductor: no C++ compiler found\nmore detail")

    failing._forward = cannot_compile
    with caplog.at_level(logging.WARNING, logger="lora_ppo.compiled_update"):
        fallback_stats, fallback_weights = updated(fallback_roles, rollout, failing)
    eager_stats, eager_weights = updated(eager_roles, rollout, None)
    assert fallback_stats == eager_stats and all(torch.equal(a, b) for a, b in zip(fallback_weights, eager_weights))
    assert calls == [1] and failing.disabled == "RuntimeError: inductor: no C++ compiler found"
    assert [r.getMessage() for r in caplog.records] == [
        "update: the compiled decoder layers cannot run here (RuntimeError: inductor: no C++ compiler found); "
        "eager from now on"]


@pytest.mark.parametrize("setting", [True, False])
def test_the_recipe_switch_makes_the_compiled_step(tmp_path, tiny_model_dir, setting):
    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / "run",
                                                        ppo={"compile_update": setting}))
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    assert isinstance(trainer.update_settings.compiled_layers, CompiledLayers) == setting
