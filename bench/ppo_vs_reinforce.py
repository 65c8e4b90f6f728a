"""PPO (the quickstart recipe) against plain REINFORCE on the same host, seed and wall-clock.

For each seed: train the recipe with PPO, then train REINFORCE (bench/reinforce_baseline.py)
for exactly PPO's training time (evaluation excluded), both evaluated on the same held-out
prompts with the same sampling seed. REINFORCE has no KL penalty, so its KL is reported beside
its score, and so is the point where its KL first reached PPO's final KL (the score it had
bought with the same drift from the starting model). Prints one JSON object; run alone (each
seed is a few minutes of CPU-heavy work on 2 cores).

    python bench/ppo_vs_reinforce.py [--seeds 0 1 2] [overrides of the recipe ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "quickstart.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/bench-ppo-vs-reinforce")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for both, e.g. data.eval_samples_per_prompt=4")
    args = parser.parse_args()

    per_seed = []
    for seed in args.seeds:
        ppo = run_ppo(args.recipe, seed, f"{args.out}/ppo-seed{seed}", args.overrides)
        gc.collect()
        reinforce = run_reinforce_for(args.recipe, seed, f"{args.out}/reinforce-seed{seed}", args.overrides,
                                      ppo["train_wall_s"], ppo["final_kl"])
        gc.collect()
        per_seed.append({"seed": seed, "ppo": ppo, "reinforce": reinforce})
        print(json.dumps(per_seed[-1]), file=sys.stderr, flush=True)

    def mean(algo: str, key: str) -> float:
        return round(statistics.fmean(run[algo][key] for run in per_seed), 4)

    print(json.dumps({
        "recipe": args.recipe, "overrides": args.overrides, "seeds": args.seeds,
        "mean": {algo: {key: mean(algo, key) for key in ("heldout_gain", "final_kl", "train_wall_s")}
                 for algo in ("ppo", "reinforce")},
        "per_seed": per_seed,
    }, indent=2))


def seeded_recipe(recipe_path: str, seed: int, out: str, overrides: list[str]):
    """The recipe with this seed and output folder, and the user's overrides, for either algorithm."""
    import lora_ppo

    return lora_ppo.load_recipe(recipe_path, [f"train.seed={seed}", f"train.output_dir={out}",
                                              "train.overwrite=true", *overrides])


def run_ppo(recipe_path: str, seed: int, out: str, overrides: list[str]) -> dict:
    import lora_ppo

    recipe = seeded_recipe(recipe_path, seed, out, overrides)
    summary = lora_ppo.PPOTrainer(recipe, progress=False).train()
    metrics = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (Path(out) / "samples.jsonl").read_text().splitlines()]
    last_step = metrics[-1]["step"]
    return {
        "steps": len(metrics),
        # Training only, as REINFORCE's budget counts it: the steps, not loading or evaluation.
        "train_wall_s": round(sum(m["time/step"] for m in metrics), 1),
        **_heldout(summary),
        "final_kl": round(summary["final_kl"], 3),
        "batch_scores": [round(m["objective/scores"], 3) for m in metrics],
        "batch_kl": [round(m["objective/kl"], 3) for m in metrics],
        "last_batch_samples": [{"prompt": s["prompt"], "completion": s["completion"]}
                               for s in samples if s["step"] == last_step],
    }


def run_reinforce_for(recipe_path: str, seed: int, out: str, overrides: list[str], budget_s: float,
                      ppo_kl: float) -> dict:
    from reinforce_baseline import run_reinforce

    result = run_reinforce(seeded_recipe(recipe_path, seed, out, overrides), budget_s)
    reached = next((i for i, kl in enumerate(result["batch_kl"]) if kl >= ppo_kl), None)
    return {
        "steps": result["steps"],
        "train_wall_s": result["train_wall_s"],
        **_heldout(result),
        "final_kl": result["final_kl"],
        "at_ppo_final_kl": None if reached is None else {
            "step": reached + 1, "elapsed_s": result["elapsed_s"][reached],
            "batch_score": result["batch_scores"][reached], "batch_kl": result["batch_kl"][reached],
        },
        "batch_scores": result["batch_scores"],
        "batch_kl": result["batch_kl"],
        "last_batch_samples": result["last_batch_samples"],
    }


def _heldout(summary: dict) -> dict:
    before, after = summary["heldout_score_before"], summary["heldout_score_after"]
    return {
        "heldout_score_before": round(before, 4), "heldout_score_after": round(after, 4),
        "heldout_gain": round(after - before, 4),
        "heldout_score_se_after": round(summary["heldout_score_se_after"], 4),
        "heldout_textblob_before": round(summary.get("heldout_textblob_before", float("nan")), 4),
        "heldout_textblob_after": round(summary.get("heldout_textblob_after", float("nan")), 4),
    }


if __name__ == "__main__":
    main()
