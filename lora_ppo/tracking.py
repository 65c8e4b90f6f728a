"""Send a run's metrics to the trackers a recipe names (`train.report_to`: TensorBoard, Weights &
Biases, Trackio) through accelerate's tracker classes: the resolved recipe as the run's config,
every step's metrics, and samples as a table where the tracker has tables. metrics.jsonl is
written whatever the trackers.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Optional, Sequence

from lora_ppo.errors import RecipeError, first_line

# The package each tracker needs, and the extra that installs it: pip install 'lora_ppo[<extra>]'.
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}
TENSORBOARD_DIR = "tensorboard"


def check_installed(names: Sequence[str]) -> None:
    """Refuse, before anything loads, a tracker whose package is not installed."""
    for name in names:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise RecipeError(f"train.report_to: {name} is not installed; pip install 'lora_ppo[{name}]'")


def flat_config(data: Any, prefix: str = "") -> dict[str, Any]:
    """A nested recipe as `section.field: value` with scalar values (what trackers' configs take)."""
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(flat_config(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: data if isinstance(data, (bool, int, float, str)) or data is None else str(data)}


def start_trackers(names: Sequence[str], run_dir: Path, config: dict[str, Any]) -> Optional["Trackers"]:
    """The trackers `names` of the run in `run_dir`, started with `config` (None when there are none).
    Called before the held-out evaluation: one that cannot start (not logged in) stops the run
    before minutes of evaluating."""
    if not names:
        return None
    trackers = Trackers(names, run_dir, Path(run_dir).name)
    trackers.start(config)
    return trackers


class Trackers:
    """The trackers of one run. Call `start` once, `log` per step, `log_samples` when samples are
    written, and `finish` at the end (also after an error, so the files are complete)."""

    def __init__(self, names: Sequence[str], run_dir: Path, run_name: str):
        check_installed(names)
        self.trackers = [self._make(name, Path(run_dir), run_name) for name in names]

    @staticmethod
    def _make(name: str, run_dir: Path, run_name: str):
        from accelerate.tracking import TensorBoardTracker, TrackioTracker, WandBTracker

        if name == "tensorboard":
            return TensorBoardTracker(run_name, logging_dir=run_dir / TENSORBOARD_DIR)
        if name == "wandb":
            # WANDB_MODE=offline (or wandb login) decides where it goes; its files stay in the run folder.
            return WandBTracker(run_name, dir=str(run_dir), name=run_name)
        return TrackioTracker(run_name, name=run_name)

    def start(self, config: dict[str, Any]) -> None:
        values = flat_config(config)
        for tracker in self.trackers:
            try:
                tracker.start()
                tracker.store_init_configuration(values)
            except Exception as err:  # a tracker that cannot start (login, network) is a setup problem
                raise RecipeError(f"train.report_to: {tracker.name} did not start: {first_line(err)}") from None

    def log(self, metrics: dict[str, float], step: int) -> None:
        values = {k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))}
        for tracker in self.trackers:
            tracker.log(values, step=step)

    def log_samples(self, rows: list[dict], step: int) -> None:
        """Completions as a table (W&B, Trackio) or a Markdown table (TensorBoard)."""
        if not rows:
            return
        columns = list(rows[0])
        data = [[_cell(row[c]) for c in columns] for row in rows]
        for tracker in self.trackers:
            if tracker.name == "wandb":
                tracker.log_table("samples", columns=columns, data=data, step=step)
            elif tracker.name == "trackio":
                import trackio

                tracker.log({"samples": trackio.Table(columns=columns, data=data)}, step=step)
            else:
                head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
                body = "".join("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |\n"
                               for row in data)
                tracker.log({"samples": head + body}, step=step)

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()


def _cell(value: Any) -> Any:
    return value if isinstance(value, (int, float, str)) else str(value)

