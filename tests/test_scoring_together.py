"""rollout.score_roles_together: the roles a rollout is scored as share one forward (the batch
repeated per role, PEFT's per-row adapter selection) and give what one forward per role gives,
on the real 4-bit tiny model, with the reference as the bare base or as a frozen adapter."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lora_ppo.bnb_workarounds import dequantized_4bit_layers
from lora_ppo.roles import POLICY, REFERENCE, VALUE
from lora_ppo.rollout import score_passes
from tests.conftest import prompt_and_random_response

PROMPTS = ["This movie was", "The acting in the remake", "I", "Plot twists aside, the ending"]


def _batch(tokenizer):
    ids, mask, start = prompt_and_random_response(tokenizer, PROMPTS, response_len=6)
    mask[1, start + 4 :] = 0  # a response that stopped early: padding after it
    return ids, mask, start


@pytest.fixture(scope="module")
def reference_adapter(make_roles, tmp_path_factory):
    """A frozen reference adapter that differs from the bare base (the SFT-start case)."""
    folder = tmp_path_factory.mktemp("reference")
    make_roles(seed=7, scale=0.5).save_adapter(POLICY, folder)
    return str(folder)


@pytest.mark.parametrize("reference", ["disable", "adapter"])
@pytest.mark.parametrize("dequantized", [False, True], ids=["4bit-per-pass", "dequantized-per-step"])
@pytest.mark.parametrize("recorded_old_logprobs", [False, True])
def test_roles_scored_together_equal_one_forward_per_role(make_roles, tiny_tokenizer, reference_adapter, reference,
                                                          dequantized, recorded_old_logprobs):
    roles = make_roles(seed=1, scale=0.5, reference=reference_adapter if reference == "adapter" else "disable")
    with torch.no_grad():  # the head starts at zero: every value would be 0 whatever the rows
        roles.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
    ids, mask, start = _batch(tiny_tokenizer)
    recorded = torch.randn(len(PROMPTS), ids.shape[1] - start) if recorded_old_logprobs else None
    context = dequantized_4bit_layers(roles.peft, torch.float32) if dequantized else contextlib.nullcontext()
    rows_per_forward = {}
    with context:
        # forward_batch_size 3 over 4 sequences: a full micro-batch and a short one.
        for stacked in (True, False):
            rows_seen = []
            hook = roles.peft.get_input_embeddings().register_forward_hook(
                lambda module, args, output: rows_seen.append(args[0].shape[0]))
            try:
                rows_per_forward[stacked] = rows_seen, score_passes(roles, ids, mask, start, 0.7, 3,
                                                                    old_logprobs=recorded, together=stacked)
            finally:
                hook.remove()
    (rows_together, together), (rows_apart, apart) = rows_per_forward[True], rows_per_forward[False]
    # Off, each role has its own forward of at most forward_batch_size rows (the memory it saves).
    roles_scored = 2 if recorded_old_logprobs else 3
    assert rows_together == [3 * roles_scored, 1 * roles_scored]
    assert rows_apart == [3] * roles_scored + [1] * roles_scored
    for a, b in zip(together, apart):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if recorded is not None:
        assert together[0] is recorded
    # The roles really differ, so a mix-up of rows between them would show.
    old, ref, values = apart
    response = mask[:, start:].bool()
    assert (old - ref)[response].abs().max() > 1e-3
    assert values[response].abs().max() > 1e-3


def test_scoring_together_leaves_the_active_adapter_and_gradients_alone(make_roles, tiny_tokenizer):
    roles = make_roles(seed=1, scale=0.5)
    ids, mask, _start = _batch(tiny_tokenizer)
    hidden = roles.hidden_states_as_roles(ids, mask, [REFERENCE, VALUE, POLICY])
    assert [h.shape for h in hidden] == [(len(PROMPTS), ids.shape[1], roles.hidden_size)] * 3
    with roles.as_role(POLICY):
        torch.testing.assert_close(hidden[2], roles.hidden_states(ids, mask), atol=1e-5, rtol=1e-5)
    # No hook is left behind: a plain forward afterwards uses the active adapter alone.
    with roles.as_role(VALUE):
        torch.testing.assert_close(roles.hidden_states(ids, mask), hidden[1], atol=1e-5, rtol=1e-5)
    assert all(p.requires_grad for p in roles.policy_parameters() + roles.value_parameters())


def test_an_error_inside_mixed_rows_leaves_no_adapter_names_behind(make_roles, tiny_tokenizer):
    # Left in place, the per-row adapter names would apply to every later forward (and fail on any
    # other batch size).
    roles = make_roles(seed=1, scale=0.5)
    ids, mask, _start = _batch(tiny_tokenizer)
    with roles.as_role(VALUE):
        expected = roles.hidden_states(ids, mask)
    with pytest.raises(KeyboardInterrupt):
        with roles.rows_as_roles([POLICY, REFERENCE], ids.shape[0]):
            raise KeyboardInterrupt
    with roles.as_role(VALUE):
        torch.testing.assert_close(roles.hidden_states(ids, mask), expected, atol=0, rtol=0)
