"""Predict peak memory per phase of a recipe from the model's config alone (no weights loaded).

The parameters are counted by model_shape.ModelShape, split as bitsandbytes splits them: it
quantizes the nn.Linear and Conv1D layers, and leaves everything else at the compute dtype,
including the fused 3-D expert weights and the routers of an MoE in transformers 5. Every term is
counted in bytes:

  static   = quantized linear weights + unquantized parts (embeddings, LM head, norms, biases,
             MoE experts and routers)
             + adapters (policy, value, frozen reference) + AdamW state + value head
             + reward model + a fixed runtime cost (CUDA context, or the Python process on CPU)
  generate = static + KV cache + per-step logits + one dequantized weight + prefill activations
  score    = static + one micro-batch forward (one layer live at a time) + a logits chunk
  update   = static + adapter gradients + activations kept for backward (all layers, or only
             layer inputs under gradient checkpointing) + a checkpointed logits chunk
  With rollout.compile the KV cache is a static one, allocated for a power-of-two batch and held
  through score and update too.

The activation constants were fitted to peaks measured by bench/memory_scaling.py; bench/README.md
has the measurements and how far the estimate is from them.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from lora_ppo.compiled_generation import bucket
from lora_ppo.config import AUTO, AUTO_DEQUANTIZE_SHARE, LoraSettings, ModelConfig, Recipe, SFTRecipe, field_value
from lora_ppo.logprobs import DEFAULT_CHUNK_TOKENS
from lora_ppo.model_shape import ModelShape, classifier_shape, load_shape
from lora_ppo.optimizers import MIN_8BIT_SIZE

GB = 1e9
PHASES = ("generate", "score", "update")

# Bytes per quantized linear weight parameter. NF4 packs two weights per byte plus one absmax per
# 64 weights: an fp32 absmax (+4/64), or with double quantization an 8-bit one with an fp32
# scale per 256 blocks (+1/64 + 4/(64*256)). LLM.int8 stores one int8 per weight plus fp32
# row statistics (negligible).
FOUR_BIT_BYTES = {True: 0.5 + 1 / 64 + 4 / (64 * 256), False: 0.5 + 4 / 64}
EIGHT_BIT_BYTES = 1.0
# Trainable adapter parameters are kept in fp32 (PEFT upcasts them): weight + grad + 2 Adam moments.
ADAPTER_WEIGHT_BYTES = 4
ADAPTER_GRAD_BYTES = 4
ADAM_BYTES = 8
OPTIMIZER_8BIT_BLOCK = 256  # bitsandbytes' 8-bit optimizers quantize their moments in blocks of 256
# Fixed cost beyond the tensors: the CUDA context and allocator slack on GPU; the Python process
# with torch, transformers, peft and bitsandbytes imported on CPU (measured by the bench).
RUNTIME_BYTES = {"cuda": 0.6 * GB, "cpu": 0.62 * GB}
# Values kept for backward per token per decoder layer, in units of (hidden, intermediate, kv
# width) elements: norms, q/k/v/o inputs and outputs, attention output, gate/up/act/product.
ACT_HIDDEN_TERMS = 10
ACT_INTERMEDIATE_TERMS = 4
ACT_KV_TERMS = 2
# The update's peak holds the saved values plus, while backward runs, the gradients of the
# activations and the backward's temporaries: about twice the saved values (the saved values
# alone were checked against torch.autograd.graph.saved_tensors_hooks).
BACKWARD_FACTOR = 2.0
# On CPU the update's peak resident memory also grows with the base model: glibc keeps the
# per-layer fp32 temporaries of backward (dequantized weights, weight-sized gradient buffers) as
# heap it does not hand back within the phase: about half the fp32 size of the linear layers,
# twice that for the int8 backward (fitted with BACKWARD_FACTOR on bench/memory_scaling.py's
# update peaks). GPU memory is counted as live tensors (max_memory_allocated), which this is not.
CPU_BACKWARD_SLACK = {"4bit": 0.5, "none": 0.5, "8bit": 1.0}
# Live values of a no-grad forward per token: the residual stream, one layer's MLP intermediates.
FWD_HIDDEN_TERMS = 4
FWD_INTERMEDIATE_TERMS = 3
# Computing in 16 bits with float32 adapters, PEFT casts each adapter's input to float32 and runs it
# there: float32 [tokens, width] tensors beside the 16-bit ones, counted as two more intermediate widths
# in 16-bit units (bench/live_memory.py: a scoring row in bfloat16 measured 1.43x the float32-fitted
# terms on CPU, as on an H100 at 8B, 0.26 GB against 0.18; the same with `model.adapter_autocast` on
# CPU, where PEFT still casts; on a GPU it then skips the casts, and this may over-count).
FP32_ADAPTER_OUTPUT_TERMS = 2
# `model.fused_lora` computing in 16 bits keeps no such float32 copies: no adapter terms in a no-grad
# forward, and a layer's values for the backward measured 0.58x PEFT's path (bench/live_memory.py: 4.00
# against 6.61 MB a row with checkpointing, of which 0.26 are the layer inputs kept either way: 0.58x,
# rounded up).
FUSED_LORA_LAYER_FACTOR = 0.59
# fp32 [positions, vocab] tensors alive at once in a logits chunk: logits, softmax, log-softmax
# (and their gradient under autograd).
LOGIT_COPIES_NO_GRAD = 3
LOGIT_COPIES_GRAD = 5
# Generation keeps the step's logits, the processed scores and the sampling probabilities.
GEN_LOGIT_COPIES = 3


@dataclass(frozen=True)
class Estimate:
    """Bytes per component and per phase; with a budget, the largest sizes that fit it."""

    shape: ModelShape
    components: dict[str, float]
    phases: dict[str, float]
    budget_gb: Optional[float]
    # Recipe overrides that fit the budget together and validate: the largest rollout.batch_size,
    # the fewest ppo.grad_accum_steps for it, the largest rollout.forward_batch_size ({}: nothing fits).
    fitting: dict[str, int]
    dequantize_per_step: bool = False  # as decided for this budget (`auto` included)
    processes: int = 1  # data-parallel processes: the phases are each one's
    weight_parts: dict[str, float] = field(default_factory=dict)  # components["weights"] by part (_weight_parts)
    static_kv_cache: float = 0.0  # rollout.compile: the KV cache held through every phase (in `phases`)
    auto_choices: tuple["AutoChoice", ...] = ()  # the sizes the recipe left `auto`, as chosen for the budget
    host: dict[str, float] = field(default_factory=dict)  # what the memory levers keep in CPU memory instead
    levers: dict[str, Any] = field(default_factory=dict)  # when nothing fits the budget: the levers that make it fit
    # model.offload_embeddings: generation looks tokens up in a copy of the table on the device (in
    # `phases["generate"]`), where that keeps generation's peak at or under the other phases'.
    embeddings_staged: bool = False
    # The least budget (GB) whose `auto` plan runs the update faster, and how (`faster_update_budget`).
    faster_update: Optional[tuple[float, str]] = None

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    @property
    def fits(self) -> Optional[bool]:
        return None if self.budget_gb is None else self.peak <= self.budget_gb * GB


def _dtype_bytes(recipe: Recipe, device: str) -> int:
    return 4 if recipe.model.compute_dtype_name(device) == "float32" else 2


def _weight_parts(shape: ModelShape, model: ModelConfig, act_bytes: int, device: str = "cuda") -> dict[str, float]:
    """Bytes of the base weights on the device: the linear layers bitsandbytes quantizes, at their
    quantization's cost, then each part it leaves at the compute dtype (MoE experts included); the
    LM head at the linear layers' cost with `model.quantize_lm_head`, and the embeddings left out
    with `model.offload_embeddings` (they are in CPU memory: `_host_parts`)."""
    per_weight = _quantized_bytes(model, act_bytes)
    parts = {"linear_layers": shape.linear_params * per_weight,
             **{part: n * act_bytes for part, n in shape.unquantized_parts().items()}}
    if model.quantize_lm_head and "lm_head" in parts:
        parts["lm_head"] = shape.vocab * shape.hidden * per_weight
    if model.embeddings_on_cpu and device != "cpu":
        parts.pop("embeddings", None)
    return parts


def _quantized_bytes(model: ModelConfig, act_bytes: int) -> float:
    """Bytes a quantized linear weight takes (the compute dtype's without quantization)."""
    q = model.quantization
    return FOUR_BIT_BYTES[model.double_quant] if q == "4bit" else EIGHT_BIT_BYTES if q == "8bit" else act_bytes


def _weight_bytes(shape: ModelShape, model: ModelConfig, act_bytes: int, device: str = "cuda") -> float:
    return sum(_weight_parts(shape, model, act_bytes, device).values())


def _host_parts(shape: ModelShape, recipe: Recipe, act_bytes: int, device: str) -> dict[str, float]:
    """What the memory levers keep in CPU memory instead of the GPU's: the embedding table
    (`model.offload_embeddings`); AdamW's moments with a copy of each weight and gradient
    (`ppo.optimizer_state: cpu`, 16 bytes a trainable weight)."""
    if device == "cpu":
        return {}
    host = {}
    if recipe.model.embeddings_on_cpu:
        host["embeddings"] = shape.vocab * (shape.embed_width or shape.hidden) * act_bytes
    if recipe.ppo.optimizer_state == "cpu":
        host["optimizer"] = _adapter_params(shape, recipe)[0] * (ADAM_BYTES + ADAPTER_WEIGHT_BYTES + ADAPTER_GRAD_BYTES)
    return host


def _optimizer_bytes(shape: ModelShape, recipe: Recipe, device: str) -> float:
    """AdamW's state on the device: two fp32 moments a trainable weight; with bitsandbytes' 8-bit
    state, per tensor of at least MIN_8BIT_SIZE elements one byte a moment plus an fp32 absmax
    per block of OPTIMIZER_8BIT_BLOCK and a 256-entry fp32 code per moment; none when held on
    the CPU."""
    state = recipe.ppo.optimizer_state
    if state == "cpu" and device != "cpu":
        return 0.0
    if state != "8bit":
        return _adapter_params(shape, recipe)[0] * ADAM_BYTES
    total = 0.0
    for numel, count in trainable_tensors(shape, recipe):
        if numel < MIN_8BIT_SIZE:
            total += count * numel * ADAM_BYTES
        else:
            total += count * 2 * (numel + 4 * math.ceil(numel / OPTIMIZER_8BIT_BLOCK) + 4 * 256)
    return total


def trainable_tensors(shape: ModelShape, recipe: Recipe) -> list[tuple[int, int]]:
    """(elements, how many) of each trainable tensor: LoRA's A (r x in) and B (out x r) per adapted
    layer of the policy and the value, and the value head's weight and bias."""
    ad = recipe.adapters
    tensors = []
    for settings in (ad.policy, ad.value) if recipe.uses_critic else (ad.policy,):
        tensors += shape.lora_tensors(settings.r, settings.target_modules, settings.target_parameters)
    if recipe.uses_critic:
        tensors += [(shape.hidden, 1), (1, 1)]
    return tensors


def _lora_params(shape: ModelShape, settings: LoraSettings) -> int:
    """The LoRA parameters of one adapter with `settings` on `shape`."""
    return shape.lora_params(settings.r, settings.target_modules, getattr(settings, "target_parameters", ()))


def _adapter_params(shape: ModelShape, recipe: Recipe) -> tuple[int, int]:
    """(trainable, frozen) LoRA parameter counts."""
    ad = recipe.adapters
    lora = functools.partial(_lora_params, shape)
    trainable = lora(ad.policy)
    if recipe.uses_critic:
        trainable += lora(ad.value) + shape.hidden + 1
    frozen = lora(ad.policy) if ad.reference_adapter_path else 0
    if recipe.reward.adapter_path:  # a frozen reward adapter and its head on the same backbone
        r, targets, parameters = _saved_lora_settings(recipe.reward.adapter_path, ad.policy)
        frozen += shape.lora_params(r, targets, parameters) + shape.hidden + 1
    return trainable, frozen


def _saved_lora_settings(folder: str, fallback: LoraSettings) -> tuple[int, Any, list[str]]:
    """(r, target modules, target parameters) of a saved PEFT adapter; the fallback's when the
    folder is not here."""
    path = Path(folder) / "adapter_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        targets = config["target_modules"]
        return (int(config["r"]), "all-linear" if targets == "all-linear" else list(targets),
                list(config.get("target_parameters") or ()))
    except (OSError, ValueError, KeyError, TypeError):
        return fallback.r, fallback.target_modules, list(getattr(fallback, "target_parameters", ()))


def _reward_bytes(recipe: Recipe, classifier_shapes: list[ModelShape], device: str) -> float:
    """The weights of the classifier reward models, each in its own quantization and dtype
    (the policy's unless its source says otherwise); other sources need next to nothing."""
    classifiers = [s for s in recipe.reward.source_list() if s.kind == "classifier"]
    total = 0.0
    for source, shape in zip(classifiers, classifier_shapes):
        # The policy's memory levers are its own: a classifier loads whole.
        model = recipe.model.model_copy(update={"quantization": source.quantization or recipe.model.quantization,
                                                "compute_dtype": source.dtype or recipe.model.compute_dtype,
                                                "offload_embeddings": False, "quantize_lm_head": False})
        total += _weight_bytes(shape, model, 4 if model.compute_dtype_name(device) == "float32" else 2)
    return total


def _dequantized_weight_bytes(shape: ModelShape, recipe: Recipe, act_bytes: int) -> float:
    """A quantized layer's weight is dequantized to the compute dtype for each matmul; with
    `model.dequantize_per_step` every linear layer is held dequantized through the step."""
    if recipe.model.quantization == "none" or not shape.converted:
        return 0.0
    # A quantized LM head is one more quantized weight: dequantized whole for its matmul too.
    head = shape.vocab * shape.hidden if recipe.model.quantize_lm_head and not shape.tied_embeddings else 0
    largest = max(head, *(lin.fan_in * lin.fan_out for lin in shape.all_linears)) * act_bytes
    if recipe.model.dequantize_per_step is True:  # `auto` is decided by `estimate` before this
        copy = (shape.linear_params + head) * act_bytes
        budget = recipe.model.dequantize_budget_gb
        # A partial copy: at most the budget, plus the one layer outside it dequantized for a pass.
        return copy if budget is None or budget * GB >= copy else budget * GB + largest
    return largest


def kv_cache_bytes(shape: ModelShape, act_bytes: int, rows: int, tokens: int) -> float:
    """Keys and values of every layer for `rows` sequences of `tokens` tokens."""
    return 2 * shape.layers * shape.kv_width * rows * tokens * act_bytes


def static_kv_cache_bytes(shape: ModelShape, recipe: Recipe, act_bytes: int, batch: int, device: str) -> float:
    """With `rollout.compile` on for `device`: the static KV cache, its rows rounded up to the
    compiled batch bucket, which stays allocated through scoring and the update; else 0."""
    if not recipe.rollout.compiles_on(device, recipe.decode_steps):
        return 0.0
    return kv_cache_bytes(shape, act_bytes, bucket(batch), recipe.sequence_tokens)


def generate_bytes(shape: ModelShape, recipe: Recipe, act_bytes: int, batch: int, device: str = "cuda") -> float:
    """KV cache for the whole sequence (the static one with `rollout.compile`), the step's
    vocabulary logits, one dequantized weight, and prefill activations of one layer."""
    static_kv = static_kv_cache_bytes(shape, recipe, act_bytes, batch, device)
    kv = static_kv if static_kv else kv_cache_bytes(shape, act_bytes, batch, recipe.sequence_tokens)
    logits = GEN_LOGIT_COPIES * batch * shape.vocab * 4
    dequant = _dequantized_weight_bytes(shape, recipe, act_bytes)
    prefill = batch * recipe.data.max_prompt_tokens * forward_values_per_token(shape, act_bytes, recipe.model.fused_lora)
    return kv + logits + dequant + prefill


def score_bytes(shape: ModelShape, recipe: Recipe, act_bytes: int, rows: int) -> float:
    """One scoring forward of `rows` sequences (each repeated per role with
    rollout.score_roles_together) and one logits chunk."""
    if recipe.rollout.score_roles_together:
        rows *= max(1, recipe.scored_roles(float32=act_bytes == 4))
    tokens = rows * recipe.sequence_tokens
    return forward_bytes(shape, recipe, act_bytes, tokens, min(DEFAULT_CHUNK_TOKENS, rows * recipe.rollout.response_tokens))


def forward_values_per_token(shape: ModelShape, act_bytes: int, fused_lora: bool = False) -> float:
    """Bytes a no-grad forward keeps alive per token while one layer runs."""
    casts = act_bytes < ADAPTER_WEIGHT_BYTES and not fused_lora  # PEFT's float32 copies
    intermediate = FWD_INTERMEDIATE_TERMS + (FP32_ADAPTER_OUTPUT_TERMS if casts else 0)
    return (FWD_HIDDEN_TERMS * shape.hidden + intermediate * shape.intermediate) * act_bytes


def forward_bytes(shape: ModelShape, recipe, act_bytes: int, tokens: int, logit_positions: int) -> float:
    """A no-grad forward of `tokens` tokens (one layer live at a time), a logits chunk of
    `logit_positions`, and the dequantized weights (`recipe.model`: a PPO or an SFT recipe's)."""
    layer = tokens * forward_values_per_token(shape, act_bytes, recipe.model.fused_lora)
    logits = LOGIT_COPIES_NO_GRAD * logit_positions * shape.vocab * 4
    dequant = _dequantized_weight_bytes(shape, recipe, act_bytes)
    return layer + logits + dequant


def update_bytes(shape: ModelShape, recipe: Recipe, act_bytes: int, rows: int, device: str = "cuda") -> float:
    """One update forward and backward of `rows` sequences (twice over with
    ppo.update_roles_together and a critic) and one logits chunk of the policy's."""
    copies = 2 if recipe.ppo.update_roles_together and recipe.uses_critic else 1
    tokens = rows * copies * recipe.sequence_tokens
    passes = [_lora_params(shape, recipe.adapters.policy)]
    if recipe.uses_critic:
        passes.append(_lora_params(shape, recipe.adapters.value))
    in_pass = sum(passes) if copies == 2 else max(passes)
    cast = 0.0 if recipe.ppo.compile_update else adapter_copies_bytes(recipe.model, act_bytes, in_pass)
    # ppo.packing: packed rows hold no more tokens than `rows` at full width, but each role's hidden states
    # that predict the response tokens are gathered into a tensor of their own, held through the backward.
    gathered = copies * rows * recipe.rollout.response_tokens * shape.hidden * act_bytes if recipe.ppo.packing else 0
    return cast + gathered + backward_bytes(shape, recipe, act_bytes, tokens,
                                 min(DEFAULT_CHUNK_TOKENS, rows * recipe.rollout.response_tokens), device)


def adapter_copies_bytes(model: ModelConfig, act_bytes: int, params_in_pass: int) -> float:
    """`model.fused_lora` computing in 16 bits: the adapters of a pass cast once to the compute dtype
    (`fused_lora.adapters_cast_once`), held with their gradients in it through the pass's forward and
    backward."""
    if not model.fused_lora or act_bytes >= ADAPTER_WEIGHT_BYTES:
        return 0.0
    return 2 * act_bytes * params_in_pass


def backward_bytes(shape: ModelShape, recipe, act_bytes: int, tokens: int, logit_positions: int,
                   device: str = "cuda") -> float:
    """A forward and backward of `tokens` tokens, a checkpointed logits chunk of `logit_positions`,
    the dequantized weights and, on CPU, the heap backward keeps (`recipe.model`: a PPO or an SFT
    recipe's)."""
    per_layer = tokens * (
        ACT_HIDDEN_TERMS * shape.hidden + ACT_INTERMEDIATE_TERMS * shape.intermediate + ACT_KV_TERMS * shape.kv_width
    ) * act_bytes
    if recipe.model.fused_lora and act_bytes < ADAPTER_WEIGHT_BYTES:
        per_layer *= FUSED_LORA_LAYER_FACTOR
    if recipe.model.checkpointing_on:
        # Layer inputs stay; one layer's activations are rebuilt at a time during backward.
        acts = shape.layers * tokens * shape.hidden * act_bytes + BACKWARD_FACTOR * per_layer
    else:
        acts = BACKWARD_FACTOR * shape.layers * per_layer
    logits = LOGIT_COPIES_GRAD * logit_positions * shape.vocab * 4
    dequant = _dequantized_weight_bytes(shape, recipe, act_bytes)
    # The CPU allocator keeps the weights dequantized per pass during backward; with one
    # dequantized copy per step there are none.
    per_pass = recipe.model.dequantize_per_step is not True
    slack = CPU_BACKWARD_SLACK[recipe.model.quantization] * shape.linear_params * 4 if device == "cpu" and per_pass else 0.0
    return acts + logits + dequant + slack


def estimate(
    shape: ModelShape,
    recipe: Recipe,
    device: str = "cuda",
    budget_gb: Optional[float] = None,
    classifier_shapes: Optional[list[ModelShape]] = None,
    processes: int = 1,
    propose_levers: bool = True,
) -> Estimate:
    """Peak bytes per phase for `recipe` on a model of `shape`, on "cuda" or "cpu" (with the shapes
    of the recipe's classifier reward models, in the order of its sources), per process of a
    data-parallel run of `processes`: each holds the whole model and a share of the rows. Sizes
    the recipe leaves `auto` are chosen for the budget first (without one: their leanest). When
    no batch fits the budget, `propose_levers` looks for the memory levers that make it fit."""
    recipe, choices = choose_auto_sizes(shape, recipe, device, budget_gb, processes, classifier_shapes)
    act = _dtype_bytes(recipe, device)
    recipe = _dequantize_resolved(shape, recipe, act, budget_gb)
    weight_parts = _weight_parts(shape, recipe.model, act, device)
    components = _resident(shape, recipe, act, device, classifier_shapes)
    static = sum(components.values())
    grads = _adapter_params(shape, recipe)[0] * ADAPTER_GRAD_BYTES
    ro = recipe.rollout
    rows = ro.batch_size // processes  # a process generates and scores its share of the batch
    held = static_kv_cache_bytes(shape, recipe, act, rows, device)
    phases = {
        "generate": static + generate_bytes(shape, recipe, act, rows, device),
        "score": static + held + score_bytes(shape, recipe, act, min(ro.forward_batch_size, rows)),
        "update": static + held + grads + update_bytes(
            shape, recipe, act, update_rows(recipe.minibatch_size, recipe.micro_batch_size, processes), device),
    }
    host = _host_parts(shape, recipe, act, device)
    staged = "embeddings" in host and \
        phases["generate"] + host["embeddings"] <= max(phases["score"], phases["update"])
    if staged:
        phases["generate"] += host["embeddings"]
    fitting: dict[str, int] = {}
    if budget_gb is not None:
        fitting = largest_fitting_sizes(shape, recipe, act, device, budget_gb * GB - static, grads, processes)
    levers = {}
    if budget_gb is not None and not fitting and propose_levers:
        levers = levers_that_fit(shape, recipe, device, budget_gb, classifier_shapes, processes)
    return Estimate(shape, components, phases, budget_gb, fitting, bool(recipe.model.dequantize_per_step), processes,
                    weight_parts, held, tuple(choices), host, levers, staged)


def _resident(shape: ModelShape, recipe: Recipe, act: int, device: str,
              classifier_shapes: Optional[list[ModelShape]]) -> dict[str, float]:
    """What stays in memory through every phase, by component (`dequantize_per_step` decided)."""
    trainable, frozen = _adapter_params(shape, recipe)
    return {
        "weights": _weight_bytes(shape, recipe.model, act, device),
        "adapters": (trainable + frozen) * ADAPTER_WEIGHT_BYTES,
        "optimizer": _optimizer_bytes(shape, recipe, device),
        "reward_model": _reward_bytes(recipe, classifier_shapes or [], device),
        "runtime": RUNTIME_BYTES[device],
    }


def rows_text(n: int) -> str:
    return f"{n} row{'s' if n != 1 else ''}"


@dataclass(frozen=True)
class AutoChoice:
    """A size the recipe left `auto`: the value the memory plan chose and why, in a clause."""

    field: str
    value: Any
    reason: str

    def __str__(self) -> str:
        value = str(self.value).lower() if isinstance(self.value, bool) else self.value
        return f"{self.field}={value} ({self.reason})"


def choose_auto_sizes(
    shape: ModelShape, recipe: Recipe, device: str, budget_gb: Optional[float], processes: int = 1,
    classifier_shapes: Optional[list[ModelShape]] = None,
) -> tuple[Recipe, list[AutoChoice]]:
    """The recipe with its `auto` sizes chosen for `budget_gb` (GB for the whole process), and
    each choice with its reason (`_choose_sizes`); model.offload_embeddings: in CPU memory where
    the plan fits only so, or runs the update in fewer micro-batches or without recomputing (a
    GPU's update is bound by the host below ~8 rows a micro-batch: bench/README.md), else on the
    device (a lookup on the CPU makes each decoded token wait to reach the host). Then, with
    `model.dequantize_per_step: auto`, the dequantized copy in what those sizes leave of the budget
    (`_dequantized_copy_in_leftover`)."""
    planned, choices = _sizes_and_embeddings(shape, recipe, device, budget_gb, processes, classifier_shapes)
    if not choices or recipe.model.dequantize_per_step != AUTO or recipe.model.quantization != "4bit" \
            or budget_gb is None:
        return planned, choices
    return _dequantized_copy_in_leftover(shape, planned, choices, device, budget_gb, processes, classifier_shapes)


def _dequantized_copy_in_leftover(
    shape: ModelShape, planned: Recipe, choices: list[AutoChoice], device: str, budget_gb: float, processes: int,
    classifier_shapes: Optional[list[ModelShape]],
) -> tuple[Recipe, list[AutoChoice]]:
    """`planned` (its sizes chosen) with model.dequantize_per_step decided for `budget_gb`: the whole
    copy where it takes at most AUTO_DEQUANTIZE_SHARE of the room beyond the weights (as a run
    decides without a plan); else the part of it that fits what the plan leaves of its share of the
    budget (model.dequantize_budget_gb: the layers that fit, in the model's order), where that holds
    at least one layer; else off. The copy saves dequantizing its layers in every pass: on a GPU a
    4-bit decode step's time (bench/README.md), with the same numbers. The sizes come first: a
    larger micro-batch is worth more to the update than the copy."""
    act = _dtype_bytes(planned, device)
    path = "model.dequantize_per_step"
    off = planned.with_values({path: False, "model.dequantize_budget_gb": None})
    whole = _dequantized_weight_bytes(shape, off.with_values({path: True}), act)
    if planned.model.dequantize_budget_gb is not None:  # the user's cap on the copy
        whole = min(whole, planned.model.dequantize_budget_gb * GB)
    if _dequantize_resolved(shape, planned, act, budget_gb).model.dequantize_per_step:
        reason = f"the {whole / GB:.2f} GB copy takes at most {AUTO_DEQUANTIZE_SHARE:.0%} of the room beyond the weights"
        return planned.with_values({path: True}), [*choices, AutoChoice(path, True, reason)]
    without = estimate(shape, off, device, budget_gb, classifier_shapes, processes, propose_levers=False)
    planned_bytes = AUTO_PLAN_SHARE * budget_gb * GB
    left = planned_bytes - without.peak
    layer = _dequantized_weight_bytes(shape, off, act)  # the largest layer's copy, made for its pass
    if left < layer:
        reason = (f"the plan ({without.peak / GB:.2f} GB) does not fit {budget_gb:.3g} GB" if not without.fits else
                  f"the plan ({without.peak / GB:.2f} GB) leaves {max(left, 0) / GB:.2f} GB of the "
                  f"{planned_bytes / GB:.3g} GB planned, less than one layer's copy ({layer / GB:.2f} GB)")
        return off, [*choices, AutoChoice(path, False, reason)]
    if left >= whole and planned.model.dequantize_budget_gb is None:
        reason = f"the whole {whole / GB:.2f} GB copy fits beside the plan ({without.peak / GB:.2f} GB)"
        return planned.with_values({path: True}), [*choices, AutoChoice(path, True, reason)]
    part_gb = math.floor(min(left, whole) / GB * 100) / 100  # rounded down: still within the plan
    return planned.with_values({path: True, "model.dequantize_budget_gb": part_gb}), [
        *choices, AutoChoice(path, True, "a part of the copy fits beside the plan: faster 4-bit layers, the same numbers"),
        AutoChoice("model.dequantize_budget_gb", part_gb,
                   f"of the whole copy's {whole / GB:.2f} GB, what the plan ({without.peak / GB:.2f} GB) leaves of the "
                   f"{planned_bytes / GB:.3g} GB planned")]


def _sizes_and_embeddings(
    shape: ModelShape, recipe: Recipe, device: str, budget_gb: Optional[float], processes: int = 1,
    classifier_shapes: Optional[list[ModelShape]] = None,
) -> tuple[Recipe, list[AutoChoice]]:
    """`choose_auto_sizes` up to the dequantized copy: the sizes and the embeddings' place."""
    if recipe.model.offload_embeddings != AUTO:
        return _choose_sizes(shape, recipe, device, budget_gb, processes, classifier_shapes)
    kept = recipe.with_values({"model.offload_embeddings": False})
    if not _lever_applies(shape, kept, device, "model.offload_embeddings", True):
        reason = "everything is in CPU memory" if device == "cpu" else "the model ties them to the LM head"
        planned, choices = _choose_sizes(shape, kept, device, budget_gb, processes, classifier_shapes)
        return planned, [AutoChoice("model.offload_embeddings", False, reason), *choices]
    plans = {place: _choose_sizes(shape, planned, device, budget_gb, processes, classifier_shapes)
             for place, planned in ((False, kept), (True, recipe.with_values({"model.offload_embeddings": True})))}
    on_device, on_cpu = plans[False][0], plans[True][0]

    def speed(planned: Recipe) -> tuple:  # the smaller the faster: fitting, fewer micro-batches, no recomputing
        fits = estimate(shape, planned, device, budget_gb, classifier_shapes, processes, propose_levers=False).fits
        return fits is False, planned.ppo.grad_accum_steps, planned.model.gradient_checkpointing

    kept_speed = speed(on_device)
    offload = speed(on_cpu) < kept_speed
    table = f"the table's {_host_parts(shape, on_cpu, _dtype_bytes(recipe, device), device)['embeddings'] / GB:.2f} GB"
    if not offload and kept_speed[0]:
        reason = f"the plan does not fit with {table} in CPU memory either"
    elif not offload:
        reason = f"{table} in CPU memory would not speed the update: {_update_text(on_device)} either way"
    elif kept_speed[0]:
        reason = f"the plan fits only with {table} in CPU memory"
    else:
        reason = f"with {table} in CPU memory the update runs {_update_text(on_cpu)}, against {_update_text(on_device)}"
    planned, choices = plans[offload]
    return planned, [AutoChoice("model.offload_embeddings", offload, reason), *choices]


def _update_text(planned: Recipe) -> str:
    return f"micro-batches of {rows_text(planned.micro_batch_size)}" + \
        ("" if planned.model.gradient_checkpointing else " without recomputing")


# How far above its budget a plan looks for a faster update, and how finely (GB).
FASTER_REACH, FASTER_STEP_GB = 1.25, 0.05


def faster_update_budget(
    shape: ModelShape, recipe: Recipe, device: str, budget_gb: float, processes: int = 1,
    classifier_shapes: Optional[list[ModelShape]] = None,
) -> Optional[tuple[float, str]]:
    """The least budget (GB, within FASTER_STEP_GB, up to FASTER_REACH times `budget_gb`) whose
    `auto` plan runs the update in larger micro-batches, or without recomputing at no smaller ones,
    and that update in a clause. None where the recipe leaves neither `auto`, or the plan's next
    change within reach is not plainly faster (fewer rows without recomputing). Near a plan's edge
    tens of MB double a micro-batch: a user who can free them should know."""
    if not {"ppo.grad_accum_steps", "model.gradient_checkpointing"} & set(recipe.auto_sizes):
        return None

    def plan(gb: float) -> Recipe:  # the sizes alone: the dequantized copy after them moves no micro-batch
        return _sizes_and_embeddings(shape, recipe, device, gb, processes, classifier_shapes)[0]

    def update(planned: Recipe) -> tuple[int, bool]:
        return planned.micro_batch_size, planned.model.gradient_checkpointing

    # As the budget grows the micro-batch grows, and checkpointing, once off, stays off: the first
    # budget whose plan differs is found by halving.
    now, low, high = update(plan(budget_gb)), budget_gb, budget_gb * FASTER_REACH
    if update(plan(high)) == now:
        return None
    while high - low > FASTER_STEP_GB:
        middle = (low + high) / 2
        low, high = (middle, high) if update(plan(middle)) == now else (low, middle)
    faster_plan = plan(high)
    (micro, checkpointing), (micro_now, checkpointing_now) = update(faster_plan), now
    faster = micro > micro_now if checkpointing == checkpointing_now else checkpointing_now and micro >= micro_now
    # Rounded up: still the faster plan.
    return (math.ceil(high * 100) / 100, _update_text(faster_plan)) if faster else None


def _choose_sizes(
    shape: ModelShape, recipe: Recipe, device: str, budget_gb: Optional[float], processes: int = 1,
    classifier_shapes: Optional[list[ModelShape]] = None,
) -> tuple[Recipe, list[AutoChoice]]:
    """The recipe with its `auto` sizes but the embeddings' place chosen for `budget_gb` (GB for the
    whole process), and each choice with its reason. ppo.grad_accum_steps: the fewest (the
    largest micro-batch) whose update fits; model.gradient_checkpointing: off when the update
    fits without it at that same micro-batch (recomputing costs a forward, a smaller micro-batch
    more passes over the weights); rollout.forward_batch_size: the most rows, up to a process's
    share of the batch, whose scoring fits. Without a budget, or when even the leanest does not
    fit: the leanest (micro-batches of one row, checkpointing on, one row per scoring forward).
    The plan fills AUTO_PLAN_SHARE of the budget."""
    autos = recipe.auto_sizes
    if not autos:
        return recipe, []
    act = _dtype_bytes(recipe, device)
    planned = _dequantize_resolved(shape, recipe, act, budget_gb)
    rows = recipe.rollout.batch_size // processes
    held = static_kv_cache_bytes(shape, planned, act, rows, device)
    resident = sum(_resident(shape, planned, act, device, classifier_shapes).values()) + held
    room = None if budget_gb is None else AUTO_PLAN_SHARE * budget_gb * GB - resident
    grads = _adapter_params(shape, planned)[0] * ADAPTER_GRAD_BYTES
    per_minibatch = recipe.minibatch_size
    accum = recipe.ppo.grad_accum_steps
    micros = [per_minibatch // d for d in range(1, per_minibatch + 1) if per_minibatch % d == 0] if accum == AUTO \
        else [per_minibatch // accum]  # largest first

    def update_peak(micro: int, checkpointing: bool) -> float:
        planned_ckpt = planned.model_copy(update={"model": planned.model.model_copy(
            update={"gradient_checkpointing": checkpointing})})
        return grads + update_bytes(shape, planned_ckpt, act, update_rows(per_minibatch, micro, processes), device)

    def largest_micro(checkpointing: bool) -> int:
        return next((m for m in micros if room is not None and update_peak(m, checkpointing) <= room), 0)

    budget = "no budget given" if budget_gb is None else f"{budget_gb:.3g} GB"
    planned_text = budget if budget_gb is None else f"the {AUTO_PLAN_SHARE * budget_gb:.3g} GB planned of {budget}"

    values: dict[str, Any] = {}
    choices: list[AutoChoice] = []
    checkpointing = recipe.model.gradient_checkpointing
    if checkpointing == AUTO:
        with_it, without = largest_micro(True), largest_micro(False)
        enough = without * recipe.sequence_tokens >= AUTO_MIN_FORWARD_TOKENS[device]
        checkpointing = not (without and (without >= with_it or enough))
        if not (with_it or without):
            reason = f"{budget}: the leanest" if room is None else f"no micro-batch fits {planned_text}: the leanest"
        elif not checkpointing:
            reason = ("the update fits without it at the same micro-batch" if without >= with_it else
                      f"without it micro-batches of {rows_text(without)} ({without * recipe.sequence_tokens} tokens a "
                      "forward) fit: no recomputing")
        else:
            reason = (f"without it the largest micro-batch that fits {budget} is {rows_text(without)}, with it {with_it}"
                      if without else f"without it no micro-batch fits {budget}; with it {rows_text(with_it)}")
        values["model.gradient_checkpointing"] = checkpointing
        choices.append(AutoChoice("model.gradient_checkpointing", checkpointing, reason))
    if accum == AUTO:
        micro = largest_micro(checkpointing)
        if micro:
            accum, reason = per_minibatch // micro, (f"micro-batches of {rows_text(micro)}, the largest whose update fits "
                                                     f"{budget} ({(resident + update_peak(micro, checkpointing)) / GB:.2f} GB)")
        else:
            accum = per_minibatch
            reason = (f"{budget}: the leanest, micro-batches of 1 row" if room is None else
                      f"even micro-batches of 1 row need {(resident + update_peak(1, checkpointing)) / GB:.2f} GB, "
                      f"more than {planned_text}: the leanest")
        values["ppo.grad_accum_steps"] = accum
        choices.append(AutoChoice("ppo.grad_accum_steps", accum, reason))
    if recipe.rollout.forward_batch_size == AUTO:
        scoring = max((n for n in range(rows, 0, -1)
                       if room is not None and score_bytes(shape, planned, act, n) <= room), default=0)
        if scoring:
            reason = ("the whole batch's scoring fits" if scoring == rows else "the most rows whose scoring fits") + \
                f" {budget} ({(resident + score_bytes(shape, planned, act, scoring)) / GB:.2f} GB)"
        else:
            reason = f"{budget}: the leanest" if room is None else \
                f"even one row's scoring does not fit {planned_text}: the leanest"
        values["rollout.forward_batch_size"] = scoring or 1
        choices.append(AutoChoice("rollout.forward_batch_size", scoring or 1, reason))
    return recipe.with_values(values), choices


# The memory levers `estimate` may propose, each a recipe override, cheapest first: the same numbers
# a little slower (embeddings looked up on the CPU; AdamW stepped on the CPU), then other numbers
# (8-bit AdamW moments), slower generation (no static KV cache), a quantized LM head, and last
# smaller adapters. Options of one field exclude each other.
LEVERS: tuple[tuple[str, Any], ...] = (
    ("model.offload_embeddings", True), ("ppo.optimizer_state", "cpu"), ("ppo.optimizer_state", "8bit"),
    ("rollout.compile", False), ("model.quantize_lm_head", True), ("adapters.value.r", 8),
)


def levers_that_fit(shape: ModelShape, recipe: Recipe, device: str, budget_gb: float,
                    classifier_shapes: Optional[list[ModelShape]] = None, processes: int = 1) -> dict[str, Any]:
    """The fewest memory levers (LEVERS, the cheapest of equally many) with which the recipe's own
    batch fits `budget_gb`, its `auto` sizes chosen again; else with which some batch fits; {}
    when none do. Levers that change nothing for this recipe and model are not tried."""
    import itertools

    usable = [(path, value) for path, value in LEVERS if _lever_applies(shape, recipe, device, path, value)]
    combos = sorted((c for n in range(1, len(usable) + 1) for c in itertools.combinations(range(len(usable)), n)
                     if len({usable[i][0] for i in c}) == n), key=lambda c: (len(c), sum(c)))
    fallback: dict[str, Any] = {}
    for combo in combos:
        values = dict(usable[i] for i in combo)
        try:
            e = estimate(shape, recipe.with_values(values), device, budget_gb, classifier_shapes, processes,
                         propose_levers=False)
        except ValueError:  # an invalid combination (the recipe refuses it)
            continue
        if e.fits:
            return values
        if e.fitting and not fallback:
            fallback = values
    return fallback


def _lever_applies(shape: ModelShape, recipe: Recipe, device: str, path: str, value: Any) -> bool:
    """Whether a lever would change this recipe's memory on this model and device."""
    if device == "cpu" and path in ("model.offload_embeddings", "ppo.optimizer_state"):
        return False  # everything is in CPU memory already
    if path in ("model.offload_embeddings", "model.quantize_lm_head") and shape.tied_embeddings:
        return False  # refused for tied embeddings
    if path == "model.quantize_lm_head" and recipe.model.quantization == "none":
        return False
    if path == "rollout.compile" and not recipe.rollout.compiles_on(device, recipe.decode_steps):
        return False
    if path == "adapters.value.r" and (not recipe.uses_critic or recipe.adapters.value.r <= value):
        return False
    return field_value(recipe, path) != value


def estimate_sft(shape: ModelShape, recipe: SFTRecipe, device: str = "cuda", budget_gb: Optional[float] = None) -> Estimate:
    """Peak bytes of a `train-sft` run on a model of `shape`: the weights, the adapter and its AdamW
    state; then a training micro-batch's forward and backward (`update`), a held-out batch's
    forward (`evaluate`) and the greedy held-out answers (`sample`), every row counted at
    data.max_length tokens (packed rows fill sequences no longer than their sum). Only target
    positions reach the LM head, a chunk at a time."""
    act = _dtype_bytes(recipe, device)
    recipe = _dequantize_resolved(shape, recipe, act, budget_gb)
    ad = recipe.adapter
    trainable = shape.lora_params(ad.r, ad.target_modules, ad.target_parameters)
    weight_parts = _weight_parts(shape, recipe.model, act, device)
    components = {
        "weights": sum(weight_parts.values()),
        "adapters": trainable * ADAPTER_WEIGHT_BYTES,
        "optimizer": trainable * ADAM_BYTES,
        "runtime": RUNTIME_BYTES[device],
    }
    static = sum(components.values())
    micro = recipe.train.batch_size // recipe.train.grad_accum_steps
    length = recipe.data.max_length
    phases = {
        "update": static + trainable * ADAPTER_GRAD_BYTES + adapter_copies_bytes(recipe.model, act, trainable)
        + backward_bytes(shape, recipe, act, micro * length, min(DEFAULT_CHUNK_TOKENS, micro * length), device),
        "evaluate": static + forward_bytes(shape, recipe, act, recipe.data.eval_batch_size * length,
                                           min(DEFAULT_CHUNK_TOKENS, recipe.data.eval_batch_size * length)),
    }
    rows = min(recipe.data.eval_batch_size, recipe.data.eval_samples)
    if rows:  # the held-out answers sampled greedily: a KV cache for prompt and answer, then each step's logits
        kv = kv_cache_bytes(shape, act, rows, length + recipe.data.eval_max_new_tokens)
        phases["sample"] = static + kv + GEN_LOGIT_COPIES * rows * shape.vocab * 4 + forward_bytes(
            shape, recipe, act, rows * length, 0)
    return Estimate(shape, components, phases, budget_gb, {}, bool(recipe.model.dequantize_per_step), 1, weight_parts)


def format_sft_estimate(est: Estimate, recipe: SFTRecipe, device: str) -> str:
    """The SFT estimate as lines: model, recipe sizes, resident parts, peak per phase, verdict."""
    s = est.shape
    micro = recipe.train.batch_size // recipe.train.grad_accum_steps
    lines = [
        f"model: {recipe.model.name}  ({s.total_params / 1e9:.2f}B parameters: {s.layers} layers, hidden {s.hidden}, "
        f"vocab {s.vocab}), quantization {recipe.model.quantization}, on {device}",
        f"recipe (train-sft): micro-batch {micro} rows of up to {recipe.data.max_length} tokens"
        f"{' (packed)' if recipe.sft.packing else ''}, held-out batch {recipe.data.eval_batch_size}, gradient "
        f"checkpointing {'on' if recipe.model.checkpointing_on else 'off'}, dequantize per step "
        f"{'on' if est.dequantize_per_step else 'off'}",
        "",
        "always resident:",
    ]
    for name, value in est.components.items():
        lines.append(f"  {name:<14}{value / GB:8.2f} GB")
        if name == "weights":
            lines += _weight_lines(est, recipe, device)
    lines.append("peak per phase:")
    lines += [f"  {name:<14}{value / GB:8.2f} GB" for name, value in est.phases.items()]
    lines.append(f"peak: {est.peak / GB:.2f} GB")
    if est.budget_gb is not None:
        lines.append(f"{'fits' if est.fits else 'does NOT fit'} in {est.budget_gb:g} GB")
    return "\n".join(lines)


def update_rows(minibatch: int, micro_batch: int, processes: int) -> int:
    """Rows a process puts through one forward and backward of the update: its share of the
    minibatch, in micro-batches of at most the recipe's micro-batch size."""
    return min(micro_batch, minibatch // processes)


def _dequantize_resolved(shape: ModelShape, recipe: Recipe, act_bytes: int, budget_gb: Optional[float]) -> Recipe:
    """The recipe with `model.dequantize_per_step: auto` decided as a run decides it: on when the
    dequantized copy takes at most AUTO_DEQUANTIZE_SHARE of the budget beyond the weights; off
    without a budget (the lean plan)."""
    setting = recipe.model.dequantize_per_step
    if setting == "auto":
        room = None if budget_gb is None else budget_gb * GB - _weight_bytes(shape, recipe.model, act_bytes)
        copy_bytes = shape.linear_params * act_bytes
        if recipe.model.dequantize_budget_gb is not None:
            copy_bytes = min(copy_bytes, recipe.model.dequantize_budget_gb * GB)
        setting = recipe.model.quantization == "4bit" and room is not None and copy_bytes <= AUTO_DEQUANTIZE_SHARE * room
    return recipe.model_copy(update={"model": recipe.model.model_copy(update={"dequantize_per_step": setting})})


MAX_BATCH = 4096  # the search for sizes that fit stops here
# `auto` sizes plan for this share of the budget: the allocator's reserved memory runs ~6% above
# what tensors hold, and the estimate is within a few percent of measured peaks (bench/README.md).
AUTO_PLAN_SHARE = 0.9
# Gradient checkpointing `auto` is off when, without it, the update still fits with forwards of at
# least this many tokens (or the micro-batch it has with checkpointing): recomputing costs a third
# of the update's work. A GPU's update waits on the host below ~4,000 tokens a forward: on an H100
# and an H200 (2026-11-26/27, bench/README.md) micro-batches of 4 x 512 tokens took 1.7-2.4x the
# time of 8 x 512 for the same work, and 2 x 512 twice that of 4, far more than recomputing costs.
# On CPU the per-micro-batch overhead is small against the compute (not measured on the device).
AUTO_MIN_FORWARD_TOKENS = {"cuda": 4096, "cpu": 1024}


def largest_fitting_sizes(
    shape: ModelShape, recipe: Recipe, act: int, device: str, room: float, grads: float, processes: int = 1
) -> dict[str, int]:
    """The largest rollout.batch_size whose generation fits `room` (bytes beyond the resident
    ones) and whose update fits with some valid ppo.grad_accum_steps, the fewest such steps, and
    the largest rollout.forward_batch_size (at most the batch) whose scoring fits. Every value
    respects the recipe's divisibility rules, so the three together validate; {} if none fit."""
    def largest(fits) -> int:  # each phase's cost grows with its row count: halving finds the last that fits
        low, high = 0, MAX_BATCH
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        return low

    by_held: dict[float, tuple[int, int]] = {}  # the largest micro-batch and scoring rows, by the KV cache held

    def largest_rows(held: float) -> tuple[int, int]:
        if held not in by_held:
            by_held[held] = (largest(lambda n: held + grads + update_bytes(shape, recipe, act, n, device) <= room),
                             largest(lambda n: held + score_bytes(shape, recipe, act, n) <= room))
        return by_held[held]

    if 0 in largest_rows(0.0):
        return {}
    minibatches = recipe.ppo.num_minibatches
    # Batches in steps that keep the recipe's own accumulation valid (micro-batches stay whole) and
    # split over the processes (whole groups of samples, equal shares of each minibatch).
    step = math.lcm(recipe.rollout.samples_per_prompt * processes, minibatches * recipe.ppo.grad_accum_steps,
                    minibatches * processes)
    for batch in range(MAX_BATCH - MAX_BATCH % step, 0, -step):
        if generate_bytes(shape, recipe, act, batch // processes, device) > room:
            continue
        max_micro, max_rows = largest_rows(static_kv_cache_bytes(shape, recipe, act, batch // processes, device))
        if max_micro == 0 or max_rows == 0:
            continue
        per_minibatch = batch // minibatches
        # The fewest micro-batches per minibatch whose size divides it and fits the update.
        steps = next(d for d in range(1, per_minibatch + 1)
                     if per_minibatch % d == 0 and update_rows(per_minibatch, per_minibatch // d, processes) <= max_micro)
        return {"rollout.batch_size": batch, "ppo.grad_accum_steps": steps,
                "rollout.forward_batch_size": min(max_rows, batch // processes)}
    return {}

def estimate_recipe(recipe: Recipe, device: str = "cuda", budget_gb: Optional[float] = None,
                    processes: int = 1) -> Estimate:
    shape, classifiers = recipe_shapes(recipe)
    est = estimate(shape, recipe, device, budget_gb, classifiers, processes)
    if budget_gb is None:
        return est
    return replace(est, faster_update=faster_update_budget(shape, recipe, device, budget_gb, processes, classifiers))


def recipe_shapes(recipe: Recipe) -> tuple[ModelShape, list[ModelShape]]:
    """The policy model's shape and its classifier reward models', from their configs alone."""
    shape = load_shape(recipe.model.name, recipe.model.trust_remote_code)
    classifiers = [classifier_shape(s.model, recipe.model.trust_remote_code)
                   for s in recipe.reward.source_list() if s.kind == "classifier"]
    return shape, classifiers


# How the printed answer names the parts of the weights bitsandbytes leaves at the compute dtype.
PART_LABELS = {
    "moe_experts": "MoE experts", "unconverted_linears": "linear layers", "embeddings": "embeddings",
    "lm_head": "LM head", "positions": "position embeddings", "routers": "MoE routers", "norms": "norms",
    "biases": "biases",
}


def _weight_lines(est: Estimate, recipe: Recipe, device: str) -> list[str]:
    """What the weights hold: the linear layers at their quantization's cost, then what stays at
    the compute dtype, largest first, with why where it is not what a 4-bit model suggests."""
    s, q = est.shape, recipe.model.quantization
    dtype = recipe.model.compute_dtype_name(device)
    kind = {"4bit": "4-bit", "8bit": "8-bit"}.get(q, dtype)
    quantized = {"linear_layers", "lm_head"} if recipe.model.quantize_lm_head and q != "none" else {"linear_layers"}
    parts = sorted(((k, v) for k, v in est.weight_parts.items() if k not in quantized), key=lambda kv: -kv[1])
    head = f", LM head {est.weight_parts['lm_head'] / GB:.2f} GB" if "lm_head" in quantized & set(est.weight_parts) else ""
    lines = [f"    {kind} linear layers {est.weight_parts['linear_layers'] / GB:.2f} GB "
             f"({s.linear_params / 1e9:.2f}B parameters){head}",
             f"    {'unquantized' if q != 'none' else 'other weights'} ({dtype}): "
             + ", ".join(f"{PART_LABELS[k]} {v / GB:.2f} GB" for k, v in parts)]
    if q != "none" and "moe_experts" in est.weight_parts:
        lines.append(f"    (bitsandbytes leaves fused MoE expert weights at {dtype}: transformers stores them as "
                     "3-D parameters, and bitsandbytes quantizes only Linear layers)")
    if q != "none" and not s.converted:
        lines.append(f"    (bitsandbytes converts only exact nn.Linear layers, and {s.model_type}'s are a subclass: "
                     f"they stay at {dtype})")
    return lines


def format_estimate(est: Estimate, recipe: Recipe, device: str) -> str:
    s, n = est.shape, est.processes
    recipe = recipe.with_values({choice.field: choice.value for choice in est.auto_choices})
    rows = recipe.rollout.batch_size // n
    moe = f"; MoE: {s.experts} experts, {s.experts_per_token} per token" if s.experts else ""
    lines = [
        f"model: {recipe.model.name}  ({s.total_params / 1e9:.2f}B parameters: {s.layers} layers, hidden {s.hidden}, "
        f"vocab {s.vocab}{moe}), quantization {recipe.model.quantization}, on {device}",
        *([f"per process of {n} (each holds the model; the rows are its share of the batch)"] if n > 1 else []),
        *([f"approximate: model type {s.model_type!r} is not in the estimate's table; counted as a Llama-shaped "
           "decoder"] if s.approximate else []),
        f"recipe: batch {rows}, prompt <= {recipe.data.max_prompt_tokens} + "
        f"{recipe.rollout.response_tokens} {'episode' if recipe.rollout.episodic else 'new'} tokens, scoring rows {min(recipe.rollout.forward_batch_size, rows)}, "
        f"update micro-batch {update_rows(recipe.minibatch_size, recipe.micro_batch_size, n)}, gradient checkpointing "
        f"{'on' if recipe.model.checkpointing_on else 'off'}, dequantize per step "
        f"{'on' if est.dequantize_per_step else 'off'}",
        *([f"auto sizes for {est.budget_gb:g} GB:" if est.budget_gb is not None else
           "auto sizes (no --gpu-gb: shown at their leanest; a run chooses them for the device's free memory):"]
          + [f"  {choice}" for choice in est.auto_choices] if est.auto_choices else []),
        *([f"  (from {est.faster_update[0]:g} GB the update would run {est.faster_update[1]})"]
          if est.faster_update else []),
        "",
        "always resident:",
    ]
    for name, value in est.components.items():
        lines.append(f"  {name:<14}{value / GB:8.2f} GB")
        if name == "weights" and est.weight_parts:
            lines += _weight_lines(est, recipe, device)
    lines.append("peak per phase:")
    for name in PHASES:
        lines.append(f"  {name:<14}{est.phases[name] / GB:8.2f} GB")
    if est.static_kv_cache:
        lines.append(f"  (rollout.compile: the static KV cache, {est.static_kv_cache / GB:.2f} GB, is held in every phase)")
    if est.host:
        lines.append("in CPU memory instead (the memory levers): "
                     + ", ".join(f"{name} {value / GB:.2f} GB" for name, value in est.host.items()))
    if est.embeddings_staged:
        lines.append(f"  (generation looks tokens up in a copy of the embeddings on the GPU, "
                     f"{est.host['embeddings'] / GB:.2f} GB, counted in its phase: it stays under the others)")
    lines.append(f"peak: {est.peak / GB:.2f} GB")
    if est.budget_gb is not None:
        verdict = "fits" if est.fits else "does NOT fit"
        lines.append(f"{verdict} in {est.budget_gb:g} GB")
        if est.fitting:
            lines.append(f"largest sizes that fit together in all {est.budget_gb:g} GB (others as in the recipe; "
                         f"`auto` plans for {AUTO_PLAN_SHARE:.0%} of it): "
                         + " ".join(f"{k}={v}" for k, v in est.fitting.items()))
        elif sum(est.components.values()) > est.budget_gb * GB:
            experts = est.weight_parts.get("moe_experts", 0.0)
            lines.append("no batch size fits: what stays resident alone is larger than the budget"
                         + (f" (the unquantized MoE experts alone take {experts / GB:.2f} GB)" if experts else ""))
        else:
            lines.append("no batch size fits: even one response per phase needs more than the budget")
        if est.levers:
            lines.append(f"to fit {est.budget_gb:g} GB: " + " ".join(
                f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in est.levers.items())
                + " (docs/memory.md: what each costs)")
    return "\n".join(lines)


def as_json(est: Estimate) -> dict:
    return {
        "params": est.shape.total_params,
        "model_type": est.shape.model_type,
        "approximate": est.shape.approximate,
        # What bitsandbytes quantizes, and what it leaves at the compute dtype, by part.
        "quantized_params": est.shape.linear_params,
        "unquantized_params": est.shape.unquantized_parts(),
        "weights_gb": {k: round(v / GB, 3) for k, v in est.weight_parts.items()},
        "components_gb": {k: round(v / GB, 3) for k, v in est.components.items()},
        "phases_gb": {k: round(v / GB, 3) for k, v in est.phases.items()},
        "static_kv_cache_gb": round(est.static_kv_cache / GB, 3),
        "peak_gb": round(est.peak / GB, 3),
        "budget_gb": est.budget_gb,
        "fits": est.fits,
        "fitting": est.fitting,
        "dequantize_per_step": est.dequantize_per_step,
        "auto": {c.field: c.value for c in est.auto_choices},
        "host_gb": {k: round(v / GB, 3) for k, v in est.host.items()},
        "embeddings_staged": est.embeddings_staged,
        "faster_update_from_gb": est.faster_update[0] if est.faster_update else None,
        "levers": est.levers,
        "processes": est.processes,
    }


__all__ = ["Estimate", "estimate", "estimate_recipe", "format_estimate", "as_json", "estimate_sft",
           "format_sft_estimate"]
