"""train.report_to through the real tracker libraries: TensorBoard's event files read back with
TensorBoard's own reader, W&B in offline mode, Trackio writing locally; a tracker that is not
installed is a one-line recipe error naming the extra."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lora_ppo.cli import app
from lora_ppo.tracking import flat_config
from tests.conftest import tiny_recipe_dict

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, tiny_model_dir):
    """A 2-step run that reports to all three trackers, in a fresh process (Trackio and W&B read
    their folders from the environment at import)."""
    root = tmp_path_factory.mktemp("tracked")
    out = root / "run"
    # 8 responses a step: the samples logged are 4 of them (train.sample_every's doc), in every tracker.
    recipe = tiny_recipe_dict(tiny_model_dir, out, rollout={"batch_size": 8, "forward_batch_size": 4},
                              train={"steps": 2, "sample_every": 1, "eval": False,
                                     "report_to": ["tensorboard", "wandb", "trackio"]})
    (root / "r.yaml").write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "TRACKIO_DIR": str(root / "trackio"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "lora_ppo.cli", "train", str(root / "r.yaml"), "--no-progress"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, out, env


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_event_files_hold_every_step(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, _ = tracked_run
    runs = [p for p in (out / "tensorboard").rglob("events.out.tfevents.*")]
    assert runs, "no TensorBoard event file"
    acc = EventAccumulator(str(runs[0].parent))
    acc.Reload()
    metrics = _metrics(out)
    for key in ("objective/scores", "objective/kl", "policy/entropy", "loss/value"):
        events = acc.Scalars(key)
        assert [e.step for e in events] == [1, 2]
        assert [e.value for e in events] == pytest.approx([m[key] for m in metrics], rel=1e-6)
    assert "samples" in " ".join(acc.Tags()["tensors"])  # the samples table, as Markdown text
    # Every number of a step's record, under its own name, and the step as the x-axis, not a metric.
    assert set(acc.Tags()["scalars"]) == {k for m in metrics for k, v in m.items()
                                          if k != "step" and isinstance(v, (int, float))}


def _wandb_records(path: Path) -> list:
    """The protobuf records of an offline W&B run file. wandb 0.31 writes no summary or config
    files offline (its Go core keeps them for `wandb sync`), and ships no Python reader of its own:
    the file is a 7-byte header, then LevelDB-log chunks (crc, length, type) in 32 KiB blocks."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, pos, pending, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_is_written_in_the_run_folder(tracked_run):
    _, out, _ = tracked_run
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = _wandb_records(next(runs[0].glob("*.wandb")))
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    assert [h.step.num for h in history] == [1, 2]
    scores = [json.loads(next(i.value_json for i in h.item if list(i.nested_key) == ["objective/scores"]))
              for h in history]
    assert scores == pytest.approx([m["objective/scores"] for m in _metrics(out)])
    config = {u.key: json.loads(u.value_json) for r in records if r.WhichOneof("record_type") == "config"
              for u in r.config.update}
    assert config["ppo.clip_eps"] == 0.2  # the resolved recipe is the run's config
    assert list((runs[0] / "files" / "media" / "table").glob("samples_*.table.json"))  # the samples table


def test_trackio_writes_locally(tracked_run):
    root, out, env = tracked_run
    # Trackio reads TRACKIO_DIR at import: read it back in a process with the run's environment.
    script = ("import json; from trackio.sqlite_storage import SQLiteStorage as S; "
              f"print(json.dumps(S.get_logs({out.name!r}, {out.name!r}), default=str))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    logs = [entry for entry in json.loads(proc.stdout) if "objective/scores" in entry]
    assert [entry["step"] for entry in logs] == [1, 2]
    tables = [(e["step"], e["samples"]["_value"]) for e in json.loads(proc.stdout) if "samples" in e]
    written = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert tables == [(step, [r for r in written if r["step"] == step]) for step in (1, 2)]
    assert [len(rows) for _, rows in tables] == [4, 4]
    assert [entry["objective/scores"] for entry in logs] == pytest.approx(
        [m["objective/scores"] for m in _metrics(out)])
    assert list((root / "trackio").glob("*.db"))


def test_a_tracker_not_installed_is_a_one_line_error(tmp_path, tiny_model_dir, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "run", train={"report_to": ["wandb"]})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(app, ["train", str(tmp_path / "r.yaml")])
    assert result.exit_code == 2
    assert result.stderr == "error: train.report_to: wandb is not installed; pip install 'lora_ppo[wandb]'\n"
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize("stage", ["train", "train-sft"])
def test_a_tracker_that_cannot_start_stops_the_run_before_the_held_out_evaluation(stage, tmp_path, tiny_model_dir,
                                                                                  monkeypatch):
    """W&B not logged in: one line and exit 2 before the held-out evaluation, which on a large model
    takes minutes (it came after it until 2026-11-29)."""
    from accelerate.tracking import WandBTracker

    from lora_ppo.sft.trainer import SFTTrainer
    from lora_ppo.trainer import PPOTrainer
    from tests.sft_helpers import demonstration_rows, sft_recipe_dict, write_jsonl

    def not_logged_in(self):
        raise RuntimeError("No API key configured. Use `wandb login` to log in.")

    evaluated = []
    monkeypatch.setattr(WandBTracker, "start", not_logged_in)
    for trainer in (PPOTrainer, SFTTrainer):
        monkeypatch.setattr(trainer, "evaluate", lambda self, *args: evaluated.append(type(self).__name__))
    if stage == "train":
        recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "run", train={"report_to": ["wandb"]})
    else:
        data = write_jsonl(tmp_path / "demos.jsonl", demonstration_rows(8))
        recipe = sft_recipe_dict(tiny_model_dir, data, data, tmp_path / "run", report_to=["wandb"])
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(app, [stage, str(tmp_path / "r.yaml"), "--no-progress"])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == ("error: train.report_to: wandb did not start: No API key configured. "
                                              "Use `wandb login` to log in.")
    assert evaluated == []


def test_unknown_tracker_names_the_choices(tmp_path, tiny_model_dir):
    recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "run", train={"report_to": ["mlflow"]})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(app, ["validate", str(tmp_path / "r.yaml")])
    assert result.exit_code == 2 and "train.report_to" in result.stderr and "tensorboard" in result.stderr


def test_a_python_caller_gets_its_tensorboard_logs_when_the_run_ends_and_the_samples_as_markdown(tmp_path):
    """In a notebook the process does not exit after train(): the trackers are finished, so the
    event file holds the steps (TensorBoard buffers them for two minutes). One sample row, with a
    `|` and a line break of its own, is one row of the Markdown table."""
    from accelerate import PartialState
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lora_ppo.tracking import TENSORBOARD_DIR, Trackers

    PartialState()  # accelerate's trackers log from the main process, which this names
    trackers = Trackers(["tensorboard"], tmp_path, "run")
    trackers.start({"ppo": {"clip_eps": 0.2}})
    trackers.log({"step": 3, "objective/scores": 0.25, "alarm/nan": 1.0}, step=3)
    trackers.log_samples([{"step": 3, "prompt": "a | b", "completion": "one\ntwo", "score": 0.25}], step=3)
    trackers.finish()
    # Closed: a next run in the process (train.overwrite moves this folder aside) holds no file of it open.
    assert trackers.trackers[0].writer.all_writers is None

    acc = EventAccumulator(str(next((tmp_path / TENSORBOARD_DIR).rglob("events.out.tfevents.*")).parent))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"objective/scores", "alarm/nan"}
    assert [(e.step, e.value) for e in acc.Scalars("objective/scores")] == [(3, 0.25)]
    [text] = [t for t in acc.Tags()["tensors"] if "samples" in t]
    [event] = acc.Tensors(text)
    markdown = event.tensor_proto.string_val[0].decode()
    assert markdown == ("| step | prompt | completion | score |\n|---|---|---|---|\n"
                        "| 3 | a \\| b | one two | 0.25 |\n")


def test_flat_config_joins_sections():
    assert flat_config({"ppo": {"clip_eps": 0.2}, "train": {"report_to": ["wandb"]}, "x": None}) == {
        "ppo.clip_eps": 0.2, "train.report_to": "['wandb']", "x": None}
