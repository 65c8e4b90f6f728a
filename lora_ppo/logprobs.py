"""Per-token logprobs and entropy at response positions, in chunks along the sequence.

Only the hidden states of response positions go through the LM head, a chunk at a time, so
no [B, T_total, V] (or even [B, T_resp, V]) fp32 logits tensor exists. Under autograd each
chunk is checkpointed: its logits are recomputed in backward instead of being kept.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_TOKENS = 64


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
