"""Per-phase peak memory in metrics.jsonl: each phase gets its own high-water mark, and the
run-wide peak survives the per-phase resets."""

from __future__ import annotations

import pytest
import torch

from lora_ppo import memory

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


def test_a_phase_cyclic_garbage_is_released_before_the_next_phase(resettable_peak):
    """Garbage held in a reference cycle (as a library's cache object may be) is collected
    between phases, so it does not count in the next phase's peak."""
    peaks = memory.PhasePeaks()
    with peaks.phase("big"):
        holder: dict = {"tensor": torch.ones(75_000_000)}  # 300 MB, touched
        holder["tensor"] += 1
        holder["self"] = holder  # a cycle: only the garbage collector frees it
        del holder
    with peaks.phase("small"):
        torch.ones(1000).sum()
    assert peaks.peaks_gb["big"] - peaks.peaks_gb["small"] > 0.25
