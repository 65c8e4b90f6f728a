"""Forward passes over the columns their rows use (`ppo.trim_padding`), and the choice of a
micro-batch's layout: cut to those columns, or packed (`ppo.packing`, lora_ppo/packing.py).

A rollout is one [B, P + T_resp] block: prompts left-padded to the longest prompt, responses
right-padded to the longest response. A micro-batch of a few of its rows needs only the columns
from its own longest prompt to its own longest response; the rest is padding that every layer
would compute and throw away. Cutting it changes no real token's numbers: a leading column no row
uses holds nothing any token attends to (positions count real tokens only), and a trailing one lies
after every real token (causal attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch

from lora_ppo.packing import PackedMicroBatch, packed_micro_batches


@dataclass(frozen=True)
class UsedColumns:
    """The columns a group of rows uses: `[first, first + response_start + response_width)` of the
    rollout's block, of which the response columns are the first `response_width` after the prompt."""

    first: int  # the first column kept
    response_start: int  # where the responses start in the kept columns
    response_width: int  # the response columns kept, from the rollout's first

    @classmethod
    def all_of(cls, attention_mask: torch.Tensor, response_start: int) -> "UsedColumns":
        return cls(0, response_start, attention_mask.shape[1] - response_start)

    @classmethod
    def of(cls, attention_mask: torch.Tensor, response_start: int) -> "UsedColumns":
        """The columns `attention_mask` [b, T] (prompt then response) has any real token in. At least the
        last prompt column and one response column stay, so every response position has a predecessor."""
        used = attention_mask.bool().any(dim=0)
        prompt_used = used[:response_start].nonzero()
        first = int(prompt_used[0]) if len(prompt_used) else response_start - 1
        response_used = used[response_start:].nonzero()
        width = int(response_used[-1]) + 1 if len(response_used) else 1
        return cls(first, response_start - first, width)

    def cut(self, block: torch.Tensor) -> torch.Tensor:
        """These columns of a [b, P + T_resp] block."""
        return block[:, self.first : self.first + self.response_start + self.response_width]

    def responses(self, per_token: torch.Tensor) -> torch.Tensor:
        """These columns of a [b, T_resp] per-token tensor."""
        return per_token[:, : self.response_width]


def used_columns(attention_mask: torch.Tensor, response_start: int, trim: bool) -> UsedColumns:
    """`UsedColumns.of` with `trim` (`ppo.trim_padding`), else every column."""
    if trim:
        return UsedColumns.of(attention_mask, response_start)
    return UsedColumns.all_of(attention_mask, response_start)


def pad_responses(per_token: torch.Tensor, width: int) -> torch.Tensor:
    """A [b, w] per-token tensor widened with zeros to [b, width] (the rollout's response width)."""
    return torch.nn.functional.pad(per_token, (0, width - per_token.shape[1]))


def longest_first(attention_mask: torch.Tensor) -> torch.Tensor:
    """Row indices ordered by real length, longest first (ties in their given order): consecutive
    micro-batches of this order hold rows of similar length, so each pads little."""
    return torch.sort(attention_mask.long().sum(dim=1), descending=True, stable=True).indices


@dataclass(frozen=True)
class CutMicroBatch:
    """Rows of a rollout over the columns they use (`cols`), ready for a forward."""

    rows: torch.Tensor  # the rows, on the device of the rollout's tensors
    host_rows: torch.Tensor  # the same rows, on the host
    cols: UsedColumns
    input_ids: torch.Tensor  # [b, cut columns]
    attention_mask: Optional[torch.Tensor]  # None where no kept position is padding
    host_mask: torch.Tensor  # the cut attention mask, on the host: counts without a read from the device

    position_ids = None  # counted from the attention mask

    @property
    def positions(self) -> int:
        return self.host_mask.numel()

    @property
    def real_positions(self) -> int:
        return int(self.host_mask.sum())

    @property
    def targets(self) -> torch.Tensor:
        """The response columns' tokens [b, response_width]."""
        return self.input_ids[:, self.cols.response_start :]

    def responses(self, per_token: torch.Tensor) -> torch.Tensor:
        """These rows' response columns kept, of their [b, T_resp] per-token tensor."""
        return self.cols.responses(per_token)

    def predicting(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states [b, response_width, H] that predict the response columns, of a forward's."""
        return hidden[:, self.cols.response_start - 1 : -1]

    @staticmethod
    def laid_out(per_token: torch.Tensor) -> torch.Tensor:
        """Per-token values of `targets`, already laid out as [b, response_width]."""
        return per_token


def cut_micro_batches(order: torch.Tensor, host_mask: torch.Tensor, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor, response_start: int, size: int,
                      trim: bool) -> Iterator[CutMicroBatch]:
    """The rows of `order` (on the host), `size` at a time, each cut to the columns it uses (with
    `trim`). Lengths and cuts come from `host_mask`, the host's copy of `attention_mask`: reading
    the device's per micro-batch would wait for the GPU each time. Without padding the forward gets
    no mask: the same causal attention, and nothing for transformers to read back."""
    on_device = order.to(input_ids.device)
    for start in range(0, len(order), size):
        host_rows, rows = order[start : start + size], on_device[start : start + size]
        cols = used_columns(host_mask[host_rows], response_start, trim)
        cut_host = cols.cut(host_mask[host_rows])
        mask = None if bool(cut_host.all()) else cols.cut(attention_mask[rows])
        yield CutMicroBatch(rows, host_rows, cols, cols.cut(input_ids[rows]), mask, cut_host)


MicroBatch = Union[CutMicroBatch, PackedMicroBatch]


def micro_batches(rows: torch.Tensor, host_mask: torch.Tensor, host_predicted: torch.Tensor,
                  input_ids: torch.Tensor, attention_mask: torch.Tensor, response_start: int, size: int,
                  packing: bool, trim: bool) -> Iterator[MicroBatch]:
    """The rows of a rollout (`rows`, on the host) as forwards: packed into `size` sequences each
    (`packing`: the positions of the host's [B, T_resp] `host_predicted` are predicted), or `size`
    rows each, cut to the columns they use (`trim`). Cut micro-batches take rows of similar length
    together where there is more than one of them; one micro-batch keeps the rows' order."""
    if packing:
        return packed_micro_batches(rows, host_mask, host_predicted, input_ids, response_start, size)
    if trim and len(rows) > size:
        rows = rows[longest_first(host_mask[rows])]
    return cut_micro_batches(rows, host_mask, input_ids, attention_mask, response_start, size, trim)
