"""Per-phase peak memory in metrics.jsonl: each phase gets its own high-water mark, freed memory
goes back between phases, and the run-wide peak survives the per-phase resets; the /proc figures
behind them (and behind the CPU's free memory) are read in bytes."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from lora_ppo import memory
from lora_ppo.model import free_memory_bytes

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU (resident memory) path")


@pytest.fixture()
def resettable_peak():
    """Skip where the kernel does not let a process reset its peak RSS (checked when the test
    runs, not at collection, so collecting the suite allocates nothing)."""
    memory.reset_peak()
    before = memory.peak_bytes()
    x = torch.ones(50_000_000)  # 200 MB touched
    x += 1
    del x
    memory.release_memory()
    memory.reset_peak()
    if memory.peak_bytes() >= before + 100e6:
        pytest.skip("this kernel does not let a process reset its peak RSS")


def test_a_transient_allocation_shows_in_its_own_phase_only(resettable_peak):
    peaks = memory.PhasePeaks()
    with peaks.phase("big"):
        x = torch.ones(75_000_000)  # 300 MB, touched, then freed inside the phase
        x += 1
        del x
    with peaks.phase("small"):
        torch.ones(1000).sum()
    assert peaks.peaks_gb["big"] - peaks.peaks_gb["small"] > 0.25
    # The run-wide peak still remembers the big phase after the reset for "small".
    assert memory.run_peak_gb() >= peaks.peaks_gb["big"] - 1e-6


@pytest.mark.parametrize("outlived_a_young_collection", [False, True])
def test_a_phase_cyclic_garbage_is_released_before_the_next_phase(resettable_peak, outlived_a_young_collection):
    """Garbage held in a reference cycle (as a library's cache object may be) is collected
    between phases, so it does not count in the next phase's peak; also when the collector ran
    while the step still held it (promoted past generation 0: the release collects 0 and 1)."""
    peaks = memory.PhasePeaks()
    with peaks.phase("big"):
        holder: dict = {"tensor": torch.ones(75_000_000)}  # 300 MB, touched
        holder["tensor"] += 1
        holder["self"] = holder  # a cycle: only the garbage collector frees it
        if outlived_a_young_collection:
            gc.collect(0)  # holder survives it, so it now sits in generation 1
        del holder
    with peaks.phase("small"):
        torch.ones(1000).sum()
    assert peaks.peaks_gb["big"] - peaks.peaks_gb["small"] > 0.25


def test_freed_heap_memory_goes_back_to_the_system_between_phases():
    """Many small blocks freed below one still in use stay in glibc's free lists (the process
    keeps them resident) until the release trims them, so the next phase does not count them."""
    blocks = [bytearray(8000) for _ in range(40_000)]  # 320 MB of malloc'd blocks, below mmap's threshold
    keep = bytearray(8000)  # above them on the heap: free() alone cannot shrink the heap
    held = memory.resident_bytes()
    del blocks
    if memory.resident_bytes() < held - 200e6:
        pytest.skip("this C library hands freed heap blocks back by itself")
    memory.release_memory()
    assert memory.resident_bytes() < held - 250e6
    del keep


def test_resident_fields_are_read_from_proc_in_bytes(monkeypatch, tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t   1500 kB\n")
    monkeypatch.setattr(memory, "_STATUS", status)
    assert memory.resident_bytes() == 1500 * 1024
    assert memory.resident_bytes("VmHWM") == 2048 * 1024
    assert memory.resident_bytes("VmSwap") == 0  # a field the kernel does not give
    monkeypatch.setattr(memory, "_STATUS", tmp_path / "absent")  # not Linux
    assert memory.resident_bytes() == 0


def test_the_cpu_memory_free_is_the_kernels_available_figure_in_bytes(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:    9000000 kB\n")
    monkeypatch.setattr(memory, "_MEMINFO", meminfo)
    assert free_memory_bytes(torch.device("cpu")) == 9_000_000 * 1024  # not MemFree: caches give way
    monkeypatch.setattr(memory, "_MEMINFO", tmp_path / "absent")  # not Linux: unknown
    assert free_memory_bytes(torch.device("cpu")) is None


@pytest.mark.parametrize("platform, expected", [("linux", 3000 * 1024), ("darwin", 3000)])
def test_without_proc_the_peak_is_the_rusage_maximum_in_bytes(monkeypatch, tmp_path, platform, expected):
    """Off Linux there is no VmHWM: the peak is getrusage's ru_maxrss, which Linux counts in KiB
    and macOS in bytes."""
    monkeypatch.setattr(memory, "_STATUS", tmp_path / "absent")
    monkeypatch.setattr(memory.resource, "getrusage", lambda who: types.SimpleNamespace(ru_maxrss=3000))
    monkeypatch.setattr(memory.sys, "platform", platform)
    assert memory.peak_bytes() == expected


def test_the_run_peak_is_in_gb_and_the_largest_before_or_after_resets(monkeypatch):
    monkeypatch.setattr(memory, "_run_peak", 3e9)
    monkeypatch.setattr(memory, "peak_bytes", lambda: 2e9)
    assert memory.run_peak_gb() == 3.0
    monkeypatch.setattr(memory, "peak_bytes", lambda: 4.5e9)
    assert memory.run_peak_gb() == 4.5


def test_the_live_cpu_peak_counts_what_is_held_at_once_not_what_was_ever_allocated():
    def run():
        first = torch.empty(1_000_000)  # 4 MB, freed before the next two
        del first
        second, third = torch.empty(1_000_000), torch.empty(250_000)  # 5 MB at once
        del second, third

    assert memory.peak_live_cpu_bytes(run) == 5_000_000
