"""Helpers for the reliability tests: tiny recipes on disk and metric comparison."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.conftest import tiny_recipe_dict

# Wall-clock measurements differ between any two runs; everything else must match exactly.
TIMING_PREFIXES = ("time/", "tokens_per_s", "memory/")


def write_recipe(path: Path, model_dir: Path, output_dir: Path, **train) -> Path:
    recipe = tiny_recipe_dict(model_dir, output_dir, train={"save_every": 1, "steps": 4, **train})
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


def deterministic_metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(TIMING_PREFIXES)} for line in lines
    ]


def adapter_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))
