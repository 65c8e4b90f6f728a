"""Random-init models of a real model's shape, for the benchmarks that need its size, not its
weights (memory does not depend on the values)."""

from __future__ import annotations

from pathlib import Path


def build_random_model(config_dir: Path, tokenizer_dir: str, folder: Path) -> None:
    """Random-init weights of `config_dir`'s shape, saved in bf16 with the given tokenizer (whose
    vocabulary must fit the model's); built on the GPU when there is one. Skipped if present."""
    if (folder / "config.json").is_file():
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(config_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if len(tokenizer) > config.vocab_size:
        raise SystemExit(f"tokenizer has {len(tokenizer)} tokens, the model only {config.vocab_size}")
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    staging = folder.with_name(folder.name + ".partial")
    model.save_pretrained(staging, max_shard_size="4GB")
    tokenizer.save_pretrained(staging)
    staging.rename(folder)
    del model
    torch.cuda.empty_cache()
