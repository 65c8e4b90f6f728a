"""Switching the active LoRA adapter by setting it on each LoRA layer, without PEFT's walk; and
passing each row's adapter to the layers (PEFT's mixed batches) the same way.

PEFT's `set_adapter` walks every module of the model and sets `requires_grad` on every adapter
weight of every LoRA layer, `disable_adapter` also computes the model's status first, and its
context for per-row adapters walks the model twice to hook each LoRA layer: tens of milliseconds
each for an 8B model, paid about 40 times in a one-step run of the 8B recipe (bench/README.md,
update_host_ops.py). A role's `requires_grad` never changes (`RoleModel._fix_requires_grad` undid
PEFT's change after every switch), so what is left is what PEFT's forward reads on each layer.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional


class AdapterSwitch:
    """The LoRA layers of a PEFT model, kept once, to set their active adapter directly. `of` gives
    one only where nothing else takes part in a switch (no `modules_to_save` or trainable tokens,
    which PEFT switches by module walk of their own) and the layers have the attributes this PEFT's
    forward reads."""

    def __init__(self, peft, layers: list):
        self.peft = peft
        self.layers = layers

    @classmethod
    def of(cls, peft) -> Optional["AdapterSwitch"]:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        modules = list(peft.modules())
        layers = [m for m in modules if isinstance(m, BaseTunerLayer)]
        if any(isinstance(m, AuxiliaryTrainingWrapper) for m in modules) or not all(
                hasattr(layer, "_active_adapter") and hasattr(layer, "_disable_adapters") for layer in layers):
            return None
        return cls(peft, layers)

    def activate(self, name: str) -> None:
        """What `peft.set_adapter(name)` sets, less its `requires_grad` changes."""
        self.peft.active_adapter = name
        self.peft.base_model.active_adapter = name
        for layer in self.layers:
            layer._active_adapter = [name]

    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[None]:
        """What `peft.disable_adapter()` sets for LoRA, less its `requires_grad` changes."""
        for layer in self.layers:
            layer._disable_adapters = True
        try:
            yield
        finally:
            for layer in self.layers:
                layer._disable_adapters = False

    @contextlib.contextmanager
    def rows_as_adapters(self, names: list[str]) -> Iterator[None]:
        """What PEFT's `_enable_peft_forward_hooks(adapter_names=names)` does for LoRA: each LoRA layer's
        forward gets `adapter_names`, so row i is computed with adapter `names[i]`. The hooks go on
        leaving, whatever ends the block."""
        def pass_names(_module, args, kwargs):
            kwargs["adapter_names"] = names
            return args, kwargs

        handles = [layer.register_forward_pre_hook(pass_names, with_kwargs=True) for layer in self.layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
