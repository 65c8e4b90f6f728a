"""Predict peak memory per phase of a recipe from the model's config alone (no weights loaded).

The model is a decoder-only transformer (Llama/Qwen/Mistral shapes: attention with grouped
KV heads, a gated MLP). Every term is counted in bytes:

  static   = quantized linear weights + unquantized parts (embeddings, LM head, norms)
             + adapters (policy, value, frozen reference) + AdamW state + value head
             + reward model + a fixed runtime cost (CUDA context, or the Python process on CPU)
  generate = static + KV cache + per-step logits + one dequantized weight + prefill activations
  score    = static + one micro-batch forward (one layer live at a time) + a logits chunk
  update   = static + adapter gradients + activations kept for backward (all layers, or only
             layer inputs under gradient checkpointing) + a checkpointed logits chunk

The activation constants were fitted to peaks measured by bench/memory_scaling.py; bench/README.md
has the measurements and how far the estimate is from them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from lora_ppo.config import AUTO_DEQUANTIZE_SHARE, BUILTIN_PREFIX, LoraSettings, ModelConfig, Recipe
from lora_ppo.errors import RecipeError, first_line
from lora_ppo.logprobs import DEFAULT_CHUNK_TOKENS

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
# fp32 [positions, vocab] tensors alive at once in a logits chunk: logits, softmax, log-softmax
# (and their gradient under autograd).
LOGIT_COPIES_NO_GRAD = 3
LOGIT_COPIES_GRAD = 5
# Generation keeps the step's logits, the processed scores and the sampling probabilities.
GEN_LOGIT_COPIES = 3


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs from a causal LM's config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size") if getattr(text, k, None) is None]
        if missing:
            raise RecipeError(
                f"model.name: config of type {type(text).__name__} lacks {', '.join(missing)}; "
                "the estimate knows decoder-only transformers (Llama, Qwen, Mistral shapes)"
            )
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(
            hidden=text.hidden_size,
            intermediate=text.intermediate_size,
            layers=text.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab=text.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder layer."""
        h, q, kv, i = self.hidden, self.q_width, self.kv_width, self.intermediate
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }

    @property
    def linear_params(self) -> int:
        """Parameters in the decoder layers' linear layers (what bitsandbytes quantizes)."""
        return self.layers * sum(a * b for a, b in self.linear_shapes().values())

    @property
    def unquantized_params(self) -> int:
        """Embeddings, the LM head when untied, and the RMSNorm weights."""
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied_embeddings else 2) + (2 * self.layers + 1) * self.hidden

    @property
    def total_params(self) -> int:
        return self.linear_params + self.unquantized_params

    def lora_params(self, r: int, target_modules) -> int:
        shapes = self.linear_shapes()
        names = shapes if target_modules == "all-linear" else [m for m in target_modules if m in shapes]
        return self.layers * sum(r * (shapes[n][0] + shapes[n][1]) for n in names)


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

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    @property
    def fits(self) -> Optional[bool]:
        return None if self.budget_gb is None else self.peak <= self.budget_gb * GB


def _dtype_bytes(recipe: Recipe, device: str) -> int:
    return 4 if recipe.model.compute_dtype_name(device) == "float32" else 2


def _weight_bytes(shape: ModelShape, model: ModelConfig, act_bytes: int) -> float:
    q = model.quantization
    if q == "4bit":
        linear = shape.linear_params * FOUR_BIT_BYTES[model.double_quant]
    elif q == "8bit":
        linear = shape.linear_params * EIGHT_BIT_BYTES
    else:
        linear = shape.linear_params * act_bytes
    return linear + shape.unquantized_params * act_bytes


def _adapter_params(shape: ModelShape, recipe: Recipe) -> tuple[int, int]:
    """(trainable, frozen) LoRA parameter counts."""
    ad = recipe.adapters
    trainable = shape.lora_params(ad.policy.r, ad.policy.target_modules)
    if recipe.uses_critic:
        trainable += shape.lora_params(ad.value.r, ad.value.target_modules) + shape.hidden + 1
    frozen = shape.lora_params(ad.policy.r, ad.policy.target_modules) if ad.reference_adapter_path else 0
    if recipe.reward.adapter_path:  # a frozen reward adapter and its head on the same backbone
        r, targets = _saved_lora_settings(recipe.reward.adapter_path, ad.policy)
        frozen += shape.lora_params(r, targets) + shape.hidden + 1
    return trainable, frozen


def _saved_lora_settings(folder: str, fallback: LoraSettings) -> tuple[int, Any]:
    """(r, target modules) of a saved PEFT adapter; the fallback's when the folder is not here."""
    path = Path(folder) / "adapter_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        targets = config["target_modules"]
        return int(config["r"]), "all-linear" if targets == "all-linear" else list(targets)
    except (OSError, ValueError, KeyError, TypeError):
        return fallback.r, fallback.target_modules


def _reward_bytes(recipe: Recipe, classifier_shapes: list[ModelShape], device: str) -> float:
    """The weights of the classifier reward models, each in its own quantization and dtype
    (the policy's unless its source says otherwise); other sources need next to nothing."""
    classifiers = [s for s in recipe.reward.source_list() if s.kind == "classifier"]
    total = 0.0
    for source, shape in zip(classifiers, classifier_shapes):
        model = recipe.model.model_copy(update={"quantization": source.quantization or recipe.model.quantization,
                                                "compute_dtype": source.dtype or recipe.model.compute_dtype})
        total += _weight_bytes(shape, model, 4 if model.compute_dtype_name(device) == "float32" else 2)
    return total


def _dequantized_weight_bytes(shape: ModelShape, recipe: Recipe, act_bytes: int) -> float:
    """A quantized layer's weight is dequantized to the compute dtype for each matmul; with
    `model.dequantize_per_step` every linear layer is held dequantized through the step."""
    if recipe.model.quantization == "none":
        return 0.0
    if recipe.model.dequantize_per_step is True:  # `auto` is decided by `estimate` before this
        return shape.linear_params * act_bytes
    return max(a * b for a, b in shape.linear_shapes().values()) * act_bytes


def _seq_len(recipe: Recipe) -> int:
    return recipe.data.max_prompt_tokens + recipe.rollout.max_new_tokens


def generate_bytes(shape: ModelShape, recipe: Recipe, act_bytes: int, batch: int) -> float:
    """KV cache for the whole sequence, the step's vocabulary logits, one dequantized weight,
    and prefill activations of one layer."""
    tokens = batch * _seq_len(recipe)
    kv = 2 * shape.layers * shape.kv_width * tokens * act_bytes
    logits = GEN_LOGIT_COPIES * batch * shape.vocab * 4
    dequant = _dequantized_weight_bytes(shape, recipe, act_bytes)
    prefill = batch * recipe.data.max_prompt_tokens * (
        FWD_HIDDEN_TERMS * shape.hidden + FWD_INTERMEDIATE_TERMS * shape.intermediate
    ) * act_bytes
    return kv + logits + dequant + prefill


def score_bytes(shape: ModelShape, recipe: Recipe, act_bytes: int, rows: int) -> float:
    """One scoring forward of `rows` sequences (each repeated per role with
    rollout.score_roles_together) and one logits chunk."""
    if recipe.rollout.score_roles_together:
        rows *= max(1, recipe.scored_roles(float32=act_bytes == 4))
    tokens = rows * _seq_len(recipe)
    layer = tokens * (FWD_HIDDEN_TERMS * shape.hidden + FWD_INTERMEDIATE_TERMS * shape.intermediate) * act_bytes
    chunk = min(DEFAULT_CHUNK_TOKENS, rows * recipe.rollout.max_new_tokens)
    logits = LOGIT_COPIES_NO_GRAD * chunk * shape.vocab * 4
    dequant = _dequantized_weight_bytes(shape, recipe, act_bytes)
    return layer + logits + dequant


def update_bytes(shape: ModelShape, recipe: Recipe, act_bytes: int, rows: int, device: str = "cuda") -> float:
    """One update forward and backward of `rows` sequences (twice over with
    ppo.update_roles_together and a critic) and one logits chunk of the policy's."""
    copies = 2 if recipe.ppo.update_roles_together and recipe.uses_critic else 1
    tokens = rows * copies * _seq_len(recipe)
    per_layer = tokens * (
        ACT_HIDDEN_TERMS * shape.hidden + ACT_INTERMEDIATE_TERMS * shape.intermediate + ACT_KV_TERMS * shape.kv_width
    ) * act_bytes
    if recipe.model.gradient_checkpointing:
        # Layer inputs stay; one layer's activations are rebuilt at a time during backward.
        acts = shape.layers * tokens * shape.hidden * act_bytes + BACKWARD_FACTOR * per_layer
    else:
        acts = BACKWARD_FACTOR * shape.layers * per_layer
    chunk = min(DEFAULT_CHUNK_TOKENS, rows * recipe.rollout.max_new_tokens)
    logits = LOGIT_COPIES_GRAD * chunk * shape.vocab * 4
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
) -> Estimate:
    """Peak bytes per phase for `recipe` on a model of `shape`, on "cuda" or "cpu" (with the shapes
    of the recipe's classifier reward models, in the order of its sources), per process of a
    data-parallel run of `processes`: each holds the whole model and a share of the rows."""
    act = _dtype_bytes(recipe, device)
    trainable, frozen = _adapter_params(shape, recipe)
    recipe = _dequantize_resolved(shape, recipe, act, budget_gb)
    components = {
        "weights": _weight_bytes(shape, recipe.model, act),
        "adapters": (trainable + frozen) * ADAPTER_WEIGHT_BYTES,
        "optimizer": trainable * ADAM_BYTES,
        "reward_model": _reward_bytes(recipe, classifier_shapes or [], device),
        "runtime": RUNTIME_BYTES[device],
    }
    static = sum(components.values())
    grads = trainable * ADAPTER_GRAD_BYTES
    ro = recipe.rollout
    rows = ro.batch_size // processes  # a process generates and scores its share of the batch
    phases = {
        "generate": static + generate_bytes(shape, recipe, act, rows),
        "score": static + score_bytes(shape, recipe, act, min(ro.forward_batch_size, rows)),
        "update": static + grads + update_bytes(
            shape, recipe, act, update_rows(recipe.minibatch_size, recipe.micro_batch_size, processes), device),
    }
    fitting: dict[str, int] = {}
    if budget_gb is not None:
        fitting = largest_fitting_sizes(shape, recipe, act, device, budget_gb * GB - static, grads, processes)
    return Estimate(shape, components, phases, budget_gb, fitting, bool(recipe.model.dequantize_per_step), processes)


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
        setting = recipe.model.quantization == "4bit" and room is not None and copy_bytes <= AUTO_DEQUANTIZE_SHARE * room
    return recipe.model_copy(update={"model": recipe.model.model_copy(update={"dequantize_per_step": setting})})


MAX_BATCH = 4096  # the search for sizes that fit stops here


def largest_fitting_sizes(
    shape: ModelShape, recipe: Recipe, act: int, device: str, room: float, grads: float, processes: int = 1
) -> dict[str, int]:
    """The largest rollout.batch_size whose generation fits `room` (bytes beyond the resident
    ones) and whose update fits with some valid ppo.grad_accum_steps, the fewest such steps, and
    the largest rollout.forward_batch_size (at most the batch) whose scoring fits. Every value
    respects the recipe's divisibility rules, so the three together validate; {} if none fit."""
    def largest(fits) -> int:  # each phase's cost grows with its row count
        return max((n for n in range(1, MAX_BATCH + 1) if fits(n)), default=0)

    max_micro = largest(lambda n: grads + update_bytes(shape, recipe, act, n, device) <= room)
    max_rows = largest(lambda n: score_bytes(shape, recipe, act, n) <= room)
    if max_micro == 0 or max_rows == 0:
        return {}
    minibatches = recipe.ppo.num_minibatches
    # Batches in steps that keep the recipe's own accumulation valid (micro-batches stay whole) and
    # split over the processes (whole groups of samples, equal shares of each minibatch).
    step = math.lcm(recipe.rollout.samples_per_prompt * processes, minibatches * recipe.ppo.grad_accum_steps,
                    minibatches * processes)
    for batch in range(MAX_BATCH - MAX_BATCH % step, 0, -step):
        if generate_bytes(shape, recipe, act, batch // processes) > room:
            continue
        per_minibatch = batch // minibatches
        # The fewest micro-batches per minibatch whose size divides it and fits the update.
        steps = next(d for d in range(1, per_minibatch + 1)
                     if per_minibatch % d == 0 and update_rows(per_minibatch, per_minibatch // d, processes) <= max_micro)
        return {"rollout.batch_size": batch, "ppo.grad_accum_steps": steps,
                "rollout.forward_batch_size": min(max_rows, batch // processes)}
    return {}

def load_shape(name: str, trust_remote_code: bool = False) -> ModelShape:
    """The config of a hub id, a local folder or a builtin model, without loading weights."""
    from transformers import AutoConfig

    from lora_ppo.builtin_model import BUILTIN_MODELS, cache_dir, find_packaged_gguf
    from lora_ppo.model import resolve_model_path

    try:
        if name.startswith(BUILTIN_PREFIX):
            key = name[len(BUILTIN_PREFIX):]
            if key in BUILTIN_MODELS and not (cache_dir() / key / "config.json").is_file():
                gguf = find_packaged_gguf(BUILTIN_MODELS[key].distribution, BUILTIN_MODELS[key].filename)  # metadata only: no conversion
                return ModelShape.from_config(AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name))
        config = AutoConfig.from_pretrained(resolve_model_path(name), trust_remote_code=trust_remote_code)
    except RecipeError:
        raise
    except Exception as err:  # noqa: BLE001 - hub/network/parse errors become one line
        raise RecipeError(f"model.name: cannot read the config of {name!r}: {first_line(err)}") from None
    return ModelShape.from_config(config)


def estimate_recipe(recipe: Recipe, device: str = "cuda", budget_gb: Optional[float] = None,
                    processes: int = 1) -> Estimate:
    shape = load_shape(recipe.model.name, recipe.model.trust_remote_code)
    classifiers = [_classifier_shape(s.model, recipe.model.trust_remote_code)
                   for s in recipe.reward.source_list() if s.kind == "classifier"]
    return estimate(shape, recipe, device, budget_gb, classifiers, processes)


def _classifier_shape(name: str, trust_remote_code: bool) -> Optional[ModelShape]:
    """Reward classifiers are often encoders (BERT-like): count their parameters the same way."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001
        raise RecipeError(f"reward.model: cannot read the config of {name!r}: {first_line(err)}") from None
    hidden, layers = config.hidden_size, config.num_hidden_layers
    inter = getattr(config, "intermediate_size", 4 * hidden)
    heads = config.num_attention_heads
    return ModelShape(hidden, inter, layers, heads, heads, hidden // heads, config.vocab_size, True)


def format_estimate(est: Estimate, recipe: Recipe, device: str) -> str:
    s, n = est.shape, est.processes
    rows = recipe.rollout.batch_size // n
    lines = [
        f"model: {recipe.model.name}  ({s.total_params / 1e9:.2f}B parameters: {s.layers} layers, hidden {s.hidden}, "
        f"vocab {s.vocab}), quantization {recipe.model.quantization}, on {device}",
        *([f"per process of {n} (each holds the model; the rows are its share of the batch)"] if n > 1 else []),
        f"recipe: batch {rows}, prompt <= {recipe.data.max_prompt_tokens} + "
        f"{recipe.rollout.max_new_tokens} new tokens, scoring rows {min(recipe.rollout.forward_batch_size, rows)}, "
        f"update micro-batch {update_rows(recipe.minibatch_size, recipe.micro_batch_size, n)}, gradient checkpointing "
        f"{'on' if recipe.model.gradient_checkpointing else 'off'}, dequantize per step "
        f"{'on' if est.dequantize_per_step else 'off'}",
        "",
        "always resident:",
    ]
    for name, value in est.components.items():
        lines.append(f"  {name:<14}{value / GB:8.2f} GB")
    lines.append("peak per phase:")
    for name in PHASES:
        lines.append(f"  {name:<14}{est.phases[name] / GB:8.2f} GB")
    lines.append(f"peak: {est.peak / GB:.2f} GB")
    if est.budget_gb is not None:
        verdict = "fits" if est.fits else "does NOT fit"
        lines.append(f"{verdict} in {est.budget_gb:g} GB")
        if est.fitting:
            lines.append("largest sizes that fit together (others as in the recipe): "
                         + " ".join(f"{k}={v}" for k, v in est.fitting.items()))
        elif sum(est.components.values()) > est.budget_gb * GB:
            lines.append("no batch size fits: what stays resident alone is larger than the budget")
        else:
            lines.append("no batch size fits: even one response per phase needs more than the budget")
    return "\n".join(lines)


def as_json(est: Estimate) -> dict:
    return {
        "params": est.shape.total_params,
        "components_gb": {k: round(v / GB, 3) for k, v in est.components.items()},
        "phases_gb": {k: round(v / GB, 3) for k, v in est.phases.items()},
        "peak_gb": round(est.peak / GB, 3),
        "budget_gb": est.budget_gb,
        "fits": est.fits,
        "fitting": est.fitting,
        "dequantize_per_step": est.dequantize_per_step,
        "processes": est.processes,
    }


__all__ = ["ModelShape", "Estimate", "estimate", "estimate_recipe", "load_shape", "format_estimate", "as_json"]
