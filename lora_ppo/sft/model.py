"""The adapter `train-sft` trains, on the one backbone: the logprobs of a batch's target tokens
(the masked cross-entropy is their negative mean), padded or packed, and the check that this
model's attention keeps packed rows apart.
"""

from __future__ import annotations

from typing import Optional

import torch

from lora_ppo.config import SFTAdapterSettings
from lora_ppo.errors import RecipeError
from lora_ppo.logprobs import token_logprobs
from lora_ppo.model_checks import probe_ids
from lora_ppo.quantization import AdapterNumerics
from lora_ppo.roles import POLICY, SingleAdapterModel
from lora_ppo.sft.batches import Batch

# Packed positions must reproduce a row computed alone to this share of its largest hidden value
# (positions ignored would be off by a rotation, not by rounding).
PACKED_POSITION_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


class SFTModel(SingleAdapterModel):
    """The backbone with the trainable policy adapter: its folder is a plain PEFT adapter, what a PPO
    recipe's `adapters.policy.init_from` takes."""

    def __init__(self, base_model, settings: SFTAdapterSettings, base_name: Optional[str] = None,
                 numerics: AdapterNumerics = AdapterNumerics()):
        super().__init__(base_model, settings, POLICY, (POLICY,), base_name, settings.dropout, numerics)

    def batch_hidden_states(self, batch: Batch) -> torch.Tensor:
        """Last hidden states of the decoder, [B, T, H]: positions as the batch gives them, and
        without an attention mask for a packed batch (transformers parts its rows by their positions)."""
        with self.adapter_compute():
            return self.decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                position_ids=batch.position_ids, use_cache=False).last_hidden_state

    def target_logprobs(self, batch: Batch) -> torch.Tensor:
        """log p(token | tokens before it in its row) of every target token, [N] float32 in the
        batch's order. Only target positions go through the LM head, in chunks."""
        hidden = self.batch_hidden_states(batch)  # [B, T, H]
        predicting = batch.target_mask[:, 1:]  # [B, T-1]: position t predicts token t + 1
        chosen = hidden[:, :-1][predicting]  # [N, H]
        targets = batch.input_ids[:, 1:][predicting]  # [N]
        logprobs, _ = token_logprobs(self.token_logits, chosen.unsqueeze(0), targets.unsqueeze(0))
        return logprobs.squeeze(0)

    @torch.no_grad()
    def check_packing(self) -> None:
        """Refuse packing where this model's attention lets packed rows see each other, or ignores the
        positions: a packed probe row must not change with the row packed before it, and must match
        itself computed alone. Raises RecipeError."""
        vocab = self.lm_head.out_features  # not weight.shape[0]: a 4-bit head's weight is packed
        ids = probe_ids(vocab, self.lm_head.weight.device)[0, :6]
        first, second = ids[:3], ids[3:]
        other_first = (first + 1) % vocab  # other tokens before the same row
        positions = torch.tensor([[0, 1, 2, 0, 1, 2]], device=ids.device)

        def packed(before: torch.Tensor) -> torch.Tensor:
            row = torch.cat([before, second]).unsqueeze(0)
            return self.decoder(input_ids=row, position_ids=positions, use_cache=False).last_hidden_state[0, 3:]

        alone = self.decoder(input_ids=second.unsqueeze(0), use_cache=False).last_hidden_state[0]
        with_first, with_other = packed(first), packed(other_first)
        model_type = self.peft.get_base_model().config.model_type
        if not torch.equal(with_first, with_other):
            raise RecipeError(f"sft.packing: {model_type}'s attention lets a packed row see the row before it "
                              "(its attention implementation ignores packed positions); set sft.packing: false")
        tolerance = PACKED_POSITION_TOLERANCE.get(alone.dtype, 5e-2) * float(alone.abs().max().clamp(min=1.0))
        if (with_first - alone).abs().max() > tolerance:
            raise RecipeError(f"sft.packing: {model_type} does not count a packed row's positions from 0 as given; "
                              "set sft.packing: false")
