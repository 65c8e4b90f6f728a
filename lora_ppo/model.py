"""Load the one base model (4-bit, 8-bit or unquantized) and its tokenizer, from a local
folder, a hub id, or the embedded default model."""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import weakref
from pathlib import Path
from typing import Iterator, Optional

import torch
from safetensors import SafetensorError
from torch import nn

from lora_ppo.bnb_workarounds import dequantized_4bit_bytes, dequantized_4bit_layers, keep_4bit_weights_differentiable
from lora_ppo.builtin_model import resolve_builtin
from lora_ppo.config import AUTO_DEQUANTIZE_SHARE, BUILTIN_PREFIX, ModelConfig
from lora_ppo.errors import RecipeError, first_line
from lora_ppo.fused_4bit_decode import fuse_4bit_decode
from lora_ppo.memory import available_cpu_bytes
from lora_ppo.model_checks import fused_expert_parameters, unconverted_linears
from lora_ppo.devices import accelerator_module, device, device_map
from lora_ppo.quantization import compute_dtype, compute_in, quantization_config

log = logging.getLogger(__name__)


def resolve_model_path(name: str) -> str:
    """A local folder or hub id that `from_pretrained` accepts."""
    if name.startswith(BUILTIN_PREFIX):
        return str(resolve_builtin(name))
    # A hub id is "name" or "org/name"; anything else is meant as a local folder.
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()
    if looks_local and not Path(name).expanduser().is_dir():
        raise RecipeError(f"model.name: folder not found: {name}")
    return str(Path(name).expanduser()) if looks_local else name


def _load_error(name: str, err: Exception) -> RecipeError:
    if "trust_remote_code" in str(err):
        return RecipeError(
            f"model.name: {name!r} needs its own Python code to load; it runs only with "
            "model.trust_remote_code: true (read that code first)"
        )
    return RecipeError(f"model.name: cannot load {name!r}: {first_line(err)}")


def load_tokenizer(cfg: ModelConfig):
    """The tokenizer, left-padding, with a pad token (eos when the model has none)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(cfg.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise _load_error(cfg.name, err) from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.chat_template_kwargs:
        pass_template_variables(tokenizer, cfg.chat_template_kwargs)
    return tokenizer


def pass_template_variables(tokenizer, variables: dict) -> None:
    """Every `apply_chat_template` call of `tokenizer` from now on renders with `variables`
    (`model.chat_template_kwargs`), the call's own arguments first; RecipeError for a name its
    template never reads, which would otherwise change nothing."""
    templates = tokenizer.chat_template
    texts = list(templates.values()) if isinstance(templates, dict) else [templates] if templates else []
    for name in variables:
        if not any(re.search(rf"\b{re.escape(name)}\b", text) for text in texts):
            where = "the tokenizer has no chat template" if not texts else "its chat template never reads it"
            raise RecipeError(f"model.chat_template_kwargs: {name!r} would change nothing: {where}")
    apply = tokenizer.apply_chat_template

    @functools.wraps(apply)
    def apply_with_variables(conversation, *args, **kwargs):
        return apply(conversation, *args, **{**variables, **kwargs})

    tokenizer.apply_chat_template = apply_with_variables  # an instance attribute shadows the method


def model_config(cfg: ModelConfig):
    """The model's transformers config, read alone (no weights); a RecipeError naming model.name
    when it cannot be read."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(resolve_model_path(cfg.name), trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise _load_error(cfg.name, err) from None


def model_context(cfg: ModelConfig) -> Optional[int]:
    """The model's context in tokens (its position table, from the config alone); None for models
    without a fixed limit (ALiBi, as Bloom)."""
    text = model_config(cfg).get_text_config()
    return getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)


def check_row_length(cfg: ModelConfig, tokens: int, field: str) -> None:
    """Refuse rows of up to `tokens` tokens (`field` sets it) that do not fit the model's context."""
    context = model_context(cfg)
    if context and tokens > context:
        raise RecipeError(f"{field}: rows of up to {tokens} tokens exceed the model's context of {context} tokens")


def check_context(cfg: ModelConfig, prompt_tokens: int, new_tokens: int, field: str = "rollout.max_new_tokens") -> None:
    """Refuse sequences longer than the model's context (its position table, from the config
    alone): past it, positions wrap or fail deep inside a forward. Models without a fixed limit
    (ALiBi, as Bloom) pass."""
    context = model_context(cfg)
    if context and prompt_tokens + new_tokens > context:
        raise RecipeError(f"{field}: prompts of up to {prompt_tokens} tokens (data.max_prompt_tokens) "
                          f"plus {new_tokens} new ones exceed the model's context of {context} tokens")


def load_base_model(cfg: ModelConfig):
    """Load the base causal LM once, quantized as the recipe says, every weight frozen."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(cfg.name)
    dtype = compute_dtype(cfg)
    dev = device()
    _check_tied_levers(cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype,
            quantization_config=quantization_config(cfg),
            device_map=device_map(dev),
            trust_remote_code=cfg.trust_remote_code,
            use_safetensors=_has_safetensors(path),
        )
    except (OSError, ValueError, SafetensorError) as err:  # a truncated or corrupt weights file too
        raise _load_error(cfg.name, err) from None
    model.requires_grad_(False)
    model.config.use_cache = True
    compute_in(model, dtype, cfg.name)
    _log_what_stays_unquantized(model, cfg)
    keep_4bit_weights_differentiable(model)
    if cfg.fused_4bit_decode:
        fuse_4bit_decode(model, dev)
    if dev.type == "cpu":
        _copy_out_of_checkpoint_mapping(model)
    if cfg.embeddings_on_cpu:
        model.set_input_embeddings(CpuEmbedding(model.get_input_embeddings(), dev))
    return model


def _check_tied_levers(cfg: ModelConfig) -> None:
    """Refuse the memory levers that need the embeddings and the LM head apart, on a model that
    ties them (one table read by both), before the weights load."""
    if not (cfg.embeddings_on_cpu or cfg.quantize_lm_head):
        return
    config = model_config(cfg)
    if getattr(config, "tie_word_embeddings", False) or getattr(config.get_text_config(), "tie_word_embeddings", False):
        lever = "offload_embeddings" if cfg.embeddings_on_cpu else "quantize_lm_head"
        raise RecipeError(f"model.{lever}: {cfg.name} ties its embeddings to the LM head (one table for both), "
                          "so they cannot be kept apart; leave it off for this model")


class CpuEmbedding(nn.Module):
    """The input embeddings kept in CPU memory (`model.offload_embeddings`): each forward's token
    ids are looked up there and the rows sent to the model's device. The table is held outside the
    module's parameters and buffers, so the model's device stays the GPU's (transformers moves a
    model's inputs to the device of its first parameter) and no `.to()` moves it back."""

    def __init__(self, embedding: nn.Module, dev: torch.device) -> None:
        super().__init__()
        object.__setattr__(self, "table", embedding.to("cpu"))  # not a submodule: its weight stays off the GPU
        self.out_device = dev
        # Whether generation copies the table to the device for its lookups (`on_device`): the
        # memory plan says so where generation's peak with it stays under the update's or scoring's.
        self.staged_for_generation = False
        self._staged: Optional[dict[str, torch.Tensor]] = None

    @property
    def weight(self) -> torch.Tensor:
        return self.table.weight

    @property
    def num_embeddings(self) -> int:
        return self.table.weight.shape[0]

    @property
    def embedding_dim(self) -> int:
        return self.table.weight.shape[1]

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """Within it (when `staged_for_generation`), lookups use a copy of the table on the device:
        a decoded token's lookup on the CPU would wait for the token to reach the host, each step."""
        if not self.staged_for_generation or self._staged is not None:
            yield
            return
        tensors = dict(self.table.named_parameters()) | dict(self.table.named_buffers())
        self._staged = {name: tensor.to(self.out_device, copy=True) for name, tensor in tensors.items()}
        try:
            yield
        finally:
            self._staged = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The original module's forward (Gemma scales its rows), on the CPU or with the staged copy.
        if self._staged is not None:
            return torch.func.functional_call(self.table, self._staged, (input_ids.to(self.out_device),))
        return self.table(input_ids.to("cpu")).to(self.out_device, non_blocking=True)


def embeddings_on_device(model: nn.Module) -> contextlib.AbstractContextManager:
    """Generation's lookups on the device, where the model keeps its embeddings in CPU memory
    and the memory plan staged them (`CpuEmbedding.on_device`)."""
    embedding = model.get_input_embeddings()
    return embedding.on_device() if isinstance(embedding, CpuEmbedding) else contextlib.nullcontext()


def _log_what_stays_unquantized(model: nn.Module, cfg: ModelConfig) -> None:
    """Say what a quantized load left at the compute dtype besides embeddings, norms and the LM
    head: an MoE's fused expert weights (transformers 5 stores them as 3-D parameters) and Linear
    subclasses (Falcon's FalconLinear), since bitsandbytes converts exact nn.Linear layers only."""
    if cfg.quantization == "none":
        return
    dtype = compute_dtype(cfg)
    for what, found in (("fused MoE expert weights", fused_expert_parameters(model)),
                        ("linear layers of a Linear subclass", unconverted_linears(model))):
        if found:
            elements = sum(found.values())
            log.warning("model.quantization %s leaves %d %s (%.2fB parameters, %.2f GB) unquantized in %s: "
                        "bitsandbytes converts exact nn.Linear layers only (docs/models.md)", cfg.quantization,
                        len(found), what, elements / 1e9, elements * dtype.itemsize / 1e9,
                        str(dtype).removeprefix("torch."))


def _copy_out_of_checkpoint_mapping(model: nn.Module) -> None:
    """On CPU, weights kept in their checkpoint dtype (embeddings, norms, or everything when
    unquantized) are views of the memory-mapped safetensors file, and one such view keeps the
    whole file mapped: after a 4-bit load that is the whole unquantized checkpoint in resident
    file pages the model no longer needs. Copying the unquantized tensors lets the mapping go."""
    quantized: tuple[type, ...] = ()
    try:
        import bitsandbytes as bnb

        quantized = (bnb.nn.Params4bit, bnb.nn.Int8Params)
    except ImportError:
        pass
    seen: set[int] = set()  # tied weights are one Parameter: copy it once, it stays tied
    with torch.no_grad():
        for module in model.modules():
            tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
            for _name, tensor in tensors:
                if id(tensor) not in seen and not isinstance(tensor, quantized):
                    seen.add(id(tensor))
                    tensor.data = tensor.data.clone()



def _has_safetensors(path: str) -> bool | None:
    """Local folders must hold safetensors (no pickle loading); hub ids decide for themselves."""
    local = Path(path)
    if local.is_dir():
        if not any(local.glob("*.safetensors")):
            raise RecipeError(f"model.name: {path} holds no .safetensors weights (pickled weights are not loaded)")
        return True
    return None


# model.dequantize_per_step auto: the decision for each loaded model, made at its first step.
_AUTO_DEQUANTIZE: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def dequantized_once(model: nn.Module, cfg: ModelConfig) -> contextlib.AbstractContextManager:
    """The 4-bit layers computed from one dequantized copy for the duration, when the recipe's
    `model.dequantize_per_step` asks for it (or, with `auto`, when the copy fits: decided once per
    model); otherwise a context that does nothing. Each training step and each evaluation runs
    inside one. The copy is made by the first and kept on the layers for the next, until the run
    ends (`release_dequantized_copies`): between steps nothing else needs the memory, and the
    same tensors keep the compiled decode step's CUDA graphs valid."""
    setting = cfg.dequantize_per_step
    limit = None if cfg.dequantize_budget_gb is None else cfg.dequantize_budget_gb * 1e9
    if setting == "auto":
        if model not in _AUTO_DEQUANTIZE:
            _AUTO_DEQUANTIZE[model] = _dequantized_copy_fits(model, compute_dtype(cfg), limit)
        setting = _AUTO_DEQUANTIZE[model]
    if not setting:
        return contextlib.nullcontext()
    return dequantized_4bit_layers(model, compute_dtype(cfg), limit, keep=True)


def _dequantized_copy_fits(model: nn.Module, dtype: torch.dtype, limit: Optional[float] = None) -> bool:
    copy_bytes = dequantized_4bit_bytes(model, dtype)
    if limit is not None:
        copy_bytes = min(copy_bytes, limit)  # at most the budget's layers are held
    if copy_bytes == 0:
        return False  # no 4-bit layers: nothing to dequantize
    free = free_memory_bytes(device())
    fits = free is not None and copy_bytes <= AUTO_DEQUANTIZE_SHARE * free
    free_text = "unknown" if free is None else f"{free / 1e9:.2f} GB"
    log.info("model.dequantize_per_step auto: %s (the copy takes %.2f GB, %s free)",
             "on" if fits else "off", copy_bytes / 1e9, free_text)
    return fits


def free_memory_bytes(dev: torch.device) -> Optional[int]:
    """Memory this process could still allocate: on a CUDA or XPU GPU what the driver reports free
    plus what torch's allocator holds unused, and never more than the process's own allocator cap
    (`set_per_process_memory_fraction`, set to share a card) leaves; on MPS the recommended working
    set less what tensors hold; on CPU Linux's MemAvailable. None when it cannot be read."""
    if dev.type in ("cuda", "xpu"):
        gpu = accelerator_module(dev.type)
        free, total = gpu.mem_get_info(dev)
        allocated = gpu.memory_allocated(dev)
        available = free + gpu.memory_reserved(dev) - allocated
        # The driver's free memory ignores the cap: a 12 GB cap on an 80 GB card reads ~80 GB free.
        fraction = getattr(gpu, "get_per_process_memory_fraction", None)
        cap = fraction(dev) if fraction is not None else None
        if isinstance(cap, float) and cap < 1.0:  # 1.0: no cap; 0.0 a cap of nothing (torch takes 0 to 1)
            available = min(available, int(cap * total) - allocated)
        return max(0, available)
    if dev.type == "mps":
        return torch.mps.recommended_max_memory() - torch.mps.current_allocated_memory()
    return available_cpu_bytes()
