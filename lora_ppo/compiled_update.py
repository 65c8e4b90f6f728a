"""Compiled decoder layers for the PPO update (`ppo.compile_update`).

The update runs every decoder layer through PEFT's LoRA layers and bitsandbytes' 4-bit matmuls:
thousands of small kernels per micro-batch, each launched from Python. On a GPU below 8 rows a
micro-batch took about twice its kernels' time (bench/README.md). Here every decoder layer's forward
runs one function compiled once (`torch.compile`, sequence length dynamic), whose backward is
compiled with it: fewer launches, elementwise work fused. Inductor emulates eager's rounding of
each intermediate (`emulate_precision_casts`), so on CPU logprobs, losses and gradients are eager's
(bit for bit in bfloat16; in float32 within rounding, a norm being summed in another order:
tests/test_compiled_update.py) and the PPO ratio still starts at 1. On a GPU in bfloat16 its
logprobs were measured past the self-check's limit from the eager scoring pass's (bench/README.md):
bench/update_numerics.py tells there whether that is rounding or another function.

Gradient checkpointing stays eager, around the compiled forward: the forward's saved tensors are
dropped, and the backward reruns the compiled forward for the one layer it is in. With the
checkpoint compiled inside the function, a layer's recomputation held half as much again per row
as eager's and ran out of memory on the device where eager fit (bench/README.md, live_memory.py).

One graph per role: a layer's module is an input to the graph (not a constant), so a 32-layer model
compiles as few graphs as a 2-layer one, and the first layer's input is made to need a gradient as
every other layer's does.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from lora_ppo.errors import named_first_line

log = logging.getLogger(__name__)


def layer_forward(layer: torch.nn.Module, *args, **kwargs):
    """A decoder layer's own forward (not the instance's wrapper around it)."""
    return type(layer).forward(layer, *args, **kwargs)


def layer_step(layer: torch.nn.Module, checkpointing: bool, *args, forward=layer_forward, **kwargs):
    """`forward` (a decoder layer's own, or its compiled version) of `layer`, checkpointed or not."""
    run = functools.partial(forward, layer, **kwargs)
    return checkpoint(run, *args, use_reentrant=False) if checkpointing else run(*args)


class CompiledLayers:
    """The compiled layer step, what compiling has cost, and why it is off after a failure."""

    def __init__(self) -> None:
        # Each role, dequantized layers (model.dequantize_per_step) and a one-row micro-batch are
        # graphs of their own: past dynamo's default 8 per function, later ones would
        # run eager. Recent torch.compile (2.13 here) takes a limit of its own; older ones keep the default.
        limit = {"recompile_limit": 64} if "recompile_limit" in inspect.signature(torch.compile).parameters else {}
        compiled = torch.compile(layer_forward, dynamic=True, options={"emulate_precision_casts": True}, **limit)

        def forward(layer: torch.nn.Module, *args, **kwargs):
            # Dynamo gives dimensions of equal size one symbol ("duck shaping"): a first micro-batch
            # as long as a head is wide (the rotary tables' last dimension) would compile a graph for
            # that length alone, and every other length would compile a second one.
            with torch.fx.experimental._config.patch(use_duck_shape=False):
                return compiled(layer, *args, **kwargs)

        self._forward = forward
        self.compile_s = 0.0  # the calls that compiled a graph: compiling, then running one layer
        self.graphs = 0
        self.disabled: Optional[str] = None  # why the compiled path is off, after a failure

    def __call__(self, layer: torch.nn.Module, checkpointing: bool, *args, **kwargs):
        """One decoder layer's forward (checkpointed where `checkpointing`): compiled, or eager
        for good once compiling failed (one log line)."""
        if self.disabled is not None:
            return layer_step(layer, checkpointing, *args, **kwargs)
        inputs = args
        if args and isinstance(args[0], torch.Tensor) and not args[0].requires_grad:
            # The first layer's input (the embeddings) needs no gradient, which would make its graph
            # one of its own: as much compiling again as every other layer's. Asking for that gradient
            # costs one layer's input gradient, which is then dropped.
            inputs = (args[0].detach().requires_grad_(), *args[1:])
        graphs_before = unique_graphs()
        t0 = time.perf_counter()
        try:
            out = layer_step(layer, checkpointing, *inputs, forward=self._forward, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # noqa: BLE001 - any failure to compile means "run eager"
            self.disabled = named_first_line(error)
            log.warning("update: the compiled decoder layers cannot run here (%s); eager from now on", self.disabled)
            return layer_step(layer, checkpointing, *args, **kwargs)
        new = unique_graphs() - graphs_before
        if new:
            seconds = time.perf_counter() - t0
            self.graphs += new
            self.compile_s += seconds
            log.info("update: compiled a decoder layer graph (%d so far) in %.1f s", self.graphs, seconds)
        return out


def unique_graphs() -> int:
    """Graphs torch.compile has made in this process so far (every compiled path counts here)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
