"""The verifiable-reward task: `recipes/arithmetic.yaml` (or overrides of it) for several seeds,
each in a fresh process, with held-out accuracy before and after, its standard error, the KL,
the batch accuracy per step, wall time and peak memory. Prints one JSON line per seed, then a
Markdown table; run alone (it is CPU-heavy: about 12 minutes per seed on a 2-core CPU).

    python bench/arithmetic_check.py [--seeds 0 1 2] [key.path=value ...]
    python bench/arithmetic_check.py --seeds 0 data.name=add2        # a harder variant
    python bench/arithmetic_check.py --recipe recipes/agent.yaml      # the multi-turn task
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "arithmetic.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/bench-arithmetic")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. data.name=add2")
    args = parser.parse_args()

    rows = []
    for seed in args.seeds:
        out = Path(args.out) / f"seed-{seed}"
        command = [sys.executable, "-m", "lora_ppo.cli", "train", args.recipe, f"train.seed={seed}",
                   f"train.output_dir={out}", "train.overwrite=true", *args.overrides, "--no-progress"]
        t0 = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            print(json.dumps({"seed": seed, "error": done.stderr.strip().splitlines()[-1:]}), flush=True)
            continue
        summary = json.loads((out / "summary.json").read_text())
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rows.append({
            "seed": seed,
            "heldout_accuracy_before": round(summary["heldout_score_before"], 3),
            "heldout_se_before": round(summary["heldout_score_se_before"], 3),
            "heldout_accuracy_after": round(summary["heldout_score_after"], 3),
            "heldout_se_after": round(summary["heldout_score_se_after"], 3),
            "final_kl": round(summary["final_kl"], 2),
            # an environment's reward (recipes/agent.yaml) where the episode gives it
            "batch_accuracy": [round(m.get("episode/env_reward", m["objective/raw_scores"]), 2) for m in steps],
            **({"turns": [round(m["episode/turns"], 2) for m in steps]} if "episode/turns" in steps[0] else {}),
            "seconds_per_step": round(sum(m["time/step"] for m in steps) / len(steps), 1),
            "wall_time_s": round(wall, 1),
            "peak_memory_gb": round(summary["peak_memory_gb"], 2),
            "overrides": args.overrides,
        })
        print(json.dumps(rows[-1]), flush=True)
    print("\n| seed | held-out accuracy before -> after | final KL | wall time |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['seed']} | {r['heldout_accuracy_before']:.3f} (± {r['heldout_se_before']:.3f}) -> "
              f"{r['heldout_accuracy_after']:.3f} (± {r['heldout_se_after']:.3f}) | {r['final_kl']} | "
              f"{r['wall_time_s']:.0f} s |")


if __name__ == "__main__":
    main()
