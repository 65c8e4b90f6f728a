"""Sizes left `auto` (ppo.grad_accum_steps, rollout.forward_batch_size, model.gradient_checkpointing,
model.offload_embeddings), and with them the dequantized copy (model.dequantize_per_step): chosen by
the memory plan to fit the budget it is given and no larger, recorded in the run's recipe.yaml, kept
on resume, and shown by `lora-ppo estimate`."""

from __future__ import annotations

import json
import logging

import pytest
import yaml
from typer.testing import CliRunner

from lora_ppo import estimate as est
from lora_ppo.cli import app
from lora_ppo.config import field_value, recipe_from_dict
from lora_ppo.distributed import World
from lora_ppo.errors import RecipeError
from lora_ppo.model_shape import ModelShape, load_shape
from lora_ppo.sizing import with_auto_sizes
from tests.conftest import tiny_recipe_dict

runner = CliRunner()
GB = 1e9
LLAMA_8B = ModelShape(4096, 14336, 32, 32, 8, 128, 128256, False)
AUTO = {"ppo": {"grad_accum_steps": "auto", "num_minibatches": 2, "num_epochs": 2},
        "rollout": {"forward_batch_size": "auto", "batch_size": 16, "max_new_tokens": 256},
        "model": {"gradient_checkpointing": "auto"}, "data": {"max_prompt_tokens": 256}}


def _recipe(**changes):
    sections = {name: {**AUTO.get(name, {}), **changes.get(name, {})} for name in {*AUTO, *changes}}
    return recipe_from_dict({"adapters": {"policy": {"r": 16}, "value": {"r": 16}}, **sections})


def _peaks(shape, recipe, budget_gb):
    """(score, update) peaks of a recipe whose sizes are all given, as `estimate` counts them."""
    e = est.estimate(shape, recipe, device="cuda", budget_gb=budget_gb)
    assert not e.auto_choices
    return e.phases["score"], e.phases["update"]


@pytest.mark.parametrize("budget_gb", [11, 12, 16, 24])
def test_auto_sizes_fit_the_budget_and_one_size_larger_does_not(budget_gb):
    recipe = _recipe()
    planned, choices = est.choose_auto_sizes(LLAMA_8B, recipe, "cuda", budget_gb)
    assert [c.field for c in choices][:3] == ["model.gradient_checkpointing", "ppo.grad_accum_steps",
                                              "rollout.forward_batch_size"]
    assert planned.auto_sizes == []
    plan = est.AUTO_PLAN_SHARE * budget_gb * GB
    score, update = _peaks(LLAMA_8B, planned, budget_gb)
    assert score <= plan and update <= plan
    # One more scoring row, or the next larger micro-batch (fewer accumulation steps), would not fit.
    if planned.rollout.forward_batch_size < 16:
        assert _peaks(LLAMA_8B, planned.with_values({"rollout.forward_batch_size": planned.rollout.forward_batch_size + 1}),
                      budget_gb)[0] > plan
    fewer = [d for d in range(1, planned.ppo.grad_accum_steps) if 8 % d == 0]
    if fewer:
        assert _peaks(LLAMA_8B, planned.with_values({"ppo.grad_accum_steps": fewer[-1]}), budget_gb)[1] > plan
    # 8B: without checkpointing a 512-token row's activations alone are gigabytes.
    assert planned.model.gradient_checkpointing is True


def test_micro_batches_of_one_row_are_chosen_where_only_they_fit():
    """10.5 GB for the 8B shape: one row fits the plan with checkpointing, two do not. The choice
    says it fits (it does, by the estimate), not that even one row is too much."""
    planned, choices = est.choose_auto_sizes(LLAMA_8B, _recipe(), "cuda", 10.5)
    plan = est.AUTO_PLAN_SHARE * 10.5 * GB
    assert planned.micro_batch_size == 1 and planned.ppo.grad_accum_steps == 8
    assert _peaks(LLAMA_8B, planned, 10.5)[1] <= plan
    assert _peaks(LLAMA_8B, planned.with_values({"ppo.grad_accum_steps": 4}), 10.5)[1] > plan
    assert "micro-batches of 1 row, the largest whose update fits 10.5 GB" in str(choices[1])
    assert str(choices[0]).endswith("with it 1 row)")


def test_the_leanest_is_said_only_where_nothing_fits():
    """8 GB for the 8B shape: nothing fits the plan, and each choice says so against the planned
    share; 10 GB: one scoring row fits, said as a fit; no budget: the leanest, for want of one."""
    _, tight = est.choose_auto_sizes(LLAMA_8B, _recipe(), "cuda", 8)
    assert tight[0].reason == "no micro-batch fits the 7.2 GB planned of 8 GB: the leanest"
    assert tight[1].reason.startswith("even micro-batches of 1 row need ")
    assert tight[1].reason.endswith(" GB, more than the 7.2 GB planned of 8 GB: the leanest")
    assert tight[2].reason == "even one row's scoring does not fit the 7.2 GB planned of 8 GB: the leanest"
    planned, one_row = est.choose_auto_sizes(LLAMA_8B, _recipe(), "cuda", 10)
    assert planned.rollout.forward_batch_size == 1 and _peaks(LLAMA_8B, planned, 10)[0] <= est.AUTO_PLAN_SHARE * 10 * GB
    assert one_row[2].reason.startswith("the most rows whose scoring fits 10 GB")
    _, unbounded = est.choose_auto_sizes(LLAMA_8B, _recipe(), "cuda", None)
    assert [c.reason for c in unbounded[:3]] == ["no budget given: the leanest",
                                                 "no budget given: the leanest, micro-batches of 1 row",
                                                 "no budget given: the leanest"]


@pytest.mark.parametrize("budget_gb", [4, 12, 16, 32, 48])  # each reason for the dequantized copy, in turn
def test_each_choice_said_is_the_value_the_run_gets(budget_gb):
    planned, choices = est.choose_auto_sizes(LLAMA_8B, _recipe(model={"dequantize_per_step": "auto"}), "cuda",
                                             budget_gb)
    assert {c.field: c.value for c in choices} == {c.field: field_value(planned, c.field) for c in choices}


def test_the_users_cap_on_the_copy_is_the_copy_auto_weighs():
    """16 GB for the 8B shape: the whole 13.96 GB copy takes more than half the room beyond the
    weights, a copy capped at 2 GB (model.dequantize_budget_gb) does not: on, as a run decides with
    that cap (model.dequantized_once), and the user's 2 GB kept rather than what the plan leaves."""
    capped = _recipe(model={"dequantize_per_step": "auto", "dequantize_budget_gb": 2.0})
    planned, choices = est.choose_auto_sizes(LLAMA_8B, capped, "cuda", 16)
    assert (planned.model.dequantize_per_step, planned.model.dequantize_budget_gb) == (True, 2.0)
    assert str(choices[-1]) == ("model.dequantize_per_step=true (the 2.00 GB copy takes at most 50% of the room "
                                "beyond the weights)")
    uncapped, _ = est.choose_auto_sizes(LLAMA_8B, _recipe(model={"dequantize_per_step": "auto"}), "cuda", 16)
    assert uncapped.model.dequantize_budget_gb < 2.0  # the plan's leftover: the cap decided above


def test_a_larger_budget_never_gets_a_smaller_micro_batch_or_scoring_batch():
    sizes = [est.choose_auto_sizes(LLAMA_8B, _recipe(), "cuda", gb)[0] for gb in (11, 12, 14, 16)]
    micro = [r.micro_batch_size for r in sizes]
    scoring = [r.rollout.forward_batch_size for r in sizes]
    assert micro == sorted(micro) and scoring == sorted(scoring) and micro[0] < micro[-1]


def test_checkpointing_goes_off_when_the_update_fits_without_it():
    tiny = ModelShape(64, 128, 2, 4, 2, 16, 320, True)
    planned, choices = est.choose_auto_sizes(tiny, _recipe(), "cuda", 4.0)
    assert planned.model.gradient_checkpointing is False and planned.ppo.grad_accum_steps == 1
    assert "fits without it at the same micro-batch" in str(choices[0])
    # A recipe that fixes the micro-batch keeps it; only the other sizes are chosen.
    fixed, choices = est.choose_auto_sizes(tiny, _recipe(ppo={"grad_accum_steps": 4}), "cuda", 4.0)
    assert fixed.ppo.grad_accum_steps == 4 and [c.field for c in choices] == [
        "model.gradient_checkpointing", "rollout.forward_batch_size", "model.dequantize_per_step"]


def test_a_gpu_keeps_recomputing_rather_than_run_micro_batches_too_small_to_fill_it():
    """Without recomputing the 8B update fits 32 GB only in micro-batches of 2 rows (1,024 tokens a
    forward), with it in 8. A GPU's update waits on the host below ~4,000 tokens a forward
    (micro-batches of 2 took twice the time of 4, and 4 over twice that of 8, on an H200), so it
    keeps recomputing; on CPU, where a micro-batch's overhead is small, 1,024 tokens are enough."""
    gpu, choices = est.choose_auto_sizes(LLAMA_8B, _recipe(), "cuda", 32)
    assert (gpu.model.gradient_checkpointing, gpu.micro_batch_size) == (True, 8)
    assert choices[0].reason == "without it the largest micro-batch that fits 32 GB is 2 rows, with it 8"
    cpu, choices = est.choose_auto_sizes(LLAMA_8B, _recipe(), "cpu", 60)
    assert (cpu.model.gradient_checkpointing, cpu.micro_batch_size) == (False, 2)
    assert choices[0].reason == "without it micro-batches of 2 rows (1024 tokens a forward) fit: no recomputing"


def test_without_a_budget_or_room_the_sizes_are_the_leanest():
    for budget in (None, 1.0):  # 1 GB: the 8B weights alone do not fit
        planned, choices = est.choose_auto_sizes(LLAMA_8B, _recipe(), "cuda", budget)
        assert (planned.ppo.grad_accum_steps, planned.rollout.forward_batch_size,
                planned.model.gradient_checkpointing) == (8, 1, True)
        assert all("leanest" in choice.reason for choice in choices[:3])
        # No room for a dequantized copy either (without a budget the run decides, as without a plan).
        assert planned.model.dequantize_per_step == ("auto" if budget is None else False)
        assert choices[3:] == ([] if budget is None else [est.AutoChoice(
            "model.dequantize_per_step", False, f"the plan ({est.estimate(LLAMA_8B, planned, 'cuda', 1.0).peak / GB:.2f} "
            "GB) does not fit 1 GB")])


OFFLOAD_AUTO = {"model": {"gradient_checkpointing": "auto", "offload_embeddings": "auto"}}
LLAMA_8B_TABLE = 128256 * 4096 * 2  # vocabulary x hidden, bfloat16


def test_the_embeddings_go_to_cpu_memory_where_the_update_gets_larger_micro_batches():
    planned, choices = est.choose_auto_sizes(LLAMA_8B, _recipe(**OFFLOAD_AUTO), "cuda", 12)
    kept, _ = est.choose_auto_sizes(LLAMA_8B, _recipe(), "cuda", 12)  # the table on the device
    assert (planned.model.offload_embeddings, planned.micro_batch_size, kept.micro_batch_size) == (True, 8, 4)
    assert str(choices[0]) == ("model.offload_embeddings=true (with the table's 1.05 GB in CPU memory the update runs "
                               "micro-batches of 8 rows, against micro-batches of 4 rows)")
    e = est.estimate(LLAMA_8B, planned, device="cuda", budget_gb=12)
    assert e.host == {"embeddings": LLAMA_8B_TABLE} and e.peak <= est.AUTO_PLAN_SHARE * 12 * GB
    # With room for micro-batches of 8 on the device the table stays there: a lookup on the CPU
    # costs each decoded token a wait, and nothing in the update gets faster.
    roomy, choices = est.choose_auto_sizes(LLAMA_8B, _recipe(**OFFLOAD_AUTO), "cuda", 24)
    assert (roomy.model.offload_embeddings, roomy.micro_batch_size) == (False, 8)
    assert "would not speed the update: micro-batches of 8 rows either way" in choices[0].reason


def test_the_embeddings_go_to_cpu_memory_where_the_plan_fits_only_so():
    fixed = _recipe(ppo={"grad_accum_steps": 8}, rollout={"forward_batch_size": 1},
                    model={"gradient_checkpointing": True, "offload_embeddings": "auto"})
    on_device = est.estimate(LLAMA_8B, fixed.with_values({"model.offload_embeddings": False}), device="cuda").peak
    assert on_device - est.estimate(LLAMA_8B, fixed.with_values({"model.offload_embeddings": True}),
                                    device="cuda").peak == LLAMA_8B_TABLE
    between = (on_device - LLAMA_8B_TABLE / 2) / GB
    planned, choices = est.choose_auto_sizes(LLAMA_8B, fixed, "cuda", between)
    assert planned.model.offload_embeddings is True and "fits only with the table's 1.05 GB" in choices[0].reason
    planned, choices = est.choose_auto_sizes(LLAMA_8B, fixed, "cuda", (on_device - 2 * LLAMA_8B_TABLE) / GB)
    assert planned.model.offload_embeddings is False and "does not fit with the table" in choices[0].reason


def test_the_embeddings_stay_where_they_are_for_tied_models_and_on_cpu():
    tied = ModelShape(4096, 14336, 32, 32, 8, 128, 128256, True)
    planned, choices = est.choose_auto_sizes(tied, _recipe(**OFFLOAD_AUTO), "cuda", 12)
    assert planned.model.offload_embeddings is False and "ties them to the LM head" in choices[0].reason
    planned, choices = est.choose_auto_sizes(LLAMA_8B, _recipe(**OFFLOAD_AUTO), "cpu", 12)
    assert planned.model.offload_embeddings is False and "everything is in CPU memory" in choices[0].reason
    # Undecided (no memory plan: train-reward, train-sft) is off.
    assert not recipe_from_dict(OFFLOAD_AUTO).model.embeddings_on_cpu


def test_auto_accumulation_still_checks_the_minibatches():
    with pytest.raises(RecipeError, match=r"rollout.batch_size \(16\) must be divisible by ppo.num_minibatches \(3\)"):
        _recipe(ppo={"num_minibatches": 3})
    with pytest.raises(ValueError, match="choose the sizes first"):
        _ = _recipe().micro_batch_size


def test_estimate_shows_the_choices(tmp_path):
    result = runner.invoke(app, ["estimate", "recipes/single_gpu_8b.yaml", "model.name=bench/model_configs/llama-3.1-8b",
                                 "ppo.grad_accum_steps=auto", "rollout.forward_batch_size=auto", "--gpu-gb", "12"])
    assert result.exit_code == 0, result.output
    recipe = recipe_from_dict(yaml.safe_load(open("recipes/single_gpu_8b.yaml")),
                              ["model.name=bench/model_configs/llama-3.1-8b", "ppo.grad_accum_steps=auto",
                               "rollout.forward_batch_size=auto"])
    planned, _ = est.choose_auto_sizes(load_shape(recipe.model.name), recipe, "cuda", 12.0)
    assert "auto sizes for 12 GB:" in result.stdout
    assert f"  ppo.grad_accum_steps={planned.ppo.grad_accum_steps} (micro-batches of {planned.micro_batch_size} rows" \
        in result.stdout
    assert f"update micro-batch {planned.micro_batch_size}," in result.stdout


def test_a_run_records_its_choice_and_a_resume_keeps_it(tmp_path, tiny_model_dir, caplog):
    import lora_ppo

    out = tmp_path / "run"
    data = tiny_recipe_dict(tiny_model_dir, out, train={"steps": 1, "eval": False, "memory_budget_gb": 4.0},
                            ppo={"grad_accum_steps": "auto", "num_epochs": 1, "num_minibatches": 2},
                            rollout={"forward_batch_size": "auto"},
                            model={"gradient_checkpointing": "auto", "offload_embeddings": "auto"})
    recipe = recipe_from_dict(data)
    expected, _ = est.choose_auto_sizes(load_shape(recipe.model.name), recipe, "cpu", 4.0)
    with caplog.at_level(logging.INFO, logger="lora_ppo"):
        lora_ppo.PPOTrainer(recipe, progress=False).train()
    saved = yaml.safe_load((out / "recipe.yaml").read_text())
    recorded = (saved["ppo"]["grad_accum_steps"], saved["rollout"]["forward_batch_size"],
                saved["model"]["gradient_checkpointing"], saved["model"]["offload_embeddings"])
    assert recorded == (expected.ppo.grad_accum_steps, expected.rollout.forward_batch_size,
                        expected.model.gradient_checkpointing, expected.model.offload_embeddings) == (1, 4, False, False)
    # The tiny model's dequantized copy takes far less than half of 4 GB: the whole copy, recorded.
    assert (saved["model"]["dequantize_per_step"], saved["model"]["dequantize_budget_gb"]) == (True, None)
    assert "auto sizes for 4.0 GB, train.memory_budget_gb: model.offload_embeddings=false (everything is in CPU " \
        "memory); model.gradient_checkpointing=false" in caplog.text
    # Resumed with the same `auto` recipe and a budget that would choose the leanest sizes: the
    # run goes on with what it recorded.
    more = recipe_from_dict(data, ["train.steps=2", "train.memory_budget_gb=0.001"])
    trainer = lora_ppo.PPOTrainer(more, progress=False, resume="auto")
    assert (trainer.recipe.ppo.grad_accum_steps, trainer.recipe.rollout.forward_batch_size,
            trainer.recipe.model.gradient_checkpointing, trainer.recipe.model.offload_embeddings) == recorded
    assert trainer.recipe.model.dequantize_per_step is True  # 0.001 GB would leave no room for it
    trainer.train()
    assert yaml.safe_load((out / "recipe.yaml").read_text())["ppo"]["grad_accum_steps"] == 1
    # A resume that sets the copy itself keeps what it says: only `auto` takes the recorded plan.
    explicit = recipe_from_dict(data, ["train.steps=3", "model.dequantize_per_step=false"])
    assert with_auto_sizes(explicit, "auto", World()).model.dequantize_per_step is False


def test_the_plan_names_the_budget_from_which_the_update_runs_in_larger_micro_batches(monkeypatch, caplog):
    """Near a plan's edge tens of MB double a micro-batch (2026-11-27: one H200 call's 8B run read
    11.9 GB and ran micro-batches of 8, the next read a little less and ran 4). The estimate and
    the run's log say from which budget the update would run faster, to 0.05 GB."""
    recipe = _recipe(**OFFLOAD_AUTO)

    def micro(budget_gb: float) -> int:
        return est.choose_auto_sizes(LLAMA_8B, recipe, "cuda", budget_gb)[0].micro_batch_size

    edge, text = est.faster_update_budget(LLAMA_8B, recipe, "cuda", 11.8)
    assert (micro(11.8), micro(edge), micro(edge - est.FASTER_STEP_GB), text) == (4, 8, 4, "micro-batches of 8 rows")
    # Micro-batches of 8 are the whole minibatch: nothing larger; without recomputing needs more than 25% more.
    assert est.faster_update_budget(LLAMA_8B, recipe, "cuda", 12.0) is None
    # The run says it where it plans for its budget.
    import lora_ppo
    from lora_ppo import sizing
    from lora_ppo.distributed import join_world

    monkeypatch.setattr(sizing, "device_type", lambda: "cuda")
    user = lora_ppo.load_recipe("recipes/single_gpu_8b.yaml", ["model.name=bench/model_configs/llama-3.1-8b",
                                                               "train.memory_budget_gb=11.8"])
    with caplog.at_level(logging.INFO, logger="lora_ppo.sizing"):
        planned = sizing.with_auto_sizes(user, None, join_world())
    assert planned.micro_batch_size == 4
    assert f"(from {edge:g} GB the update would run micro-batches of 8 rows)" in caplog.text
    result = runner.invoke(app, ["estimate", "recipes/single_gpu_8b.yaml", "model.name=bench/model_configs/llama-3.1-8b",
                                 "--gpu-gb", "11.8"])
    assert f"\n  (from {edge:g} GB the update would run micro-batches of 8 rows)\n" in result.stdout
    result = runner.invoke(app, ["estimate", "recipes/single_gpu_8b.yaml", "model.name=bench/model_configs/llama-3.1-8b",
                                 "--gpu-gb", "11.8", "--json"])
    assert json.loads(result.stdout)["faster_update_from_gb"] == edge


LLAMA_8B_LAYER_COPY = 14336 * 4096 * 2  # the largest linear layer (gate, up, down), bfloat16


@pytest.mark.parametrize("budget_gb", [12, 16, 24])
def test_a_dequantized_copy_takes_what_the_sizes_leave_of_the_plan(budget_gb):
    """model.dequantize_per_step auto, after the sizes: the part of the copy that fits beside the
    plan's peak within its 90% of the budget (0.01 GB more would not), none where that is less than
    one layer's copy. The sizes are those chosen without it: the copy takes only what they leave."""
    planned, choices = est.choose_auto_sizes(LLAMA_8B, _recipe(), "cuda", budget_gb)
    plan = est.AUTO_PLAN_SHARE * budget_gb * GB
    off = planned.with_values({"model.dequantize_per_step": False, "model.dequantize_budget_gb": None})
    assert est.choose_auto_sizes(LLAMA_8B, _recipe(model={"dequantize_per_step": False}), "cuda", budget_gb)[0] == off
    left = plan - est.estimate(LLAMA_8B, off, "cuda", budget_gb).peak
    if left < LLAMA_8B_LAYER_COPY:
        assert budget_gb == 12 and planned == off
        assert "less than one layer's copy (0.12 GB)" in choices[-1].reason
        return
    part = planned.model.dequantize_budget_gb
    assert planned.model.dequantize_per_step is True and part == int(left / GB * 100) / 100
    assert [c.field for c in choices][-2:] == ["model.dequantize_per_step", "model.dequantize_budget_gb"]
    assert est.estimate(LLAMA_8B, planned, "cuda", budget_gb).peak <= plan
    assert est.estimate(LLAMA_8B, planned.with_values({"model.dequantize_budget_gb": part + 0.01}), "cuda",
                        budget_gb).peak > plan


def test_the_whole_copy_where_it_takes_half_the_room_or_fits_beside_the_plan():
    small = ModelShape(896, 4864, 24, 14, 2, 64, 151936, True)  # Qwen2.5-0.5B's shape
    whole = small.linear_params * 2  # bfloat16
    planned, choices = est.choose_auto_sizes(small, _recipe(), "cuda", 24)
    assert (planned.model.dequantize_per_step, planned.model.dequantize_budget_gb) == (True, None)
    assert str(choices[-1]) == (f"model.dequantize_per_step=true (the {whole / GB:.2f} GB copy takes at most 50% of "
                                "the room beyond the weights)")
    # A model that is not 4-bit has nothing to dequantize: the run decides (off).
    planned, choices = est.choose_auto_sizes(small, _recipe(model={"quantization": "none"}), "cuda", 24)
    assert planned.model.dequantize_per_step == "auto" and choices[-1].field != "model.dequantize_per_step"


def test_a_data_parallel_run_plans_for_the_least_free_memory_of_its_processes(monkeypatch, caplog):
    """Two processes, one with 13 GB free and one with 11 GB: each plans for 11 GB and the 0.6 GB
    the process itself takes on a GPU (CUDA's context and allocator, counted by the estimate):
    11.6 GB, on both, so both choose the same sizes."""
    import lora_ppo
    from lora_ppo import sizing

    class TwoProcesses(World):
        def gather(self, obj):
            return [13_000_000_000, 11_000_000_000]

    monkeypatch.setattr(sizing, "device_type", lambda: "cuda")
    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: 0)  # each process's own, gathered above
    user = lora_ppo.load_recipe("recipes/single_gpu_8b.yaml", ["model.name=bench/model_configs/llama-3.1-8b"])
    with caplog.at_level(logging.INFO, logger="lora_ppo.sizing"):
        sizing.with_auto_sizes(user, None, TwoProcesses(rank=0, size=2))
    assert "auto sizes for 11.6 GB, free on the device now: " in caplog.text


def test_a_resume_from_a_checkpoint_outside_any_run_plans_anew(tmp_path, tiny_model_dir):
    """A checkpoint copied away from its run folder has no recipe.yaml to take recorded sizes from:
    the plan chooses them (resolve_resume then says what the checkpoint lacks)."""
    recipe = recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / "run",
                                               train={"memory_budget_gb": 4.0}, ppo={"grad_accum_steps": "auto"}))
    lonely = tmp_path / "copied" / "step-3"
    lonely.mkdir(parents=True)
    assert with_auto_sizes(recipe, lonely, World()).ppo.grad_accum_steps == \
        est.choose_auto_sizes(load_shape(recipe.model.name), recipe, "cpu", 4.0)[0].ppo.grad_accum_steps
