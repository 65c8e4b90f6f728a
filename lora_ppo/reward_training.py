"""`lora-ppo train-reward`: a reward LoRA adapter and scalar head trained on preference pairs, on
the same 4-bit base the PPO run will use (Bradley-Terry: loss = -log sigmoid(r_chosen - r_rejected
- margin), Stiennon et al. 2020). Its final/reward folder is what `reward.kind: adapter` loads.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from lora_ppo import checkpoint
from lora_ppo.builtin_model import portable_name
from lora_ppo.config import RewardRecipe, recipe_to_yaml, with_absolute_paths
from lora_ppo.data import PreferencePair, PromptStream, load_preference_sets
from lora_ppo.memory import run_peak_gb
from lora_ppo.model import dequantized_once, load_base_model, load_tokenizer
from lora_ppo.parts import seed_everything
from lora_ppo.progress import LineProgress
from lora_ppo.roles import REWARD, RewardModel
from lora_ppo.run_dir import append_jsonl
from lora_ppo.signals import stop_on_signals
from lora_ppo.state import RewardTrainState

log = logging.getLogger(__name__)

EVAL_BATCH_PAIRS = 16  # held-out pairs scored at once


def pair_batch(pairs: list[PreferencePair], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen sequences, then the rejected ones, right-padded: (input_ids, attention_mask),
    each [2B, T]. Scores are read at each row's last real token, whatever the padding."""
    sequences = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    return ids.to(device), mask.to(device)


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected - margin) per pair, [B] (Bradley-Terry with a margin)."""
    return -F.logsigmoid(chosen - rejected - margin)


def pair_wins(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """1 per pair whose chosen response scores higher, 0.5 per tie, [B]: the untrained head (zero)
    ties every pair, so accuracy starts at chance, 0.5."""
    return (chosen > rejected).float() + 0.5 * (chosen == rejected).float()


class RewardTrainer:
    """Build a reward-model run from a `RewardRecipe`, then `train()`.

    Args:
        recipe: a validated `RewardRecipe`.
        progress: show a progress bar.
        resume: "auto" (the newest complete checkpoint) or a checkpoint folder.
    """

    def __init__(self, recipe: RewardRecipe, progress: bool = True, resume: Optional[str | Path] = None):
        recipe = with_absolute_paths(recipe)  # recipe.yaml works from any folder (eval, export, resume)
        self.recipe = recipe
        self.recipe_yaml = recipe_to_yaml(recipe)
        self.progress = progress
        self.run, self.resume_from = checkpoint.open_run(recipe, resume)
        seed_everything(recipe.train.seed)
        self.tokenizer = load_tokenizer(recipe.model)
        # Data before weights: a bad dataset fails in seconds.
        self.train_pairs, self.eval_pairs = load_preference_sets(recipe.data, self.tokenizer, recipe.train.seed)
        self.model = RewardModel(load_base_model(recipe.model), recipe.adapter, portable_name(recipe.model.name))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=recipe.train.learning_rate, weight_decay=0.0)
        self.total_steps = math.ceil(len(self.train_pairs.pairs) * recipe.train.epochs / recipe.train.batch_size)
        self.scheduler = None
        if recipe.train.lr_schedule == "linear":
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda i: max(0.0, 1.0 - i / max(1, self.total_steps)))
        self.stream = PromptStream(self.train_pairs.pairs, recipe.train.seed)
        self.generator = torch.Generator().manual_seed(recipe.train.seed)
        self.state = RewardTrainState()
        if self.resume_from is not None:
            self.resume_from, self.state = checkpoint.load_newest(self.run, self.resume_from, str(resume) == "auto",
                                                                  self._trainables(), RewardTrainState)
            log.info("resuming from %s (step %d)", self.resume_from, self.state.step)

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    # ---- the loop ---------------------------------------------------------------------------

    def train(self) -> dict:
        """Run the whole recipe; returns the summary (also written to summary.json)."""
        from tqdm.auto import tqdm

        t0 = time.perf_counter()
        moved = self.run.open(self.recipe_yaml, None if self.resume_from is None else (self.state.metrics_lines, 0))
        if moved is not None:
            log.warning("%s held a run: moved it to %s", self.run.root, moved)
        if self.train_pairs.dropped:
            log.warning("dropped preference pairs from %s: %s", self.recipe.data.source,
                        ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in self.train_pairs.dropped.items()))
        if self.state.eval_before is None:
            self.state.eval_before = self.evaluate()
        bar = tqdm(total=self.total_steps, initial=self.state.step, desc="reward", disable=not self.progress,
                   dynamic_ncols=True, file=sys.stderr)
        try:
            with stop_on_signals() as stop:
                while self.state.step < self.total_steps:
                    self._one_step(bar)
                    if stop.requested:
                        folder = self.save_checkpoint()
                        print(f"interrupted at step {self.state.step}: checkpoint saved to {folder}", file=sys.stderr)
                        raise KeyboardInterrupt
        finally:
            bar.close()
        self.save_checkpoint(self.run.final)
        after = self.evaluate()
        summary = {
            "steps": self.state.step,
            "train_pairs": len(self.train_pairs.pairs),
            "heldout_pairs": len(self.eval_pairs.pairs),
            **{f"heldout_{k}_before": v for k, v in self.state.eval_before.items()},
            **{f"heldout_{k}_after": v for k, v in after.items()},
            "wall_time_s": time.perf_counter() - t0,
            "peak_memory_gb": run_peak_gb(),
            "output_dir": str(self.run.root),
            "reward_adapter": str(self.run.final / REWARD),
        }
        self.run.write_summary(summary)
        return summary

    def _one_step(self, bar) -> None:
        r, state = self.recipe.train, self.state
        metrics = self.train_step()
        if r.eval_every and state.step % r.eval_every == 0 and state.step < self.total_steps:
            metrics.update({f"eval/{k}": v for k, v in self.evaluate().items()})
        state.last_metrics = metrics
        append_jsonl(self.run.metrics, metrics)
        state.metrics_lines += 1
        if r.save_every and state.step % r.save_every == 0 and state.step < self.total_steps:
            self.save_checkpoint()
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", acc=f"{metrics['accuracy']:.2f}")
        if state.step % r.log_every == 0 and not self.progress:
            print(f"step {state.step}/{self.total_steps}  loss {metrics['loss']:.3f}  accuracy "
                  f"{metrics['accuracy']:.2f}  {metrics['time/step']:.1f}s", file=sys.stderr)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over `train.batch_size` pairs, in `train.grad_accum_steps` micro-batches."""
        r, state = self.recipe, self.state
        t0 = time.perf_counter()
        pairs, state.position = self.stream.take(r.train.batch_size, state.position)
        micro = r.train.batch_size // r.train.grad_accum_steps
        totals = {"loss": 0.0, "accuracy": 0.0, "margin": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        with dequantized_once(self.model.peft, r.model), self.model.gradient_checkpointing(r.model.checkpointing_on), \
                self.model.training_mode():
            for start in range(0, len(pairs), micro):
                chunk = pairs[start : start + micro]
                chosen, rejected = self._scores(chunk)
                margin = torch.tensor([p.margin for p in chunk], device=chosen.device)
                # Summed over pairs and divided by the whole batch: micro-batches add up to it.
                loss = pairwise_loss(chosen, rejected, margin).sum() / len(pairs)
                loss.backward()
                totals["loss"] += float(loss)
                totals["accuracy"] += float(pair_wins(chosen, rejected).sum()) / len(pairs)
                totals["margin"] += float((chosen - rejected).sum()) / len(pairs)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), r.train.max_grad_norm)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        state.step += 1
        seconds = time.perf_counter() - t0
        return {"step": state.step, **totals, "grad_norm": float(grad_norm), "lr": self.optimizer.param_groups[0]["lr"],
                "time/step": seconds, "memory/peak_gb": run_peak_gb()}

    def _scores(self, pairs: list[PreferencePair]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = pair_batch(pairs, self.tokenizer.pad_token_id, self.device)
        scores = self.model.scores(ids, mask)  # [2B]
        return scores[: len(pairs)], scores[len(pairs) :]

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out pairwise accuracy (chosen scored above rejected, ties half), mean margin and loss."""
        pairs = self.eval_pairs.pairs
        if not pairs:
            return {}
        chosen, rejected = [], []
        # A bar on a terminal; else a line per tenth, so a log shows the first minute is not a hang.
        from tqdm.auto import tqdm

        bar = (tqdm(total=len(pairs), desc="held-out", dynamic_ncols=True, file=sys.stderr, leave=False)
               if self.progress else LineProgress(len(pairs), "held-out", "pairs"))
        with bar, dequantized_once(self.model.peft, self.recipe.model):
            for start in range(0, len(pairs), EVAL_BATCH_PAIRS):
                c, r = self._scores(pairs[start : start + EVAL_BATCH_PAIRS])
                chosen.append(c)
                rejected.append(r)
                bar.update(len(c))
        c, r = torch.cat(chosen), torch.cat(rejected)
        margin = torch.tensor([p.margin for p in pairs], device=c.device)
        return {"accuracy": float(pair_wins(c, r).mean()), "margin": float((c - r).mean()),
                "loss": float(pairwise_loss(c, r, margin).mean())}

    # ---- checkpoints ------------------------------------------------------------------------

    def _trainables(self) -> checkpoint.Trainables:
        return checkpoint.Trainables(self.model, (REWARD,), self.optimizer, self.scheduler, self.generator)

    def save_checkpoint(self, folder: Optional[Path] = None) -> Path:
        """A full-state checkpoint, by default checkpoints/step-N/ (keeping the newest train.keep_last)."""
        if folder is not None:
            return checkpoint.save(folder, self._trainables(), self.state, self.recipe_yaml)
        return checkpoint.save(self.run.step_checkpoint(self.state.step), self._trainables(), self.state,
                               self.recipe_yaml, keep_last=self.recipe.train.keep_last)


def format_reward_summary(summary: dict) -> str:
    """A few human lines for the end of a reward-model run."""
    def fmt(key: str) -> str:
        value = summary.get(key)
        return "n/a" if value is None else f"{value:.3f}"

    return "\n".join([
        f"held-out accuracy: {fmt('heldout_accuracy_before')} -> {fmt('heldout_accuracy_after')} "
        f"({summary['heldout_pairs']} pairs)",
        f"held-out mean margin: {fmt('heldout_margin_before')} -> {fmt('heldout_margin_after')}",
        f"wall time: {summary['wall_time_s']:.0f} s, peak memory: {summary['peak_memory_gb']:.2f} GB",
        f"reward adapter: {summary['reward_adapter']} (use it with reward.kind: adapter, reward.adapter: <that folder>)",
    ])
