"""Peak memory per phase (generate, score, update), and handing freed memory back between phases.

On GPU the peak is `torch.cuda.max_memory_allocated` (what the tensors need); on CPU it is the
process's peak resident set (VmHWM), which Linux lets a process reset through
/proc/self/clear_refs, so each phase gets its own high-water mark.
"""

from __future__ import annotations

import ctypes
import gc
import resource
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _on_gpu() -> bool:
    return torch.cuda.is_available()


def resident_bytes(field: str = "VmRSS") -> int:
    """A /proc/self/status memory field in bytes (VmRSS now, VmHWM the peak); 0 off Linux."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_cpu_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")  # "5" resets the peak RSS to the current RSS
        return True
    except OSError:
        return False


def release_memory() -> None:
    """Give freed memory back before the next phase: the CUDA cache on GPU, glibc's free lists
    on CPU (without it a phase's peak would include the previous phase's freed blocks)."""
    # A step's cyclic garbage is young: collecting generations 0-1 takes well under a millisecond,
    # where a full collection walks every object the libraries hold (bench/README.md, vs_trl.py).
    gc.collect(1)
    if _on_gpu():
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_run_peak = 0  # the largest peak seen before any reset: resets erase the process-wide one


def reset_peak() -> None:
    global _run_peak
    _run_peak = max(_run_peak, peak_bytes())
    if _on_gpu():
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_cpu_peak()


def peak_bytes() -> int:
    """Peak since the last `reset_peak`: GPU allocated bytes, or the CPU process's peak RSS."""
    if _on_gpu():
        return torch.cuda.max_memory_allocated()
    hwm = resident_bytes("VmHWM")
    if hwm:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux; never reset


def run_peak_gb() -> float:
    """Peak memory since the process started (across phase resets), in GB."""
    return max(_run_peak, peak_bytes()) / 1e9


class PhasePeaks:
    """Collects the peak memory of each named phase of a step, in GB."""

    def __init__(self) -> None:
        self.peaks_gb: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        release_memory()
        reset_peak()
        try:
            yield
        finally:
            self.peaks_gb[name] = max(self.peaks_gb.get(name, 0.0), peak_bytes() / 1e9)
