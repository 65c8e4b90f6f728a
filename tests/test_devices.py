"""The one device choice (lora_ppo.devices.device_type: CUDA, XPU, MPS, CPU in that order) and
what differs per device: device_map, compute dtype, forked and saved RNG streams, cache, peak and
free memory. Availability is monkeypatched: only CPU runs here for real (docs/devices.md)."""

from __future__ import annotations

import pytest
import torch

from lora_ppo import devices, memory
from lora_ppo.config import ModelConfig
from lora_ppo.distributed import World
from lora_ppo.model import free_memory_bytes
from lora_ppo.devices import (
    device,
    device_map,
    device_rng_states,
    device_type,
    fork_rng_args,
    restore_device_rng_states,
)
from lora_ppo.quantization import compute_dtype

ON_CPU_ONLY = not torch.cuda.is_available() and not torch.xpu.is_available() and not torch.backends.mps.is_available()


def _available(monkeypatch, *kinds: str) -> None:
    """Make exactly `kinds` of cuda, xpu and mps report themselves available."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: "cuda" in kinds)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: "xpu" in kinds)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: "mps" in kinds)


@pytest.mark.parametrize("available, expected", [
    (("cuda", "xpu", "mps"), "cuda"),
    (("cuda", "mps"), "cuda"),
    (("xpu", "mps"), "xpu"),
    (("mps",), "mps"),
    ((), "cpu"),
])
def test_the_device_is_the_first_available_of_cuda_xpu_mps_cpu(monkeypatch, available, expected):
    _available(monkeypatch, *available)
    assert device_type() == expected


def test_a_torch_without_xpu_goes_on_to_mps(monkeypatch):
    _available(monkeypatch, "mps")
    monkeypatch.delattr(torch, "xpu")
    assert device_type() == "mps"


def test_device_is_the_current_gpu_or_the_device_itself(monkeypatch):
    _available(monkeypatch, "cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert device() == torch.device("cuda", 1)
    _available(monkeypatch, "xpu")
    monkeypatch.setattr(torch.xpu, "current_device", lambda: 2)
    assert device() == torch.device("xpu", 2)
    _available(monkeypatch, "mps")
    assert device() == torch.device("mps")
    _available(monkeypatch)
    assert device() == torch.device("cpu")


@pytest.mark.skipif(not ON_CPU_ONLY, reason="checks a machine without an accelerator")
def test_on_this_cpu_machine_the_real_choice_is_cpu():
    assert device_type() == "cpu"
    assert device() == torch.device("cpu")
    assert device_map() == {"": "cpu"}
    assert device_rng_states() == {}
    assert compute_dtype(ModelConfig()) is torch.float32


@pytest.mark.parametrize("dev, expected", [
    (torch.device("cuda", 1), {"": 1}),  # a bare int: a CUDA ordinal, as before
    (torch.device("xpu", 0), {"": "xpu:0"}),
    (torch.device("mps"), {"": "mps"}),
    (torch.device("cpu"), {"": "cpu"}),
])
def test_device_map_puts_the_whole_model_on_the_device(dev, expected):
    assert device_map(dev) == expected


@pytest.mark.parametrize("dev", [torch.device("cuda", 0), torch.device("xpu", 1), torch.device("mps")])
def test_fork_rng_forks_the_accelerator_stream_of_the_device(dev):
    assert fork_rng_args(dev) == {"devices": [dev], "device_type": dev.type}


def test_fork_rng_on_cpu_forks_the_cpu_stream_alone():
    assert fork_rng_args(torch.device("cpu")) == {"devices": []}
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    with torch.random.fork_rng(**fork_rng_args(torch.device("cpu"))):
        torch.manual_seed(99)
        torch.rand(10)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("available, bf16, expected", [
    (("cuda",), True, torch.bfloat16),
    (("cuda",), False, torch.float16),
    (("xpu",), True, torch.bfloat16),
    (("xpu",), False, torch.float16),
    (("mps",), True, torch.bfloat16),  # macOS 14 or newer
    (("mps",), False, torch.float16),
    ((), True, torch.float32),
])
def test_auto_compute_dtype_per_device(monkeypatch, available, bf16, expected):
    _available(monkeypatch, *available)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.xpu, "is_bf16_supported", lambda *a, **k: bf16)
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: bf16)
    assert compute_dtype(ModelConfig()) is expected
    assert compute_dtype(ModelConfig(compute_dtype="float16")) is torch.float16  # the recipe's own choice wins


@pytest.mark.parametrize("macos, expected", [((13, 6), False), ((14, 0), True), ((15, 1), True)])
def test_mps_computes_in_bfloat16_from_macos_14(monkeypatch, macos, expected):
    monkeypatch.setattr(torch.backends.mps, "is_macos_or_newer", lambda major, minor: macos >= (major, minor))
    assert devices.bf16_supported("mps") is expected


def test_bfloat16_support_is_asked_of_the_named_device_and_never_on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.xpu, "is_bf16_supported", lambda *a, **k: True)
    _available(monkeypatch)  # this machine is a CPU: the answer is the named device's, not its own
    assert devices.bf16_supported("cuda") and devices.bf16_supported("xpu")
    assert devices.bf16_supported("cpu") is False


class _Recorder:
    """Stands in for torch.cuda / torch.xpu / torch.mps: records the calls made to it."""

    def __init__(self, rows: int = 2):
        self.calls: list[tuple] = []
        self.states = [torch.full((3,), i, dtype=torch.uint8) for i in range(rows)]

    def __getattr__(self, name):
        returns = {
            "get_rng_state_all": self.states, "get_rng_state": self.states[0],
            "max_memory_allocated": 123, "driver_allocated_memory": 456,
            "mem_get_info": (1000, 5000), "memory_reserved": 300, "memory_allocated": 200,
            "recommended_max_memory": 900, "current_allocated_memory": 400, "current_device": 1,
        }

        def call(*args, **kwargs):
            self.calls.append((name, *args))
            return returns.get(name)

        return call


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_rng_states_of_every_gpu_are_saved_and_restored(monkeypatch, kind):
    gpu = _Recorder()
    monkeypatch.setattr(torch, kind, gpu)
    monkeypatch.setattr(devices, "device_type", lambda: kind)
    saved = device_rng_states()
    assert list(saved) == [kind] and torch.equal(saved[kind], torch.stack(gpu.states))
    restore_device_rng_states(saved)
    [(name, restored)] = [c for c in gpu.calls if c[0] == "set_rng_state_all"]
    assert [r.tolist() for r in restored] == [s.tolist() for s in gpu.states]


def test_mps_rng_state_is_saved_and_restored(monkeypatch):
    mps = _Recorder(rows=1)
    monkeypatch.setattr(torch, "mps", mps)
    monkeypatch.setattr(devices, "device_type", lambda: "mps")
    saved = device_rng_states()
    assert list(saved) == ["mps"] and torch.equal(saved["mps"], mps.states[0])
    restore_device_rng_states(saved)
    assert [c[0] for c in mps.calls] == ["get_rng_state", "set_rng_state"]


def test_rng_states_saved_on_another_device_are_left_alone(monkeypatch):
    gpu = _Recorder()
    monkeypatch.setattr(torch, "cuda", gpu)
    monkeypatch.setattr(devices, "device_type", lambda: "cuda")
    restore_device_rng_states({"mps": torch.zeros(3, dtype=torch.uint8)})  # saved on a Mac, resumed on CUDA
    assert gpu.calls == []


@pytest.mark.parametrize("kind", ["cuda", "xpu", "mps"])
def test_empty_cache_empties_the_device_in_use(monkeypatch, kind):
    gpu = _Recorder()
    monkeypatch.setattr(torch, kind, gpu)
    monkeypatch.setattr(devices, "device_type", lambda: kind)
    devices.empty_cache()
    assert gpu.calls == [("empty_cache",)]


@pytest.mark.parametrize("kind, peak", [("cuda", 123), ("xpu", 123), ("mps", 456)])
def test_peak_memory_is_read_and_reset_on_the_accelerator(monkeypatch, kind, peak):
    gpu = _Recorder()
    monkeypatch.setattr(torch, kind, gpu)
    monkeypatch.setattr(memory, "_accelerator", lambda: kind)
    monkeypatch.setattr(memory, "_reset_cpu_peak", lambda: pytest.fail("reset the CPU peak on a GPU"))
    assert memory.peak_bytes() == peak
    memory.release_memory()
    memory.reset_peak()
    names = [c[0] for c in gpu.calls]
    assert "empty_cache" in names
    assert ("reset_peak_memory_stats" in names) == (kind != "mps")  # MPS keeps no peak to reset


@pytest.mark.skipif(not ON_CPU_ONLY, reason="checks a machine without an accelerator")
def test_memory_sees_no_accelerator_on_this_cpu_machine():
    assert memory._accelerator() is None


@pytest.mark.parametrize("dev, expected", [
    (torch.device("cuda", 0), 1000 + 300 - 200),  # driver's free + allocator's cached, unused
    (torch.device("xpu", 0), 1000 + 300 - 200),
    (torch.device("mps"), 900 - 400),  # recommended working set - tensors
])
def test_free_memory_per_device(monkeypatch, dev, expected):
    monkeypatch.setattr(torch, dev.type, _Recorder())
    assert free_memory_bytes(dev) == expected


@pytest.mark.parametrize("fraction, expected", [
    (1.0, 1000 + 300 - 200),  # no cap: what the driver and the allocator's cache leave
    (0.5, 1000 + 300 - 200),  # a cap of 2500 bytes of 5000 leaves 2300: the driver's 1100 binds
    (0.1, 500 - 200),  # a cap of 500 bytes: 300 more may be allocated, whatever the driver says
    (0.0, 0),  # a cap of nothing: the 200 held are already past it
])
@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_free_memory_honours_the_process_allocator_cap(monkeypatch, kind, fraction, expected):
    gpu = _Recorder()
    gpu.get_per_process_memory_fraction = lambda device=None: fraction
    monkeypatch.setattr(torch, kind, gpu)
    assert free_memory_bytes(torch.device(kind, 0)) == expected


def test_dequantize_auto_stays_off_under_a_cap_the_copy_does_not_fit(monkeypatch):
    """The bug the cap fix is for: a 12 GB cap on an 80 GB card read as 78 GB free, and
    `dequantize_per_step: auto` chose a 14 GB dequantized copy. Under the cap 7 GB are free."""
    import lora_ppo.model as model_module

    gpu, gb = _Recorder(), 10**9
    gpu.mem_get_info = lambda device=None: (78 * gb, 80 * gb)
    gpu.memory_reserved = lambda device=None: 5 * gb
    gpu.memory_allocated = lambda device=None: 5 * gb
    gpu.get_per_process_memory_fraction = lambda device=None: 12 / 80
    monkeypatch.setattr(torch, "cuda", gpu)
    monkeypatch.setattr(model_module, "device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(model_module, "dequantized_4bit_bytes", lambda model, dtype: 3 * gb)
    assert free_memory_bytes(torch.device("cuda", 0)) == 7 * gb  # 12 GB cap - 5 GB held, not 78 GB
    assert model_module._dequantized_copy_fits(torch.nn.Linear(1, 1), torch.bfloat16)  # 3 GB <= half of 7
    monkeypatch.setattr(model_module, "dequantized_4bit_bytes", lambda model, dtype: 14 * gb)
    assert not model_module._dequantized_copy_fits(torch.nn.Linear(1, 1), torch.bfloat16)


@pytest.mark.parametrize("backend, expected", [
    ("nccl", torch.device("cuda", 1)), ("xccl", torch.device("xpu", 1)), ("gloo", torch.device("cpu")),
])
def test_collectives_put_their_tensors_on_the_backend_device(monkeypatch, backend, expected):
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: backend)
    if expected.type != "cpu":
        monkeypatch.setattr(torch, expected.type, _Recorder())
    assert World(rank=0, size=2).device == expected
    assert World().device == torch.device("cpu")  # alone: no process group to ask
