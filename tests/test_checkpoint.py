"""Exact resume: a run killed with SIGKILL (or mid-save) and resumed ends with the same adapters
and metrics as an uninterrupted run; partial checkpoints are never picked; changed recipes are
refused unless the change is harmless; saved state is only ever loaded with weights_only."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import lora_ppo
from lora_ppo import checkpoint
from lora_ppo.cli import app
from lora_ppo.errors import RecipeError
from lora_ppo.run_dir import MANIFEST_FILE, RunDir
from tests.conftest import (
    adapter_tensors,
    deterministic_metrics,
    tiny_recipe_dict,
    write_recipe,
)

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _train_cmd(recipe: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lora_ppo.cli", "train", str(recipe), "--no-progress", *extra]


def _assert_same_run(a: Path, b: Path) -> None:
    assert deterministic_metrics(a) == deterministic_metrics(b)
    for role in ("policy", "value"):
        ta, tb = adapter_tensors(a / "final" / role), adapter_tensors(b / "final" / role)
        assert ta.keys() == tb.keys()
        for key in ta:
            assert torch.equal(ta[key], tb[key]), f"{role} {key} differs"
    assert (a / "samples.jsonl").read_text() == (b / "samples.jsonl").read_text()


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_model_dir) -> Path:
    """An uninterrupted 4-step run of the shared recipe, through the CLI in a subprocess."""
    root = tmp_path_factory.mktemp("reference")
    recipe = write_recipe(root / "tiny.yaml", tiny_model_dir, root / "run")
    subprocess.run(_train_cmd(recipe), env=ENV, cwd=REPO, check=True, capture_output=True, timeout=300)
    return root / "run"


# Loaded into the training subprocess through PYTHONPATH: at the start of step 3 (after step 2's
# checkpoint) the run writes a marker and waits to be killed, so the kill lands in step 3 however
# slow the machine is.
HOLD_IN_STEP_3 = """
import os, pathlib, threading
from lora_ppo import trainer
_train_step = trainer.PPOTrainer.train_step
def _held(self):
    if self.state.step == 2:
        pathlib.Path(os.environ["LORA_PPO_TEST_MARKER"]).write_text("in step 3")
        threading.Event().wait()  # until the test kills this process
    return _train_step(self)
trainer.PPOTrainer.train_step = _held
"""


def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path, tiny_model_dir, reference_run):
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "run")
    run, hook, marker = tmp_path / "run", tmp_path / "hook", tmp_path / "in-step-3"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_IN_STEP_3, encoding="utf-8")
    env = {**ENV, "PYTHONPATH": f"{hook}{os.pathsep}{REPO}", "LORA_PPO_TEST_MARKER": str(marker)}
    proc = subprocess.Popen(_train_cmd(recipe), env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        proc_ended, deadline = None, time.monotonic() + 300  # a hung run fails instead of hanging the suite
        while not marker.exists() and proc_ended is None:
            assert time.monotonic() < deadline, "no marker from step 3 in 300 s"
            try:
                proc_ended = proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
        assert proc_ended is None, "the run ended before step 3"
        assert (run / "checkpoints" / "step-2" / MANIFEST_FILE).exists()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (run / "final").exists()
    done = subprocess.run(_train_cmd(recipe, "--resume", "auto"), env=ENV, cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "from step" in done.stderr
    _assert_same_run(reference_run, run)


class SimulatedKill(BaseException):
    """Stands in for a kill landing inside a checkpoint write."""


def test_kill_during_save_leaves_previous_checkpoint_and_resume_skips_partial(
    tmp_path, tiny_model_dir, reference_run, monkeypatch
):
    from lora_ppo import atomic

    # In this process, with the thread count of the reference's subprocesses (OMP_NUM_THREADS=1):
    # float reductions, the KV-cached decode's among them, round differently with other counts.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _kill_during_save_then_resume(tmp_path, tiny_model_dir, reference_run, monkeypatch, atomic)
    finally:
        torch.set_num_threads(threads)


def _kill_during_save_then_resume(tmp_path, tiny_model_dir, reference_run, monkeypatch, atomic) -> None:
    recipe_dict = tiny_recipe_dict(tiny_model_dir, tmp_path / "run", train={"save_every": 1, "steps": 4})
    real_fsync_tree = atomic.fsync_tree

    def dies_on_step_2(folder):
        if folder.name.startswith(".step-2.tmp-"):
            raise SimulatedKill  # everything is staged, nothing renamed
        real_fsync_tree(folder)

    monkeypatch.setattr(atomic, "fsync_tree", dies_on_step_2)
    with pytest.raises(SimulatedKill):
        lora_ppo.PPOTrainer(lora_ppo.recipe_from_dict(recipe_dict), progress=False).train()
    monkeypatch.setattr(atomic, "fsync_tree", real_fsync_tree)
    run, ckpts = RunDir(tmp_path / "run"), tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-1"]
    # What a SIGKILL during the write leaves behind (no cleanup runs): a staging folder.
    partial = ckpts / ".step-2.tmp-killed"
    shutil.copytree(ckpts / "step-1", partial)
    (partial / MANIFEST_FILE).unlink()
    recipe = lora_ppo.recipe_from_dict(recipe_dict)
    assert checkpoint.resolve_resume(run, "auto", recipe) == ckpts / "step-1"
    with pytest.raises(RecipeError, match="not a complete checkpoint"):
        checkpoint.resolve_resume(run, partial, recipe)

    lora_ppo.PPOTrainer(recipe, progress=False, resume="auto").train()
    assert not partial.exists()  # the next save cleared it
    _assert_same_run(reference_run, tmp_path / "run")


def test_disk_full_while_saving_is_one_clear_error_and_previous_checkpoint_intact(
    tmp_path, tiny_model_dir, monkeypatch
):
    import errno

    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "run", eval=False)
    real_save = torch.save

    def full_disk(obj, path, *args, **kwargs):
        if ".step-2.tmp" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    result = CliRunner().invoke(app, ["train", str(recipe), "--no-progress"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: could not save checkpoint {tmp_path / 'run' / 'checkpoints' / 'step-2'}: "
                                "no space left on the device; it needs about ")
    assert "earlier checkpoints are intact" in lines[-1]
    assert "Traceback" not in result.output
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-1"]
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    trainer = lora_ppo.PPOTrainer(lora_ppo.load_recipe(recipe), progress=False, resume="auto")
    assert trainer.steps_done == 1



def _one_step_trainer(output_dir: Path, tiny_model_dir: Path, **train):
    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(tiny_model_dir, output_dir,
                                                        train={"eval": False, "steps": 4, **train}))
    return recipe, lora_ppo.PPOTrainer(recipe, progress=False)


@pytest.mark.parametrize("checkpoint_name, kept", [("final", 3), ("checkpoints/step-2", 2)])
def test_a_checkpoint_of_another_run_continues_in_a_new_output_dir(tmp_path, finished_run, tiny_model_dir,
                                                                    checkpoint_name, kept):
    """`PPOTrainer(recipe, resume=<run>/final)` with a new train.output_dir (docs/recipe.md: it may
    change on resume): the recipe is checked against the checkpoint's own run, the new folder
    starts with that run's lines up to the checkpoint, and the old run is left as it was."""
    before = {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()}
    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(
        tiny_model_dir, tmp_path / "branch", reward={"also_log": ["textblob"]},
        train={"steps": 4, "sample_every": 1, "save_every": 2}))
    trainer = lora_ppo.PPOTrainer(recipe, progress=False, resume=finished_run / checkpoint_name)
    assert trainer.steps_done == kept
    trainer.train()
    old, new = deterministic_metrics(finished_run), deterministic_metrics(tmp_path / "branch")
    assert [m["step"] for m in new] == list(range(1, 5)) and new[:kept] == old[:kept]
    assert checkpoint.is_checkpoint(tmp_path / "branch" / "final")
    assert {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()} == before

    taken = lora_ppo.recipe_from_dict(tiny_recipe_dict(
        tiny_model_dir, tmp_path / "branch", reward={"also_log": ["textblob"]}, train={"steps": 5}))
    with pytest.raises(RecipeError, match="train.output_dir: .* already holds a run"):
        lora_ppo.PPOTrainer(taken, progress=False, resume=finished_run / "final")


def _assert_needs_more_than_is_free(message: str, folder: Path) -> None:
    found = re.fullmatch(rf"could not save checkpoint {re.escape(str(folder))}: no space left on the device; it needs "
                         rf"about (\d+) kB free in {re.escape(str(folder.parent))} and (\d+) kB are free; earlier "
                         r"checkpoints are intact \(free some space, then resume with --resume auto\)", message)
    assert found, message
    assert int(found.group(1)) > int(found.group(2))


def test_a_real_full_disk_while_a_checkpoint_is_written_leaves_the_previous_one_resumable(tmp_path, tiny_model_dir):
    """On a real tmpfs: step 1's checkpoint fits; the disk is then filled to just over what the
    next checkpoint's tensors take, so it passes the free-space check and its files fill the device
    mid-write. One DiskFullError naming the folder; no staging folder or step-2 left; step 1 resumes."""
    from tests.mounts import fill_until_free, tmpfs

    with tmpfs(tmp_path / "disk", size_kb=2048) as disk:
        recipe, trainer = _one_step_trainer(disk / "run", tiny_model_dir, save_every=1)
        queries = [[5, 17, 42], [9, 33, 61, 7]]
        responses = [[12, 40, 2], [8, 8, 19, 2]]
        trainer.step(queries, responses, [1.0, 0.0])
        ckpts = disk / "run" / "checkpoints"
        assert checkpoint.is_checkpoint(ckpts / "step-1")
        needed = checkpoint.saved_bytes(trainer._trainables())
        filler = fill_until_free(disk, needed + 8192)
        assert needed <= shutil.disk_usage(disk).free < needed + 16384
        with pytest.raises(checkpoint.DiskFullError) as raised:
            trainer.step(queries, responses, [1.0, 0.0])
        _assert_needs_more_than_is_free(str(raised.value), ckpts / "step-2")
        assert sorted(p.name for p in ckpts.iterdir()) == ["step-1"]  # no staging folder, no step-2
        filler.unlink()
        resumed = lora_ppo.PPOTrainer(recipe, progress=False, resume="auto")
        assert resumed.steps_done == 1 and resumed.resume_from == ckpts / "step-1"


def test_a_checkpoint_that_cannot_fit_is_refused_in_one_line_before_a_byte_is_written(tmp_path, tiny_model_dir):
    """The CLI on a real tmpfs with less free space than the final checkpoint's tensors: one line,
    exit 2, and nothing of final/ (nor a staging folder) in the run folder."""
    from tests.mounts import fill_until_free, tmpfs

    with tmpfs(tmp_path / "disk", size_kb=2048) as disk:
        fill_until_free(disk, 64 * 1024)
        recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, disk / "run", eval=False, steps=1, save_every=0)
        result = CliRunner().invoke(app, ["train", str(recipe), "--no-progress"])
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2, result.output
        _assert_needs_more_than_is_free(lines[-1].removeprefix("error: "), disk / "run" / "final")
        assert "Traceback" not in result.output
        assert sorted(p.name for p in (disk / "run").iterdir()) == ["metrics.jsonl", "recipe.yaml", "samples.jsonl"]
        assert not RunDir(disk / "run").has_checkpoint()


def test_changed_recipe_is_refused_with_the_differences_and_harmless_changes_allowed(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "run", steps=3, eval=False,
                          keep_last=1)
    runner = CliRunner()
    first = runner.invoke(app, ["train", str(recipe), "--no-progress"])
    assert first.exit_code == 0, first.output
    refused = runner.invoke(
        app, ["train", str(recipe), "rollout.batch_size=8", "adapters.policy.r=8", "train.steps=4",
              "--resume", "auto"],
    )
    assert refused.exit_code == 2
    assert refused.stderr.strip().splitlines() == [
        f"error: --resume: the recipe differs from the run's {tmp_path / 'run' / 'recipe.yaml'} in fields a "
        "resumed run cannot change: adapters.policy.r, rollout.batch_size"
    ]
    allowed = runner.invoke(
        app, ["train", str(recipe), "train.steps=4", "train.log_every=2", "--resume", "auto"]
    )
    assert allowed.exit_code == 0, allowed.output
    assert len(deterministic_metrics(tmp_path / "run")) == 4
    # keep_last=1: of step-1 and step-2 only the newest stays (step 3 resumed from final/, step 4 is final/).
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-2"]


def test_resume_without_checkpoint_fails_in_one_line(tmp_path, tiny_model_dir):
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "run")
    result = CliRunner().invoke(app, ["train", str(recipe), "--resume", "auto"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --resume auto: no complete checkpoint under {tmp_path / 'run'}"
    ]


def test_checkpoint_holds_the_whole_state(tmp_path, tiny_model_dir):
    import json

    recipe = lora_ppo.recipe_from_dict(
        tiny_recipe_dict(tiny_model_dir, tmp_path / "run", train={"save_every": 1, "steps": 2, "eval": False},
                         ppo={"lr_schedule": "linear", "target_kl": 0.1, "score_norm": True})
    )
    lora_ppo.PPOTrainer(recipe, progress=False).train()
    folder = tmp_path / "run" / "checkpoints" / "step-1"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["step"] == 1 and set(manifest["versions"]) >= {"lora_ppo", "torch", "peft"}
    assert len(manifest["recipe_sha256"]) == 64
    for name in ("policy/adapter_model.safetensors", "value/adapter_model.safetensors",
                 "value/value_head.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "trainer_state.json"):
        assert (folder / name).is_file(), name
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["prompt_position"] == [0, 4] and state["metrics_lines"] == 1 and state["score_moments"][2] == 4
    assert state["kl_coef"] != 0.05  # the adaptive controller moved it
    for name in ("optimizer.pt", "scheduler.pt", "rng.pt"):
        torch.load(folder / name, weights_only=True)
    # merge-and-export still reads a checkpoint folder (its policy/ and the run's recipe.yaml).
    report = lora_ppo.merge_and_export(folder, tmp_path / "exported", adapter_only=True)
    assert (tmp_path / "exported" / "adapter_model.safetensors").is_file() and report.checkpoint == folder


def test_saved_state_is_only_loaded_with_weights_only():
    for path in Path(lora_ppo.__file__).parent.glob("*.py"):
        for call in re.findall(r"torch\.load\([^)]*\)", path.read_text()):
            assert "weights_only=True" in call, f"{path.name}: {call}"


def test_finished_run_continued_with_more_steps_matches_uninterrupted_run(tmp_path, tiny_model_dir, reference_run):
    # final/ is a full checkpoint: 2 steps, finished (evaluated, summary written), then 2 more.
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "run")
    first = subprocess.run(_train_cmd(recipe, "train.steps=2"), env=ENV, cwd=REPO, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stderr
    more = subprocess.run(_train_cmd(recipe, "--resume", "auto", "train.steps=4"), env=ENV, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert more.returncode == 0, more.stderr
    assert "from step 2" in more.stderr
    _assert_same_run(reference_run, tmp_path / "run")


def test_resume_auto_goes_back_past_a_checkpoint_it_cannot_read(tmp_path, tiny_model_dir, caplog):
    """final/ cut short (its policy adapter half written: a full disk, a bad copy): --resume auto
    says so and continues from checkpoints/step-2 instead; a named checkpoint with a garbage
    optimizer.pt is one line and exit 2."""
    import logging

    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "run", steps=3, eval=False)
    assert CliRunner().invoke(app, ["train", str(recipe), "--no-progress"]).exit_code == 0
    run = tmp_path / "run"
    weights = run / "final" / "policy" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="lora_ppo.checkpoint"):
        result = CliRunner().invoke(app, ["train", str(recipe), "--no-progress", "train.steps=4", "--resume", "auto"])
    assert result.exit_code == 0, result.stderr
    assert f"checkpoint {run / 'final'} cannot be loaded" in caplog.text and "goes back to" in caplog.text
    assert f"from step 2 ({run / 'checkpoints' / 'step-2'})" in result.stderr
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]

    (run / "checkpoints" / "step-3" / "optimizer.pt").write_bytes(b"not a pickle at all")
    result = CliRunner().invoke(app, ["train", str(recipe), "--no-progress", "train.steps=5", "--resume",
                                 str(run / "checkpoints" / "step-3")])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: --resume: checkpoint {run / 'checkpoints' / 'step-3'} cannot be loaded: ")


def test_a_cut_short_final_gives_way_to_a_checkpoint_of_its_own_step(tmp_path, tiny_model_dir, caplog):
    """A checkpoint of final/'s own step beside it (here a copy, as a user keeps one): when final/
    cannot be read, --resume auto takes that one, as new as final/, not step-1, and says so once."""
    import logging

    recipe, trainer = _one_step_trainer(tmp_path / "run", tiny_model_dir, steps=2, save_every=1)
    trainer.train()
    run = tmp_path / "run"
    shutil.copytree(run / "final", run / "checkpoints" / "step-2")
    (run / "final" / "optimizer.pt").write_bytes(b"cut short")
    with caplog.at_level(logging.WARNING, logger="lora_ppo.checkpoint"):
        resumed = lora_ppo.PPOTrainer(recipe, progress=False, resume="auto")
    assert resumed.resume_from == run / "checkpoints" / "step-2" and resumed.steps_done == 2
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"checkpoint {run / 'final'} cannot be loaded: ")
    assert warning.endswith(f"; --resume auto goes back to {run / 'checkpoints' / 'step-2'}")


def test_samples_are_written_at_the_end_and_a_continued_run_drops_them(tmp_path, tiny_model_dir):
    """train.sample_every 2 over 3 steps: samples at step 2 and at the end (3). Continued to 4
    steps from final/, the run samples as one that never stopped at 3: steps 2 and 4."""
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "run", steps=3, eval=False,
                          sample_every=2, save_every=0)
    samples = tmp_path / "run" / "samples.jsonl"

    def sampled_steps() -> list[int]:
        return sorted({json.loads(line)["step"] for line in samples.read_text().splitlines()})

    assert CliRunner().invoke(app, ["train", str(recipe), "--no-progress"]).exit_code == 0
    assert sampled_steps() == [2, 3]
    result = CliRunner().invoke(app, ["train", str(recipe), "--no-progress", "train.steps=4", "--resume", "auto"])
    assert result.exit_code == 0, result.stderr
    assert sampled_steps() == [2, 4]


def test_a_moved_run_resumes_where_it_is_now(tmp_path, tiny_model_dir):
    """A run folder moved (or copied to another machine) resumes from its own recipe.yaml: the
    run is where that file is, whatever train.output_dir it recorded."""
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "first" / "run", steps=2, eval=False)
    assert CliRunner().invoke(app, ["train", str(recipe), "--no-progress"]).exit_code == 0
    moved = tmp_path / "moved" / "run"
    moved.parent.mkdir()
    shutil.move(str(tmp_path / "first" / "run"), moved)
    result = CliRunner().invoke(app, ["train", str(moved / "recipe.yaml"), "--no-progress", "train.steps=3",
                                      "--resume", "auto"])
    assert result.exit_code == 0, result.stderr
    assert f"from step 2 ({moved / 'final'})" in result.stderr
    assert [json.loads(line)["step"] for line in (moved / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert not (tmp_path / "first" / "run").exists()
