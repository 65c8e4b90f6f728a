"""Guards: a NaN/inf in a step's quantities skips its update without touching the adapters;
too many in a row stop the run with a checkpoint; Ctrl-C / SIGTERM finish the step, save and
say how to resume; reward functions that misbehave are named."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import pytest
import torch
from typer.testing import CliRunner

import lora_ppo
from lora_ppo import ppo_math
from lora_ppo import trainer as trainer_module
from lora_ppo.cli import app
from lora_ppo.perf import StepWork
from lora_ppo.rewards import RewardError
from tests.conftest import adapter_tensors, tiny_recipe_dict, write_recipe


def _recipe(tiny_model_dir, out, **train):
    return lora_ppo.recipe_from_dict(
        tiny_recipe_dict(tiny_model_dir, out, train={"save_every": 1, "steps": 3, "eval": False, **train})
    )


def _poison_advantages(monkeypatch, bad_steps: set[int], counter: list[int]) -> None:
    real = trainer_module.compute_advantages

    def poisoned(*args, **kwargs):
        adv = real(*args, **kwargs)
        counter[0] += 1
        if counter[0] in bad_steps:
            return dataclasses.replace(adv, advantages=torch.full_like(adv.advantages, float("nan")))
        return adv

    monkeypatch.setattr(trainer_module, "compute_advantages", poisoned)


def test_nan_advantages_skip_the_update_and_leave_adapters_untouched(tmp_path, tiny_model_dir, monkeypatch, caplog):
    _poison_advantages(monkeypatch, {2}, [0])
    checks = []
    real_check = trainer_module.first_step_logprob_error
    monkeypatch.setattr(trainer_module, "first_step_logprob_error", lambda *a: checks.append(a) or real_check(*a))
    rated = []  # the seconds each step's perf/* divide by
    real_rates = StepWork.metrics
    monkeypatch.setattr(StepWork, "metrics", lambda self, shape, seconds: rated.append(seconds) or real_rates(self, shape, seconds))
    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / "run", ppo={"lr_schedule": "linear"},
                                                        train={"save_every": 1, "steps": 4, "eval": False}))
    started = time.perf_counter()
    lora_ppo.PPOTrainer(recipe, progress=False).train()
    wall = time.perf_counter() - started
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["guard/skipped"] for m in metrics] == [0.0, 1.0, 0.0, 0.0]
    assert [m["guard/consecutive_skips"] for m in metrics] == [0.0, 1.0, 0.0, 0.0]
    assert metrics[1]["guard/skipped_minibatches"] == 2.0  # 1 epoch x 2 minibatches
    assert "step 2: non-finite advantages, update skipped" in caplog.text
    # The linear schedule counts the skipped step's 2 updates too: after step n, 1e-2 x (1 - 2n / 8).
    assert [m["lr/policy"] for m in metrics] == pytest.approx([7.5e-3, 5e-3, 2.5e-3, 0.0])
    assert len(checks) == 1  # the logprob self-check stops a first step only; later ones are the alarms'
    # An update's rate is logged where one ran, and its time lies within its step's, within the run's.
    assert ["perf/update_tflops" in m for m in metrics] == [True, False, True, True]
    assert [r["update"] for r in rated] == [m["time/update"] if i != 1 else 0.0 for i, m in enumerate(metrics)]
    assert all(0 < m["time/update"] <= m["time/step"] for i, m in enumerate(metrics) if i != 1)
    assert sum(m["time/step"] for m in metrics) <= wall
    assert not any(key.startswith("dist/") for m in metrics for key in m)  # one process: nothing to compare
    ckpts = tmp_path / "run" / "checkpoints"
    for role in ("policy", "value"):
        step1, step2, step3 = (adapter_tensors(ckpts / f"step-{n}" / role) for n in (1, 2, 3))
        assert all(torch.equal(step1[k], step2[k]) for k in step1), f"{role} changed in a skipped step"
        assert any(not torch.equal(step2[k], step3[k]) for k in step2), f"{role} did not train after the skip"


def test_nan_loss_skips_the_minibatch(tmp_path, tiny_model_dir, monkeypatch):
    real = ppo_math.policy_loss

    def nan_loss(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        return loss * float("nan"), stats

    monkeypatch.setattr(ppo_math, "policy_loss", nan_loss)
    trainer = lora_ppo.PPOTrainer(_recipe(tiny_model_dir, tmp_path / "run", steps=1, save_every=0), progress=False)
    before = {n: p.detach().clone() for n, p in trainer.roles.peft.named_parameters() if "lora_" in n}
    trainer.train()
    after = dict(trainer.roles.peft.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text())
    assert metrics["guard/skipped"] == 1.0 and metrics["guard/skipped_minibatches"] == 2.0


def test_consecutive_skips_stop_the_run_with_a_checkpoint(tmp_path, tiny_model_dir, monkeypatch):
    _poison_advantages(monkeypatch, set(range(2, 100)), [0])
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "run", steps=10, save_every=0,
                          max_consecutive_skips=2, eval=False)
    result = CliRunner().invoke(app, ["train", str(recipe), "--no-progress"])
    assert result.exit_code == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: step 3: 2 updates in a row skipped for NaN/inf (non-finite advantages at step 3)")
    assert "Traceback" not in result.output
    good = adapter_tensors(tmp_path / "run" / "checkpoints" / "step-3" / "policy")
    # The halted checkpoint holds the adapters as step 1 left them.
    monkeypatch.undo()
    one = tmp_path / "one"
    lora_ppo.PPOTrainer(_recipe(tiny_model_dir, one, steps=1, save_every=0), progress=False).train()
    step1 = adapter_tensors(one / "final" / "policy")
    assert all(torch.equal(good[k], step1[k]) for k in good)


def test_sigterm_finishes_the_step_saves_and_says_how_to_resume(tmp_path, tiny_model_dir, monkeypatch):
    real_step = trainer_module.PPOTrainer.train_step

    def step_then_term(self):
        out = real_step(self)
        if self.steps_done == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(trainer_module.PPOTrainer, "train_step", step_then_term)
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "run", save_every=0, eval=False)
    result = CliRunner().invoke(app, ["train", str(recipe), "--no-progress"])
    assert result.exit_code == 130
    assert "stopping after this step to save a checkpoint (again to abandon the step)" in result.stderr
    assert "interrupted at step 2: checkpoint saved to" in result.stderr
    assert f"resume with: lora-ppo train {recipe} --resume auto" in result.stderr
    assert (tmp_path / "run" / "checkpoints" / "step-2" / "manifest.json").is_file()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_one_sigterm_abandons_a_step_stuck_in_a_reward_function_without_timeout(tmp_path, tiny_model_dir, monkeypatch,
                                                                                 capfd):
    """A reward with no reward.timeout_s that hangs at step 2: the first SIGTERM (sent from inside
    it, so the moment is fixed) abandons the step once it has been stuck STUCK_GRACE_S (0 here),
    instead of waiting for a second signal. Exit 130, step 1's checkpoint resumes."""
    import threading

    from lora_ppo import signals

    monkeypatch.setattr(signals, "STUCK_GRACE_S", 0.0)
    released = threading.Event()
    calls = []

    def hangs_at_step_2(prompts, completions):
        calls.append(len(completions))
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            released.wait(timeout=30)  # abandoned long before; without the fix the step goes on
        return [0.0] * len(completions)

    recipe = _recipe(tiny_model_dir, tmp_path / "run", steps=3, save_every=1)
    trainer = lora_ppo.PPOTrainer(recipe, reward_fn=hangs_at_step_2, progress=False)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
    finally:
        released.set()
    assert len(calls) == 2 and trainer.steps_done == 1
    assert ("reward function hangs_at_step_2 is still running 0 s after the stop request: abandoning the step (the "
            "run resumes from its newest checkpoint)") in capfd.readouterr().err
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-1"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert lora_ppo.PPOTrainer(recipe, reward_fn=hangs_at_step_2, progress=False, resume="auto").steps_done == 1


def test_a_stuck_step_is_abandoned_before_the_kill_of_docker_stop():
    """docker stop sends SIGKILL 10 s after its SIGTERM (Kubernetes after 30): a step stuck in
    user code must be given up, with its line said, before that."""
    from lora_ppo.signals import POLL_S, STUCK_GRACE_S

    assert STUCK_GRACE_S + POLL_S < 10


def test_the_watch_for_a_stuck_step_ends_with_the_steps(monkeypatch):
    """A stop asked (the watch started) and the loop left: user code run afterwards (an evaluation's
    reward, a later call from Python) is not interrupted by the finished run's watch."""
    import threading

    from lora_ppo import signals
    from lora_ppo.rewards import USER_CODE

    monkeypatch.setattr(signals, "STUCK_GRACE_S", 1e-6)  # above 0: no step is in user code while asked
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        with signals.stop_on_signals(announce=False) as request:
            os.kill(os.getpid(), signal.SIGINT)  # the first: a stop is asked, the watch starts
            assert request.requested and not received
        watch = [t for t in threading.enumerate() if t.name == "stop-watch"]
        monkeypatch.setattr(USER_CODE, "since", 0.0)  # now in user code, stuck since long ago
        monkeypatch.setattr(USER_CODE, "what", "reward function late")
        for thread in watch:
            thread.join(timeout=60)
        assert not any(t.is_alive() for t in watch) and received == []
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_step_is_stuck_only_while_in_user_code_after_the_request():
    from lora_ppo.rewards import UserCodeClock
    from lora_ppo.signals import StopRequest, stuck_for

    clock, request = UserCodeClock(), StopRequest()
    clock.since = 10.0
    assert stuck_for(request, clock, now=50.0) == 0.0  # no stop asked
    request.requested, request.at = True, 30.0
    assert stuck_for(request, clock, now=50.0) == 20.0  # counted from the request, not the call's start
    clock.since = 40.0
    assert stuck_for(request, clock, now=50.0) == 10.0  # a call that started after it, from its start
    clock.since = None
    assert stuck_for(request, clock, now=50.0) == 0.0  # generating or updating: never abandoned

def test_a_run_stopped_before_its_first_checkpoint_is_started_over(tmp_path, tiny_model_dir, monkeypatch):
    """Ctrl-C in the first held-out evaluation: no checkpoint exists, so no resume hint (it could
    not work), and running the same command again starts over, the old folder moved aside."""
    def interrupted(self, records_file=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_module.PPOTrainer, "evaluate", interrupted)
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "run", steps=1)
    result = CliRunner().invoke(app, ["train", str(recipe), "--no-progress"])
    assert result.exit_code == 130 and "resume with" not in result.stderr
    assert result.stderr.splitlines()[-1] == (f"interrupted before the first checkpoint: nothing to resume; lora-ppo "
                                              f"train {recipe} starts over")
    assert (tmp_path / "run" / "recipe.yaml").is_file() and not (tmp_path / "run" / "final").exists()

    monkeypatch.undo()
    again = CliRunner().invoke(app, ["train", str(recipe), "--no-progress", "train.eval=false"])
    assert again.exit_code == 0, again.stderr
    assert (tmp_path / "run" / "final" / "policy" / "adapter_model.safetensors").is_file()
    assert [p.name.startswith("run.old-") for p in tmp_path.iterdir() if p.name != "run"].count(True) == 1


@pytest.mark.parametrize("function, message", [
    ("tests.reward_fns:raises", "reward function raises raised RuntimeError: reward server is down"),
    ("tests.reward_fns:wrong_count", "reward function wrong_count returned 1 scores for 4 completions"),
])
def test_bad_reward_function_is_named(tmp_path, tiny_model_dir, function, message):
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "run", eval=False)
    result = CliRunner().invoke(app, ["train", str(recipe), f"reward.function={function}"])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    start = lines.index(f"error: {message}")
    # After the one line: the user's own frames (their file and line), none of lora_ppo's.
    frames = lines[start + 1:]
    if function.endswith(":raises"):
        assert any("reward_fns.py" in line and "in raises" in line for line in frames), frames
        assert frames[-1] == "RuntimeError: reward server is down"
    else:
        assert frames == []
    assert not any("lora_ppo" in line for line in frames)


@pytest.mark.parametrize("function, message", [
    ("tests.reward_fns:numeric_strings", "must return a list of numbers, and returned text ('0.5')"),
    ("tests.reward_fns:one_string", "must return a list of numbers, and returned text ('1111')"),
    ("tests.reward_fns:hangs", "reward function hangs did not return within reward.timeout_s (0.5 s)"),
])
def test_a_reward_returning_text_or_hanging_stops_with_one_line(tmp_path, tiny_model_dir, function, message):
    """Text is refused even when it reads as a number ("0.5"); a function that never returns is
    stopped at reward.timeout_s (it waits on an event nobody sets: no race with the clock)."""
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_model_dir, tmp_path / "run", eval=False)
    result = CliRunner().invoke(app, ["train", str(recipe), f"reward.function={function}", "reward.timeout_s=0.5"])
    assert result.exit_code == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: reward function") and message in last


def test_non_finite_reward_names_function_and_prompt_index(tmp_path, tiny_model_dir):
    def half_nan(prompts, completions):
        return [float("nan") if i == 1 else 0.0 for i in range(len(completions))]

    trainer = lora_ppo.PPOTrainer(_recipe(tiny_model_dir, tmp_path / "run"), reward_fn=half_nan, progress=False)
    with pytest.raises(RewardError, match="reward function half_nan returned nan for prompt index 1"):
        trainer.train()
