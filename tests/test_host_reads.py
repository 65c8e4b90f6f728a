"""Scoring reads the device once, and the update twice per minibatch, not once per statistic, packed
(`ppo.packing`) or not.

On a GPU every read of a tensor's value into Python (`float(t)`, `t.item()`, `if t:`, boolean
indexing) waits until the GPU has run everything queued before it; between a forward and its
backward that leaves the GPU idle while Python launches the next kernels. Here the rollout's tensors
are marked as device memory (a tensor subclass that counts such reads, and passes everything else
through), so the reads of anything computed from them are counted on CPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import traceback

import pytest
import torch

from lora_ppo.config import PPOConfig
from lora_ppo.rollout import score_passes
from lora_ppo.update import UpdateSettings, compute_advantages, ppo_update
from tests.conftest import rollout_for_update

# What waits for the device: reading values into Python or onto the host.
READS = {"__bool__", "__float__", "__int__", "__index__", "item", "tolist", "nonzero", "cpu", "numpy"}
LIBRARIES = ("transformers", "peft", "bitsandbytes")


class OnDevice(torch.Tensor):
    """A tensor standing for GPU memory: `reads` logs, per read of its values, which library asked."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        targets = (*args[1:], *(kwargs or {}).values())
        to_host = name == "to" and any(a == "cpu" or a == torch.device("cpu") for a in targets)
        if name in READS or to_host:
            frames = [f.filename for f in traceback.extract_stack()[:-1]]
            library = next((lib for f in reversed(frames) for lib in LIBRARIES if f"/{lib}/" in f), "lora_ppo")
            cls.reads.append(library)
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **(kwargs or {}))
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out  # now on the host
        return super().__torch_function__(func, types, args, kwargs)


def on_device(rollout):
    fields = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout)}
    return dataclasses.replace(rollout, **{k: v.as_subclass(OnDevice) for k, v in fields.items()
                                            if isinstance(v, torch.Tensor)})


def reads_of_an_update(roles, rollout, micro_batch: int, epochs: int, minibatches: int,
                       packing: bool = False) -> list[str]:
    cfg = PPOConfig(num_epochs=epochs, num_minibatches=minibatches)
    rollout = on_device(rollout)
    adv = compute_advantages(rollout, cfg, 0.05, rollout.scores)
    batch = rollout.response_ids.shape[0]
    settings = UpdateSettings(batch // minibatches, micro_batch, 1.0, gradient_checkpointing=True)
    roles.packing = packing
    optimizer = torch.optim.SGD(roles.policy_parameters() + roles.value_parameters(), lr=1e-3)
    OnDevice.reads = []
    ppo_update(roles, optimizer, None, rollout, adv, cfg, settings, 0.05, torch.Generator().manual_seed(0))
    return OnDevice.reads


@pytest.mark.parametrize("padded", [False, True], ids=["equal-lengths", "padded"])
def test_an_update_reads_what_it_computed_once_per_minibatch_whatever_its_micro_batches(make_roles, tiny_tokenizer,
                                                                                          padded):
    """2 epochs x 2 minibatches of 2 rows: the two masks once (the counts and column cuts), each
    minibatch's mean ratio and loss checks once, then the logged means and the self-check once each,
    in micro-batches of one row as of two. (The optimizer step's read of the gradients' norms is not
    counted: the gradients are the adapters', not computed from the marked rollout.) transformers
    reads a mask with padding to decide its attention path; a micro-batch without padding gives it
    none to read."""
    roles = make_roles(seed=1, scale=0.3)
    rollout = rollout_for_update(roles, tiny_tokenizer)
    if not padded:  # every prompt and response at full length
        rollout = dataclasses.replace(rollout, query_mask=torch.ones_like(rollout.query_mask),
                                      response_mask=torch.ones_like(rollout.response_mask))
    expected_own = 2 + 2 * 2 + 2
    for micro_batch in (1, 2):
        reads = reads_of_an_update(roles, rollout, micro_batch, epochs=2, minibatches=2)
        own = [r for r in reads if r == "lora_ppo"]
        assert len(own) == expected_own, (micro_batch, reads)
        if not padded:
            assert reads == own, (micro_batch, reads)


def test_a_packed_update_reads_no_more_than_an_unpacked_one(make_roles, tiny_tokenizer):
    """`ppo.packing` makes its packed sequences and the indices of their tokens on the host, from the
    host's masks, and copies them to the device once per minibatch: the update's own reads stay the 8
    above. (transformers reads each packed forward's positions once, to part its rows: those positions
    are made on the host, so that read is not counted here.)"""
    roles = make_roles(seed=1, scale=0.3)
    rollout = rollout_for_update(roles, tiny_tokenizer)
    for micro_batch in (1, 2):
        reads = reads_of_an_update(roles, rollout, micro_batch, epochs=2, minibatches=2, packing=True)
        assert reads == ["lora_ppo"] * (2 + 2 * 2 + 2), (micro_batch, reads)


@pytest.mark.parametrize("padded", [False, True], ids=["equal-lengths", "padded"])
def test_scoring_reads_the_device_once_whatever_its_micro_batches(make_roles, tiny_tokenizer, padded):
    """The mask, once (lengths and column cuts, or packed sequences); the logprobs and values stay on the
    device. (Packed, transformers reads each forward's positions to part its rows: made on the host, they
    are not counted here.)"""
    roles = make_roles(seed=1, scale=0.3)
    rollout = rollout_for_update(roles, tiny_tokenizer)
    ids, mask = rollout.input_ids, rollout.attention_mask
    if not padded:
        mask = torch.ones_like(mask)
    start = rollout.response_start
    for rows, together, packing in itertools.product((1, 4), (True, False), (False, True)):
        roles.packing = packing
        OnDevice.reads = []
        score_passes(roles, ids.as_subclass(OnDevice), mask.as_subclass(OnDevice), start, 1.0, rows,
                     together=together)
        own = [r for r in OnDevice.reads if r == "lora_ppo"]
        assert len(own) == 1, (rows, together, packing, OnDevice.reads)
        if not padded and not packing:
            assert OnDevice.reads == own, (rows, together, OnDevice.reads)
