"""`lora-ppo estimate`: the arithmetic on a hand-checked tiny config, how each phase scales with
the recipe, the command's output and errors, and the parameter counts of every architecture it
knows against the models transformers builds and bitsandbytes quantizes (MoE experts included)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from lora_ppo import estimate as est
from lora_ppo.cli import app
from lora_ppo.config import recipe_from_dict
from lora_ppo.errors import RecipeError
from lora_ppo.model_shape import ModelShape
from tests.architectures import ARCHITECTURES, configs
from tests.conftest import tiny_recipe_dict

runner = CliRunner()

# hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 KV heads, vocabulary 320, tied.
TINY = ModelShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=320,
                      tied_embeddings=True)


def _recipe(**sections):
    return recipe_from_dict({"adapters": {"policy": {"r": 4}, "value": {"r": 4}, "reference": "disable"}, **sections})


def test_parameter_counts_by_hand():
    """Per layer: q 64x64, k and v 64x32, o 64x64, gate/up/down 64x128 each = 36864."""
    assert TINY.linear_params == 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192) == 73728
    # Tied embedding 320x64, plus 2 norms per layer and a final norm of 64.
    assert TINY.unquantized_params == 320 * 64 + 5 * 64 == 20800
    # LoRA r=4 on all seven linears: r * (in + out) each.
    per_layer = 4 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 128) * 2 + (128 + 64))
    assert TINY.lora_params(4, "all-linear") == 2 * per_layer == 8192
    assert TINY.lora_params(4, ["q_proj", "v_proj"]) == 2 * 4 * ((64 + 64) + (64 + 32))
    # Full names (what lora_ppo hands PEFT on an MoE model, and saves): one layer's module each.
    one_layer = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "model.layers.1.mlp.down_proj"]
    assert TINY.lora_params(4, one_layer) == 2 * 4 * (64 + 64) + 4 * (128 + 64)
    assert TINY.lora_params(4, ["q_proj", *one_layer]) == 2 * 4 * (64 + 64) + 4 * (128 + 64)


def test_a_reward_adapter_counts_what_its_saved_config_names(tmp_path):
    """PEFT 0.22 saves `all-linear` as every layer's full module name: a frozen reward adapter of
    r=8 on all of TINY's layers is 2 x 8192 LoRA parameters (see above) plus its head's 65."""
    import json

    names = [f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.k_proj",
             "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "target_modules": names}))
    recipe = _recipe(reward={"kind": "adapter", "adapter": str(tmp_path), "function": None})
    assert est._adapter_params(TINY, recipe) == (8192 * 2 + 65, 2 * 8192 + 65)


def test_static_components_by_hand():
    """4-bit with double quant: half a byte per weight plus 1/64 + 4/(64*256) absmax bytes; fp32
    on CPU for the rest; policy + value LoRA and the value head (65) train in fp32 with AdamW."""
    e = est.estimate(TINY, _recipe(), device="cpu")
    assert e.components["weights"] == pytest.approx(73728 * (0.5 + 1 / 64 + 4 / 16384) + 20800 * 4)
    trainable = 8192 * 2 + 65
    assert e.components["adapters"] == trainable * 4
    assert e.components["optimizer"] == trainable * 8
    assert e.components["runtime"] == est.RUNTIME_BYTES["cpu"]
    # Unquantized on GPU: bf16 everywhere (2 bytes per weight).
    none_gpu = est.estimate(TINY, _recipe(model={"quantization": "none"}), device="cuda")
    assert none_gpu.components["weights"] == (73728 + 20800) * 2


def test_kv_cache_and_logits_scale_with_the_generation_batch():
    """One more sequence of 10 + 6 tokens costs, in fp32 (4 bytes):
    its KV cache, 2 (K and V) x 2 layers x 32 (2 KV heads of 16) x 16 tokens x 4 = 8192 bytes;
    the step's logits, 3 copies x 320 vocabulary x 4 = 3840 bytes;
    its prefill activations, 10 prompt tokens x (4 x 64 hidden + 3 x 128 intermediate) x 4 = 25600 bytes."""
    r = _recipe(data={"max_prompt_tokens": 10}, rollout={"max_new_tokens": 6})
    one = est.generate_bytes(TINY, r, 4, batch=1)
    two = est.generate_bytes(TINY, r, 4, batch=2)
    assert two - one == pytest.approx(8192 + 3840 + 25600)


def test_gradient_checkpointing_keeps_only_layer_inputs():
    """A micro-batch of 4 rows x 16 tokens = 64 tokens. Per layer, the values kept for backward are
    64 x (10 x 64 hidden + 4 x 128 intermediate + 2 x 32 KV width) x 4 bytes = 311296 bytes, and
    backward doubles what is live. Without checkpointing: 2 x 2 layers x 311296 = 1245184 bytes.
    With it: the layer inputs (2 layers x 64 tokens x 64 hidden x 4 = 32768) plus one layer
    rebuilt at a time (2 x 311296 = 622592): 655360 bytes. The difference: 589824."""
    one_role = {"update_roles_together": False}
    r_off = _recipe(data={"max_prompt_tokens": 10}, rollout={"max_new_tokens": 6},
                    model={"gradient_checkpointing": False}, ppo=one_role)
    r_on = _recipe(data={"max_prompt_tokens": 10}, rollout={"max_new_tokens": 6},
                   model={"gradient_checkpointing": True}, ppo=one_role)
    off, on = est.update_bytes(TINY, r_off, 4, rows=4), est.update_bytes(TINY, r_on, 4, rows=4)
    assert off - on == pytest.approx(589824)


@pytest.mark.parametrize("estimator, extra", [("gae", 1245184), ("rloo", 0)])
def test_policy_and_value_updated_together_hold_both_copies(estimator, extra):
    """With a critic, ppo.update_roles_together runs the 4 rows twice (policy and value copies):
    without checkpointing 2 x 2 layers x 311296 bytes more, as above. RLOO has no value role."""
    def update(together):
        r = _recipe(data={"max_prompt_tokens": 10}, rollout={"max_new_tokens": 6, "samples_per_prompt": 2},
                    model={"gradient_checkpointing": False},
                    ppo={"update_roles_together": together, "advantage_estimator": estimator})
        return est.update_bytes(TINY, r, 4, rows=4)
    assert update(True) - update(False) == pytest.approx(extra)


def test_fused_lora_counts_no_float32_copies_in_16_bits():
    """bfloat16, 4 rows x 16 tokens = 64 tokens, checkpointing on, one role. A layer's values for the
    backward: 64 x (10 x 64 + 4 x 128 + 2 x 32) x 2 bytes = 155648; backward doubles them (311296) and
    `model.fused_lora` keeps 0.59x of that: 127631.36 bytes less. It holds the pass's adapter cast
    once to bfloat16 and its gradient: r 4 on q, k, v, o, gate, up, down of 2 layers is 2 x 4 x (128 +
    96 + 96 + 128 + 3 x 192) = 8192 parameters, 2 x 2 bytes each, 32768 bytes more (twice that with
    both roles in one pass; none with the compiled update, whose layers cast per call). Scoring 2 rows
    x 16 tokens: no float32 adapter terms, 32 x 2 x 128 intermediate x 2 bytes = 16384 bytes less. In
    float32 nothing changes."""
    def recipe(fused, **ppo):
        return _recipe(data={"max_prompt_tokens": 10}, rollout={"max_new_tokens": 6, "score_roles_together": False},
                       model={"gradient_checkpointing": True, "fused_lora": fused},
                       ppo={"update_roles_together": False, **ppo})
    peft, fused = recipe(False), recipe(True)
    saved = 311296 * 0.41
    assert est.update_bytes(TINY, peft, 2, 4) - est.update_bytes(TINY, fused, 2, 4) == pytest.approx(saved - 32768)
    together = recipe(False, update_roles_together=True), recipe(True, update_roles_together=True)
    assert est.update_bytes(TINY, together[0], 2, 4) - est.update_bytes(TINY, together[1], 2, 4) == \
        pytest.approx(2 * saved - 65536)
    compiled = recipe(False, compile_update=True), recipe(True, compile_update=True)
    assert est.update_bytes(TINY, compiled[0], 2, 4) - est.update_bytes(TINY, compiled[1], 2, 4) == pytest.approx(saved)
    assert est.score_bytes(TINY, peft, 2, 2) - est.score_bytes(TINY, fused, 2, 2) == pytest.approx(16384)
    assert est.update_bytes(TINY, peft, 4, 4) == est.update_bytes(TINY, fused, 4, 4)
    assert est.score_bytes(TINY, peft, 4, 2) == est.score_bytes(TINY, fused, 4, 2)


def test_packing_counts_the_gathered_hidden_states_and_no_more_tokens():
    """Packed micro-batches hold no more tokens than their rows at full width, so only each role's
    gathered hidden states that predict the response tokens are new: 4 rows x 6 response tokens x 64
    hidden x 2 bytes = 3072 bytes in bfloat16 (twice that with both roles in one pass)."""
    def recipe(packing, together=False):
        return _recipe(data={"max_prompt_tokens": 10}, rollout={"max_new_tokens": 6},
                       ppo={"packing": packing, "update_roles_together": together})
    assert est.update_bytes(TINY, recipe(True), 2, 4) - est.update_bytes(TINY, recipe(False), 2, 4) == 3072
    assert est.update_bytes(TINY, recipe(True, True), 2, 4) - est.update_bytes(TINY, recipe(False, True), 2, 4) == 6144
    assert est.update_bytes(TINY, recipe(True), 4, 4) - est.update_bytes(TINY, recipe(False), 4, 4) == 6144


def test_dequantize_per_step_holds_every_linear_layer_unquantized():
    """Per pass, one dequantized weight at a time (the largest, 64 x 128); with
    model.dequantize_per_step all 73728 linear weights in fp32, in every phase:
    (73728 - 8192) x 4 = 262144 bytes more. On CPU the per-pass copies that glibc keeps during
    backward (half the fp32 linear layers, 0.5 x 73728 x 4 = 147456 bytes) go away."""
    base = _recipe(data={"max_prompt_tokens": 10}, rollout={"max_new_tokens": 6})
    held = _recipe(data={"max_prompt_tokens": 10}, rollout={"max_new_tokens": 6}, model={"dequantize_per_step": True})
    assert est.generate_bytes(TINY, held, 4, 2) - est.generate_bytes(TINY, base, 4, 2) == pytest.approx(262144)
    assert est.score_bytes(TINY, held, 4, 2) - est.score_bytes(TINY, base, 4, 2) == pytest.approx(262144)
    cpu_gap = est.update_bytes(TINY, held, 4, 2, "cpu") - est.update_bytes(TINY, base, 4, 2, "cpu")
    assert cpu_gap == pytest.approx(262144 - 147456)
    assert est.update_bytes(TINY, held, 4, 2, "cuda") - est.update_bytes(TINY, base, 4, 2, "cuda") == pytest.approx(262144)


def test_compiled_generation_holds_a_static_kv_cache_in_every_phase():
    """rollout.compile: the KV cache is allocated for the batch rounded up to a power of two (3 ->
    4 rows) and stays through scoring and the update: 2 (K and V) x 2 layers x 32 x 4 rows x 16
    tokens x 4 bytes = 32768 bytes, where generate() holds 3 rows' 24576 while generating only."""
    def recipe(compile_setting, steps=400):
        return _recipe(data={"max_prompt_tokens": 10}, ppo={"num_minibatches": 1}, train={"steps": steps},
                       rollout={"max_new_tokens": 6, "batch_size": 3, "compile": compile_setting})

    off, on = est.estimate(TINY, recipe(False), device="cpu"), est.estimate(TINY, recipe(True), device="cpu")
    assert off.static_kv_cache == 0 and on.static_kv_cache == 32768
    assert on.phases["generate"] - off.phases["generate"] == 32768 - 24576
    assert on.phases["score"] - off.phases["score"] == on.phases["update"] - off.phases["update"] == 32768
    assert est.as_json(on)["static_kv_cache_gb"] == round(32768 / 1e9, 3)
    assert "the static KV cache, 0.00 GB, is held in every phase" in est.format_estimate(on, recipe(True), "cpu")
    # auto: on for a CUDA GPU (bf16 there: 2 bytes a value) when the run decodes 2,000 token steps
    # or more: 400 steps x 6 tokens, not 300 x 6.
    assert est.estimate(TINY, recipe("auto"), device="cpu").static_kv_cache == 0
    assert est.estimate(TINY, recipe("auto"), device="cuda").static_kv_cache == 16384
    assert est.estimate(TINY, recipe("auto", steps=300), device="cuda").static_kv_cache == 0


def test_a_batch_whose_static_cache_leaves_no_update_room_is_passed_over():
    """The 8B shape at 22 GB, compiled generation, no checkpointing: 128 rows generate within the
    budget, but their static KV cache (held through the update) leaves no micro-batch room; the
    suggestion is the largest batch that fits every phase, and it validates and fits."""
    llama_8b = ModelShape(4096, 14336, 32, 32, 8, 128, 128256, False)
    r = recipe_from_dict({"adapters": {"policy": {"r": 16}, "value": {"r": 16}}, "model": {"gradient_checkpointing": False},
                          "rollout": {"compile": True, "max_new_tokens": 256}, "data": {"max_prompt_tokens": 256}})
    e = est.estimate(llama_8b, r, device="cuda", budget_gb=22.0)
    room, act = 22e9 - sum(e.components.values()), 2
    assert est.generate_bytes(llama_8b, r, act, 128) <= room  # 128 rows generate
    assert est.static_kv_cache_bytes(llama_8b, r, act, 128, "cuda") + est.update_bytes(llama_8b, r, act, 1) > room
    assert e.fitting["rollout.batch_size"] == 64
    fitted = recipe_from_dict(r.model_dump(mode="json"), [f"{k}={v}" for k, v in e.fitting.items()])
    assert est.estimate(llama_8b, fitted, device="cuda", budget_gb=22.0).fits


@pytest.mark.parametrize("sections", [
    {},
    {"rollout": {"batch_size": 12, "samples_per_prompt": 3}, "ppo": {"num_minibatches": 2}},
    {"rollout": {"batch_size": 16}, "ppo": {"num_minibatches": 2, "grad_accum_steps": 4}},
])
@pytest.mark.parametrize("budget_gb", [0.62, 0.7, 2.0])
def test_fitting_sizes_are_a_recipe_that_validates_and_fits(sections, budget_gb):
    """What `estimate --gpu-gb` suggests, applied as overrides, validates and fits the budget, and
    the next larger valid batch would not fit."""
    e = est.estimate(TINY, _recipe(**sections), device="cuda", budget_gb=budget_gb)
    assert e.fitting, "something fits these budgets"
    # The phases below, counted as the estimate decided model.dequantize_per_step: auto.
    r = _recipe(**sections, model={"dequantize_per_step": e.dequantize_per_step})
    fitted = recipe_from_dict(r.model_dump(mode="json"), [f"{k}={v}" for k, v in e.fitting.items()])
    assert est.estimate(TINY, fitted, device="cuda", budget_gb=budget_gb).fits
    step = fitted.rollout.samples_per_prompt * fitted.ppo.num_minibatches * r.ppo.grad_accum_steps
    bigger = fitted.rollout.batch_size + step
    if bigger <= est.MAX_BATCH:
        static = sum(e.components.values())
        assert static + est.generate_bytes(TINY, r, 2, bigger) > budget_gb * 1e9 or all(
            static + (8192 * 2 + 65) * 4 + est.update_bytes(TINY, r, 2, micro) > budget_gb * 1e9
            for micro in range(1, bigger // fitted.ppo.num_minibatches + 1)
            if (bigger // fitted.ppo.num_minibatches) % micro == 0
        )


def test_dequantize_auto_holds_the_copy_only_where_it_takes_half_the_room_or_less():
    """`auto` as the estimate decides it: TINY's 73728 linear weights in fp16 (147456 bytes, in
    place of the one 64x128 weight a pass dequantizes without it: 16384) fit half of any budget
    beyond its weights; without a budget the plan stays lean; a model whose copy is 14 GB next to
    24 GB does not get one (the 8B case)."""
    tiny = est.estimate(TINY, _recipe(), device="cuda", budget_gb=1.0)
    assert tiny.dequantize_per_step
    assert tiny.phases["update"] - est.estimate(TINY, _recipe(model={"dequantize_per_step": False}), device="cuda",
                                                budget_gb=1.0).phases["update"] == pytest.approx(147456 - 16384)
    assert not est.estimate(TINY, _recipe(), device="cuda").dequantize_per_step
    big = ModelShape(4096, 14336, 32, 32, 8, 128, 128256, False)  # Llama-3.1-8B
    assert not est.estimate(big, _recipe(), device="cuda", budget_gb=24).dequantize_per_step
    assert not est.estimate(TINY, _recipe(model={"quantization": "8bit"}), device="cuda", budget_gb=1.0).dequantize_per_step


def test_nothing_fits_a_budget_below_the_resident_memory():
    assert est.estimate(TINY, _recipe(), device="cuda", budget_gb=0.1).fitting == {}


def test_big_vocabulary_costs_one_chunk_not_the_whole_sequence():
    """Peak memory for the update grows with the vocabulary by one logits chunk only: 5 fp32
    copies x 64 positions x 150000 more entries x 4 bytes = 192 MB, whatever the 512 new tokens."""
    small = ModelShape(**{**TINY.__dict__, "vocab": 1000})
    large = ModelShape(**{**TINY.__dict__, "vocab": 151_000})
    r = _recipe(rollout={"max_new_tokens": 512, "batch_size": 8})
    extra = est.update_bytes(large, r, 2, 8) - est.update_bytes(small, r, 2, 8)
    assert extra == pytest.approx(5 * 64 * 150_000 * 4)


def test_estimate_command_reads_a_local_config(tiny_model_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe_dict(tiny_model_dir, tmp_path / "out")))
    result = runner.invoke(app, ["estimate", str(recipe), "--gpu-gb", "12"])
    assert result.exit_code == 0, result.output
    assert "peak per phase" in result.output and "fits in 12 GB" in result.output
    result = runner.invoke(app, ["estimate", str(recipe), "--device", "cpu", "--json"])
    data = json.loads(result.output)
    assert set(data["phases_gb"]) == {"generate", "score", "update"}
    assert not (tmp_path / "out").exists()  # nothing written, no weights loaded


def test_estimate_says_when_it_does_not_fit(tiny_model_dir, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe_dict(tiny_model_dir, tmp_path / "out")))
    result = runner.invoke(app, ["estimate", str(recipe), "--gpu-gb", "0.1"])
    assert result.exit_code == 1 and "does NOT fit in 0.1 GB" in result.output


@pytest.mark.parametrize("args, expected", [
    (["--device", "tpu"], "--device must be cuda or cpu"),
    (["--gpu-gb", "-3"], "--gpu-gb must be a number of GB > 0, got -3"),
    # nan compared false with every size: "no batch size fits", exit 1, as if the card were too small
    (["--gpu-gb", "nan"], "--gpu-gb must be a number of GB > 0, got nan"),
    (["--gpu-gb", "inf"], "--gpu-gb must be a number of GB > 0, got inf"),
    (["model.name=/nonexistent/folder"], "model.name: folder not found"),
])
def test_estimate_bad_input_is_one_line_exit_2(tiny_model_dir, tmp_path, args, expected):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe_dict(tiny_model_dir, tmp_path / "out")))
    result = runner.invoke(app, ["estimate", str(recipe), *args])
    assert result.exit_code == 2
    assert expected in result.output and len(result.output.strip().splitlines()) == 1


def test_each_process_holds_the_model_and_its_share_of_the_rows():
    """With 4 processes a process generates and scores a quarter of the batch and updates at most
    its quarter of a minibatch per micro-batch; what stays resident is the same."""
    r = _recipe(rollout={"batch_size": 32, "forward_batch_size": 16}, ppo={"num_minibatches": 2, "grad_accum_steps": 2})
    one, four = est.estimate(TINY, r, device="cuda"), est.estimate(TINY, r, device="cuda", processes=4)
    assert four.components == one.components
    static = sum(one.components.values())
    assert four.phases["generate"] == static + est.generate_bytes(TINY, r, 2, 8)
    # rollout.compile (auto: on for cuda) holds the static KV cache of a process's 8 rows while scoring.
    assert four.phases["score"] == static + est.static_kv_cache_bytes(TINY, r, 2, 8, "cuda") + est.score_bytes(TINY, r, 2, 8)
    # minibatch 16, micro-batch 8: a process's share of a minibatch is 4 rows, in one micro-batch;
    # the KV cache it holds is its 8 rows' instead of 32.
    held = est.static_kv_cache_bytes(TINY, r, 2, 8, "cuda") - est.static_kv_cache_bytes(TINY, r, 2, 32, "cuda")
    assert four.phases["update"] - one.phases["update"] == held + est.update_bytes(TINY, r, 2, 4, "cuda") - est.update_bytes(
        TINY, r, 2, 8, "cuda")
    fitted = est.estimate(TINY, r, device="cuda", budget_gb=2.0, processes=4).fitting
    assert fitted["rollout.batch_size"] % (4 * 2) == 0  # splits over the processes and minibatches
    assert four.processes == 4 and est.as_json(four)["processes"] == 4


def test_estimate_refuses_a_batch_that_does_not_split(tiny_model_dir, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe_dict(tiny_model_dir, tmp_path / "out")))
    result = runner.invoke(app, ["estimate", str(path), "--num-processes", "3"])
    assert result.exit_code == 2
    assert "do not split over 3 processes" in result.output
    shared = runner.invoke(app, ["estimate", str(path), "--num-processes", "2"])
    assert shared.exit_code == 0 and "per process of 2" in shared.output and "batch 2," in shared.output


# Architectures: every count checked against what transformers builds and bitsandbytes loads.

# Qwen/Qwen3-30B-A3B's config.json (the hub's numbers; no weights needed).
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "intermediate_size": 6144, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "tie_word_embeddings": False,
}
MODEL_CONFIGS = Path(__file__).parents[1] / "bench" / "model_configs"
BENCH_CONFIGS = sorted(p.parent.name for p in MODEL_CONFIGS.glob("*/config.json"))


def _extra_configs() -> dict:
    """Variants the zoo lacks: shared experts with dense layers between MoE ones, Mixtral's experts,
    OPT's embedding projections, Falcon's new architecture and sequential norms, biases by flag."""
    import transformers as tf

    small = {"vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4}
    return {
        "qwen2_moe": tf.Qwen2MoeConfig(**small, num_key_value_heads=2, intermediate_size=128, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=48, decoder_sparse_step=2, mlp_only_layers=[3]),
        "mixtral": tf.MixtralConfig(**small, num_key_value_heads=2, intermediate_size=32, num_local_experts=4,
                                    num_experts_per_tok=2),
        "opt_projected": tf.OPTConfig(**small, ffn_dim=256, word_embed_proj_dim=32, max_position_embeddings=256),
        "falcon_new": tf.FalconConfig(**small, new_decoder_architecture=True, num_kv_heads=2, bias=True),
        "falcon_sequential": tf.FalconConfig(**small, parallel_attn=False, multi_query=False),
        "cohere_qk_norm": tf.CohereConfig(**small, num_key_value_heads=2, intermediate_size=128, use_qk_norm=True),
        "llama_biased": tf.LlamaConfig(**small, num_key_value_heads=2, intermediate_size=128, attention_bias=True,
                                       mlp_bias=True, tie_word_embeddings=False),
        "gpt_neox_unbiased": tf.GPTNeoXConfig(**small, intermediate_size=256, attention_bias=False),
    }


def _config(name: str):
    from transformers import AutoConfig, Qwen3MoeConfig

    if name in ARCHITECTURES:
        return configs(vocab=320)[name]
    if name in BENCH_CONFIGS:
        return AutoConfig.from_pretrained(MODEL_CONFIGS / name)
    if name == "qwen3-30b-a3b":
        return Qwen3MoeConfig(**{k: v for k, v in QWEN3_30B_A3B.items() if k != "model_type"})
    return _extra_configs()[name]


def _meta_model(config):
    """The model transformers builds from `config`, on the meta device (no memory, any size)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


EXTRA = ("qwen2_moe", "mixtral", "opt_projected", "falcon_new", "falcon_sequential", "cohere_qk_norm", "llama_biased",
         "gpt_neox_unbiased")


@pytest.mark.parametrize("name", [*ARCHITECTURES, *EXTRA, *BENCH_CONFIGS, "qwen3-30b-a3b"])
def test_parameter_count_matches_the_model_transformers_builds(name):
    """Every architecture the estimate counts, tiny and real-size: its total is the model's own
    (tied embeddings once), within 5%."""
    config = _config(name)
    real = sum(p.numel() for p in _meta_model(config).parameters())
    assert ModelShape.from_config(config).total_params == pytest.approx(real, rel=0.05)


@pytest.mark.parametrize("name", ["gpt2", "falcon", "qwen2", "qwen3_moe", "qwen2_moe"])
def test_quantized_split_matches_a_real_4bit_load(name, tmp_path):
    """Loaded in real NF4 on CPU: what bitsandbytes made Linear4bit is the estimate's quantized
    count, and the fused 3-D expert weights stay as they were. GPT-2's Conv1D layers are converted;
    Falcon's FalconLinear (an nn.Linear subclass) is not, so nothing of Falcon is quantized."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = _config(name)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=nf4, device_map="cpu")
    quantized = sum(m.weight.quant_state.shape.numel() for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))
    experts = sum(p.numel() for p in model.parameters() if p.ndim == 3)
    shape = ModelShape.from_config(config)
    assert shape.linear_params == quantized
    assert shape.unquantized_parts().get("moe_experts", 0) == experts
    assert (quantized == 0) == (name == "falcon") and (experts > 0) == name.endswith("_moe")


@pytest.mark.parametrize("name", [*ARCHITECTURES, "qwen2_moe", "opt_projected"])
def test_lora_parameters_match_peft(name):
    """`all-linear` LoRA as a run applies it: PEFT's all-linear, or on fused MoE experts the
    Linear layers' names (docs/models.md); r=4 on the meta-device model."""
    from peft import LoraConfig, get_peft_model

    from lora_ppo.roles import module_targets

    config = _config(name)
    model = _meta_model(config)
    with torch.device("meta"):
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=module_targets(model, "all-linear", "adapters.policy")))
    real = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    shape = ModelShape.from_config(config)
    assert shape.lora_params(4, "all-linear") == real
    # What a saved adapter_config.json names (full names on an MoE model) counts the same.
    assert shape.lora_params(4, peft_model.peft_config["default"].target_modules) == real


def test_lora_on_fused_experts_holds_one_pair_per_expert():
    """PEFT's target_parameters on Qwen3-MoE's experts: r x E rows for each of gate_up_proj
    [E, 2I, H] and down_proj [E, H, I], per MoE layer, on top of attention's."""
    from peft import LoraConfig, get_peft_model

    config = _config("qwen3_moe")  # 2 layers, 4 experts, I = 32, H = 64
    with torch.device("meta"):
        peft_model = get_peft_model(_meta_model(config), LoraConfig(
            r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    real = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
    shape = ModelShape.from_config(config)
    experts = 2 * 4 * 4 * ((64 + 64) + (64 + 32))
    assert shape.lora_params(4, "all-linear", ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]) == real
    assert real - shape.lora_params(4, "all-linear") == experts


def test_an_moe_is_not_said_to_fit_when_its_experts_do_not(tmp_path):
    """Qwen3-30B-A3B in "4-bit": its 29.0B expert parameters stay bf16 (58 GB), so a 24 GB card
    is far from enough; the answer names the experts and their size."""
    folder = tmp_path / "qwen3-30b-a3b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    experts = 48 * 128 * (2048 * 2 * 768 + 768 * 2048)
    recipe = recipe_from_dict({"model": {"name": str(folder), "quantization": "4bit"}})
    e = est.estimate_recipe(recipe, device="cuda", budget_gb=24)
    assert not e.fits and e.fitting == {}
    assert e.weight_parts["moe_experts"] == experts * 2
    assert e.components["weights"] > experts * 2 > 24e9
    text = est.format_estimate(e, recipe, "cuda")
    assert "does NOT fit in 24 GB" in text and f"MoE experts {experts * 2 / 1e9:.2f} GB" in text
    data = est.as_json(e)
    assert data["unquantized_params"]["moe_experts"] == experts and data["fits"] is False
    assert data["quantized_params"] == 48 * (2048 * 4096 * 2 + 2 * 2048 * 512)  # attention only
    # Activations see the experts a token goes through: 8 of 768 wide.
    assert e.shape.intermediate == 8 * 768


def test_estimate_command_names_what_stays_unquantized(tmp_path):
    folder = tmp_path / "qwen3-30b-a3b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"name": str(folder)}}))
    result = runner.invoke(app, ["estimate", str(recipe), "--gpu-gb", "24"])
    assert result.exit_code == 1, result.output
    assert "unquantized (bfloat16): MoE experts 57.98 GB" in result.output
    assert "bitsandbytes leaves fused MoE expert weights at bfloat16" in result.output


def test_an_architecture_it_cannot_count_is_one_line_naming_it(tmp_path):
    from transformers import BertConfig

    with pytest.raises(RecipeError, match="cannot count the parameters of model type 'bert'"):
        ModelShape.from_config(BertConfig())
    folder = tmp_path / "t5"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 64}))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"name": str(folder)}}))
    result = runner.invoke(app, ["estimate", str(recipe)])
    assert result.exit_code == 2
    assert "model type 't5'" in result.output and len(result.output.strip().splitlines()) == 1


def test_an_unlisted_dense_rmsnorm_decoder_is_counted_as_llama_and_says_so():
    from transformers import GemmaConfig

    config = GemmaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    shape = ModelShape.from_config(config)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert shape.approximate and abs(shape.total_params - real) / real < 0.05
    # An unlisted MoE is never guessed at: its experts could be most of the model.
    moe = GemmaConfig(**{**config.to_dict(), "num_experts": 8})
    with pytest.raises(RecipeError, match="model type 'gemma'"):
        ModelShape.from_config(moe)


def test_an_episode_budget_is_counted_as_the_sequence_after_the_prompt():
    """Episodes of up to 30 tokens after a 10-token prompt (rollout.max_episode_tokens) hold the
    KV cache of 10 + 30 tokens: one more episode costs 2 x 2 layers x 32 x 40 tokens x 4 = 20480
    bytes of cache, + 3840 of logits + 25600 of prefill; without a budget, 3 turns of 6 tokens count
    as 18 (2 x 2 x 32 x 28 x 4 = 14336)."""
    budget = _recipe(data={"max_prompt_tokens": 10},
                     rollout={"max_new_tokens": 6, "environment": "m:E", "max_turns": 3, "max_episode_tokens": 30})
    turns = _recipe(data={"max_prompt_tokens": 10}, rollout={"max_new_tokens": 6, "environment": "m:E", "max_turns": 3})
    for recipe, cache in ((budget, 20480), (turns, 14336)):
        one = est.generate_bytes(TINY, recipe, 4, batch=1)
        assert est.generate_bytes(TINY, recipe, 4, batch=2) - one == pytest.approx(cache + 3840 + 25600)
