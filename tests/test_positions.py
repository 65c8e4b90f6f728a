"""Which position every read comes from, checked against forwards written here on each row
alone, unpadded: the value and the logprob of response token t read the hidden state at
`response_start - 1 + t` (the one that predicts it), a score head reads the last real token,
under left padding of prompts and right padding after the stop token; and the masks, positions
and completion ids the rollout builds for them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lora_ppo.config import AdaptersConfig, ModelConfig, RolloutConfig
from lora_ppo.model import load_base_model
from lora_ppo.rewards import RewardSources
from lora_ppo.roles import POLICY, REWARD, REWARD_HEAD_FILE, VALUE, VALUE_HEAD_FILE, RoleModel, last_real_index, \
    position_ids_for
from lora_ppo.rollout import Samples, collect_rollout, join_prompt_response, left_pad, truncate_at_stop
from tests.conftest import prompt_rows

# The tiny tokenizer pads with its eos (<|im_end|>), as many chat models do.
EOS = PAD = 2
# The forwards here run the same 4-bit model on each row alone (other shapes, no padding) instead of
# on the padded batch: float32 sums then add up in another order, which moves values and logprobs
# of order 1-10 by up to ~6e-6 (measured); a read one position off moves them by > 1e-2.
ATOL = 1e-5
PROMPTS = ["This movie was", "I hated the plot, the pacing was terrible", "A dull sequel"]


def ids(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


@pytest.fixture(scope="module")
def roles(make_roles):
    """Policy and value adapters perturbed, and a random value head: PEFT starts B at zero and
    lora_ppo starts the head at zero, and with either the reads would not depend on position."""
    roles = make_roles(seed=5, scale=0.4)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():  # nn.Linear's own scale (1 / sqrt(H)): values of order 1
        weight = roles.value_head.weight
        weight.copy_(torch.randn(weight.shape, generator=g) / weight.shape[1] ** 0.5)
        roles.value_head.bias.fill_(0.25)
    return roles


@pytest.fixture(scope="module")
def batch(tiny_tokenizer):
    """Left-padded prompts of three lengths, then responses cut at their stop token: row 0 stops at
    its third token, row 1 never stops, row 2 stops at its first token."""
    assert tiny_tokenizer.eos_token_id == EOS and tiny_tokenizer.pad_token_id == PAD
    rows = prompt_rows(tiny_tokenizer, PROMPTS)
    query_ids, query_mask = left_pad(rows, PAD, "cpu")
    lengths = [len(r.ids) for r in rows]
    assert len(set(lengths)) == 3 and query_mask.sum(1).tolist() == lengths  # really left-padded
    assert query_mask[:, -1].all()
    response_ids = ids([[40, 41, EOS, PAD, PAD, PAD], [50, 51, 52, 53, 54, 55], [EOS, PAD, PAD, PAD, PAD, PAD]])
    response_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    input_ids, attention_mask = join_prompt_response(query_ids, query_mask, response_ids, response_mask)
    assert torch.equal(input_ids, torch.cat([query_ids, response_ids], 1))
    assert torch.equal(attention_mask, torch.cat([query_mask, response_mask.long()], 1))
    return dict(rows=rows, query_ids=query_ids, query_mask=query_mask, input_ids=input_ids,
                attention_mask=attention_mask, response_start=query_ids.shape[1], prompt_lengths=lengths,
                response_ids=response_ids, response_mask=response_mask)


def real_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, row: int) -> torch.Tensor:
    """The row's tokens without any padding, [1, n]."""
    return input_ids[row][attention_mask[row].bool()].unsqueeze(0)


def plain_hidden(roles, role, tokens: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states of one unpadded sequence as `role`, default positions. [n, H]"""
    with torch.no_grad(), roles.as_role(role):
        return roles.peft.get_base_model().get_decoder()(input_ids=tokens).last_hidden_state[0]


def head_of(linear: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden, linear.weight, linear.bias).squeeze(-1)


def value_head_at_last_token(roles, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The value head on the value role's hidden state of each row's last real token, each row alone. [B]"""
    rows = range(input_ids.shape[0])
    last_hidden = [plain_hidden(roles, VALUE, real_tokens(input_ids, attention_mask, row))[-1] for row in rows]
    return head_of(roles.value_head, torch.stack(last_hidden))


# ---- positions and masks on hand-made tensors -------------------------------------------------


def test_position_ids_of_a_left_padded_prompt_are_those_of_the_prompt_unpadded():
    mask = ids([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 0, 0, 0, 1]])
    expected = ids([[-1, -1, 0, 1, 2], [0, 1, 2, 3, 4], [-1, 0, 1, 2, -1], [-1, -1, -1, -1, 0]])  # -1: padding
    got = position_ids_for(mask)
    real = mask.bool()
    assert torch.equal(got[real], expected[real])
    # Padding is never attended to, but it still indexes learned position embeddings (OPT, GPT-2).
    assert got.min() >= 0


@pytest.mark.parametrize("mask, last", [
    ([[1, 1, 1, 1]], [3]),
    ([[0, 0, 1, 1]], [3]),  # left padding
    ([[1, 1, 0, 0]], [1]),  # right padding
    ([[0, 1, 1, 0]], [2]),  # both
    ([[0, 0, 0, 1], [1, 0, 0, 0]], [3, 0]),
    ([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0]], [3, 4, 2]),
])
def test_last_real_index_on_hand_made_masks(mask, last):
    assert last_real_index(ids(mask)).tolist() == last
    assert last_real_index(torch.tensor(mask, dtype=torch.bool)).tolist() == last


def test_left_pad_puts_each_prompt_at_the_right_end(tiny_tokenizer):
    rows = prompt_rows(tiny_tokenizer, ["This movie was", "A dull sequel with bad dialogue"])
    query_ids, query_mask = left_pad(rows, PAD, "cpu")
    width = max(len(r.ids) for r in rows)
    for row, q, m in zip(rows, query_ids, query_mask):
        n = len(row.ids)
        assert q.tolist() == [PAD] * (width - n) + list(row.ids)
        assert m.tolist() == [0] * (width - n) + [1] * n


@pytest.mark.parametrize("raw, stop, out, mask, stopped", [
    # pad == eos: the first eos is the real stop token; the eos after it are padding.
    ([[7, EOS, EOS, EOS], [7, 8, 9, EOS]], (EOS,), [[7, EOS, PAD, PAD], [7, 8, 9, EOS]],
     [[1, 1, 0, 0], [1, 1, 1, 1]], [True, True]),
    # No stop token anywhere: everything is real, nothing stopped.
    ([[7, 8, 9], [4, 5, 6]], (EOS,), [[7, 8, 9], [4, 5, 6]], [[1, 1, 1], [1, 1, 1]], [False, False]),
    # Stop at position 0 in every row: one real token each, trimmed to it.
    ([[EOS, 8, 9], [EOS, EOS, 6]], (EOS,), [[EOS], [EOS]], [[1], [1]], [True, True]),
    # No stop ids: never cut, even at tokens equal to pad/eos; no row counts as stopped.
    ([[7, EOS, 9], [EOS, PAD, 5]], (), [[7, EOS, 9], [EOS, PAD, 5]], [[1, 1, 1], [1, 1, 1]], [False, False]),
    # A stop token other than pad: what follows it becomes pad.
    ([[7, 5, 9, 9], [5, 9, 9, 9]], (5,), [[7, 5], [5, PAD]], [[1, 1], [1, 0]], [True, True]),
    # Several stop tokens (an end-of-turn token beside the eos): each row ends at the first of any.
    ([[7, 5, 9, EOS], [7, EOS, 5, 9], [7, 8, 5, EOS], [7, 8, 9, 9]], (EOS, 5),
     [[7, 5, PAD, PAD], [7, EOS, PAD, PAD], [7, 8, 5, PAD], [7, 8, 9, 9]],
     [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], [True, True, True, False]),
])
def test_truncate_at_stop_hand_cases(raw, stop, out, mask, stopped):
    got_ids, got_mask, got_stopped = truncate_at_stop(ids(raw), stop, PAD)
    assert got_ids.tolist() == out
    assert got_mask.tolist() == [[bool(x) for x in row] for row in mask]
    assert got_stopped.tolist() == stopped


def test_completion_ids_stop_at_and_include_the_stop_token_without_padding():
    # As truncate_at_stop leaves them (pad == eos): the first eos is real, the rest is padding.
    response_ids = ids([[11, 12, EOS, PAD, PAD], [13, EOS, PAD, PAD, PAD], [17, 18, 19, 20, 21],
                        [EOS, PAD, PAD, PAD, PAD]])
    response_mask = ids([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]).bool()
    stopped = torch.tensor([True, True, False, True])
    samples = Samples(ids([[1], [1], [1], [1]]), ids([[1], [1], [1], [1]]), response_ids, response_mask, stopped,
                      ["", "", "", ""])
    assert samples.completion_ids() == [[11, 12, EOS], [13, EOS], [17, 18, 19, 20, 21], [EOS]]


# ---- positions read from the model, against forwards on each row alone ------------------------


def test_value_of_response_token_t_reads_the_hidden_state_that_predicts_it(roles, batch):
    ids_, mask, start = batch["input_ids"], batch["attention_mask"], batch["response_start"]
    with torch.no_grad(), roles.as_role(VALUE):
        values = roles.values(ids_, mask, start)  # [B, T_resp]
    assert values.shape == batch["response_mask"].shape
    for row, (p, n) in enumerate(zip(batch["prompt_lengths"], batch["response_mask"].sum(1).tolist())):
        hidden = plain_hidden(roles, VALUE, real_tokens(ids_, mask, row))
        # V_t is read where response token t is predicted: the prompt's last token for t = 0.
        expected = head_of(roles.value_head, hidden[p - 1 : p - 1 + n])
        torch.testing.assert_close(values[row, :n], expected, atol=ATOL, rtol=1e-5)
    # The value head is not constant along the sequence, so a read one position off would differ.
    assert (values[1, 1:] - values[1, :-1]).abs().min() > 1e-2


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_of_response_token_t_comes_from_the_position_before_it(roles, batch, temperature):
    ids_, mask, start = batch["input_ids"], batch["attention_mask"], batch["response_start"]
    with torch.no_grad(), roles.as_role(POLICY):
        logprobs, _ = roles.response_logprobs(ids_, mask, start, temperature)
        from_hidden, _ = roles.logprobs_from_hidden(roles.hidden_states(ids_, mask), ids_, start, temperature)
    torch.testing.assert_close(from_hidden, logprobs, atol=0.0, rtol=0.0)
    for row, (p, n) in enumerate(zip(batch["prompt_lengths"], batch["response_mask"].sum(1).tolist())):
        tokens = real_tokens(ids_, mask, row)
        with torch.no_grad(), roles.as_role(POLICY):
            logits = roles.peft(input_ids=tokens).logits[0].float()  # the model's own forward, LM head included
        dist = torch.log_softmax(logits[p - 1 : p - 1 + n] / temperature, dim=-1)
        expected = dist.gather(-1, tokens[0, p : p + n, None]).squeeze(-1)
        torch.testing.assert_close(logprobs[row, :n], expected, atol=ATOL, rtol=1e-5)


def test_logprobs_match_the_models_own_forward_on_the_padded_batch(roles, batch):
    # The padded batch itself, with positions written out here: each prompt's real tokens count from 0.
    ids_, mask, start = batch["input_ids"], batch["attention_mask"], batch["response_start"]
    width = ids_.shape[1]
    positions = torch.zeros_like(ids_)
    for row in range(ids_.shape[0]):
        first = start - batch["prompt_lengths"][row]  # the prompt's first real token
        positions[row, first:] = torch.arange(width - first)
    with torch.no_grad(), roles.as_role(POLICY):
        logprobs, _ = roles.response_logprobs(ids_, mask, start, 1.0)
        logits = roles.peft(input_ids=ids_, attention_mask=mask, position_ids=positions).logits.float()
    expected = torch.log_softmax(logits[:, start - 1 : -1], -1).gather(-1, ids_[:, start:, None]).squeeze(-1)
    real = batch["response_mask"]
    torch.testing.assert_close(logprobs[real], expected[real], atol=ATOL, rtol=1e-5)


# A pad token other than the stop token, as tokenizers with a pad token of their own have. With pad ==
# eos a pad after the stop token has the stop token's id and position and sees the same tokens, so its
# hidden state is the stop token's: only a distinct pad shows a read past the last real token.
OWN_PAD = 0


def padded_batches(tokenizer, pad: int):
    """{name: (input_ids, attention_mask)} with left padding only, right padding only, and both."""
    same = ["This movie was", "The film is a"]
    assert len(tokenizer(same[0])["input_ids"]) == len(tokenizer(same[1])["input_ids"])
    cases = {}
    for name, prompts, raw in [
        ("left", PROMPTS[:2], [[40, 41, 42], [50, 51, 52]]),
        ("right", same, [[40, EOS, 42, 43], [50, 51, 52, EOS]]),
        ("both", PROMPTS, [[40, 41, EOS, 43], [50, 51, 52, 53], [EOS, 61, 62, 63]]),
    ]:
        q_ids, q_mask = left_pad(prompt_rows(tokenizer, prompts), pad, "cpu")
        r_ids, r_mask, _ = truncate_at_stop(ids(raw), (EOS,), pad)
        cases[name] = join_prompt_response(q_ids, q_mask, r_ids, r_mask)
    return cases


@pytest.mark.parametrize("pad", [PAD, OWN_PAD])
@pytest.mark.parametrize("padding", ["left", "right", "both"])
def test_sequence_scores_read_the_last_real_token(roles, tiny_tokenizer, padding, pad):
    input_ids, attention_mask = padded_batches(tiny_tokenizer, pad)[padding]
    left = (attention_mask[:, 0] == 0).any().item()
    right = (attention_mask[:, -1] == 0).any().item()
    assert (left, right) == {"left": (True, False), "right": (False, True), "both": (True, True)}[padding]
    with torch.no_grad(), roles.as_role(VALUE):
        scores = roles.sequence_scores(VALUE, input_ids, attention_mask)
    expected = value_head_at_last_token(roles, input_ids, attention_mask)
    torch.testing.assert_close(scores, expected, atol=ATOL, rtol=1e-5)


def test_reward_adapter_scores_the_last_real_token(roles, tiny_model_dir, tiny_tokenizer, tmp_path_factory):
    # A reward adapter folder holding the value adapter and its head: the reward role must then
    # score exactly what the value head says at each sequence's last real token.
    folder = tmp_path_factory.mktemp("reward-adapter") / "reward"
    roles.save_adapter(VALUE, folder)
    (folder / VALUE_HEAD_FILE).rename(folder / REWARD_HEAD_FILE)
    settings = {"policy": {"r": 4, "alpha": 8}, "value": {"r": 4, "alpha": 8}}
    scorer = RoleModel(load_base_model(ModelConfig(name=str(tiny_model_dir))), AdaptersConfig(**settings),
                       reward_adapter=str(folder))
    for pad in (PAD, OWN_PAD):
        for padding, (input_ids, attention_mask) in padded_batches(tiny_tokenizer, pad).items():
            scores = scorer.reward_scores(input_ids, attention_mask)
            expected = value_head_at_last_token(roles, input_ids, attention_mask)
            torch.testing.assert_close(scores, expected, atol=ATOL, rtol=1e-5, msg=f"{padding} padding, pad {pad}")
    assert scorer.heads[REWARD].weight.abs().sum() > 0


# ---- what reward functions are given ----------------------------------------------------------


class FixedSampler:
    """Stands in for `Sampler`: returns the given samples instead of generating."""

    def __init__(self, roles, cfg: RolloutConfig, samples: Samples):
        self.roles, self.cfg, self.samples = roles, cfg, samples

    def sample(self, rows, record_logprobs=False, role=POLICY, seeds=None) -> Samples:
        return self.samples


def test_reward_functions_get_completion_ids_up_to_the_stop_token(roles, batch, tiny_tokenizer):
    seen = []

    def records(prompts, completions, completion_ids):
        seen.append(completion_ids)
        return [0.0] * len(completions)

    stopped = torch.tensor([True, False, True])
    samples = Samples(batch["query_ids"], batch["query_mask"], batch["response_ids"], batch["response_mask"], stopped,
                      tiny_tokenizer.batch_decode(batch["response_ids"], skip_special_tokens=True))
    cfg = RolloutConfig(forward_batch_size=2, logprobs_from_generation=False)
    collect_rollout(FixedSampler(roles, cfg, samples), batch["rows"], RewardSources.of(records))
    assert seen == [[[40, 41, EOS], [50, 51, 52, 53, 54, 55], [EOS]]]
