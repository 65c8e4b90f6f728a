"""The adapter `train-sft` trains, on the one backbone: the logprobs of a batch's target tokens
(the masked cross-entropy is their negative mean), padded or packed.
"""

from __future__ import annotations

from typing import Optional

import torch

from lora_ppo.config import SFTAdapterSettings
from lora_ppo.logprobs import token_logprobs
from lora_ppo.quantization import AdapterNumerics
from lora_ppo.roles import POLICY, SingleAdapterModel
from lora_ppo.sft.batches import Batch


class SFTModel(SingleAdapterModel):
    """The backbone with the trainable policy adapter: its folder is a plain PEFT adapter, what a PPO
    recipe's `adapters.policy.init_from` takes."""

    def __init__(self, base_model, settings: SFTAdapterSettings, base_name: Optional[str] = None,
                 numerics: AdapterNumerics = AdapterNumerics()):
        super().__init__(base_model, settings, POLICY, base_name, settings.dropout, numerics)

    def target_logprobs(self, batch: Batch) -> torch.Tensor:
        """log p(token | tokens before it in its row) of every target token, [N] float32 in the
        batch's order. Only target positions go through the LM head, in chunks."""
        hidden = self.hidden_states(batch.input_ids, batch.attention_mask, batch.position_ids)  # [B, T, H]
        predicting = batch.target_mask[:, 1:]  # [B, T-1]: position t predicts token t + 1
        chosen = hidden[:, :-1][predicting]  # [N, H]
        targets = batch.input_ids[:, 1:][predicting]  # [N]
        logprobs, _ = token_logprobs(self.token_logits, chosen.unsqueeze(0), targets.unsqueeze(0))
        return logprobs.squeeze(0)
