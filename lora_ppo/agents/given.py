"""Rollouts made by the caller (`PPOTrainer.step`): token ids of queries and responses, and a
score per response, turned into the same `Rollout` a `train()` step builds by sampling."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from lora_ppo.data import PromptRow
from lora_ppo.memory import PhasePeaks
from lora_ppo.rollout import (
    Rollout, Sampler, join_prompt_response, left_pad, missing_eos_penalized, score_passes, stop_token_id,
)


def _ids(seq, what: str, i: int) -> list[int]:
    ids = seq.tolist() if isinstance(seq, torch.Tensor) else list(seq)
    if not ids or not all(isinstance(x, int) for x in ids):
        raise ValueError(f"step: {what} {i} must be a non-empty sequence of token ids, got {str(seq)[:60]!r}")
    return ids


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
    if not (len(queries) == len(responses) == len(scores)) or not queries:
        raise ValueError(f"step: got {len(queries)} queries, {len(responses)} responses and {len(scores)} scores; "
                         "they must be as many, and at least one")
    if action_mask is not None and len(action_mask) != len(responses):
        raise ValueError(f"step: action_mask has {len(action_mask)} rows for {len(responses)} responses")
    roles, cfg, tokenizer = sampler.roles, sampler.cfg, sampler.tokenizer
    device = roles.lm_head.weight.device
    peaks = peaks if peaks is not None else PhasePeaks()
    pad = tokenizer.pad_token_id
    query_lists = [_ids(q, "query", i) for i, q in enumerate(queries)]
    response_lists = [_ids(r, "response", i) for i, r in enumerate(responses)]
    rows = [PromptRow(tokenizer.decode(q, skip_special_tokens=True), "", tuple(q)) for q in query_lists]
    query_ids, query_mask = left_pad(rows, pad, device)
    T, B = max(map(len, response_lists)), len(query_lists)
    response_ids = torch.full((B, T), pad, dtype=torch.long)
    action = torch.zeros((B, T), dtype=torch.bool)
    observation = torch.zeros((B, T), dtype=torch.bool)
    for i, r in enumerate(response_lists):
        response_ids[i, : len(r)] = torch.tensor(r)
        acts = [True] * len(r) if action_mask is None else [bool(a) for a in action_mask[i]]
        if len(acts) != len(r):
            raise ValueError(f"step: action_mask row {i} has {len(acts)} entries for a response of {len(r)} tokens")
        action[i, : len(r)] = torch.tensor(acts)
        observation[i, : len(r)] = ~action[i, : len(r)]
    stop_id = stop_token_id(tokenizer, cfg.stop_token)
    stopped = torch.tensor([stop_id is not None and r[-1] == stop_id for r in response_lists], device=device)
    response_ids, action, observation = response_ids.to(device), action.to(device), observation.to(device)
    input_ids, attention_mask = join_prompt_response(query_ids, query_mask, response_ids, action | observation)
    with peaks.phase("score"):
        old_logprobs, ref_logprobs, values = score_passes(
            roles, input_ids, attention_mask, query_ids.shape[1], cfg.temperature, cfg.forward_batch_size,
            with_values=with_values, with_reference=with_reference, together=cfg.score_roles_together)
    raw_scores = torch.tensor([float(s) for s in scores], dtype=torch.float32, device=device)
    completions = tokenizer.batch_decode([[t for t, a in zip(r, action[i].tolist()) if a]
                                          for i, r in enumerate(response_lists)], skip_special_tokens=True)
    multi_turn = bool(observation.any())
    return Rollout(
        rows=rows, completions=completions, query_ids=query_ids, query_mask=query_mask, response_ids=response_ids,
        response_mask=action, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, values=values,
        raw_scores=raw_scores, scores=missing_eos_penalized(raw_scores, stopped, cfg), stopped=stopped,
        observation_mask=observation if multi_turn else None,
    )
