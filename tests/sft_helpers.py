"""Demonstrations, recipes and a by-hand loss for the tiny-model SFT tests (the JSONL writer serves the
reward tests too): a completion the random model cannot guess (a review opener followed by two words of
praise), in TRL's prompt + completion format."""

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


def nll_by_hand(model, tokenizer, rows, completion_only: bool = True) -> tuple[float, int]:
    """(summed negative log-likelihood, token count) of the rows' target tokens, from the model's own
    forward (LM head included), one unpadded row at a time; with `completion_only`, a row's prompt
    tokens (as the tokenizer counts them) are no targets."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            prompt_tokens = len(tokenizer(row.prompt)["input_ids"]) if completion_only else 1
            logp = torch.log_softmax(model.peft(input_ids=torch.tensor([row.ids])).logits[0].double(), dim=-1)
            for t in range(prompt_tokens, len(row.ids)):
                total -= float(logp[t - 1, row.ids[t]])
                count += 1
    return total, count
