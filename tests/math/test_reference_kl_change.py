"""ppo.max_kl's estimate of how far an update moved the KL to the reference: a hand-computed case,
padding, and first-order agreement with the exact KL of a small autoregressive policy."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lora_ppo.ppo_math import reference_kl_change

TOL = dict(atol=1e-6, rtol=1e-5)


def t(values):
    return torch.tensor(values, dtype=torch.float64)


def test_no_change_when_the_policy_has_not_moved():
    old = t([[-1.0, -2.0, -0.5]])
    ref = t([[-1.5, -1.0, -0.7]])
    mask = torch.tensor([[True, True, False]])
    assert reference_kl_change(old, old, ref, mask).item() == 0.0


def test_hand_computed_change():
    # k1 per token 0.5 and 0.25, so the KL still to come is 0.75 at token 0 and 0.25 at token 1.
    # Token 0 doubled its probability (rho - 1 = 1), token 1 halved it (rho - 1 = -0.5):
    # first order 1 * 0.75 - 0.5 * 0.25 = 0.625; the movement rho log rho - rho + 1 is
    # 2 ln 2 - 1 at token 0 and 0.5 ln 0.5 + 0.5 at token 1.
    old = t([[-1.0, -2.0]])
    ref = old - t([[0.5, 0.25]])
    new = old + t([[math.log(2.0), math.log(0.5)]])
    mask = torch.tensor([[True, True]])
    movement = (2 * math.log(2.0) - 1) + (0.5 * math.log(0.5) + 0.5)
    assert reference_kl_change(new, old, ref, mask).item() == pytest.approx(0.625 + movement)
    # A baseline of 0.75 and 0.25 per position removes the first-order part of this one response.
    assert reference_kl_change(new, old, ref, mask, t([0.75, 0.25])).item() == pytest.approx(movement)


def test_padding_changes_nothing():
    old = t([[-1.0, -2.0, -0.3], [-0.4, -0.9, -1.1]])
    ref = old - t([[0.2, 0.1, 0.3], [0.4, -0.1, 0.2]])
    new = old + t([[0.1, -0.2, 0.05], [0.3, 0.1, -0.1]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    expected = reference_kl_change(new, old, ref, mask)
    garbage = torch.where(mask, torch.zeros_like(old), torch.full_like(old, float("nan")))
    torch.testing.assert_close(reference_kl_change(new + garbage, old + garbage, ref + garbage, mask), expected, **TOL)


# A two-token autoregressive policy over 3 symbols: every sequence enumerable, the KL exact.
VOCAB = 3


def _sequence_logprobs(first: torch.Tensor, second: torch.Tensor) -> dict[tuple[int, int], torch.Tensor]:
    """Per-token logprobs [2] of each sequence (a, b) under first-token logits [V] and second-token logits [V, V]."""
    lp1, lp2 = first.log_softmax(-1), second.log_softmax(-1)
    return {(a, b): torch.stack([lp1[a], lp2[a, b]]) for a, b in itertools.product(range(VOCAB), repeat=2)}


def _exact_kl(policy: dict, ref: dict) -> float:
    return sum(policy[y].sum().exp() * (policy[y] - ref[y]).sum() for y in policy).item()


def _expected_estimate(new: dict, old: dict, ref: dict, with_kl_to_come: bool = True, baseline=None) -> float:
    """The estimate's exact expectation over sequences sampled from the old policy."""
    mask = torch.tensor([[True, True]])
    total = 0.0
    for y in old:
        n, o, r = new[y][None], old[y][None], ref[y][None]
        if with_kl_to_come:
            change = reference_kl_change(n, o, r, mask, baseline)
        else:  # each token's own KL only: misses the tokens its choice leads to
            change = (torch.expm1(n - o) * (o - r)).sum(dim=1)
        total += old[y].sum().exp().item() * change.item()
    return total


def _small_policy_setup():
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(VOCAB, generator=g, dtype=torch.float64),
              torch.randn(VOCAB, VOCAB, generator=g, dtype=torch.float64)]
    ref = _sequence_logprobs(*(torch.randn(x.shape, generator=g, dtype=torch.float64) for x in logits))
    direction = [torch.randn(x.shape, generator=g, dtype=torch.float64) for x in logits]
    return logits, ref, direction


def test_first_order_agreement_with_the_exact_kl():
    logits, ref, direction = _small_policy_setup()
    old = _sequence_logprobs(*logits)
    errors, naive_errors = [], []
    for step in (0.1, 0.05, 0.025):
        new = _sequence_logprobs(*(x + step * d for x, d in zip(logits, direction)))
        exact = _exact_kl(new, ref) - _exact_kl(old, ref)
        errors.append(abs(_expected_estimate(new, old, ref) - exact))
        naive_errors.append(abs(_expected_estimate(new, old, ref, with_kl_to_come=False) - exact))
        assert abs(exact) > 10 * errors[-1]  # the estimate carries the change, not noise around it
    # Second-order error: halving the step quarters it. Without the KL still to come it only halves.
    assert errors[1] < errors[0] / 3 and errors[2] < errors[1] / 3
    assert naive_errors[2] > naive_errors[1] / 3


def test_a_baseline_leaves_the_expected_change_unchanged():
    logits, ref, direction = _small_policy_setup()
    old = _sequence_logprobs(*logits)
    new = _sequence_logprobs(*(x + 0.3 * d for x, d in zip(logits, direction)))
    plain = _expected_estimate(new, old, ref)
    with_baseline = _expected_estimate(new, old, ref, baseline=t([2.5, -1.0]))
    assert with_baseline == pytest.approx(plain, rel=1e-9, abs=1e-12)
