"""AdamW's step wherever its moments are kept (`ppo.optimizer_state`), against the update worked
out by hand: no weight decay, torch's betas, the group's own learning rate."""

from __future__ import annotations

import pytest
import torch

from lora_ppo.optimizers import adamw


@pytest.mark.parametrize("state", ["device", "cpu", "8bit"])
def test_two_steps_are_adams_by_hand(state):
    """Step 1 moves each weight by lr * g / (|g| + eps) (bias-corrected moments g and g^2); step 2,
    with gradient h, by lr * m / (sqrt(v) + eps), with m = (0.1 * 0.9 g + 0.1 h) / (1 - 0.9^2) and
    v = (0.001 * 0.999 g^2 + 0.001 h^2) / (1 - 0.999^2). A weight decay would pull the weights
    towards 0 on top (8-bit keeps small tensors' moments in 32 bits, so the same numbers)."""
    start = torch.tensor([1.0, -2.0, 0.5, 3.0])
    g, h = torch.tensor([0.5, -1.0, 2.0, -0.25]), torch.tensor([1.0, 1.0, -1.0, 0.5])
    lr, eps = 0.1, 1e-8
    weight = torch.nn.Parameter(start.clone())
    optimizer = adamw([{"params": [weight], "lr": lr}], state, eps)
    for grad in (g, h):
        weight.grad = grad.clone()
        optimizer.step()
    after_one = start - lr * g / (g.abs() + eps)
    m = (0.1 * 0.9 * g + 0.1 * h) / (1 - 0.9**2)
    v = (0.001 * 0.999 * g**2 + 0.001 * h**2) / (1 - 0.999**2)
    torch.testing.assert_close(weight.detach(), after_one - lr * m / (v.sqrt() + eps), rtol=1e-5, atol=1e-6)
