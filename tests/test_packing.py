"""ppo.packing: scoring's and the update's rows packed back to back into sequences give every real token
the numbers a plain forward of that sequence alone gives, and today's update, in fewer micro-batches;
the padding left and the sequences made are counted here by hand. A model whose attention would let
packed rows see each other is refused."""

from __future__ import annotations

import pytest
import torch

import lora_ppo
from lora_ppo.config import PPOConfig
from lora_ppo.errors import RecipeError
from lora_ppo.packing import pack, packed_micro_batches
from lora_ppo.roles import POLICY, REFERENCE, VALUE
from lora_ppo.rollout import score_passes
from lora_ppo.update import UpdateSettings, compute_advantages, ppo_update
from tests.conftest import scored_rollout, tiny_recipe_dict
from tests.test_trim_padding import (PROMPT_LENGTHS, RESPONSE_LENGTHS, WIDTH, assert_a_run_trains_as_one_without,
                                     assert_same_update, padded_batch)


def test_best_fit_decreasing_by_hand():
    # Longest first, each into the fullest bin it fits: 6 | 5+3 | 4+4 -> bins hold 6+2, 5+3, 4+4.
    assert pack([4, 6, 5, 3, 4, 2], 8) == [[1, 5], [2, 3], [0, 4]]
    assert pack([8, 1], 8) == [[0], [1]]
    # 4 fits both 6 (room 4) and 5 (room 5): the fuller bin takes it, leaving 3 for the other
    # (the emptier bin first would give 6+3, 5+4).
    assert pack([6, 5, 4, 3], 10) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("case", ["outside-the-mask", "no-token-before-it"])
def test_a_response_token_that_cannot_be_predicted_is_refused(case):
    ids, mask, response_mask = padded_batch(100)
    response_mask = response_mask.clone()
    if case == "outside-the-mask":  # row 3's response is 2 tokens; a third is marked on padding
        response_mask[3, 2] = True
    else:  # row 0 without its prompt: its first response token has nothing before it
        mask = mask.clone()
        mask[0, :WIDTH] = 0
    with pytest.raises(ValueError, match="row 3: a response token outside|row 0: .* no token before it"):
        list(packed_micro_batches(torch.arange(4), mask, response_mask, ids, WIDTH, 2))


def test_the_packed_micro_batches_of_a_rollout_by_hand():
    # Real lengths (prompt + response): 6, 6, 9, 8 in 12 columns. Best fit decreasing: 9 and 8 alone,
    # the two 6s together; two sequences a micro-batch.
    ids, mask, response_mask = padded_batch(100)
    first, second = packed_micro_batches(torch.arange(4), mask, response_mask, ids, WIDTH, 2)
    assert first.host_rows.tolist() == [2, 3] and second.host_rows.tolist() == [0, 1]
    assert first.input_ids.shape == (2, 9) and second.input_ids.shape == (1, 12)
    assert (first.real_positions, first.positions, second.real_positions, second.positions) == (17, 18, 12, 12)
    assert first.input_ids[0].tolist() == ids[2, WIDTH - 3 : WIDTH + 6].tolist()
    assert first.input_ids[1, :8].tolist() == ids[3, WIDTH - 6 : WIDTH + 2].tolist()
    assert first.position_ids.tolist() == [list(range(9)), list(range(8)) + [0]]  # the tail: a row of its own
    assert second.input_ids[0].tolist() == ids[0, WIDTH - 2 : WIDTH + 4].tolist() + ids[1, WIDTH - 5 : WIDTH + 1].tolist()
    assert second.position_ids.tolist() == [list(range(6)) * 2]
    # Each response token is predicted by the token before it, and lands in its row's response column.
    assert first.response_width == 6 and second.response_width == 4
    assert second.predictors.tolist() == [1, 2, 3, 4, 10]
    assert second.targets.tolist() == [ids[0, WIDTH : WIDTH + 4].tolist() + [ids[1, WIDTH].item()]]
    laid_out = second.laid_out(torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]]))
    assert laid_out.tolist() == [[1.0, 2.0, 3.0, 4.0], [5.0, 0.0, 0.0, 0.0]]


@pytest.fixture()
def roles(make_roles):
    return make_roles(seed=2, scale=0.5)


@pytest.mark.parametrize("together", [True, False], ids=["roles-in-one-forward", "a-forward-per-role"])
def test_packed_scoring_gives_each_token_a_plain_forward_of_its_sequence_alone(roles, together):
    """Scoring in packed micro-batches of 2 sequences (the 9 and the 8 tokens, then the two 6s in one):
    each real response token's logprob under the policy and the reference and its value are those of
    a plain forward of its sequence alone; after the response, 0."""
    ids, mask, _ = padded_batch(roles.lm_head.out_features)
    roles.packing = True
    old, ref, values = score_passes(roles, ids, mask, WIDTH, 1.0, forward_batch_size=2, together=together)
    for row, (p, r) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)):
        alone = ids[row : row + 1, WIDTH - p : WIDTH + r]  # the sequence, no padding anywhere
        for role, got in ((POLICY, old), (REFERENCE, ref), (VALUE, values)):
            with roles.as_role(role), torch.no_grad():
                out = roles.peft(input_ids=alone, output_hidden_states=True)
            if role == VALUE:
                expected = roles.value_head(out.hidden_states[-1][0, p - 1 : -1]).squeeze(-1).float()
            else:
                logits = out.logits[0, p - 1 : -1].float()
                expected = torch.log_softmax(logits, -1).gather(-1, alone[0, p:, None]).squeeze(-1)
            torch.testing.assert_close(got[row, :r], expected, atol=1e-5, rtol=1e-5)
            assert not got[row, r:].any(), role


def rollout(roles):
    ids, mask, _ = padded_batch(roles.lm_head.out_features)
    return scored_rollout(roles, ids, mask, WIDTH, forward_batch_size=4)


def updated(roles, batch, packing: bool, micro_batch: int, together: bool = False) -> tuple[dict, list, int]:
    """(stats, weights after, decoder forwards) of a 2-epoch update of the 4 rows as one minibatch."""
    cfg = PPOConfig(num_epochs=2, num_minibatches=1, learning_rate=1e-2)
    adv = compute_advantages(batch, cfg, cfg.kl_coef, batch.scores)
    # Plain SGD: a weight moves by its gradient, so the weights compare the gradients.
    optimizer = torch.optim.SGD(roles.policy_parameters() + roles.value_parameters(), lr=cfg.learning_rate)
    roles.packing = packing
    settings = UpdateSettings(4, micro_batch, 1.0, gradient_checkpointing=True, roles_together=together)
    forwards = []
    hook = roles.decoder.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        stats = ppo_update(roles, optimizer, None, batch, adv, cfg, settings, cfg.kl_coef,
                           torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    return vars(stats), [p.detach().clone() for p in roles.policy_parameters() + roles.value_parameters()], len(forwards)


# (micro-batch size, both roles in one pass, padding share unpacked and packed, micro-batches unpacked
# and packed). Real lengths 6, 6, 9, 8 in 12 columns. One row a micro-batch, each trimmed to itself: no
# padding in 4 micro-batches; packed, one sequence a micro-batch: 9, 8 and the two 6s, in 3. Two rows a
# micro-batch, trimmed: 9 + 8 tokens in 2 x 12 columns and 6 + 6 in 2 x 9 (13 of 42 positions padding);
# packed: 9 and 8 in 2 x 9 columns, the two 6s in one sequence of 12 (1 of 30).
SPLITS = [(1, False, 0.0, 0.0, 4, 3), (2, False, 13 / 42, 1 / 30, 2, 2), (2, True, 13 / 42, 1 / 30, 2, 2)]


@pytest.mark.parametrize("micro_batch, together, plain_padding, packed_padding, plain_micro, packed_micro", SPLITS,
                         ids=["one-row", "two-rows", "two-rows-roles-together"])
def test_a_packed_update_is_todays_with_less_padding_and_fewer_micro_batches(
        make_roles, micro_batch, together, plain_padding, packed_padding, plain_micro, packed_micro):
    torch.manual_seed(0)
    plain_roles = make_roles(seed=2, scale=0.5)
    torch.manual_seed(0)
    packed_roles = make_roles(seed=2, scale=0.5)
    batch = rollout(plain_roles)
    plain, plain_weights, plain_forwards = updated(plain_roles, batch, False, micro_batch, together)
    packed, packed_weights, packed_forwards = updated(packed_roles, batch, True, micro_batch, together)

    assert plain.pop("padding_frac") == pytest.approx(plain_padding)
    assert packed.pop("padding_frac") == pytest.approx(packed_padding)
    passes = 2 * (1 if together else 2)  # decoder forwards per micro-batch: 2 epochs, 1 or 2 roles a pass
    assert (plain_forwards, packed_forwards) == (passes * plain_micro, passes * packed_micro)
    for stats in (plain, packed):  # the self-check: rounding apart from 0 in float32, not equal to each other
        assert stats.pop("logprob_max_diff") < 1e-5 and stats.pop("logprob_mean_diff") < 1e-5
    assert_same_update(packed, plain, packed_weights, plain_weights)


def test_an_episodes_observations_are_packed_as_context_and_never_predicted(make_roles):
    """Multi-turn episodes: tokens between turns (observations) are attended to but never actions. Row 2's
    response tokens 2 and 3 are an observation here: packed, they stay in the sequence (the action after
    them is predicted from them), their logprobs are never computed, and the update is the unpacked one."""
    import dataclasses

    torch.manual_seed(0)
    plain_roles = make_roles(seed=2, scale=0.5)
    torch.manual_seed(0)
    packed_roles = make_roles(seed=2, scale=0.5)
    batch = rollout(plain_roles)
    observation = torch.zeros_like(batch.response_mask)
    observation[2, 2:4] = True
    batch = dataclasses.replace(batch, response_mask=batch.response_mask & ~observation, observation_mask=observation)
    assert batch.attention_mask[2].sum() == PROMPT_LENGTHS[2] + RESPONSE_LENGTHS[2]  # still in the context
    plain, plain_weights, _ = updated(plain_roles, batch, False, 2)
    packed, packed_weights, _ = updated(packed_roles, batch, True, 2)
    for stats in (plain, packed):
        stats.pop("padding_frac")
        assert stats.pop("logprob_max_diff") < 1e-5 and stats.pop("logprob_mean_diff") < 1e-5
    assert_same_update(packed, plain, packed_weights, plain_weights)
    ids, mask = batch.input_ids, batch.attention_mask
    micro = next(m for m in packed_micro_batches(torch.arange(4), mask, batch.response_mask, ids, WIDTH, 2)
                 if 2 in m.host_rows.tolist())
    assert len(micro.predictors) == int(batch.response_mask[micro.host_rows].sum())  # actions only


def test_a_run_with_packing_trains_as_one_without(tmp_path, tiny_model_dir):
    assert_a_run_trains_as_one_without(tmp_path, tiny_model_dir, "packing")


def test_packing_is_refused_where_attention_crosses_rows(tmp_path, tiny_model_dir, monkeypatch):
    """transformers parts packed rows by their positions; where it did not, each row would see the one
    before it, and the probe at load time refuses the recipe."""
    import transformers.masking_utils as masking

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / "run", ppo={"packing": True}))
    with pytest.raises(RecipeError, match="^ppo.packing: llama's attention lets a packed row see the row before it"):
        lora_ppo.PPOTrainer(recipe, progress=False)


def test_in_bfloat16_the_packed_self_check_is_within_tolerance(make_roles, tiny_tokenizer):
    """The update's first logprobs against the scoring pass's, same weights, both packed: scoring packs
    the 4 rows 2 sequences at a time, the update each minibatch's 2 rows one sequence at a time, so the
    shapes differ and bfloat16 rounds apart, within the self-check's bfloat16 limit (as trimming does)."""
    from lora_ppo.alarms import LOGPROB_TOLERANCE
    from tests.conftest import rollout_for_update
    from tests.test_compiled_update import bf16_roles
    from tests.test_compiled_update import updated as updated_in_micro_batches_of_one

    roles = bf16_roles(make_roles)
    roles.packing = True
    batch = rollout_for_update(roles, tiny_tokenizer)  # scored 2 sequences at a time
    stats, _ = updated_in_micro_batches_of_one(roles, batch, None, packing=True)
    assert 0 < stats["logprob_mean_diff"] < LOGPROB_TOLERANCE["bfloat16"] / 2  # the limit the alarm reads
