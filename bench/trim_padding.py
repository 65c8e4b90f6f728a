"""`ppo.trim_padding` and `ppo.packing` on CPU, printed as JSON: the scoring passes' and the update's
seconds over a rollout whose responses stop at different lengths, with neither, trimming, and packing,
in turn.

The quickstart's model and prompts (SmolLM2-135M, real 4-bit NF4): one rollout of `--batch` responses
sampled up to `--max-new-tokens`, each then cut at a random length between 1/8 of that and all of
it (as responses that stop at their EOS are), rescored. Scoring in micro-batches of 8 rows; the update
as `recipes/quickstart.yaml` runs it except for micro-batches of `--micro-batch` rows (its minibatches
of 8 split in two: the rows of each are ordered by length first when trimming). Packed, a micro-batch
holds as many sequences of at most the rollout's width, rows back to back.

    python bench/trim_padding.py [--repeats 3]      # about 6 minutes on 2 cores; run alone
    python bench/trim_padding.py --max-new-tokens 20 --micro-batch 8 --as-sampled   # the quickstart's own shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def ragged(response_ids, response_mask, pad_id: int, seed: int):
    """Responses cut at random lengths between 1/8 of their width and all of it (padding after), as
    responses that stop at their EOS are; the same lengths for the same seed. (ids, mask, kept) [B, T]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows, width = response_ids.shape
    lengths = torch.randint(max(1, width // 8), width + 1, (rows,), generator=g)
    keep = (torch.arange(width)[None, :] < lengths[:, None]).to(response_mask.device)
    mask = response_mask & keep
    return torch.where(mask, response_ids, torch.full_like(response_ids, pad_id)), mask, keep


def variable_lengths(rollout, pad_id: int, seed: int):
    """The rollout with each response cut at a random length (`ragged`)."""
    response_ids, response_mask, _ = ragged(rollout.response_ids, rollout.response_mask, pad_id, seed)
    return dataclasses.replace(rollout, response_ids=response_ids, response_mask=response_mask)


def main() -> None:
    import torch

    import lora_ppo
    from lora_ppo.model import dequantized_once
    from lora_ppo.rollout import score_passes
    from lora_ppo.update import compute_advantages, ppo_update

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--as-sampled", action="store_true",
                        help="keep the responses as sampled (the quickstart's own lengths), not cut at random")
    args = parser.parse_args()

    recipe = lora_ppo.load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml", [
        f"rollout.batch_size={args.batch}", f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.stop_token=null", "train.eval=false", "train.output_dir=/tmp/lora_ppo_trim_padding_bench",
        "rollout.forward_batch_size=8"])
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    roles, tokenizer = trainer.parts.roles, trainer.parts.tokenizer
    settings = dataclasses.replace(trainer.update_settings, micro_batch_size=args.micro_batch)
    settings_names = ("off", "on", "packed")
    seconds = {phase: {name: [] for name in settings_names} for phase in ("score", "update")}
    padding, micro_batches = {}, {}
    _, sampled = trainer.train_step()
    with dequantized_once(roles.peft, recipe.model):  # as a step runs (the quickstart dequantizes per step)
        rollout = sampled if args.as_sampled else variable_lengths(sampled, tokenizer.pad_token_id, seed=0)
        ids, mask, start = rollout.input_ids, rollout.attention_mask, rollout.response_start
        old, ref, values = score_passes(roles, ids, mask, start, recipe.rollout.temperature, 8)
        rollout = dataclasses.replace(rollout, old_logprobs=old, ref_logprobs=ref, values=values)
        adv = compute_advantages(rollout, recipe.ppo, recipe.ppo.kl_coef, rollout.scores)
        # Learning rate 0: every repeat updates the same weights, so each times the same work.
        optimizer = torch.optim.SGD(roles.policy_parameters() + roles.value_parameters(), lr=0.0)
        for _ in range(args.repeats):
            for setting in settings_names:
                roles.trim_padding, roles.packing = setting != "off", setting == "packed"
                t0 = time.perf_counter()
                score_passes(roles, ids, mask, start, recipe.rollout.temperature, 8)
                seconds["score"][setting].append(time.perf_counter() - t0)
                forwards = []
                hook = roles.decoder.register_forward_pre_hook(lambda module, args: forwards.append(1))
                t0 = time.perf_counter()
                stats = ppo_update(roles, optimizer, None, rollout, adv, recipe.ppo, settings, recipe.ppo.kl_coef,
                                   torch.Generator().manual_seed(0))
                seconds["update"][setting].append(time.perf_counter() - t0)
                hook.remove()
                padding[setting] = round(stats.padding_frac, 4)
                micro_batches[setting] = len(forwards) // 2  # a forward per role and micro-batch
    lengths = rollout.response_mask.sum(dim=1).float()
    result = {
        "shape": {"batch": args.batch, "response_width": int(rollout.response_ids.shape[1]),
                  "response_tokens_mean": round(float(lengths.mean()), 1), "prompt_width": start,
                  "micro_batch": args.micro_batch, "forward_batch_size": 8, "as_sampled": args.as_sampled},
        "update_padding_frac": padding,
        "update_micro_batches": micro_batches,
        **{f"{phase}_s_median": {k: round(statistics.median(v), 2) for k, v in by.items()}
           for phase, by in seconds.items()},
        **{f"{phase}_on_over_off": round(statistics.median(by["on"]) / statistics.median(by["off"]), 3)
           for phase, by in seconds.items()},
        **{f"{phase}_packed_over_on": round(statistics.median(by["packed"]) / statistics.median(by["on"]), 3)
           for phase, by in seconds.items()},
        "seconds": seconds,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
