"""Demonstrations and recipes for the tiny-model SFT tests: a completion the random model cannot
guess (a review opener followed by two words of praise), in TRL's prompt + completion format."""

from __future__ import annotations

import json
from pathlib import Path

GOOD = ["great", "wonderful", "lovely", "masterpiece"]


def demonstration_rows(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"Review {i}: the film was", "completion": f" {GOOD[i % 4]} and {GOOD[(i + 1) % 4]}"}
            for i in range(start, start + n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def sft_recipe_dict(model_dir: Path, data: Path, held_out: Path, out: Path, sft: dict | None = None, **train) -> dict:
    return {
        "model": {"name": str(model_dir), "quantization": "4bit", "gradient_checkpointing": False},
        "adapter": {"r": 4, "alpha": 8},
        "data": {"source": str(data), "eval_source": str(held_out), "eval_split": "train", "eval_size": 8,
                 "max_length": 48, "eval_samples": 4, "eval_max_new_tokens": 8},
        "sft": sft or {},
        "train": {"epochs": 2, "batch_size": 8, "learning_rate": 3e-2, "eval_every": 4, "output_dir": str(out),
                  "lr_schedule": "constant", **train},
    }
