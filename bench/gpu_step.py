"""GPU step benchmark: where the time of a PPO step goes on a real-size model, under a memory cap.

Builds a random-init model of a real model's shape (default Llama-3.1-8B's) straight into a
pre-quantized 4-bit checkpoint, one weight at a time on the GPU (bench/random_models.py: no bf16
copy is ever written or held), measures the card's bf16 matmul rate, then for each `--gpu-gb`
budget (default 12 and 24) caps the process's CUDA allocator at that budget minus the CUDA
context and runs `--steps` PPO steps of a recipe (default recipes/single_gpu_8b.yaml: its `auto`
sizes are chosen for the capped free memory, as a user's run chooses them), every prompt as long
as `data.max_prompt_tokens` allows and every response at full length. For each budget it writes:

- the auto sizes chosen, per-step seconds, peaks and `perf/*` (model FLOPs per phase per second),
  each phase's rate as a share of the measured matmul rate, and the allocator's reserved peak and
  retries;
- the KL check: objective/kl per step of the near-reference policy (per token, against the bf16
  self-check tolerance), and on a fresh sample the per-token mean of generation logprobs minus
  scoring logprobs, and the KL measured from each (scoring the policy together with the reference
  in one stacked forward, or alone);
- one extra step per update variant (compiled layers, double the micro-batch, both roles in one
  pass, checkpointing off, half the micro-batch, `model.fused_lora` in the update at the same micro-
  batch (also with its adapters cast per layer call) and double it, then the `auto` choice again as a
  control), on the same loaded run: the update's seconds, TFLOP/s and peak, or where it ran out of
  memory; then `ppo.trim_padding` on and off over responses cut at random lengths (their padding
  share too);
- after every timed step (the last budget only: a CUDA profile slows every later launch of the
  process, `step_after_profiler`), a torch.profiler table of one update micro-batch (policy and value
  forward and backward) and one optimizer step by kernel family (4-bit dequantize, matmul,
  attention, softmax and reductions, optimizer, other elementwise), with the device time under the
  LM head + logprob and LoRA ranges (forward) and the top kernels by name; then the same
  micro-batch's wall time and its waits for the GPU (CUDA's sync debug mode);
- the same table for one more generation of the batch (warm: compiled by the steps), against
  that call's wall time and per decoded token: where a 4-bit decode step's time goes;
- with the update variants, one more step at the `auto` settings after the profiles
  (`after_profiler`): what the profiles cost the steps that follow them.

Prints one JSON object and writes it to `--out`.

    python bench/gpu_step.py [--config bench/model_configs/llama-3.1-8b] [--gpu-gb 12 24] [--steps 2]
                             [--tokenizer DIR] [--out bench/results/gpu_step_h100.json] [overrides ...]

On an H100 a budget takes about 4 minutes (loading, 85 s compiling generation, the steps, the KL
check and the profile), the update variants (first budget only) 3 more, the model build 12-25 s:
within a device call's 10 minutes, run
one budget per call (`--gpu-gb 12`, then `--gpu-gb 24 --no-update-variants`; the built model is
reused from `--work` while the machine stays warm).

Without `--tokenizer` a small byte-level BPE tokenizer (the tests' one, with a chat template) is
built: token ids only need to fit the model's vocabulary. Without a GPU it runs uncapped on CPU as
a smoke test of itself (use a small `--config`).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest.mock import patch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_memory_check import cap_allocator, long_prompts, run_overrides, software  # noqa: E402  (bench/, beside this script)
from nf4_decode_matmul import add_launch_argument, use_tuned_launch  # noqa: E402
from random_models import build_random_4bit_model, small_tokenizer  # noqa: E402

GB = 1e9
# Kernel families, matched in order against a kernel's lower-cased name (first match wins).
KERNEL_FAMILIES = (
    ("4-bit fused matmul", ("nf4_linear", "gemm_4bit")),  # model.fused_4bit_decode's, bitsandbytes' own
    ("4-bit dequantize", ("dequant", "kdequantize", "bnb")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax_warp_forward_causal", "efficient_attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "_mm_", "splitk", "sm90_", "sm80_",
                "aten::mm", "aten::addmm", "aten::bmm")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("softmax and reductions", ("softmax", "logsumexp", "reduce", "log_softmax", "cunn_", "gather", "scatter")),
)
RANGES = ("lm_head_logprobs", "lora")
# Update variants tried on the loaded run, one extra step each (no reload, no recompile): the
# candidates for "fill the card", measured against the `auto` choice, in this order (a device call
# cut short keeps the first). The `auto` choice runs again last: the same settings a few steps later
# say how far the process drifted (on 2026-11-27 two steps with identical work took 9.6 and 15.6 s).
UPDATE_VARIANTS = {
    # ppo.compile_update: a first step compiles (its seconds recorded apart), the second is timed
    "compile_update": lambda s: {"compiled_layers": _compiled_layers()},
    "micro_batch_double": lambda s: {"micro_batch_size": min(s.minibatch_size, 2 * s.micro_batch_size)},
    "roles_together": lambda s: {"roles_together": True},
    "checkpointing_off": lambda s: {"gradient_checkpointing": False},
    "micro_batch_half": lambda s: {"micro_batch_size": max(1, s.micro_batch_size // 2)},
    # model.fused_lora in the update alone (`fused_in_update`): the same settings, then double the
    # micro-batch in the memory its float32 copies no longer take
    "fused_lora": lambda s: {},
    # the same with each layer casting its adapter's weights at every call (before `adapters_cast_once`)
    "fused_lora_cast_per_call": lambda s: {},
    "fused_lora_micro_batch_double": lambda s: {"micro_batch_size": min(s.minibatch_size, 2 * s.micro_batch_size)},
    "auto_again": lambda s: {},
}


def variant_names(text: str) -> list[str]:
    names = text.split(",")
    known = [*UPDATE_VARIANTS, "ragged", "after_profiler"]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {known}")
    return names


def _compiled_layers():
    from lora_ppo.compiled_update import CompiledLayers

    return CompiledLayers()


def family(name: str) -> str:
    lower = name.lower()
    return next((fam for fam, keys in KERNEL_FAMILIES if any(k in lower for k in keys)), "other elementwise")


def matmul_tflops(torch, device: str) -> float:
    """The card's bf16 matmul rate (TFLOP/s) on a large square product (fp32 on CPU)."""
    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (1024, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    repeats = 20 if device == "cuda" else 3
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e12


@contextmanager
def profiler_ranges(trainer):
    """Name the LM head + logprob work and every LoRA A/B forward in the profile (record_function
    ranges): kernel names alone do not say which matmul is the LM head or an adapter's."""
    import torch
    from torch.autograd.profiler import record_function

    from lora_ppo import logprobs

    real_chunk = logprobs._chunk_logprobs

    def chunk(*args, **kwargs):
        with record_function("lm_head_logprobs"):
            return real_chunk(*args, **kwargs)

    handles, open_ranges = [], []
    for name, module in trainer.roles.peft.named_modules():
        if re.search(r"\.lora_[AB]\.[^.]+$", name):
            handles.append(module.register_forward_pre_hook(
                lambda *_: open_ranges.append(record_function("lora").__enter__())))
            handles.append(module.register_forward_hook(lambda *_: open_ranges.pop().__exit__(None, None, None)))
    logprobs._chunk_logprobs = chunk
    try:
        yield
    finally:
        logprobs._chunk_logprobs = real_chunk
        for handle in handles:
            handle.remove()
        torch.cuda.synchronize() if torch.cuda.is_available() else None


def step_after_profiler(trainer) -> dict:
    """One more step at the `auto` settings after the profiles: against the steps before them, what a
    CUDA profile's CUPTI, still attached, costs the steps after it (every slower step of the earlier
    device calls ran after their profile: bench/README.md)."""
    metrics, _ = trainer.train_step()
    keys = ("time/generate", "time/score_forward", "time/update", "time/step", "perf/update_tflops")
    return {**{k: round(metrics[k], 4) for k in keys if k in metrics}, **allocator_counts(), **card_state()}


def profile_update(trainer, rollout) -> dict:
    """One update micro-batch (policy and value, forward and backward) and one optimizer step
    under torch.profiler: device time by kernel family, by range, and the top kernels; then the same
    unprofiled: its wall time, and its waits for the GPU."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from lora_ppo.update import _TokenWeightedMeans, compute_advantages, minibatch_backward

    r, parts = trainer.recipe, trainer.parts
    adv = compute_advantages(rollout, r.ppo, trainer.state.kl_coef, rollout.scores, r.rollout.samples_per_prompt)
    rows = torch.arange(r.micro_batch_size, device=rollout.response_ids.device)
    settings = trainer.update_settings
    one_micro = type(settings)(r.micro_batch_size, r.micro_batch_size, settings.temperature,
                               settings.gradient_checkpointing, settings.roles_together)
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    def micro_batch(wait: bool = True) -> None:
        with parts.roles.gradient_checkpointing(settings.gradient_checkpointing):
            minibatch_backward(parts.roles, rollout, adv, rows, r.ppo, one_micro, trainer.state.kl_coef,
                               _TokenWeightedMeans())
        parts.optimizer.step()
        if cuda and wait:
            torch.cuda.synchronize()

    parts.optimizer.zero_grad(set_to_none=True)
    with profiler_ranges(trainer), profile(activities=activities) as prof:
        micro_batch()
    parts.optimizer.zero_grad(set_to_none=True)
    # The same micro-batch unprofiled: its wall time against its kernels' (the rest is the host's), and
    # how often it waited for the GPU (CUDA's sync debug mode warns at each wait).
    t0 = time.perf_counter()
    micro_batch()
    wall_ms = (time.perf_counter() - t0) * 1e3
    parts.optimizer.zero_grad(set_to_none=True)
    syncs = None
    if cuda:
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                micro_batch(wait=False)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        parts.optimizer.zero_grad(set_to_none=True)
    # The adapters moved by extra optimizer steps: only `step_after_profiler` (timing, not learning) runs after.
    cpu_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    ranges = {}
    for label in RANGES:
        tops = [e for e in cpu_events if e.name == label]
        ranges[label] = sum(_device_time_under(e, cuda) for e in tops) / 1e3
    return {"micro_batch_rows": r.micro_batch_size, "wall_ms": round(wall_ms, 2), "host_syncs": syncs,
            **kernel_summary(prof, cuda), "forward_ranges_ms": {k: round(v, 2) for k, v in ranges.items()}}


def profile_generation(trainer, prompts) -> dict:
    """One more generation of the step's batch (warm: its graph compiled by the steps) under
    torch.profiler: device time by kernel family and the top kernels, against the same call's wall
    time unprofiled (the rest is the GPU waiting on the host). Where a 4-bit decode step's time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    rows = prompts[: trainer.recipe.rollout.batch_size]

    def generate() -> int:
        samples = trainer.sampler.sample(rows)
        if cuda:
            torch.cuda.synchronize()
        return int(samples.response_mask.shape[1])

    t0 = time.perf_counter()
    new_tokens = generate()
    wall_ms = (time.perf_counter() - t0) * 1e3
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        generate()
    return {"rows": len(rows), "new_tokens": new_tokens, "wall_ms": round(wall_ms, 2),
            "decode_step_ms": round(wall_ms / max(new_tokens, 1), 3), **kernel_summary(prof, cuda)}


def kernel_summary(prof, cuda: bool) -> dict:
    """A profile's device time: in all, by kernel family, and its 15 longest kernels. The device
    side of a record_function range (kineto's GPU user annotation) comes back as a CUDA event of the
    range's name, spanning the kernels under it: not a kernel. On CPU (a smoke test) every op's own
    time stands in for kernels."""
    import torch

    events = prof.events()
    cpu_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    ranges_named = {e.name for e in cpu_events}
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and e.name not in ranges_named] if cuda else cpu_events
    time_of = (lambda e: e.device_time) if cuda else (lambda e: e.self_cpu_time_total)
    total = sum(time_of(e) for e in kernels)
    families: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in kernels:
        families[family(e.name)] = families.get(family(e.name), 0.0) + time_of(e)
        by_name[e.name] = by_name.get(e.name, 0.0) + time_of(e)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    return {
        "device_ms": round(total / 1e3, 2),
        "by_family_ms": {k: round(v / 1e3, 2) for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
        "by_family_share": {k: round(v / max(total, 1e-9), 3) for k, v in families.items()},
        "top_kernels_ms": [[name[:120], round(t / 1e3, 2)] for name, t in top],
    }


def _device_time_under(event, cuda: bool) -> float:
    """Device time (us) of every kernel launched under a CPU range, its sub-ranges included."""
    # A CPU event's device_time_total already sums its children's kernels.
    return event.device_time_total if cuda else event.cpu_time_total


def update_variants(trainer, results: dict, save=lambda: None, only=None) -> dict:
    """One extra step per UPDATE_VARIANTS entry on the loaded run (the rollout work is the same):
    seconds, TFLOP/s and peak of the update, or the out-of-memory, and the allocator's retries so
    far. Each lands in `results` and is saved as it comes.

    Then `ppo.trim_padding` on, `ppo.packing` on, and both off, in three adjacent steps whose responses
    are cut at random lengths (`RaggedResponses`): the rest of this workload has no padding to remove.

    Not here: `model.adapter_autocast` changes generation's compiled graph, so its step compiled and
    recorded a second decode graph (99 s on 2026-11-27) whose memory every later variant then ran
    beside; it gets a run of its own (`model.adapter_autocast=true --no-update-variants`)."""
    import dataclasses

    import torch

    base_settings, base_work = trainer.update_settings, trainer.work

    def step(name: str, described: dict, keys=("time/update", "perf/update_tflops", "memory/update_gb")) -> None:
        try:
            metrics, _ = trainer.train_step()
            results[name] = {**described, **{k: round(metrics[k], 4) for k in keys if k in metrics},
                             **allocator_counts(), **card_state()}
        except torch.OutOfMemoryError as err:
            results[name] = f"out of memory: {str(err).splitlines()[0][:160]}"
            trainer.parts.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        print(json.dumps({name: results[name]}), file=sys.stderr, flush=True)
        save()

    for name, change in UPDATE_VARIANTS.items():
        if only is not None and name not in only:
            continue
        settings = dataclasses.replace(base_settings, **change(base_settings))
        fused = name.startswith("fused_lora")  # the layers change, whatever the settings
        if settings == base_settings and name != "auto_again" and not fused:
            results[name] = "same as the auto choice"
            continue
        trainer.update_settings = settings
        trainer.work = dataclasses.replace(base_work, checkpointing=settings.gradient_checkpointing)
        described = {"micro_batch": settings.micro_batch_size, "roles_together": settings.roles_together,
                     "gradient_checkpointing": settings.gradient_checkpointing}
        if settings.compiled_layers is not None:
            step(f"{name}_compiling", described,
                 ("time/update", "time/compile", "update/compiled_graphs", "memory/update_gb"))
        per_call = patch("lora_ppo.update.adapters_cast_once", lambda *_: nullcontext()) \
            if name.endswith("_cast_per_call") else nullcontext()
        with fused_in_update(trainer.parts.roles) if fused else nullcontext() as routed, per_call:
            step(name, described, ("time/update", "perf/update_tflops", "memory/update_gb", "check/logprob_mean_diff"))
        if routed is not None and isinstance(results[name], dict):
            results[name]["fused_layers"] = routed["layers"]
    trainer.update_settings, trainer.work = base_settings, base_work
    roles, sampler = trainer.parts.roles, trainer.sampler
    keys = ("time/score_forward", "time/update", "perf/update_tflops", "memory/update_gb", "update/padding_frac",
            "check/logprob_mean_diff")
    # (name, ppo.trim_padding, ppo.packing)
    ragged = (("ragged_trim_padding_on", True, False), ("ragged_packing", True, True),
              ("ragged_trim_padding_off", False, False))
    for name, trim, packing in ragged if only is None or "ragged" in only else ():
        trainer.sampler, roles.trim_padding, roles.packing = RaggedResponses(sampler, seed=0), trim, packing
        try:
            step(name, {"micro_batch": base_settings.micro_batch_size}, keys)
        finally:
            trainer.sampler, roles.trim_padding, roles.packing = sampler, True, False
    return results


@contextmanager
def fused_in_update(roles):
    """`model.fused_lora` in the update's forwards and backwards only. Generation's compiled decode step
    was traced with PEFT's forward: routing the layers for the whole step would compile it again (as
    `model.adapter_autocast` did, 99 s and a second graph's memory). Scoring keeps PEFT's numbers, so
    the step's `check/logprob_mean_diff` reads the bfloat16 gap between the two paths. Yields how
    many layers the update ran fused."""
    from lora_ppo.fused_lora import fuse_lora_layers, unfuse_lora_layers

    plain = roles.gradient_checkpointing  # the update's context around its forwards and backwards
    routed = {"layers": 0}  # LoRA layers the update ran fused

    @contextmanager
    def fused(*args, **kwargs):
        routed["layers"] = fuse_lora_layers(roles.peft)["fused"]
        try:
            with plain(*args, **kwargs):
                yield
        finally:
            unfuse_lora_layers(roles.peft)

    roles.gradient_checkpointing = fused
    try:
        yield routed
    finally:
        del roles.gradient_checkpointing


class RaggedResponses:
    """A sampler whose responses are cut at random lengths (`trim_padding.ragged`, as the CPU benchmark
    cuts them; the same lengths for the same `seed`): padding for `ppo.trim_padding` to trim, where a
    random model never samples its stop token. The completions' text is left whole (the reward sees
    it; only the timing is measured)."""

    def __init__(self, sampler, seed: int) -> None:
        self._sampler, self._seed = sampler, seed

    def __getattr__(self, name):
        return getattr(self._sampler, name)

    def sample(self, *args, **kwargs):
        import dataclasses

        import torch

        from trim_padding import ragged  # bench/, beside this script: the CPU benchmark's lengths

        samples = self._sampler.sample(*args, **kwargs)
        ids, mask, keep = ragged(samples.response_ids, samples.response_mask, self._sampler.tokenizer.pad_token_id,
                                 self._seed)
        logprobs = None if samples.logprobs is None else torch.where(mask, samples.logprobs, 0.0)
        return dataclasses.replace(samples, response_ids=ids, response_mask=mask, logprobs=logprobs,
                                   stopped=samples.stopped | ~keep[:, -1])


def kl_check(trainer, prompts) -> dict:
    """On a fresh sample of the near-reference policy: the per-token mean of generation logprobs
    minus scoring logprobs, and the KL estimate (k1, nats per token) from each pairing."""
    import dataclasses

    import torch

    from lora_ppo.model import dequantized_once
    from lora_ppo.roles import POLICY, REFERENCE
    from lora_ppo.rollout import score_passes

    r, roles, sampler = trainer.recipe, trainer.roles, trainer.sampler
    rows = prompts[: r.rollout.batch_size]
    with dequantized_once(roles.peft, r.model):
        samples = sampler.sample(rows, record_logprobs=True)
        ids, mask = samples.model_input()
        start = samples.query_ids.shape[1]
        args = (roles, ids, mask, start, r.rollout.temperature, r.rollout.forward_batch_size)
        stacked_old, stacked_ref, _ = score_passes(*args, with_values=False, together=True)
        alone_old, alone_ref, _ = score_passes(*args, with_values=False, together=False)
        # The same comparison for generate() (no static cache, no compiled step), where the
        # compiled path ran: which of the two sampling paths parts from the scoring pass.
        eager = None
        if sampler.decoder is not None:
            eager = dataclasses.replace(sampler, decoder=None).sample(rows, record_logprobs=True)
            e_ids, e_mask = eager.model_input()
            eager_old = score_passes(roles, e_ids, e_mask, eager.query_ids.shape[1], r.rollout.temperature,
                                     r.rollout.forward_batch_size, with_values=False, with_reference=False)[0]
    m = samples.response_mask

    def mean(x: torch.Tensor, where: torch.Tensor = m) -> float:
        return float(x[where].double().mean()) if where.any() else float("nan")

    gen = samples.logprobs
    first = torch.zeros_like(m)
    first[:, 0] = m[:, 0]  # the first new token comes from the (eager) prefill in both paths
    eager_part = {} if eager is None else {
        "eager_generation_minus_scoring_policy_abs": mean((eager.logprobs - eager_old).abs(), eager.response_mask)}
    return {
        "generation_minus_scoring_first_token_abs": mean((gen - stacked_old).abs(), first),
        "generation_minus_scoring_later_tokens_abs": mean((gen - stacked_old).abs(), m & ~first),
        **eager_part,
        "tokens": int(m.sum()),
        "kl_per_token_scoring_stacked": mean(stacked_old - stacked_ref),
        "kl_per_token_scoring_alone": mean(alone_old - alone_ref),
        "kl_per_token_generation_vs_reference_stacked": mean(gen - stacked_ref),
        "generation_minus_scoring_policy": mean(gen - stacked_old),
        "generation_minus_scoring_policy_abs": mean((gen - stacked_old).abs()),
        "stacked_minus_alone_policy_abs": mean((stacked_old - alone_old).abs()),
        "stacked_minus_alone_reference_abs": mean((stacked_ref - alone_ref).abs()),
        "roles": [POLICY, REFERENCE],
    }


def static_cache(trainer) -> dict:
    """The compiled decoder's static KV cache: its bytes, and what the allocator holds now, between
    steps (the estimate counts the cache as held through scoring and the update; on the H100 the
    phases after generation measured that much less)."""
    import torch

    decoder = trainer.parts.decoder
    tensors = [t for cache in (decoder._caches.values() if decoder else ()) for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor)]
    return {"held_gb": round(sum(t.numel() * t.element_size() for t in tensors) / GB, 3),
            "devices": sorted({str(t.device) for t in tensors}),
            "allocated_now_gb": round(torch.cuda.memory_allocated() / GB, 3) if torch.cuda.is_available() else None}


def allocator_counts() -> dict:
    """The CUDA allocator's reserved peak, its retries so far (each retry frees every cached block
    and waits for the GPU: a step near the cap pays for them in time, not in an error), and its calls
    to cudaMalloc and cudaFree so far (each one waits too: a cache whose blocks no longer fit a step's
    requests makes more of them)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {"memory/reserved_gb": round(torch.cuda.max_memory_reserved() / GB, 3),
            "cuda/alloc_retries": stats.get("num_alloc_retries", 0), "cuda/ooms": stats.get("num_ooms", 0),
            "cuda/device_allocs": stats.get("num_device_alloc"), "cuda/device_frees": stats.get("num_device_free")}


def card_state() -> dict:
    """The card's SM clock, temperature and power now, and the milliseconds it has spent held back
    by its power and thermal limits so far (NVML's violation counters, where nvidia-ml-py is
    installed; {} elsewhere). Identical work that took longer while these counters grew was the
    card slowing down, not the code."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        held = {name: pynvml.nvmlDeviceGetViolationStatus(handle, policy).violationTime / 1e6
                for name, policy in (("power", pynvml.NVML_PERF_POLICY_POWER),
                                     ("thermal", pynvml.NVML_PERF_POLICY_THERMAL))}
        return {"card/sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
                "card/temperature_c": pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU),
                "card/power_w": round(pynvml.nvmlDeviceGetPowerUsage(handle) / 1000),
                **{f"card/{name}_limited_ms": round(ms) for name, ms in held.items()}}
    except Exception:  # noqa: BLE001  (no NVML here: nothing to record)
        return {}


def recorded(part, *args):
    """The part's result, or its error as text (printed too) where it raised."""
    try:
        return part(*args)
    except Exception as err:  # noqa: BLE001  (a benchmark records what broke and goes on)
        text = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
        print(json.dumps({part.__name__: text}), file=sys.stderr, flush=True)
        return {"error": text}


def run_budget(args, model_dir: Path, prompts, prompt_tokens: int, gpu_gb: float, matmul_rate: float,
               result: dict, save=lambda: None) -> dict:
    """Fill `result` with this budget's measurements, calling `save` after each part."""
    import torch

    import lora_ppo
    from lora_ppo.alarms import LOGPROB_TOLERANCE
    from lora_ppo.data import PromptStream
    from lora_ppo.devices import device
    from lora_ppo.model import free_memory_bytes
    from lora_ppo.quantization import compute_dtype
    from lora_ppo.sizing import budget_from_free

    cuda = torch.cuda.is_available()
    context, cap = cap_allocator(gpu_gb)
    recipe = lora_ppo.load_recipe(args.recipe, run_overrides(model_dir, Path(args.work) / f"run-{gpu_gb:g}",
                                                              args.overrides))
    result.update({"gpu_gb": gpu_gb, "cuda_context_gb": round(context / GB, 3), "allocator_cap_gb": round(cap / GB, 3)})
    # The budget the run's `auto` sizes are planned for (lora_ppo.sizing): near a plan's edge (the
    # 8B recipe's micro-batches of 8 from 11.9 GB) tens of MB decide the sizes.
    result["plan_budget_gb"] = round(budget_from_free(free_memory_bytes(device()), "cuda" if cuda else "cpu"), 3)
    t0 = time.perf_counter()
    try:
        trainer = lora_ppo.PPOTrainer(recipe, progress=False)
        trainer.stream = PromptStream(prompts, recipe.train.seed)
        result["load_s"] = round(time.perf_counter() - t0, 1)
        r = trainer.recipe
        result["auto"] = {"ppo.grad_accum_steps": r.ppo.grad_accum_steps, "micro_batch": r.micro_batch_size,
                          "rollout.forward_batch_size": r.rollout.forward_batch_size,
                          "model.gradient_checkpointing": r.model.gradient_checkpointing,
                          "model.offload_embeddings": r.model.offload_embeddings,
                          "model.dequantize_per_step": r.model.dequantize_per_step,
                          "model.dequantize_budget_gb": r.model.dequantize_budget_gb,
                          "embeddings_staged_for_generation": getattr(
                              trainer.roles.peft.get_input_embeddings(), "staged_for_generation", False),
                          "rollout.compile": trainer.parts.decoder is not None}
        steps, rollout = [], None
        for _ in range(args.steps):
            metrics, rollout = trainer.train_step()
            step = {k: round(v, 4) for k, v in metrics.items()
                    if k.startswith(("memory/", "time/", "perf/", "objective/kl", "check/", "update/"))}
            for phase in ("generate", "score", "update"):
                if f"perf/{phase}_tflops" in metrics:
                    step[f"{phase}_share_of_measured_matmul"] = round(metrics[f"perf/{phase}_tflops"] / matmul_rate, 4)
            step["objective/kl_per_token"] = round(metrics["objective/kl"] / max(metrics["response/length"], 1), 6)
            step.update({**allocator_counts(), **card_state()})
            steps.append(step)
            print(json.dumps(step), file=sys.stderr, flush=True)
        result["steps"] = steps
        result["static_cache"] = static_cache(trainer)
        tolerance = LOGPROB_TOLERANCE[str(compute_dtype(r.model)).removeprefix("torch.")]
        result["kl_within_bf16_tolerance"] = all(abs(s["objective/kl_per_token"]) <= tolerance for s in steps)
        save()
        # Each later part is recorded on its own: one that breaks (a profiler API of another torch)
        # must not cost the device call the parts that worked.
        if args.kl_check:
            result["kl_check"] = recorded(kl_check, trainer, prompts)
            save()
        variants = args.update_variants and gpu_gb == args.gpu_gb[0]  # the first budget only: each costs a step
        if variants:
            result["update_variants"] = {}
            outcome = recorded(update_variants, trainer, result["update_variants"], save, args.variants)
            result["update_variants"].update({"error": outcome["error"]} if "error" in outcome else {})
        # The profiles come after every timed step: a CUDA profile leaves CUPTI attached to the process
        # (Kineto tears it down only with TEARDOWN_CUPTI=1), and each later launch pays for it (pytorch
        # issue 144455). So only the process's last budget is profiled, and one step after the profiles
        # measures what they cost the steps that follow (`after_profiler`).
        if gpu_gb == args.gpu_gb[-1]:
            result["profile"] = recorded(profile_update, trainer, rollout)
            save()
            result["generation_profile"] = recorded(profile_generation, trainer, prompts)
            save()
            if variants and (args.variants is None or "after_profiler" in args.variants):
                result["update_variants"]["after_profiler"] = recorded(step_after_profiler, trainer)
                save()
    except torch.OutOfMemoryError as err:
        result["error"] = f"out of memory: {str(err).splitlines()[0]}"
    result["max_phase_peak_gb"] = max((v for s in result.get("steps", []) for k, v in s.items()
                                        if k.startswith("memory/") and k != "memory/peak_gb"), default=None)
    if cuda:
        result["max_reserved_gb"] = round(torch.cuda.max_memory_reserved() / GB, 3)
    trainer = None
    gc.collect()
    if cuda:
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "bench" / "model_configs" / "llama-3.1-8b"))
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder (default: a small one, built)")
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "single_gpu_8b.yaml"))
    parser.add_argument("--gpu-gb", type=float, nargs="+", default=[12.0, 24.0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--work", default="/tmp/lora_ppo_gpu_step")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--no-kl-check", dest="kl_check", action="store_false",
                        help="skip the KL check (a fresh sample, scored three ways, and an eager one: a minute)")
    parser.add_argument("--no-update-variants", dest="update_variants", action="store_false",
                        help="skip the extra steps that try other update settings")
    parser.add_argument("--variants", type=variant_names, default=None,
                        help="only these update variants, comma-separated (ragged: trimming, packing, neither; "
                             "after_profiler: one step after the profiles); default all")
    add_launch_argument(parser)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    nf4_launch = None
    if args.nf4_launch_from:  # read first: a wrong file stops the run before the model is built
        nf4_launch = use_tuned_launch(args.nf4_launch_from)

    import torch
    from transformers import AutoTokenizer

    import lora_ppo

    cuda = torch.cuda.is_available()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = args.tokenizer or small_tokenizer(work / "tokenizer")
    model_dir = work / (Path(args.config).name + "-4bit")
    t0 = time.perf_counter()
    build_random_4bit_model(Path(args.config), tokenizer_dir, model_dir)
    build_s = time.perf_counter() - t0
    rate = matmul_tflops(torch, "cuda" if cuda else "cpu")
    base = lora_ppo.load_recipe(args.recipe, [f"model.name={model_dir}", *args.overrides])
    prompts, prompt_tokens = long_prompts(AutoTokenizer.from_pretrained(model_dir), base.data)
    result = {
        **software(), "config": args.config, "recipe": args.recipe, "overrides": args.overrides,
        "prompt_tokens": prompt_tokens, "max_new_tokens": base.rollout.max_new_tokens, "batch": base.rollout.batch_size,
        "build_s": round(build_s, 1), "measured_matmul_tflops": round(rate, 1),
        "budgets": [],
    }
    if nf4_launch is not None:
        result["nf4_launch"] = nf4_launch

    def save() -> None:  # after each part: a device call cut short keeps the parts done
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    for gb in args.gpu_gb:
        result["budgets"].append({})
        run_budget(args, model_dir, prompts, prompt_tokens, gb, rate, result["budgets"][-1], save)
        save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
