"""The libraries' notices a run does not need to show, kept out of the Python API as the CLI keeps
them out of its output: loading bars, notices about an optional bitsandbytes kernel, and PEFT's
read of a transformers property that transformers has renamed.
"""

from __future__ import annotations

import functools
import logging
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable)

# At import on a CPU with AVX512-BF16, bitsandbytes asks the `kernels` package (a dependency of
# transformers since 5.25) for an optional 4-bit CPU kernel from the hub; offline or without it,
# both log a notice and bitsandbytes uses its own kernel. Nothing for a user to act on.
HUB_KERNEL_LOGGERS = ("bitsandbytes.backends.cpu.ops", "kernels")
# PEFT 0.21 reads `model.is_gradient_checkpointing` when it wraps a model; transformers renamed it
# `is_activation_checkpointing` (the old name goes in v6). lora_ppo reads neither: it checkpoints
# layers itself (RoleModel.gradient_checkpointing), so the notice is PEFT's to act on, not the user's.
PEFT_RENAMED_PROPERTY = r"`is_gradient_checkpointing` is deprecated"


def without_peft_rename_notice(fn: F) -> F:
    """`fn` (a function that wraps a model with PEFT) without the notice of PEFT_RENAMED_PROPERTY."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=PEFT_RENAMED_PROPERTY, category=FutureWarning)
            return fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]


def quiet_hub_kernel_notices() -> None:
    """Keep HUB_KERNEL_LOGGERS' notices (they come once, at bitsandbytes' first import) out of the output."""
    for name in HUB_KERNEL_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


@contextmanager
def quiet_loading() -> Iterator[None]:
    """Load a model without transformers' loading bar or the hub kernel notices; the bar's
    setting comes back afterwards (a user's own loads keep theirs)."""
    from transformers.utils import logging as hf_logging

    quiet_hub_kernel_notices()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
