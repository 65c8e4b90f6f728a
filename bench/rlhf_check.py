"""RLHF on one backbone, offline: preference pairs from the embedded SmolLM2's own continuations of
the movie review openers, labelled by a judge PPO never sees (TextBlob polarity); `train-reward`
trains a reward adapter on them; PPO then trains the policy with `reward.kind: adapter`, and the
judge scores the held-out continuations before and after. Each stage runs in a fresh process;
prints one JSON line per seed, then a Markdown table. Run alone (CPU-heavy).

    python bench/rlhf_check.py [PPO overrides, e.g. ppo.kl_coef=0.2] [--seeds 0 1 2] [--samples 6] [--reuse]
                               [--no-function-reward]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The PPO run: the quickstart's, with the reward's scores normalised (a reward adapter's scale
# differs from seed to seed) and the adaptive KL controller, floored at the quickstart's
# coefficient, raising it once the KL passes 5 nats.
PPO_SETTINGS = ["reward.normalize=true", "ppo.target_kl=5", "ppo.kl_horizon=8", "ppo.kl_coef_min=0.05"]
# Scored by the reward adapter, the judge logged beside it.
ADAPTER_REWARD = ["reward.kind=adapter", "reward.also_log=[textblob]"]
# Pairs whose judge scores differ by less than this carry no preference worth learning.
MIN_JUDGE_GAP = 0.1


def make_pairs(seed: int, samples: int, out: Path) -> dict:
    """Sample `samples` continuations per opener with the untrained policy; for every two of a
    prompt's continuations the judge tells apart, the more positive one is chosen."""
    import lora_ppo
    from lora_ppo.data import load_prompt_sets
    from lora_ppo.model import dequantized_once
    from lora_ppo.parts import build
    from lora_ppo.rewards import textblob_reward

    recipe = lora_ppo.load_recipe(REPO / "recipes" / "quickstart.yaml", [f"train.seed={seed}",
                                                                         "rollout.batch_size=64"])
    parts = build(recipe)
    judge = textblob_reward()
    train, held_out = load_prompt_sets(recipe.data, parts.tokenizer, seed)
    sampler = parts.sampler(recipe)
    counts = {}
    for name, rows in (("train", train.rows), ("held_out", held_out.rows)):
        pairs = []
        repeated = [row for row in rows for _ in range(samples)]
        completions = []
        with dequantized_once(parts.roles.peft, recipe.model):
            for start in range(0, len(repeated), 64):
                completions += sampler.sample(repeated[start : start + 64]).completions
        for i, row in enumerate(rows):
            texts = completions[i * samples : (i + 1) * samples]
            scores = judge([row.prompt] * samples, texts)
            for a, b in itertools.combinations(range(samples), 2):
                if abs(scores[a] - scores[b]) >= MIN_JUDGE_GAP:
                    good, bad = (a, b) if scores[a] > scores[b] else (b, a)
                    pairs.append({"prompt": row.prompt, "chosen": texts[good], "rejected": texts[bad]})
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
        counts[name] = len(pairs)
    return counts


def run(command: list[str]) -> tuple[dict, float]:
    """Run a lora-ppo command in a fresh process; (its summary.json, wall seconds)."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "lora_ppo.cli", *command, "--no-progress"], cwd=REPO,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip().splitlines()[-1:]}")
    output_dir = next(arg.split("=", 1)[1] for arg in command if arg.startswith("train.output_dir="))
    return json.loads((REPO / output_dir / "summary.json").read_text()), time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--samples", type=int, default=6, help="continuations per opener to pair up")
    parser.add_argument("--out", default="runs/bench-rlhf")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the pairs and reward adapters an earlier run left under --out; rerun PPO only")
    parser.add_argument("--function-reward", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the first seed's PPO with a function reward, for the memory comparison")
    parser.add_argument("--make-pairs", type=int, metavar="SEED", help=argparse.SUPPRESS)
    parser.add_argument("ppo_overrides", nargs="*", metavar="KEY=VALUE",
                        help="recipe overrides for the PPO stage, e.g. ppo.kl_coef=0.2")
    args = parser.parse_args()
    out = Path(args.out)
    if args.make_pairs is not None:  # the pair-making stage, in its own process
        print(json.dumps(make_pairs(args.make_pairs, args.samples, out / f"seed-{args.make_pairs}" / "pairs")))
        return

    rows = []
    for seed in args.seeds:
        base = out / f"seed-{seed}"
        pairs_files = [base / "pairs" / f"{name}.jsonl" for name in ("train", "held_out")]
        if args.reuse and all(f.is_file() for f in pairs_files):
            counts = {f.stem: sum(1 for _ in f.open()) for f in pairs_files}
            pairs_s = None
        else:
            t0 = time.perf_counter()
            made = subprocess.run([sys.executable, __file__, "--make-pairs", str(seed), "--samples", str(args.samples),
                                   "--out", str(out)], cwd=REPO, capture_output=True, text=True, check=True)
            counts = json.loads(made.stdout.strip().splitlines()[-1])
            pairs_s = time.perf_counter() - t0
        if args.reuse and (base / "reward" / "summary.json").is_file():
            reward, reward_s = json.loads((base / "reward" / "summary.json").read_text()), None
        else:
            reward, reward_s = run(["train-reward", "recipes/movie_reward.yaml", f"train.seed={seed}",
                                    f"data.source={pairs_files[0]}", f"data.eval_source={pairs_files[1]}",
                                    f"data.eval_size={counts['held_out']}",  # every held-out pair, not the first 128
                                    f"train.output_dir={base / 'reward'}"])
        ppo, ppo_s = run(["train", "recipes/quickstart.yaml", f"train.seed={seed}", *PPO_SETTINGS, *ADAPTER_REWARD,
                          *args.ppo_overrides,
                          f"reward.adapter={base / 'reward' / 'final' / 'reward'}", f"train.output_dir={base / 'ppo'}"])
        row = {
            "seed": seed, "pairs": counts,
            "reward_heldout_accuracy": round(reward["heldout_accuracy_after"], 3),
            "reward_heldout_accuracy_before": round(reward["heldout_accuracy_before"], 3),
            "judge_before": round(ppo["heldout_textblob_before"], 3),
            "judge_se_before": round(ppo["heldout_textblob_se_before"], 3),
            "judge_after": round(ppo["heldout_textblob_after"], 3),
            "judge_se_after": round(ppo["heldout_textblob_se_after"], 3),
            "reward_adapter_score_before": round(ppo["heldout_score_before"], 3),
            "reward_adapter_score_after": round(ppo["heldout_score_after"], 3),
            "final_kl": round(ppo["final_kl"], 2),  # the last rollout's: the policy before its last update
            "heldout_kl_after": round(ppo["heldout_kl_after"], 2),  # the judged policy's, on the held-out openers
            "ppo_peak_memory_gb": round(ppo["peak_memory_gb"], 2),
            "seconds": {stage: None if t is None else round(t)  # None: reused from an earlier run
                        for stage, t in (("pairs", pairs_s), ("train_reward", reward_s), ("ppo", ppo_s))},
        }
        if args.function_reward and seed == args.seeds[0]:  # the same PPO run with a function reward: one backbone
            function, _ = run(["train", "recipes/quickstart.yaml", f"train.seed={seed}", *PPO_SETTINGS, *args.ppo_overrides,
                               "reward.kind=textblob", "reward.also_log=[]", f"train.output_dir={base / 'ppo-function-reward'}"])
            row["function_reward_peak_memory_gb"] = round(function["peak_memory_gb"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| seed | pairs (train / held-out) | reward adapter held-out accuracy | judge (TextBlob) before -> after "
          "| KL: last rollout / judged policy | PPO peak memory | wall time (pairs + reward + PPO) |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["seconds"]
        print(f"| {r['seed']} | {r['pairs']['train']} / {r['pairs']['held_out']} | {r['reward_heldout_accuracy']:.3f} | "
              f"{r['judge_before']:.3f} (± {r['judge_se_before']:.3f}) -> {r['judge_after']:.3f} "
              f"(± {r['judge_se_after']:.3f}) | {r['final_kl']} / {r['heldout_kl_after']} | {r['ppo_peak_memory_gb']} GB | "
              f"{' + '.join('reused' if t is None else f'{t} s' for t in s.values())} |")


if __name__ == "__main__":
    main()
