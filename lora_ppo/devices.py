"""The one device everything runs on (CUDA, XPU, MPS or CPU), and what differs per device:
device_map, bfloat16 support, cache, forked and saved RNG streams. Imports torch alone, so every
layer can ask it. docs/devices.md says which devices are tested."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Literal, Mapping, Optional

import torch

DeviceType = Literal["cuda", "xpu", "mps", "cpu"]
# Devices with their own RNG, cache and memory counters in a torch module of the same name.
ACCELERATORS = ("cuda", "xpu", "mps")
# MPS computes in bfloat16 from macOS 14 on; before that only float16.
MPS_BF16_MACOS = (14, 0)


def device_type() -> DeviceType:
    """The kind of device to run on, the first available of: CUDA (ROCm builds of torch report
    through torch.cuda too), Intel XPU, Apple MPS; else CPU. The one place that decides it."""
    if torch.cuda.is_available():
        return "cuda"
    xpu = getattr(torch, "xpu", None)  # absent from older torch builds
    if xpu is not None and xpu.is_available():
        return "xpu"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def accelerator_module(kind: str) -> Optional[ModuleType]:
    """torch.cuda, torch.xpu or torch.mps for an accelerator's device type; None for CPU."""
    return getattr(torch, kind) if kind in ACCELERATORS else None


def model_device(model: torch.nn.Module) -> torch.device:
    """The device a model's (first) parameters are on."""
    return next(model.parameters()).device


def device() -> torch.device:
    """The device to put models and tensors on: the current CUDA or XPU device, MPS, or CPU."""
    kind = device_type()
    if kind in ("cuda", "xpu"):
        return torch.device(kind, accelerator_module(kind).current_device())
    return torch.device(kind)


def device_map(dev: Optional[torch.device] = None) -> dict[str, Any]:
    """`from_pretrained`'s device_map putting the whole model on `dev` (default: `device()`)."""
    dev = device() if dev is None else dev
    if dev.type == "cuda":
        return {"": dev.index}  # transformers and accelerate read a bare int as a CUDA ordinal
    return {"": str(dev)}  # "xpu:0", "mps", "cpu"


def bf16_supported(kind: str) -> bool:
    """Whether a device of this type computes in bfloat16; False on CPU, where the recipe's rule
    never asks."""
    if kind in ("cuda", "xpu"):
        return accelerator_module(kind).is_bf16_supported()
    if kind == "mps":
        return torch.backends.mps.is_macos_or_newer(*MPS_BF16_MACOS)
    return False


def empty_cache() -> None:
    """Hand the accelerator's cached free blocks back to its driver; nothing on CPU."""
    module = accelerator_module(device_type())
    if module is not None:
        module.empty_cache()


def fork_rng_args(dev: torch.device) -> dict[str, Any]:
    """Keyword arguments for `torch.random.fork_rng` that fork the CPU RNG and `dev`'s own."""
    if dev.type not in ACCELERATORS:
        return {"devices": []}  # the CPU RNG is always forked
    return {"devices": [dev], "device_type": dev.type}


def device_rng_states() -> dict[str, torch.Tensor]:
    """The accelerator's RNG states, keyed by its device type (one row per CUDA or XPU device;
    MPS has one generator); empty on CPU."""
    kind = device_type()
    if kind == "mps":
        return {"mps": torch.mps.get_rng_state()}
    if kind in ("cuda", "xpu"):
        return {kind: torch.stack(accelerator_module(kind).get_rng_state_all())}
    return {}


def restore_device_rng_states(tensors: Mapping[str, torch.Tensor]) -> None:
    """Restore what `device_rng_states` saved, when it was saved on this kind of device (a
    checkpoint from a GPU resumed on CPU has nothing here to restore)."""
    kind = device_type()
    if kind not in tensors:
        return
    if kind == "mps":
        torch.mps.set_rng_state(tensors["mps"])
    elif kind in ("cuda", "xpu"):
        accelerator_module(kind).set_rng_state_all(list(tensors[kind]))
