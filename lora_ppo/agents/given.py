"""Rollouts made by the caller (`PPOTrainer.step`): token ids of queries and responses, and a
score per response, turned into the same `Rollout` a `train()` step builds by sampling."""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

import torch

from lora_ppo.data import PromptRow
from lora_ppo.memory import PhasePeaks
from lora_ppo.rollout import (
    Rollout, Sampler, join_prompt_response, left_pad, missing_eos_penalized, score_passes,
)


def _ids(seq, what: str, i: int, vocab_size: int) -> list[int]:
    ids = _as_list(seq)
    if not ids or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in ids):
        raise ValueError(f"step: {what} {i} must be a non-empty sequence of token ids, got {str(seq)[:60]!r}")
    ids = [int(x) for x in ids]
    outside = next(((at, x) for at, x in enumerate(ids) if not 0 <= x < vocab_size), None)
    if outside is not None:
        raise ValueError(f"step: {what} {i} has the token id {outside[1]} at position {outside[0]}, outside the "
                         f"model's vocabulary (ids 0 to {vocab_size - 1})")
    return ids


def _as_list(value: Any) -> Optional[list]:
    """The items of a list, tuple, tensor or array (numpy, pandas: anything with `tolist`), as a list;
    None for text or a single value."""
    if isinstance(value, (str, bytes)):
        return None
    if hasattr(value, "tolist"):
        items = value.tolist()
        return items if isinstance(items, list) else None  # a 0-d tensor or array gives one value
    return list(value) if isinstance(value, Sequence) else None


def _scores(scores: Any) -> list[float]:
    """One finite number per response; text is refused even when it reads as one ("0.1"), as
    reward functions' text is."""
    values = _as_list(scores)
    if values is None:
        raise ValueError(f"step: scores must be one number per response, got {str(scores)[:60]!r}")
    values = [v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v for v in values]  # TRL's form
    for i, score in enumerate(values):
        number = isinstance(score, numbers.Real) and not isinstance(score, bool)
        if not number or not math.isfinite(float(score)):
            kind = "text" if isinstance(score, (str, bytes)) else "not a finite number"
            raise ValueError(f"step: scores[{i}] is {kind} ({score!r}); give one finite number per response")
    return [float(score) for score in values]


def _action_rows(action_mask: Any, lengths: list[int]) -> list[list[bool]]:
    """One row of booleans per response, as long as it, with at least one action token."""
    given = _as_list(action_mask)
    if given is None or len(given) != len(lengths):
        got = f"{len(given)} rows" if given is not None else repr(action_mask)[:60]
        raise ValueError(f"step: action_mask must be one list of booleans per response ({len(lengths)}), got {got}")
    rows = []
    for i, (row, length) in enumerate(zip(given, lengths)):
        values = _as_list(row)
        if values is None or not all(isinstance(a, bool) or a in (0, 1) for a in values):
            raise ValueError(f"step: action_mask row {i} must be a list of booleans, got {str(row)[:60]!r}")
        if len(values) != length:
            raise ValueError(f"step: action_mask row {i} has {len(values)} entries for a response of {length} tokens")
        if not any(values):
            raise ValueError(f"step: action_mask row {i} marks no token as the policy's: a response needs at least "
                             "one action token (the score sits on its last one)")
        rows.append([bool(a) for a in values])
    return rows


def rollout_from_tokens(
    sampler: Sampler,
    queries: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    scores: Sequence[float],
    action_mask: Optional[Sequence[Sequence[bool]]] = None,
    with_values: bool = True,
    with_reference: bool = True,
    peaks: Optional[PhasePeaks] = None,
) -> Rollout:
    """Left-padded queries, right-padded responses, the response tokens the caller marked as
    actions (all of them by default), then old and reference logprobs and values scored as in
    `collect_rollout`. A response that ends with the stop token counts as stopped; the recipe's
    `missing_eos_penalty` applies to the others, as in a sampled rollout."""
    given = [(x, _as_list(x)) for x in (queries, responses, scores)]
    if any(items is None for _, items in given) or len({len(items) for _, items in given}) != 1 or not given[0][1]:
        counts = [len(items) if items is not None else repr(x)[:20] for x, items in given]
        raise ValueError(f"step: got {counts[0]} queries, {counts[1]} responses and {counts[2]} scores; they must be "
                         "as many, and at least one")
    queries, responses, scores = (items for _, items in given)
    roles, cfg, tokenizer = sampler.roles, sampler.cfg, sampler.tokenizer
    device = roles.lm_head.weight.device
    peaks = peaks if peaks is not None else PhasePeaks()
    pad = tokenizer.pad_token_id
    vocab_size = roles.peft.get_input_embeddings().num_embeddings
    query_lists = [_ids(q, "query", i, vocab_size) for i, q in enumerate(queries)]
    response_lists = [_ids(r, "response", i, vocab_size) for i, r in enumerate(responses)]
    score_values = _scores(scores)
    action_rows = None if action_mask is None else _action_rows(action_mask, [len(r) for r in response_lists])
    rows = [PromptRow(tokenizer.decode(q, skip_special_tokens=True), "", tuple(q)) for q in query_lists]
    query_ids, query_mask = left_pad(rows, pad, device)
    T, B = max(map(len, response_lists)), len(query_lists)
    response_ids = torch.full((B, T), pad, dtype=torch.long)
    action = torch.zeros((B, T), dtype=torch.bool)
    observation = torch.zeros((B, T), dtype=torch.bool)
    for i, r in enumerate(response_lists):
        response_ids[i, : len(r)] = torch.tensor(r)
        acts = [True] * len(r) if action_rows is None else action_rows[i]
        action[i, : len(r)] = torch.tensor(acts)
        observation[i, : len(r)] = ~action[i, : len(r)]
    stop_ids = sampler.stop_ids
    stopped = torch.tensor([r[-1] in stop_ids for r in response_lists], device=device)
    response_ids, action, observation = response_ids.to(device), action.to(device), observation.to(device)
    input_ids, attention_mask = join_prompt_response(query_ids, query_mask, response_ids, action | observation)
    with peaks.phase("score"):
        old_logprobs, ref_logprobs, values = score_passes(
            roles, input_ids, attention_mask, query_ids.shape[1], cfg.temperature, cfg.forward_batch_size,
            with_values=with_values, with_reference=with_reference, together=cfg.score_roles_together)
    raw_scores = torch.tensor(score_values, dtype=torch.float32, device=device)
    completions = tokenizer.batch_decode([[t for t, a in zip(r, action[i].tolist()) if a]
                                          for i, r in enumerate(response_lists)], skip_special_tokens=True)
    multi_turn = bool(observation.any())
    return Rollout(
        rows=rows, completions=completions, query_ids=query_ids, query_mask=query_mask, response_ids=response_ids,
        response_mask=action, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, values=values,
        raw_scores=raw_scores, scores=missing_eos_penalized(raw_scores, stopped, cfg), stopped=stopped,
        observation_mask=observation if multi_turn else None,
    )
