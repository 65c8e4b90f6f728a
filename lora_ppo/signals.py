"""Ctrl-C and SIGTERM during training: the first asks the run to stop after the current step
(which then saves a checkpoint); a second abandons the step at once."""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


@dataclass
class StopRequest:
    requested: bool = False


@contextmanager
def stop_on_signals(announce: bool = True) -> Iterator[StopRequest]:
    """Catch SIGINT and SIGTERM for the duration; the previous handlers come back afterwards.
    `announce`: say so on stderr (one process of several keeps quiet)."""
    request = StopRequest()

    def handler(signum, frame):
        if request.requested:
            raise KeyboardInterrupt
        request.requested = True
        if announce:
            print("\nstopping after this step to save a checkpoint (again to abandon the step)", file=sys.stderr)

    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: leave signals alone
        pass
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
