"""Memory scaling: peak memory per PPO phase against base-model size, per quantization.

Random-init Llama models of realistic proportions (about 30M to 0.5B parameters, SmolLM2's
49k vocabulary, built from configs) each run two full PPO steps (rollout + update) in a fresh
process; the second step's per-phase peaks are reported (the first one allocates the AdamW
state). Also prints what `lora-ppo estimate --device cpu` predicts for the same recipe, and the
fitted slope of peak memory against base parameters. Run alone: it is CPU-heavy.

    python bench/memory_scaling.py [--sizes 30m 70m 135m 360m 500m] [--quant 4bit 8bit none]
                                   [--no-checkpointing] [--allocator default|strict]
                                   [--dequantize-per-step false|true|auto]

On CPU the peaks are the process's peak resident memory per phase (VmHWM, reset between phases).
glibc's malloc keeps memory a phase has freed (transient dequantized weights, activations) in
its heap, so with `--allocator default` a peak includes that retained memory, as a CPU user
sees it. `--allocator strict` runs each point with MALLOC_MMAP_THRESHOLD_=65536: every
allocation over 64 KiB gets its own mapping and goes back to the OS when freed, so the peak is
the memory actually live at once (what `torch.cuda.max_memory_allocated` reports on a GPU),
at about twice the run time. Each point also counts, exactly, the bytes of the base model's
weights, of the adapters and value head, and of the AdamW state, so the slopes split into
weights, trainable state and the rest (activations, allocator).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from random_models import build_random_model  # noqa: E402  (bench/, beside this script)

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


def build_model(size: str, folder: Path, tokenizer_dir: Optional[str] = None, config_dir: Optional[str] = None) -> None:
    """Save a random-init model (skip if present): a Llama of `size` from SIZES, or the shape of
    `config_dir`'s config.json (see random_models). The tokenizer is the builtin SmolLM2 one
    unless `tokenizer_dir` names another (it must not be larger than the model's vocabulary)."""
    if (folder / "config.json").is_file():
        return
    from lora_ppo.model import resolve_builtin

    tokenizer_dir = tokenizer_dir or str(resolve_builtin("builtin:smollm2-135m-instruct"))
    if config_dir is not None:
        build_random_model(Path(config_dir), tokenizer_dir, folder)
        return
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **SIZES[size])
    staging = folder.with_name(folder.name + ".partial")
    LlamaForCausalLM(config).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(folder)


GRADIENT_CHECKPOINTING = "true"  # --no-checkpointing measures the update without it
COMPUTE_DTYPE = "auto"  # --compute-dtype bfloat16: unquantized parts as on a GPU (fp32 on CPU otherwise)
DEQUANTIZE_PER_STEP = "false"  # --dequantize-per-step: the 4-bit rows hold the layers dequantized per step
# glibc: a fixed mmap threshold (this also switches off its dynamic growth up to 32 MiB).
STRICT_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def recipe_overrides(model_dir: Path, quant: str, prompts: Path, out: Path) -> list[str]:
    return [
        f"model.name={model_dir}", f"model.quantization={quant}",
        f"model.gradient_checkpointing={GRADIENT_CHECKPOINTING}", f"model.compute_dtype={COMPUTE_DTYPE}",
        # Stated, not inherited from the quickstart (which holds the layers dequantized per step);
        # it only exists for 4-bit.
        f"model.dequantize_per_step={DEQUANTIZE_PER_STEP if quant == '4bit' else 'false'}",
        "data.eval_size=0", "reward.also_log=[]", f"data.max_prompt_tokens={PROMPT_WORDS + 8}",
        f"rollout.batch_size={BATCH}", f"rollout.max_new_tokens={NEW_TOKENS}", "rollout.stop_token=null",
        f"rollout.forward_batch_size={BATCH}", "ppo.num_epochs=1", "ppo.num_minibatches=2",
        "train.eval=false", f"train.output_dir={out}", "train.overwrite=true",
    ]


def measure_one(model_dir: Path, quant: str, prompts: Path, out: Path) -> dict:
    """In this (fresh) process: two PPO steps; the second step's per-phase peaks, and the estimate."""
    import torch

    import lora_ppo
    from lora_ppo import memory
    from lora_ppo.data import PromptFormat, PromptStream, prepare_rows
    from lora_ppo.estimate import as_json, estimate_recipe

    baseline = memory.resident_bytes()
    recipe = lora_ppo.load_recipe(REPO / "recipes" / "quickstart.yaml", recipe_overrides(model_dir, quant, prompts, out))
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    # Every prompt the same length, so the estimate sees the real sequence length.
    fmt = PromptFormat(trainer.parts.tokenizer, recipe.data.chat_template)
    same_length = prepare_rows([{"prompt": p} for p in prompts.read_text().splitlines()], "prompt", fmt, 10**6, str(prompts))
    trainer.stream = PromptStream(same_length.rows, recipe.train.seed)
    prompt_tokens = max(len(row.ids) for row in same_length.rows)
    memory.release_memory()
    loaded = memory.resident_bytes()
    t0 = time.perf_counter()
    trainer.train_step()
    metrics, _ = trainer.train_step()
    seconds = time.perf_counter() - t0
    tensors = tensor_bytes(trainer)
    # The estimate for exactly this recipe, with the real prompt length.
    exact = lora_ppo.load_recipe(REPO / "recipes" / "quickstart.yaml",
                                 [*recipe_overrides(model_dir, quant, prompts, out), f"data.max_prompt_tokens={prompt_tokens}"])
    predicted = as_json(estimate_recipe(exact, device="cuda" if torch.cuda.is_available() else "cpu"))
    measured = {k.split("/")[1][: -len("_gb")]: round(v, 3) for k, v in metrics.items()
                if k.startswith("memory/") and k.endswith("_gb") and k != "memory/peak_gb"}
    return {
        "params": predicted["params"],
        "quantization": quant,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "prompt_tokens": prompt_tokens,
        "process_baseline_gb": round(baseline / 1e9, 3),
        "after_load_gb": round(loaded / 1e9, 3),
        "tensors_gb": {k: round(v / 1e9, 4) for k, v in tensors.items()},
        "measured_gb": measured,
        "estimated_gb": {k: predicted["phases_gb"][k] for k in measured if k in predicted["phases_gb"]},
        "two_steps_s": round(seconds, 1),
    }


def _storage_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def tensor_bytes(trainer) -> dict[str, int]:
    """Exact bytes held by tensors, by kind: the base model's weights (4-bit packed data and its
    quantization constants included), the adapters + value head, and the AdamW state."""
    model = trainer.roles.peft
    seen: set = set()
    trainable = [p for p in model.parameters() if p.requires_grad]
    if trainer.roles.value_head is not None:
        trainable += list(trainer.roles.value_head.parameters())
    adapters = _storage_bytes(trainable + [p for n, p in model.named_parameters() if "lora_" in n], seen)
    quant_constants = []
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            quant_constants += [state.absmax, state.code]
            if state.state2 is not None:
                quant_constants += [state.state2.absmax, state.state2.code]
            if getattr(state, "offset", None) is not None:
                quant_constants.append(state.offset)
        for attr in ("SCB", "CB"):  # 8-bit row scales
            value = getattr(getattr(module, "weight", None), attr, None)
            if value is not None:
                quant_constants.append(value)
    base = _storage_bytes([*model.parameters(), *model.buffers(), *quant_constants], seen)
    optimizer = _storage_bytes([v for state in trainer.parts.optimizer.state.values()
                                for v in state.values() if hasattr(v, "untyped_storage")], seen)
    return {"base_weights": base, "adapters": adapters, "optimizer": optimizer}


def fit_slope(rows: list[dict], quant: str) -> dict:
    """Least-squares fits of memory = fixed + slope * params: for the step's peak (max over
    phases, activations included), for what stays resident (the reward phase, where only
    weights, adapters, optimizer state and the runtime are held), and for the exactly counted
    tensor bytes of the base weights and of the trainable state (adapters, head, AdamW)."""
    ok = [r for r in rows if r.get("quantization") == quant and "measured_gb" in r]
    if len(ok) < 2:
        return {}
    fits = {
        "peak": _line([(r["params"], max(r["measured_gb"].values()) * 1e9) for r in ok]),
        "resident": _line([(r["params"], r["measured_gb"]["reward"] * 1e9) for r in ok]),
    }
    if all("tensors_gb" in r for r in ok):
        fits["base_weights"] = _line([(r["params"], r["tensors_gb"]["base_weights"] * 1e9) for r in ok])
        fits["trainable_state"] = _line(
            [(r["params"], (r["tensors_gb"]["adapters"] + r["tensors_gb"]["optimizer"]) * 1e9) for r in ok])
    return fits


def _line(pts: list[tuple[float, float]]) -> dict:
    n = len(pts)
    mx = sum(p for p, _ in pts) / n
    my = sum(m for _, m in pts) / n
    sxx = sum((p - mx) ** 2 for p, _ in pts)
    slope = sum((p - mx) * (m - my) for p, m in pts) / sxx
    return {"bytes_per_param": round(slope, 3), "fixed_gb": round((my - slope * mx) / 1e9, 3), "points": n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--configs", nargs="*", default=[],
                        help="also folders holding a config.json (e.g. bench/model_configs/qwen2.5-7b): random-init models of those shapes")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder for the random models (default: the builtin SmolLM2 one)")
    parser.add_argument("--quant", nargs="+", default=["4bit", "8bit", "none"], choices=["4bit", "8bit", "none"])
    parser.add_argument("--work", default="/tmp/lora_ppo_bench_memory", help="where the random models are saved")
    parser.add_argument("--no-checkpointing", action="store_true", help="update without gradient checkpointing")
    parser.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="dtype of compute and of the unquantized parts (auto: float32 on CPU)")
    parser.add_argument("--dequantize-per-step", choices=["false", "true", "auto"], default="false",
                        help="4-bit rows: model.dequantize_per_step (false: dequantize in every pass, the lean plan)")
    parser.add_argument("--allocator", choices=["default", "strict"], default="default",
                        help="strict: glibc returns every allocation over 64 KiB at once (peak = live memory)")
    parser.add_argument("--one", nargs=2, metavar=("SIZE", "QUANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    global GRADIENT_CHECKPOINTING, COMPUTE_DTYPE, DEQUANTIZE_PER_STEP
    GRADIENT_CHECKPOINTING = "false" if args.no_checkpointing else "true"
    COMPUTE_DTYPE = args.compute_dtype
    DEQUANTIZE_PER_STEP = args.dequantize_per_step
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.txt"
    prompts.write_text("\n".join(" ".join(["the"] * PROMPT_WORDS) for _ in range(64)) + "\n")

    if args.one:  # child mode: measure one configuration, print one JSON line
        size, quant = args.one
        print(json.dumps(measure_one(work / size, quant, prompts, work / f"run-{size}-{quant}")))
        return

    rows = []
    points = [(size, None) for size in args.sizes] + [(Path(c).name, c) for c in args.configs]
    for size, config_dir in points:
        build_model(size, work / size, args.tokenizer, config_dir)
        for quant in args.quant:
            # A fresh process per point: peak RSS of one configuration must not include another's.
            flags = ["--no-checkpointing"] if args.no_checkpointing else []
            flags += ["--compute-dtype", args.compute_dtype, "--dequantize-per-step", args.dequantize_per_step]
            env = {**os.environ, "HF_HUB_OFFLINE": "1", **(STRICT_ALLOCATOR_ENV if args.allocator == "strict" else {})}
            proc = subprocess.run([sys.executable, __file__, "--work", str(work), *flags, "--one", size, quant],
                                  capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                last = (proc.stderr.strip().splitlines() or ["?"])[-1]
                row = {"size": size, "quantization": quant, "error": last}
            else:
                row = {"size": size, **json.loads(proc.stdout.strip().splitlines()[-1])}
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    slopes = {q: fit_slope(rows, q) for q in args.quant}
    print(json.dumps({"batch": BATCH, "new_tokens": NEW_TOKENS, "gradient_checkpointing": not args.no_checkpointing,
                      "dequantize_per_step": args.dequantize_per_step,
                      "allocator": args.allocator, "compute_dtype": args.compute_dtype,
                      "rows": rows, "slopes": slopes}, indent=2))


if __name__ == "__main__":
    main()
