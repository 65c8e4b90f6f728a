"""Edge cases with hand-computed answers: whitening over two or one valid entries, group advantages
with no spread, a checkpoint whose adapters do not fit the model, a failed rename while publishing
a checkpoint, and every divisibility rule of a recipe, each refused in one line."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from lora_ppo import atomic, checkpoint
from lora_ppo.cli import app
from lora_ppo.config import RewardRecipe, recipe_from_dict, recipe_to_yaml
from lora_ppo.errors import RecipeError
from lora_ppo.ppo_math import WHITEN_EPS, group_advantages, masked_var, masked_whiten
from lora_ppo.run_dir import RECIPE_FILE
from lora_ppo.state import TrainState
from tests.conftest import tiny_recipe_dict
from tests.test_checkpoint_files import trainables

NAN = float("nan")
TOL = dict(atol=1e-6, rtol=1e-5)


def t64(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# ---- whitening and group baselines ------------------------------------------------------------


def test_masked_var_of_exactly_two_entries_is_unbiased():
    values = t64([[1.0, 4.0, 100.0], [NAN, -7.0, 3.0]])
    mask = torch.tensor([[True, True, False], [False, False, False]])
    # mean 2.5; squared deviations 2.25 + 2.25; unbiased: / (2 - 1).
    torch.testing.assert_close(masked_var(values, mask), t64(4.5), **TOL)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_of_exactly_two_entries(shift_mean):
    values = t64([[1.0, NAN], [4.0, 1e30]])
    mask = torch.tensor([[True, False], [True, False]])
    scale = 1.5 / math.sqrt(4.5 + WHITEN_EPS)  # |x - mean| / unbiased std: 1 / sqrt(2) for both
    centred = t64([[-scale, 0.0], [scale, 0.0]])
    expected = centred if shift_mean else t64([[2.5 - scale, 0.0], [2.5 + scale, 0.0]])
    out = masked_whiten(values, mask, shift_mean=shift_mean)
    torch.testing.assert_close(out, expected, **TOL)


@pytest.mark.parametrize("shift_mean, kept", [(True, 0.0), (False, 3.0)])
def test_masked_whiten_of_one_entry_is_finite(shift_mean, kept):
    values = t64([[NAN, 3.0, float("inf")]])
    mask = torch.tensor([[False, True, False]])
    assert masked_var(values, mask).item() == 0.0
    out = masked_whiten(values, mask, shift_mean=shift_mean)
    torch.testing.assert_close(out, t64([[0.0, kept, 0.0]]), atol=0.0, rtol=0.0)


def test_grpo_group_with_zero_spread_gets_zero_advantage():
    rewards = t64([2.0, 2.0, 2.0, 1.0, 3.0, 5.0])
    out = group_advantages(rewards, 3, "grpo")
    assert torch.isfinite(out).all()
    # Group 1: no spread -> 0 / (0 + eps). Group 2: mean 3, unbiased std 2.
    expected = t64([0.0, 0.0, 0.0, -2.0 / (2.0 + 1e-6), 0.0, 2.0 / (2.0 + 1e-6)])
    torch.testing.assert_close(out, expected, **TOL)


def test_rloo_group_with_zero_spread_gets_zero_advantage():
    out = group_advantages(t64([-4.0, -4.0, 0.5, 1.5]), 2, "rloo")
    torch.testing.assert_close(out, t64([0.0, 0.0, -1.0, 1.0]), atol=0.0, rtol=0.0)


# ---- checkpoints that do not fit, and a failed publish ----------------------------------------


@pytest.fixture(scope="module")
def r4_roles(make_roles):
    return make_roles(seed=4)


@pytest.fixture(scope="module")
def r4_checkpoint(r4_roles, tmp_path_factory):
    """A checkpoint of r=4 policy and value adapters on the tiny model."""
    folder = tmp_path_factory.mktemp("r4") / "step-1"
    checkpoint.save(folder, trainables(r4_roles), TrainState(step=1), "recipe: r4\n")
    return folder


@pytest.mark.parametrize("adapters", [{"policy": {"r": 8, "alpha": 16}}, {"value": {"r": 8, "alpha": 16}},
                                      {"policy": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}])
def test_a_checkpoint_whose_adapter_does_not_fit_is_refused_in_one_line(make_roles, r4_checkpoint, adapters):
    roles = make_roles(**adapters)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.load(r4_checkpoint, trainables(roles), TrainState)
    message = str(err.value)
    assert "\n" not in message and str(r4_checkpoint) in message


def test_the_same_checkpoint_loads_into_a_model_it_fits(make_roles, r4_roles, r4_checkpoint):
    roles = make_roles(seed=9)  # other B weights, same shapes
    state = checkpoint.load(r4_checkpoint, trainables(roles), TrainState)
    assert state.step == 1
    for a, b in zip(roles.policy_parameters() + roles.value_parameters(),
                    r4_roles.policy_parameters() + r4_roles.value_parameters()):
        assert torch.equal(a, b)


def test_a_rank_mismatch_names_the_adapter_that_does_not_fit(make_roles, r4_checkpoint):
    roles = make_roles(policy={"r": 8, "alpha": 16})
    with pytest.raises(checkpoint.CheckpointError, match="policy adapter does not fit"):
        checkpoint.load(r4_checkpoint, trainables(roles), TrainState)


def test_cli_resume_from_a_checkpoint_of_another_rank_fails_in_one_line(tmp_path, tiny_model_dir, r4_checkpoint):
    # The run's own recipe.yaml says r=8 (so the recipe check passes); the checkpoint holds r=4.
    data = tiny_recipe_dict(tiny_model_dir, tmp_path / "run", adapters={"policy": {"r": 8, "alpha": 16}},
                            train={"eval": False})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / RECIPE_FILE).write_text(recipe_to_yaml(recipe_from_dict(data)), encoding="utf-8")
    recipe = tmp_path / "r8.yaml"
    recipe.write_text(yaml.safe_dump(data), encoding="utf-8")
    result = CliRunner().invoke(app, ["train", str(recipe), "--no-progress", "--resume", str(r4_checkpoint)])
    assert result.exit_code == 2, result.output  # a checkpoint that cannot be loaded is bad input
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"checkpoint {r4_checkpoint}" in lines[0], \
        result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_failed_rename_while_publishing_a_checkpoint_keeps_the_previous_one(
        r4_roles, tmp_path, monkeypatch, make_roles):
    folder = tmp_path / "checkpoints" / "final"
    checkpoint.save(folder, trainables(r4_roles), TrainState(step=1), "recipe: r4\n")
    before = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    real_replace, refused = atomic.os.replace, []

    def fails_to_publish(src, dst):
        # Only the rename of the staging folder onto `final` (os.replace is also what Path.replace
        # calls while the adapters are written into the staging folder).
        if Path(dst) == folder and Path(src).name.startswith(atomic.staging_prefix(folder.name)):
            refused.append(src)
            raise OSError(5, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", fails_to_publish)
    with pytest.raises(checkpoint.CheckpointError, match="Input/output error; earlier checkpoints are intact"):
        checkpoint.save(folder, trainables(make_roles(seed=7)), TrainState(step=2), "recipe: r4\n")
    monkeypatch.setattr(atomic.os, "replace", real_replace)
    assert len(refused) == 1  # everything was staged; only publishing it failed
    after = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert after == before
    assert [p.name for p in folder.parent.iterdir()] == ["final"]  # no staging or set-aside folder left
    assert checkpoint.load(folder, trainables(make_roles(seed=8)), TrainState).step == 1


# ---- divisibility rules of a recipe -----------------------------------------------------------


@pytest.mark.parametrize("sections, expected", [
    ({"rollout": {"batch_size": 6, "samples_per_prompt": 4}},
     "rollout.batch_size (6) must be divisible by rollout.samples_per_prompt (4)"),
    ({"rollout": {"batch_size": 8}, "ppo": {"num_minibatches": 3}},
     "rollout.batch_size (8) must be divisible by ppo.num_minibatches * ppo.grad_accum_steps (3)"),
    ({"rollout": {"batch_size": 8}, "ppo": {"num_minibatches": 2, "grad_accum_steps": 3}},
     "rollout.batch_size (8) must be divisible by ppo.num_minibatches * ppo.grad_accum_steps (6)"),
    ({"rollout": {"batch_size": 8}, "ppo": {"num_minibatches": 1, "grad_accum_steps": 16}},
     "rollout.batch_size (8) must be divisible by ppo.num_minibatches * ppo.grad_accum_steps (16)"),
    ({"ppo": {"advantage_estimator": "rloo"}},
     "ppo.advantage_estimator 'rloo' needs rollout.samples_per_prompt >= 2 (got 1)"),
    ({"ppo": {"advantage_estimator": "grpo"}, "rollout": {"samples_per_prompt": 1}},
     "ppo.advantage_estimator 'grpo' needs rollout.samples_per_prompt >= 2 (got 1)"),
])
def test_each_divisibility_rule_is_one_line_naming_fields_and_values(sections, expected):
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(sections)
    assert str(err.value) == expected


def test_reward_recipe_batch_size_must_divide_by_grad_accum_steps():
    with pytest.raises(RecipeError) as err:
        recipe_from_dict({"train": {"batch_size": 8, "grad_accum_steps": 3}}, schema=RewardRecipe)
    message = str(err.value)
    assert "\n" not in message
    assert message == "train.batch_size (8) must be divisible by grad_accum_steps (3)"


@pytest.mark.parametrize("sections, minibatch, micro_batch", [
    # 12 rows in 2 minibatches of 6, each in 2 micro-batches of 3.
    ({"rollout": {"batch_size": 12, "samples_per_prompt": 3}, "ppo": {"num_minibatches": 2, "grad_accum_steps": 2}},
     6, 3),
    # 8 rows in 8 minibatches of one row each.
    ({"rollout": {"batch_size": 8, "samples_per_prompt": 2}, "ppo": {"advantage_estimator": "grpo",
                                                                     "num_minibatches": 8}}, 1, 1),
])
def test_recipes_that_divide_are_accepted(sections, minibatch, micro_batch):
    recipe = recipe_from_dict(sections)
    assert (recipe.minibatch_size, recipe.micro_batch_size) == (minibatch, micro_batch)
    reward = recipe_from_dict({"train": {"batch_size": 12, "grad_accum_steps": 4}}, schema=RewardRecipe)
    assert (reward.train.batch_size, reward.train.grad_accum_steps) == (12, 4)


def test_a_checkpoint_adapter_with_weights_the_model_has_no_place_for_is_refused(tmp_path, make_roles, r4_checkpoint):
    """One extra LoRA matrix (a layer the model does not have) in an otherwise fitting adapter:
    loading it would silently drop trained weights, so it is refused, naming the adapter."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    shutil.copytree(r4_checkpoint, folder)
    weights_file = folder / "policy" / "adapter_model.safetensors"
    weights = load_file(str(weights_file))
    name = next(k for k in weights if ".layers.0." in k)
    weights[name.replace(".layers.0.", ".layers.7.")] = weights[name].clone()  # the tiny model has 2 layers
    save_file(weights, str(weights_file))
    with pytest.raises(checkpoint.CheckpointError, match=f"^checkpoint {folder}: policy adapter does not fit this model"):
        checkpoint.load(folder, trainables(make_roles()), TrainState)
