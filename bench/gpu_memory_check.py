"""GPU check of the memory claim: PPO steps of a real-size model inside a capped GPU budget.

Builds a random-init model from a `config.json` (default: Llama-3.1-8B's shape, in
`model_configs/`; no weights are downloaded, the memory is the same as the real model's),
saves it in bf16 (or, with `--prequantized`, straight into a 4-bit checkpoint one weight at a
time: a 32B model's bf16 copy is 65 GB), then loads it through lora_ppo's own path in 4-bit and runs PPO steps of a
recipe (default `recipes/single_gpu_8b.yaml`) with the process's CUDA allocator capped so that
the whole process, CUDA context included, stays within `--gpu-gb`: an allocation beyond it
raises out-of-memory. Responses are forced to full length (no stop token) and prompts are
as long as `data.max_prompt_tokens` allows, the worst case the estimate plans for. Prints one
JSON object: per-phase peaks (`torch.cuda.max_memory_allocated`, reset per phase), the
allocator's reserved peak, the CUDA context, seconds per phase, and `lora-ppo estimate`'s
prediction for the same recipe.

    python bench/gpu_memory_check.py [--config bench/model_configs/llama-3.1-8b] [--tokenizer DIR]
                                     [--gpu-gb 12] [--steps 2] [--prequantized] [overrides ...]
    python bench/gpu_memory_check.py --config bench/model_configs/qwen2.5-32b --recipe recipes/single_gpu_32b.yaml \
                                     --gpu-gb 24 --prequantized --out bench/results/gpu_memory_check_qwen2.5-32b.json

Needs a CUDA GPU with room for the bf16 model while it is built (16 GB for 8B; the cap applies
only once it is saved) and disk for the saved copy; with `--prequantized`, room for one weight
and disk for the 4-bit checkpoint (19 GB for 32B). Without `--tokenizer`, a small one is built.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from random_models import build_random_4bit_model, build_random_model, small_tokenizer  # noqa: E402  (bench/)

GB = 1e9


def software() -> dict:
    """The device and the libraries' versions a result was measured with: a transformers release
    can change what a keyword means (before 5.24 the KV cache was `past_key_values`)."""
    import importlib.metadata

    import torch

    versions = {name: importlib.metadata.version(name) for name in ("transformers", "peft", "bitsandbytes")}
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, **versions}


def cap_allocator(gpu_gb: float) -> tuple[float, float]:
    """Cap torch's CUDA allocator at `gpu_gb` minus the CUDA context (which counts against a real
    card but not against the allocator) and reset its peaks: (context, cap) in bytes; (0, 0)
    without a GPU, where the run goes uncapped."""
    import torch

    if not torch.cuda.is_available():
        return 0.0, 0.0
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    context = total - free - torch.cuda.memory_reserved()
    cap = gpu_gb * GB - context
    torch.cuda.set_per_process_memory_fraction(cap / total)
    torch.cuda.reset_peak_memory_stats()
    return context, cap


def run_overrides(model_dir: Path, output_dir: Path, overrides: list[str]) -> list[str]:
    """The recipe overrides of a device run: the built model, no evaluation, every response at full
    length (no stop token), a fresh run folder; then the caller's."""
    return [f"model.name={model_dir}", "data.eval_source=null", "data.eval_size=0", "train.eval=false",
            "rollout.stop_token=null", f"train.output_dir={output_dir}", "train.overwrite=true", *overrides]


def long_prompts(tokenizer, data, n: int = 64) -> tuple[list, int]:
    """PromptRows of one repeated word, as long as data.max_prompt_tokens allows (formatted as
    the recipe formats its prompts)."""
    from lora_ppo.data import PromptFormat, prepare_rows

    fmt = PromptFormat(tokenizer, data.chat_template, data.system_prompt)
    words = data.max_prompt_tokens
    while words > 1 and len(fmt.render(" ".join(["the"] * words))[1]) > data.max_prompt_tokens:
        words -= 1
    rows = prepare_rows([{"prompt": " ".join(["the"] * words)}] * n, "prompt", fmt, data.max_prompt_tokens, "bench")
    if not rows.rows:
        raise SystemExit(f"data.max_prompt_tokens={data.max_prompt_tokens}: even a one-word prompt is longer in "
                         "this recipe's format (its chat template); raise it")
    return rows.rows, len(rows.rows[0].ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "bench" / "model_configs" / "llama-3.1-8b"))
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (any smaller than the vocabulary; default: a small one, built)")
    parser.add_argument("--prequantized", action="store_true", help="build the model straight into a 4-bit checkpoint")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "single_gpu_8b.yaml"))
    parser.add_argument("--gpu-gb", type=float, default=12.0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--work", default="/tmp/lora_ppo_gpu_check")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    import torch

    import lora_ppo
    from lora_ppo import memory
    from lora_ppo.data import PromptStream
    from lora_ppo.estimate import as_json, estimate_recipe

    cuda = torch.cuda.is_available()  # without one it runs as a smoke test of itself, uncapped
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / (Path(args.config).name + ("-4bit" if args.prequantized else ""))
    tokenizer = args.tokenizer or small_tokenizer(work / "tokenizer")
    t0 = time.perf_counter()
    (build_random_4bit_model if args.prequantized else build_random_model)(Path(args.config), tokenizer, model_dir)
    build_s = time.perf_counter() - t0

    context, cap = cap_allocator(args.gpu_gb)
    reserved_peak = [0]
    if cuda:
        # Phases reset the CUDA peak counters; keep the largest reserved peak across them.
        real_reset = memory.reset_peak

        def reset_peak_keeping_reserved() -> None:
            reserved_peak[0] = max(reserved_peak[0], torch.cuda.max_memory_reserved())
            real_reset()

        memory.reset_peak = reset_peak_keeping_reserved

    from transformers import AutoTokenizer

    base = lora_ppo.load_recipe(args.recipe, [f"model.name={model_dir}", *args.overrides])
    prompts, prompt_tokens = long_prompts(AutoTokenizer.from_pretrained(model_dir), base.data)
    overrides = run_overrides(model_dir, work / "run", args.overrides)
    recipe = lora_ppo.load_recipe(args.recipe, overrides)
    exact = lora_ppo.load_recipe(args.recipe, [*overrides, f"data.max_prompt_tokens={prompt_tokens}"])
    t1 = time.perf_counter()
    steps, error, ran = [], None, recipe
    try:
        trainer = lora_ppo.PPOTrainer(recipe, progress=False)
        ran = trainer.recipe  # with the `auto` sizes the run chose for the capped free memory
        exact = ran.with_values({"data.max_prompt_tokens": prompt_tokens})
        # The longest prompts the recipe admits, in place of the builtin short ones.
        trainer.stream = PromptStream(prompts, recipe.train.seed)
        load_s = time.perf_counter() - t1
        after_load = torch.cuda.memory_allocated() if cuda else memory.resident_bytes()
        load_peak = torch.cuda.max_memory_allocated() if cuda else memory.resident_bytes("VmHWM")
        for _ in range(args.steps):
            metrics, _rollout = trainer.train_step()
            steps.append({k: round(v, 3) for k, v in metrics.items()
                          if k.startswith(("memory/", "time/", "tokens_per_s"))})
            print(json.dumps(steps[-1]), file=sys.stderr, flush=True)
    except torch.OutOfMemoryError as err:  # did not fit under the cap: say where
        error = f"out of memory after {len(steps)} step(s): {str(err).splitlines()[0]}"
        load_s = after_load = load_peak = float("nan")
    if cuda:
        reserved_peak[0] = max(reserved_peak[0], torch.cuda.max_memory_reserved())
    predicted = as_json(estimate_recipe(exact, device="cuda" if cuda else "cpu", budget_gb=args.gpu_gb))
    result = {
        "fits": error is None, "error": error, **software(),
        "config": args.config, "recipe": args.recipe, "overrides": args.overrides,
        "params": predicted["params"], "prompt_tokens": prompt_tokens,
        "max_new_tokens": recipe.rollout.max_new_tokens, "batch": recipe.rollout.batch_size,
        "micro_batch": ran.micro_batch_size if ran.ppo.grad_accum_steps != "auto" else None,
        "auto": {path: ran.model_dump(mode="json")[path.split(".")[0]][path.split(".")[1]] for path in recipe.auto_sizes},
        "gpu_gb_budget": args.gpu_gb, "cuda_context_gb": round(context / GB, 3),
        "allocator_cap_gb": round(cap / GB, 3),
        "after_load_gb": round(after_load / GB, 3), "load_peak_gb": round(load_peak / GB, 3),
        "max_allocated_gb": round(memory.run_peak_gb(), 3),
        "max_reserved_gb": round(reserved_peak[0] / GB, 3),
        "process_peak_gb": round((reserved_peak[0] + context) / GB, 3),
        "steps": steps,
        "estimated": predicted,
        "build_s": round(build_s, 1), "load_s": round(load_s, 1), "prequantized": args.prequantized,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
