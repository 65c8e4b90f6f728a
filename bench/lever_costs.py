"""What each memory lever of docs/memory.md costs a step, at a recipe's real sizes, without the model.

Each lever changes one piece of work, and that piece can be timed alone, on the card a user has
(a CUDA GPU when there is one, else the CPU), from the model's config and the recipe:

- `ppo.optimizer_state`: one optimizer step over the recipe's trainable adapter tensors (shapes
  as `lora-ppo estimate` counts them), with torch's AdamW on the device (`device`), bitsandbytes'
  AdamW8bit (`8bit`), and `optimizers.CpuAdamW` (`cpu`: weights and gradients copied to CPU
  memory, AdamW there, weights copied back; `transfer_gb` crosses per step on a GPU).
  `optimizer_steps_per_ppo_step` = epochs x minibatches.
- `model.offload_embeddings`: one lookup of the whole batch (scoring, each update micro-batch)
  and of one decoded token's rows, from the table on the device against `model.CpuEmbedding`.
- `model.quantize_lm_head`: the LM head over one chunk of positions (`logprobs.DEFAULT_CHUNK_TOKENS`)
  in the compute dtype against the 4-bit head bitsandbytes makes (`model.quantization`'s type).
  `lm_head_matmuls_per_step` counts the chunks of a step's response positions through the head:
  scoring's two passes (policy, reference), and per update epoch the policy's forward, its
  recomputation in backward and the backward's product (3).

No weights are loaded; tensors are random. Prints JSON.

    python bench/lever_costs.py                                   # the 32B recipe (about 2 minutes on CPU)
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


def median_seconds(run, repeats: int, sync=lambda: None) -> float:
    run()  # the first call allocates (AdamW's moments, the allocator's pages)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def adapter_tensors(shape, recipe) -> list[int]:
    """Element counts of every trainable tensor, one entry each, as the estimate counts them."""
    from lora_ppo.estimate import trainable_tensors

    return [numel for numel, count in trainable_tensors(shape, recipe) for _ in range(count)]


def optimizer_costs(sizes: list[int], device, repeats: int, sync) -> dict:
    import torch

    from lora_ppo.optimizers import adamw

    result = {"adapter_tensors": len(sizes), "adapter_params": sum(sizes),
              # per optimizer step on a GPU: each weight and gradient down (fp32), each weight up
              "transfer_gb": round(3 * 4 * sum(sizes) / 1e9, 3)}
    for state in ("device", "8bit", "cpu"):
        weights = [torch.zeros(n, device=device, requires_grad=True) for n in sizes]
        for w in weights:
            w.grad = torch.full_like(w, 1e-3)
        optimizer = adamw([{"params": weights, "lr": 1e-5}], state, eps=1e-8)
        result[f"{state}_step_s"] = round(median_seconds(optimizer.step, repeats, sync), 4)
        del weights, optimizer
    return result


def embedding_costs(shape, recipe, device, repeats: int, sync) -> dict:
    import torch

    from lora_ppo.model import CpuEmbedding

    table = torch.nn.Embedding(shape.vocab, shape.hidden, dtype=torch.bfloat16)
    lookups = {"device": table.to(device), "cpu": CpuEmbedding(torch.nn.Embedding(
        shape.vocab, shape.hidden, dtype=torch.bfloat16), device)}
    rows = recipe.rollout.batch_size
    tokens = recipe.data.max_prompt_tokens + recipe.rollout.max_new_tokens
    whole = torch.randint(0, shape.vocab, (rows, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    newest = whole[:, -1:]
    result = {"table_gb": round(shape.vocab * shape.hidden * 2 / 1e9, 3), "rows": rows, "tokens": tokens,
              "whole_batch_gb": round(rows * tokens * shape.hidden * 2 / 1e9, 3),
              "decode_tokens_per_step": recipe.rollout.max_new_tokens}
    with torch.no_grad():
        for where, lookup in lookups.items():
            result[f"{where}_whole_batch_s"] = round(median_seconds(lambda: lookup(whole), repeats, sync), 5)
            result[f"{where}_decode_token_s"] = round(median_seconds(lambda: lookup(newest), repeats * 20, sync), 6)
    return result


def lm_head_costs(shape, recipe, device, dtype, repeats: int, sync) -> dict:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf
    import torch

    from lora_ppo.logprobs import DEFAULT_CHUNK_TOKENS

    weight = torch.randn(shape.vocab, shape.hidden, dtype=dtype, device=device) * 0.02
    quantized, state = bnbf.quantize_4bit(weight, quant_type=recipe.model.bnb_4bit_quant_type)
    hidden = torch.randn(DEFAULT_CHUNK_TOKENS, shape.hidden, dtype=dtype, device=device)
    positions = recipe.rollout.batch_size * recipe.rollout.max_new_tokens
    chunks = -(-positions // DEFAULT_CHUNK_TOKENS)
    with torch.no_grad():
        full = median_seconds(lambda: torch.nn.functional.linear(hidden, weight), repeats, sync)
        four_bit = median_seconds(lambda: bnb.matmul_4bit(hidden, quantized.t(), quant_state=state), repeats, sync)
    return {"chunk_tokens": DEFAULT_CHUNK_TOKENS, "compute_dtype_chunk_s": round(full, 5),
            "4bit_chunk_s": round(four_bit, 5), "lm_head_matmuls_per_step": chunks * (2 + 3 * recipe.ppo.num_epochs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "single_gpu_32b.yaml"))
    parser.add_argument("--config", default=str(REPO / "bench" / "model_configs" / "qwen2.5-32b"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()

    import torch

    import lora_ppo
    from lora_ppo.model_shape import load_shape
    from lora_ppo.quantization import compute_dtype

    recipe = lora_ppo.load_recipe(args.recipe, [f"model.name={args.config}"])
    shape = load_shape(args.config)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dtype = compute_dtype(recipe.model)  # what the model would compute in here (float32 on a CPU)
    result = {"recipe": args.recipe, "config": args.config,
              "device": torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)",
              "torch": torch.__version__, "optimizer_steps_per_ppo_step": recipe.ppo.num_epochs * recipe.ppo.num_minibatches}

    def save() -> None:  # after each part: a device call cut short keeps the parts done
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    result["optimizer_state"] = optimizer_costs(adapter_tensors(shape, recipe), device, args.repeats, sync)
    save()
    result["offload_embeddings"] = embedding_costs(shape, recipe, device, args.repeats, sync)
    save()
    result["quantize_lm_head"] = lm_head_costs(shape, recipe, device, dtype, args.repeats, sync)
    save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
