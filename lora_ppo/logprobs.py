"""Per-token logprobs and entropy at response positions, in chunks along the sequence.

Only the hidden states of response positions go through the LM head, a chunk at a time, so
no [B, T_total, V] (or even [B, T_resp, V]) fp32 logits tensor exists. Under autograd each
chunk is checkpointed: its logits are recomputed in backward instead of being kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_TOKENS = 64


@dataclass(frozen=True)
class LogitTransform:
    """What a model's forward does to its LM head's output before it is a distribution:
    `softcap * tanh(logits * scale / softcap)`, or `logits * scale` without a soft-cap.

    Gemma 2/3 soft-cap their final logits (`final_logit_softcapping`), Granite divides them by
    `logits_scaling`, Cohere multiplies them by `logit_scale`. The bare LM head of such a model is
    not its distribution, so every logprob, KL and ratio must go through this.
    """

    scale: float = 1.0
    softcap: Optional[float] = None

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits


IDENTITY = LogitTransform()


def _chunk_logprobs(
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(hidden).float() / temperature  # [B, c, V]
    log_norm = torch.logsumexp(logits, dim=-1)  # [B, c]
    target_logits = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    probs = torch.softmax(logits, dim=-1)
    entropy = log_norm - (probs * logits).sum(-1)
    return target_logits - log_norm, entropy


def token_logprobs(
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each target token and the entropy of its distribution.

    Args:
        lm_head: maps hidden states [..., H] to vocabulary logits [..., V].
        hidden: [B, T_resp, H] hidden states of the positions that *predict* the targets.
        targets: [B, T_resp] token ids.
        temperature: the sampling temperature; logits are divided by it exactly as in
            generation, or the ratio to rollout logprobs (and the KL) would be off.
        chunk_tokens: how many positions go through the LM head at once.
    Returns:
        (logprobs, entropy), each [B, T_resp] in float32.
    """
    chunk_tokens = max(1, chunk_tokens // max(1, hidden.shape[0]))
    logprob_chunks, entropy_chunks = [], []
    for start in range(0, hidden.shape[1], chunk_tokens):
        h = hidden[:, start : start + chunk_tokens]
        t = targets[:, start : start + chunk_tokens]
        if torch.is_grad_enabled() and h.requires_grad:
            lp, ent = checkpoint(_chunk_logprobs, lm_head, h, t, temperature, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(lm_head, h, t, temperature)
        logprob_chunks.append(lp)
        entropy_chunks.append(ent)
    if not logprob_chunks:
        empty = hidden.new_zeros(targets.shape, dtype=torch.float32)
        return empty, empty.clone()
    return torch.cat(logprob_chunks, dim=1), torch.cat(entropy_chunks, dim=1)
