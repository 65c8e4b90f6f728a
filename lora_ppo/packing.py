"""Rows packed back to back into a few sequences, so a forward computes (almost) no padding
(`ppo.packing`, `sft.packing`).

A rollout is one [B, P + T_resp] block: prompts left-padded, responses right-padded. Packed, each
row's real tokens follow the row before them, each row with its own positions from 0:

    rollout rows:  | [PAD] [PAD] prompt | answer [PAD] [PAD] |     packed: | prompt answer prompt answer |
                   | [PAD] prompt prompt | answer answer [PAD] |            | prompt prompt answer answer [PAD] |
                   | prompt prompt prompt | ans [PAD] [PAD] |

A packed sequence has no attention mask: transformers finds where each row starts from the
positions (a position that is not the one before plus one) and masks the rows apart
(`Backbone.check_packing` makes sure a model's attention does). The padding at the end of a shorter
sequence is a row of its own, never predicted from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch


def pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: row indices grouped into as few bins of `capacity` tokens as it finds,
    the longest rows placed first, each into the fullest bin it fits. Every length must fit."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [b for b in range(len(bins)) if room[b] >= lengths[index]]
        if not fits:
            bins.append([])
            room.append(capacity)
            fits = [len(bins) - 1]
        best = min(fits, key=lambda b: room[b])
        bins[best].append(index)
        room[best] -= lengths[index]
    return bins


@dataclass(frozen=True)
class PackedMicroBatch:
    """Rows of a rollout packed into sequences, ready for a forward, and where each of their response
    tokens is predicted. The rows' per-token tensors keep the rollout's layout: [rows, response_width]."""

    rows: torch.Tensor  # the rows, on the device of the rollout's tensors
    host_rows: torch.Tensor  # the same rows, on the host
    input_ids: torch.Tensor  # [S, L] packed sequences
    position_ids: torch.Tensor  # [S, L] each row's positions from 0 (the tail's padding too)
    predictors: torch.Tensor  # [N] flat index into [S * L] of the position predicting each response token
    slots: torch.Tensor  # [N] flat index into [rows, response_width] of that token
    response_width: int  # response columns kept, from the rollout's first
    real_positions: int  # the rows' real tokens, of the S * L positions a forward computes

    attention_mask = None  # the positions part the rows

    @property
    def positions(self) -> int:
        return self.input_ids.numel()

    @property
    def targets(self) -> torch.Tensor:
        """The response tokens [1, N], in the order of `predictors`."""
        return self.input_ids.flatten()[self.predictors + 1].unsqueeze(0)

    def responses(self, per_token: torch.Tensor) -> torch.Tensor:
        """These rows' response columns kept, of their [b, T_resp] per-token tensor."""
        return per_token[:, : self.response_width]

    def predicting(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states [1, N, H] that predict the response tokens, of a forward's [S, L, H]."""
        return hidden.flatten(0, 1)[self.predictors].unsqueeze(0)

    def laid_out(self, per_token: torch.Tensor) -> torch.Tensor:
        """Values [1, N] of the response tokens laid out as [rows, response_width]; 0 where no response
        token is (padding, or a token the response mask leaves out)."""
        flat = per_token.new_zeros(len(self.rows) * self.response_width)
        return flat.scatter(0, self.slots, per_token[0]).view(len(self.rows), self.response_width)


@dataclass(frozen=True)
class _Layout:
    """One packed micro-batch on the host: its rows, and per packed position its source in the rollout."""

    rows: list[int]
    shape: tuple[int, int]  # (S, L)
    sources: torch.Tensor  # flat index into the rollout's [B, P + T_resp] of each real token
    destinations: torch.Tensor  # flat index into [S * L] of each
    positions: torch.Tensor  # [S, L]
    predictors: torch.Tensor
    slots: torch.Tensor
    response_width: int


def _layout(groups: list[list[int]], attention: torch.Tensor, response: torch.Tensor, response_start: int) -> _Layout:
    """The layout of sequences that each hold the rollout rows of one group back to back."""
    real_cols = {row: attention[row].nonzero().squeeze(1) for group in groups for row in group}
    flat_rows = [row for group in groups for row in group]
    lengths = {row: len(cols) for row, cols in real_cols.items()}
    width = max(sum(lengths[row] for row in group) for group in groups)
    response_width = max((int(response[row].nonzero().max()) + 1 for row in flat_rows if response[row].any()), default=1)
    positions = torch.zeros((len(groups), width), dtype=torch.long)
    sources, destinations, predictors, slots = [], [], [], []
    for s, group in enumerate(groups):
        used = 0  # tokens of this sequence placed so far
        for row in group:
            cols, n, at = real_cols[row], lengths[row], s * width + used  # `at`: the row's first flat index
            sources.append(row * attention.shape[1] + cols)
            destinations.append(torch.arange(at, at + n))
            positions[s, used : used + n] = torch.arange(n)
            tokens = response[row].nonzero().squeeze(1)  # response columns holding a token to predict
            columns = tokens + response_start
            if len(tokens) and not (attention[row, columns].all() and attention[row, : columns[0]].any()):
                raise ValueError(f"row {row}: a response token outside the attention mask, or with no token before it")
            predictors.append(at + torch.searchsorted(cols, columns) - 1)  # the row's token before each
            slots.append(len(slots) * response_width + tokens)  # the row's place among the micro-batch's rows
            used += n
        positions[s, used:] = torch.arange(width - used)  # the tail's padding: a row of its own
    return _Layout(flat_rows, (len(groups), width), torch.cat(sources), torch.cat(destinations), positions,
                   torch.cat(predictors), torch.cat(slots), response_width)


def packed_micro_batches(order: torch.Tensor, host_mask: torch.Tensor, host_response: torch.Tensor,
                         input_ids: torch.Tensor, response_start: int, size: int) -> Iterator[PackedMicroBatch]:
    """The rows of `order` (on the host) packed into sequences of at most the rollout's width, `size`
    sequences a micro-batch: no micro-batch holds more tokens than `size` rows at full width, the memory
    the estimate counts, and short rows share sequences, so fewer micro-batches run. Every index is made
    from `host_mask` and `host_response` (the host's copies of the attention and response masks) and
    goes to the device in one copy: a read from the device would wait for the GPU."""
    lengths = host_mask[order].sum(dim=1).tolist()
    bins = [[int(order[i]) for i in group] for group in pack(lengths, host_mask.shape[1])]
    layouts = [_layout(bins[start : start + size], host_mask, host_response, response_start)
               for start in range(0, len(bins), size)]
    parts = [(torch.tensor(layout.rows), layout.sources, layout.destinations, layout.positions.flatten(),
              layout.predictors, layout.slots) for layout in layouts]
    host = torch.cat([t for part in parts for t in part])
    on_device = host.to(input_ids.device).split([len(t) for part in parts for t in part])
    flat_ids = input_ids.flatten()
    for i, layout in enumerate(layouts):
        rows, sources, destinations, positions, predictors, slots = on_device[6 * i : 6 * i + 6]
        packed = flat_ids.new_zeros(layout.shape[0] * layout.shape[1])  # the tail's padding: token 0
        packed[destinations] = flat_ids[sources]
        yield PackedMicroBatch(rows, parts[i][0], packed.view(layout.shape), positions.view(layout.shape), predictors,
                               slots, layout.response_width, len(sources))
