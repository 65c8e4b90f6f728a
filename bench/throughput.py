"""Throughput of the quickstart model and recipe: seconds per PPO step and per phase (generate,
score, update), generated tokens per second, and per-phase peak memory. Prints one JSON object;
run alone (two cores shared with anything else give meaningless numbers).

    python bench/throughput.py [--steps 3] [key.path=value ...]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. rollout.batch_size=32")
    args = parser.parse_args()

    import torch

    import lora_ppo

    recipe = lora_ppo.load_recipe(args.recipe, ["train.eval=false", "train.output_dir=/tmp/lora_ppo_bench_throughput",
                                                "train.overwrite=true", *args.overrides])
    t0 = time.perf_counter()
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    load_s = time.perf_counter() - t0
    steps = []
    for _ in range(args.steps):
        metrics, rollout = trainer.train_step()
        generated = int(rollout.response_mask.sum())
        steps.append({
            "step_s": metrics["time/step"],
            "generate_s": metrics["time/generate"],
            "score_s": metrics["time/score_forward"],
            "reward_s": metrics["time/reward"],
            "update_s": metrics["time/update"],
            "generated_tokens": generated,
            "generated_tokens_per_s": generated / metrics["time/generate"],
            "memory_gb": {k[len("memory/"):-3]: round(v, 3) for k, v in metrics.items()
                          if k.startswith("memory/") and k.endswith("_gb") and k != "memory/peak_gb"},
        })
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in steps[-1].items()}),
              file=sys.stderr, flush=True)

    def median(key):
        return round(statistics.median(s[key] for s in steps), 2)

    print(json.dumps({
        "model": recipe.model.name,
        "quantization": recipe.model.quantization,
        "batch_size": recipe.rollout.batch_size,
        "max_new_tokens": recipe.rollout.max_new_tokens,
        "logprobs_from_generation": trainer.sampler.cfg.logprobs_from_generation,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "load_s": round(load_s, 1),
        "steps": args.steps,
        "median": {key: median(key) for key in ("step_s", "generate_s", "score_s", "reward_s", "update_s",
                                                 "generated_tokens_per_s")},
        "per_step": steps,
    }, indent=2))


if __name__ == "__main__":
    main()
