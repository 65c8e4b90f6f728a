"""Each update path against float32 on the device: does a faster path compute the same update?

A GPU runs an update path with other kernels than the CPU, and in bfloat16 other kernels round
otherwise: on an H200 the compiled update's logprobs read 0.040 nats per token from the eager
scoring pass's (bench/README.md), twice the self-check's bfloat16 limit, where the CPU tests find
them equal to the bit. Another rounding, or another function? In bfloat16 the two look alike (on the
tiny test model a policy whose LoRA B is 5% larger lands 3x as far from float32 as the default), so
each path also runs in float32, where rounding is a thousand times smaller than any such change.

A random model of `--config`'s widths with `--layers` decoder layers (bench/random_models.py, NF4),
loaded twice: computing in float32 and in `--dtype` (a GPU's `auto`: bfloat16). Both get the same
policy and value adapters (LoRA B and the value head drawn at random: fresh ones would hide the
adapters' numerics). `--rows` prompts of `--prompt-tokens` tokens and responses cut at random lengths
up to `--response-tokens` are scored in float32 (old and reference logprobs, values) and advantages
computed from them, once. Each path then runs the update's first minibatch of every row (micro-batches
of `--micro-batch`), forward and backward, against the default path in float32:

- `logprob_mean_diff`: mean |the path's logprobs - float32's| per response token (the update's own
  self-check, against the float32 scoring);
- `policy_grad_rel`, `value_grad_rel`: |the path's gradient - float32's| / |float32's| over a role's
  adapter (and head) parameters;
- in float32, `same_function`: every distance within FLOAT32_LIMIT;
- in the low precision, `vs_default`: each distance as a multiple of the default path's, the
  precision the path costs (a bfloat16 adapter rounds where PEFT's float32 adapter does not: on the
  tiny CPU model `model.fused_lora` measured 0.8-1.5x and `model.adapter_autocast` 0.8-2.4x).

Prints one JSON object and writes it to `--out` after each path.

    python bench/update_numerics.py [--config bench/model_configs/llama-3.1-8b] [--layers 4] [--rows 4]
        [--paths fused_lora,compile_update,...] [--out bench/results/update_numerics_h200.json]

Without a GPU it runs on CPU (`--dtype bfloat16`) as a test of itself (use a small `--config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest.mock import patch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_memory_check import software  # noqa: E402  (bench/, beside this script)
from random_models import build_random_4bit_model, small_tokenizer  # noqa: E402

# In float32 a path computes the default's function when its logprobs (nats per token) and
# gradients (relative) are this close: float32 rounding in another order is about 1e-6 (a compiled
# update's gradients 3e-6 on CPU, docs/performance.md); on the tiny test model the policy's LoRA B
# 0.1% larger moves its gradient 5e-4 (and its bfloat16 distances 1.00-1.05x the default's).
FLOAT32_LIMIT = 1e-4
# Paths that exist only in 16-bit: no float32 run.
LOW_PRECISION_ONLY = {"adapter_autocast"}


@contextmanager
def fused(roles):
    """model.fused_lora: every LoRA layer as one addmm in the compute dtype."""
    from lora_ppo.fused_lora import fuse_lora_layers, unfuse_lora_layers

    fuse_lora_layers(roles.peft)
    try:
        yield
    finally:
        unfuse_lora_layers(roles.peft)


def _pefts_forward(roles):
    """PEFT's own forward in every LoRA layer, where lora_ppo's default drops two of its passes and must
    give its numbers bit for bit (`fused_lora.lean_lora_forward`)."""
    from lora_ppo.fused_lora import pefts_forward

    return pefts_forward(roles.peft)


def _compiled():
    from lora_ppo.compiled_update import CompiledLayers

    return CompiledLayers()


# name: (roles, update settings) -> (the settings to run, a context around the run). Each changes one
# thing from the default: the recipe's switch, or an update setting `auto` can choose.
PATHS = {
    "default": lambda roles, s: (s, nullcontext()),
    "pefts_forward": lambda roles, s: (s, _pefts_forward(roles)),
    "fused_lora": lambda roles, s: (s, fused(roles)),
    "adapter_autocast": lambda roles, s: (s, patch.object(roles, "autocast_dtype", _bfloat16_model(roles))),
    "compile_update": lambda roles, s: (dataclasses.replace(s, compiled_layers=_compiled()), nullcontext()),
    "roles_together": lambda roles, s: (dataclasses.replace(s, roles_together=True), nullcontext()),
    "packing": lambda roles, s: (s, patch.object(roles, "packing", True)),
    "trim_padding_off": lambda roles, s: (s, patch.object(roles, "trim_padding", False)),
    "checkpointing_off": lambda roles, s: (dataclasses.replace(s, gradient_checkpointing=False), nullcontext()),
}


def _bfloat16_model(roles):
    """bfloat16, where `roles` computes in it: model.adapter_autocast runs nowhere else."""
    import torch

    if roles.lm_head.weight.dtype != torch.bfloat16:
        raise ValueError(f"model.adapter_autocast runs only in bfloat16, not {roles.lm_head.weight.dtype}")
    return torch.bfloat16


def path_names(text: str) -> list[str]:
    names = text.split(",")
    unknown = sorted(set(names) - set(PATHS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {list(PATHS)}")
    return ["default", *(n for n in names if n != "default")]  # the others are measured against it


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, got {text!r}")
    return int(text)


def roles_of(model_dir: Path, compute_dtype: str, rank: int):
    """The recipe's policy and value adapters (rank `rank`, alpha twice it) on the model, computing in
    `compute_dtype`, the default path's switches."""
    from lora_ppo.config import AdaptersConfig, ModelConfig
    from lora_ppo.model import load_base_model
    from lora_ppo.roles import RoleModel

    base = load_base_model(ModelConfig(name=str(model_dir), compute_dtype=compute_dtype))
    adapter = {"r": rank, "alpha": 2 * rank}
    return RoleModel(base, AdaptersConfig(policy=adapter, value=adapter))


def draw_adapters(roles, lora_b_std: float, seed: int = 0) -> None:
    """LoRA B of both adapters and the value head at random (PEFT starts B at zero, the head is zero)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in roles.peft.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * lora_b_std)
        head = roles.value_head
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) / head.weight.shape[1] ** 0.5)


def copy_trainable(source, target) -> None:
    """The trainable parameters (adapters and heads) of `source` into `target`, in its dtypes."""
    import torch

    with torch.no_grad():
        mine = source.policy_parameters() + source.value_parameters()
        theirs = target.policy_parameters() + target.value_parameters()
        for a, b in zip(mine, theirs, strict=True):
            b.copy_(a)


def scored_rollout(roles, rows: int, prompt_tokens: int, response_tokens: int, vocab: int, pad_id: int, seed: int = 0):
    """A Rollout of random prompts and responses cut at random lengths (1 to `response_tokens`; the
    longest row whole), scored by `roles`, with random scores."""
    import torch

    from lora_ppo.rollout import Rollout, score_passes

    g = torch.Generator().manual_seed(seed)
    device = roles.lm_head.weight.device
    ids = torch.randint(3, vocab, (rows, prompt_tokens + response_tokens), generator=g)
    lengths = torch.randint(1, response_tokens + 1, (rows,), generator=g)
    lengths[0] = response_tokens
    response_mask = torch.arange(response_tokens)[None, :] < lengths[:, None]
    ids[:, prompt_tokens:] = torch.where(response_mask, ids[:, prompt_tokens:], pad_id)
    mask = torch.cat([torch.ones(rows, prompt_tokens, dtype=torch.long), response_mask.long()], dim=1)
    ids, mask, response_mask = ids.to(device), mask.to(device), response_mask.to(device)
    old, ref, values = score_passes(roles, ids, mask, prompt_tokens, 1.0, forward_batch_size=rows)
    scores = torch.randn(rows, generator=g).to(device)
    return Rollout(rows=[], completions=[""] * rows, query_ids=ids[:, :prompt_tokens],
                   query_mask=mask[:, :prompt_tokens], response_ids=ids[:, prompt_tokens:],
                   response_mask=response_mask, old_logprobs=old, ref_logprobs=ref, values=values,
                   raw_scores=scores, scores=scores, stopped=~response_mask[:, -1])


def one_minibatch(roles, rollout, adv, cfg, settings) -> dict:
    """The update's first minibatch of every row, forward and backward, as `settings` run it: its
    self-check against the rollout's logprobs, its losses, and each role's gradient (float32, flat)."""
    import torch

    from lora_ppo.distributed import World
    from lora_ppo.update import LogprobCheck, _TokenWeightedMeans, minibatch_backward

    means, check = _TokenWeightedMeans(), LogprobCheck()
    rows = torch.arange(rollout.response_ids.shape[0])
    with roles.gradient_checkpointing(settings.gradient_checkpointing, settings.compiled_layers):
        minibatch_backward(roles, rollout, adv, rows, cfg, settings, cfg.kl_coef, means, check=check)
    grads = {}
    for role, params in (("policy", roles.policy_parameters()), ("value", roles.value_parameters())):
        grads[role] = torch.cat([p.grad.detach().float().flatten().cpu() for p in params if p.grad is not None])
        for p in params:
            p.grad = None
    _, logprob_mean_diff = check.over(World())
    return {"logprob_mean_diff": logprob_mean_diff, "policy_loss": means.mean("loss/policy"),
            "value_loss": means.mean("loss/value"), "grads": grads}


def distances(run: dict, exact: dict) -> dict:
    """How far a path's minibatch is from float32's default."""
    out = {"logprob_mean_diff": run["logprob_mean_diff"]}
    for role in ("policy", "value"):
        g, e = run["grads"][role], exact["grads"][role]
        out[f"{role}_grad_rel"] = float((g - e).norm() / e.norm()) if g.shape == e.shape else float("nan")
    return {key: round(value, 7) for key, value in out.items()}


DISTANCES = ("logprob_mean_diff", "policy_grad_rel", "value_grad_rel")


def same_function(entry: dict) -> bool:
    """In float32 a path computes the default's function: every distance within FLOAT32_LIMIT (NaN is not)."""
    return all(entry[key] <= FLOAT32_LIMIT for key in DISTANCES)


def vs_default(entry: dict, default: dict) -> dict:
    """A bfloat16 path's distances from float32 as multiples of the bfloat16 default's."""
    return {key: round(entry[key] / default[key], 3) if default[key] > 0 else (1.0 if entry[key] == 0 else
                                                                               float("inf")) for key in DISTANCES}


def check_paths(low, exact, rollout, cfg, micro_batch: int, names, results: dict, save=lambda: None) -> dict:
    """Every path of `names` (the default first) run in float32 on `exact` and in 16 bits on `low` (its
    entry named by `low`'s compute dtype), each against the default path on `exact`, into `results`. A
    path that raises is recorded with its error's first line, its partial gradients dropped, and the
    rest go on."""
    from lora_ppo.errors import named_first_line
    from lora_ppo.update import UpdateSettings, compute_advantages

    rows = rollout.response_ids.shape[0]
    settings = UpdateSettings(rows, micro_batch, 1.0, gradient_checkpointing=True)
    adv = compute_advantages(rollout, cfg, cfg.kl_coef, rollout.scores)
    reference = one_minibatch(exact, rollout, adv, cfg, settings)
    results["float32_self_check"] = reference["logprob_mean_diff"]  # the update against its own scoring
    low_dtype = str(low.lm_head.weight.dtype).removeprefix("torch.")
    for name in names:
        entry = results[name] = {}
        for dtype, roles in (("float32", exact), (low_dtype, low)):
            if dtype == "float32" and name in LOW_PRECISION_ONLY:
                continue
            try:
                run_settings, context = PATHS[name](roles, settings)
                t0 = time.perf_counter()
                with context:
                    run = one_minibatch(roles, rollout, adv, cfg, run_settings)
                entry[dtype] = {**distances(run, reference), "policy_loss": run["policy_loss"],
                                "value_loss": run["value_loss"], "seconds": round(time.perf_counter() - t0, 2)}
            except Exception as error:  # noqa: BLE001 - one path's failure must not lose the others'
                entry[dtype] = {"error": named_first_line(error)}
                for p in roles.policy_parameters() + roles.value_parameters():
                    p.grad = None  # what a backward cut short left would add to the next path's
                continue
            if dtype == "float32":
                entry[dtype]["same_function"] = same_function(entry[dtype])
            elif "error" not in results["default"].get(dtype, {"error": "not run"}):
                entry[dtype]["vs_default"] = vs_default(entry[dtype], results["default"][dtype])
        print(json.dumps({name: entry}), file=sys.stderr, flush=True)
        save()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "bench" / "model_configs" / "llama-3.1-8b"))
    parser.add_argument("--layers", type=positive, default=4, help="decoder layers (the config's widths; default 4)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16"],
                        help="the compute dtype of the paths measured (auto: bfloat16 on a GPU that has it)")
    parser.add_argument("--rows", type=positive, default=4)
    parser.add_argument("--micro-batch", type=positive, default=None, help="rows per micro-batch (default: all)")
    parser.add_argument("--prompt-tokens", type=positive, default=256)
    parser.add_argument("--response-tokens", type=positive, default=256)
    parser.add_argument("--rank", type=positive, default=16, help="LoRA rank of both adapters (the 8B recipe's)")
    parser.add_argument("--lora-b-std", type=float, default=0.02)
    parser.add_argument("--paths", type=path_names, default=list(PATHS))
    parser.add_argument("--work", default="/tmp/lora_ppo_update_numerics")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    if not (Path(args.config) / "config.json").is_file():
        parser.error(f"--config {args.config}: no config.json there")

    import torch

    from lora_ppo.config import PPOConfig

    torch.manual_seed(0)  # LoRA A's initialisation (copied into both roles): the same every run
    work = Path(args.work)
    config = json.loads((Path(args.config) / "config.json").read_text())
    config_dir = work / f"{Path(args.config).name}-{args.layers}-layers"
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": args.layers}))
    model_dir = config_dir.with_name(config_dir.name + "-4bit")
    build_random_4bit_model(config_dir, small_tokenizer(work / "tokenizer"), model_dir)
    cuda = torch.cuda.is_available()
    dtype = args.dtype if args.dtype != "auto" else "float16" if cuda and not torch.cuda.is_bf16_supported() \
        else "bfloat16"
    exact = roles_of(model_dir, "float32", args.rank)
    draw_adapters(exact, args.lora_b_std)
    low = roles_of(model_dir, dtype, args.rank)
    copy_trainable(exact, low)
    config = exact.peft.get_base_model().config
    rollout = scored_rollout(exact, args.rows, args.prompt_tokens, args.response_tokens, config.vocab_size,
                             config.pad_token_id)
    result = {**software(), "config": args.config, "layers": args.layers, "dtype": dtype, "rows": args.rows,
              "micro_batch": args.micro_batch or args.rows, "prompt_tokens": args.prompt_tokens,
              "response_tokens": args.response_tokens,
              "response_lengths": rollout.response_mask.sum(1).tolist(),
              "float32_matmuls_in_tf32": cuda and torch.backends.cuda.matmul.allow_tf32, "paths": {}}

    def save() -> None:  # after each path: a device call cut short keeps the paths done
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    check_paths(low, exact, rollout, PPOConfig(), args.micro_batch or args.rows, args.paths, result["paths"], save)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
