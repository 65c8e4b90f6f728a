"""Achieved throughput of a step's phases: the matmul work (model FLOPs) each phase did, from the
loaded model's layer sizes and the batch's shapes, and the share of the device's peak rate where
the device is known. Elementwise work (norms, activations, softmax, optimizer) is not counted, so
a phase's rate is a lower bound on what the card did and a fair measure of how full it was kept.

Counted per token of a forward: 2 FLOPs per weight of every linear layer it passes (the 4-bit
base's at their unquantized size, and each LoRA adapter's A and B), 2 per weight of the LM head at
the positions it is applied to, and 4 x (query width) per attended position per layer (scores
and the weighted sum, causal: a token attends to itself and what precedes it). A backward pass
costs the input gradients of every layer (1x the forward for frozen weights) plus the weight
gradients of the trained LoRA (another 1x of theirs) and 2x the attention; gradient
checkpointing adds one more forward of the decoder; the logprob chunks are always recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

TERA = 1e12
# Dense bf16 matmul peaks from the makers' spec sheets (TFLOP/s, no sparsity), matched by a
# substring of torch.cuda.get_device_name(); first match wins, so longer names come first.
# A card that is not listed gets no share, only its TFLOP/s.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("GH200", 989.0), ("H200", 989.0),
    ("A100", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A10G", 70.0), ("A10", 125.0),
)


def device_peak_tflops(name: Optional[str]) -> Optional[float]:
    """The spec-sheet dense bf16 peak of a GPU named `name` (as CUDA names it), or None."""
    if not name:
        return None
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def current_device_peak_tflops(dev: torch.device) -> Optional[float]:
    """`device_peak_tflops` of the CUDA device a model runs on; None on other devices."""
    if dev.type != "cuda":
        return None
    return device_peak_tflops(torch.cuda.get_device_name(dev))


def _lora_adapter(name: str) -> Optional[str]:
    """The adapter a LoRA A/B module belongs to, from its name (`...lora_A.policy`), else None."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("lora_A", "lora_B"):
            return parts[i + 1]
    return None


def _weight_count(module: nn.Module) -> int:
    """Weights of a linear layer at its unquantized size (a 4-bit weight's packed tensor is smaller)."""
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return module.in_features * module.out_features
    weight = getattr(module, "weight", None)  # GPT-2's Conv1D
    return weight.numel() if weight is not None else 0


def _is_linear(module: nn.Module) -> bool:
    # PEFT's LoRA wrappers (named Linear4bit too) hold the layer as `base_layer`: counted there.
    return (not hasattr(module, "base_layer")
            and (isinstance(module, nn.Linear) or type(module).__name__ in ("Linear4bit", "Linear8bitLt", "Conv1D")))


@dataclass(frozen=True)
class ModelFlops:
    """Per-token matmul sizes of a loaded model (a PEFT model or a bare one)."""

    linear_weights: int  # the decoder's linear layers (base weights; the LM head apart)
    lora_weights: dict[str, int]  # each adapter's A and B weights
    head_weights: int  # the LM head: hidden x vocabulary
    attention_width: int  # layers x query width

    @classmethod
    def of(cls, model: nn.Module, lm_head: nn.Module) -> "ModelFlops":
        linear, lora = 0, {}
        for name, module in model.named_modules():
            if module is lm_head or not _is_linear(module):
                continue
            adapter = _lora_adapter(name)
            if adapter is None:
                linear += _weight_count(module)
            else:
                lora[adapter] = lora.get(adapter, 0) + _weight_count(module)
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = getattr(text, "num_attention_heads", 0) or 0
        head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
        return cls(linear, lora, _weight_count(lm_head), (getattr(text, "num_hidden_layers", 0) or 0) * heads * head_dim)

    def forward(self, tokens: float, attended: float, head_positions: float, adapter: Optional[str] = None) -> float:
        """FLOPs of a forward over `tokens` tokens that attend to `attended` positions in all (summed
        over tokens), with the LM head at `head_positions` of them, under `adapter` (None: none)."""
        weights = self.linear_weights + (self.lora_weights.get(adapter, 0) if adapter else 0)
        return 2.0 * weights * tokens + 4.0 * self.attention_width * attended + 2.0 * self.head_weights * head_positions

    def backward(self, tokens: float, attended: float, head_positions: float, adapter: str) -> float:
        """FLOPs of the backward of `forward(...)` with `adapter` trained: input gradients of every
        layer, the adapter's weight gradients, twice the attention."""
        lora = self.lora_weights.get(adapter, 0)
        return (2.0 * (self.linear_weights + 2 * lora) * tokens + 8.0 * self.attention_width * attended
                + 2.0 * self.head_weights * head_positions)


def causal_attended(lengths: torch.Tensor) -> float:
    """Positions attended to in all by sequences of `lengths` real tokens (n(n+1)/2 each)."""
    lengths = lengths.double()
    return float((lengths * (lengths + 1) / 2).sum())


@dataclass(frozen=True)
class StepShape:
    """What a step's phases ran over: its sequences' real lengths, prompts and responses."""

    sequence_lengths: torch.Tensor  # [B] real tokens of prompt + response
    prompt_lengths: torch.Tensor  # [B] real prompt tokens
    response_tokens: float  # real response tokens in all (the LM head's positions)
    decode_steps: int  # tokens generated per row (the response width)

    @classmethod
    def of(cls, query_mask: torch.Tensor, response_mask: torch.Tensor, context_mask: torch.Tensor) -> "StepShape":
        prompts = query_mask.long().sum(dim=1).cpu()
        return cls(prompts + context_mask.long().sum(dim=1).cpu(), prompts, float(response_mask.sum()),
                   int(response_mask.shape[1]))


def generate_flops(model: ModelFlops, shape: StepShape) -> float:
    """Prefill of every prompt, then one token per row and decode step (rows that stopped early
    keep decoding padding until the batch ends: that work is done too), each with the LM head."""
    rows = float(len(shape.prompt_lengths))
    prefill = model.forward(float(shape.prompt_lengths.sum()), causal_attended(shape.prompt_lengths), rows, "policy")
    steps = torch.arange(1, shape.decode_steps + 1, dtype=torch.float64)
    attended = float((shape.prompt_lengths.double()[:, None] + steps[None, :]).sum())
    decode = model.forward(rows * shape.decode_steps, attended, rows * shape.decode_steps, "policy")
    return prefill + decode


def score_flops(model: ModelFlops, shape: StepShape, roles: dict[str, bool]) -> float:
    """One forward per scored role over the whole sequences; `roles` maps each adapter scored
    (`reference` with None for adapters disabled) to whether it reads logprobs (the LM head)."""
    tokens, attended = float(shape.sequence_lengths.sum()), causal_attended(shape.sequence_lengths)
    return sum(model.forward(tokens, attended, shape.response_tokens if head else 0.0, adapter)
               for adapter, head in roles.items())


def update_flops(model: ModelFlops, shape: StepShape, epochs: int, with_value: bool, checkpointing: bool) -> float:
    """Every epoch: the policy's forward and backward (its logprob chunks recomputed), the value's
    without the LM head; a recomputed decoder forward each with gradient checkpointing."""
    tokens, attended = float(shape.sequence_lengths.sum()), causal_attended(shape.sequence_lengths)
    total = 0.0
    for adapter, head in (("policy", shape.response_tokens), ("value", 0.0))[: 1 + with_value]:
        forward = model.forward(tokens, attended, head, adapter)
        recompute = model.forward(tokens, attended, 0.0, adapter) if checkpointing else 0.0
        total += forward + recompute + 2.0 * model.head_weights * head + model.backward(tokens, attended, head, adapter)
    return epochs * total


@dataclass(frozen=True)
class StepWork:
    """What a run's steps compute besides their shapes, to count each phase's FLOPs: the model,
    the roles scored (adapter name, or None for adapters disabled -> reads logprobs), the update's
    epochs and roles, and the device's peak (None: unknown)."""

    model: ModelFlops
    scored_roles: dict[Optional[str], bool]
    epochs: int
    with_value: bool
    checkpointing: bool
    peak_tflops: Optional[float] = None
    processes: int = 1  # data-parallel: each process did its share of the batch's work

    def metrics(self, shape: StepShape, seconds: dict[str, float]) -> dict[str, float]:
        """`perf/*` for one step whose phases took `seconds` (a phase absent or 0: not run)."""
        flops = {
            "generate": generate_flops(self.model, shape),
            "score": score_flops(self.model, shape, self.scored_roles),
            "update": update_flops(self.model, shape, self.epochs, self.with_value, self.checkpointing),
        }
        share = {phase: work / self.processes for phase, work in flops.items()}
        rows_steps = len(shape.prompt_lengths) * shape.decode_steps / self.processes
        return throughput_metrics(share, seconds, self.peak_tflops, rows_steps)


def throughput_metrics(flops: dict[str, float], seconds: dict[str, float], peak_tflops: Optional[float],
                       generated_tokens: float) -> dict[str, float]:
    """`perf/*` of a step: each phase's TFLOP/s (and its share of the device's peak where known),
    and the decode's tokens per second (rows x decode steps)."""
    metrics: dict[str, float] = {}
    for phase, work in flops.items():
        if seconds.get(phase, 0.0) > 0:
            rate = work / seconds[phase] / TERA
            metrics[f"perf/{phase}_tflops"] = rate
            if peak_tflops:
                metrics[f"perf/{phase}_peak_frac"] = rate / peak_tflops
    if seconds.get("generate", 0.0) > 0:
        metrics["perf/generate_tokens_per_s"] = generated_tokens / seconds["generate"]
    return metrics
