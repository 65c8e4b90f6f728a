"""Progress without a terminal: where no bar can redraw (a log file, CI, nohup, a job scheduler),
one log line each time another tenth of the work is done, with the same `update` / `close` a tqdm
bar has, so a loop reports through either."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

STEPS_SHOWN = 10  # lines per piece of work, at most


class LineProgress:
    """Logs `desc: done/total (elapsed)` at every tenth of `total`, and the end."""

    def __init__(self, total: float, desc: str, unit: str = "") -> None:
        self.total, self.desc, self.unit = total, desc, f" {unit}" if unit else ""
        self.done = 0.0
        self.shown = 0  # tenths already logged
        self.start = time.perf_counter()
        log.info("%s: 0/%g%s", desc, total, self.unit)

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.done += n
        tenth = int(STEPS_SHOWN * self.done / self.total) if self.total else STEPS_SHOWN
        if tenth > self.shown:
            self.shown = tenth
            log.info("%s: %g/%g%s (%.0f s)", self.desc, self.done, self.total, self.unit,
                     time.perf_counter() - self.start)

    def close(self) -> None:
        """Nothing to tidy: every line is already written."""
