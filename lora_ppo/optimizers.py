"""AdamW for the trainable adapters, with its two moments kept where the recipe says
(`ppo.optimizer_state`): fp32 on the device, 8-bit blockwise on the device (bitsandbytes'
AdamW8bit), or fp32 in CPU memory with the step computed there. AdamW's moments are 8 bytes per
trainable weight: 2.15 GB for r=16 policy and value adapters on a 32B model."""

from __future__ import annotations

from typing import Any, Literal

import torch

OptimizerState = Literal["device", "8bit", "cpu"]
# bitsandbytes keeps a tensor's moments in 32 bits below this many elements (its own default):
# small tensors (the value head, biases) gain nothing from 8 bits.
MIN_8BIT_SIZE = 4096
ADAMW_DEFAULTS = {"betas": (0.9, 0.999), "weight_decay": 0.0}


def adamw(groups: list[dict[str, Any]], state: OptimizerState, eps: float) -> torch.optim.Optimizer:
    """AdamW without weight decay over `groups` (each with its params and lr), its moments kept
    as `state` says."""
    if state == "device":
        return torch.optim.AdamW(groups, eps=eps, **ADAMW_DEFAULTS)
    if state == "8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, eps=eps, min_8bit_size=MIN_8BIT_SIZE, **ADAMW_DEFAULTS)
    if state == "cpu":
        return CpuAdamW(groups, eps=eps)
    raise ValueError(f"optimizer state must be device, 8bit or cpu, got {state!r}")


class CpuAdamW(torch.optim.Optimizer):
    """AdamW whose moments live in CPU memory (as DeepSpeed's ZeRO-Offload keeps them): a step
    copies each weight and its gradient to a CPU copy, runs torch's AdamW there, and copies the
    weight back. The device then holds weights and gradients only; the copies cost two transfers
    of the adapters per optimizer step. Outside `step` it behaves as the optimizer of the device
    weights: their param groups (what an lr schedule sets), zero_grad, and a state_dict that holds
    the CPU moments."""

    def __init__(self, groups: list[dict[str, Any]], eps: float) -> None:
        super().__init__(groups, {"lr": 1e-3, "eps": eps, **ADAMW_DEFAULTS})
        pin = torch.cuda.is_available()  # pinned host memory: faster copies to and from a GPU
        self.copies: list[list[torch.Tensor]] = [
            [torch.empty(p.shape, dtype=torch.float32, pin_memory=pin) for p in group["params"]]
            for group in self.param_groups
        ]
        host_groups = [{**_settings(group), "params": copies} for group, copies in zip(self.param_groups, self.copies)]
        self.host = torch.optim.AdamW(host_groups)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch's signature
        if closure is not None:
            raise ValueError("CpuAdamW does not take a closure")
        self._share_settings()
        for group, copies in zip(self.param_groups, self.copies):
            for param, copy in zip(group["params"], copies):
                # The weight is copied too, not only kept here: loading adapters (resume, init)
                # writes the device weights.
                copy.copy_(param)
                copy.grad = None if param.grad is None else param.grad.to("cpu", torch.float32)
        self.host.step()
        for group, copies in zip(self.param_groups, self.copies):
            for param, copy in zip(group["params"], copies):
                if copy.grad is not None:
                    param.copy_(copy)
                    copy.grad = None
        return None

    def _share_settings(self) -> None:
        """Give the host groups what a schedule set in the device groups (the learning rate)."""
        for group, host_group in zip(self.param_groups, self.host.param_groups):
            host_group.update(_settings(group))

    def state_dict(self) -> dict[str, Any]:
        self._share_settings()  # updates skipped since the last step still moved the schedule
        return self.host.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.host.load_state_dict(state_dict)
        for group, host_group in zip(self.param_groups, self.host.param_groups):
            group.update(_settings(host_group))


def _settings(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings (lr, betas, ...), without its params."""
    return {k: v for k, v in group.items() if k != "params"}
