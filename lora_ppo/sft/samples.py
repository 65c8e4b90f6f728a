"""Held-out completions before and after training, for the report: greedy (so before and after read
as the same prompts' answers, not two draws), continuing each prompt as the PPO run renders it, cut
after the stop token."""

from __future__ import annotations

from typing import Sequence

import torch

from lora_ppo.data import PromptRow
from lora_ppo.roles import Backbone
from lora_ppo.rollout import (left_pad, model_end_tokens, stop_token_ids, truncate_at_stop,
                              without_model_generation_defaults)
from lora_ppo.sft.rows import SFTRow


@torch.no_grad()
def greedy_samples(model: Backbone, tokenizer, rows: Sequence[SFTRow], max_new_tokens: int,
                   batch_size: int) -> list[dict]:
    """One record per row that has a prompt: `prompt`, the model's `completion`, the dataset's
    `reference` answer, and `sample` 0 (as the report pairs records of the same prompt)."""
    from transformers import GenerationConfig

    # where a PPO run's responses end (rollout.stop_token: eos): the tokenizer's and the model's end tokens
    stop = stop_token_ids(tokenizer, "eos", model_end_tokens(model.peft.get_base_model()))
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                              eos_token_id=list(stop) or None, use_cache=True)
    prompted = [row for row in rows if row.prompt_ids]
    device = model.lm_head.weight.device
    records = []
    for start in range(0, len(prompted), batch_size):
        chunk = prompted[start : start + batch_size]
        ids, mask = left_pad([PromptRow(row.prompt, "", row.prompt_ids) for row in chunk], tokenizer.pad_token_id,
                             device)
        with model.adapter_compute(), without_model_generation_defaults(model.peft):
            out = model.peft.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        response, _, _ = truncate_at_stop(out[:, ids.shape[1]:], stop, tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(response, skip_special_tokens=True)
        records += [{"prompt": row.prompt, "completion": text, "reference": row.completion, "sample": 0}
                    for row, text in zip(chunk, texts)]
    return records
