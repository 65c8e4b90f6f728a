"""`perf/*`: the FLOPs each phase of a step did, counted from the loaded model's layers, against
sizes worked out by hand for the tiny Llama of conftest (hidden 64, MLP 128, 2 layers, 4 heads of
16, 2 key-value heads) with r=4 LoRA on all linear layers."""

from __future__ import annotations

import pytest
import torch

from lora_ppo.config import recipe_from_dict
from lora_ppo.model import load_base_model
from lora_ppo.perf import (ModelFlops, StepShape, StepWork, current_device_peak_tflops, device_peak_tflops,
                           generate_flops, score_flops, throughput_metrics, update_flops)
from lora_ppo.roles import RoleModel
from tests.conftest import tiny_recipe_dict

# Per layer: q 64x64, k 64x32, v 64x32, o 64x64, gate and up 64x128, down 128x64.
LAYER_WEIGHTS = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 64 * 128 + 64 * 128 + 128 * 64
# r=4 LoRA on each: r x (in + out).
LAYER_LORA = 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64) + (64 + 128) + (64 + 128) + (128 + 64))


@pytest.fixture(scope="module")
def tiny_roles(tiny_model_dir, tmp_path_factory):
    recipe = recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path_factory.mktemp("run")))
    return RoleModel(load_base_model(recipe.model), recipe.adapters)


def test_model_sizes_are_counted_from_the_loaded_4bit_model(tiny_roles):
    flops = ModelFlops.of(tiny_roles.peft, tiny_roles.lm_head)
    vocab = tiny_roles.lm_head.weight.shape[0]
    assert flops.linear_weights == 2 * LAYER_WEIGHTS  # at their unquantized size, not the packed 4-bit one
    assert flops.lora_weights == {"policy": 2 * LAYER_LORA, "value": 2 * LAYER_LORA}
    assert flops.head_weights == 64 * vocab
    assert flops.attention_width == 2 * 4 * 16


@pytest.mark.parametrize("kind", ["gpt2", "qwen3"])
def test_model_sizes_of_conv1d_layers_and_of_heads_narrower_than_hidden_over_heads(kind):
    """GPT-2's Conv1D layers (no in_features; no head_dim in its config) and a Qwen3 whose heads are
    8 wide where hidden / heads is 16, counted by hand (2 layers, hidden 64, 4 heads, vocabulary 96)."""
    import transformers as tf

    if kind == "gpt2":
        config = tf.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64)
        layer = 64 * 192 + 64 * 64 + 64 * 256 + 256 * 64  # c_attn (q, k, v), c_proj, c_fc (4 x hidden), c_proj
        query_width = 4 * 16
    else:
        config = tf.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
        layer = 64 * 32 + 64 * 16 + 64 * 16 + 32 * 64 + 3 * 64 * 128  # q, k, v, o; gate, up, down
        query_width = 4 * 8
    model = tf.AutoModelForCausalLM.from_config(config)
    flops = ModelFlops.of(model, model.get_output_embeddings())
    assert (flops.linear_weights, flops.attention_width, flops.head_weights) == (2 * layer, 2 * query_width, 64 * 96)


def test_phase_flops_match_a_hand_count():
    model = ModelFlops(linear_weights=1000, lora_weights={"policy": 10, "value": 20}, head_weights=300,
                       attention_width=7)
    # Two rows: prompts of 2 and 3 real tokens, responses of 3 and 1 real tokens in a width of 3.
    query_mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    response_mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    shape = StepShape.of(query_mask, response_mask, response_mask)
    assert shape.sequence_lengths.tolist() == [5, 4] and shape.response_tokens == 4 and shape.decode_steps == 3
    attended = 5 * 6 / 2 + 4 * 5 / 2  # causal: n(n+1)/2 positions per sequence

    # Generate: prefill of 2 + 3 prompt tokens (head at each row's last), then 3 decode steps of both
    # rows, attending to 3, 4, 5 and 4, 5, 6 positions.
    prefill = 2 * 1010 * 5 + 4 * 7 * (3 + 6) + 2 * 300 * 2
    decode = 2 * 1010 * 6 + 4 * 7 * (3 + 4 + 5 + 4 + 5 + 6) + 2 * 300 * 6
    assert generate_flops(model, shape) == pytest.approx(prefill + decode)

    # Score: the reference (adapters disabled) and the policy read logprobs at 4 positions; the value does not.
    score = (2 * 1000 * 9 + 4 * 7 * attended + 2 * 300 * 4) + (2 * 1010 * 9 + 4 * 7 * attended + 2 * 300 * 4) \
        + (2 * 1020 * 9 + 4 * 7 * attended)
    assert score_flops(model, shape, {None: True, "policy": True, "value": False}) == pytest.approx(score)

    # Update, one epoch: forward, recomputed forward (checkpointing), recomputed logprob chunks,
    # backward (input gradients 1x, LoRA weight gradients, attention 2x) for the policy; the value
    # the same without the LM head.
    policy = ((2 * 1010 * 9 + 4 * 7 * attended + 2 * 300 * 4) + (2 * 1010 * 9 + 4 * 7 * attended) + 2 * 300 * 4
              + (2 * (1000 + 20) * 9 + 8 * 7 * attended + 2 * 300 * 4))
    value = (2 * 1020 * 9 + 4 * 7 * attended) * 2 + (2 * (1000 + 40) * 9 + 8 * 7 * attended)
    assert update_flops(model, shape, 2, True, True) == pytest.approx(2 * (policy + value))
    no_checkpointing = policy - (2 * 1010 * 9 + 4 * 7 * attended)
    assert update_flops(model, shape, 1, False, False) == pytest.approx(no_checkpointing)


def test_rates_and_share_of_the_peak():
    metrics = throughput_metrics({"generate": 2e12, "score": 3e12, "update": 8e12},
                                 {"generate": 2.0, "score": 0.5, "update": 0.0}, 100.0, 512)
    assert metrics == pytest.approx({"perf/generate_tflops": 1.0, "perf/generate_peak_frac": 0.01,
                                     "perf/score_tflops": 6.0, "perf/score_peak_frac": 0.06,
                                     "perf/generate_tokens_per_s": 256.0})  # an update that did not run: no rate
    assert "perf/update_peak_frac" not in throughput_metrics({"update": 1e12}, {"update": 1.0}, None, 0)


def test_data_parallel_processes_each_count_their_share():
    model = ModelFlops(1000, {"policy": 0}, 0, 0)
    shape = StepShape.of(torch.ones(4, 2, dtype=torch.bool), torch.ones(4, 3, dtype=torch.bool),
                         torch.ones(4, 3, dtype=torch.bool))
    alone = StepWork(model, {"policy": True}, 1, False, False).metrics(shape, {"score": 1.0, "generate": 1.0})
    halves = StepWork(model, {"policy": True}, 1, False, False, processes=2).metrics(shape, {"score": 1.0, "generate": 1.0})
    assert halves["perf/score_tflops"] == pytest.approx(alone["perf/score_tflops"] / 2)
    assert halves["perf/generate_tokens_per_s"] == pytest.approx(alone["perf/generate_tokens_per_s"] / 2) == 6.0


def test_a_steps_update_rate_counts_its_epochs_value_and_checkpointing():
    """StepWork hands the update's settings to `update_flops` (checked by hand above) as the run has
    them: 3 epochs with the value and no checkpointing."""
    model = ModelFlops(1000, {"policy": 10, "value": 20}, 300, 7)
    shape = StepShape.of(torch.ones(2, 2, dtype=torch.bool), torch.ones(2, 3, dtype=torch.bool),
                         torch.ones(2, 3, dtype=torch.bool))
    metrics = StepWork(model, {"policy": True}, 3, True, False).metrics(shape, {"update": 2.0})
    assert metrics["perf/update_tflops"] == pytest.approx(update_flops(model, shape, 3, True, False) / 2.0 / 1e12)
    assert update_flops(model, shape, 3, True, False) != update_flops(model, shape, 3, False, True)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0), ("NVIDIA H200", 989.0),
    ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA L4", 121.0), ("NVIDIA L40", 181.0),
    ("NVIDIA L40S", 362.0), ("NVIDIA A10G", 70.0),
    ("NVIDIA A10", 125.0), ("NVIDIA GeForce RTX 4090", None), (None, None),
])
def test_device_peaks_by_cuda_name(name, peak):
    assert device_peak_tflops(name) == peak


def test_the_peak_of_the_device_a_model_runs_on(monkeypatch):
    """A CUDA device's peak by the name CUDA gives it; a CPU has none (and CUDA is never asked)."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: asked.append(dev) or "NVIDIA H100 PCIe")
    assert current_device_peak_tflops(torch.device("cpu")) is None and asked == []
    assert current_device_peak_tflops(torch.device("cuda", 0)) == 756.0 and asked == [torch.device("cuda", 0)]


@pytest.mark.parametrize("overrides, from_generation, scored, epochs, critic", [
    ({}, True, {None: True, "value": False}, 4, True),  # the reference by disabling adapters; values
    ({}, False, {"policy": True, None: True, "value": False}, 4, True),
    ({"ppo": {"num_epochs": 2, "advantage_estimator": "rloo"}, "rollout": {"samples_per_prompt": 2},
      "adapters": {"reference": "none"}}, False, {"policy": True}, 2, False),
])
def test_what_a_runs_steps_compute_follows_its_recipe(tiny_roles, tiny_model_dir, tmp_path, overrides,
                                                       from_generation, scored, epochs, critic):
    """The roles scored (and which read logprobs), the update's epochs and roles, checkpointing and
    the process count, for `perf/*`."""
    from lora_ppo.metrics import step_work

    recipe = recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / "run", **overrides))
    recipe = recipe.with_values({"ppo.num_epochs": epochs, "model.gradient_checkpointing": True})
    work = step_work(recipe, tiny_roles, from_generation, processes=3)
    assert work.scored_roles == scored
    assert (work.epochs, work.with_value, work.checkpointing, work.processes) == (epochs, critic, True, 3)
    assert work.peak_tflops is None  # a CPU: no known peak
    assert work.model == ModelFlops.of(tiny_roles.peft, tiny_roles.lm_head)
