"""`lora-ppo estimate`: the arithmetic on a hand-checked tiny config, how each phase scales with
the recipe, and the command's output and errors."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from lora_ppo import estimate as est
from lora_ppo.cli import app
from lora_ppo.config import recipe_from_dict
from tests.conftest import tiny_recipe_dict

runner = CliRunner()

# hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 KV heads, vocabulary 320, tied.
TINY = est.ModelShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=320,
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
    """One more sequence in the batch costs its KV cache (2 x layers x kv width x tokens x bytes),
    the step's logits and its prefill activations."""
    r = _recipe(data={"max_prompt_tokens": 10}, rollout={"max_new_tokens": 6})
    one = est.generate_bytes(TINY, r, 4, batch=1)
    two = est.generate_bytes(TINY, r, 4, batch=2)
    kv = 2 * 2 * 32 * 16 * 4
    logits = est.GEN_LOGIT_COPIES * 320 * 4
    prefill = 10 * (est.FWD_HIDDEN_TERMS * 64 + est.FWD_INTERMEDIATE_TERMS * 128) * 4
    assert two - one == pytest.approx(kv + logits + prefill)


def test_gradient_checkpointing_keeps_only_layer_inputs():
    r_off = _recipe(data={"max_prompt_tokens": 10}, rollout={"max_new_tokens": 6},
                    model={"gradient_checkpointing": False})
    r_on = _recipe(data={"max_prompt_tokens": 10}, rollout={"max_new_tokens": 6},
                   model={"gradient_checkpointing": True})
    tokens = 4 * 16
    per_layer = tokens * (est.ACT_HIDDEN_TERMS * 64 + est.ACT_INTERMEDIATE_TERMS * 128 + est.ACT_KV_TERMS * 32) * 4
    off, on = est.update_bytes(TINY, r_off, 4, rows=4), est.update_bytes(TINY, r_on, 4, rows=4)
    k = est.BACKWARD_FACTOR
    assert off - on == pytest.approx(k * 2 * per_layer - (2 * tokens * 64 * 4 + k * per_layer))


def test_dequantize_per_step_holds_every_linear_layer_unquantized():
    """Per pass, one dequantized weight at a time (the largest, 64x128); with
    model.dequantize_per_step all 73728 linear weights in the compute dtype, in every phase,
    and no CPU backward term for per-pass copies."""
    base = _recipe(data={"max_prompt_tokens": 10}, rollout={"max_new_tokens": 6})
    held = _recipe(data={"max_prompt_tokens": 10}, rollout={"max_new_tokens": 6}, model={"dequantize_per_step": True})
    extra = (73728 - 64 * 128) * 4
    assert est.generate_bytes(TINY, held, 4, 2) - est.generate_bytes(TINY, base, 4, 2) == pytest.approx(extra)
    assert est.score_bytes(TINY, held, 4, 2) - est.score_bytes(TINY, base, 4, 2) == pytest.approx(extra)
    slack = est.CPU_BACKWARD_SLACK["4bit"] * 73728 * 4
    cpu_gap = est.update_bytes(TINY, held, 4, 2, "cpu") - est.update_bytes(TINY, base, 4, 2, "cpu")
    assert cpu_gap == pytest.approx(extra - slack)
    assert est.update_bytes(TINY, held, 4, 2, "cuda") - est.update_bytes(TINY, base, 4, 2, "cuda") == pytest.approx(extra)


def test_largest_sizes_fit_and_one_more_does_not():
    r = _recipe()
    e = est.estimate(TINY, r, device="cuda", budget_gb=0.62)
    static = sum(e.components.values())
    n = e.largest["micro_batch_size"]
    grads = (8192 * 2 + 65) * 4
    assert n > 0
    assert static + grads + est.update_bytes(TINY, r, 2, n) <= 0.62e9 < static + grads + est.update_bytes(TINY, r, 2, n + 1)


def test_big_vocabulary_costs_one_chunk_not_the_whole_sequence():
    """Peak memory for the update grows with the vocabulary by one logits chunk only."""
    small = est.ModelShape(**{**TINY.__dict__, "vocab": 1000})
    large = est.ModelShape(**{**TINY.__dict__, "vocab": 151_000})
    r = _recipe(rollout={"max_new_tokens": 512, "batch_size": 8})
    extra = est.update_bytes(large, r, 2, 8) - est.update_bytes(small, r, 2, 8)
    assert extra == pytest.approx(est.LOGIT_COPIES_GRAD * est.DEFAULT_CHUNK_TOKENS * 150_000 * 4)


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
    (["--gpu-gb", "-3"], "--gpu-gb must be > 0"),
    (["model.name=/nonexistent/folder"], "model.name: folder not found"),
])
def test_estimate_bad_input_is_one_line_exit_2(tiny_model_dir, tmp_path, args, expected):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe_dict(tiny_model_dir, tmp_path / "out")))
    result = runner.invoke(app, ["estimate", str(recipe), *args])
    assert result.exit_code == 2
    assert expected in result.output and len(result.output.strip().splitlines()) == 1
