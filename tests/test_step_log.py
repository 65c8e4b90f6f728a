"""A step's record: what metrics.jsonl and samples.jsonl hold (every alarm's flag, 4 samples every
train.sample_every steps and at the end), the line counts a checkpoint keeps for resuming, the
alarms' look-back after a resume, and the progress bar or its console lines."""

from __future__ import annotations

import json

import pytest

import lora_ppo
from lora_ppo.alarms import ALARMS
from lora_ppo.config import Recipe
from lora_ppo.run_dir import RunDir
from lora_ppo.state import TrainState
from lora_ppo.step_log import HISTORY, StepLog
from tests.conftest import tiny_recipe_dict


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_samples_are_four_every_sample_every_steps_and_at_the_end_and_every_step_flags_every_alarm(
        tmp_path, tiny_model_dir):
    """docs/recipe.md: "Write 4 samples to samples.jsonl every N steps and at the end". With 8
    responses a step, steps 2 and 3 of 3 (sample_every 2) write 4 each; the final checkpoint counts
    step 2's alone (a run continued from it drops the end's, as one that never stopped there)."""
    run = tmp_path / "run"
    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(
        tiny_model_dir, run, rollout={"batch_size": 8, "forward_batch_size": 4},
        train={"steps": 3, "sample_every": 2, "eval": False}))
    lora_ppo.PPOTrainer(recipe, progress=False).train()

    samples = _lines(run / "samples.jsonl")
    assert [s["step"] for s in samples] == [2] * 4 + [3] * 4
    assert all(set(s) == {"step", "prompt", "completion", "score"} for s in samples)
    assert all(s["score"] == float(s["completion"].count("e")) for s in samples)  # tests.reward_fns.count_letter_e
    metrics = _lines(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert {k: v for k, v in m.items() if k.startswith("alarm/")}.keys() == {f"alarm/{a}" for a in ALARMS}
        assert all(m[f"alarm/{a}"] in (0.0, 1.0) for a in ALARMS)
    state = json.loads((run / "final" / "trainer_state.json").read_text())
    assert (state["metrics_lines"], state["samples_lines"]) == (3, 4)


def _metrics(step: int, entropy: float) -> dict:
    return {"step": step, "objective/scores": 0.5, "objective/kl": 0.1, "response/length": 6.0,
            "response/stopped_frac": 0.0, "policy/entropy": entropy, "time/step": 1.0}


def _log(tmp_path, progress: bool, steps: int = 20, **train) -> tuple[StepLog, RunDir]:
    recipe = Recipe(**tiny_recipe_dict(tmp_path / "model", tmp_path / "run",
                                       train={"steps": steps, "sample_every": 0, "log_every": 2, **train}))
    run = RunDir(tmp_path / "run")
    run.root.mkdir(parents=True, exist_ok=True)
    return StepLog(recipe, run, progress, (), "float32"), run


def test_a_resumed_runs_alarms_look_back_over_the_same_steps_as_one_that_never_stopped(tmp_path):
    """The entropy-collapse alarm compares a step with the oldest step it looks back over. A run
    resumed after step 20 reads the last HISTORY steps of its metrics.jsonl back: the alarm at
    step 21 is the one the uninterrupted run raises."""
    entropies = [4.0] * 3 + [0.3] * 17  # fell under a tenth of where it started, three steps in
    whole, run = _log(tmp_path / "whole", progress=False, steps=21)
    whole.open(TrainState())
    for step, entropy in enumerate(entropies, start=1):
        whole.record(TrainState(step=step), _metrics(step, entropy), rollout=None)
    resumed, _ = _log(tmp_path / "resumed", progress=False, steps=21)
    (resumed.run.metrics).write_text(run.metrics.read_text())
    resumed.open(TrainState(step=20))
    assert resumed.history == whole.history == _lines(run.metrics)[-HISTORY:]

    flags = []
    for log in (whole, resumed):
        last = _metrics(21, 0.3)
        log.record(TrainState(step=21), last, rollout=None)
        flags.append(last["alarm/entropy_collapse"])
    assert flags[0] == flags[1]


@pytest.mark.parametrize("progress", [True, False])
def test_a_bar_with_progress_and_a_line_every_log_every_steps_without(tmp_path, capsys, caplog, progress):
    """And nothing else: a single-turn run is not warned about rollout.max_turns."""
    log, _ = _log(tmp_path, progress, steps=4)
    log.open(TrainState())
    with caplog.at_level("WARNING"):
        for step in (1, 2, 3, 4):
            log.record(TrainState(step=step), _metrics(step, 4.0), rollout=None)
    log.close()
    assert caplog.text == ""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    if progress:
        assert "PPO" in err and "4/4" in err and not lines
        assert "score=0.500, kl=0.10, len=6.0, s/step=1.0" in err  # the step's numbers beside the bar
        assert err.endswith("\n")  # closed: the bar's line ends, what is printed next starts a line of its own
    else:
        assert "PPO" not in err
        assert lines == ["step 2/4  score 0.500  kl 0.10  len 6.0  s/step 1.0",
                         "step 4/4  score 0.500  kl 0.10  len 6.0  s/step 1.0"]


def test_the_turn_limit_is_warned_at_step_one_when_it_ended_most_episodes(tmp_path, caplog):
    """Most: more than half. Half of the episodes cut is not warned; three quarters is, once."""
    for cut, warned in ((0.5, False), (0.75, True)):
        log, _ = _log(tmp_path / str(cut), progress=False, steps=3)
        log.open(TrainState())
        caplog.clear()
        with caplog.at_level("WARNING"):
            for step in (1, 2, 3):
                log.record(TrainState(step=step), {**_metrics(step, 4.0), "episode/turn_limit_frac": cut},
                           rollout=None)
        lines = [r.getMessage() for r in caplog.records if "rollout.max_turns" in r.getMessage()]
        assert lines == ([f"step 1: rollout.max_turns (1) ended {100 * cut:.0f}% of the episodes before the "
                          "environment did (episode/turn_limit_frac): it expects more turns; raise rollout.max_turns"]
                         if warned else [])


def _rollout(n: int):
    """What StepLog reads of a rollout to write samples: its rows' prompts, completions, scores."""
    from types import SimpleNamespace

    import torch

    return SimpleNamespace(rows=[SimpleNamespace(prompt=f"prompt {i}") for i in range(n)],
                           completions=[f"completion {i}" for i in range(n)],
                           scores=torch.arange(n, dtype=torch.float32))


def test_the_ends_samples_are_written_once_when_the_last_step_was_not_a_sampled_one(tmp_path):
    for last, written in ((4, []), (3, [3, 3, 3, 3])):  # sample_every 2: step 4 wrote its own already
        log, run = _log(tmp_path / str(last), progress=False, steps=last, sample_every=2)
        log.record_last_samples(TrainState(step=last), _rollout(6))
        got = _lines(run.samples) if run.samples.exists() else []
        assert [s["step"] for s in got] == written
        assert [s["prompt"] for s in got] == [f"prompt {i}" for i in range(len(written))]
        assert [s["score"] for s in got] == [float(i) for i in range(len(written))]


def test_an_alarm_is_warned_when_it_starts_not_at_every_step_it_lasts(tmp_path, caplog):
    log, run = _log(tmp_path, progress=False, steps=5)
    log.open(TrainState())
    with caplog.at_level("WARNING"):
        for step, entropy in enumerate((4.0, 4.0, 0.3, 0.3, 0.3), start=1):
            log.record(TrainState(step=step), _metrics(step, entropy), rollout=None)
    assert [m["alarm/entropy_collapse"] for m in _lines(run.metrics)] == [0.0, 0.0, 1.0, 1.0, 1.0]
    warned = [r.getMessage() for r in caplog.records if "alarm" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("step 3: alarm entropy_collapse: ")


def test_closing_finishes_the_trackers_and_needs_no_bar(tmp_path):
    """A run that failed before its first step (the held-out evaluation) closes its log without a
    bar; a closed log has finished its trackers, so their files are whole."""
    from accelerate import PartialState

    PartialState()
    log, _ = _log(tmp_path, progress=False, steps=2, report_to=["tensorboard"])
    log.start_trackers()
    log.close()  # never opened
    assert log.trackers.trackers[0].writer.all_writers is None
