"""Save and restore a run's whole state, atomically: adapters (and the value head), optimizer,
lr schedule, TrainState and every random number generator, in one checkpoint folder.

    step-N/  policy/  value/  optimizer.pt  scheduler.pt  rng.pt  trainer_state.json  manifest.json

(a reward-model run saves reward/ instead of policy/ and value/; a run of N processes adds
rng-process-1.pt ... for the random streams of the processes after the first).

manifest.json is written last: a folder holding it is complete (`run_dir.is_checkpoint`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import pickle
import random
import shutil
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, Protocol

import torch
from safetensors import SafetensorError

from lora_ppo.atomic import STAGING_MARK, atomic_folder
from lora_ppo.config import Recipe, RewardRecipe, resume_differences
from lora_ppo.distributed import World
from lora_ppo.errors import RecipeError, first_line
from lora_ppo.roles import HEAD_FILES, Backbone
from lora_ppo.run_dir import (MANIFEST_FILE, RECIPE_FILE, STATE_FILE, RunDir, find_run_root, is_checkpoint,
                              read_manifest)

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
PROCESS_RNG_FILE = "rng-process-{}.pt"  # the random streams of process 1, 2, ... of a data-parallel run
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
FORMAT_VERSION = 3  # 2: trainer_state.json holds the run's state record; 3: with per-source reward moments


# What reading a checkpoint's files raises when they are cut short or not what they claim:
# safetensors and pickle (torch.load) have error types of their own.
UNREADABLE = (OSError, ValueError, KeyError, RuntimeError, EOFError, pickle.UnpicklingError, SafetensorError)


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written or read; the message says which and why."""


class RunState(Protocol):
    """A run's state besides weights, optimizer and RNGs (TrainState, AdapterTrainState)."""

    step: int

    def to_json(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Trainables:
    """What a checkpoint saves besides the run state: the trained adapters (with their heads),
    the optimizer with its schedule, and the generator that orders minibatches."""

    model: Backbone
    trained: tuple[str, ...]  # adapters saved and restored
    optimizer: torch.optim.Optimizer
    scheduler: Optional[torch.optim.lr_scheduler.LRScheduler]
    generator: torch.Generator
    frozen: tuple[str, ...] = ()  # adapters saved only, so the run folder holds everything it used


def recipe_hash(recipe_yaml: str) -> str:
    return hashlib.sha256(recipe_yaml.encode("utf-8")).hexdigest()


def process_rng_state(generator: torch.Generator) -> dict[str, Any]:
    """This process's random streams (torch, CUDA, the minibatch generator, Python, numpy)."""
    return {"tensors": _torch_rng_states(generator), "python": _python_rng_state(), "numpy": _numpy_rng_state()}


def save(folder: Path, parts: Trainables, state: RunState, recipe_yaml: str,
         keep_last: Optional[int] = None, process_rngs: Optional[list[dict[str, Any]]] = None) -> Path:
    """Write the whole state to `folder` (staged beside it, fsynced, renamed), and with
    `keep_last` delete all but the newest `keep_last` complete checkpoints beside it.
    `process_rngs`: every process's `process_rng_state`, in rank order (default: this one's).

    Raises DiskFullError when the free space cannot hold it (checked first, and when a write
    fails on a full device), CheckpointError for other OSErrors (permissions); either way nothing
    of this checkpoint is left behind and earlier checkpoints are intact.
    """
    folder = Path(folder)
    process_rngs = process_rngs or [process_rng_state(parts.generator)]
    needed = expected_bytes(folder, parts)
    _check_free_space(folder, needed)  # refused before a byte is written, where it cannot fit
    try:
        with atomic_folder(folder) as staging, _out_of_space_named(folder, staging, needed):
            for name in parts.trained + parts.frozen:
                parts.model.save_adapter(name, staging / name)
            torch.save(parts.optimizer.state_dict(), staging / OPTIMIZER_FILE)
            if parts.scheduler is not None:
                torch.save(parts.scheduler.state_dict(), staging / SCHEDULER_FILE)
            first = process_rngs[0]
            torch.save(first["tensors"], staging / RNG_FILE)
            for rank, rng in enumerate(process_rngs[1:], start=1):
                torch.save(rng, staging / PROCESS_RNG_FILE.format(rank))
            record = {**state.to_json(), "rng": {"python": first["python"], "numpy": first["numpy"]}}
            (staging / STATE_FILE).write_text(json.dumps(record), encoding="utf-8")
            manifest = {
                "format": FORMAT_VERSION,
                "step": state.step,
                "processes": len(process_rngs),
                "recipe_sha256": recipe_hash(recipe_yaml),
                "versions": _versions(),
                "files": sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file()),
            }
            (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    except OSError as err:  # a write refused (permissions), or the fsync or rename of a full device
        if err.errno in OUT_OF_SPACE:
            raise _no_space(folder, needed, _free_bytes(folder)) from None
        raise CheckpointError(
            f"could not save checkpoint {folder}: {err.strerror or err}; earlier checkpoints are intact"
        ) from None
    if keep_last is not None:
        prune(folder.parent, keep_last)
    return folder


# A write that fails with less than this left free failed for want of space, whatever the writer
# raised: torch.save says "unexpected pos" or "iostream error", safetensors its own error type.
FULL_DISK_SLACK = 1 << 20  # bytes
OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(CheckpointError):
    """A checkpoint that does not fit in the free space left; nothing of it is left behind."""


def saved_bytes(parts: Trainables) -> int:
    """What a checkpoint of `parts` holds at least: the trained and frozen adapters with their
    heads, and the optimizer's state (file headers, RNG and run state come on top)."""
    trained = [p for group in parts.optimizer.param_groups for p in group["params"]]
    frozen = [p for name in parts.frozen for p in parts.model.adapter_params(name)]
    moments = [t for state in parts.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in trained + frozen + moments)


def expected_bytes(folder: Path, parts: Trainables) -> int:
    """What the checkpoint `folder` will take: as much as a complete one beside it (the same run
    saves the same tensors), and at least `saved_bytes`."""
    beside = [f for f in (folder.parent.iterdir() if folder.parent.is_dir() else []) if is_checkpoint(f)]
    sizes = [sum(p.stat().st_size for p in f.rglob("*") if p.is_file()) for f in beside]
    return max([saved_bytes(parts), *sizes])


def _free_bytes(folder: Path) -> int:
    existing = next(p for p in (folder, *folder.absolute().parents) if p.exists())
    return shutil.disk_usage(existing).free


def _no_space(folder: Path, needed: int, free: int) -> DiskFullError:
    return DiskFullError(
        f"could not save checkpoint {folder}: no space left on the device; it needs about {_megabytes(needed)} "
        f"free in {folder.parent} and {_megabytes(free)} are free; earlier checkpoints are intact (free some "
        "space, then resume with --resume auto)")


def _megabytes(n: int) -> str:
    return f"{n / 1e3:.0f} kB" if n < 1e6 else f"{n / 1e6:.1f} MB"


def _check_free_space(folder: Path, needed: int) -> None:
    free = _free_bytes(folder)
    if free < needed:
        raise _no_space(folder, needed, free)


@contextmanager
def _out_of_space_named(folder: Path, staging: Path, needed: int) -> Iterator[None]:
    """A write into `staging` that failed because the device filled up, as a DiskFullError (the
    staging folder is then removed by atomic_folder, which this runs inside)."""
    try:
        yield
    except Exception as err:
        if not (getattr(err, "errno", None) in OUT_OF_SPACE or shutil.disk_usage(staging).free < FULL_DISK_SLACK):
            raise
        # measured once the staged files are gone: what the user has to work with
        shutil.rmtree(staging, ignore_errors=True)
        raise _no_space(folder, needed, _free_bytes(folder)) from None


def load(folder: Path, parts: Trainables, state_type: type, world: World = World()) -> Any:
    """Put the adapters, optimizer, schedule and RNG streams saved in `folder` back into freshly
    built parts, and return the saved run state (a `state_type`). Each process of a data-parallel
    run takes its own random streams; a checkpoint resumes only with the number of processes that
    wrote it (RecipeError otherwise)."""
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
        if manifest.get("format") != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {folder}: format {manifest.get('format')} is not {FORMAT_VERSION} "
                "(written by another version of lora_ppo)"
            )
        check_processes(folder, manifest, world.size)
        record = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
        state = state_type.from_json({k: v for k, v in record.items() if k != "rng"})
        load_adapters(folder, parts.model, parts.trained)
        parts.optimizer.load_state_dict(_saved_tensors(folder / OPTIMIZER_FILE))
        if parts.scheduler is not None and (folder / SCHEDULER_FILE).exists():
            parts.scheduler.load_state_dict(_saved_tensors(folder / SCHEDULER_FILE))
        rng_tensors, rng = _saved_tensors(folder / RNG_FILE), record["rng"]
        if world.rank > 0:
            own = folder / PROCESS_RNG_FILE.format(world.rank)
            saved = _saved_tensors(own)
            rng_tensors, rng = saved["tensors"], saved
    except (CheckpointError, RecipeError):
        raise
    except UNREADABLE as err:
        raise CheckpointError(f"checkpoint {folder} cannot be loaded: {first_line(err)}") from None
    _restore_rng(rng, rng_tensors, parts.generator)
    return state


def _saved_tensors(path: Path) -> Any:
    """What `torch.save` wrote to `path`, read weights-only. A file that is no pickle of tensors makes
    torch advise loading it with weights_only=False (running any code it holds): said plainly instead."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"checkpoint {path.parent} cannot be loaded: {path.name} is not a file torch.save "
                              "wrote (cut short or replaced)") from None


def load_newest(run: RunDir, folder: Path, auto: bool, parts: Trainables, state_type: type,
                world: World = World()) -> tuple[Path, Any]:
    """`load` the checkpoint `--resume` chose; with `--resume auto`, one that cannot be loaded (a
    file cut short by a full disk, a garbage optimizer.pt) gives way to the next older complete
    checkpoint, with a warning. Returns (the folder loaded, its state)."""
    candidates = [folder]
    if auto:
        older = [f for f in run.resumable() if f != folder and _step(f) <= _step(folder)]
        candidates += sorted(older, key=_step, reverse=True)
    for i, candidate in enumerate(candidates):
        try:
            return candidate, load(candidate, parts, state_type, world)
        except CheckpointError as err:
            if i == len(candidates) - 1:
                raise RecipeError(f"--resume: {err}") from None  # bad input, not a failure of the run
            log.warning("%s; --resume auto goes back to %s", err, candidates[i + 1])
    raise AssertionError("not reached: the last candidate returns or raises")


def _step(folder: Path) -> int:
    return int(read_manifest(folder).get("step", -1))


def check_processes(folder: Path, manifest: dict, processes: int) -> None:
    """A checkpoint resumes exactly only with the number of processes that wrote it."""
    written_by = int(manifest.get("processes", 1))
    if written_by != processes:
        raise RecipeError(
            f"--resume: checkpoint {folder} was written by {written_by} process(es) and resumes exactly only "
            f"with as many (--num-processes {written_by}); this run has {processes}"
        )


def load_adapters(folder: Path, model: Backbone, names: tuple[str, ...]) -> None:
    """Put the adapters `names` (and their heads) saved in a checkpoint into `model`'s own ones.

    Raises CheckpointError when an adapter does not fit the model, or the files cannot be read.
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    try:
        for name in names:
            weights = load_file(str(Path(folder) / name / ADAPTER_WEIGHTS_FILE))
            try:
                result = set_peft_model_state_dict(model.peft, weights, adapter_name=name)
            except RuntimeError as err:  # torch's first line names neither the adapter nor the shapes
                mismatch = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line),
                                first_line(err))
                raise CheckpointError(f"checkpoint {folder}: {name} adapter does not fit this model "
                                      f"({mismatch})") from None
            if getattr(result, "unexpected_keys", None):
                raise CheckpointError(f"checkpoint {folder}: {name} adapter does not fit this model")
            if name in model.heads:
                model.load_head(name, Path(folder) / name / HEAD_FILES[name])
    except CheckpointError:
        raise
    except UNREADABLE as err:
        raise CheckpointError(f"checkpoint {folder} cannot be loaded: {first_line(err)}") from None


log = logging.getLogger(__name__)


def open_run(recipe: Recipe | RewardRecipe, resume: Optional[str | Path], check_taken: bool = True,
             processes: int = 1) -> tuple[RunDir, Optional[Path]]:
    """The run folder of a new or resumed run, and the checkpoint to resume from: a new run
    refuses a folder another run wrote to (unless train.overwrite; `check_taken` False: the
    process that does not write leaves it to the one that does), a resumed one checks its recipe
    and the number of `processes` that wrote the checkpoint, before the model loads."""
    run = RunDir(recipe.train.output_dir)
    if check_taken:
        run.check_writable()
    if resume is not None:
        folder = resolve_resume(run, resume, recipe)
        try:
            manifest = read_manifest(folder)
        except (OSError, ValueError):
            manifest = None  # unreadable: `load` says so (and `--resume auto` goes back past it)
        if manifest is not None:
            check_processes(folder, manifest, processes)
        if check_taken and not run.same_folder(run_of(folder, run)):
            run.refuse_if_taken(recipe.train.overwrite)  # continued in a new folder: as a new run's
        return run, folder
    if check_taken:
        run.refuse_if_taken(recipe.train.overwrite)
    return run, None


def start_run_folder(run: RunDir, recipe_yaml: str, resume_from: Optional[Path],
                     lines: tuple[int, int]) -> None:
    """Write the run folder's start: a new run's, or a resumed one's with the checkpoint's `lines`
    (metrics, samples) of its logs, copied from the checkpoint's run when it continues in another
    train.output_dir. With train.overwrite the old run is moved out of the way, and the log says where.

    Once per trainer: a second `train()` (run again after Ctrl-C in a notebook, or on a finished
    run) would take its own run for an old one, move it aside and log the rest in a new folder."""
    if run.started:
        raise RuntimeError(f"train(): this trainer's run in {run.root} has started already; to go on, make a new "
                           "trainer with resume='auto' (it continues from the newest checkpoint, final/ included)")
    resumed_run = None if resume_from is None else run_of(resume_from, run)
    moved = run.open(recipe_yaml, None if resume_from is None else lines, resumed_run)
    run.started = True
    if moved is not None:
        log.warning("%s held a run: moved it to %s", run.root, moved)


def resolve_resume(run: RunDir, resume: str | Path, recipe: Recipe | RewardRecipe) -> Path:
    """The checkpoint `--resume` names ("auto": the newest complete one of the run, final/
    included, so a finished run continues with more steps), after checking that the recipe
    changes nothing a step computes (model, adapters, sizes...)."""
    if str(resume) == "auto":
        found = run.resumable()
        if not found:
            raise RecipeError(f"--resume auto: no complete checkpoint under {run.root}")
        folder = max(found, key=lambda f: (int(read_manifest(f).get("step", -1)), f == run.final))
    else:
        folder = Path(resume)
        if not is_checkpoint(folder):
            raise RecipeError(f"--resume: {folder} is not a complete checkpoint (no {MANIFEST_FILE})")
    source = run_of(folder, run)
    if not source.recipe.is_file():
        raise RecipeError(f"--resume: {folder} has no {RECIPE_FILE} beside it (in it, its parent or grandparent), "
                          f"nor has {run.root}: copy the checkpoint with its run folder, which records the recipe "
                          "it trained with")
    import yaml

    saved = yaml.safe_load(source.recipe.read_text(encoding="utf-8"))
    differences = resume_differences(saved, recipe)
    if differences:
        raise RecipeError(
            f"--resume: the recipe differs from the run's {source.recipe} in fields a resumed run cannot "
            f"change: {', '.join(differences)}"
        )
    ppo = isinstance(recipe, Recipe)
    schedule = recipe.ppo.lr_schedule if ppo else recipe.train.lr_schedule
    length = "steps" if ppo else "epochs"
    before, now = (saved.get("train") or {}).get(length), getattr(recipe.train, length)
    if schedule == "linear" and before != now:
        log.warning("train.%s changed from %s to %d: the linear learning-rate decay is re-planned to the new end, "
                    "so this is not the run the new recipe makes from the start (with a constant schedule it is)",
                    length, before, now)
    return folder


def run_of(checkpoint: Path, default: RunDir) -> RunDir:
    """The run folder a checkpoint belongs to (the one holding its recipe.yaml), else `default`."""
    root = find_run_root(checkpoint)
    return RunDir(root) if root is not None else default


def prune(checkpoints_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints, and staging folders left by
    a killed save."""
    checkpoints_dir = Path(checkpoints_dir)
    for stale in checkpoints_dir.glob(f".step-*{STAGING_MARK}*"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in RunDir(checkpoints_dir.parent).complete_checkpoints()[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def _versions() -> dict[str, str]:
    import peft
    import transformers

    from lora_ppo import __version__

    return {
        "lora_ppo": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "peft": peft.__version__, "python": sys.version.split()[0],
    }


def _torch_rng_states(generator: torch.Generator) -> dict[str, torch.Tensor]:
    from lora_ppo.devices import device_rng_states

    return {"torch": torch.get_rng_state(), "generator": generator.get_state(), **device_rng_states()}


def _python_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _numpy_rng_state() -> dict:
    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}


def _restore_rng(state: dict, tensors: dict, generator: torch.Generator) -> None:
    import numpy as np

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(tensors["torch"])
    generator.set_state(tensors["generator"])
    from lora_ppo.devices import restore_device_rng_states

    restore_device_rng_states(tensors)
