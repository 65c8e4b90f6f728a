"""Where a training step's record goes: the alarms read it first (their `alarm/*` flags join it),
then metrics.jsonl, the trackers, samples.jsonl every train.sample_every steps, and the progress
bar, or a console line when there is no bar."""

from __future__ import annotations

import logging
import sys
from typing import Optional

from lora_ppo.alarms import ALARMS, AlarmSettings, check_alarms
from lora_ppo.config import Recipe
from lora_ppo.rollout import Rollout
from lora_ppo.run_dir import RunDir, append_jsonl, read_jsonl
from lora_ppo.state import TrainState
from lora_ppo.tracking import Trackers, start_trackers

log = logging.getLogger(__name__)

SAMPLES_PER_LOG = 4  # completions written to samples.jsonl each time samples are logged
HISTORY = 16  # steps of metrics the alarms look back over
TURN_LIMIT_WARN_FRAC = 0.5  # "most episodes" cut by rollout.max_turns at the first step


class StepLog:
    """The log of one run's steps, from `start_trackers` and `open` (after the run folder is ready) to
    `close`."""

    def __init__(self, recipe: Recipe, run: RunDir, progress: bool, side_metrics: tuple[str, ...], dtype: str):
        self.recipe, self.run, self.progress = recipe, run, progress
        self.settings = AlarmSettings.for_dtype(dtype, recipe.rollout.max_new_tokens, recipe.ppo.target_kl, side_metrics)
        self.history: list[dict] = []
        self.trackers: Optional[Trackers] = None
        self.bar = None

    def start_trackers(self) -> None:
        """Start the trackers, before the held-out evaluation (`tracking.start_trackers`)."""
        self.trackers = start_trackers(self.recipe.train.report_to, self.run.root, self.recipe.model_dump(mode="json"))

    def open(self, state: TrainState) -> None:
        """Start the bar; a resumed run's alarms look back over its earlier steps."""
        from tqdm.auto import tqdm

        self.history = read_jsonl(self.run.metrics)[-HISTORY:]
        self.bar = tqdm(total=self.recipe.train.steps, initial=state.step, desc="PPO", disable=not self.progress,
                        dynamic_ncols=True, file=sys.stderr)

    def record(self, state: TrainState, metrics: dict, rollout: Rollout) -> None:
        """One step's metrics (alarm flags added) and, every train.sample_every steps, samples."""
        self._alarms(metrics)
        self._warn_turn_limit(metrics)
        state.last_metrics = metrics
        append_jsonl(self.run.metrics, metrics)
        state.metrics_lines += 1
        if self.trackers is not None:
            self.trackers.log(metrics, state.step)
        every = self.recipe.train.sample_every
        if every and state.step % every == 0:
            state.samples_lines += self._write_samples(state.step, rollout)
        self._show(state, metrics)

    def record_last_samples(self, state: TrainState, rollout: Rollout) -> None:
        """The end of the run's samples, when its last step was not a sampled one. Left out of
        the line count the final checkpoint saves: a run continued from it drops them and samples
        as one that never stopped there."""
        every = self.recipe.train.sample_every
        if every and state.step % every:
            self._write_samples(state.step, rollout)

    def _write_samples(self, step: int, rollout: Rollout) -> int:
        samples = [{"step": step, "prompt": row.prompt, "completion": completion, "score": score}
                   for row, completion, score in zip(rollout.rows, rollout.completions, rollout.scores.tolist())]
        for sample in samples[:SAMPLES_PER_LOG]:
            append_jsonl(self.run.samples, sample)
        if self.trackers is not None:
            self.trackers.log_samples(samples[:SAMPLES_PER_LOG], step)
        return len(samples[:SAMPLES_PER_LOG])

    def _alarms(self, metrics: dict) -> None:
        before = {name for name in ALARMS if self.history and self.history[-1].get(f"alarm/{name}")}
        raised = {alarm.name: alarm for alarm in check_alarms([*self.history, metrics], self.settings)}
        for name in ALARMS:
            metrics[f"alarm/{name}"] = float(name in raised)
        for name, alarm in raised.items():
            if name not in before:  # warn when it starts, not at every step it lasts
                log.warning("step %d: alarm %s: %s", metrics["step"], name, alarm.message)
        self.history = [*self.history, metrics][-HISTORY:]

    def _warn_turn_limit(self, metrics: dict) -> None:
        """Once, at a run's first step: most episodes were still going when rollout.max_turns (1 by
        default) ended them, so the environment never got the turns it expects."""
        cut = metrics.get("episode/turn_limit_frac", 0.0)
        if metrics["step"] == 1 and cut > TURN_LIMIT_WARN_FRAC:
            log.warning("step 1: rollout.max_turns (%d) ended %.0f%% of the episodes before the environment did "
                        "(episode/turn_limit_frac): it expects more turns; raise rollout.max_turns",
                        self.recipe.rollout.max_turns, 100 * cut)

    def _show(self, state: TrainState, metrics: dict) -> None:
        line = {"score": f"{metrics['objective/scores']:.3f}", "kl": f"{metrics['objective/kl']:.2f}",
                "len": f"{metrics['response/length']:.1f}", "s/step": f"{metrics['time/step']:.1f}"}
        if self.recipe.rollout.environment is not None and "episode/return" in metrics:
            # the score plus the environment's rewards: with `reward.kind: none`, what is learnt
            line = {"return": f"{metrics['episode/return']:.3f}", **line}
        self.bar.update(1)
        self.bar.set_postfix(line)
        if not self.progress and state.step % self.recipe.train.log_every == 0:
            print(f"step {state.step}/{self.recipe.train.steps}  " + "  ".join(f"{k} {v}" for k, v in line.items()),
                  file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.trackers is not None:
            self.trackers.finish()
