"""`lora_ppo.rollout.truncate_at_stop`: the stop token is a real token, padding follows it."""

from __future__ import annotations

import torch

from lora_ppo.ppo_math import kl_shaped_rewards
from lora_ppo.rollout import truncate_at_stop

STOP, PAD = 2, 0


def ids(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


def masks(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def test_stop_token_kept_and_padding_after_it():
    raw = ids([[5, 6, STOP, 7, 8], [5, 6, 7, 8, 9], [STOP, 3, 4, 5, 6]])
    out, mask, stopped = truncate_at_stop(raw, (STOP,), PAD)
    assert torch.equal(out, ids([[5, 6, STOP, PAD, PAD], [5, 6, 7, 8, 9], [STOP, PAD, PAD, PAD, PAD]]))
    assert torch.equal(mask, masks([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]))
    assert torch.equal(stopped, masks([1, 0, 1]))
    assert mask.dtype == torch.bool and stopped.dtype == torch.bool
    # The input is left as it was.
    assert torch.equal(raw, ids([[5, 6, STOP, 7, 8], [5, 6, 7, 8, 9], [STOP, 3, 4, 5, 6]]))


def test_first_stop_counts():
    out, mask, stopped = truncate_at_stop(ids([[4, STOP, 5, STOP, 6]]), (STOP,), PAD)
    assert torch.equal(out, ids([[4, STOP]]))
    assert torch.equal(mask, masks([[1, 1]]))
    assert torch.equal(stopped, masks([1]))


def test_trimmed_to_longest_real_response():
    raw = ids([[5, STOP, 7, 8, 9, 9], [STOP, 9, 9, 9, 9, 9], [5, 6, 7, STOP, 9, 9]])
    out, mask, stopped = truncate_at_stop(raw, (STOP,), PAD)
    assert torch.equal(out, ids([[5, STOP, PAD, PAD], [STOP, PAD, PAD, PAD], [5, 6, 7, STOP]]))
    assert torch.equal(mask, masks([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]))
    assert torch.equal(stopped, masks([1, 1, 1]))


def test_no_stop_id_keeps_everything():
    raw = ids([[5, STOP, 7], [8, 9, PAD]])
    out, mask, stopped = truncate_at_stop(raw, (), PAD)
    assert torch.equal(out, raw)
    assert torch.equal(mask, torch.ones(2, 3, dtype=torch.bool))
    assert torch.equal(stopped, masks([0, 0]))


def test_pad_equal_to_eos():
    # generate() pads finished rows with eos when pad == eos: only the first one is real.
    eos = pad = 2
    raw = ids([[5, eos, eos, eos], [5, 6, eos, eos], [eos, eos, eos, eos]])
    out, mask, stopped = truncate_at_stop(raw, (eos,), pad)
    assert torch.equal(out, ids([[5, eos, eos], [5, 6, eos], [eos, eos, eos]]))
    assert torch.equal(mask, masks([[1, 1, 0], [1, 1, 1], [1, 0, 0]]))
    assert torch.equal(stopped, masks([1, 1, 1]))

    # And the score then lands on that stop token, not on the pad (same id) after it.
    logprobs = torch.full(out.shape, -1.0, dtype=torch.float64)
    rewards, _ = kl_shaped_rewards(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), logprobs, logprobs, mask, 0.1)
    expected = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [3.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(rewards, expected, atol=0.0, rtol=0.0)


def test_no_row_stops():
    raw = ids([[5, 6, 7], [8, 9, 10]])
    out, mask, stopped = truncate_at_stop(raw, (STOP,), PAD)
    assert torch.equal(out, raw)
    assert torch.equal(mask, torch.ones(2, 3, dtype=torch.bool))
    assert torch.equal(stopped, masks([0, 0]))


def test_empty_batches_keep_no_column():
    """No rows: nothing to keep (not one column of padding), for the truncation and the prompts."""
    from lora_ppo.rollout import left_pad

    out, mask, stopped = truncate_at_stop(torch.zeros(0, 4, dtype=torch.long), (STOP,), PAD)
    assert out.shape == mask.shape == (0, 0) and stopped.shape == (0,)
    ids, attention = left_pad([], PAD, "cpu")
    assert ids.shape == attention.shape == (0, 0)


def _samples_with_a_stop_before_the_end():
    """Row 0 stopped after 2 tokens (padding follows), row 1 ran to the limit; prompts left-padded."""
    from lora_ppo.rollout import Samples

    return Samples(query_ids=ids([[PAD, 11, 12], [13, 14, 15]]), query_mask=ids([[0, 1, 1], [1, 1, 1]]),
                   response_ids=ids([[21, STOP, PAD, PAD], [22, 23, 24, 25]]),
                   response_mask=masks([[1, 1, 0, 0], [1, 1, 1, 1]]), stopped=masks([1, 0]),
                   completions=["a", "bcde"])


def test_a_reward_reading_the_last_token_reads_the_stop_token_not_the_padding_after_it():
    """What a reward adapter (or a classifier at the last token) is given: the rollout's own
    model input, whose attention mask ends at the stop token; the padding after it is not read."""
    from lora_ppo.rewards import AdapterReward, RewardBatch, RewardSources
    from lora_ppo.data import PromptRow
    from lora_ppo.roles import last_real_index

    samples = _samples_with_a_stop_before_the_end()
    read = []

    def last_token_scorer(input_ids, attention_mask):  # reads as a reward adapter does
        last = input_ids.gather(1, last_real_index(attention_mask).unsqueeze(1)).squeeze(1)
        read.extend(last.tolist())
        return last.float()

    rows = [PromptRow("p0", "p0", (11, 12)), PromptRow("p1", "p1", (13, 14, 15))]
    batch = RewardBatch.from_rows(rows, samples.completions, samples.completion_ids(), samples.model_input())
    assert RewardSources.of(AdapterReward(last_token_scorer, 8)).score(batch).total == [float(STOP), 25.0]
    assert read == [STOP, 25]


def test_completion_ids_are_each_responses_real_tokens_with_its_stop_token():
    """What the documented generate() / step() loop hands to step() and to reward functions."""
    samples = _samples_with_a_stop_before_the_end()
    assert samples.completion_ids() == [[21, STOP], [22, 23, 24, 25]]
    assert samples.action_mask() == [[True, True], [True] * 4]
    assert samples.queries() == [[11, 12], [13, 14, 15]]
