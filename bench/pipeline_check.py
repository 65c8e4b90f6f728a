"""The whole RLHF pipeline on one 4-bit backbone, offline (recipes/pipeline/, docs/pipeline.md): for
each seed, `train-sft`, `train-reward`, then PPO from the SFT adapter (its reference) and, to compare,
the same PPO from the bare model; each stage in a fresh process. Measures the SFT stage's held-out
loss and format adherence, the reward adapter's held-out accuracy, and each PPO run's judged gain
(`correct`: the answer checked against the dataset's, never optimised), learned-reward gain, format
adherence and KL to its reference. Prints one JSON line per seed, then one with the means and
standard errors over seeds. CPU-heavy: run it alone.

    python bench/pipeline_check.py [--seeds 0 1 2] [--out runs/bench-pipeline] [--threads 2]
    python bench/pipeline_check.py --seeds 0 --set ppo:train.steps=12 --set all:model.dequantize_per_step=false
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes" / "pipeline"
sys.path.insert(0, str(REPO))

from lora_ppo.run_dir import read_jsonl  # noqa: E402
from lora_ppo.verifiable import answers_match, states_answer_in_format  # noqa: E402


def run(args: list[str], threads: int) -> float:
    """`lora-ppo ARGS` in a fresh process; its wall time. Stops the bench on a failure."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "lora_ppo.cli", *args, "--no-progress"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"lora-ppo {' '.join(args)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - t0


def share(records: list[dict], test) -> float:
    return sum(1 for r in records if test(r)) / max(1, len(records))


def formatted(record: dict) -> bool:
    return states_answer_in_format(record["completion"])


STAGES = ("sft", "reward", "ppo")
EXTRA: dict[str, list[str]] = {stage: [] for stage in STAGES}  # --set overrides, per stage


def sft_stage(out: Path, seed: int, threads: int) -> dict:
    wall = run(["train-sft", str(RECIPES / "sft.yaml"), f"train.seed={seed}", f"train.output_dir={out}",
                *EXTRA["sft"]], threads)
    summary = json.loads((out / "summary.json").read_text())
    before, after = read_jsonl(out / "eval_before.jsonl"), read_jsonl(out / "eval_after.jsonl")
    return {
        "heldout_loss": [round(summary["heldout_loss_before"], 3), round(summary["heldout_loss_after"], 3)],
        # Greedy completions of the held-out questions: a `#### N` line, and the right N.
        "format": [round(share(before, formatted), 3), round(share(after, formatted), 3)],
        "correct_greedy": [round(share(r, lambda x: answers_match(x["completion"], x["reference"])), 3)
                           for r in (before, after)],
        "wall_time_s": round(wall, 1),
    }


def reward_stage(out: Path, seed: int, threads: int) -> dict:
    wall = run(["train-reward", str(RECIPES / "reward.yaml"), f"train.seed={seed}", f"train.output_dir={out}",
                *EXTRA["reward"]], threads)
    summary = json.loads((out / "summary.json").read_text())
    return {"heldout_accuracy": [round(summary["heldout_accuracy_before"], 3),
                                 round(summary["heldout_accuracy_after"], 3)],
            "wall_time_s": round(wall, 1)}


def ppo_stage(out: Path, seed: int, threads: int, start: list[str]) -> dict:
    wall = run(["train", str(RECIPES / "ppo.yaml"), f"train.seed={seed}", f"train.output_dir={out}", *start,
                *EXTRA["ppo"]], threads)
    summary = json.loads((out / "summary.json").read_text())
    before, after = read_jsonl(out / "eval_before.jsonl"), read_jsonl(out / "eval_after.jsonl")

    def pair(name: str) -> list[float]:
        return [round(summary[f"heldout_{name}_before"], 3), round(summary[f"heldout_{name}_after"], 3)]

    return {
        "correct": pair("correct"), "correct_se": [round(summary["heldout_correct_se_before"], 3),
                                                   round(summary["heldout_correct_se_after"], 3)],
        "reward": pair("adapter"),
        "format": [round(share(before, formatted), 3), round(share(after, formatted), 3)],
        "heldout_kl_after": round(summary["heldout_kl_after"], 2),
        "final_kl": round(summary["final_kl"], 2),
        "wall_time_s": round(wall, 1),
    }


def mean_se(values: list[float]) -> list[float]:
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return [round(statistics.fmean(values), 3), round(se, 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/bench-pipeline")
    parser.add_argument("--threads", type=int, default=2, help="OMP/MKL threads of each stage's process")
    parser.add_argument("--set", action="append", default=[], metavar="STAGE:KEY=VALUE",
                        help="a recipe override for one stage (sft, reward, ppo) or all of them (all)")
    args = parser.parse_args()
    for item in args.set:
        stage, _, override = item.partition(":")
        if stage not in (*STAGES, "all") or "=" not in override:
            parser.error(f"--set {item!r}: expected STAGE:key=value with STAGE one of {', '.join(STAGES)}, all")
        for name in STAGES if stage == "all" else (stage,):
            EXTRA[name].append(override)

    rows = []
    for seed in args.seeds:
        root = Path(args.out) / f"seed-{seed}"
        sft, reward = root / "sft", root / "reward"
        row = {"seed": seed, "sft": sft_stage(sft, seed, args.threads), "reward": reward_stage(reward, seed, args.threads)}
        adapter = f"reward.sources=[{{kind: adapter, adapter: {reward}, weight: 1.0}}, " \
                  "{kind: math_answer, answer_column: answer, weight: 0.0, name: correct}]"
        row["ppo_from_sft"] = ppo_stage(root / "ppo", seed, args.threads, [f"adapters.policy.init_from={sft}", adapter])
        row["ppo_from_base"] = ppo_stage(root / "ppo-base", seed, args.threads, ["~adapters.policy.init_from", adapter])
        rows.append(row)
        print(json.dumps(row), flush=True)

    def over_seeds(stage: str, key: str, index: int) -> list[float]:
        return mean_se([r[stage][key][index] for r in rows])

    print(json.dumps({
        "seeds": args.seeds,
        "sft_heldout_loss_after": over_seeds("sft", "heldout_loss", 1),
        "sft_format_after": over_seeds("sft", "format", 1),
        "reward_heldout_accuracy_after": over_seeds("reward", "heldout_accuracy", 1),
        **{f"{stage}_{key}_{when}": over_seeds(stage, key, i)
           for stage in ("ppo_from_sft", "ppo_from_base") for key in ("correct", "format", "reward")
           for i, when in enumerate(("before", "after"))},
        **{f"{stage}_heldout_kl_after": mean_se([r[stage]["heldout_kl_after"] for r in rows])
           for stage in ("ppo_from_sft", "ppo_from_base")},
    }), flush=True)


if __name__ == "__main__":
    main()
