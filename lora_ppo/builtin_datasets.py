"""Datasets that ship with lora_ppo (`builtin:<name>` in data.source): movie review openers for
the quickstart, arithmetic questions with their answers for the verifiable-reward task, and the
same questions as demonstrations and preference pairs for the offline pipeline (docs/pipeline.md).

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


# Arithmetic difficulties (data.name): the digits of the two operands, and the operations.
ARITHMETIC_CONFIGS = {
    "addsub1": {"digits": ((1, 1),), "ops": ("+", "-")},
    "add12": {"digits": ((1, 2), (2, 1)), "ops": ("+",)},
    "addsub12": {"digits": ((1, 2), (2, 1)), "ops": ("+", "-")},
    "add2": {"digits": ((2, 2),), "ops": ("+",)},
    "addsub2": {"digits": ((2, 2),), "ops": ("+", "-")},
    "addsub3": {"digits": ((2, 2), (2, 3), (3, 2), (3, 3)), "ops": ("+", "-")},
}
ARITHMETIC_DEFAULT = "addsub3"
ARITHMETIC_SPLITS = ("train", "test")
# Split sizes where the problem space is large; a small space is split in two halves instead.
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
    below zero, and the test split holds no problem of the train split."""
    return [{"prompt": question, "answer": str(result)}
            for question, _, result in _arithmetic_questions("arithmetic", name, split)]


def _arithmetic_questions(dataset: str, name: Optional[str], split: str) -> list[tuple[str, str, int]]:
    """(question, the sum written out as `47 + 385`, its result) for each problem of a split."""
    config = name or ARITHMETIC_DEFAULT
    if config not in ARITHMETIC_CONFIGS:
        raise RecipeError(f"data.name: builtin:{dataset} has no config {config!r} (known: {', '.join(ARITHMETIC_CONFIGS)})")
    if split not in ARITHMETIC_SPLITS:
        raise RecipeError(f"data.split: builtin:{dataset} has no split {split!r} (known: {', '.join(ARITHMETIC_SPLITS)})")
    rng = random.Random(f"{_ARITHMETIC_SEED}-{config}")
    problems = _arithmetic_problems(ARITHMETIC_CONFIGS[config], rng)
    return [(rng.choice(ARITHMETIC_TEMPLATES).format(a=a, op=op, b=b), f"{a} {op} {b}", a + b if op == "+" else a - b)
            for a, op, b in problems[split]]


def worked_answer(written: str, result: int) -> str:
    """An answer in the GSM8K style the pipeline teaches: the sum worked out, then `#### N`."""
    return f"{written} = {result}\n#### {result}"


def arithmetic_sft(name: Optional[str], split: str) -> Rows:
    """builtin:arithmetic's questions as conversations a supervised stage learns from: the question
    as the user's turn, its worked answer (`7 + 5 = 12` then `#### 12`) as the assistant's, and the
    `answer` column. Same configs and splits, so no test problem is ever trained on."""
    return [{"messages": [{"role": "user", "content": question},
                          {"role": "assistant", "content": worked_answer(written, result)}],
             "answer": str(result)}
            for question, written, result in _arithmetic_questions("arithmetic_sft", name, split)]


# How far off the wrong answer of a preference pair is (never below zero).
ARITHMETIC_MISSES = (-2, -1, 1, 2, 10)


def arithmetic_preferences(name: Optional[str], split: str) -> Rows:
    """Preference pairs on builtin:arithmetic's questions, two per question, the right worked answer
    (`7 + 5 = 12` then `#### 12`) chosen each time: against a wrong one in the same format (off by
    one, two or ten, seeded), and against the right number without the `####` line (`7 + 5 is
    12.`). What a reward adapter learns from them prefers answers that are right and marked."""
    rng = random.Random(f"{_ARITHMETIC_SEED}-preferences-{name}-{split}")
    rows = []
    for question, written, result in _arithmetic_questions("arithmetic_preferences", name, split):
        miss = rng.choice([m for m in ARITHMETIC_MISSES if result + m >= 0])
        for rejected in (worked_answer(written, result + miss), f"{written} is {result}."):
            rows.append({"prompt": question, "chosen": worked_answer(written, result), "rejected": rejected,
                         "answer": str(result)})
    return rows


def _arithmetic_problems(spec: dict, rng: random.Random) -> dict[str, list[tuple[int, str, int]]]:
    """Distinct problems per split: all of a small problem space, shuffled and halved; a sample of
    a large one."""
    def numbers(digits: int) -> range:
        return range(0 if digits == 1 else 10 ** (digits - 1), 10**digits)

    pairs = [(a, b) for da, db in spec["digits"] for a in numbers(da) for b in numbers(db)]
    space = len(pairs) * len(spec["ops"])
    if space <= 2 * sum(ARITHMETIC_SPLIT_SIZES.values()):
        problems = sorted({(max(a, b), op, min(a, b)) if op == "-" else (a, op, b)
                           for a, b in pairs for op in spec["ops"]})
        rng.shuffle(problems)
        half = len(problems) // 2
        return {"test": problems[:half], "train": problems[half:]}
    seen: set[tuple[int, str, int]] = set()
    split_problems: dict[str, list[tuple[int, str, int]]] = {}
    for part in ("test", "train"):
        chosen = []
        while len(chosen) < ARITHMETIC_SPLIT_SIZES[part]:
            da, db = rng.choice(spec["digits"])
            a, b, op = rng.choice(numbers(da)), rng.choice(numbers(db)), rng.choice(spec["ops"])
            problem = (max(a, b), op, min(a, b)) if op == "-" else (a, op, b)
            if problem not in seen:
                seen.add(problem)
                chosen.append(problem)
        split_problems[part] = chosen
    return split_problems


def _no_config(dataset: str, name: Optional[str]) -> None:
    if name is not None:
        raise RecipeError(f"data.name: builtin:{dataset} has no configs (got {name!r})")


BUILTIN_DATASETS: dict[str, Callable[[Optional[str], str], Rows]] = {
    "movie_review_openers": movie_review_openers,
    "movie_review_openers_heldout": movie_review_openers_heldout,
    "arithmetic": arithmetic,
    "arithmetic_sft": arithmetic_sft,
    "arithmetic_preferences": arithmetic_preferences,
}
