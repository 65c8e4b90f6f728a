"""Learning check: PPO, RLOO and GRPO each train the quickstart task for a short budget and
must raise the held-out mean score. Prints one JSON object; run alone (it is CPU-heavy).

    python bench/learning_check.py [--steps 10] [--modes ppo rloo grpo] [--out runs/bench-learning]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODE_OVERRIDES = {
    "ppo": ["ppo.advantage_estimator=gae"],
    # 4 samples per prompt; rollout.batch_size counts responses, so as many per step as PPO.
    "rloo": ["ppo.advantage_estimator=rloo", "rollout.samples_per_prompt=4"],
    "grpo": ["ppo.advantage_estimator=grpo", "rollout.samples_per_prompt=4", "ppo.kl_penalty=loss",
             "ppo.kl_estimator=k3"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--modes", nargs="+", default=list(MODE_OVERRIDES), choices=list(MODE_OVERRIDES))
    parser.add_argument("--out", default="runs/bench-learning")
    args = parser.parse_args()

    import lora_ppo

    results = {}
    for mode in args.modes:
        overrides = [f"train.steps={args.steps}", f"train.output_dir={args.out}/{mode}", "train.overwrite=true",
                     *MODE_OVERRIDES[mode]]
        recipe = lora_ppo.load_recipe(args.recipe, overrides)
        t0 = time.perf_counter()
        summary = lora_ppo.PPOTrainer(recipe, progress=False).train()
        results[mode] = {
            "heldout_score_before": summary["heldout_score_before"],
            "heldout_score_after": summary["heldout_score_after"],
            "improved": summary["heldout_score_after"] > summary["heldout_score_before"],
            "final_kl": summary["final_kl"],
            "wall_time_s": round(time.perf_counter() - t0, 1),
            "peak_memory_gb": summary["peak_memory_gb"],
            "critic": recipe.uses_critic,
        }
        print(json.dumps({mode: results[mode]}), file=sys.stderr)
    print(json.dumps({"steps": args.steps, "recipe": args.recipe, "results": results}, indent=2))


if __name__ == "__main__":
    main()
