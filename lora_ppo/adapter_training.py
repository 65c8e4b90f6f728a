"""The run of a stage that trains one adapter over a fixed set of rows (`train-reward`, `train-sft`):
the run folder, seeded steps with a held-out evaluation every train.eval_every steps, metrics.jsonl
and the trackers, a progress bar or log lines, checkpoints every train.save_every steps and at the
end, Ctrl-C and `--resume`. A stage subclasses `AdapterTrainer` with its rows, model, step and
evaluation.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from lora_ppo import checkpoint
from lora_ppo.bnb_workarounds import release_dequantized_copies
from lora_ppo.config import recipe_to_yaml, with_absolute_paths
from lora_ppo.data import PromptStream
from lora_ppo.memory import run_peak_gb
from lora_ppo.model import dequantized_once, load_tokenizer
from lora_ppo.parts import seed_everything
from lora_ppo.progress import LineProgress
from lora_ppo.roles import Backbone
from lora_ppo.run_dir import append_jsonl
from lora_ppo.signals import stop_on_signals
from lora_ppo.state import AdapterTrainState
from lora_ppo.tracking import Trackers, check_installed, start_trackers

log = logging.getLogger(__name__)


class AdapterTrainer:
    """The loop, run folder and checkpoints of a one-adapter stage, from its recipe (a `RewardRecipe`
    or an `SFTRecipe`: sections model, adapter, data, train).

    A stage's `__init__` calls this one (the run folder is checked, the seed set, the tokenizer
    loaded), loads its rows and model, then calls `start_training` with them. It defines
    `train_step` (one optimizer step over the next rows of `self.stream` -> its metrics,
    `time/step` among them), `evaluate` (held-out scores), and the hooks below.

    Args:
        recipe: a validated recipe.
        progress: show a progress bar.
        resume: "auto" (the newest complete checkpoint) or a checkpoint folder.
    """

    label = "train"  # the progress bar's
    what, unit = "an adapter", "rows"  # what the command says it trains, on how many of what
    adapters: tuple[str, ...] = ()  # the adapters a checkpoint saves
    eval_metric = "eval/{}"  # the name of a held-out score in metrics.jsonl

    def __init__(self, recipe: Any, progress: bool = True, resume: Optional[str | Path] = None):
        recipe = with_absolute_paths(recipe)  # recipe.yaml works from any folder (eval, export, resume)
        self.recipe = recipe
        self.recipe_yaml = recipe_to_yaml(recipe)
        self.progress = progress
        self.run, self.resume_from = checkpoint.open_run(recipe, resume)
        self._resume_auto = str(resume) == "auto"
        check_installed(recipe.train.report_to)  # before minutes of loading
        seed_everything(recipe.train.seed)
        self.tokenizer = load_tokenizer(recipe.model)
        self.state = AdapterTrainState()
        self.final_eval: Optional[dict[str, float]] = None  # the last step's held-out scores, the run's "after"

    def start_training(self, model: Backbone, parameters: list[torch.nn.Parameter], rows: list) -> None:
        """The seeded order of the training `rows` (`self.stream`), AdamW over `parameters`, the
        learning-rate schedule over the steps the rows take, and with `--resume` the checkpoint's
        state, once the stage has its rows and model."""
        r = self.recipe.train
        self.model = model
        self.stream = PromptStream(rows, r.seed)
        self.optimizer = torch.optim.AdamW(parameters, lr=r.learning_rate, weight_decay=0.0)
        self.total_steps = math.ceil(len(rows) * r.epochs / r.batch_size)
        self.scheduler = None
        if r.lr_schedule == "linear":
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda i: max(0.0, 1.0 - i / max(1, self.total_steps)))
        self.generator = torch.Generator().manual_seed(r.seed)
        if self.resume_from is not None:
            self.resume_from, self.state = checkpoint.load_newest(self.run, self.resume_from, self._resume_auto,
                                                                  self._trainables(), AdapterTrainState)
            log.info("resuming from %s (step %d)", self.resume_from, self.state.step)

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    # ---- what a stage defines -----------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """One optimizer step over `train.batch_size` rows; returns its metrics (`step` first)."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """The held-out scores ({} without held-out rows)."""
        raise NotImplementedError

    def before_training(self) -> None:
        """Said once the run folder is ready (what was dropped from the data)."""

    def write_samples(self, path: Path) -> None:
        """Held-out completions written beside the evaluation before and after training (none by default)."""

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, str]:
        """What the progress bar and the `--no-progress` line show of a step."""
        return {}

    def summary_counts(self) -> dict[str, Any]:
        """What the summary says of the data, before the held-out scores."""
        return {}

    def summary_outputs(self) -> dict[str, Any]:
        """What the summary says of the trained adapter, last."""
        return {}

    # ---- the loop -----------------------------------------------------------------------------

    def train(self) -> dict:
        """Run the whole recipe; returns the summary (also written to summary.json)."""
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        checkpoint.start_run_folder(self.run, self.recipe_yaml, self.resume_from, (self.state.metrics_lines, 0))
        self.before_training()
        bar = None
        trackers = start_trackers(self.recipe.train.report_to, self.run.root, self.recipe.model_dump(mode="json"))
        try:
            if self.state.eval_before is None:  # a resumed run keeps the evaluation its first part made
                self.state.eval_before = self.evaluate()
                self.write_samples(self.run.eval_before)
            bar = tqdm(total=self.total_steps, initial=self.state.step, desc=self.label, disable=not self.progress,
                       dynamic_ncols=True, file=sys.stderr)
            with stop_on_signals() as stop:
                while self.state.step < self.total_steps:
                    self._one_step(bar, trackers)
                    if stop.requested:
                        folder = self.save_checkpoint()
                        print(f"interrupted at step {self.state.step}: checkpoint saved to {folder}", file=sys.stderr)
                        raise KeyboardInterrupt
        finally:
            if bar is not None:
                bar.close()
            if trackers is not None:
                trackers.finish()
        self.save_checkpoint(self.run.final)
        after = self.final_eval if self.final_eval is not None else self.evaluate()
        self.write_samples(self.run.eval_after)
        release_dequantized_copies(self.model.peft)  # the run's last use of them
        summary = {
            "steps": self.state.step,
            **self.summary_counts(),
            **{f"heldout_{k}_before": v for k, v in self.state.eval_before.items()},
            **{f"heldout_{k}_after": v for k, v in after.items()},
            "wall_time_s": time.perf_counter() - t0,
            "peak_memory_gb": run_peak_gb(),
            "output_dir": str(self.run.root),
            **self.summary_outputs(),
        }
        self.run.write_summary(summary)
        return summary

    def _one_step(self, bar, trackers: Optional[Trackers]) -> None:
        r, state = self.recipe.train, self.state
        metrics = self.train_step()
        # The last step is always evaluated: its scores are the run's "after", and the held-out
        # curves in metrics.jsonl and the trackers end where the run does.
        last = state.step == self.total_steps
        if last or (r.eval_every and state.step % r.eval_every == 0):
            scores = self.evaluate()
            metrics.update({self.eval_metric.format(k): v for k, v in scores.items()})
            self.final_eval = scores if last else None
        state.last_metrics = metrics
        append_jsonl(self.run.metrics, metrics)
        state.metrics_lines += 1
        if trackers is not None:
            trackers.log(metrics, state.step)
        if r.save_every and state.step % r.save_every == 0 and state.step < self.total_steps:
            self.save_checkpoint()
        shown = self.progress_fields(metrics)
        bar.update(1)
        bar.set_postfix(shown)
        if state.step % r.log_every == 0 and not self.progress:
            print(f"step {state.step}/{self.total_steps}  " + "".join(f"{k} {v}  " for k, v in shown.items())
                  + f"{metrics['time/step']:.1f}s", file=sys.stderr)

    def next_rows(self) -> tuple[list, list[list]]:
        """The step's `train.batch_size` rows in the seeded order (the position moves on), and the
        same rows as `train.grad_accum_steps` micro-batches."""
        r = self.recipe.train
        rows, self.state.position = self.stream.take(r.batch_size, self.state.position)
        micro = r.batch_size // r.grad_accum_steps
        return rows, [rows[start : start + micro] for start in range(0, len(rows), micro)]

    @contextlib.contextmanager
    def training_pass(self) -> Iterator[None]:
        """Around a step's forwards and backwards: gradients cleared, the 4-bit layers dequantized
        once (`model.dequantize_per_step`), gradient checkpointing as the recipe says, dropout on."""
        self.optimizer.zero_grad(set_to_none=True)
        model, cfg = self.model, self.recipe.model
        with dequantized_once(model.peft, cfg), model.gradient_checkpointing(cfg.checkpointing_on), \
                model.training_mode():
            yield

    def micro_batch(self) -> contextlib.AbstractContextManager:
        """Around a micro-batch's forward and backward: with `model.fused_lora`, the trained adapter cast to
        the compute dtype once for every layer (`Backbone.adapters_cast_once`)."""
        return self.model.adapters_cast_once([self.model.adapter_name])

    def step_optimizer(self, parameters: list[torch.nn.Parameter]) -> dict[str, float]:
        """Clip the gradients of `parameters` (the step's backward done), step the optimizer and the
        schedule, count the step; returns the gradient norm and the learning rate (the schedule's
        next one, as train-reward has always logged it)."""
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, self.recipe.train.max_grad_norm)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.state.step += 1
        return {"grad_norm": float(grad_norm), "lr": self.optimizer.param_groups[0]["lr"]}

    def held_out_bar(self, total: int, unit: str):
        """A bar on a terminal; else a line per tenth, so a log shows the first minute is not a hang."""
        from tqdm.auto import tqdm

        if self.progress:
            return tqdm(total=total, desc="held-out", dynamic_ncols=True, file=sys.stderr, leave=False)
        return LineProgress(total, "held-out", unit)

    # ---- checkpoints --------------------------------------------------------------------------

    def _trainables(self) -> checkpoint.Trainables:
        return checkpoint.Trainables(self.model, self.adapters, self.optimizer, self.scheduler, self.generator)

    def save_checkpoint(self, folder: Optional[Path] = None) -> Path:
        """A full-state checkpoint, by default checkpoints/step-N/ (keeping the newest train.keep_last)."""
        if folder is not None:
            return checkpoint.save(folder, self._trainables(), self.state, self.recipe_yaml)
        return checkpoint.save(self.run.step_checkpoint(self.state.step), self._trainables(), self.state,
                               self.recipe_yaml, keep_last=self.recipe.train.keep_last)
