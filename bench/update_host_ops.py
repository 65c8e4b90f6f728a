"""The host's work in one update micro-batch, counted on CPU, printed as JSON.

On a GPU the update is bound by the host below 8 rows (bench/README.md#gpu_steppy-needs-a-cuda-gpu):
Python and the dispatcher issue every operator, and each operator that computes launches a kernel.
Their number does not depend on the width of the model, so it can be counted here: the 8B recipe's
structure (Llama-3.1-8B's config: 32 layers, LoRA r=16 on all 7 linear layers of each, 4-bit NF4)
at a tiny width (hidden 64), where compute is next to nothing. One micro-batch of `--rows` rows of
`--prompt` + `--response` tokens: the policy's and the value's forward and backward with gradient
checkpointing, as `ppo_update` runs it.

In bfloat16, alone, with `model.adapter_autocast`, with `ppo.compile_update`, with `model.fused_lora`,
with both of the last two, and with `ppo.update_roles_together` (policy and value stacked in one pass)
without and with `model.fused_lora`; and both fused variants with each layer casting its adapter's
weights at every call, as before `adapters_cast_once` (`--variants` picks some): the operators
dispatched, those that launch work (everything but views and other metadata, counted with the
operators they call), the kernels (`kernel_ops`: those that call no other such operator, about one
GPU kernel each), the dtype casts, the 4-bit dequantizations, the micro-batch's seconds at this
width (median of `--repeats`; mostly host, plus attention over the full sequence), and a role
switch's milliseconds (policy to value, into and out of the reference by disabled adapters, into
and out of one batch of rows under policy, reference and value) as lora_ppo switches
(lora_ppo/adapter_switch.py) and through PEFT's `set_adapter`, `disable_adapter` and forward hooks. With
`ppo.compile_update` the fused kernels of the compiled layers are not operators and are not counted:
on a GPU each is one more launch. On a machine with a CUDA GPU the model runs there (as the trainer
places it): at this width a micro-batch's seconds are then the host's work alone.

    python bench/update_host_ops.py [--rows 4] [--prompt 256 --response 256]   # about 5 minutes
    python bench/update_host_ops.py --variants bfloat16,bfloat16_fused_lora
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from unittest.mock import patch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 32, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 2048}
# Operators that only describe memory (no kernel on a GPU).
METADATA = {"aten::view", "aten::as_strided", "aten::transpose", "aten::t", "aten::reshape", "aten::_unsafe_view",
            "aten::slice", "aten::select", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::permute",
            "aten::detach", "detach", "aten::resolve_conj", "aten::resolve_neg", "aten::alias", "aten::empty",
            "aten::empty_strided", "aten::empty_like", "aten::new_empty", "aten::new_empty_strided", "aten::split",
            "aten::chunk", "aten::narrow",
            "aten::contiguous", "aten::lift_fresh", "aten::result_type", "aten::size", "aten::stride",
            "aten::is_nonzero", "aten::matmul", "aten::linear", "aten::to", "aten::flatten", "aten::unflatten",
            "aten::view_as", "aten::_reshape_alias", "aten::split_with_sizes", "aten::unbind"}
# Operators that launch a kernel of their own besides those of the operators they call (bitsandbytes'
# and batched `_foreach_` ops count as their own kernels alone: `kernel_ops`).
OWN_KERNEL = {"aten::addmm", "aten::baddbmm", "aten::addbmm"}
# Tensors per launch of CUDA's multi-tensor kernels with two lists (ATen's depth_to_max_tensors).
FOREACH_TENSORS = 64
# bfloat16 as on a GPU (on CPU `auto` means float32, and `model.adapter_autocast` needs bfloat16).
VARIANTS = {"bfloat16": ["model.compute_dtype=bfloat16"],
            "bfloat16_adapter_autocast": ["model.compute_dtype=bfloat16", "model.adapter_autocast=true"],
            "bfloat16_compile_update": ["model.compute_dtype=bfloat16", "ppo.compile_update=true"],
            "bfloat16_fused_lora": ["model.compute_dtype=bfloat16", "model.fused_lora=true"],
            "bfloat16_compile_update_fused_lora": ["model.compute_dtype=bfloat16", "ppo.compile_update=true",
                                                   "model.fused_lora=true"],
            "bfloat16_roles_together": ["model.compute_dtype=bfloat16", "ppo.update_roles_together=true"],
            "bfloat16_roles_together_fused_lora": ["model.compute_dtype=bfloat16", "ppo.update_roles_together=true",
                                                   "model.fused_lora=true"]}
# The fused layers casting their adapters' weights at every call, as before `adapters_cast_once`.
CAST_PER_CALL = {"bfloat16_fused_lora_cast_per_call": VARIANTS["bfloat16_fused_lora"],
                 "bfloat16_roles_together_fused_lora_cast_per_call": VARIANTS["bfloat16_roles_together_fused_lora"]}
VARIANTS.update(CAST_PER_CALL)


def model_folder(work: Path) -> Path:
    from random_models import build_random_4bit_model, resized_config, small_tokenizer

    folder = work / "model"
    if not (folder / "config.json").exists():
        build_random_4bit_model(resized_config(SHAPE, work / "config"), small_tokenizer(work / "tokenizer"), folder)
    return folder


def measure(model_dir: Path, work: Path, overrides: list[str], args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import lora_ppo
    from lora_ppo.rollout import Rollout, score_passes
    from lora_ppo.update import UpdateSettings, _TokenWeightedMeans, compute_advantages, minibatch_backward

    recipe = lora_ppo.load_recipe(str(Path(__file__).parents[1] / "recipes" / "single_gpu_8b.yaml"), [
        f"model.name={model_dir}", f"train.output_dir={work / 'run'}", "model.gradient_checkpointing=true",
        "ppo.grad_accum_steps=2", "rollout.forward_batch_size=4", *overrides])
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    roles, optimizer = trainer.parts.roles, trainer.parts.optimizer
    rows, prompt, response = args.rows, args.prompt, args.response
    device = roles.lm_head.weight.device  # a GPU where there is one: then the seconds are the host's work
    ids = torch.randint(3, SHAPE["vocab_size"], (rows, prompt + response),
                        generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    old, ref, values = score_passes(roles, ids, mask, prompt, 1.0, rows)
    scores = torch.zeros(rows, device=device)
    rollout = Rollout(rows=[None] * rows, completions=[""] * rows, query_ids=ids[:, :prompt],
                      query_mask=mask[:, :prompt], response_ids=ids[:, prompt:], response_mask=mask[:, prompt:].bool(),
                      old_logprobs=old, ref_logprobs=ref, values=values, raw_scores=scores, scores=scores,
                      stopped=torch.zeros(rows, dtype=torch.bool, device=device))
    adv = compute_advantages(rollout, recipe.ppo, 0.05, scores)
    compiled = trainer.update_settings.compiled_layers  # ppo.compile_update
    settings = UpdateSettings(rows, rows, 1.0, gradient_checkpointing=True,
                              roles_together=trainer.update_settings.roles_together, compiled_layers=compiled)

    def micro_batch() -> None:
        with roles.gradient_checkpointing(True, compiled):
            minibatch_backward(roles, rollout, adv, torch.arange(rows, device=device), recipe.ppo, settings, 0.05,
                               _TokenWeightedMeans())
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

    micro_batch()  # warm (and compile)
    seconds = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        micro_batch()
        seconds.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        micro_batch()
    counts = {e.key: e.count for e in prof.key_averages() if e.key.startswith(("aten::", "bitsandbytes::"))}
    launching = {k: n for k, n in counts.items() if k.startswith("aten::") and k not in METADATA}
    kernels = kernel_ops(prof.events())
    return {
        "operators": sum(n for k, n in counts.items() if k.startswith("aten::")),
        "launching_work_aten": sum(launching.values()),
        "kernel_ops": sum(kernels.values()),
        "top_kernel_ops": kernels.most_common(8),
        "casts": counts.get("aten::_to_copy", 0),
        "dequantize_4bit": counts.get("bitsandbytes::dequantize_4bit", 0),
        "top_launching": sorted(launching.items(), key=lambda kv: -kv[1])[:8],
        "seconds_median": round(statistics.median(seconds), 3),
        "role_switch_ms": role_switch_ms(roles),
    }


def role_switch_ms(roles, repeats: int = 21) -> dict:
    """Median milliseconds of one role switch (`RoleModel.as_role`), lora_ppo's own and PEFT's."""
    from lora_ppo.roles import POLICY, REFERENCE, VALUE

    def median_ms(role) -> float:
        times = []
        for _ in range(repeats):
            with roles.as_role(POLICY):
                pass
            t0 = time.perf_counter()
            with roles.as_role(role) if role else roles.rows_as_roles((POLICY, REFERENCE, VALUE), 4):
                pass
            times.append(time.perf_counter() - t0)
        return round(1000 * statistics.median(times), 3)

    def switches(prefix: str) -> dict:  # the role None: into and out of one mixed batch of the three
        return {prefix + "value": median_ms(VALUE), prefix + "reference_disabled": median_ms(REFERENCE),
                prefix + "mixed_rows": median_ms(None)}

    direct = roles._switch
    result = switches("")
    roles._switch = None
    try:
        result.update(switches("peft_"))
    finally:
        roles._switch = direct
    return result


def kernel_ops(events) -> Counter:
    """The operators that compute and call no other such operator, by name: about one kernel each on a
    GPU. A cast (`_to_copy`) counts as its `copy_`, `zeros` as its `fill_`, an out-of-place `addmm` as
    its `copy_` of the input added to and its own matmul, a bitsandbytes op as one, whatever it runs
    inside on CPU (on a GPU one kernel), and a `_foreach_` op as one per 64 tensors (on CPU a copy per
    tensor). Casts of 0-dim tensors are left out: they are mostly the Python numbers an operator wraps
    (`grad * alpha`), cast on the host with no kernel."""
    def computes(e) -> bool:
        if e.name in ("aten::_to_copy", "aten::copy_") and all(shape == [] for shape in e.input_shapes[:2]):
            return False
        return e.name.startswith("bitsandbytes::") or (e.name.startswith("aten::") and e.name not in METADATA)

    def one_kernel(e) -> bool:  # a GPU runs it as its own kernels, whatever it calls on CPU
        return e.name.startswith(("bitsandbytes::", "aten::_foreach_"))

    def inside_one_kernel(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if one_kernel(parent):
                return True
            parent = parent.cpu_parent
        return False

    counts: Counter = Counter()
    for e in events:
        if computes(e) and not inside_one_kernel(e) and (
                e.name in OWN_KERNEL or one_kernel(e) or not any(computes(child) for child in e.cpu_children)):
            # a CUDA multi-tensor kernel takes up to 64 tensors (fewer when they are large); on CPU the
            # op calls one operator per tensor (the profiler records no shapes for a list of tensors).
            counts[e.name] += math.ceil(len(e.cpu_children) / FOREACH_TENSORS) if e.name.startswith(
                "aten::_foreach_") else 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS), type=lambda text: text.split(","),
                        help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--work", default="/tmp/lora_ppo_update_host_ops")
    args = parser.parse_args()
    unknown = [name for name in args.variants if name not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    work = Path(args.work)
    model_dir = model_folder(work)
    result = {"shape": {**SHAPE, "rows": args.rows, "prompt": args.prompt, "response": args.response}}
    for name in args.variants:
        with patch("lora_ppo.update.adapters_cast_once", lambda *_: contextlib.nullcontext()) \
                if name in CAST_PER_CALL else contextlib.nullcontext():
            result[name] = measure(model_dir, work / name, VARIANTS[name], args)
        print(json.dumps({name: result[name]}), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
