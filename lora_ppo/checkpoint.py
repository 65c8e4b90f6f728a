"""Save and resume the whole training state, atomically: adapters, optimizer, scheduler,
controllers, RNG streams, data cursor and log positions, in output_dir/checkpoints/step-N/.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from lora_ppo.errors import RecipeError
from lora_ppo.roles import POLICY, VALUE

if TYPE_CHECKING:
    from lora_ppo.trainer import PPOTrainer

CHECKPOINTS_DIR = "checkpoints"
# Written last: a step-N folder with a manifest is complete, anything else is ignored.
MANIFEST_FILE = "manifest.json"
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that could not be written or read; the message says which and why."""


def recipe_hash(recipe_yaml: str) -> str:
    return hashlib.sha256(recipe_yaml.encode("utf-8")).hexdigest()


def _versions() -> dict[str, str]:
    import peft
    import transformers

    from lora_ppo import __version__

    return {
        "lora_ppo": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "peft": peft.__version__, "python": sys.version.split()[0],
    }


def _fsync_tree(folder: Path) -> None:
    """Flush every file and folder under `folder` (itself included) to disk."""
    for path in sorted(folder.rglob("*"), reverse=True):
        _fsync(path)
    _fsync(folder)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _python_rng_state() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _numpy_rng_state() -> dict:
    import numpy as np

    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}


def _restore_rng(state: dict, tensors: dict, trainer: "PPOTrainer") -> None:
    import numpy as np

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(tensors["torch"])
    trainer.generator.set_state(tensors["generator"])
    if torch.cuda.is_available() and "cuda" in tensors:
        torch.cuda.set_rng_state_all(list(tensors["cuda"]))


def _count_lines(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _write_adapters(trainer: "PPOTrainer", staging: Path) -> None:
    trainer.roles.save_adapter(POLICY, staging / POLICY)
    if trainer.roles.has_value:
        trainer.roles.save_adapter(VALUE, staging / VALUE)


def _publish(staging: Path, folder: Path) -> None:
    """Replace `folder` with the fully written, fsynced `staging` folder."""
    _fsync(staging)
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(staging, folder)
    _fsync(folder.parent)


def _save_error(folder: Path, staging: Path, err: OSError, what: str) -> "CheckpointError":
    shutil.rmtree(staging, ignore_errors=True)
    return CheckpointError(f"could not save {what} {folder}: {err.strerror or err}; earlier checkpoints are intact")


def save_final_adapters(trainer: "PPOTrainer", folder: Path) -> Path:
    """Write policy/ (and value/ with a critic) plus trainer_state.json to `folder`, staged in a
    hidden `.NAME.tmp` sibling, fsynced and renamed, like a checkpoint (without training state).

    Raises CheckpointError (disk full, permissions).
    """
    folder = Path(folder)
    staging = folder.with_name(f".{folder.name}.tmp")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        _write_adapters(trainer, staging)
        (staging / STATE_FILE).write_text(json.dumps({"step": trainer.step}), encoding="utf-8")
        _fsync_tree(staging)
        _publish(staging, folder)
    except OSError as err:
        raise _save_error(folder, staging, err, "adapters") from None
    return folder


def save_checkpoint(trainer: "PPOTrainer", folder: Path, keep_last: Optional[int] = None) -> Path:
    """Write the trainer's whole state to `folder` (staged in a hidden `.NAME.tmp` sibling, fsynced,
    then renamed), and delete all but the newest `keep_last` complete checkpoints beside it.

    Raises CheckpointError (disk full, permissions); the previous checkpoints are left intact.
    """
    from lora_ppo.trainer import METRICS_FILE, SAMPLES_FILE

    folder = Path(folder)
    staging = folder.with_name(f".{folder.name}.tmp")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        _write_adapters(trainer, staging)
        torch.save(trainer.optimizer.state_dict(), staging / OPTIMIZER_FILE)
        if trainer.scheduler is not None:
            torch.save(trainer.scheduler.state_dict(), staging / SCHEDULER_FILE)
        rng = {"torch": torch.get_rng_state(), "generator": trainer.generator.get_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
        torch.save(rng, staging / RNG_FILE)
        state = {
            "step": trainer.step,
            "kl_coef": trainer.kl_coef,
            "score_moments": list(trainer.score_moments),
            "stream": trainer.stream.state_dict(),
            "consecutive_skips": trainer.consecutive_skips,
            "eval_before": trainer.eval_before,
            "last_metrics": trainer.last_metrics,
            "metrics_lines": _count_lines(trainer.output_dir / METRICS_FILE),
            "samples_lines": _count_lines(trainer.output_dir / SAMPLES_FILE),
            "rng": {"python": _python_rng_state(), "numpy": _numpy_rng_state()},
        }
        (staging / STATE_FILE).write_text(json.dumps(state), encoding="utf-8")
        _fsync_tree(staging)
        manifest = {
            "format": FORMAT_VERSION,
            "step": trainer.step,
            "recipe_sha256": recipe_hash(trainer.recipe_yaml),
            "versions": _versions(),
            "files": sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file()),
        }
        with open(staging / MANIFEST_FILE, "w", encoding="utf-8") as f:
            f.write(json.dumps(manifest, indent=2))
            f.flush()
            os.fsync(f.fileno())
        _publish(staging, folder)
    except OSError as err:
        raise _save_error(folder, staging, err, "checkpoint") from None
    if keep_last is not None:
        prune_checkpoints(folder.parent, keep_last)
    return folder


def complete_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """Complete step-N folders (those with a manifest), oldest first."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for child in checkpoints_dir.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / MANIFEST_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def prune_checkpoints(checkpoints_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints, and leftover staging folders."""
    for stale in Path(checkpoints_dir).glob(".step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    for old in complete_checkpoints(checkpoints_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def resolve_resume(output_dir: Path, resume: str | Path) -> Path:
    """The checkpoint folder `--resume` names: "auto" (the newest complete one) or a path."""
    if str(resume) == "auto":
        found = complete_checkpoints(Path(output_dir) / CHECKPOINTS_DIR)
        if not found:
            raise RecipeError(f"--resume auto: no complete checkpoint under {Path(output_dir) / CHECKPOINTS_DIR}")
        return found[-1]
    folder = Path(resume)
    if not (folder / MANIFEST_FILE).is_file():
        raise RecipeError(f"--resume: {folder} is not a complete checkpoint (no {MANIFEST_FILE})")
    return folder


def load_checkpoint(trainer: "PPOTrainer", folder: Path) -> None:
    """Put the state saved in `folder` back into a freshly built trainer."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    folder = Path(folder)
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text(encoding="utf-8"))
        if manifest.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {folder}: format {manifest.get('format')} is not {FORMAT_VERSION}")
        state = json.loads((folder / STATE_FILE).read_text(encoding="utf-8"))
        roles = trainer.roles
        adapters = [POLICY, VALUE] if roles.has_value else [POLICY]
        for name in adapters:
            weights = load_file(str(folder / name / "adapter_model.safetensors"))
            result = set_peft_model_state_dict(roles.peft, weights, adapter_name=name)
            if getattr(result, "unexpected_keys", None):
                raise CheckpointError(f"checkpoint {folder}: {name} adapter does not fit this model")
        if roles.has_value:
            from lora_ppo.roles import VALUE_HEAD_FILE

            roles.load_value_head(folder / VALUE / VALUE_HEAD_FILE)
        trainer.optimizer.load_state_dict(torch.load(folder / OPTIMIZER_FILE, weights_only=True))
        if trainer.scheduler is not None and (folder / SCHEDULER_FILE).exists():
            trainer.scheduler.load_state_dict(torch.load(folder / SCHEDULER_FILE, weights_only=True))
        rng_tensors = torch.load(folder / RNG_FILE, weights_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint {folder} cannot be loaded: {err}") from None
    trainer.step = int(state["step"])
    trainer.kl_coef = float(state["kl_coef"])
    trainer.score_moments = tuple(state["score_moments"])
    trainer.stream.load_state_dict(state["stream"])
    trainer.consecutive_skips = int(state["consecutive_skips"])
    trainer.eval_before = state["eval_before"]
    trainer.last_metrics = state["last_metrics"]
    trainer.resume_lines = (int(state["metrics_lines"]), int(state["samples_lines"]))
    _restore_rng(state["rng"], rng_tensors, trainer)
