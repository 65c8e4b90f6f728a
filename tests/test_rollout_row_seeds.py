"""rollout.seed_per_row: each response from its own seeded stream, whatever batch it is in, with
the recipe's sampling distribution."""

from __future__ import annotations

import torch

from lora_ppo.config import RolloutConfig
from lora_ppo.rollout import RowSeededSampling, Sampler, row_seeds
from tests.conftest import prompt_rows


def sampled(sampling: RowSeededSampling, scores: torch.Tensor) -> torch.Tensor:
    out = sampling(torch.zeros(scores.shape[0], 1, dtype=torch.long), scores)
    assert torch.isfinite(out).sum(dim=1).eq(1).all()  # a one-hot choice per row: greedy takes it
    return out.argmax(dim=1)


def test_tokens_follow_the_tempered_top_k_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    rows = 4000
    cfg = RolloutConfig(temperature=0.7, top_k=3)
    tokens = sampled(RowSeededSampling(row_seeds(0, (0, 0), range(rows)), cfg, torch.device("cpu")),
                     logits.expand(rows, -1).clone())
    expected = torch.softmax(logits[:3] / 0.7, dim=0)
    counts = torch.bincount(tokens, minlength=5).double() / rows
    assert counts[3:].sum() == 0  # outside the top 3: never
    sigma = (expected * (1 - expected) / rows).sqrt()
    assert ((counts[:3] - expected).abs() < 5 * sigma).all(), (counts, expected)


def test_a_rows_tokens_depend_on_its_seed_not_on_the_batch():
    cfg = RolloutConfig()
    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    seeds = row_seeds(7, (0, 4), range(3))
    together = sampled(RowSeededSampling(seeds, cfg, torch.device("cpu")), scores)
    alone = sampled(RowSeededSampling(seeds[2:], cfg, torch.device("cpu")), scores[2:])
    assert together[2] == alone[0]
    assert len(set(row_seeds(7, (0, 4), range(100)))) == 100
    assert row_seeds(7, (0, 4), range(3)) != row_seeds(7, (0, 8), range(3))  # another step, other streams


def test_a_prompt_gets_the_same_response_alone_as_in_a_padded_batch(make_roles, tiny_tokenizer):
    roles = make_roles(seed=3)
    sampler = Sampler(roles, tiny_tokenizer, RolloutConfig(max_new_tokens=8, stop_token=None))
    rows = prompt_rows(tiny_tokenizer, ["a much longer prompt than the other one, padded less", "short"])
    seeds = row_seeds(0, (0, 0), range(2))
    torch.manual_seed(0)
    batch = sampler.sample(rows, record_logprobs=True, seeds=seeds)
    torch.manual_seed(123)  # the global stream plays no part
    alone = sampler.sample(rows[1:], record_logprobs=True, seeds=seeds[1:])
    assert torch.equal(batch.response_ids[1], alone.response_ids[0])
    torch.testing.assert_close(batch.logprobs[1], alone.logprobs[0], rtol=1e-4, atol=1e-5)
    other = sampler.sample(rows[1:], seeds=row_seeds(0, (0, 2), range(1)))
    assert not torch.equal(other.response_ids[0], alone.response_ids[0])


def test_a_rows_seed_is_the_documented_hash_over_the_whole_63_bit_range():
    """A recorded run samples the same streams after an upgrade (`seed_per_row` must match on resume):
    a row's seed is sha256 of "seed/step key/row", its first 8 bytes little-endian, halved into the
    non-negative range torch.Generator.manual_seed takes."""
    import hashlib

    by_hand = [int.from_bytes(hashlib.sha256(f"7/0/4/{row}".encode()).digest()[:8], "little") // 2
               for row in range(100)]
    assert row_seeds(7, (0, 4), range(100)) == by_hand
    assert max(by_hand) >= 2**62  # 100 draws all below 2^62 has chance 2^-100


def test_a_restarted_sampling_draws_each_rows_tokens_again():
    """After a sampling attempt that failed (the compiled path falling back to generate()), each row
    starts its stream over: the retry samples what the first attempt would have."""
    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    sampling = RowSeededSampling(row_seeds(0, (1, 0), range(3)), RolloutConfig(), torch.device("cpu"))
    first = [sampled(sampling, scores) for _ in range(4)]
    sampling.restart()
    assert [sampled(sampling, scores).tolist() for _ in range(4)] == [t.tolist() for t in first]
    assert len({tuple(t.tolist()) for t in first}) > 1  # the four draws differ: a restart is visible
