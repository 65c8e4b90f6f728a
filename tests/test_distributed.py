"""Data-parallel PPO: rollout gathering (no processes), then real 2-process runs on CPU (gloo,
started by `lora-ppo train --num-processes 2` through accelerate launch) against 1-process runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional
from pathlib import Path

import pytest
import torch

from lora_ppo.distributed import World
from lora_ppo.rollout import Rollout, gather_rollout
from tests.conftest import adapter_tensors, tiny_recipe_dict

REPO = Path(__file__).resolve().parents[1]
PAD = 0


@dataclass(frozen=True)
class PresetWorld(World):
    """A world whose gather returns preset shares: gather_rollout's merging without processes."""

    shares: tuple = ()

    def gather(self, obj):
        return list(self.shares)


def rollout_rows(prompt_lengths, response_lengths, seed):
    """A rollout with left-padded prompts and right-padded responses of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    B, P, T = len(prompt_lengths), max(prompt_lengths), max(response_lengths)
    positions_p, positions_t = torch.arange(P).expand(B, P), torch.arange(T).expand(B, T)
    query_mask = (positions_p >= P - torch.tensor(prompt_lengths)[:, None]).long()
    response_mask = positions_t < torch.tensor(response_lengths)[:, None]
    ids = lambda mask, shape: torch.where(mask.bool(), torch.randint(1, 50, shape, generator=g), PAD)  # noqa: E731
    floats = lambda: torch.where(response_mask, torch.randn(B, T, generator=g), 0.0)  # noqa: E731
    return Rollout(
        rows=[f"prompt {seed}-{i}" for i in range(B)], completions=[f"completion {seed}-{i}" for i in range(B)],
        query_ids=ids(query_mask, (B, P)), query_mask=query_mask, response_ids=ids(response_mask, (B, T)),
        response_mask=response_mask, old_logprobs=floats(), ref_logprobs=floats(), values=floats(),
        raw_scores=torch.randn(B, generator=g), scores=torch.randn(B, generator=g), stopped=response_mask[:, -1],
        side_scores={"textblob": [float(i) for i in range(B)]}, source_scores={}, timings={"generate": float(seed)},
    )


def trimmed(rollout: Rollout, prompt_width: int, response_width: int, rows: slice) -> Rollout:
    """Rows of `rollout` padded as a process holding only them pads them (to their own widest)."""
    per_token = {name: getattr(rollout, name)[rows, :response_width] for name in
                 ("response_ids", "response_mask", "old_logprobs", "ref_logprobs", "values")}
    return Rollout(
        rows=rollout.rows[rows], completions=rollout.completions[rows],
        query_ids=rollout.query_ids[rows, -prompt_width:], query_mask=rollout.query_mask[rows, -prompt_width:],
        **per_token, raw_scores=rollout.raw_scores[rows], scores=rollout.scores[rows], stopped=rollout.stopped[rows],
        side_scores={k: v[rows] for k, v in rollout.side_scores.items()}, source_scores={},
        timings={"generate": 1.0 + rows.start},
    )


def test_gathered_rollout_is_the_whole_batch_padded_as_one_process_pads_it():
    whole = rollout_rows([3, 5, 2, 4], [4, 2, 6, 3], seed=0)
    first, second = trimmed(whole, 5, 4, slice(0, 2)), trimmed(whole, 4, 6, slice(2, 4))
    gathered = gather_rollout(PresetWorld(0, 2, shares=(vars(first), vars(second))), first, PAD)
    for name in ("query_ids", "query_mask", "response_ids", "response_mask", "old_logprobs", "ref_logprobs",
                 "values", "raw_scores", "scores", "stopped"):
        assert torch.equal(getattr(gathered, name), getattr(whole, name)), name
    assert gathered.rows == whole.rows and gathered.completions == whole.completions
    assert gathered.side_scores == whole.side_scores
    assert gathered.timings == {"generate": 3.0}  # the slowest process's


def test_share_splits_evenly_or_refuses():
    assert World(1, 2).share([1, 2, 3, 4]) == [3, 4]
    assert World(0, 1).share([1, 2, 3]) == [1, 2, 3]
    with pytest.raises(ValueError, match="3 items do not split over 2 processes"):
        World(0, 2).share([1, 2, 3])


# ---- two real processes -----------------------------------------------------------------------


def lora_ppo(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lora_ppo", *args, "--no-progress"], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def write(path: Path, recipe: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]


def test_two_processes_make_the_same_run_as_one(tmp_path, tiny_model_dir):
    """Per-row seeded sampling: the same responses whoever generates them; advantages whitened
    over the whole batch, each process half of every minibatch, gradients summed: the same update.
    Old logprobs are rescored: read off generation they carry the KV-cached decode's float noise
    of each process's own padding (~1e-5), which Adam's first steps amplify."""
    recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "one",
                              rollout={"seed_per_row": True, "logprobs_from_generation": False},
                              ppo={"num_epochs": 2, "num_minibatches": 2}, train={"steps": 3})
    path = write(tmp_path / "recipe.yaml", recipe)
    one = lora_ppo("train", str(path))
    assert one.returncode == 0, one.stderr[-2000:]
    two = lora_ppo("train", str(path), f"train.output_dir={tmp_path / 'two'}", "--num-processes", "2")
    assert two.returncode == 0, two.stderr[-2000:]
    assert "on 2 processes" in two.stderr and two.stdout.count("held-out mean score") == 1  # the main one prints

    for role in ("policy", "value"):
        a, b = adapter_tensors(tmp_path / "one" / "final" / role), adapter_tensors(tmp_path / "two" / "final" / role)
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5)
    single, double = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert len(double) == 3  # one writer
    assert [m["dist/adapter_spread"] for m in double] == [0.0, 0.0, 0.0]  # in sync after every step
    for a, b in zip(single, double):
        # Clip fractions count exact ties that float noise breaks either way; everything else matches.
        for key in ("objective/scores", "objective/kl", "loss/policy", "loss/value", "policy/approxkl",
                    "response/length", "value/explained_var"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), key
    samples = [json.loads(line)["completion"] for line in (tmp_path / "two" / "samples.jsonl").open()]
    assert samples == [json.loads(line)["completion"] for line in (tmp_path / "one" / "samples.jsonl").open()]


def test_two_processes_play_the_same_episodes_as_one(tmp_path, tiny_model_dir):
    """Multi-turn episodes with an environment (tests.agent_envs:Again): each process plays its
    share of the episodes, the gathered batch (observation masks and turn rewards included) is
    the one a single process builds, and the update is the same."""
    recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "one", data={"chat_template": True},
                              rollout={"seed_per_row": True, "logprobs_from_generation": False,
                                       "environment": "tests.agent_envs:Again", "max_turns": 2},
                              train={"steps": 2, "eval": False})
    path = write(tmp_path / "recipe.yaml", recipe)
    one = lora_ppo("train", str(path))
    assert one.returncode == 0, one.stderr[-2000:]
    two = lora_ppo("train", str(path), f"train.output_dir={tmp_path / 'two'}", "--num-processes", "2")
    assert two.returncode == 0, two.stderr[-2000:]
    for role in ("policy", "value"):
        a, b = adapter_tensors(tmp_path / "one" / "final" / role), adapter_tensors(tmp_path / "two" / "final" / role)
        for key in a:
            torch.testing.assert_close(b[key], a[key], rtol=1e-4, atol=1e-5)
    for a, b in zip(metrics(tmp_path / "one"), metrics(tmp_path / "two")):
        for key in ("episode/turns", "episode/observation_tokens", "episode/env_reward", "response/length"):
            assert b[key] == a[key], key
        for key in ("objective/kl", "loss/policy", "loss/value"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), key


def worker(launcher: subprocess.Popen, rank: int):
    import psutil

    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "lora_ppo" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


# Loaded into each training process through PYTHONPATH: process 1 writes a marker at the start
# of step 3 (after step 2's checkpoint) and waits there to be killed, so the kill lands in the
# run however slow the machine is (process 0 waits for it in the step's first collective).
HOLD_RANK_1_IN_STEP_3 = """
import os, pathlib, threading
from lora_ppo import trainer
_train_step = trainer.PPOTrainer.train_step
def _held(self):
    if self.state.step == 2 and self.world.rank == 1:
        pathlib.Path(os.environ["LORA_PPO_TEST_MARKER"]).write_text("in step 3")
        threading.Event().wait()  # until the test kills this process
    return _train_step(self)
trainer.PPOTrainer.train_step = _held
"""


def test_a_killed_process_fails_the_run_and_its_last_checkpoint_resumes(tmp_path, tiny_model_dir):
    from lora_ppo.run_dir import RunDir

    out = tmp_path / "run"
    path = write(tmp_path / "recipe.yaml", tiny_recipe_dict(
        tiny_model_dir, out, rollout={"max_new_tokens": 12}, train={"steps": 4, "save_every": 1, "eval": False}))
    hook, marker = tmp_path / "hook", tmp_path / "in-step-3"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_RANK_1_IN_STEP_3, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{REPO}", "LORA_PPO_TEST_MARKER": str(marker)}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "lora_ppo", "train", str(path), "--num-processes", "2", "--no-progress"], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + 240  # a hung run fails instead of hanging the suite
        while not marker.exists():
            assert time.monotonic() < deadline, "process 1 never reached step 3"
            try:
                launcher.wait(timeout=0.2)
                raise AssertionError("the run ended before process 1 reached step 3")
            except subprocess.TimeoutExpired:
                pass
        victim = worker(launcher, 1)
        assert victim is not None
        victim.send_signal(signal.SIGKILL)
        assert launcher.wait(timeout=180) != 0
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)

    run = RunDir(out)
    newest = run.complete_checkpoints()[-1]
    assert not (out / "final").exists() and newest.name == "step-2"  # killed in step 3
    # A checkpoint of 2 processes resumes only with 2.
    refused = lora_ppo("train", str(path), "--resume", "auto")
    assert refused.returncode == 2
    assert "written by 2 process(es)" in refused.stderr and "--num-processes 2" in refused.stderr
    assert "Traceback" not in refused.stderr
    resumed = lora_ppo("train", str(path), "--resume", "auto", "--num-processes", "2")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]


def test_a_batch_that_does_not_split_is_refused_before_launching(tmp_path, tiny_model_dir):
    path = write(tmp_path / "recipe.yaml", tiny_recipe_dict(tiny_model_dir, tmp_path / "run", rollout={"batch_size": 6},
                                                            ppo={"num_minibatches": 1}))
    done = lora_ppo("train", str(path), "--num-processes", "4")
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: rollout.batch_size: 6 responses are 6 prompts per step "
                                   "(samples_per_prompt 1), which do not split over 4 processes")
    assert not (tmp_path / "run").exists()


def test_train_reward_refuses_to_run_in_several_processes(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from lora_ppo.cli import app

    monkeypatch.setenv("WORLD_SIZE", "2")
    result = CliRunner().invoke(app, ["train-reward", str(REPO / "recipes" / "movie_reward.yaml")])
    assert result.exit_code == 2
    assert result.output.strip() == "error: train-reward runs in one process; it was launched in 2"


def fake_run_with_checkpoint(tmp_path: Path, tiny_model_dir, processes: Optional[int]) -> tuple[Path, Path]:
    """A run folder with a recipe and one complete checkpoint's manifest, written by `processes`
    (None: the key left out, as one process writes it): the recipe's path and the checkpoint."""
    from lora_ppo.config import Recipe, recipe_to_yaml

    recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "run")
    path = write(tmp_path / "recipe.yaml", recipe)
    step = tmp_path / "run" / "checkpoints" / "step-1"
    step.mkdir(parents=True)
    (tmp_path / "run" / "recipe.yaml").write_text(recipe_to_yaml(Recipe(**recipe)), encoding="utf-8")
    manifest = {"format": 3, "step": 1, **({} if processes is None else {"processes": processes})}
    (step / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return path, step


def test_a_checkpoint_of_one_process_is_refused_before_launching_two(tmp_path, tiny_model_dir):
    from typer.testing import CliRunner

    from lora_ppo.cli import app

    path, step = fake_run_with_checkpoint(tmp_path, tiny_model_dir, None)
    result = CliRunner().invoke(app, ["train", str(path), "--resume", "auto", "--num-processes", "2"])
    assert result.exit_code == 2
    assert result.output.strip() == (f"error: --resume: checkpoint {step} was written by 1 process(es) and resumes "
                                     "exactly only with as many (--num-processes 1); this run has 2")


def test_a_checkpoint_of_two_processes_is_refused_in_one_before_the_model_loads(tmp_path, tiny_model_dir,
                                                                               monkeypatch):
    """An 8B model takes minutes to load: the refusal comes first."""
    from typer.testing import CliRunner

    from lora_ppo import trainer
    from lora_ppo.cli import app

    def loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the checkpoint was refused")

    monkeypatch.setattr(trainer, "build", loading)
    path, step = fake_run_with_checkpoint(tmp_path, tiny_model_dir, 2)
    result = CliRunner().invoke(app, ["train", str(path), "--resume", "auto"])
    assert result.exit_code == 2
    assert result.output.strip() == (f"error: --resume: checkpoint {step} was written by 2 process(es) and resumes "
                                     "exactly only with as many (--num-processes 2); this run has 1")
