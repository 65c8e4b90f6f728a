"""Memory scaling: peak memory per PPO phase against base-model size, per quantization.

Random-init Llama models of realistic proportions (about 30M to 0.5B parameters, SmolLM2's
49k vocabulary, built from configs) each run two full PPO steps (rollout + update) in a fresh
process; the second step's per-phase peaks are reported (the first one allocates the AdamW
state). Also prints what `lora-ppo estimate --device cpu` predicts for the same recipe, and the
fitted slope of peak memory against base parameters. Run alone: it is CPU-heavy.

    python bench/memory_scaling.py [--sizes 30m 70m 135m 360m 500m] [--quant 4bit 8bit none] [--no-checkpointing]

On CPU the peaks are the process's peak resident memory per phase (VmHWM, reset between phases).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Llama proportions; vocabulary 49152 (SmolLM2's tokenizer), tied embeddings.
SIZES = {
    "30m": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2),
    "70m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=10, num_attention_heads=8, num_key_value_heads=4),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3),
    "360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5),
    "500m": dict(hidden_size=1280, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=20, num_key_value_heads=4),
}
PROMPT_WORDS = 24  # every prompt is the same length, so the estimate sees the real sequence length
BATCH, NEW_TOKENS = 8, 16


def build_model(size: str, folder: Path) -> None:
    """Save a random-init Llama of `size` with the builtin SmolLM2 tokenizer (skip if present)."""
    if (folder / "config.json").is_file():
        return
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from lora_ppo.model import resolve_builtin

    tokenizer = AutoTokenizer.from_pretrained(resolve_builtin("builtin:smollm2-135m-instruct"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **SIZES[size])
    staging = folder.with_name(folder.name + ".partial")
    LlamaForCausalLM(config).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(folder)


GRADIENT_CHECKPOINTING = "true"  # --no-checkpointing measures the update without it


def recipe_overrides(model_dir: Path, quant: str, prompts: Path, out: Path) -> list[str]:
    return [
        f"model.name={model_dir}", f"model.quantization={quant}",
        f"model.gradient_checkpointing={GRADIENT_CHECKPOINTING}",
        f"data.source={prompts}", "data.eval_size=0", f"data.max_prompt_tokens={PROMPT_WORDS + 8}",
        f"rollout.batch_size={BATCH}", f"rollout.max_new_tokens={NEW_TOKENS}", "rollout.stop_token=null",
        f"rollout.forward_batch_size={BATCH}", "ppo.num_epochs=1", "ppo.num_minibatches=2",
        "train.eval=false", f"train.output_dir={out}", "train.overwrite=true",
    ]


def measure_one(model_dir: Path, quant: str, prompts: Path, out: Path) -> dict:
    """In this (fresh) process: two PPO steps; the second step's per-phase peaks, and the estimate."""
    import torch

    import lora_ppo
    from lora_ppo import memory
    from lora_ppo.estimate import as_json, estimate_recipe

    baseline = memory.resident_bytes()
    recipe = lora_ppo.load_recipe(REPO / "recipes" / "quickstart.yaml", recipe_overrides(model_dir, quant, prompts, out))
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    prompt_tokens = max(len(trainer.tokenizer(p)["input_ids"]) for p in trainer.train_prompts.prompts)
    memory.release_memory()
    loaded = memory.resident_bytes()
    t0 = time.perf_counter()
    trainer.train_step()
    metrics, _ = trainer.train_step()
    seconds = time.perf_counter() - t0
    # The estimate for exactly this recipe, with the real prompt length.
    exact = lora_ppo.load_recipe(REPO / "recipes" / "quickstart.yaml",
                                 [*recipe_overrides(model_dir, quant, prompts, out), f"data.max_prompt_tokens={prompt_tokens}"])
    predicted = as_json(estimate_recipe(exact, device="cpu"))
    measured = {k.split("/")[1][: -len("_gb")]: round(v, 3) for k, v in metrics.items()
                if k.startswith("memory/") and k.endswith("_gb") and k != "memory/peak_gb"}
    return {
        "params": predicted["params"],
        "quantization": quant,
        "threads": torch.get_num_threads(),
        "prompt_tokens": prompt_tokens,
        "process_baseline_gb": round(baseline / 1e9, 3),
        "after_load_gb": round(loaded / 1e9, 3),
        "measured_gb": measured,
        "estimated_gb": {k: predicted["phases_gb"][k] for k in measured if k in predicted["phases_gb"]},
        "two_steps_s": round(seconds, 1),
    }


def fit_slope(rows: list[dict], quant: str) -> dict:
    """Least-squares fits of memory = fixed + slope * params: for the step's peak (max over
    phases, activations included) and for what stays resident (the reward phase, where only
    weights, adapters, optimizer state and the runtime are held)."""
    ok = [r for r in rows if r.get("quantization") == quant and "measured_gb" in r]
    if len(ok) < 2:
        return {}
    return {
        "peak": _line([(r["params"], max(r["measured_gb"].values()) * 1e9) for r in ok]),
        "resident": _line([(r["params"], r["measured_gb"]["reward"] * 1e9) for r in ok]),
    }


def _line(pts: list[tuple[float, float]]) -> dict:
    n = len(pts)
    mx = sum(p for p, _ in pts) / n
    my = sum(m for _, m in pts) / n
    sxx = sum((p - mx) ** 2 for p, _ in pts)
    slope = sum((p - mx) * (m - my) for p, m in pts) / sxx
    return {"bytes_per_param": round(slope, 3), "fixed_gb": round((my - slope * mx) / 1e9, 3), "points": n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--quant", nargs="+", default=["4bit", "8bit", "none"], choices=["4bit", "8bit", "none"])
    parser.add_argument("--work", default="/tmp/lora_ppo_bench_memory", help="where the random models are saved")
    parser.add_argument("--no-checkpointing", action="store_true", help="update without gradient checkpointing")
    parser.add_argument("--one", nargs=2, metavar=("SIZE", "QUANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    global GRADIENT_CHECKPOINTING
    GRADIENT_CHECKPOINTING = "false" if args.no_checkpointing else "true"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.txt"
    prompts.write_text("\n".join(" ".join(["the"] * PROMPT_WORDS) for _ in range(64)) + "\n")

    if args.one:  # child mode: measure one configuration, print one JSON line
        size, quant = args.one
        print(json.dumps(measure_one(work / size, quant, prompts, work / f"run-{size}-{quant}")))
        return

    rows = []
    for size in args.sizes:
        build_model(size, work / size)
        for quant in args.quant:
            # A fresh process per point: peak RSS of one configuration must not include another's.
            flags = ["--no-checkpointing"] if args.no_checkpointing else []
            proc = subprocess.run([sys.executable, __file__, "--work", str(work), *flags, "--one", size, quant],
                                  capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["?"])[-1]
                row = {"size": size, "quantization": quant, "error": last}
            else:
                row = {"size": size, **json.loads(proc.stdout.strip().splitlines()[-1])}
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    slopes = {q: fit_slope(rows, q) for q in args.quant}
    print(json.dumps({"batch": BATCH, "new_tokens": NEW_TOKENS, "gradient_checkpointing": not args.no_checkpointing,
                      "rows": rows, "slopes": slopes}, indent=2))


if __name__ == "__main__":
    main()
