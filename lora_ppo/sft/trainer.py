"""`lora-ppo train-sft`: the supervised stage. A policy LoRA adapter trained on demonstrations with
the masked cross-entropy (the mean negative log-likelihood of the target tokens), on the 4-bit
backbone the PPO run will use; its final/policy folder is what PPO's `adapters.policy.init_from`
and `adapters.reference` take (the run folder names it too).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from lora_ppo.adapter_training import AdapterTrainer
from lora_ppo.builtin_model import portable_name
from lora_ppo.config import SFTRecipe, as_recipe
from lora_ppo.data import drop_counts_text
from lora_ppo.memory import run_peak_gb
from lora_ppo.model import check_row_length, dequantized_once, load_base_model
from lora_ppo.quantization import adapter_numerics
from lora_ppo.roles import POLICY
from lora_ppo.run_dir import write_jsonl
from lora_ppo.sft.batches import Batch, packed_batch, padded_batch
from lora_ppo.sft.model import SFTModel
from lora_ppo.sft.rows import TRUNCATED, SFTRow, SFTSet, load_sft_sets
from lora_ppo.sft.samples import greedy_samples

log = logging.getLogger(__name__)

# A loss this large means nothing as a perplexity (exp would overflow a float).
MAX_PERPLEXITY_LOSS = 50.0


def perplexity(loss: float) -> float:
    """exp(mean negative log-likelihood per target token)."""
    return math.exp(min(loss, MAX_PERPLEXITY_LOSS))


class SFTTrainer(AdapterTrainer):
    """Build a supervised run from an `SFTRecipe`, then `train()`.

    Args:
        recipe: a validated `SFTRecipe`.
        progress: show a progress bar.
        resume: "auto" (the newest complete checkpoint) or a checkpoint folder.
    """

    label = "sft"
    what, unit = "a policy adapter", "rows"  # what the command says it trains, on how many what
    adapters = (POLICY,)
    eval_metric = "sft/eval_{}"

    def __init__(self, recipe: SFTRecipe | dict | str | Path, progress: bool = True,
                 resume: Optional[str | Path] = None):
        super().__init__(as_recipe(recipe, SFTRecipe, "SFTTrainer"), progress, resume)
        recipe = self.recipe
        check_row_length(recipe.model, recipe.data.max_length, "data.max_length")
        # Data before weights: a bad dataset fails in seconds.
        self.train_rows, self.eval_rows = load_sft_sets(recipe.data, recipe.sft, self.tokenizer, recipe.train.seed)
        SFTModel.start_folder(recipe.adapter)  # and the adapter it starts from
        model = SFTModel(load_base_model(recipe.model), recipe.adapter, portable_name(recipe.model.name),
                         adapter_numerics(recipe.model))
        if recipe.sft.packing:
            model.check_packing("sft.packing")
        self.start_training(model, model.parameters(), self.train_rows.rows)

    def batch(self, rows: Sequence[SFTRow]) -> Batch:
        """`rows` as model input: packed when the recipe says so, else one padded row per sequence."""
        pad = self.tokenizer.pad_token_id
        laid_out = packed_batch(rows, pad, self.recipe.packing_length) if self.recipe.sft.packing else \
            padded_batch(rows, pad)
        return laid_out.to(self.device)

    # ---- the stage's parts of the loop --------------------------------------------------------

    def before_training(self) -> None:
        for name, rows, source in (("training", self.train_rows, self.recipe.data.source),
                                   ("held-out", self.eval_rows, self.recipe.data.eval_source)):
            _log_counts(name, rows, source, self.recipe.data.max_length)

    def progress_fields(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{metrics['sft/loss']:.3f}", "perplexity": f"{metrics['sft/perplexity']:.2f}"}

    def summary_counts(self) -> dict[str, Any]:
        return {"train_rows": len(self.train_rows.rows), "heldout_rows": len(self.eval_rows.rows)}

    def summary_outputs(self) -> dict[str, Any]:
        return {"adapter": str(self.run.final / POLICY)}

    def train_step(self) -> dict[str, float]:
        """One optimizer step over `train.batch_size` rows, in `train.grad_accum_steps` micro-batches."""
        t0 = time.perf_counter()
        rows, micro_batches = self.next_rows()
        # Summed over the step's target tokens and divided by their number: micro-batches (and
        # packed or padded layouts) add up to the same loss and gradients.
        targets = sum(row.target_count for row in rows)
        loss_sum, positions = 0.0, 0
        with self.training_pass():
            for chunk in micro_batches:
                batch = self.batch(chunk)
                with self.micro_batch():
                    loss = -self.model.target_logprobs(batch).sum() / targets
                    loss.backward()
                loss_sum += float(loss.detach())
                positions += batch.positions
        stepped = self.step_optimizer(self.model.parameters())
        tokens = sum(len(row.ids) for row in rows)
        seconds = time.perf_counter() - t0
        return {"step": self.state.step, "sft/loss": loss_sum, "sft/perplexity": perplexity(loss_sum),
                "sft/target_tokens": targets, "sft/tokens": tokens, "sft/padding_frac": 1.0 - tokens / positions,
                **stepped, "time/step": seconds, "tokens_per_s": tokens / max(seconds, 1e-9),
                "memory/peak_gb": run_peak_gb()}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss (mean negative log-likelihood per target token) and its perplexity."""
        rows = self.eval_rows.rows
        if not rows:
            return {}
        total, count = 0.0, 0
        size = self.recipe.data.eval_batch_size
        with self.held_out_bar(len(rows), "rows") as bar, dequantized_once(self.model.peft, self.recipe.model):
            for start in range(0, len(rows), size):
                logprobs = self.model.target_logprobs(self.batch(rows[start : start + size]))
                total -= float(logprobs.double().sum())
                count += logprobs.numel()
                bar.update(min(size, len(rows) - start))
        return {"loss": total / count, "perplexity": perplexity(total / count)}

    def write_samples(self, path: Path) -> None:
        """The greedy completions of the first `data.eval_samples` held-out prompts."""
        data = self.recipe.data
        rows = self.eval_rows.rows[: data.eval_samples]
        if not any(row.prompt_ids for row in rows):
            return
        with dequantized_once(self.model.peft, self.recipe.model):
            records = greedy_samples(self.model, self.tokenizer, rows, data.eval_max_new_tokens, data.eval_batch_size)
        write_jsonl(path, records)


def _log_counts(name: str, rows: SFTSet, source: Optional[str], max_length: int) -> None:
    dropped = {k: v for k, v in rows.dropped.items() if k != TRUNCATED}
    if dropped:
        log.warning("dropped %s rows from %s: %s", name, source, drop_counts_text(dropped))
    if rows.dropped.get(TRUNCATED):
        log.warning("truncated %d %s rows from %s to data.max_length (%d tokens)", rows.dropped[TRUNCATED], name,
                    source, max_length)


def format_sft_summary(summary: dict) -> str:
    """A few human lines for the end of a supervised run."""
    def fmt(key: str, digits: int = 3) -> str:
        value = summary.get(key)
        return "n/a" if value is None else f"{value:.{digits}f}"

    return "\n".join([
        f"held-out loss: {fmt('heldout_loss_before')} -> {fmt('heldout_loss_after')} (perplexity "
        f"{fmt('heldout_perplexity_before', 2)} -> {fmt('heldout_perplexity_after', 2)}, {summary['heldout_rows']} rows)",
        f"wall time: {summary['wall_time_s']:.0f} s, peak memory: {summary['peak_memory_gb']:.2f} GB",
        f"adapter: {summary['adapter']} (PPO starts from it with adapters.policy.init_from: {summary['output_dir']})",
    ])
