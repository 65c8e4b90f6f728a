"""Live tensor memory of a scoring pass and an update micro-batch per row, on CPU, against the estimate.

`lora-ppo estimate` counts each phase's activations per row from constants fitted to the peaks
of `bench/memory_scaling.py`, which are a process's resident memory: on CPU that runs in float32.
A GPU computes in bfloat16 while the adapters stay float32, and PEFT casts each adapter's input
and output between the two: memory the float32 fit never saw (issue 41: a scoring row at 8B
measured 0.26 GB on an H100, estimated 0.18). This measures what a GPU's
`max_memory_allocated` would: the peak of the bytes torch's allocator holds (the profiler's
allocation and free events), above what was held before the pass, in either compute dtype.

A random 4-bit model of Llama-3.1-8B's proportions (hidden 512, MLP 1792, 2 layers, GQA 4:1),
every row `--prompt` + `--response` real tokens, computing in float32, in bfloat16, and in bfloat16
with `model.adapter_autocast` (`--dtypes` also takes `+fused`: `model.fused_lora`). For `--rows` of
each size: one scoring pass (policy, reference and value, stacked as `rollout.score_roles_together`
does) and one update micro-batch (policy then value, forward and backward, gradient checkpointing on
and off; with `--compile-update`, also `ppo.compile_update` with checkpointing). The per-row slope
(largest rows minus smallest, divided by their difference) cancels what does not grow with rows
(weights dequantized per matmul, the logits chunk, gradients of the adapters).

    python bench/live_memory.py [--rows 2 6] [--prompt 48 --response 80]   # about 2 minutes
    python bench/live_memory.py --dtypes bfloat16 --rows 4 8 --prompt 64 --response 64 --compile-update
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPE = {"hidden_size": 512, "intermediate_size": 1792, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "vocab_size": 2048}
MB = 1e6


def model_folder(work: Path) -> Path:
    from random_models import build_random_model, resized_config, small_tokenizer

    folder = work / "model"
    build_random_model(resized_config(SHAPE, work / "config"), small_tokenizer(work / "tokenizer"), folder)
    return folder


def measure(folder: Path, dtype: str, rows_list: list[int], prompt: int, response: int,
            compile_update: bool = False) -> dict:
    import torch

    import lora_ppo
    from lora_ppo.estimate import score_bytes, update_bytes
    from lora_ppo.compiled_update import CompiledLayers
    from lora_ppo.memory import peak_live_cpu_bytes
    from lora_ppo.model_shape import load_shape
    from lora_ppo.rollout import Rollout, score_passes
    from lora_ppo.update import UpdateSettings, compute_advantages, ppo_update

    compute, *levers = dtype.split("+")  # "bfloat16+autocast": model.adapter_autocast, "+fused": model.fused_lora
    recipe = lora_ppo.recipe_from_dict({
        "model": {"name": str(folder), "quantization": "4bit", "compute_dtype": compute,
                  "adapter_autocast": "autocast" in levers, "fused_lora": "fused" in levers, "dequantize_per_step": False,
                  "gradient_checkpointing": True},
        "adapters": {"policy": {"r": 16, "alpha": 32}, "value": {"r": 16, "alpha": 32}},
        "reward": {"kind": "function", "function": "tests.reward_fns:count_letter_e"},
        "data": {"source": "builtin:movie_review_openers", "eval_source": None, "max_prompt_tokens": prompt},
        "rollout": {"batch_size": max(rows_list), "max_new_tokens": response, "forward_batch_size": max(rows_list),
                    "logprobs_from_generation": False, "stop_token": None},
        "ppo": {"num_epochs": 1, "num_minibatches": 1},
        "train": {"output_dir": "/tmp/lora_ppo_live_memory_run", "eval": False, "overwrite": True},
    })
    roles = lora_ppo.PPOTrainer(recipe, progress=False).parts.roles
    shape, act = load_shape(str(folder)), 2 if compute == "bfloat16" else 4
    g = torch.Generator().manual_seed(0)
    # (checkpointing, compiled layers) of each update measured
    variants = [(True, None), (False, None)] + ([(True, CompiledLayers())] if compile_update else [])
    result: dict = {}
    for rows in rows_list:
        ids = torch.randint(3, SHAPE["vocab_size"], (rows, prompt + response), generator=g)
        mask = torch.ones_like(ids)
        scored = {}
        measured = peak_live_cpu_bytes(lambda: scored.update(zip(("old", "ref", "values"), score_passes(
            roles, ids, mask, prompt, 1.0, rows, together=recipe.rollout.score_roles_together))))
        point = {"score": {"measured_mb": measured / MB, "estimated_mb": score_bytes(shape, recipe, act, rows) / MB}}
        scores = torch.ones(rows)
        rollout = Rollout(rows=[], completions=[""] * rows, query_ids=ids[:, :prompt], query_mask=mask[:, :prompt],
                          response_ids=ids[:, prompt:], response_mask=mask[:, prompt:].bool(),
                          old_logprobs=scored["old"], ref_logprobs=scored["ref"], values=scored["values"],
                          raw_scores=scores, scores=scores, stopped=torch.zeros(rows, dtype=torch.bool))
        adv = compute_advantages(rollout, recipe.ppo, recipe.ppo.kl_coef, scores)
        # Plain SGD at lr 0: no optimizer state allocated in the window, the weights never move.
        optimizer = torch.optim.SGD(roles.policy_parameters() + roles.value_parameters(), lr=0.0)
        for checkpointing, compiled in variants:
            settings = UpdateSettings(rows, rows, 1.0, gradient_checkpointing=checkpointing, compiled_layers=compiled)
            def update():
                ppo_update(roles, optimizer, None, rollout, adv, recipe.ppo, settings, recipe.ppo.kl_coef,
                           torch.Generator().manual_seed(0))
            if compiled is not None:
                update()  # compiling allocates what the update does not hold
            measured = peak_live_cpu_bytes(update)
            planned = recipe.model_copy(update={"model": recipe.model.model_copy(
                update={"gradient_checkpointing": checkpointing})})
            point[f"update_checkpointing_{'on' if checkpointing else 'off'}" + ("_compiled" if compiled else "")] = {
                "measured_mb": measured / MB, "estimated_mb": update_bytes(shape, planned, act, rows) / MB}
        result[rows] = point
    low, high = min(rows_list), max(rows_list)
    per_row = {}
    for phase in result[low]:
        slope = {k: (result[high][phase][k] - result[low][phase][k]) / (high - low) for k in ("measured_mb", "estimated_mb")}
        per_row[phase] = {**{k: round(v, 3) for k, v in slope.items()},
                          "measured_over_estimated": round(slope["measured_mb"] / slope["estimated_mb"], 3)}
    return {"per_row": per_row,
            "points": {rows: {phase: {k: round(v, 2) for k, v in values.items()} for phase, values in point.items()}
                       for rows, point in result.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs=2, type=int, default=[2, 6])
    parser.add_argument("--prompt", type=int, default=48)
    parser.add_argument("--response", type=int, default=80)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "bfloat16+autocast"],
                        help="compute dtypes, each with +autocast (model.adapter_autocast) or +fused (model.fused_lora)")
    parser.add_argument("--compile-update", action="store_true",
                        help="also the update with ppo.compile_update (checkpointing on): compiling takes a minute")
    parser.add_argument("--work", default="/tmp/lora_ppo_live_memory")
    args = parser.parse_args()
    folder = model_folder(Path(args.work))
    out = {"shape": SHAPE, "prompt": args.prompt, "response": args.response}
    for dtype in args.dtypes:
        out[dtype] = measure(folder, dtype, args.rows, args.prompt, args.response, args.compile_update)
        print(json.dumps({dtype: out[dtype]["per_row"]}), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
