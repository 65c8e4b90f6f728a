"""The device benchmarks (bench/gpu_step.py, bench/gpu_memory_check.py) run end to end on CPU with a
tiny model of the 8B config's architecture: device time is scarce (minutes per session), so a
script that breaks must break here, not on the GPU. Each writes the JSON its bench/README.md
section reads, and every part of it ran (a part that raises is recorded as an error)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lora_ppo.alarms import LOGPROB_TOLERANCE

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 2048}
SIZES = ["rollout.max_new_tokens=8", "data.max_prompt_tokens=32"]


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    """Llama-3.1-8B's config (what the device runs build) at a tiny size."""
    sys.path.insert(0, str(REPO / "bench"))
    from random_models import resized_config

    return resized_config(SHAPE, tmp_path_factory.mktemp("tiny-8b-config"))


def run_script(script: str, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_gpu_step_writes_every_part(tiny_config, tmp_path):
    out = tmp_path / "gpu_step.json"
    run_script("gpu_step.py", "--config", str(tiny_config), "--gpu-gb", "4", "--work", str(tmp_path / "work"),
               "--out", str(out), *SIZES, "rollout.compile=true", "ppo.grad_accum_steps=4")
    (budget,) = json.loads(out.read_text())["budgets"]
    assert len(budget["steps"]) == 2 and all(s["time/step"] > 0 and "perf/update_tflops" in s for s in budget["steps"])
    assert set(budget["auto"]) >= {"micro_batch", "rollout.forward_batch_size", "model.gradient_checkpointing"}
    assert budget["plan_budget_gb"] > 0  # what the `auto` sizes were planned for (on CPU: memory available)
    for part in ("kl_check", "update_variants", "profile", "generation_profile", "static_cache"):
        assert "error" not in budget[part], (part, budget[part])
    variants = budget["update_variants"]
    assert 0 <= budget["steps"][-1]["update/padding_frac"] < 1
    assert variants["compile_update_compiling"]["time/compile"] > 0 and "time/update" in variants["compile_update"]
    assert variants["compile_update_compiling"]["update/compiled_graphs"] == 2  # policy, value
    assert list(variants)[0] == "compile_update_compiling"  # the one most wanted, first
    assert "time/update" in variants["auto_again"]  # the control, after the settings
    # model.fused_lora in the update alone, every LoRA layer of the 2-layer model (7 per layer, policy
    # and value on the same modules): in float32 its logprobs are scoring's (PEFT's path) within rounding
    assert list(variants).index("fused_lora") < list(variants).index("auto_again")
    assert variants["fused_lora_micro_batch_double"]["micro_batch"] == 2 * variants["fused_lora"]["micro_batch"]
    fused = variants["fused_lora"]
    assert fused["fused_layers"] == 14 and "time/update" in fused
    assert variants["fused_lora_cast_per_call"]["fused_layers"] == 14  # the same layers, casting per call
    assert fused["check/logprob_mean_diff"] <= LOGPROB_TOLERANCE["float32"]
    # Trimming on, packing, and neither over the same responses cut at random lengths: the padding each
    # skips (4 micro-batches a minibatch, rows ordered by length first; packed, rows back to back).
    on, packed, off = (variants[f"ragged_{name}"] for name in ("trim_padding_on", "packing", "trim_padding_off"))
    assert 0 <= packed["update/padding_frac"] < on["update/padding_frac"] < off["update/padding_frac"] < 1
    assert list(variants)[-4:-1] == ["ragged_trim_padding_on", "ragged_packing", "ragged_trim_padding_off"]
    # Every timed step comes before the profiles (a CUDA profile slows the launches after it), then one
    # step at the `auto` settings measures what they cost
    assert list(budget).index("update_variants") < list(budget).index("profile")
    assert list(variants)[-1] == "after_profiler" and variants["after_profiler"]["time/update"] > 0
    kl = budget["kl_check"]
    assert {"generation_minus_scoring_first_token_abs", "generation_minus_scoring_later_tokens_abs",
            "eager_generation_minus_scoring_policy_abs"} <= set(kl)
    assert kl["kl_per_token_scoring_stacked"] == pytest.approx(kl["kl_per_token_scoring_alone"], abs=1e-5)
    profile = budget["profile"]
    assert profile["device_ms"] > 0 and sum(profile["by_family_ms"].values()) == pytest.approx(profile["device_ms"],
                                                                                             abs=0.1)
    assert profile["wall_ms"] > 0 and profile["host_syncs"] is None  # counted on CUDA only
    generation = budget["generation_profile"]  # one more batch, profiled by kernel family
    # the recipe's batch of 16, each response at full length (no stop token)
    assert (generation["rows"], generation["new_tokens"]) == (16, 8) and generation["wall_ms"] > 0
    assert sum(generation["by_family_ms"].values()) == pytest.approx(generation["device_ms"], abs=0.1)
    assert budget["static_cache"]["devices"] == ["cpu"]  # the compiled decoder's cache, held between steps


def test_gpu_memory_check_writes_the_measurement_beside_the_estimate(tiny_config, tmp_path):
    out = tmp_path / "check.json"
    run_script("gpu_memory_check.py", "--config", str(tiny_config), "--prequantized", "--steps", "1",
               "--work", str(tmp_path / "work"), "--out", str(out), *SIZES)
    result = json.loads(out.read_text())
    assert result["fits"] and result["error"] is None and len(result["steps"]) == 1
    assert result["estimated"]["peak_gb"] > 0 and set(result["auto"]) == {
        "ppo.grad_accum_steps", "rollout.forward_batch_size", "model.gradient_checkpointing",
        "model.offload_embeddings"}


def test_gpu_step_runs_only_the_variants_named(tiny_config, tmp_path):
    """`--variants` keeps a short device call to the settings it is for, in their usual order (named
    here in another; none that compiles, which the test above times). `--nf4-launch-from` puts the
    kernel's tuned launch settings in the JSON."""
    out, launch = tmp_path / "gpu_step.json", tmp_path / "nf4.json"
    tuned = {"block_n": 32, "programs_per_sm": 8, "blocks_per_iteration": 2, "num_warps": 8, "num_stages": 3}
    launch.write_text(json.dumps({"shapes": {
        "down": {"out_features": 64, "in_features": 128, "rows": {
            "16": {"bnb_us": 8.0, "fused_us": 9.0, "fused_best_us": 7.0, "fused_best": tuned}}},
        "k/v": {"out_features": 32, "in_features": 64, "rows": {
            "16": {"bnb_us": 5.0, "fused_us": 9.0, "fused_best_us": 9.5, "fused_best": {"block_n": 32}}}}}}))
    run_script("gpu_step.py", "--config", str(tiny_config), "--gpu-gb", "4", "5", "--work", str(tmp_path / "work"),
               "--out", str(out), "--steps", "1", "--no-kl-check", "--variants", "auto_again,roles_together",
               "--nf4-launch-from", str(launch), *SIZES, "ppo.grad_accum_steps=4")
    assert json.loads(out.read_text())["nf4_launch"] == {"tuned": {"64x128": tuned}, "bitsandbytes_faster": ["32x64"]}
    first, last = json.loads(out.read_text())["budgets"]
    assert list(first["update_variants"]) == ["roles_together", "auto_again"]  # no after_profiler: not named
    assert first["update_variants"]["roles_together"]["roles_together"] is True
    # Only the last budget is profiled: the first one's steps would otherwise run after its profiles
    assert "profile" not in first and "update_variants" not in last
    assert last["profile"]["device_ms"] > 0 and len(last["steps"]) == 1


@pytest.mark.parametrize("content", [None, "{}", "not json"])
def test_a_launch_file_that_is_not_the_sweeps_stops_the_run_with_one_line(tiny_config, tmp_path, content):
    """A missing or wrong `--nf4-launch-from` file ends gpu_step.py with one line, before the model is
    built (no work folder), not with a traceback a device call would pay for."""
    launch = tmp_path / "nf4.json"
    if content is not None:
        launch.write_text(content)
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_step.py"), "--config", str(tiny_config),
                           "--work", str(tmp_path / "work"), "--nf4-launch-from", str(launch)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith(f"--nf4-launch-from {launch}: not a bench/nf4_decode_matmul.py JSON")
    assert not (tmp_path / "work").exists()


def test_the_sweep_never_picks_a_setting_that_computes_the_wrong_product(tiny_config):
    """A launch setting that is fastest but wrong (a miscompile on some GPU) is passed over; one that
    did not run is too; and with none right there is no best. (`tiny_config` puts bench/ on the path.)"""
    from nf4_decode_matmul import fastest_correct

    entries = [{"block_n": 32, "us": 5.0, "correct": False}, {"block_n": 64, "us": 7.0, "correct": True},
               {"block_n": 128, "us": "error: OutOfResources"}, {"block_n": 16, "us": 9.0, "correct": True}]
    assert fastest_correct(entries)["block_n"] == 64
    assert fastest_correct(entries[:1] + entries[2:3]) is None


def test_lever_costs_times_every_lever(tiny_config, tmp_path):
    """bench/lever_costs.py (a minute on the device, no model built) writes each lever's timings."""
    out = tmp_path / "lever_costs.json"
    run_script("lever_costs.py", "--config", str(tiny_config), "--recipe", str(REPO / "recipes" / "single_gpu_8b.yaml"),
               "--repeats", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert all(result["optimizer_state"][f"{state}_step_s"] > 0 for state in ("device", "8bit", "cpu"))
    assert all(result["offload_embeddings"][f"{where}_{what}_s"] > 0
               for where in ("device", "cpu") for what in ("whole_batch", "decode_token"))
    head = result["quantize_lm_head"]
    assert head["compute_dtype_chunk_s"] > 0 and head["4bit_chunk_s"] > 0
    # 16 x 256 response positions in chunks of 64, through the head 2 + 3 x 2 epochs times
    assert head["lm_head_matmuls_per_step"] == 64 * 8


def test_nf4_decode_matmul_times_every_path_of_every_shape(tiny_config, tmp_path):
    """bench/nf4_decode_matmul.py (model.fused_4bit_decode's kernel against bitsandbytes); on CPU the
    kernel runs in Triton's interpreter, so only its numbers are checked, not its times."""
    pytest.importorskip("triton")
    out = tmp_path / "nf4.json"
    run_script("nf4_decode_matmul.py", "--config", str(tiny_config), "--rows", "1,16", "--calls", "1", "--repeats", "1",
               "--out", str(out))
    result = json.loads(out.read_text())
    # The tiny config's q/o (64 x 64, merged: 4 layers of it), k/v (32 x 64), gate/up (128 x 64), down (64 x 128).
    assert {name: shape["layers"] for name, shape in result["shapes"].items()} == {"q/o": 4, "k/v": 4, "gate/up": 4,
                                                                                  "down": 2}
    for shape in result["shapes"].values():
        for row in shape["rows"].values():
            assert all(row[f"{path}_us"] > 0 for path in ("bnb", "dequantize_linear", "fused", "copy"))
            assert row["max_abs_diff"] <= 1e-5 * row["max_abs"] + 1e-6  # float32 on CPU: summation order only
        # The launch settings swept at 16 rows alone: 3 x 3, then 3 x 3 from the best, then 5 stages x
        # paired lookups or not; each computes the product.
        assert "fused_sweep" not in shape["rows"]["1"]
        swept = shape["rows"]["16"]["fused_sweep"]
        assert len(swept) == 28 and {entry["blocks_per_iteration"] for entry in swept} == {1, 2, 4}
        assert sum(entry["paired_codes"] for entry in swept) == 5
        assert all(entry["max_abs_diff"] <= 1e-5 * shape["rows"]["16"]["max_abs"] + 1e-6 and entry["correct"]
                   for entry in swept)
        assert shape["rows"]["16"]["fused_best_us"] == min(entry["us"] for entry in swept)
    assert set(result["decode_step_ms"]) == {"1", "16"}
    assert "fused_best" not in result["decode_step_ms"]["1"] and result["decode_step_ms"]["16"]["fused_best"] > 0
    # What `--nf4-launch-from` reads, at 16 rows: each shape's best where it beat the defaults, and the
    # shapes where bitsandbytes beat the kernel.
    from nf4_decode_matmul import tuned_launch_from

    tuned, bitsandbytes_faster = tuned_launch_from(str(out))
    for shape in result["shapes"].values():
        row, key = shape["rows"]["16"], (shape["out_features"], shape["in_features"])
        beat = row["fused_best_us"] < row["fused_us"]
        assert tuned.get(key) == (row["fused_best"] if beat else None)
        assert (key in bitsandbytes_faster) == (row["bnb_us"] < min(row["fused_best_us"], row["fused_us"]))


def test_update_numerics_measures_every_path_against_float32(tiny_config, tmp_path):
    """bench/update_numerics.py: each update path in float32 and in bfloat16 against the default path in
    float32. On CPU every path computes the default's function, and those that only lay the work out
    otherwise round as it does (the compiled update, bit for bit in tests/test_compiled_update.py, is
    left out here: a minute of compiling)."""
    out = tmp_path / "numerics.json"
    layouts = ["pefts_forward", "roles_together", "packing", "trim_padding_off", "checkpointing_off"]
    paths = ["fused_lora", "adapter_autocast", *layouts]
    run_script("update_numerics.py", "--config", str(tiny_config), "--layers", "2", "--dtype", "bfloat16",
               "--rows", "4", "--prompt-tokens", "16", "--response-tokens", "16", "--rank", "4",
               "--work", str(tmp_path / "work"), "--paths", ",".join(paths), "--out", str(out))
    result = json.loads(out.read_text())
    assert result["dtype"] == "bfloat16" and max(result["response_lengths"]) == 16 > min(result["response_lengths"])
    measured = result["paths"]
    assert list(measured) == ["float32_self_check", "default", *paths]
    assert measured["float32_self_check"] < 1e-5  # float32's update reproduces its scoring
    default = measured["default"]["bfloat16"]
    assert default["logprob_mean_diff"] > 1e-5 and default["policy_grad_rel"] > 0  # bfloat16 really ran
    for name in paths:
        if name != "adapter_autocast":  # bfloat16 by definition: no float32 run
            assert measured[name]["float32"]["same_function"], (name, measured[name])
        assert all(ratio > 0 for ratio in measured[name]["bfloat16"]["vs_default"].values())
    for name in layouts:
        assert set(measured[name]["bfloat16"]["vs_default"].values()) == {1.0}, name
    for dtype in ("float32", "bfloat16"):  # PEFT's own forward: lora_ppo's numbers, bit for bit
        pefts, default = measured["pefts_forward"][dtype], measured["default"][dtype]
        keys = ("logprob_mean_diff", "policy_grad_rel", "value_grad_rel", "policy_loss", "value_loss")
        assert {k: pefts[k] for k in keys} == {k: default[k] for k in keys}
    assert "float32" not in measured["adapter_autocast"]


def test_update_numerics_tells_another_function_from_another_rounding(tiny_model_dir, tiny_config):
    """The distances are what they say: the default path's bfloat16 logprob distance is the model's own,
    read from its plain forward in each dtype (the same to the digits recorded); and a path computing a
    slightly other policy (its LoRA B 1% larger) is told apart in float32 while model.fused_lora is not.
    (`tiny_config` puts bench/ on the path.)"""
    import argparse
    import contextlib

    import torch

    import update_numerics as un
    from lora_ppo.config import PPOConfig
    from lora_ppo.roles import POLICY

    @contextlib.contextmanager
    def larger_lora_b(roles):
        bs = [p for name, p in roles.peft.named_parameters() if f"lora_B.{POLICY}." in name]
        with torch.no_grad():
            for p in bs:
                p.mul_(1.01)
        try:
            yield
        finally:
            with torch.no_grad():
                for p in bs:
                    p.div_(1.01)

    torch.manual_seed(0)
    exact = un.roles_of(tiny_model_dir, "float32", 4)
    un.draw_adapters(exact, 0.3)
    low = un.roles_of(tiny_model_dir, "bfloat16", 4)
    un.copy_trainable(exact, low)
    config = exact.peft.get_base_model().config
    rollout = un.scored_rollout(exact, 3, 8, 6, config.vocab_size, config.pad_token_id)
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(un.PATHS, "larger_lora_b", lambda roles, s: (s, larger_lora_b(roles)))
        un.check_paths(low, exact, rollout, PPOConfig(), 3, ["default", "fused_lora", "larger_lora_b"], results)
    assert results["fused_lora"]["float32"]["same_function"]
    assert not results["larger_lora_b"]["float32"]["same_function"], results["larger_lora_b"]
    assert results["larger_lora_b"]["float32"]["value_grad_rel"] == 0  # the value's adapter is untouched

    def plain_logprobs(roles) -> torch.Tensor:
        start = rollout.query_ids.shape[1]
        with roles.as_role(POLICY), torch.no_grad():
            logits = roles.peft(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask).logits
        logprobs = logits[:, start - 1:-1].float().log_softmax(-1)
        return logprobs.gather(-1, rollout.response_ids.unsqueeze(-1)).squeeze(-1)[rollout.response_mask]

    independent = float((plain_logprobs(low) - plain_logprobs(exact)).abs().mean())
    assert results["default"]["bfloat16"]["logprob_mean_diff"] == pytest.approx(independent, rel=1e-5)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown"):
        un.path_names("fused_lora,fast_lora")
    assert un.path_names("packing,default") == ["default", "packing"]  # the default first: the others need it
