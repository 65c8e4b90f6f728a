"""PPO side by side with TRL 1.12.0's PPOTrainer (the last TRL release that has one) on the same
work: a random-init Llama (~58M parameters, fp32 compute), the same 256 prompts of 16 tokens,
batch 8, 32 new tokens and no stop token, 1 epoch of 1 minibatch per update, LoRA r=16 on
q/k/v/o, the same random reward classifier (TRL: fp32; lora_ppo: its default, quantized as the
policy), each side with its own defaults otherwise. Each run is a
fresh process; runs alternate so drift on a shared machine hits every setup alike. Prints one
JSON line per run, then a Markdown table of medians. Run alone (CPU-heavy). Not part of CI.

TRL lives in its own venv (it pins nothing of ours, but keeps our env clean):

    python3 -m venv .venv-trl
    .venv-trl/bin/pip install torch==2.13.0
    .venv-trl/bin/pip install trl==1.12.0 transformers==5.23.0 peft==0.21.2 bitsandbytes==0.50.2 \\
        accelerate==1.15.0 datasets==5.2.0
    python bench/vs_trl.py [--repeats 2] [--updates 8] [--setups trl-peft trl-qlora lora_ppo ...]
    python bench/vs_trl.py --profile --repeats 1 --setups trl-qlora lora_ppo   # where the time goes

`--profile` runs torch's profiler over updates 2..N and adds, per phase (lora_ppo) or per update
(TRL), the seconds spent inside torch ops by kind (matmul, 4-bit dequantize, attention, ...) and
outside them (Python, framework and profiler overhead). The profiler slows every op a little and
its event records add to the peak RSS, so compare profiled runs with each other, not with
unprofiled ones.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BATCH, NEW_TOKENS, PROMPT_TOKENS, PROMPTS = 8, 32, 16, 256
TEMPERATURE, LEARNING_RATE, KL_COEF = 0.7, 3e-6, 0.05
LORA = {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
# The random model: Llama blocks at SmolLM2's vocabulary (its tokenizer is embedded, no download).
MODEL_CONFIG = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 10, "num_attention_heads": 8,
                "num_key_value_heads": 8, "max_position_embeddings": 512, "tie_word_embeddings": True}

# What each setup is: the TRL ones run in .venv-trl; lora_ppo ones are recipe overrides.
LORA_PPO_SETUPS = {
    "lora_ppo": [],  # today's defaults
    "lora_ppo-before": ["model.dequantize_per_step=false", "rollout.score_roles_together=false",
                        "rollout.logprobs_from_generation=false",
                        "ppo.update_roles_together=false"],  # the 2026-11-23 defaults
    "lora_ppo-update-together": ["ppo.update_roles_together=true"],  # policy and value in one update pass
    "lora_ppo-lean": ["model.dequantize_per_step=false"],  # the least memory: 4 bits in every pass
    "lora_ppo-lean-update-together": ["model.dequantize_per_step=false", "ppo.update_roles_together=true"],
    "lora_ppo-fast": ["model.gradient_checkpointing=false"],  # today's defaults without checkpointing
}
TRL_SETUPS = ("trl-peft", "trl-qlora")


# ---- the shared work -----------------------------------------------------------------------------

def build_work(folder: Path) -> None:
    """The random policy (causal LM), the random reward classifier, their tokenizer and the prompts,
    saved in fp32 under `folder`; skipped when present."""
    if (folder / "prompts.jsonl").is_file():
        return
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from lora_ppo.builtin_model import resolve_builtin

    tokenizer = AutoTokenizer.from_pretrained(resolve_builtin("builtin:smollm2-135m-instruct"))
    tokenizer.chat_template = None  # the prompts are plain text on both sides
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **MODEL_CONFIG)
    torch.manual_seed(0)
    policy = LlamaForCausalLM(config)
    config.num_labels = 1
    reward = LlamaForSequenceClassification(config)
    for name, model in (("policy", policy), ("reward", reward)):
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    # Prompts of exactly PROMPT_TOKENS tokens that re-tokenize to themselves: words, not byte soup.
    rng = random.Random(0)
    words = [i for t, i in tokenizer.get_vocab().items() if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 3]
    prompts: list[str] = []
    while len(prompts) < PROMPTS:
        text = tokenizer.decode([rng.choice(words) for _ in range(PROMPT_TOKENS)]).strip()
        if len(tokenizer(text)["input_ids"]) == PROMPT_TOKENS:
            prompts.append(text)
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"built {sum(p.numel() for p in policy.parameters()) / 1e6:.1f}M-parameter policy in {folder}",
          file=sys.stderr)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


# ---- where the time goes (--profile) -------------------------------------------------------------

# Kinds of torch op, matched in order against the op's lowercased name; the first match wins.
OP_KINDS = (
    ("4-bit dequantize", ("dequantize", "bitsandbytes", "bnb")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_weight_int")),
    ("attention", ("scaled_dot_product", "flash", "_efficient_attention")),
    ("softmax / log-softmax", ("softmax",)),
    ("copies and indexing", ("copy", "aten::cat", "aten::clone", "aten::index", "gather", "scatter", "aten::empty",
                             "aten::zeros", "aten::full", "aten::fill_", "aten::to", "aten::contiguous")),
)
OTHER_OPS = "other ops"  # every op no kind above matches
PHASE_LABEL = "phase/"


def op_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in OP_KINDS if any(k in lowered for k in keys)), OTHER_OPS)


def time_breakdown(events, updates: int) -> dict:
    """Seconds per update in each labelled phase (`phase/<name>` record_function ranges; a range
    that holds others counts only its own rest): its wall time, the self time of the torch ops
    inside it by kind, and the rest (outside any op: Python, framework and profiler overhead)."""
    phases = [e for e in events if e.name.startswith(PHASE_LABEL)]

    def within(inner, outer) -> bool:
        return inner is not outer and outer.time_range.start <= inner.time_range.start < outer.time_range.end

    out: dict[str, dict] = {}
    for phase in phases:
        name = phase.name[len(PHASE_LABEL):]
        row = out.setdefault(name, {"wall_s": 0.0, "ops": 0, "kinds_s": {}})
        # A range holding other phases (the whole step) counts only its time outside them.
        nested = sum(p.time_range.elapsed_us() for p in phases if within(p, phase))
        row["wall_s"] += (phase.time_range.elapsed_us() - nested) / 1e6
    for event in events:
        if event.name.startswith(PHASE_LABEL) or event.device_type.name != "CPU":
            continue
        start = event.time_range.start
        inside = [p for p in phases if p.time_range.start <= start < p.time_range.end]
        if not inside:
            continue
        # The innermost phase holds it (a step's phases sit inside the whole step's range).
        phase = min(inside, key=lambda p: p.time_range.elapsed_us())
        row = out[phase.name[len(PHASE_LABEL):]]
        row["ops"] += 1
        kind = op_kind(event.name)
        row["kinds_s"][kind] = row["kinds_s"].get(kind, 0.0) + event.self_cpu_time_total / 1e6
    for row in out.values():
        inner = sum(row["kinds_s"].values())
        row["outside_ops_s"] = row["wall_s"] - inner
        for key in ("wall_s", "outside_ops_s"):
            row[key] = round(row[key] / updates, 3)
        row["ops"] = round(row["ops"] / updates)
        row["kinds_s"] = {k: round(v / updates, 3) for k, v in sorted(row["kinds_s"].items(), key=lambda kv: -kv[1])}
    return out


# ---- one run per process -------------------------------------------------------------------------

def run_trl(setup: str, work: Path, updates: int, profile: bool = False) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                              BitsAndBytesConfig, TrainerCallback)
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(work / "policy", padding_side="left")
    quantized = setup == "trl-qlora"
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(work / "policy", dtype=torch.float32,
                                                  quantization_config=bnb if quantized else None)
    value = AutoModelForSequenceClassification.from_pretrained(work / "policy", num_labels=1, dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(work / "reward", num_labels=1, dtype=torch.float32)
    prompts = [json.loads(line)["prompt"] for line in (work / "prompts.jsonl").read_text().splitlines()]
    dataset = Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in prompts]})
    args = PPOConfig(
        output_dir=str(work / "trl-out"), per_device_train_batch_size=BATCH, gradient_accumulation_steps=1,
        num_mini_batches=1, num_ppo_epochs=1, total_episodes=BATCH * updates, response_length=NEW_TOKENS,
        stop_token=None, temperature=TEMPERATURE, learning_rate=LEARNING_RATE, kl_coef=KL_COEF,
        local_rollout_forward_batch_size=BATCH, num_sample_generations=0, report_to="none", save_strategy="no",
        use_cpu=True, bf16=False, fp16=False, seed=0, logging_steps=1, dataloader_num_workers=0,
    )
    lora = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=0.0, bias="none",
                      target_modules=LORA["target_modules"], task_type="CAUSAL_LM")

    class StepTimes(TrainerCallback):
        """Each update's wall time; with `profile`, updates 2..N inside the profiler, each in its
        own `phase/update` range (TRL's step has no phases to tell apart from outside)."""

        def __init__(self):
            self.times = [time.perf_counter()]
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
            self.range = None

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())
            if self.profiler is None:
                return
            if self.range is not None:
                self.range.__exit__(None, None, None)
            if len(self.times) == 2:
                self.profiler.start()
            if len(self.times) <= updates:
                self.range = torch.profiler.record_function(PHASE_LABEL + "update")
                self.range.__enter__()
            else:
                self.profiler.stop()

    clock = StepTimes()
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=None, reward_model=reward,
                         value_model=value, train_dataset=dataset, peft_config=lora, callbacks=[clock])
    clock.times = [time.perf_counter()]
    trainer.train()
    result = {"step_s": [b - a for a, b in zip(clock.times, clock.times[1:])]}
    if profile:
        result["profile"] = time_breakdown(clock.profiler.events(), updates - 1)
    return result


def recipe_dict(work: Path, updates: int) -> dict:
    """lora_ppo's side of the shared work, as a recipe (its own defaults for the rest)."""
    return {
        "model": {"name": str(work / "policy"), "quantization": "4bit"},
        "adapters": {"policy": LORA, "value": LORA, "reference": "disable"},
        "reward": {"kind": "classifier", "model": str(work / "reward")},  # quantized as the policy: the default
        "data": {"source": str(work / "prompts.jsonl"), "eval_source": None, "eval_size": 0,
                 "max_prompt_tokens": PROMPT_TOKENS},
        "rollout": {"batch_size": BATCH, "max_new_tokens": NEW_TOKENS, "stop_token": None,
                    "temperature": TEMPERATURE, "forward_batch_size": BATCH},
        "ppo": {"num_epochs": 1, "num_minibatches": 1, "learning_rate": LEARNING_RATE, "kl_coef": KL_COEF},
        "train": {"steps": updates, "seed": 0, "eval": False, "output_dir": str(work / "lora_ppo-out"),
                  "overwrite": True},
    }


def run_lora_ppo(setup: str, work: Path, updates: int, profile: bool = False) -> dict:
    import contextlib

    import torch

    import lora_ppo
    from lora_ppo.memory import PhasePeaks

    recipe = lora_ppo.recipe_from_dict(recipe_dict(work, updates), LORA_PPO_SETUPS[setup])
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    if profile:  # each phase of a step in its own range, as the trainer names it; the memory
        phase = PhasePeaks.phase  # bookkeeping between phases stays in "rest of step"

        @contextlib.contextmanager
        def labelled(self, name):
            with phase(self, name), torch.profiler.record_function(PHASE_LABEL + name):
                yield

        PhasePeaks.phase = labelled
    steps, phases = [], []
    for update in range(updates):
        if profiler is not None and update == 1:
            profiler.start()
        # The whole call, as TRL's update is timed: the per-step dequantized copy and the step's
        # bookkeeping are part of lora_ppo's update too (metrics' time/step starts after them).
        t0 = time.perf_counter()
        with torch.profiler.record_function(PHASE_LABEL + "rest of step") if profile else contextlib.nullcontext():
            metrics, _rollout = trainer.train_step()
        steps.append(time.perf_counter() - t0)
        phases.append({p: metrics[f"time/{p}"] for p in ("generate", "score_forward", "reward", "update")})
    result = {"step_s": steps, "phases": phases}
    if profiler is not None:
        profiler.stop()
        result["profile"] = time_breakdown(profiler.events(), updates - 1)
    return result


def one_run(setup: str, work: Path, updates: int, profile: bool = False) -> dict:
    import torch

    t0 = time.perf_counter()
    result = (run_trl if setup in TRL_SETUPS else run_lora_ppo)(setup, work, updates, profile)
    times = result["step_s"][1:]  # the first update pays one-time costs on both sides
    out = {"setup": setup, "updates": len(result["step_s"]), "s_per_update": round(statistics.median(times), 3),
           "peak_rss_gb": round(peak_rss_gb(), 3), "threads": torch.get_num_threads(),
           "wall_s": round(time.perf_counter() - t0, 1)}
    if "phases" in result:
        out["phases_s"] = {p: round(statistics.median(ph[p] for ph in result["phases"][1:]), 3)
                           for p in result["phases"][0]}
    if "profile" in result:
        out["profile"] = result["profile"]
    return out


# ---- the comparison ------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", nargs="+", default=[*TRL_SETUPS, *LORA_PPO_SETUPS],
                        choices=[*TRL_SETUPS, *LORA_PPO_SETUPS])
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of each setup")
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--work", default="runs/bench-vs-trl")
    parser.add_argument("--trl-python", default=str(REPO / ".venv-trl" / "bin" / "python"))
    parser.add_argument("--profile", action="store_true", help="where each update's time goes (torch profiler)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a single run, in its own process
    args = parser.parse_args()
    work = (REPO / args.work).resolve()
    if args.one:
        print(json.dumps(one_run(args.one, work, args.updates, args.profile)), flush=True)
        return

    build_work(work)
    if any(s in TRL_SETUPS for s in args.setups) and not Path(args.trl_python).is_file():
        raise SystemExit(f"no TRL venv at {args.trl_python}: see this script's docstring")
    results: dict[str, list[dict]] = {s: [] for s in args.setups}
    for _ in range(args.repeats):
        for setup in args.setups:
            python = args.trl_python if setup in TRL_SETUPS else sys.executable
            done = subprocess.run([python, __file__, "--one", setup, "--updates", str(args.updates),
                                   "--work", str(work), *(["--profile"] if args.profile else [])],
                                  cwd=REPO, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{setup} failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            results[setup].append(row)
            print(json.dumps(row), flush=True)

    print("\n| setup | peak RSS (GB) | s/update | runs |\n|---|---|---|---|")
    for setup, rows in results.items():
        rss = [r["peak_rss_gb"] for r in rows]
        spu = [r["s_per_update"] for r in rows]
        print(f"| {setup} | {min(rss):.2f}-{max(rss):.2f} | {min(spu):.2f}-{max(spu):.2f} | {len(rows)} |")
    if args.profile:
        print_profiles(results)


def print_profiles(results: dict[str, list[dict]]) -> None:
    """One Markdown table per setup (its first run): seconds per update by phase and kind of work."""
    for setup, rows in results.items():
        profile = rows[0]["profile"]
        kinds = [kind for kind, _ in OP_KINDS] + [OTHER_OPS]
        print(f"\n{setup} (profiled, s per update)\n\n| phase | wall | " + " | ".join(kinds)
              + " | outside ops | ops |\n|---|" + "---|" * (len(kinds) + 3))
        for phase, row in profile.items():
            cells = [f"{row['kinds_s'].get(kind, 0.0):.3f}" for kind in kinds]
            print(f"| {phase} | {row['wall_s']:.3f} | " + " | ".join(cells)
                  + f" | {row['outside_ops_s']:.3f} | {row['ops']} |")


if __name__ == "__main__":
    main()
