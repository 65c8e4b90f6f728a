"""Data-parallel runs: which process this is and the few collectives PPO needs.

One process per GPU (started by `accelerate launch`, or `lora-ppo train --num-processes N`),
each with its own 4-bit backbone. A process generates and scores its share of the prompts; the
rollout is then gathered so every process holds the whole batch and computes the same
statistics (whitening, group baselines, KL controller, guard, metrics) as a single process
would; in the update each takes its share of every minibatch and the adapter gradients are
summed across processes before the optimizer step. `World()` is the single-process run, where
every collective returns its input.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, TypeVar

import torch

from lora_ppo.devices import device_type
from lora_ppo.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED

T = TypeVar("T")
# The process-group backends whose collectives run on a GPU, and that GPU's device type.
GPU_BACKENDS = {"nccl": "cuda", "xccl": "xpu"}


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        """The process that writes (metrics, checkpoints, final adapters) and prints."""
        return self.rank == 0

    def share(self, items: Sequence[T]) -> list[T]:
        """This process's contiguous share of `items` (their count divides by the world size)."""
        if len(items) % self.size:
            raise ValueError(f"{len(items)} items do not split over {self.size} processes")
        n = len(items) // self.size
        return list(items[self.rank * n : (self.rank + 1) * n])

    def gather(self, obj: Any) -> list[Any]:
        """Every process's `obj` (picklable), in rank order, on every process."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(out, obj)
        return out

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of `values` over processes (a new tensor)."""
        if self.size == 1:
            return values.clone()
        total = values.detach().clone()
        torch.distributed.all_reduce(total)
        return total

    def any(self, flag: bool) -> bool:
        """True on every process when it is True on any (e.g. a stop request)."""
        return bool(self.sum(torch.tensor([float(flag)], device=self.device))[0] > 0) if self.size > 1 else flag

    def sum_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Replace each parameter's gradient by its sum over processes, in one collective.

        Every process holds gradients for the same parameters (they run the same code)."""
        if self.size == 1:
            return
        with_grad = [p for p in parameters if p.grad is not None]
        if not with_grad:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in with_grad])
        torch.distributed.all_reduce(flat)
        offset = 0
        for p in with_grad:
            p.grad.copy_(flat[offset : offset + p.grad.numel()].view_as(p.grad))
            offset += p.grad.numel()

    def barrier(self) -> None:
        if self.size > 1:
            torch.distributed.barrier()

    @property
    def device(self) -> torch.device:
        """Where collectives put their tensors: the process's GPU under NCCL (CUDA) or XCCL (XPU),
        else the CPU (gloo)."""
        kind = GPU_BACKENDS.get(torch.distributed.get_backend()) if self.size > 1 else None
        if kind is not None:
            return torch.device(kind, getattr(torch, kind).current_device())
        return torch.device("cpu")


def launched_processes() -> int:
    """The number of processes a launcher (accelerate, torchrun) started this one among; 1 alone."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def join_world() -> World:
    """This process's place among the launched ones: the process group is set up by accelerate
    (NCCL with one GPU per process, gloo on CPU) the first time; alone, `World()`."""
    if launched_processes() == 1:
        return World()
    from accelerate import PartialState

    # MPS has no multi-process backend (docs/devices.md: one process there): gloo on the CPU.
    state = PartialState(cpu=device_type() not in GPU_BACKENDS.values())
    return World(rank=state.process_index, size=state.num_processes)


def leave_world(world: World) -> None:
    """Tear the process group down (a gloo group left up aborts the interpreter at exit)."""
    if world.size > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def launch(command: list[str], processes: int) -> tuple[int, Optional[str]]:
    """Run `python <command>` in `processes` processes on this machine with accelerate's launcher
    (torchrun underneath), in this process, on a free port. Returns (exit code, a one-line
    message or None): 0; the first failed process's code (1 for a signal); 130 after Ctrl-C."""
    import socket

    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with socket.socket() as probe:  # a free port, so runs side by side do not collide
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its log repeats ours
    args = launch_command_parser().parse_args(
        ["--multi_gpu", "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no",
         "--dynamo_backend", "no", "--main_process_port", str(port), *command])
    try:
        launch_command(args)
    except SignalException:
        return EXIT_INTERRUPTED, None
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 1
        if code in (EXIT_BAD_INPUT, EXIT_INTERRUPTED):  # the process printed its own line
            return code, None
        return code, f"process {rank} of {processes} failed (exit code {failure.exitcode}); the others were stopped"
    return 0, None
