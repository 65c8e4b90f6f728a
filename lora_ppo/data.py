"""Prompts: load them (local file, Hugging Face dataset, or a built-in set), format them,
drop and count unusable rows, and serve them in a seeded, resumable order.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional

from lora_ppo.config import BUILTIN_PREFIX
from lora_ppo.errors import RecipeError, first_line
from lora_ppo.state import PromptPosition

log = logging.getLogger(__name__)

BUILTIN_DATASETS = {
    "movie_review_openers": "movie_review_openers.txt",
    "movie_review_openers_heldout": "movie_review_openers_heldout.txt",
}
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def load_prompt_texts(source: str, split: str, column: str, field_name: str = "data.source") -> list[Any]:
    """Raw prompt values from a builtin set, a local file, or a Hugging Face dataset id."""
    if source.startswith(BUILTIN_PREFIX):
        key = source[len(BUILTIN_PREFIX) :]
        if key not in BUILTIN_DATASETS:
            raise RecipeError(f"{field_name}: unknown builtin dataset {key!r} (known: {', '.join(BUILTIN_DATASETS)})")
        text = resources.files("lora_ppo.builtin_prompts").joinpath(BUILTIN_DATASETS[key]).read_text(encoding="utf-8")
        return [line for line in text.splitlines() if line.strip()]

    import datasets

    path = Path(source)
    try:
        if path.suffix.lower() in FILE_BUILDERS or path.exists():
            if not path.is_file():
                raise RecipeError(f"{field_name}: file not found: {source}")
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise RecipeError(
                    f"{field_name}: unsupported file type {path.suffix!r} (use {', '.join(FILE_BUILDERS)})"
                )
            dataset = datasets.load_dataset(builder, data_files=str(path), split="train")
            if builder == "text":
                column = "text"
        else:
            dataset = datasets.load_dataset(source, split=split)
    except RecipeError:
        raise
    except Exception as err:  # datasets raises many types; all mean "this source is unusable"
        raise RecipeError(f"{field_name}: cannot load {source!r}: {first_line(err)}") from None
    if column not in dataset.column_names:
        raise RecipeError(
            f"data.prompt_column: column {column!r} not in {source!r} (columns: {', '.join(dataset.column_names)})"
        )
    return list(dataset[column])


@dataclass
class PromptSet:
    """Formatted prompts that fit, and how many rows were dropped for which reason."""

    prompts: list[str]
    dropped: dict[str, int] = field(default_factory=dict)


def format_prompt(text: str, tokenizer, chat_template: bool) -> str:
    if not chat_template:
        return text
    if not getattr(tokenizer, "chat_template", None):
        raise RecipeError("data.chat_template: the tokenizer has no chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def prepare_prompts(raw: list[Any], tokenizer, chat_template: bool, max_prompt_tokens: int) -> PromptSet:
    """Format prompts and drop (counting) rows that are not text, empty, or too long."""
    kept: list[str] = []
    dropped = {"not_text": 0, "empty": 0, "too_long": 0}
    for value in raw:
        if not isinstance(value, str):
            dropped["not_text"] += 1
            continue
        if not value.strip():
            dropped["empty"] += 1
            continue
        text = format_prompt(value, tokenizer, chat_template)
        n_tokens = len(tokenizer(text, add_special_tokens=not chat_template)["input_ids"])
        if n_tokens > max_prompt_tokens:
            dropped["too_long"] += 1
            continue
        kept.append(text)
    return PromptSet(kept, {k: v for k, v in dropped.items() if v})


def load_prompt_sets(data_cfg, tokenizer, seed: int) -> tuple[PromptSet, PromptSet]:
    """(train, held-out) prompt sets for a recipe's data section."""
    raw = load_prompt_texts(data_cfg.source, data_cfg.split, data_cfg.prompt_column)
    train = prepare_prompts(raw, tokenizer, data_cfg.chat_template, data_cfg.max_prompt_tokens)
    if data_cfg.eval_source:
        raw_eval = load_prompt_texts(
            data_cfg.eval_source, data_cfg.eval_split, data_cfg.prompt_column, "data.eval_source"
        )
        held_out = prepare_prompts(raw_eval, tokenizer, data_cfg.chat_template, data_cfg.max_prompt_tokens)
        held_out.prompts = held_out.prompts[: data_cfg.eval_size]
    else:
        # Split the held-out prompts off the training set with the run's seed, before training.
        order = list(range(len(train.prompts)))
        random.Random(seed).shuffle(order)
        cut = min(data_cfg.eval_size, max(0, len(order) - 1))
        held_idx = set(order[:cut])
        held_out = PromptSet([p for i, p in enumerate(train.prompts) if i in held_idx])
        train.prompts = [p for i, p in enumerate(train.prompts) if i not in held_idx]
    if not train.prompts:
        reasons = ", ".join(f"{v} {k}" for k, v in train.dropped.items()) or "the source is empty"
        raise RecipeError(f"data.source: no usable prompts in {data_cfg.source!r} ({reasons})")
    return train, held_out


class PromptStream:
    """Endless batches of prompts, reshuffled each pass with a seeded RNG.

    The stream holds no position of its own: `take` reads one and returns the next, so the
    position lives in the run's TrainState and a resumed run continues the same order.
    """

    def __init__(self, prompts: list[str], seed: int):
        self.prompts = prompts
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.prompts)))
            random.Random(self.seed * 100_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # only the current pass is ever needed again
        return self._orders[epoch]

    def take(self, size: int, position: PromptPosition) -> tuple[list[str], PromptPosition]:
        """The next `size` prompts from `position`, and the position after them."""
        epoch, cursor = position
        batch: list[str] = []
        while len(batch) < size:
            if cursor >= len(self.prompts):
                epoch, cursor = epoch + 1, 0
            batch.append(self.prompts[self._order(epoch)[cursor]])
            cursor += 1
        return batch, PromptPosition(epoch, cursor)


def count_summary(prompt_set: PromptSet) -> Optional[str]:
    if not prompt_set.dropped:
        return None
    return ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in prompt_set.dropped.items())
