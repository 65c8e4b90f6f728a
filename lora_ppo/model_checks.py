"""What a loaded model needs besides its weights, found once at load time: the final logit
transform its forward applies (checked against that forward on a probe), its fused MoE expert
weights, which bitsandbytes leaves unquantized, and the keyword its forward takes a KV cache by."""

from __future__ import annotations

import inspect
import logging
from typing import Callable

import torch
from torch import nn

from lora_ppo.errors import RecipeError
from lora_ppo.logprobs import LogitTransform

log = logging.getLogger(__name__)

# Largest |logprob difference| between lora_ppo's logit path and the model's own forward on the
# probe. Both read the same LM head output, so in float32 they differ by rounding (about 1e-6); a
# model computing in bf16/fp16 applies its transform in that format (a soft-cap of 30 rounds by up
# to ~0.1), while a missed transform is off by nats.
LOGIT_PATH_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.25}
PROBE_LENGTH = 16


def logit_transform_of(config) -> LogitTransform:
    """The transform a model's forward applies to its LM head's logits, from its config:
    Granite's `logits_scaling` (divides), Cohere's `logit_scale` (multiplies), Gemma's
    `final_logit_softcapping`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    scale = float(getattr(text, "logit_scale", None) or 1.0) / float(getattr(text, "logits_scaling", None) or 1.0)
    softcap = getattr(text, "final_logit_softcapping", None)
    return LogitTransform(scale=scale, softcap=float(softcap) if softcap else None)


def probe_ids(vocab_size: int, device: torch.device) -> torch.Tensor:
    """A fixed probe sequence spread over the vocabulary, [1, PROBE_LENGTH]."""
    return (torch.arange(1, PROBE_LENGTH + 1, device=device) * 7919 % vocab_size).unsqueeze(0)


def logit_path_error(model_logits: Callable[[torch.Tensor], torch.Tensor],
                     path_logits: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor) -> float:
    """The largest |log-softmax difference| between the model's own forward and lora_ppo's path
    (decoder, LM head, transform) on `ids`, over every position and vocabulary entry."""
    with torch.no_grad():
        own = torch.log_softmax(model_logits(ids).float(), dim=-1)
        ours = torch.log_softmax(path_logits(ids).float(), dim=-1)
    return float((own - ours).abs().max())


def check_logit_path(error: float, transform: LogitTransform, dtype: torch.dtype, model_type: str) -> None:
    """Refuse a model whose distribution lora_ppo cannot reproduce: training it would optimise a
    different distribution from the one it samples, with no error anywhere."""
    tolerance = LOGIT_PATH_TOLERANCE.get(dtype, LOGIT_PATH_TOLERANCE[torch.float16])
    if error > tolerance:
        raise RecipeError(
            f"model.name: a {model_type} model's logits do not match lora_ppo's logit path (largest logprob "
            f"difference {error:.3g} on a probe, limit {tolerance:g}; transform used: {describe(transform)}): its "
            "forward post-processes logits in a way lora_ppo cannot reproduce, so it is not trained"
        )
    if not transform.is_identity:
        log.info("logit transform: %s (checked against the model's forward: largest logprob difference %.2g)",
                 describe(transform), error)


def describe(transform: LogitTransform) -> str:
    parts = ([f"x{transform.scale:g}"] if transform.scale != 1.0 else []) + (
        [f"soft-cap {transform.softcap:g}"] if transform.softcap is not None else [])
    return ", ".join(parts) or "none"


def unconverted_linears(model: nn.Module) -> dict[str, int]:
    """{name: weight elements} of the Linear layers a quantized load left at full precision besides
    the LM head: bitsandbytes converts exact nn.Linear modules only, not subclasses such as
    Falcon's FalconLinear."""
    import bitsandbytes as bnb

    head = model.get_output_embeddings()
    quantized = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    return {name: m.weight.numel() for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and not isinstance(m, quantized) and m is not head
            and type(m) is not nn.Linear}


def fused_expert_parameters(model: nn.Module) -> dict[str, int]:
    """{name: elements} of the model's 3-D weight parameters: transformers 5 stores MoE experts
    fused that way (not as Linear layers), and bitsandbytes quantizes only Linear layers."""
    return {name: p.numel() for name, p in model.named_parameters() if p.ndim == 3}


def base_forward(model: nn.Module) -> Callable:
    """The forward of the transformers model under any PEFT wrapper (whose own forward passes
    everything on as **kwargs)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.forward


def cache_keyword(model: nn.Module) -> str:
    """The keyword `model`'s forward takes its KV cache by: `cache` from transformers 5.24,
    `past_key_values` before it (and until 5.40, deprecated). A keyword the forward does not name
    lands in its **kwargs and is dropped: each decode step would then see its one new token and
    none of the context before it, and nothing would fail."""
    return "cache" if "cache" in inspect.signature(base_forward(model)).parameters else "past_key_values"


def returned_cache(output):
    """The KV cache a forward returned, by either of its names (see `cache_keyword`)."""
    return output["cache"] if "cache" in output else output.get("past_key_values")


# Packed positions must reproduce a row computed alone to this share of its largest hidden value
# (positions ignored would be off by a rotation, not by rounding).
PACKED_POSITION_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


@torch.no_grad()
def check_packing(decoder: nn.Module, vocab_size: int, device: torch.device, model_type: str, field: str) -> None:
    """Refuse packing (`field`: the recipe switch that asked for it) where this model's attention lets
    packed rows see each other, or ignores the positions: a packed probe row must not change with the
    row packed before it, and must match itself computed alone. transformers parts packed rows by their
    positions alone (a position that is not the one before plus one starts a row). Raises RecipeError."""
    ids = probe_ids(vocab_size, device)[0, :6]
    first, second = ids[:3], ids[3:]
    other_first = (first + 1) % vocab_size  # other tokens before the same row
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]], device=device)

    def packed(before: torch.Tensor) -> torch.Tensor:
        row = torch.cat([before, second]).unsqueeze(0)
        return decoder(input_ids=row, position_ids=positions, use_cache=False).last_hidden_state[0, 3:]

    alone = decoder(input_ids=second.unsqueeze(0), use_cache=False).last_hidden_state[0]
    with_first, with_other = packed(first), packed(other_first)
    if not torch.equal(with_first, with_other):
        raise RecipeError(f"{field}: {model_type}'s attention lets a packed row see the row before it "
                          f"(its attention implementation ignores packed positions); set {field}: false")
    tolerance = PACKED_POSITION_TOLERANCE.get(alone.dtype, 5e-2) * float(alone.abs().max().clamp(min=1.0))
    if (with_first - alone).abs().max() > tolerance:
        raise RecipeError(f"{field}: {model_type} does not count a packed row's positions from 0 as given; "
                          f"set {field}: false")
