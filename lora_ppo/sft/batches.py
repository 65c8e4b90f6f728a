"""A micro-batch of demonstrations as model input: one row per sequence, right-padded; or packed,
several rows per sequence, each with its own positions (from 0), so no row attends to another.

    padded:  | row 1 tokens       [PAD] [PAD] |    packed: | row 1 tokens | row 3 | row 2 |
             | row 2 tokens [PAD] [PAD] [PAD] |            | row 4 tokens   | [PAD] [PAD] |
    positions 0 1 2 ... per row                 positions   0 1 2 .. 0 1 2 .. 0 1 ..

A packed sequence has no attention mask: the positions part its rows (lora_ppo/packing.py); the
padding at the end is a segment of its own, never a target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from lora_ppo.packing import pack
from lora_ppo.sft.rows import SFTRow


@dataclass(frozen=True)
class Batch:
    """Model input for rows; per-token tensors are [B, T]."""

    input_ids: torch.Tensor  # [B, T]
    position_ids: torch.Tensor  # [B, T], counted from 0 in every row
    attention_mask: Optional[torch.Tensor]  # [B, T] 1 on real tokens; None when packed (the positions part rows)
    target_mask: torch.Tensor  # [B, T] bool: True where the loss predicts the token from the one before it

    @property
    def positions(self) -> int:
        """Token positions a forward computes, padding included."""
        return self.input_ids.numel()

    def to(self, device) -> "Batch":
        mask = None if self.attention_mask is None else self.attention_mask.to(device)
        return Batch(self.input_ids.to(device), self.position_ids.to(device), mask, self.target_mask.to(device))


def _sequences(groups: Sequence[Sequence[SFTRow]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """(input_ids, position_ids, real-token mask, target mask) of sequences that each hold the rows
    of one group back to back, right-padded to the longest; padding has positions of its own from 0."""
    width = max(sum(len(row.ids) for row in group) for group in groups)
    ids = torch.full((len(groups), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(groups), width), dtype=torch.long)
    real = torch.zeros((len(groups), width), dtype=torch.long)
    targets = torch.zeros((len(groups), width), dtype=torch.bool)
    for i, group in enumerate(groups):
        at = 0
        for row in group:
            n = len(row.ids)
            ids[i, at : at + n] = torch.tensor(row.ids)
            positions[i, at : at + n] = torch.arange(n)
            real[i, at : at + n] = 1
            targets[i, at : at + n] = torch.tensor(row.targets)
            at += n
        positions[i, at:] = torch.arange(width - at)
    return ids, positions, real, targets


def padded_batch(rows: Sequence[SFTRow], pad_id: int) -> Batch:
    """One row per sequence, right-padded, with an attention mask."""
    ids, positions, real, targets = _sequences([[row] for row in rows], pad_id)
    return Batch(ids, positions, real, targets)


def packed_batch(rows: Sequence[SFTRow], pad_id: int, capacity: int) -> Batch:
    """The rows packed into as few sequences of at most `capacity` tokens as `pack` finds, without
    an attention mask (the positions part the rows)."""
    groups = [[rows[i] for i in group] for group in pack([len(row.ids) for row in rows], capacity)]
    ids, positions, _, targets = _sequences(groups, pad_id)
    return Batch(ids, positions, None, targets)
