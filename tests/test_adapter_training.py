"""What `train-reward` and `train-sft` share (lora_ppo/adapter_training.py), on the tiny 4-bit model:
the learning-rate schedule each step logs, the progress bar a Python caller gets by default and the
log lines without one, step checkpoints, what is refused before the base model loads, `--resume auto`
going back past a checkpoint it cannot read where a named one is refused, a finished run resumed,
trackers finished after a Ctrl-C. Each stage's own numbers are in test_reward_training.py and
test_sft_training.py."""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lora_ppo.cli import app
from lora_ppo.config import RewardRecipe, SFTRecipe, recipe_from_dict
from lora_ppo.errors import RecipeError
from lora_ppo.reward_training import RewardTrainer
from lora_ppo.sft.trainer import SFTTrainer
from tests.sft_helpers import demonstration_rows, sft_recipe_dict, write_jsonl
from tests.test_reward_training import preference_rows, reward_recipe_dict

STAGES = {"sft": (SFTTrainer, SFTRecipe, "train-sft"), "reward": (RewardTrainer, RewardRecipe, "train-reward")}


# One training row each stage drops, and what it says of it once the run starts.
UNUSABLE = {"sft": ({"prompt": "Review 99: the film was", "completion": " "}, "dropped training rows from {}: 1 empty"),
            "reward": ({"prompt": "x", "chosen": " a", "rejected": " a"},
                       "dropped preference pairs from {}: 1 chosen equals rejected")}


def stage_recipe(stage: str, model_dir: Path, folder: Path, **train) -> dict:
    """A recipe of `stage` over 16 usable training rows and one it drops (and 4 held-out rows) in
    `folder`/run."""
    folder.mkdir(parents=True, exist_ok=True)
    if stage == "sft":
        data = write_jsonl(folder / "train.jsonl", demonstration_rows(16) + [UNUSABLE[stage][0]])
        held_out = write_jsonl(folder / "held.jsonl", demonstration_rows(4, start=500))
        return sft_recipe_dict(model_dir, data, held_out, folder / "run", **train)
    data = write_jsonl(folder / "train.jsonl", preference_rows(16) + [UNUSABLE[stage][0]])
    held_out = write_jsonl(folder / "held.jsonl", preference_rows(4, start=500))
    return reward_recipe_dict(model_dir, data, held_out, folder / "run", **train)


def metric_lines(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("stage", list(STAGES))
def test_the_linear_schedule_reaches_zero_at_the_last_step_and_python_callers_get_a_bar(
        stage, tmp_path, tiny_model_dir, capsys, caplog):
    """train.lr_schedule linear: 16 rows in batches of 4 are 4 steps; the rate a step logs is the
    one the next step uses, lr x (1 - step / 4), so the last reads 0. Constructed from Python with
    no `progress` argument, a run shows its progress bar; the row it dropped is said once."""
    trainer_type, schema, _ = STAGES[stage]
    recipe = stage_recipe(stage, tiny_model_dir, tmp_path, epochs=1, batch_size=4, lr_schedule="linear",
                          learning_rate=1e-2, eval_every=0, save_every=2)
    with caplog.at_level(logging.WARNING, logger=trainer_type.__module__):
        trainer_type(recipe_from_dict(recipe, schema=schema)).train()
    said = [r.getMessage() for r in caplog.records if r.name == trainer_type.__module__]
    assert said == [UNUSABLE[stage][1].format(tmp_path / "train.jsonl")]
    assert [m["lr"] for m in metric_lines(tmp_path / "run")] == pytest.approx([7.5e-3, 5e-3, 2.5e-3, 0.0], abs=1e-12)
    bar = capsys.readouterr().err
    assert f"{trainer_type.label}: 100%" in bar and "4/4" in bar and "loss=" in bar
    # save_every 2: step 2's checkpoint; the last step's state is final/, not a second copy.
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-2"]


@pytest.mark.parametrize("stage", list(STAGES))
def test_the_constant_schedule_keeps_the_rate_and_a_log_has_a_line_every_log_every_steps(
        stage, tmp_path, tiny_model_dir, capsys):
    trainer_type, schema, _ = STAGES[stage]
    recipe = stage_recipe(stage, tiny_model_dir, tmp_path, epochs=2, batch_size=8, lr_schedule="constant",
                          learning_rate=1e-2, eval_every=0, log_every=2)
    trainer_type(recipe_from_dict(recipe, schema=schema), progress=False).train()
    metrics = metric_lines(tmp_path / "run")
    assert [m["lr"] for m in metrics] == [1e-2] * 4
    shown = {"sft": "loss {sft/loss:.3f}  perplexity {sft/perplexity:.2f}",
             "reward": "loss {loss:.3f}  accuracy {accuracy:.2f}"}[stage]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert lines == [f"step {m['step']}/4  " + shown.format(**m) + f"  {m['time/step']:.1f}s" for m in metrics[1::2]]


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("refused", ["tracker", "start adapter"])
def test_a_missing_tracker_or_start_adapter_is_one_line_before_the_model_loads(stage, refused, tmp_path,
                                                                                tiny_model_dir, monkeypatch):
    """A tracker whose package is missing, or an adapter.init_from folder with no adapter in it, is
    refused in one line, exit 2, before the base model's weights load (minutes on a real model)."""
    import lora_ppo.model

    trainer_type, _, command = STAGES[stage]
    recipe = stage_recipe(stage, tiny_model_dir, tmp_path, epochs=1, batch_size=8)
    if refused == "tracker":
        recipe["train"]["report_to"] = ["wandb"]
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else
                            find_spec(name, *a))
        message = "error: train.report_to: wandb is not installed; pip install 'lora_ppo[wandb]'"
    else:
        (tmp_path / "empty").mkdir()
        recipe["adapter"]["init_from"] = str(tmp_path / "empty")
        message = f"error: adapter.init_from: '{tmp_path / 'empty'}' is not a PEFT adapter folder"

    def no_weights(*args, **kwargs):
        raise AssertionError("the base model loaded before the recipe was refused")

    monkeypatch.setattr(lora_ppo.model, "load_base_model", no_weights)
    monkeypatch.setattr(f"{trainer_type.__module__}.load_base_model", no_weights)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(app, [command, str(path), "--no-progress"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith(message), lines
    assert not (tmp_path / "run").exists()


def test_resume_auto_goes_back_past_a_checkpoint_it_cannot_read_and_a_named_one_is_refused(
        tmp_path, tiny_model_dir, monkeypatch, caplog):
    """Stopped in step 3 with a checkpoint after each step (step-1, step-2 on disk) and step-2's
    optimizer.pt garbage: `--resume auto` warns and resumes from step-1; naming step-2 is refused."""
    recipe = recipe_from_dict(stage_recipe("sft", tiny_model_dir, tmp_path, epochs=1, batch_size=4, save_every=1,
                                           eval_every=0), schema=SFTRecipe)
    real_step = SFTTrainer.train_step

    def stopped_in_step_3(self):
        metrics = real_step(self)
        if self.state.step == 3:
            raise KeyboardInterrupt
        return metrics

    monkeypatch.setattr(SFTTrainer, "train_step", stopped_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        SFTTrainer(recipe, progress=False).train()
    monkeypatch.undo()
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-1", "step-2"]
    (checkpoints / "step-2" / "optimizer.pt").write_bytes(b"not a torch file")

    caplog.set_level(logging.INFO)
    resumed = SFTTrainer(recipe, progress=False, resume="auto")
    assert resumed.resume_from == checkpoints / "step-1" and resumed.state.step == 1
    assert f"resuming from {checkpoints / 'step-1'} (step 1)" in caplog.messages
    [warning] = [r.getMessage() for r in caplog.records if r.name == "lora_ppo.checkpoint"]
    # Said plainly: not torch's advice to load the file with weights_only=False.
    unreadable = f"checkpoint {checkpoints / 'step-2'} cannot be loaded: optimizer.pt is not a file torch.save wrote " \
        "(cut short or replaced)"
    assert warning == f"{unreadable}; --resume auto goes back to {checkpoints / 'step-1'}"

    with pytest.raises(RecipeError) as refused:
        SFTTrainer(recipe, progress=False, resume=checkpoints / "step-2")
    assert str(refused.value) == f"--resume: {unreadable}"


def test_a_finished_run_resumed_ends_with_the_same_summary(tmp_path, tiny_model_dir):
    """`--resume auto` on a finished run takes final/ (every step done): no step runs, and the
    summary's held-out "after" is measured again, equal to the first one's."""
    recipe = recipe_from_dict(stage_recipe("sft", tiny_model_dir, tmp_path, epochs=1, batch_size=8, eval_every=0),
                              schema=SFTRecipe)
    t0 = time.perf_counter()
    first = SFTTrainer(recipe, progress=False).train()
    assert 0 < first["wall_time_s"] <= time.perf_counter() - t0
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    again = SFTTrainer(recipe, progress=False, resume="auto")
    assert again.resume_from == tmp_path / "run" / "final" and again.state.step == 2
    second = again.train()
    assert (second["steps"], second["heldout_loss_after"]) == (2, first["heldout_loss_after"])
    assert second["heldout_loss_before"] == first["heldout_loss_before"]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics


def test_trackers_finish_when_a_run_ends_and_when_ctrl_c_stops_it_before_its_bar(tmp_path, tiny_model_dir,
                                                                                  monkeypatch):
    """The trackers' runs are finished (their files complete, W&B's run closed) at the end, and
    when Ctrl-C lands in the first held-out evaluation, before the progress bar exists: the
    KeyboardInterrupt is what the caller gets."""
    from lora_ppo.tracking import Trackers

    finished = []
    monkeypatch.setattr(Trackers, "finish", lambda self: finished.append([t.name for t in self.trackers]))
    recipe = recipe_from_dict(stage_recipe("sft", tiny_model_dir, tmp_path, epochs=1, batch_size=8,
                                           report_to=["tensorboard"]), schema=SFTRecipe)
    SFTTrainer(recipe, progress=False).train()
    assert finished == [["tensorboard"]]

    def ctrl_c(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(SFTTrainer, "evaluate", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        SFTTrainer(recipe.model_copy(update={"train": recipe.train.model_copy(update={"overwrite": True})}),
                   progress=False).train()
    assert finished == [["tensorboard"], ["tensorboard"]]
