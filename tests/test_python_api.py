"""The README's Python API: a recipe dict -> PPOTrainer -> train; the saved policy adapter
reloads with plain PEFT and reproduces the trained model's logits."""

from __future__ import annotations

import json

import pytest
import torch

import lora_ppo
from tests.conftest import tiny_recipe_dict


def test_python_api_trains_and_saved_adapter_reproduces_logits(tmp_path, tiny_model_dir):
    from peft import PeftModel

    from lora_ppo.bnb_workarounds import keep_4bit_weights_differentiable
    from lora_ppo.config import ModelConfig
    from lora_ppo.model import load_base_model

    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / "run"), ["train.steps=2"])
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    before = {n: p.detach().clone() for n, p in trainer.roles.peft.named_parameters() if "lora_B.policy" in n}
    summary = trainer.train()
    assert summary["steps"] == 2
    # The held-out KL is the scored policy's: 0 before training (LoRA B starts at 0), and what an
    # evaluation of the trained policy measures after.
    assert abs(summary["heldout_kl_before"]) < 1e-6
    assert summary["heldout_kl_after"] == trainer.evaluate()["kl"]
    after = dict(trainer.roles.peft.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)

    ids = torch.tensor([[5, 17, 42, 9, 33, 61]])
    with torch.no_grad(), trainer.roles.as_role("policy"):
        trained_logits = trainer.roles.peft(input_ids=ids).logits
    reloaded = PeftModel.from_pretrained(
        load_base_model(ModelConfig(name=str(tiny_model_dir))), str(tmp_path / "run" / "final" / "policy")
    )
    # from_pretrained puts the model in eval mode, which on AVX512-BF16 CPUs lets bitsandbytes
    # switch to a kernel that rounds differently; compare like with like.
    keep_4bit_weights_differentiable(reloaded)
    with torch.no_grad():
        reloaded_logits = reloaded(input_ids=ids).logits
    torch.testing.assert_close(reloaded_logits, trained_logits, atol=1e-5, rtol=1e-5)


def test_python_reward_callable_overrides_recipe(tmp_path, tiny_model_dir):
    """The function's scores are the run's, as it returns them: weight 1, not normalised."""
    import json

    given = []

    def reward(prompts, completions):
        given.append([float(len(c)) for c in completions])
        return given[-1]

    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / "run"),
                                       ["train.steps=1", "train.eval=false"])
    lora_ppo.PPOTrainer(recipe, reward_fn=reward, progress=False).train()
    assert [len(scores) for scores in given] == [4]
    [metrics] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    mean = sum(given[0]) / 4
    assert metrics["objective/scores"] == pytest.approx(mean) and metrics["objective/shaped_scores"] == pytest.approx(mean)


def test_a_python_reward_is_what_the_run_records(tmp_path, tiny_model_dir):
    """recipe.yaml names the reward the run trained on: an importable function by its name (so
    `lora-ppo eval` scores with it), a local one as `kind: python` (so `eval` refuses, in one line,
    instead of scoring with the recipe's VADER)."""
    import yaml
    from typer.testing import CliRunner

    from lora_ppo.cli import app
    from tests.reward_fns import count_letter_e

    def local_reward(prompts, completions):
        return [0.0 for _ in completions]

    base = tiny_recipe_dict(tiny_model_dir, tmp_path / "unused")
    base["reward"] = {"kind": "vader", "also_log": ["textblob"]}
    for fn, expected in ((count_letter_e, {"kind": "function", "function": "tests.reward_fns:count_letter_e"}),
                         (local_reward, {"kind": "python", "name": "local_reward"})):
        run = tmp_path / fn.__name__
        recipe = lora_ppo.recipe_from_dict(base, [f"train.output_dir={run}", "train.steps=1", "train.eval=false"])
        lora_ppo.PPOTrainer(recipe, reward_fn=fn, progress=False).train()
        written = yaml.safe_load((run / "recipe.yaml").read_text(encoding="utf-8"))["reward"]
        assert {k: written[k] for k in expected} == expected and written["also_log"] == ["textblob"]

    result = CliRunner().invoke(app, ["eval", str(tmp_path / "local_reward")])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "reward.kind: python" in lines[0] and "local_reward" in lines[0]


def test_eval_batch_size_sets_how_many_held_out_prompts_generate_at_once(tmp_path, tiny_model_dir, monkeypatch):
    """data.eval_batch_size changes only the evaluation's generation batch, not training's."""
    from lora_ppo.rollout import Sampler

    batches = []
    real = Sampler.sample

    def spy(self, prompts, *args, **kwargs):
        batches.append(len(prompts))
        return real(self, prompts, *args, **kwargs)

    monkeypatch.setattr(Sampler, "sample", spy)
    d = tiny_recipe_dict(tiny_model_dir, tmp_path / "run")
    d["data"] = {**d.get("data", {}), "eval_size": 6, "eval_batch_size": 6}
    d["rollout"] = {**d.get("rollout", {}), "batch_size": 2}
    d["ppo"] = {**d.get("ppo", {}), "num_minibatches": 1, "grad_accum_steps": 1}
    trainer = lora_ppo.PPOTrainer(lora_ppo.recipe_from_dict(d), progress=False)
    trainer.evaluate()
    assert batches == [6]
    batches.clear()
    trainer.train_step()
    assert batches == [2]


def test_eval_samples_per_prompt_averages_within_prompts_and_reports_standard_error(tmp_path, tiny_model_dir):
    """Each held-out prompt is sampled eval_samples_per_prompt times; the score is the mean of
    the prompts' means and score_se the standard error across prompts."""
    seen = []

    def reward(prompts, completions):
        seen.extend(prompts)
        return [float(len(p)) for p in prompts]  # depends on the prompt only: means known exactly

    d = tiny_recipe_dict(tiny_model_dir, tmp_path / "run")
    d["data"] = {**d["data"], "eval_size": 3, "eval_samples_per_prompt": 4, "eval_batch_size": 5}
    trainer = lora_ppo.PPOTrainer(lora_ppo.recipe_from_dict(d), reward_fn=reward, progress=False)
    prompts = [row.prompt for row in trainer.parts.eval_prompts.rows]
    result = trainer.evaluate()
    assert seen == [p for p in prompts for _ in range(4)]  # 12 rows, 4 of each, in batches of 5
    lengths = torch.tensor([float(len(p)) for p in prompts], dtype=torch.float64)
    assert abs(result["score"] - lengths.mean().item()) < 1e-9
    assert abs(result["score_se"] - lengths.std().item() / 3**0.5) < 1e-9


def test_summary_reports_heldout_standard_error(tmp_path, tiny_model_dir):
    from lora_ppo.summary import format_summary

    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / "run"), ["train.steps=1"])
    summary = lora_ppo.PPOTrainer(recipe, progress=False).train()
    assert summary["heldout_score_se_before"] > 0 and summary["heldout_score_se_after"] > 0
    first = format_summary(summary).splitlines()[0]
    assert f"(± {summary['heldout_score_se_before']:.3f})" in first
    assert "score_se" not in format_summary(summary)


def test_train_again_on_the_same_trainer_is_refused_and_leaves_its_run_where_it_is(tmp_path, tiny_model_dir,
                                                                                   monkeypatch):
    """train() a second time (a notebook cell run again after Ctrl-C, or on a finished run) took
    the trainer's own run for an old one: it moved it aside and logged the rest in a new folder.
    It is refused, naming what does go on: a new trainer resumed from the newest checkpoint."""
    import os
    import signal

    from lora_ppo import trainer as trainer_module

    run = tmp_path / "run"
    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(tiny_model_dir, run,
                                                        train={"steps": 3, "eval": False, "save_every": 0}))
    real_step = trainer_module.PPOTrainer.train_step

    def interrupted_in_step_2(self):
        if self.steps_done == 1:
            os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: step 2 finishes and is saved
        return real_step(self)

    monkeypatch.setattr(trainer_module.PPOTrainer, "train_step", interrupted_in_step_2)
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    monkeypatch.undo()

    def files() -> list:
        return sorted((str(p.relative_to(tmp_path)), p.stat().st_size) for p in tmp_path.rglob("*"))

    before = files()
    with pytest.raises(RuntimeError, match=r"has started already; to go on, make a new trainer with resume='auto'"):
        trainer.train()
    assert files() == before  # nothing moved aside, nothing written

    again = lora_ppo.PPOTrainer(recipe, progress=False, resume="auto")
    assert again.steps_done == 2
    assert again.train()["steps"] == 3
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    finished = files()
    with pytest.raises(RuntimeError, match="has started already"):
        again.train()
    # step() after a finished train() logged a step past final/ into the closed log.
    with pytest.raises(RuntimeError, match=r"is closed \(final/ written, its log closed\); to go on, make a new trainer"):
        again.step([[1, 2]], [[3, 4]], [1.0])
    assert files() == finished and not list(tmp_path.glob("run.old-*"))


def test_a_trainer_takes_its_recipe_as_a_dict_or_a_file_and_says_what_it_takes_otherwise(tmp_path, tiny_model_dir):
    """`PPOTrainer({...})` or `PPOTrainer("recipe.yaml")` raised AttributeError: 'dict' object has no
    attribute 'model_copy'."""
    import yaml

    from lora_ppo.config import SFTRecipe
    from lora_ppo.reward_training import RewardTrainer
    from lora_ppo.sft.trainer import SFTTrainer

    data = tiny_recipe_dict(tiny_model_dir, tmp_path / "run", train={"steps": 1, "eval": False})
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(data))
    expected = lora_ppo.recipe_from_dict(data)
    for given in (data, str(tmp_path / "recipe.yaml"), tmp_path / "recipe.yaml"):
        assert lora_ppo.PPOTrainer(given, progress=False).recipe.model_dump() == \
            lora_ppo.PPOTrainer(expected, progress=False).recipe.model_dump()
    with pytest.raises(lora_ppo.RecipeError, match="train.stpes: unknown field"):
        lora_ppo.PPOTrainer({"train": {"stpes": 1}})
    sft = lora_ppo.recipe_from_dict({"sft": {}}, schema=SFTRecipe)
    for trainer, given, name in ((lora_ppo.PPOTrainer, sft, "SFTRecipe"), (SFTTrainer, 3, "int"),
                                 (RewardTrainer, expected, "Recipe")):
        with pytest.raises(TypeError) as err:
            trainer(given)
        wanted = {lora_ppo.PPOTrainer: "Recipe", SFTTrainer: "SFTRecipe", RewardTrainer: "RewardRecipe"}[trainer]
        assert str(err.value) == (f"{trainer.__name__}: recipe must be a {wanted}, a dict of its sections or a "
                                  f"recipe file's path, got {name}")


def test_generate_checks_its_settings_as_the_recipe_is_checked(tmp_path, tiny_model_dir):
    """`trainer.generate(prompts, temprature=0.5)` sampled at the recipe's temperature, and
    `temperature=0` was taken as given: the settings were copied in unchecked."""
    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / "run", train={"eval": False}))
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    with pytest.raises(ValueError) as err:
        trainer.generate(["The film"], temprature=0.5)
    assert str(err.value) == ("generate: unknown setting 'temprature' (it takes max_new_tokens, temperature, top_k, "
                              "top_p, stop_token)")
    with pytest.raises(ValueError, match=r"^generate: rollout.temperature: Input should be greater than 0 \(got 0\)$"):
        trainer.generate(["The film"], temperature=0)
    with pytest.raises(ValueError, match=r"^generate: rollout.max_new_tokens: Input should be greater than 0"):
        trainer.generate(["The film"], max_new_tokens=0)
    samples = trainer.generate(["The film", "A movie"], max_new_tokens=3, temperature=0.5)
    assert samples.response_mask.sum(dim=1).max() <= 3
