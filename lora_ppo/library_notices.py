"""The libraries' notices a run does not need to show, kept out of the Python API as the CLI keeps
them out of its output: loading bars, a bitsandbytes notice about an optional kernel, and PEFT's
read of a transformers property that transformers has renamed.
"""

from __future__ import annotations

import functools
import logging
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable)

# bitsandbytes logs at import that an optional CPU kernel from the hub is missing; it falls back
# to its own kernel, and lora_ppo never reaches a hub for code.
BNB_KERNEL_LOGGER = "bitsandbytes.backends.cpu.ops"
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


@contextmanager
def quiet_loading() -> Iterator[None]:
    """Load a model without transformers' loading bar or bitsandbytes' kernel notice; the bar's
    setting comes back afterwards (a user's own loads keep theirs)."""
    from transformers.utils import logging as hf_logging

    logging.getLogger(BNB_KERNEL_LOGGER).setLevel(logging.ERROR)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()
