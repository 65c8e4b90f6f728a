"""model.gradient_checkpointing must really checkpoint the update (the model stays in eval mode,
where transformers would silently skip it) and must not change the gradients."""

from __future__ import annotations

import pytest
import torch

from lora_ppo.roles import POLICY, VALUE


@pytest.fixture(scope="module")
def roles(make_roles):
    model = make_roles(seed=1)  # non-zero LoRA B matrices, so every adapter weight gets a gradient
    with torch.no_grad():  # the score head starts at zero, which would zero every value-side gradient
        model.value_head.weight.copy_(torch.randn(model.value_head.weight.shape, generator=torch.Generator().manual_seed(9)))
    return model


IDS = torch.tensor([[2, 2, 40, 51, 60, 7, 9, 11], [33, 41, 52, 61, 70, 8, 10, 12]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
START = 5


def _grads(roles, checkpointing: bool) -> tuple[list[torch.Tensor], int]:
    """Adapter + value head gradients of a policy and a value loss, and how often the MLP of
    decoder layer 0 ran (twice per pass when its activations were recomputed in backward)."""
    calls = 0

    def count(*_):
        nonlocal calls
        calls += 1

    mlp = roles.decoder.layers[0].mlp
    # A pre-hook: torch stops a recompute as soon as the last saved tensor is rebuilt, which is
    # inside the MLP, so a post-forward hook would never see the recompute.
    handle = mlp.register_forward_pre_hook(count)
    params = roles.policy_parameters() + roles.value_parameters()
    for p in params:
        p.grad = None
    try:
        with roles.gradient_checkpointing(checkpointing):
            with roles.as_role(POLICY):
                logprobs, entropy = roles.response_logprobs(IDS, MASK, START, 0.7)
            (logprobs.sum() + 0.1 * entropy.sum()).backward()
            with roles.as_role(VALUE):
                values = roles.values(IDS, MASK, START)
            (values ** 2).sum().backward()
    finally:
        handle.remove()
    return [p.grad.detach().clone() for p in params], calls


def test_checkpointing_recomputes_layers_and_leaves_gradients_unchanged(roles):
    plain, plain_calls = _grads(roles, checkpointing=False)
    ckpt, ckpt_calls = _grads(roles, checkpointing=True)
    assert plain_calls == 2  # one forward each for the policy and the value pass
    assert ckpt_calls == 4  # ... and one recompute each during backward
    assert all(g.abs().sum() > 0 for g in plain)
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_checkpointing_is_off_again_after_the_update(roles):
    _grads(roles, checkpointing=True)
    _, calls = _grads(roles, checkpointing=False)
    assert calls == 2
    assert not any(layer.training for layer in roles.decoder.layers)
