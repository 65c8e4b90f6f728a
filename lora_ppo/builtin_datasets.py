"""Datasets that ship with lora_ppo (`builtin:<name>` in data.source): movie review openers for
the quickstart, and arithmetic questions with their answers for the verifiable-reward task.

Each is a list of rows (dicts) per split, like a Hugging Face dataset; arithmetic takes a config
name (data.name) for its difficulty and is generated deterministically, so every machine trains
and evaluates on the same questions.
"""

from __future__ import annotations

import random
from importlib import resources
from typing import Callable, Optional

from lora_ppo.errors import RecipeError

Rows = list[dict]


def _text_file(filename: str) -> Rows:
    text = resources.files("lora_ppo.builtin_prompts").joinpath(filename).read_text(encoding="utf-8")
    return [{"prompt": line} for line in text.splitlines() if line.strip()]


def movie_review_openers(name: Optional[str], split: str) -> Rows:
    _no_config("movie_review_openers", name)
    return _text_file("movie_review_openers.txt")


def movie_review_openers_heldout(name: Optional[str], split: str) -> Rows:
    _no_config("movie_review_openers_heldout", name)
    return _text_file("movie_review_openers_heldout.txt")


# Arithmetic difficulties (data.name): operand digits and operations.
ARITHMETIC_CONFIGS = {
    "add2": {"digits": (2,), "ops": ("+",)},
    "addsub2": {"digits": (2,), "ops": ("+", "-")},
    "addsub3": {"digits": (2, 3), "ops": ("+", "-")},
}
ARITHMETIC_DEFAULT = "addsub3"
ARITHMETIC_SPLIT_SIZES = {"train": 4000, "test": 256}
# A few phrasings, so the policy learns the arithmetic rather than one sentence.
ARITHMETIC_TEMPLATES = (
    "What is {a} {op} {b}?",
    "Compute {a} {op} {b}.",
    "Calculate {a} {op} {b}. Answer with the number.",
    "{a} {op} {b} = ?",
)
_ARITHMETIC_SEED = 20261123


def arithmetic(name: Optional[str], split: str) -> Rows:
    """Questions such as "What is 47 + 385?" with an `answer` column ("432"). Subtractions never go
    below zero. The test split holds no question of the train split."""
    config = name or ARITHMETIC_DEFAULT
    if config not in ARITHMETIC_CONFIGS:
        raise RecipeError(f"data.name: builtin:arithmetic has no config {config!r} (known: {', '.join(ARITHMETIC_CONFIGS)})")
    if split not in ARITHMETIC_SPLIT_SIZES:
        raise RecipeError(f"data.split: builtin:arithmetic has no split {split!r} (known: train, test)")
    spec = ARITHMETIC_CONFIGS[config]
    rng = random.Random(f"{_ARITHMETIC_SEED}-{config}")
    seen: set[tuple[int, str, int]] = set()
    rows_by_split: dict[str, Rows] = {}
    for part in ("test", "train"):  # the test questions first, so train can skip them
        rows: Rows = []
        while len(rows) < ARITHMETIC_SPLIT_SIZES[part]:
            a, b = (rng.randint(10 ** (d - 1), 10**d - 1) for d in (rng.choice(spec["digits"]), rng.choice(spec["digits"])))
            op = rng.choice(spec["ops"])
            if op == "-" and b > a:
                a, b = b, a
            if (a, op, b) in seen:
                continue
            seen.add((a, op, b))
            question = rng.choice(ARITHMETIC_TEMPLATES).format(a=a, op=op, b=b)
            rows.append({"prompt": question, "answer": str(a + b if op == "+" else a - b)})
        rows_by_split[part] = rows
    return rows_by_split[split]


def _no_config(dataset: str, name: Optional[str]) -> None:
    if name is not None:
        raise RecipeError(f"data.name: builtin:{dataset} has no configs (got {name!r})")


BUILTIN_DATASETS: dict[str, Callable[[Optional[str], str], Rows]] = {
    "movie_review_openers": movie_review_openers,
    "movie_review_openers_heldout": movie_review_openers_heldout,
    "arithmetic": arithmetic,
}
