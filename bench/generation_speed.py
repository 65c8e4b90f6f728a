"""Generation alone: transformers' generate() against the static-cache compiled path
(`rollout.compile`), on one loaded model, in one process. For each path: one warm-up call
(for the compiled path: compiling, timed), then `--repeats` timed calls of one full batch, in
tokens per second; the compiled path's graphs and recompiles; with `--profile`, the seconds of
one call inside matrix multiplies and outside any torch op. With `--train-steps N`, then N PPO
steps with the compiled path and their phases; with `--stop-check`, only the compiled path
without and with a stop token. Prints one JSON object (also written to `--out`
after each part, so a run cut short keeps what it measured).

    python bench/generation_speed.py                           # the quickstart's shape (CPU)
    python bench/generation_speed.py --shape vs_trl            # bench/vs_trl.py's random Llama 58M
    python bench/generation_speed.py --shape gpu-8b --train-steps 2   # Llama-3.1-8B's shape (CUDA GPU)
    python bench/generation_speed.py --shape gpu-8b --also-fused-4bit  # then with model.fused_4bit_decode

Shapes: `quickstart` (recipes/quickstart.yaml: SmolLM2-135M 4-bit, batch 32, 20 new tokens,
stop at EOS), `vs_trl` (random Llama 58M, batch 8, 16 + 32 tokens, no stop token), `gpu-8b`
(random-init Llama-3.1-8B shape, recipes/single_gpu_8b.yaml: batch 16, 256 + 256 tokens, no
stop token, policy LoRA r16 on all linear layers, 4-bit; builds the bf16 model first). Run alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_memory_check import software  # noqa: E402  (bench/, beside this script)
from nf4_decode_matmul import add_launch_argument, use_tuned_launch  # noqa: E402

SHAPES = {
    "quickstart": {"recipe": "recipes/quickstart.yaml", "overrides": ["train.eval=false"]},
    "vs_trl": {"recipe": None, "overrides": []},
    "gpu-8b": {"recipe": "recipes/single_gpu_8b.yaml",
               "overrides": ["rollout.stop_token=null", "train.eval=false", "model.dequantize_per_step=false"]},
}


def build_recipe(shape: str, work: Path, overrides: list[str], config: Path, tokenizer: str):
    import lora_ppo

    if shape == "vs_trl":
        from vs_trl import build_work, recipe_dict

        build_work(work)
        return lora_ppo.recipe_from_dict(recipe_dict(work, updates=100), overrides)
    extra = [f"train.output_dir={work / 'generation-speed'}", "train.overwrite=true"]
    if shape == "gpu-8b":
        from random_models import build_random_model

        from lora_ppo.builtin_model import resolve_builtin

        folder = work / f"{config.name}-random"
        build_random_model(config, tokenizer or resolve_builtin("builtin:smollm2-135m-instruct"), folder)
        extra.append(f"model.name={folder}")
    return lora_ppo.load_recipe(REPO / SHAPES[shape]["recipe"], [*SHAPES[shape]["overrides"], *extra, *overrides])


def prompts_for(shape: str, trainer, recipe) -> list:
    rows = trainer.parts.train_prompts.rows
    if shape == "gpu-8b":  # every prompt at the full max_prompt_tokens: the worst case
        from gpu_memory_check import long_prompts

        rows, _length = long_prompts(trainer.parts.tokenizer, recipe.data, recipe.rollout.batch_size)
    return list(rows[: recipe.rollout.batch_size])


def time_path(sampler, rows, roles, model_cfg, repeats: int, profile: bool) -> dict:
    """One warm-up call, then `repeats` timed ones (and one profiled)."""
    import torch

    from lora_ppo.model import dequantized_once

    def synchronize() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def one() -> tuple[float, int]:
        with dequantized_once(roles.peft, model_cfg):
            synchronize()
            t0 = time.perf_counter()
            samples = sampler.sample(rows, record_logprobs=sampler.cfg.logprobs_from_generation is True)
            synchronize()
        return time.perf_counter() - t0, int(samples.response_mask.sum()), samples.response_ids.numel()

    torch.manual_seed(0)
    first_s, _, _ = one()
    runs = [one() for _ in range(repeats)]
    seconds = sorted(s for s, _, _ in runs)[len(runs) // 2]
    generated = runs[0][2]  # every row's slots up to the longest response, as generation computes them
    out = {"first_call_s": round(first_s, 2), "median_call_s": round(seconds, 3),
           "tokens_per_s": round(generated / seconds, 1), "tokens_per_call": generated}
    if profile:
        from vs_trl import PHASE_LABEL, time_breakdown

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with torch.profiler.record_function(PHASE_LABEL + "generate"):
                one()
        breakdown = time_breakdown(prof.events(), 1)["generate"]
        matmul = breakdown["kinds_s"].get("matmul", 0.0)
        out["profile"] = {"wall_s": breakdown["wall_s"], "matmul_s": matmul,
                          "outside_ops_s": breakdown["outside_ops_s"], "ops": breakdown["ops"],
                          "kinds_s": breakdown["kinds_s"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="quickstart")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--train-steps", type=int, default=0)
    parser.add_argument("--work", default="runs/bench-generation")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--config", default=str(REPO / "bench" / "model_configs" / "llama-3.1-8b"),
                        help="gpu-8b: the model shape (a config.json folder)")
    parser.add_argument("--tokenizer", default=None, help="gpu-8b: a tokenizer folder (default: the embedded one)")
    parser.add_argument("--also-dequantized", action="store_true",
                        help="then both paths again with model.dequantize_per_step on")
    parser.add_argument("--dequantized-only", action="store_true", help="only the dequantized pair")
    parser.add_argument("--also-fused-4bit", action="store_true",
                        help="then both paths again with model.fused_4bit_decode on the same model (4-bit layers)")
    parser.add_argument("--stop-check", action="store_true",
                        help="only the compiled path, without and with a stop token (eos): what its per-token "
                             "stop check costs (with --dequantized-only: on dequantized layers)")
    add_launch_argument(parser)
    parser.add_argument("overrides", nargs="*", help="recipe overrides")
    args = parser.parse_args()

    import torch

    import lora_ppo
    from lora_ppo.compiled_generation import StaticDecoder
    from lora_ppo.rollout import Sampler

    work = (REPO / args.work).resolve()
    result: dict = {"shape": args.shape, "date": time.strftime("%Y-%m-%d"), **software(),
                    "threads": torch.get_num_threads()}
    if args.nf4_launch_from:
        result["nf4_launch"] = use_tuned_launch(args.nf4_launch_from)

    def report() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))

    t0 = time.perf_counter()
    recipe = build_recipe(args.shape, work, ["rollout.compile=false", *args.overrides], Path(args.config),
                          args.tokenizer)
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    result["load_s"] = round(time.perf_counter() - t0, 1)
    parts, cfg = trainer.parts, trainer.sampler.cfg
    rows = prompts_for(args.shape, trainer, recipe)
    result.update(batch=len(rows), prompt_tokens=max(len(r.ids) for r in rows), max_new_tokens=cfg.max_new_tokens,
                  dequantize_per_step=recipe.model.dequantize_per_step)
    report()

    decoder = StaticDecoder(parts.roles.peft, recipe.sequence_tokens)

    def both_paths(model_cfg, suffix: str) -> None:
        result["generate" + suffix] = time_path(Sampler(parts.roles, parts.tokenizer, cfg), rows, parts.roles,
                                                model_cfg, args.repeats, args.profile)
        report()
        graphs, compile_s = decoder.graphs, decoder.compile_s
        compiled = time_path(Sampler(parts.roles, parts.tokenizer, cfg, decoder), rows, parts.roles, model_cfg,
                             args.repeats, args.profile)
        compiled.update(compile_s=round(decoder.compile_s - compile_s, 1), graphs=decoder.graphs - graphs,
                        recompiles=decoder.recompiles, fell_back=decoder.disabled)
        result["compiled" + suffix] = compiled
        result["speedup" + suffix] = round(compiled["tokens_per_s"] / result["generate" + suffix]["tokens_per_s"], 2)
        report()

    if args.stop_check:
        model_cfg = recipe.model.model_copy(update={"dequantize_per_step": args.dequantized_only})
        result["dequantize_per_step"] = args.dequantized_only
        for name, stop in (("compiled_no_stop", None), ("compiled_stop_eos", "eos")):
            sampler = Sampler(parts.roles, parts.tokenizer, cfg.model_copy(update={"stop_token": stop}), decoder)
            result[name] = time_path(sampler, rows, parts.roles, model_cfg, args.repeats, False)
            report()
        result["recompiles"] = decoder.recompiles
        print(json.dumps(result), flush=True)
        report()
        return
    if not args.dequantized_only:
        both_paths(recipe.model, "")

    if args.train_steps and not args.dequantized_only:
        trainer.parts.decoder = decoder
        trainer.sampler = Sampler(parts.roles, parts.tokenizer, cfg, decoder)
        steps = []
        for _ in range(args.train_steps):
            metrics, _rollout = trainer.train_step()
            steps.append({k: round(v, 2) for k, v in metrics.items() if k.startswith("time/")})
            result["train_steps_compiled"] = steps
            report()
        result["recompiles_after_training"] = decoder.recompiles
    if args.also_dequantized or args.dequantized_only:
        both_paths(recipe.model.model_copy(update={"dequantize_per_step": True}), "_dequantized")
    if args.also_fused_4bit:
        # model.fused_4bit_decode on the loaded model, with a decoder of its own (the layers' forward
        # changed: another graph, not a recompile of the first).
        from lora_ppo.devices import model_device
        from lora_ppo.fused_4bit_decode import fuse_4bit_decode

        result["fused_4bit_layers"] = fuse_4bit_decode(parts.roles.peft, model_device(parts.roles.peft))
        decoder = StaticDecoder(parts.roles.peft, recipe.sequence_tokens)
        both_paths(recipe.model, "_fused_4bit")
    print(json.dumps(result), flush=True)
    report()


if __name__ == "__main__":
    main()
