"""ppo.trim_padding: scoring and update micro-batches over the columns their rows use give every real
token the numbers a plain forward of that sequence alone gives, and today's update; the padding they
skip is what `update/padding_frac` reports, counted here by hand."""

from __future__ import annotations

import pytest
import torch

import lora_ppo
from lora_ppo.config import PPOConfig
from lora_ppo.padding import UsedColumns, longest_first, micro_batches
from lora_ppo.roles import POLICY, REFERENCE, VALUE
from lora_ppo.rollout import Rollout, score_passes
from lora_ppo.update import UpdateSettings, compute_advantages, ppo_update
from tests.conftest import clip_counts_within_a_token, deterministic_metrics, scored_rollout, tiny_recipe_dict

PROMPT_LENGTHS = [2, 5, 3, 6]
RESPONSE_LENGTHS = [4, 1, 6, 2]
WIDTH = 6  # prompts are left-padded to 6 columns, responses right-padded to 6


def test_the_used_columns_of_a_mask_by_hand():
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0],
                         [0, 1, 1, 1, 1, 0, 0]])
    cols = UsedColumns.of(mask, response_start=4)
    assert (cols.first, cols.response_start, cols.response_width) == (1, 3, 2)
    assert cols.cut(mask).tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # No response token at all: the last prompt column and one response column stay.
    empty = UsedColumns.of(torch.tensor([[0, 1, 1, 0, 0]]), response_start=3)
    assert (empty.first, empty.response_start, empty.response_width) == (1, 2, 1)
    # No prompt token at all: the last prompt column still stays, the first response token's predecessor.
    no_prompt = UsedColumns.of(torch.tensor([[0, 0, 1, 1, 0]]), response_start=2)
    assert (no_prompt.first, no_prompt.response_start, no_prompt.response_width) == (1, 1, 2)
    assert longest_first(torch.tensor([[1, 0], [1, 1], [0, 0], [0, 1]])).tolist() == [1, 0, 3, 2]


def test_rows_are_ordered_by_length_only_where_trimmed_micro_batches_split_them():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0]])  # 2, 4 and 3 real tokens

    def rows(size: int, trim: bool) -> list[list[int]]:
        return [m.host_rows.tolist() for m in micro_batches(
            torch.arange(3), mask, mask[:, 2:].bool(), mask, mask, 2, size, packing=False, trim=trim)]

    assert rows(2, trim=True) == [[1, 2], [0]]  # longest first
    assert rows(3, trim=True) == [[0, 1, 2]]  # one micro-batch: as given
    assert rows(2, trim=False) == [[0, 1], [2]]  # untrimmed: as given


def test_rows_of_equal_length_keep_their_order_in_a_large_batch():
    # torch's unstable sort reorders ties from about 100 elements; a plain stable sort by hand does not.
    lengths = [(7 * i) % 3 for i in range(256)]
    mask = torch.tensor([[1] * n + [0] * (2 - n) for n in lengths])
    assert longest_first(mask).tolist() == sorted(range(256), key=lambda i: -lengths[i])


def padded_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, response_mask) of prompts and responses of the lengths above."""
    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(len(PROMPT_LENGTHS), 2 * WIDTH, dtype=torch.long)  # pad id 0
    mask = torch.zeros_like(ids)
    for row, (p, r) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)):
        ids[row, WIDTH - p : WIDTH + r] = torch.randint(3, vocab, (p + r,), generator=g)
        mask[row, WIDTH - p : WIDTH + r] = 1
    return ids, mask, mask[:, WIDTH:].bool()


@pytest.fixture()
def roles(make_roles):
    return make_roles(seed=2, scale=0.5)


def test_trimmed_scoring_gives_each_token_a_plain_forward_of_its_sequence_alone(roles):
    ids, mask, response_mask = padded_batch(roles.lm_head.out_features)
    assert roles.trim_padding  # the default
    old, ref, values = score_passes(roles, ids, mask, WIDTH, 1.0, forward_batch_size=3)
    for row, (p, r) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)):
        alone = ids[row : row + 1, WIDTH - p : WIDTH + r]  # the sequence, no padding anywhere
        for role, got in ((POLICY, old), (REFERENCE, ref)):
            with roles.as_role(role), torch.no_grad():
                logits = roles.peft(input_ids=alone).logits[0, p - 1 : -1].float()
            expected = torch.log_softmax(logits, -1).gather(-1, alone[0, p:, None]).squeeze(-1)
            torch.testing.assert_close(got[row, :r], expected, atol=1e-5, rtol=1e-5)
        with roles.as_role(VALUE), torch.no_grad():
            hidden = roles.peft(input_ids=alone, output_hidden_states=True).hidden_states[-1][0, p - 1 : -1]
        torch.testing.assert_close(values[row, :r], roles.value_head(hidden).squeeze(-1).float(), atol=1e-5, rtol=1e-5)


def test_trimmed_scoring_matches_the_full_width_pass_on_every_real_token(roles):
    ids, mask, response_mask = padded_batch(roles.lm_head.out_features)
    roles.trim_padding = False
    full = score_passes(roles, ids, mask, WIDTH, 1.0, forward_batch_size=2)
    roles.trim_padding = True
    trimmed = score_passes(roles, ids, mask, WIDTH, 1.0, forward_batch_size=2)
    for a, b in zip(full, trimmed):
        torch.testing.assert_close(b[response_mask], a[response_mask], atol=1e-6, rtol=1e-6)


def rollout(roles) -> Rollout:
    ids, mask, _ = padded_batch(roles.lm_head.out_features)
    roles.trim_padding = False  # today's scoring
    return scored_rollout(roles, ids, mask, WIDTH, forward_batch_size=4)


def updated(roles, batch: Rollout, trim: bool) -> tuple[dict, list[torch.Tensor]]:
    roles.trim_padding = trim
    cfg = PPOConfig(num_epochs=2, num_minibatches=1, grad_accum_steps=2, learning_rate=1e-2)
    adv = compute_advantages(batch, cfg, cfg.kl_coef, batch.scores)
    # Plain SGD: a weight moves by its gradient, so the weights compare the gradients (AdamW's first step
    # moves every weight by lr x sign(gradient), and a gradient of ~0 flips with rounding).
    optimizer = torch.optim.SGD(roles.policy_parameters() + roles.value_parameters(), lr=cfg.learning_rate)
    settings = UpdateSettings(4, 2, 1.0, gradient_checkpointing=True)
    stats = ppo_update(roles, optimizer, None, batch, adv, cfg, settings, cfg.kl_coef, torch.Generator().manual_seed(0))
    return vars(stats), [p.detach().clone() for p in roles.policy_parameters() + roles.value_parameters()]


def test_a_trimmed_update_is_todays_and_skips_the_padding_counted_by_hand(make_roles):
    torch.manual_seed(0)
    full_roles = make_roles(seed=2, scale=0.5)
    torch.manual_seed(0)
    trimmed_roles = make_roles(seed=2, scale=0.5)
    batch = rollout(full_roles)
    full_stats, full_weights = updated(full_roles, batch, trim=False)
    trimmed_stats, trimmed_weights = updated(trimmed_roles, batch, trim=True)

    # Full width: 4 rows x 12 columns, 29 real tokens. Trimmed: the longest two (9 and 8 real tokens;
    # prompts 3 and 6, responses 6 and 2) take 6 + 6 columns, the other two (prompts 2 and 5,
    # responses 4 and 1) 5 + 4: 24 + 18 positions for the same 29 real tokens.
    assert full_stats.pop("padding_frac") == pytest.approx(19 / 48)
    assert trimmed_stats.pop("padding_frac") == pytest.approx(13 / 42)
    assert trimmed_stats["logprob_max_diff"] < 1e-5
    assert_same_update(trimmed_stats, full_stats, trimmed_weights, full_weights)


def assert_same_update(got: dict, expected: dict, got_weights: list, expected_weights: list) -> None:
    """The same statistics and weights after an update, within float32 rounding."""
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        else:
            assert got[key] == value, key
    for a, b in zip(got_weights, expected_weights):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# Logged numbers that amplify float32 rounding: 1 - Var(returns - values) / Var(returns) divides by the
# variance of a tiny run's returns over a few tokens (-4.3 at the second step of the run below), so values a few
# 1e-7 apart move it by up to 1e-4, where every other number moves by under 2e-5 of itself.
ILL_CONDITIONED = {"value/explained_var": 5e-4}


def assert_a_run_trains_as_one_without(tmp_path, tiny_model_dir, field: str) -> None:
    """3 steps with the `ppo` switch `field` off, then on: every logged number the same within float32
    rounding (`ILL_CONDITIONED` within what its formula makes of it, clip counts within a token), the
    update's padding share no larger.

    At a learning rate of 1e-3 (the policy's KL still reaches 0.09 by the third step): each step starts
    from the weights the one before left, which the two runs round apart (the packed attention runs
    another kernel), and the tiny recipe's 1e-2 carried that into 1.6e-4 of the value loss by the third
    step on an AMD EPYC (2026-11-28), where gradient accumulation's rounding moved it by 2e-8."""
    metrics = {}
    for setting in (False, True):
        recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(
            tiny_model_dir, tmp_path / f"{field}-{setting}",
            ppo={field: setting, "grad_accum_steps": 2, "learning_rate": 1e-3},
            rollout={"forward_batch_size": 2}, train={"steps": 3, "eval": False}))
        lora_ppo.PPOTrainer(recipe, progress=False).train()
        metrics[setting] = deterministic_metrics(tmp_path / f"{field}-{setting}")
    for off, on in zip(metrics[False], metrics[True]):
        assert on.pop("update/padding_frac") <= off.pop("update/padding_frac")
        assert on.keys() == off.keys()
        for key, value in clip_counts_within_a_token(on, off).items():
            assert on[key] == pytest.approx(value, rel=1e-4, abs=ILL_CONDITIONED.get(key, 1e-5)), key


def test_a_run_with_trimmed_padding_trains_as_one_without(tmp_path, tiny_model_dir):
    assert_a_run_trains_as_one_without(tmp_path, tiny_model_dir, "trim_padding")


def test_in_bfloat16_the_self_check_is_exact_at_full_width_and_within_tolerance_trimmed(make_roles, tiny_tokenizer):
    """The update's first logprobs against the scoring pass's, same weights: at the rollout's width both
    run the same shapes and agree bit for bit; trimmed, a micro-batch without left padding runs
    attention without a mask, and bfloat16 rounds apart, within the self-check's bfloat16 limit."""
    from lora_ppo.alarms import LOGPROB_TOLERANCE
    from tests.conftest import rollout_for_update
    from tests.test_compiled_update import bf16_roles
    from tests.test_compiled_update import updated as updated_in_micro_batches_of_one

    diffs = {}
    for trim in (False, True):
        roles = bf16_roles(make_roles)
        roles.trim_padding = trim
        batch = rollout_for_update(roles, tiny_tokenizer)  # scored 2 rows at a time
        stats, _ = updated_in_micro_batches_of_one(roles, batch, None)
        diffs[trim] = (stats["logprob_max_diff"], stats["logprob_mean_diff"])
    assert diffs[False] == (0.0, 0.0)
    assert 0 < diffs[True][1] < LOGPROB_TOLERANCE["bfloat16"] / 2
