"""Peak memory per phase (generate, score, update), handing freed memory back between phases, and
the CPU memory still available (Linux's MemAvailable, for the free memory a run plans with).

On CUDA and XPU the peak is the allocator's `max_memory_allocated` (what the tensors need); MPS
keeps no peak, so there it is what the Metal driver holds at the phase's end (freed blocks stay
in its cache until `release_memory`, so that approximates the phase's peak); on CPU it is the
process's peak resident set (VmHWM), which Linux lets a process reset through
/proc/self/clear_refs, so each phase gets its own high-water mark.
"""

from __future__ import annotations

import ctypes
import gc
import resource
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch

from lora_ppo.devices import device_type

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")
_MEMINFO = Path("/proc/meminfo")


def _accelerator() -> Optional[str]:
    """"cuda", "xpu" or "mps": the accelerator lora_ppo runs on; None on CPU."""
    kind = device_type()
    return None if kind == "cpu" else kind


def _proc_field_bytes(path: Path, field: str) -> Optional[int]:
    """A `field:   N kB` line of a /proc file in bytes; None where there is no such file or line."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident_bytes(field: str = "VmRSS") -> int:
    """A /proc/self/status memory field in bytes (VmRSS now, VmHWM the peak); 0 off Linux."""
    return _proc_field_bytes(_STATUS, field) or 0


def available_cpu_bytes() -> Optional[int]:
    """What the kernel says can still be allocated without swapping (Linux's MemAvailable), in
    bytes; None off Linux."""
    return _proc_field_bytes(_MEMINFO, "MemAvailable")


def _reset_cpu_peak() -> None:
    try:
        _CLEAR_REFS.write_text("5")  # "5" resets the peak RSS to the current RSS
    except OSError:
        pass  # an older kernel or another OS: the peak stays the process-wide one


def release_memory() -> None:
    """Give freed memory back before the next phase: the allocator's cache on a GPU, glibc's free
    lists on CPU (without it a phase's peak would include the previous phase's freed blocks)."""
    # A step's cyclic garbage is young: collecting generations 0-1 takes well under a millisecond,
    # where a full collection walks every object the libraries hold (bench/README.md, vs_trl.py).
    gc.collect(1)
    kind = _accelerator()
    if kind is not None:
        getattr(torch, kind).empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_run_peak = 0  # the largest peak seen before any reset: resets erase the process-wide one


def reset_peak() -> None:
    global _run_peak
    _run_peak = max(_run_peak, peak_bytes())
    kind = _accelerator()
    if kind in ("cuda", "xpu"):
        getattr(torch, kind).reset_peak_memory_stats()
    elif kind is None:  # MPS has no peak to reset: release_memory emptied its cache
        _reset_cpu_peak()


def peak_bytes() -> int:
    """Peak since the last `reset_peak`: GPU allocated bytes (on MPS what its driver holds now),
    or the CPU process's peak RSS."""
    kind = _accelerator()
    if kind in ("cuda", "xpu"):
        return getattr(torch, kind).max_memory_allocated()
    if kind == "mps":
        return torch.mps.driver_allocated_memory()
    hwm = resident_bytes("VmHWM")
    if hwm:
        return hwm
    # Never reset; Linux counts KiB, macOS bytes.
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def peak_live_cpu_bytes(run) -> int:
    """The most bytes torch's CPU allocator held at once while `run()` ran, above what it held
    before: what a GPU's `max_memory_allocated` counts, where the resident set (`peak_bytes`) also
    counts what glibc keeps. From the profiler's allocation and free events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


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
