"""`lora-ppo train-reward`: a reward LoRA adapter and scalar head trained on preference pairs, on
the same 4-bit base the PPO run will use (Bradley-Terry: loss = -log sigmoid(r_chosen - r_rejected
- margin), Stiennon et al. 2020). Its final/reward folder is what `reward.kind: adapter` loads.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from lora_ppo.adapter_training import AdapterTrainer
from lora_ppo.builtin_model import portable_name
from lora_ppo.config import RewardRecipe, as_recipe
from lora_ppo.data import PreferencePair, drop_counts_text, load_preference_sets
from lora_ppo.memory import run_peak_gb
from lora_ppo.model import dequantized_once, load_base_model
from lora_ppo.quantization import adapter_numerics
from lora_ppo.roles import REWARD, RewardModel

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


class RewardTrainer(AdapterTrainer):
    """Build a reward-model run from a `RewardRecipe`, then `train()`.

    Args:
        recipe: a validated `RewardRecipe`.
        progress: show a progress bar.
        resume: "auto" (the newest complete checkpoint) or a checkpoint folder.
    """

    label = "reward"
    what, unit = "a reward adapter", "pairs"  # what the command says it trains, on how many what
    adapters = (REWARD,)

    def __init__(self, recipe: RewardRecipe | dict | str | Path, progress: bool = True,
                 resume: Optional[str | Path] = None):
        super().__init__(as_recipe(recipe, RewardRecipe, "RewardTrainer"), progress, resume)
        recipe = self.recipe
        # Data before weights: a bad dataset fails in seconds.
        self.train_pairs, self.eval_pairs = load_preference_sets(recipe.data, self.tokenizer, recipe.train.seed)
        RewardModel.start_folder(recipe.adapter)  # and the adapter it starts from
        model = RewardModel(load_base_model(recipe.model), recipe.adapter, portable_name(recipe.model.name),
                            adapter_numerics(recipe.model))
        self.start_training(model, model.parameters(), self.train_pairs.pairs)

    def before_training(self) -> None:
        if self.train_pairs.dropped:
            log.warning("dropped preference pairs from %s: %s", self.recipe.data.source,
                        drop_counts_text(self.train_pairs.dropped))

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{metrics['loss']:.3f}", "accuracy": f"{metrics['accuracy']:.2f}"}

    def summary_counts(self) -> dict[str, Any]:
        return {"train_pairs": len(self.train_pairs.pairs), "heldout_pairs": len(self.eval_pairs.pairs)}

    def summary_outputs(self) -> dict[str, Any]:
        return {"reward_adapter": str(self.run.final / REWARD)}

    def train_step(self) -> dict[str, float]:
        """One optimizer step over `train.batch_size` pairs, in `train.grad_accum_steps` micro-batches."""
        t0 = time.perf_counter()
        pairs, micro_batches = self.next_rows()
        totals = {"loss": 0.0, "accuracy": 0.0, "margin": 0.0}
        with self.training_pass():
            for chunk in micro_batches:
                with self.micro_batch():
                    chosen, rejected = self._scores(chunk)
                    margin = torch.tensor([p.margin for p in chunk], device=chosen.device)
                    # Summed over pairs and divided by the whole batch: micro-batches add up to it.
                    loss = pairwise_loss(chosen, rejected, margin).sum() / len(pairs)
                    loss.backward()
                totals["loss"] += float(loss.detach())
                totals["accuracy"] += float(pair_wins(chosen, rejected).sum()) / len(pairs)
                totals["margin"] += float((chosen - rejected).detach().sum()) / len(pairs)
        stepped = self.step_optimizer(self.model.parameters())
        seconds = time.perf_counter() - t0
        return {"step": self.state.step, **totals, **stepped, "time/step": seconds, "memory/peak_gb": run_peak_gb()}

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
        with self.held_out_bar(len(pairs), "pairs") as bar, dequantized_once(self.model.peft, self.recipe.model):
            for start in range(0, len(pairs), EVAL_BATCH_PAIRS):
                c, r = self._scores(pairs[start : start + EVAL_BATCH_PAIRS])
                chosen.append(c)
                rejected.append(r)
                bar.update(len(c))
        c, r = torch.cat(chosen), torch.cat(rejected)
        margin = torch.tensor([p.margin for p in pairs], device=c.device)
        return {"accuracy": float(pair_wins(c, r).mean()), "margin": float((c - r).mean()),
                "loss": float(pairwise_loss(c, r, margin).mean())}


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
