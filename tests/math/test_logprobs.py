"""`lora_ppo.logprobs.token_logprobs` (chunked, checkpointed) against a naive full-vocab pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lora_ppo.logprobs import token_logprobs

TOL = dict(atol=1e-6, rtol=1e-5)
B, T, H, V = 3, 11, 8, 37
# chunk_tokens is split across the batch: 1 and 3 both give one position per chunk, 7 gives
# two, 64 gives all at once, and 1000 more than there is.
CHUNKS = [1, 3, 7, 10, 64, 1000]


@pytest.fixture(autouse=True)
def one_thread():
    # Tensors this small gain nothing from threads; on a busy machine the thread pool's
    # contention turns microseconds into tenths of a second per op.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_inputs(seed: int, dtype=torch.float32):
    torch.manual_seed(seed)
    lm_head = nn.Linear(H, V).to(dtype)
    with torch.no_grad():
        lm_head.weight.mul_(3.0)  # peaked distributions, far from uniform
    hidden = torch.randn(B, T, H, dtype=dtype)
    targets = torch.randint(0, V, (B, T))
    return lm_head, hidden, targets


def naive(lm_head, hidden, targets, temperature):
    logits = lm_head(hidden).float() / temperature  # [B, T, V]
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_matches_naive_without_grad(chunk_tokens, temperature):
    lm_head, hidden, targets = make_inputs(0)
    with torch.no_grad():
        lp, ent = token_logprobs(lm_head, hidden, targets, temperature=temperature, chunk_tokens=chunk_tokens)
        ref_lp, ref_ent = naive(lm_head, hidden, targets, temperature)
    assert lp.shape == ent.shape == (B, T)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)
    # Temperature really is applied: at temperature 1 the logprobs differ.
    with torch.no_grad():
        lp_t1, _ = naive(lm_head, hidden, targets, 1.0)
    assert not torch.allclose(lp, lp_t1, **TOL)


@pytest.mark.parametrize("chunk_tokens", CHUNKS)
def test_gradients_through_checkpointed_chunks_match_naive(chunk_tokens):
    temperature = 0.8
    lm_head, hidden0, targets = make_inputs(1)
    g = torch.Generator().manual_seed(2)
    w_lp = torch.randn(B, T, generator=g)
    w_ent = torch.randn(B, T, generator=g)

    hidden = hidden0.clone().requires_grad_(True)
    lp, ent = token_logprobs(lm_head, hidden, targets, temperature=temperature, chunk_tokens=chunk_tokens)
    assert lp.requires_grad and ent.requires_grad
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    grads = [hidden.grad.clone(), lm_head.weight.grad.clone(), lm_head.bias.grad.clone()]

    lm_head.zero_grad()
    hidden_ref = hidden0.clone().requires_grad_(True)
    ref_lp, ref_ent = naive(lm_head, hidden_ref, targets, temperature)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    ref_grads = [hidden_ref.grad, lm_head.weight.grad, lm_head.bias.grad]

    torch.testing.assert_close(lp.detach(), ref_lp.detach(), **TOL)
    torch.testing.assert_close(ent.detach(), ref_ent.detach(), **TOL)
    for got, want in zip(grads, ref_grads):
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want, **TOL)


def test_float64_head_matches_naive():
    # Non-fp32 heads still come back as float32, computed from the head's own precision.
    lm_head, hidden, targets = make_inputs(3, dtype=torch.float64)
    with torch.no_grad():
        lp, ent = token_logprobs(lm_head, hidden, targets, temperature=0.9, chunk_tokens=4)
        ref_lp, ref_ent = naive(lm_head, hidden, targets, 0.9)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)


def test_lm_head_sees_only_chunks():
    lm_head, hidden, targets = make_inputs(4)
    seen = []

    def head(h):
        seen.append(h.shape[1])
        return lm_head(h)

    with torch.no_grad():
        token_logprobs(head, hidden, targets, chunk_tokens=6)  # 6 // B = 2 positions at a time
    assert seen == [2, 2, 2, 2, 2, 1]


def test_empty_response():
    lm_head, hidden, targets = make_inputs(5)
    lp, ent = token_logprobs(lm_head, hidden[:, :0], targets[:, :0], temperature=0.7)
    assert lp.shape == ent.shape == (B, 0)
    assert lp.dtype == ent.dtype == torch.float32


def test_an_empty_batch_gives_empty_logprobs():
    lm_head, hidden, targets = make_inputs(5)
    lp, ent = token_logprobs(lm_head, hidden[:0], targets[:0], temperature=0.7)
    assert lp.shape == ent.shape == (0, T)


def test_the_default_temperature_is_1():
    lm_head, hidden, targets = make_inputs(6)
    with torch.no_grad():
        lp, ent = token_logprobs(lm_head, hidden, targets)
        ref_lp, ref_ent = naive(lm_head, hidden, targets, 1.0)
    torch.testing.assert_close(lp, ref_lp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)


def test_logit_transform_by_hand():
    """Granite divides by logits_scaling (scale 1/4 here), Cohere multiplies, Gemma soft-caps:
    c * tanh(x / c); with both, the scale comes first (checked element by element with math)."""
    import math

    from lora_ppo.logprobs import IDENTITY, LogitTransform

    x = torch.tensor([-9.0, -1.5, 0.0, 0.75, 6.0], dtype=torch.float64)
    expect = {
        LogitTransform(scale=0.25): [v * 0.25 for v in x.tolist()],
        LogitTransform(softcap=2.0): [2.0 * math.tanh(v / 2.0) for v in x.tolist()],
        LogitTransform(scale=3.0, softcap=5.0): [5.0 * math.tanh(3.0 * v / 5.0) for v in x.tolist()],
    }
    for transform, values in expect.items():
        assert not transform.is_identity
        torch.testing.assert_close(transform(x), torch.tensor(values, dtype=torch.float64), atol=1e-12, rtol=0)
    assert IDENTITY.is_identity and IDENTITY(x) is x
    assert not LogitTransform(scale=1.0, softcap=30.0).is_identity and not LogitTransform(scale=2.0).is_identity


def test_token_logprobs_apply_the_transform_before_the_softmax():
    """Logprobs and entropy of the transformed logits, against a plain log-softmax written here,
    in chunks of one position and of all: the transform is the model's, so a ratio of 1 depends on it."""
    from lora_ppo.logprobs import LogitTransform, token_logprobs

    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(4, 6, bias=False, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(6, 4, generator=g, dtype=torch.float64) * 3)
    hidden = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    targets = torch.tensor([[0, 5, 2], [3, 3, 1]])
    transform = LogitTransform(scale=0.5, softcap=1.5)
    logits = 1.5 * torch.tanh(0.5 * head(hidden) / 1.5) / 0.7  # temperature 0.7 after the transform
    log_p = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    expected = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    expected_entropy = -(log_p.exp() * log_p).sum(-1)
    for chunk in (1, 64):
        got, entropy = token_logprobs(lambda h: transform(head(h)), hidden, targets, 0.7, chunk_tokens=chunk)
        torch.testing.assert_close(got, expected.float(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(entropy, expected_entropy.float(), atol=1e-6, rtol=1e-5)


def test_a_chunks_vocabulary_activations_are_not_kept_for_the_backward():
    """The memory promise of chunking: under autograd each chunk is recomputed in the backward,
    so what the forward keeps is the hidden states, never a [chunk, V] block of logits or
    probabilities. Counted with saved-tensor hooks: less than one chunk's logits in all."""
    torch.manual_seed(0)
    B, T, H, V, chunk = 2, 64, 8, 4096, 32
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(B, T, H, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size() if t.data_ptr() != head.weight.data_ptr() else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs, entropy = token_logprobs(head, hidden, targets, chunk_tokens=chunk)
    one_chunks_logits = (chunk // B) * B * V * 4  # float32
    assert sum(saved) < one_chunks_logits
    (logprobs.sum() + entropy.sum()).backward()  # the recomputation gives the gradient
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()
