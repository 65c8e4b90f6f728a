"""The issue's yardstick: a plain REINFORCE loop on the quickstart task, for comparison with PPO.

Same 4-bit SmolLM2-135M-Instruct, same policy LoRA, same prompts, batch, sampling settings and
held-out evaluation as `recipes/quickstart.yaml`; no critic, no KL, no clipping, one gradient
step per batch: loss = -(score - batch mean score) * sum of the response's logprobs, averaged
over tokens. It runs for a wall-clock budget (default 6 minutes, the budget the yardstick was
quoted with) and evaluates the held-out prompts before and after. Prints one JSON object; run
alone (CPU-heavy).

    python bench/reinforce_baseline.py [--budget-s 360] [--lr 1e-3] [overrides of the quickstart recipe ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "quickstart.yaml"))
    parser.add_argument("--budget-s", type=float, default=360.0, help="training wall time (evaluation excluded)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: the recipe's ppo.learning_rate)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. data.eval_samples_per_prompt=4")
    args = parser.parse_args()

    import lora_ppo

    recipe = lora_ppo.load_recipe(args.recipe, ["train.output_dir=runs/bench-reinforce", "train.overwrite=true",
                                                *args.overrides])
    print(json.dumps(run_reinforce(recipe, args.budget_s, args.lr), indent=2))


def run_reinforce(recipe, budget_s: float, lr: float | None = None) -> dict:
    """Train the recipe's policy with plain REINFORCE for `budget_s` seconds of training (held-out
    evaluation and KL measurement excluded); returns the results as a JSON-ready dict."""
    import torch

    from lora_ppo.data import PromptStream
    from lora_ppo.model import dequantized_once
    from lora_ppo.parts import ADAM_EPS, build, evaluate_policy
    from lora_ppo.state import PromptPosition

    parts = build(recipe)  # the model, prompts, reward and evaluation PPO uses
    stream, position = PromptStream(parts.train_prompts.rows, recipe.train.seed), PromptPosition()
    optimizer = torch.optim.AdamW(parts.roles.policy_parameters(), lr=lr or recipe.ppo.learning_rate,
                                  weight_decay=0.0, eps=ADAM_EPS)
    before = evaluate_policy(parts, recipe).scores
    t0 = time.perf_counter()
    steps, curve, kl_curve, elapsed = 0, [], [], []
    while time.perf_counter() - t0 < budget_s:
        # The recipe's model.dequantize_per_step, as the PPO trainer applies it to each step.
        with dequantized_once(parts.roles.peft, recipe.model):
            prompts, position = stream.take(recipe.rollout.batch_size, position)
            samples, scores, kl = reinforce_step(parts, recipe, optimizer, prompts)
        t0 += kl["measure_s"]  # measuring the KL is not training: kept out of the budget
        steps += 1
        curve.append(round(scores.mean().item(), 3))
        kl_curve.append(round(kl["kl"], 3))
        elapsed.append(round(time.perf_counter() - t0, 1))
        print(json.dumps({"step": steps, "score": curve[-1], "kl": kl_curve[-1], "elapsed_s": elapsed[-1]}),
              file=sys.stderr, flush=True)
    train_s = time.perf_counter() - t0  # training time only (KL measurement excluded)
    after = evaluate_policy(parts, recipe).scores
    return {
        "algorithm": "reinforce (batch-mean baseline, no KL, one step per batch)",
        "steps": steps, "train_wall_s": round(train_s, 1), "learning_rate": optimizer.param_groups[0]["lr"],
        "heldout_score_before": round(before["score"], 4), "heldout_score_se_before": round(before["score_se"], 4),
        "heldout_score_after": round(after["score"], 4), "heldout_score_se_after": round(after["score_se"], 4),
        **{f"heldout_{k}_before": round(v, 4) for k, v in before.items() if k not in ("score", "score_se")},
        **{f"heldout_{k}_after": round(v, 4) for k, v in after.items() if k not in ("score", "score_se")},
        "final_kl": kl_curve[-1] if kl_curve else None,
        "batch_scores": curve,
        "batch_kl": kl_curve,
        "elapsed_s": elapsed,
        "last_batch_samples": [{"prompt": p, "completion": c} for p, c in zip(prompts[:4], samples.completions[:4])],
    }


def reinforce_step(parts, recipe, optimizer, prompts):
    """Sample a batch, score it, one gradient step on -(score - batch mean) * logprob."""
    import torch

    from lora_ppo.rewards import RewardBatch

    roles, cfg = parts.roles, recipe.rollout
    with roles.as_role("policy"):
        samples = parts.sampler(recipe).sample(prompts)
    batch = RewardBatch.from_rows(prompts, samples.completions, samples.completion_ids())
    scores = torch.tensor(parts.rewards.score(batch)[0])
    advantage = scores - scores.mean()
    input_ids, attention_mask = samples.model_input()
    mask = samples.response_mask.float()
    start = samples.query_ids.shape[1]
    with roles.as_role("policy"):
        logprobs, _ = roles.response_logprobs(input_ids, attention_mask, start, cfg.temperature)
    loss = -(advantage[:, None] * logprobs * mask).sum() / mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(roles.policy_parameters(), recipe.ppo.max_grad_norm)
    optimizer.step()
    # KL of the sampling policy to the starting model on this batch (k1 summed over each
    # response, as PPO's objective/kl): REINFORCE has no penalty, so this shows how far it went.
    t_kl = time.perf_counter()
    with torch.no_grad(), roles.as_role("reference"):
        ref_logprobs, _ = roles.response_logprobs(input_ids, attention_mask, start, cfg.temperature)
    kl = ((logprobs.detach() - ref_logprobs) * mask).sum(dim=1).mean().item()
    return samples, scores, {"kl": kl, "measure_s": time.perf_counter() - t_kl}


if __name__ == "__main__":
    main()
