"""Ctrl-C and SIGTERM during training: the first asks the run to stop after the current step
(which then saves a checkpoint); a second abandons the step at once, and so does the first when
the step is still stuck in the user's code (a reward function, an environment, a tool)
STUCK_GRACE_S seconds after it: process managers send one TERM, then KILL."""

from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from lora_ppo.rewards import USER_CODE, UserCodeClock

# Seconds a step may stay in the user's code after a stop request before it is abandoned: a
# reward that calls a server returns within them; a hung one would otherwise wait for the KILL
# (docker stop sends it after 10 s, Kubernetes after 30 s).
STUCK_GRACE_S = 5.0
POLL_S = 0.05


@dataclass
class StopRequest:
    requested: bool = False
    at: float = 0.0  # time.monotonic() of the first signal
    active: bool = True  # the signals are still caught here
    lock: threading.Lock = field(default_factory=threading.Lock)


def stuck_for(request: StopRequest, clock: UserCodeClock, now: float) -> float:
    """Seconds the step has spent in the user's code since the stop request (0 when it is not in
    the user's code now)."""
    if not request.requested or clock.since is None:
        return 0.0
    return now - max(clock.since, request.at)


@contextmanager
def stop_on_signals(announce: bool = True) -> Iterator[StopRequest]:
    """Catch SIGINT and SIGTERM for the duration; the previous handlers come back afterwards.
    `announce`: say so on stderr (one process of several keeps quiet)."""
    request = StopRequest()
    main_thread = threading.main_thread().ident

    def handler(signum, frame):
        if request.requested:
            raise KeyboardInterrupt
        request.requested, request.at = True, time.monotonic()
        if announce:
            print("\nstopping after this step to save a checkpoint (again to abandon the step)", file=sys.stderr)
        threading.Thread(target=abandon_when_stuck, name="stop-watch", daemon=True).start()

    def abandon_when_stuck() -> None:
        while True:
            with request.lock:
                if not request.active:
                    return
                stuck = stuck_for(request, USER_CODE, time.monotonic())
                if stuck >= STUCK_GRACE_S:
                    print(f"{USER_CODE.what} is still running {stuck:.0f} s after the stop request: abandoning the "
                          "step (the run resumes from its newest checkpoint)", file=sys.stderr)
                    signal.pthread_kill(main_thread, signal.SIGINT)  # the handler above, a second time
                    return
            time.sleep(POLL_S)

    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: leave signals alone
        pass
    try:
        yield request
    finally:
        with request.lock:
            request.active = False
        for sig, old in previous.items():
            signal.signal(sig, old)
