"""The run folder: what a run writes where, defined once.

    output_dir/
      recipe.yaml           the resolved recipe (every default filled in)
      metrics.jsonl         one line per step
      samples.jsonl         a few completions every train.sample_every steps
      summary.json          held-out scores before/after, final KL, time, memory
      eval_before.jsonl     the held-out completions and their scores before training
      eval_after.jsonl      ... and after
      report/               `lora-ppo report`: plots and an HTML page
      checkpoints/step-N/   full-state checkpoints (complete when they hold manifest.json)
      final/                the full-state checkpoint at the end of training
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Optional

from lora_ppo.atomic import write_file_atomically
from lora_ppo.errors import RecipeError, first_line, some_of

RECIPE_FILE = "recipe.yaml"
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
SUMMARY_FILE = "summary.json"
EVAL_BEFORE_FILE = "eval_before.jsonl"  # the held-out completions and their scores, before training
EVAL_AFTER_FILE = "eval_after.jsonl"  # ... and after
REPORT_DIR = "report"
CHECKPOINTS_DIR = "checkpoints"
FINAL_DIR = "final"
# What a run writes in its folder (tracking.py's tracker folders too): anything else, hidden names
# aside, is someone else's, and a folder holding it is not given to a run.
RUN_ENTRIES = frozenset({RECIPE_FILE, METRICS_FILE, SAMPLES_FILE, SUMMARY_FILE, EVAL_BEFORE_FILE, EVAL_AFTER_FILE,
                         REPORT_DIR, CHECKPOINTS_DIR, FINAL_DIR, "tensorboard", "wandb"})
# Written last into a checkpoint: a folder with a manifest is complete, anything else is not.
MANIFEST_FILE = "manifest.json"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def is_checkpoint(folder: Path) -> bool:
    """Whether `folder` is a complete checkpoint (what resume and export accept)."""
    return (Path(folder) / MANIFEST_FILE).is_file()


def read_manifest(folder: Path) -> dict[str, Any]:
    """A checkpoint's manifest; raises OSError or ValueError when it cannot be read."""
    manifest = json.loads((Path(folder) / MANIFEST_FILE).read_text(encoding="utf-8"))
    if not isinstance(manifest, dict):
        raise ValueError(f"{MANIFEST_FILE} is not a JSON object")
    return manifest


def find_run_root(checkpoint: Path) -> Optional[Path]:
    """The run folder a checkpoint belongs to: the nearest of itself, its parent and its
    grandparent that holds a recipe.yaml (final/ and checkpoints/step-N/ both find it)."""
    checkpoint = Path(checkpoint)
    for folder in (checkpoint, checkpoint.parent, checkpoint.parent.parent):
        if (folder / RECIPE_FILE).is_file():
            return folder
    return None


class RunDir:
    """Paths and file operations of one run folder."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.recipe, self.summary = self.root / RECIPE_FILE, self.root / SUMMARY_FILE
        self.metrics, self.samples = self.root / METRICS_FILE, self.root / SAMPLES_FILE
        self.checkpoints, self.final = self.root / CHECKPOINTS_DIR, self.root / FINAL_DIR
        self.eval_before, self.eval_after = self.root / EVAL_BEFORE_FILE, self.root / EVAL_AFTER_FILE
        self.started = False  # a trainer started its run here (checkpoint.start_run_folder)

    def step_checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step}"

    def check_writable(self) -> None:
        """Refuse, before anything loads, a folder the run could not write: a file of that name, or
        a folder (or, where it does not exist yet, its nearest existing parent) that refuses a new
        file (no permission, a read-only file system, a full disk)."""
        if self.root.exists() and not self.root.is_dir():
            raise RecipeError(f"train.output_dir: {str(self.root)!r} is a file, not a folder")
        existing = next(p for p in (self.root, *self.root.absolute().parents) if p.exists())
        if not existing.is_dir():
            raise RecipeError(f"train.output_dir: {str(existing)!r} is a file, so {str(self.root)!r} cannot be made")
        probe = existing / f".lora_ppo-write-test-{os.getpid()}"
        try:
            probe.write_bytes(b"lora_ppo")
        except OSError as err:
            # On a read-only file system even removing a file that is not there fails (EROFS).
            with contextlib.suppress(OSError):
                probe.unlink(missing_ok=True)
            raise RecipeError(f"train.output_dir: cannot write in {str(existing)!r}: "
                              f"{err.strerror or first_line(err)}") from None
        probe.unlink(missing_ok=True)

    def holds_run(self) -> bool:
        """Whether a run already wrote here (its recipe or metrics)."""
        return self.recipe.exists() or self.metrics.exists()

    def resumable(self) -> list[Path]:
        """Every complete checkpoint a run here can resume from: checkpoints/step-N oldest first,
        then final/."""
        return self.complete_checkpoints() + ([self.final] if is_checkpoint(self.final) else [])

    def has_checkpoint(self) -> bool:
        """Whether a run here saved a complete checkpoint (a step's, or final/): something to
        resume from or keep, where a run stopped before its first one left nothing to lose."""
        return bool(self.resumable())

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints/step-N folders, oldest first."""
        if not self.checkpoints.is_dir():
            return []
        found = []
        for child in self.checkpoints.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and is_checkpoint(child):
                found.append((int(match.group(1)), child))
        return [path for _, path in sorted(found)]

    def move_aside(self) -> Path:
        """Rename this run folder to a free `NAME.old-YYYYmmdd-HHMMSS[-N]` sibling; returns it."""
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target = self.root.with_name(f"{self.root.name}.old-{stamp}")
        n = 1
        while target.exists():
            n += 1
            target = self.root.with_name(f"{self.root.name}.old-{stamp}-{n}")
        os.replace(self.root, target)
        return target

    def holds_run_records(self) -> bool:
        """Whether a run wrote more here than its recipe (a project's own recipe.yaml looks like one):
        files beside those are the user's additions to the run, and move aside with it."""
        return any(p.exists() for p in (self.metrics, self.summary, self.eval_before, self.checkpoints, self.final))

    def foreign_entries(self) -> list[str]:
        """The names in this folder that no run writes (hidden ones aside)."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.name not in RUN_ENTRIES and not p.name.startswith("."))

    def refuse_if_taken(self, overwrite: bool) -> None:
        """A folder that holds a run with a checkpoint is refused unless the recipe says to start
        over; one stopped before its first checkpoint is moved aside by `open` instead. A folder
        holding other files and no run's records (a project with its own recipe.yaml, data and reward
        code) is never taken: the next run would move the project aside."""
        foreign = self.foreign_entries()
        if foreign and not self.holds_run_records():
            raise RecipeError(f"train.output_dir: {str(self.root)!r} holds files no run writes ({some_of(foreign)}); give the "
                              "run a folder of its own (a new run moves an old one's folder aside)")
        cwd = Path.cwd().resolve()
        if self.holds_run() and (cwd == self.root.resolve() or self.root.resolve() in cwd.parents):
            # Moved aside, the folder would take the shell's current folder with it, and `.` with it.
            raise RecipeError(f"train.output_dir: {str(self.root)!r} holds a run and the current folder, which a new "
                              "run cannot move aside; give the run a folder of its own")
        if self.has_checkpoint() and not overwrite:
            raise RecipeError(
                f"train.output_dir: {str(self.root)!r} already holds a run; choose another folder "
                "or set train.overwrite=true (the old run is then moved aside, not deleted)"
            )

    def open(self, recipe_yaml: str, resume_lines: Optional[tuple[int, int]] = None,
             resumed_run: Optional["RunDir"] = None) -> Optional[Path]:
        """Get the folder ready for a run: a resumed run keeps its lines up to `resume_lines`
        (metrics, samples); one resumed from another folder's checkpoint (`resumed_run`) starts
        here with a copy of those lines and its held-out records; a fresh run starts in an empty
        folder, any run already here moved aside. Returns where an old run was moved, if one was."""
        if resume_lines is not None and (resumed_run is None or self.same_folder(resumed_run)):
            self.resume(recipe_yaml, *resume_lines)
            return None
        moved = self.move_aside() if self.holds_run() else None
        self.start(recipe_yaml)
        if resume_lines is not None and resumed_run is not None:
            for name, keep in ((METRICS_FILE, resume_lines[0]), (SAMPLES_FILE, resume_lines[1]), (EVAL_BEFORE_FILE, None)):
                copy_lines(resumed_run.root / name, self.root / name, keep)
        return moved

    def same_folder(self, other: "RunDir") -> bool:
        return self.root.resolve() == other.root.resolve()

    def start(self, recipe_yaml: str) -> None:
        """Create the folder for a fresh run and write its resolved recipe."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.recipe.write_text(recipe_yaml, encoding="utf-8")

    def resume(self, recipe_yaml: str, metrics_lines: int, samples_lines: int) -> None:
        """Prepare the folder for a resumed run: lines written after the checkpoint are dropped
        (the resumed run writes them again), the old summary goes, the recipe is rewritten
        (a resume may change fields such as train.steps)."""
        self.root.mkdir(parents=True, exist_ok=True)  # a checkpoint continued in a new folder
        truncate_lines(self.metrics, metrics_lines)
        truncate_lines(self.samples, samples_lines)
        self.summary.unlink(missing_ok=True)
        self.recipe.write_text(recipe_yaml, encoding="utf-8")

    def write_summary(self, summary: dict) -> None:
        write_file_atomically(self.summary, json.dumps(summary, indent=2))


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def write_jsonl(path: Path, records: list[dict]) -> None:
    """Replace a JSONL file with `records`, one per line, all at once."""
    write_file_atomically(path, "".join(json.dumps(record) + "\n" for record in records))


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSONL file (an empty list when it does not exist). A last line cut short
    (no line break, not JSON: a run writing it now, or one killed while it did) is left out; a bad
    line before it is refused, naming the file and the line."""
    if not Path(path).exists():
        return []
    *complete, last = Path(path).read_text(encoding="utf-8").split("\n")
    records = []
    for number, line in enumerate(complete, start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise RecipeError(f"{path} line {number}: not JSON ({err.msg} at column {err.colno})") from None
    try:
        records.extend([json.loads(last)] if last.strip() else [])
    except json.JSONDecodeError:
        pass  # cut short
    return records


def copy_lines(source: Path, target: Path, keep: Optional[int]) -> None:
    """The first `keep` lines (None: all) of a text file into `target` (it may be `source`: read whole
    first); a missing file stays missing."""
    if Path(source).exists():
        with open(source, "rb") as f:
            lines = f.readlines()
        with open(target, "wb") as f:
            f.writelines(lines if keep is None else lines[:keep])


def truncate_lines(path: Path, keep: int) -> None:
    """Keep the first `keep` lines of a text file (a missing file stays missing)."""
    copy_lines(path, path, keep)


# ---- a checkpoint named on the command line (export, eval, generate) --------------------------


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint folder (holding policy/ and, with a critic, value/) and its run."""

    folder: Path
    run: RunDir
    step: Optional[int]

    @property
    def label(self) -> str:
        """The checkpoint relative to its run folder (`final`, `checkpoints/step-10`)."""
        try:
            return self.folder.relative_to(self.run.root).as_posix() or "."
        except ValueError:
            return self.folder.name

    def summary(self) -> Optional[dict]:
        """The run's summary.json, or None when the run has not written one (yet)."""
        if not self.run.summary.is_file():
            return None
        try:
            summary = json.loads(self.run.summary.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise RecipeError(f"corrupt checkpoint: {self.run.summary} cannot be read ({first_line(err)})") from None
        if not isinstance(summary, dict):
            raise RecipeError(f"corrupt run: {self.run.summary} is not a JSON object")
        return summary

    def adapter_dir(self, name: str) -> Path:
        return self.folder / name


def find_checkpoint(source: str | Path) -> Checkpoint:
    """The complete checkpoint `source` names, and the run it belongs to: `source` itself when it
    is a checkpoint (it holds manifest.json, which the checkpoint writer adds last), else the
    final/ checkpoint of the run folder `source`.

    Raises RecipeError when there is no complete checkpoint, no recipe.yaml beside it, or an
    unreadable manifest.
    """
    source = Path(source).expanduser()
    if not source.exists():
        raise RecipeError(f"checkpoint not found: {source}")
    if not source.is_dir():
        raise RecipeError(f"checkpoint {source} is not a folder")
    folder = next((f for f in (source, source / FINAL_DIR) if is_checkpoint(f)), None)
    if folder is None:
        raise RecipeError(_no_checkpoint(source))
    folder = folder.resolve()
    root = find_run_root(folder)
    if root is None:
        raise RecipeError(
            f"checkpoint {folder}: no {RECIPE_FILE} in it, its parent or grandparent "
            "(the recipe records which base model the adapters belong to)"
        )
    try:
        step = read_manifest(folder).get("step")
    except (OSError, ValueError) as err:
        path = folder / MANIFEST_FILE
        raise RecipeError(f"corrupt checkpoint: {path} cannot be read ({first_line(err)})") from None
    return Checkpoint(folder=folder, run=RunDir(root), step=step if isinstance(step, int) else None)


def _no_checkpoint(source: Path) -> str:
    """Why `source` is not a checkpoint; for a run folder, the complete checkpoints it does have."""
    run = RunDir(source)
    if not run.recipe.is_file():
        return (f"no complete checkpoint in {source}: neither it nor its {FINAL_DIR}/ folder holds "
                f"{MANIFEST_FILE} (the checkpoint writer adds it last)")
    others = [p.relative_to(source).as_posix() for p in run.complete_checkpoints()]
    hint = f"pass one of: {', '.join(others)}" if others else f"nor has it a complete {CHECKPOINTS_DIR}/step-N"
    return (f"no complete checkpoint in run {source}: its {FINAL_DIR}/ is missing or has no {MANIFEST_FILE}; "
            f"{hint}")
