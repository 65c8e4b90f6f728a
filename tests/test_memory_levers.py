"""The memory levers for the largest model per card: the embeddings in CPU memory, a quantized LM
head, AdamW's moments in 8 bits or in CPU memory. Each keeps what a step computes (or stays within
its stated error), resumes exactly, and is refused with one line where it cannot work."""

from __future__ import annotations

import types

import pytest
import torch

import lora_ppo
from lora_ppo import estimate as est
from lora_ppo import optimizers
from lora_ppo.config import ModelConfig, recipe_from_dict
from lora_ppo.errors import RecipeError
from lora_ppo.model import CpuEmbedding, embeddings_on_device, load_base_model
from lora_ppo.model_shape import ModelShape
from tests.conftest import deterministic_metrics, tiny_recipe_dict


def _model(folder, **settings):
    return load_base_model(ModelConfig(name=str(folder), quantization="4bit", **settings))


IDS = torch.tensor([[0, 5, 17, 33, 2, 9, 101, 64]])


# ---- the embeddings in CPU memory -------------------------------------------------------------


def test_embeddings_looked_up_on_the_cpu_give_the_same_hidden_states(tiny_untied_model_dir):
    plain, offloaded = _model(tiny_untied_model_dir), _model(tiny_untied_model_dir, offload_embeddings=True)
    embedding = offloaded.get_input_embeddings()
    assert isinstance(embedding, CpuEmbedding) and embedding.weight.device.type == "cpu"
    # The table is outside the model's parameters: nothing moves it, and the model's device (the
    # first parameter's, where transformers sends inputs) is the layers'.
    assert all(p is not embedding.weight for p in offloaded.parameters())
    assert torch.equal(embedding.weight, plain.get_input_embeddings().weight)
    # What transformers asks of an embedding (resizing, a model card's sizes) is the table's.
    assert (embedding.num_embeddings, embedding.embedding_dim) == tuple(embedding.weight.shape) == (320, 64)
    assert embedding.staged_for_generation is False  # no copy on the device until the memory plan says
    with torch.no_grad():
        same = offloaded.model(input_ids=IDS).last_hidden_state
        expected = plain.model(input_ids=IDS).last_hidden_state
    assert torch.equal(same, expected)


def test_generation_looks_tokens_up_in_a_copy_taken_on_entry_and_let_go_after(tiny_untied_model_dir):
    """Where the plan stages the table (`staged_for_generation`), generation's lookups read a copy
    taken as it starts (on a GPU: no wait for each token to reach the host); outside, the table."""
    plain, offloaded = _model(tiny_untied_model_dir), _model(tiny_untied_model_dir, offload_embeddings=True)
    embedding = offloaded.get_input_embeddings()
    embedding.staged_for_generation = True
    with torch.no_grad():
        expected = plain.model(input_ids=IDS).last_hidden_state
        with embeddings_on_device(offloaded):
            embedding.weight.add_(1.0)  # the table changes after the copy was taken: the copy is read
            staged = offloaded.model(input_ids=IDS).last_hidden_state
            with embeddings_on_device(offloaded):  # nested (an episode's turn): the same copy
                nested = offloaded.model(input_ids=IDS).last_hidden_state
        after = offloaded.model(input_ids=IDS).last_hidden_state
    assert torch.equal(staged, expected) and torch.equal(nested, expected)
    assert embedding._staged is None and not torch.equal(after, expected)
    embedding.staged_for_generation = False  # where the plan has no room: the table, always
    with torch.no_grad(), embeddings_on_device(offloaded):
        assert torch.equal(offloaded.model(input_ids=IDS).last_hidden_state, after)


def test_a_run_stages_the_table_for_generation_as_the_plan_says_and_logs_it(tiny_untied_model_dir, caplog):
    """The run asks the memory plan once, after loading: 16 rows scored 8 at a time leave generation
    room for the copy; 64 rows generated, scored one at a time, make generation the peak already.
    (The device is faked: staging is decided for a GPU, and nothing here touches one.)"""
    from lora_ppo.sizing import stage_embeddings_as_planned

    model = _model(tiny_untied_model_dir, offload_embeddings=True)
    embedding = model.get_input_embeddings()
    embedding.out_device = torch.device("cuda")
    short = {"rollout": {"batch_size": 16, "forward_batch_size": 8}}
    long = {"rollout": {"batch_size": 64, "forward_batch_size": 1}, "ppo": {"grad_accum_steps": 8}}
    for sections, staged, said in ((short, True, "in a copy of the table on the GPU"),
                                   (long, False, "in CPU memory (a 0.00 GB copy on the GPU would take")):
        recipe = recipe_from_dict({"model": {"name": str(tiny_untied_model_dir), "offload_embeddings": True},
                                   "adapters": {"policy": {"r": 4}, "value": {"r": 4}, "reference": "disable"},
                                   **sections})
        caplog.clear()
        with caplog.at_level("INFO", logger="lora_ppo.sizing"):
            stage_embeddings_as_planned(model, recipe)
        assert embedding.staged_for_generation is staged
        assert [r.getMessage() for r in caplog.records if said in r.getMessage()]


def test_levers_that_need_their_own_lm_head_are_refused_for_tied_embeddings(tiny_model_dir):
    for lever in ("offload_embeddings", "quantize_lm_head"):
        with pytest.raises(RecipeError, match=rf"model.{lever}: .* ties its embeddings to the LM head"):
            _model(tiny_model_dir, **{lever: True})


@pytest.mark.parametrize("top, text, tied", [
    ({"tie_word_embeddings": False}, {"tie_word_embeddings": True}, True),  # a composite config: its text model ties
    ({"tie_word_embeddings": True}, {"tie_word_embeddings": False}, True),
    ({}, {"tie_word_embeddings": False}, False),  # a config that does not say: not tied
    ({"tie_word_embeddings": False}, {}, False),
])
def test_tied_embeddings_are_read_from_the_config_or_its_text_config(monkeypatch, top, text, tied):
    from lora_ppo import model as model_module

    config = types.SimpleNamespace(**top, get_text_config=lambda: types.SimpleNamespace(**text))
    monkeypatch.setattr(model_module, "model_config", lambda cfg: config)
    check = lambda: model_module._check_tied_levers(ModelConfig(offload_embeddings=True))  # noqa: E731
    if tied:
        with pytest.raises(RecipeError, match="ties its embeddings to the LM head"):
            check()
    else:
        check()


def test_a_model_that_cannot_be_read_is_one_line_with_the_levers_on(tmp_path):
    """The levers read the model's config before the weights load: a wrong model.name is the same
    RecipeError as without them, not the library's OSError."""
    with pytest.raises(RecipeError, match="^model.name: "):
        _model(tmp_path, offload_embeddings=True)  # a folder without a config.json


def test_offloaded_embeddings_compile_as_the_device_decides_and_the_cache_is_counted():
    """The decode step compiles with the lookups on the CPU (8B: 531 tokens/s on an H200, 139 eager
    on an H100); its static KV cache is then held through every phase, and counted."""
    offloaded = _estimate(model={"offload_embeddings": True}, train={"steps": 1000})
    # K and V x 2 layers x kv width 32 x 16 rows x (64 + 24) tokens x bfloat16
    assert offloaded.static_kv_cache == 2 * 2 * 32 * 16 * (64 + 24) * 2
    assert offloaded.static_kv_cache == _estimate(train={"steps": 1000}).static_kv_cache
    assert _estimate(model={"offload_embeddings": True}, rollout={"compile": False}).static_kv_cache == 0


# ---- a quantized LM head ----------------------------------------------------------------------


def test_a_4bit_lm_head_gives_the_logits_of_its_dequantized_weight(tiny_untied_model_dir):
    from bitsandbytes.functional import dequantize_4bit

    plain, quantized = _model(tiny_untied_model_dir), _model(tiny_untied_model_dir, quantize_lm_head=True)
    head = quantized.get_output_embeddings()
    assert type(head).__name__ == "Linear4bit"
    weight = dequantize_4bit(head.weight.data, head.weight.quant_state).float()  # [V, H]
    with torch.no_grad():
        hidden = quantized.model(input_ids=IDS).last_hidden_state
        logits = quantized(input_ids=IDS).logits
        exact = plain.lm_head.weight.float()
        plain_logits = hidden @ exact.T
    # The model's own logits are its dequantized head's (by hand, a plain matmul) ...
    assert torch.allclose(logits, hidden @ weight.T, atol=1e-5, rtol=1e-5)
    # ... and differ from the unquantized head's by no more than NF4 rounding allows: each weight
    # is within half the widest gap between NF4 levels (0.3038 / 2) times its block's absmax.
    nf4_levels = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                               -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                               0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                               0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])
    half_gap = float((nf4_levels[1:] - nf4_levels[:-1]).max() / 2)
    absmax = exact.reshape(-1, 64).abs().amax(dim=1, keepdim=True).expand(-1, 64).reshape(exact.shape)
    bound = hidden.abs() @ (half_gap * absmax * 1.01).T  # 1% for the 8-bit absmax of double quantization
    assert ((logits - plain_logits).abs() <= bound).all()


# ---- AdamW's moments --------------------------------------------------------------------------


def _trained(folder, tmp_path, name, **ppo):
    recipe = recipe_from_dict(tiny_recipe_dict(folder, tmp_path / name, train={"steps": 3, "eval": False},
                                               ppo={"lr_schedule": "linear", **ppo}))
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    before = [p.detach().clone() for p in trainer.roles.policy_parameters() + trainer.roles.value_parameters()]
    for _ in range(3):
        trainer.train_step()
    after = [p.detach().clone() for p in trainer.roles.policy_parameters() + trainer.roles.value_parameters()]
    return trainer, before, after


def test_cpu_held_moments_step_exactly_as_device_moments(tmp_path, tiny_model_dir):
    """On this CPU machine both run torch's AdamW on the same numbers: the copies, the lr schedule
    reaching the host optimizer, and the moments kept between steps must leave the weights equal."""
    cpu, _, cpu_after = _trained(tiny_model_dir, tmp_path, "cpu", optimizer_state="cpu")
    _, _, device_after = _trained(tiny_model_dir, tmp_path, "device")
    assert isinstance(cpu.parts.optimizer, optimizers.CpuAdamW)
    assert all(torch.equal(a, b) for a, b in zip(cpu_after, device_after))
    state = cpu.parts.optimizer.state_dict()["state"]
    assert len(state) == len(cpu_after) and all(s["exp_avg"].device.type == "cpu" for s in state.values())


def test_8bit_moments_train_within_their_rounding_of_fp32_moments(tmp_path, tiny_model_dir, monkeypatch):
    """Every tiny tensor made 8-bit (bitsandbytes keeps small ones 32-bit by default). Blockwise
    8-bit moments carry about 1% relative error, so three steps move the adapters within 10% of
    the fp32 moments' move, and not exactly as they do."""
    monkeypatch.setattr(optimizers, "MIN_8BIT_SIZE", 1)
    eight, before, eight_after = _trained(tiny_model_dir, tmp_path, "8bit", optimizer_state="8bit")
    _, _, fp32_after = _trained(tiny_model_dir, tmp_path, "fp32")
    states = [s for s in eight.parts.optimizer.state.values() if "state1" in s]
    assert states and all(s["state1"].dtype == torch.uint8 for s in states)
    moved_8 = torch.cat([(a - b).flatten() for a, b in zip(eight_after, before)])
    moved_32 = torch.cat([(a - b).flatten() for a, b in zip(fp32_after, before)])
    relative = float((moved_8 - moved_32).norm() / moved_32.norm())
    assert 0 < relative < 0.1


@pytest.mark.parametrize("levers", [
    {"model": {"offload_embeddings": True, "quantize_lm_head": True}, "ppo": {"optimizer_state": "8bit"}},
    {"ppo": {"optimizer_state": "cpu"}},
    {"ppo": {"packing": True, "grad_accum_steps": 2}},  # a speed lever (docs/performance.md), resumed as exactly
])
def test_resume_is_exact_with_the_levers_on(tmp_path, tiny_untied_model_dir, levers, monkeypatch):
    monkeypatch.setattr(optimizers, "MIN_8BIT_SIZE", 1)  # the tiny adapters' moments really in 8 bits
    sections = {name: dict(values) for name, values in levers.items()}
    sections.setdefault("ppo", {})["num_epochs"] = 2

    def run(name, steps, resume=None):
        recipe = recipe_from_dict(tiny_recipe_dict(tiny_untied_model_dir, tmp_path / name,
                                                   train={"steps": steps, "save_every": 1, "eval": False},
                                                   **{k: {**v} for k, v in sections.items()}))
        trainer = lora_ppo.PPOTrainer(recipe, progress=False, resume=resume)
        trainer.train()
        return trainer

    whole = run("whole", 3)
    run("parts", 2)
    resumed = run("parts", 3, resume=tmp_path / "parts" / "checkpoints" / "step-1")
    assert deterministic_metrics(tmp_path / "parts")[-1] == deterministic_metrics(tmp_path / "whole")[-1]
    for a, b in zip(resumed.roles.policy_parameters(), whole.roles.policy_parameters()):
        assert torch.equal(a, b)


# ---- what the estimate counts -----------------------------------------------------------------

# hidden 64, intermediate 128, 2 layers, vocabulary 320, an LM head of its own.
UNTIED = ModelShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=320,
                        tied_embeddings=False)


def _estimate(**sections):
    recipe = recipe_from_dict({"adapters": {"policy": {"r": 4}, "value": {"r": 4}, "reference": "disable"}, **sections})
    return est.estimate(UNTIED, recipe, device="cuda")


def test_the_estimate_counts_each_lever_by_hand():
    base = _estimate()
    table = 320 * 64 * 2  # bf16 on a GPU
    offloaded = _estimate(model={"offload_embeddings": True})
    assert base.components["weights"] - offloaded.components["weights"] == table
    assert offloaded.host == {"embeddings": table}
    # The 4-bit head: NF4 with double quantization per weight; while its matmul runs it is
    # dequantized whole (320 x 64 bf16), more than the largest linear layer (64 x 128).
    head = _estimate(model={"quantize_lm_head": True})
    assert base.components["weights"] - head.components["weights"] == pytest.approx(
        table - 320 * 64 * (0.5 + 1 / 64 + 4 / (64 * 256)))
    assert head.phases["score"] - head.components["weights"] - (base.phases["score"] - base.components["weights"]) \
        == pytest.approx((320 * 64 - 64 * 128) * 2)
    # AdamW: 8 bytes a trainable weight on the device; none there when held on the CPU (16 bytes a
    # weight in CPU memory: moments and the weight and gradient copies); in 8 bits, tensors under
    # 4,096 elements (all of the tiny ones) stay 32-bit.
    trainable = 8192 * 2 + 65
    assert base.components["optimizer"] == trainable * 8
    on_cpu = _estimate(ppo={"optimizer_state": "cpu"})
    assert on_cpu.components["optimizer"] == 0 and on_cpu.host == {"optimizer": trainable * 16}
    assert _estimate(ppo={"optimizer_state": "8bit"}).components["optimizer"] == trainable * 8


def test_generation_stages_the_table_only_where_its_peak_stays_under_the_others():
    """With the table in CPU memory, generation looks tokens up in a copy on the GPU where that
    keeps generation's peak at or under scoring's and the update's: then generation holds what it
    holds with the table on the device, and the plan's peak is unchanged by the copy."""
    short = {"rollout": {"batch_size": 16, "forward_batch_size": 8}}
    on_device, staged = _estimate(**short), _estimate(**short, model={"offload_embeddings": True})
    assert staged.embeddings_staged and staged.phases["generate"] == on_device.phases["generate"]
    assert on_device.phases["update"] - staged.phases["update"] == 320 * 64 * 2
    assert staged.peak == max(staged.phases["score"], staged.phases["update"])
    # 64 rows generated, one scored at a time, micro-batches of 8: generation is the peak already.
    long = {"rollout": {"batch_size": 64, "forward_batch_size": 1}, "ppo": {"grad_accum_steps": 8}}
    on_device, host = _estimate(**long), _estimate(**long, model={"offload_embeddings": True})
    assert not host.embeddings_staged
    assert on_device.phases["generate"] - host.phases["generate"] == 320 * 64 * 2 and host.peak == host.phases["generate"]


def test_8bit_moments_by_hand_for_a_large_adapter():
    """Llama-3.1-8B, r=16 on all linear layers: every LoRA tensor has more than 4,096 elements,
    each moment 1 byte a weight plus an fp32 absmax per 256 and a 256-entry fp32 code."""
    llama = ModelShape(4096, 14336, 32, 32, 8, 128, 128256, False)
    recipe = recipe_from_dict({"ppo": {"optimizer_state": "8bit"}})
    tensors = est.trainable_tensors(llama, recipe)
    expected = sum(count * (2 * n + 2 * 4 * -(-n // 256) + 2 * 1024) if n >= 4096 else count * 8 * n
                   for n, count in tensors)
    e = est.estimate(llama, recipe, device="cuda")
    assert e.components["optimizer"] == pytest.approx(expected)
    assert e.components["optimizer"] < est.estimate(llama, recipe_from_dict({}), device="cuda").components["optimizer"] / 3.8


def test_the_32b_recipe_fits_24_gb_and_the_estimate_names_the_levers_it_needs():
    recipe = lora_ppo.load_recipe("recipes/single_gpu_32b.yaml", ["model.name=bench/model_configs/qwen2.5-32b"])
    e = est.estimate_recipe(recipe, device="cuda", budget_gb=24)
    assert e.fits and e.peak <= 24e9
    bare = lora_ppo.load_recipe("recipes/single_gpu_32b.yaml", [
        "model.name=bench/model_configs/qwen2.5-32b", "model.offload_embeddings=false", "ppo.optimizer_state=device"])
    without = est.estimate_recipe(bare, device="cuda", budget_gb=24)
    assert not without.fits and not without.fitting
    assert without.levers and est.estimate_recipe(bare.with_values(without.levers), device="cuda", budget_gb=24).fits


def test_a_dequantization_budget_is_counted_as_the_budget_and_one_layer_outside_it():
    full = _estimate(model={"dequantize_per_step": True})
    partial = _estimate(model={"dequantize_per_step": True, "dequantize_budget_gb": 50e3 / 1e9})
    off = _estimate(model={"dequantize_per_step": False})
    largest = 64 * 128 * 2  # the one layer dequantized for a pass (bf16)
    assert full.phases["update"] - off.phases["update"] == pytest.approx(73728 * 2 - largest)
    assert partial.phases["update"] - off.phases["update"] == pytest.approx(50e3)
    with pytest.raises(RecipeError, match=r"model.dequantize_budget_gb \(2\) needs dequantize_per_step true or auto"):
        recipe_from_dict({"model": {"dequantize_per_step": False, "dequantize_budget_gb": 2}})
