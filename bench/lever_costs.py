"""The host's share of what the memory levers cost a step, at a recipe's real sizes, on CPU.

Two of the levers of docs/memory.md move work from the GPU to the CPU, and that work is the same
whatever the card:

- `ppo.optimizer_state: cpu`: each optimizer step copies every adapter weight and gradient into
  CPU memory, runs torch's AdamW there, and copies the weights back (`optimizers.CpuAdamW`). Timed
  here as a whole on CPU tensors of the recipe's adapter shapes (its copies are memory copies
  here; a GPU adds the transfers: `transfer_gb` per optimizer step), beside torch's AdamW over the
  same weights, which is what the device would run without the lever.
- `model.offload_embeddings`: each forward looks its tokens up in the table in CPU memory
  (`model.CpuEmbedding`): the whole batch for scoring and each update micro-batch, the batch's
  newest tokens for each decoded token. Timed as that lookup from a table of the model's shape.

No weights are loaded: the adapters' shapes come from the model's config and the recipe (as
`lora-ppo estimate` counts them), the embedding table is random. Prints JSON.

    python bench/lever_costs.py                                   # the 32B recipe (about a minute)
    python bench/lever_costs.py --recipe recipes/single_gpu_8b.yaml --config bench/model_configs/llama-3.1-8b
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def median_seconds(run, repeats: int) -> float:
    run()  # the first call allocates (AdamW's moments, the allocator's pages)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def adapter_tensors(shape, recipe) -> list[int]:
    """Element counts of every trainable adapter tensor (policy, and value with its head)."""
    ad = recipe.adapters
    sizes = [n for n, count in shape.lora_tensors(ad.policy.r, ad.policy.target_modules) for _ in range(count)]
    if recipe.uses_critic:
        sizes += [n for n, count in shape.lora_tensors(ad.value.r, ad.value.target_modules) for _ in range(count)]
        sizes += [shape.hidden, 1]  # the value head
    return sizes


def optimizer_costs(sizes: list[int], repeats: int) -> dict:
    import torch

    from lora_ppo.optimizers import ADAMW_DEFAULTS, CpuAdamW

    result = {"adapter_tensors": len(sizes), "adapter_params": sum(sizes),
              # per optimizer step on a GPU: each weight and gradient down (fp32), each weight up
              "transfer_gb": round(3 * 4 * sum(sizes) / 1e9, 3)}
    for name in ("device_adamw", "cpu_adamw"):
        weights = [torch.zeros(n, requires_grad=True) for n in sizes]
        for w in weights:
            w.grad = torch.full_like(w, 1e-3)
        groups = [{"params": weights, "lr": 1e-5}]
        optimizer = (torch.optim.AdamW(groups, eps=1e-8, **ADAMW_DEFAULTS) if name == "device_adamw"
                     else CpuAdamW(groups, eps=1e-8))
        result[f"{name}_step_s"] = round(median_seconds(optimizer.step, repeats), 3)
        del weights, optimizer
    return result


def embedding_costs(shape, recipe, repeats: int) -> dict:
    import torch

    from lora_ppo.model import CpuEmbedding

    table = torch.nn.Embedding(shape.vocab, shape.hidden, dtype=torch.bfloat16)
    lookup = CpuEmbedding(table, torch.device("cpu"))
    rows = recipe.rollout.batch_size
    tokens = recipe.data.max_prompt_tokens + recipe.rollout.max_new_tokens
    g = torch.Generator().manual_seed(0)
    whole = torch.randint(0, shape.vocab, (rows, tokens), generator=g)
    newest = whole[:, -1:]
    with torch.no_grad():
        forward_s = median_seconds(lambda: lookup(whole), repeats)
        token_s = median_seconds(lambda: lookup(newest), repeats * 20)
    return {"table_gb": round(shape.vocab * shape.hidden * 2 / 1e9, 3), "rows": rows, "tokens": tokens,
            "whole_batch_lookup_s": round(forward_s, 4), "whole_batch_gb": round(rows * tokens * shape.hidden * 2 / 1e9, 3),
            "decode_token_lookup_s": round(token_s, 6), "decode_tokens_per_step": recipe.rollout.max_new_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "single_gpu_32b.yaml"))
    parser.add_argument("--config", default=str(REPO / "bench" / "model_configs" / "qwen2.5-32b"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    import lora_ppo
    from lora_ppo.estimate import load_shape

    recipe = lora_ppo.load_recipe(args.recipe, [f"model.name={args.config}"])
    shape = load_shape(args.config)
    optimizer_steps = recipe.ppo.num_epochs * recipe.ppo.num_minibatches
    result = {"recipe": args.recipe, "config": args.config, "threads": torch.get_num_threads(),
              "optimizer_steps_per_ppo_step": optimizer_steps,
              "optimizer_state_cpu": optimizer_costs(adapter_tensors(shape, recipe), args.repeats),
              "offload_embeddings": embedding_costs(shape, recipe, args.repeats)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
