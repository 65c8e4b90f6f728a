"""Random-init models of a real model's shape, for the benchmarks that need its size, not its
weights (memory does not depend on the values): saved in bf16, or built straight into a
pre-quantized 4-bit checkpoint one weight at a time (a 32B model in bf16 is 65 GB, more than a
device's disk; in 4-bit it is about 19 GB, and no more than one weight is ever held unquantized)."""

from __future__ import annotations

import json
from pathlib import Path

SHARD_BYTES = 4 * 10**9  # safetensors shards of the 4-bit checkpoint


def resized_config(shape: dict, folder: Path, base: str = "llama-3.1-8b") -> Path:
    """`folder` holding `bench/model_configs/<base>`'s config with `shape`'s sizes (a real
    architecture at a size the CPU runs), head size left to follow them."""
    config = json.loads((Path(__file__).parent / "model_configs" / base / "config.json").read_text())
    config.update(shape)
    config.pop("head_dim", None)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _config_and_tokenizer(config_dir: Path, tokenizer_dir: str):
    """The model's config with the tokenizer's special tokens, and the tokenizer (whose vocabulary
    must fit the model's)."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(config_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if len(tokenizer) > config.vocab_size:
        raise SystemExit(f"tokenizer has {len(tokenizer)} tokens, the model only {config.vocab_size}")
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    return config, tokenizer


def build_random_model(config_dir: Path, tokenizer_dir: str, folder: Path) -> None:
    """Random-init weights of `config_dir`'s shape, saved in bf16 with the given tokenizer (whose
    vocabulary must fit the model's); built on the GPU when there is one. Skipped if present."""
    if (folder / "config.json").is_file():
        return
    import torch
    from transformers import AutoModelForCausalLM

    config, tokenizer = _config_and_tokenizer(config_dir, tokenizer_dir)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    staging = folder.with_name(folder.name + ".partial")
    model.save_pretrained(staging, max_shard_size="4GB")
    tokenizer.save_pretrained(staging)
    staging.rename(folder)
    del model
    torch.cuda.empty_cache()


def build_random_4bit_model(config_dir: Path, tokenizer_dir: str, folder: Path, double_quant: bool = True,
                            seed: int = 0) -> None:
    """Random-init weights of `config_dir`'s shape written as a bitsandbytes NF4 checkpoint (as
    `save_pretrained` writes a 4-bit model), with the given tokenizer: each linear layer's weight
    is drawn in bf16 on the GPU (or CPU), quantized and written out before the next is drawn; the
    layers bitsandbytes leaves unquantized (embeddings, LM head, norms) stay bf16. lora_ppo then
    loads it through its own path, as any pre-quantized hub checkpoint. Skipped if present."""
    if (folder / "config.json").is_file():
        return
    import torch
    from bitsandbytes.functional import quantize_4bit
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.quantizers.base import get_keys_to_not_convert

    config, tokenizer = _config_and_tokenizer(config_dir, tokenizer_dir)
    with torch.device("meta"):  # names and shapes only
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    kept = set(get_keys_to_not_convert(skeleton))
    quantized = {f"{name}.weight" for name, module in skeleton.named_modules()
                 if isinstance(module, torch.nn.Linear) and not any(name == k or name.startswith(k + ".") for k in kept)}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(seed)
    std = getattr(config.get_text_config(), "initializer_range", 0.02)
    staging = folder.with_name(folder.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes, index = 0, {}

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(set(index.values())) + 1:05d}.safetensors"
            save_file(shard, str(staging / name), metadata={"format": "pt"})
            index.update({key: name for key in shard})
            shard, shard_bytes = {}, 0

    tied = getattr(config, "tie_word_embeddings", False)
    for name, param in skeleton.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # one tensor: the embeddings'
        if name.endswith("norm.weight") or param.dim() == 1 and name.endswith(".weight"):
            value = {name: torch.ones(param.shape, dtype=torch.bfloat16)}
        elif param.dim() == 1:  # biases
            value = {name: torch.zeros(param.shape, dtype=torch.bfloat16)}
        else:
            weight = torch.empty(param.shape, dtype=torch.bfloat16, device=device).normal_(0.0, std, generator=generator)
            if name in quantized:
                packed, state = quantize_4bit(weight, blocksize=64, compress_statistics=double_quant, quant_type="nf4")
                value = {name: packed, **{f"{name}.{k}": v for k, v in state.as_dict(packed=True).items()}}
            else:
                value = {name: weight}
        for key, tensor in value.items():
            shard[key] = tensor.contiguous().cpu()
            shard_bytes += tensor.numel() * tensor.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    (staging / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=2))
    config.quantization_config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.bfloat16).to_dict()
    config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(folder)


def small_tokenizer(folder: Path) -> str:
    """A small byte-level BPE tokenizer with a chat template (the tests' one), built once into
    `folder`: the device benchmarks need token ids that fit a model's vocabulary, not its own
    tokenizer (which a device without network cannot download)."""
    import sys

    if not (folder / "tokenizer.json").is_file():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.conftest import build_tiny_tokenizer

        folder.mkdir(parents=True, exist_ok=True)
        build_tiny_tokenizer(folder)
    return str(folder)
