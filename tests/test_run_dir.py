"""The run folder: which checkpoints are complete, how a resumed run trims its logs, and that a
run started over an old one keeps the old one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lora_ppo.errors import RecipeError
from lora_ppo.run_dir import (
    MANIFEST_FILE,
    RunDir,
    append_jsonl,
    find_checkpoint,
    find_run_root,
    is_checkpoint,
    read_jsonl,
    write_jsonl,
)


def _checkpoint(folder, complete=True):
    folder.mkdir(parents=True)
    if complete:
        (folder / MANIFEST_FILE).write_text(json.dumps({"step": 1}))
    return folder


def test_complete_checkpoints_are_those_with_a_manifest_in_step_order(tmp_path):
    run = RunDir(tmp_path)
    for n in (10, 2, 3):
        _checkpoint(run.step_checkpoint(n))
    _checkpoint(run.step_checkpoint(11), complete=False)
    _checkpoint(run.checkpoints / ".step-12.tmp-abc")
    _checkpoint(run.checkpoints / "other")
    assert [p.name for p in run.complete_checkpoints()] == ["step-2", "step-3", "step-10"]
    assert is_checkpoint(run.step_checkpoint(2)) and not is_checkpoint(run.step_checkpoint(11))


def test_a_checkpoint_finds_its_run(tmp_path):
    run = RunDir(tmp_path / "run")
    run.start("train: {}\n")
    step = _checkpoint(run.step_checkpoint(4))
    final = _checkpoint(run.final)
    assert find_run_root(step) == run.root and find_run_root(final) == run.root
    assert find_run_root(tmp_path) is None


def test_resume_keeps_the_lines_up_to_the_checkpoint_and_drops_the_summary(tmp_path):
    run = RunDir(tmp_path)
    run.start("old recipe\n")
    for step in range(1, 5):
        append_jsonl(run.metrics, {"step": step})
    append_jsonl(run.samples, {"step": 1})
    run.write_summary({"steps": 4})
    run.resume("new recipe\n", metrics_lines=2, samples_lines=0)
    assert read_jsonl(run.metrics) == [{"step": 1}, {"step": 2}]
    assert read_jsonl(run.samples) == [] and not run.summary.exists()
    assert run.recipe.read_text() == "new recipe\n"


def test_moving_a_run_aside_keeps_everything_and_picks_a_free_name(tmp_path):
    run = RunDir(tmp_path / "quickstart")
    run.start("recipe\n")
    append_jsonl(run.metrics, {"step": 1})
    first = run.move_aside()
    assert not run.root.exists() and (first / "metrics.jsonl").is_file()
    assert first.name.startswith("quickstart.old-")
    run.start("recipe\n")
    second = run.move_aside()
    assert second != first and second.exists() and first.exists()


def test_runs_moved_aside_in_the_same_second_are_numbered_from_2(tmp_path, monkeypatch):
    from lora_ppo import run_dir

    monkeypatch.setattr(run_dir.time, "strftime", lambda fmt: "20261129-120000")
    run = RunDir(tmp_path / "quickstart")
    names = []
    for step in range(3):
        run.start("recipe\n")
        append_jsonl(run.metrics, {"step": step})
        names.append(run.move_aside().name)
    assert names == ["quickstart.old-20261129-120000", "quickstart.old-20261129-120000-2",
                     "quickstart.old-20261129-120000-3"]
    assert [read_jsonl(tmp_path / name / "metrics.jsonl") for name in names] == [[{"step": 0}], [{"step": 1}], [{"step": 2}]]


@pytest.mark.parametrize("written", ["recipe.yaml", "metrics.jsonl"])
def test_a_run_stopped_before_its_first_checkpoint_is_moved_aside_by_the_next(tmp_path, written):
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    (run.root / written).write_text("left by a run that stopped\n")
    assert run.holds_run() and not run.has_checkpoint()
    moved = run.open("new recipe\n")
    assert moved is not None and (moved / written).read_text() == "left by a run that stopped\n"
    assert sorted(p.name for p in run.root.iterdir()) == ["recipe.yaml"]
    assert RunDir(tmp_path / "empty").open("recipe\n") is None


@pytest.mark.parametrize("resumed_from", ["nothing named", "the same folder"])
def test_a_run_resumed_in_its_own_folder_trims_its_lines_in_place(tmp_path, resumed_from):
    run = RunDir(tmp_path / "run")
    run.start("old recipe\n")
    for step in range(1, 4):
        append_jsonl(run.metrics, {"step": step})
    same = RunDir(tmp_path / "sub" / ".." / "run") if resumed_from == "the same folder" else None
    assert run.open("new recipe\n", resume_lines=(2, 0), resumed_run=same) is None
    assert read_jsonl(run.metrics) == [{"step": 1}, {"step": 2}] and run.recipe.read_text() == "new recipe\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing moved aside


def test_the_write_test_leaves_no_file_behind(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "new" / "run")
    run.check_writable()
    assert list(tmp_path.iterdir()) == []

    def fills_the_disk(self, data):  # the file is made, then the write fails
        Path.touch(self)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", fills_the_disk)
    with pytest.raises(RecipeError, match="cannot write in .*: No space left on device"):
        run.check_writable()
    assert list(tmp_path.iterdir()) == []


def test_an_output_dir_that_cannot_be_written_is_refused_before_anything_loads(tmp_path, tiny_model_dir, monkeypatch):
    """One line and exit 2 from `train`, before the model loads: a file where the folder should
    be, and a folder that refuses a new file (read-only file system; as root, permissions would
    not show it here, so the write fails by hand)."""
    import errno

    from typer.testing import CliRunner

    from lora_ppo import parts
    from lora_ppo.cli import app
    from tests.conftest import write_recipe

    monkeypatch.setattr(parts, "load_base_model", lambda cfg: pytest.fail("loaded the model first"))
    taken = tmp_path / "a-file"
    taken.write_text("not a folder")
    recipe = write_recipe(tmp_path / "r.yaml", tiny_model_dir, taken)
    result = CliRunner().invoke(app, ["train", str(recipe), "--no-progress"])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: train.output_dir: {str(taken)!r} is a file, not a folder"

    real_write = Path.write_bytes

    def read_only(self, data):
        if self.name.startswith(".lora_ppo-write-test"):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_write(self, data)

    monkeypatch.setattr(Path, "write_bytes", read_only)
    recipe = write_recipe(tmp_path / "r2.yaml", tiny_model_dir, tmp_path / "runs" / "new")
    result = CliRunner().invoke(app, ["train", str(recipe), "--no-progress"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and lines == [f"error: train.output_dir: cannot write in {str(tmp_path)!r}: "
                                               "Read-only file system"]
    assert not (tmp_path / "runs").exists() and not list(tmp_path.glob(".lora_ppo-write-test*"))


@pytest.mark.parametrize("below", ["run", "a/b/run"])
def test_a_real_read_only_file_system_as_output_dirs_parent_is_one_line(tmp_path, tiny_model_dir, below):
    """A read-only tmpfs mounted where the run folder would go: where even removing the probe file
    fails (EROFS, not ENOENT), it is one line and exit 2, before the model loads."""
    from typer.testing import CliRunner

    from lora_ppo.cli import app
    from tests.conftest import write_recipe
    from tests.mounts import tmpfs

    with tmpfs(tmp_path / "ro", size_kb=64, read_only=True) as mounted:
        recipe = write_recipe(tmp_path / "r.yaml", tiny_model_dir, mounted / below)
        result = CliRunner().invoke(app, ["train", str(recipe), "--no-progress"])
        assert result.exit_code == 2, result.output
        assert result.stderr.strip().splitlines() == [
            f"error: train.output_dir: cannot write in {str(mounted)!r}: Read-only file system"]


def test_a_disk_that_fills_up_under_the_runs_logs_is_one_line(tmp_path, tiny_model_dir):
    """A real tmpfs with one page free once the run starts: the first write that needs more (the
    recipe or the metrics) fails with ENOSPC, which is one line and exit 2, not a traceback."""
    from typer.testing import CliRunner

    from lora_ppo.cli import app
    from tests.conftest import write_recipe
    from tests.mounts import PAGE, fill_until_free, tmpfs

    with tmpfs(tmp_path / "disk", size_kb=256) as disk:
        fill_until_free(disk, PAGE)
        recipe = write_recipe(tmp_path / "r.yaml", tiny_model_dir, disk / "run", eval=False)
        result = CliRunner().invoke(app, ["train", str(recipe), "--no-progress"])
        assert result.exit_code == 2, result.output
        last = result.stderr.strip().splitlines()[-1]
        # Full before the first checkpoint: nothing to resume, and the line does not promise any.
        assert last.startswith(f"error: cannot write {disk / 'run'}") and last.endswith(
            ": No space left on device; no checkpoint was saved yet (run again once the folder can be written)")
        assert "Traceback" not in result.output


def test_a_checkpoint_resumed_in_a_new_folder_starts_there_with_the_lines_up_to_it(tmp_path):
    old = RunDir(tmp_path / "old")
    old.start("old recipe\n")
    for step in range(1, 4):
        append_jsonl(old.metrics, {"step": step})
    for step in (1, 3):
        append_jsonl(old.samples, {"step": step})
    for prompt in ("a", "b"):
        append_jsonl(old.eval_before, {"prompt": prompt})
    new = RunDir(tmp_path / "runs" / "2026" / "continued")  # parents that do not exist yet

    assert new.open("new recipe\n", resume_lines=(2, 1), resumed_run=old) is None
    assert new.recipe.read_text() == "new recipe\n"
    assert read_jsonl(new.metrics) == [{"step": 1}, {"step": 2}] and read_jsonl(new.samples) == [{"step": 1}]
    assert read_jsonl(new.eval_before) == [{"prompt": "a"}, {"prompt": "b"}]  # the held-out records, whole
    assert len(read_jsonl(old.metrics)) == 3 and old.recipe.read_text() == "old recipe\n"  # the old run untouched


def test_resuming_makes_a_missing_folder_and_needs_no_summary(tmp_path):
    run = RunDir(tmp_path / "a" / "b")
    run.resume("recipe\n", metrics_lines=0, samples_lines=0)
    assert run.recipe.read_text() == "recipe\n" and not run.summary.exists()


def test_a_checkpoints_summary_is_the_runs_and_none_before_the_run_ends(tmp_path):
    run = RunDir(tmp_path / "run")
    run.start("recipe\n")
    checkpoint = find_checkpoint(_checkpoint(run.step_checkpoint(1)))
    assert checkpoint.step == 1 and checkpoint.summary() is None
    run.write_summary({"steps": 4, "heldout_score_after": 0.5})
    assert checkpoint.summary() == {"steps": 4, "heldout_score_after": 0.5}


def test_write_jsonl_replaces_a_file_with_one_record_per_line(tmp_path):
    path = tmp_path / "eval_after.jsonl"
    path.write_text('{"old": true}\n')
    write_jsonl(path, [{"prompt": "a", "score": 1.5}, {"prompt": "b", "score": -2}])
    assert path.read_text() == '{"prompt": "a", "score": 1.5}\n{"prompt": "b", "score": -2}\n'


def _project(folder: Path) -> dict:
    """A user's project folder: their own recipe.yaml, data and reward code. Returns its files."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"recipe.yaml": "train:\n  steps: 2\n", "prompts.jsonl": '{"prompt": "The film"}\n',
             "my_reward.py": "def score(prompts, completions):\n    return [0.0] * len(completions)\n"}
    for name, text in files.items():
        (folder / name).write_text(text)
    return files


def test_a_project_folder_given_as_output_dir_is_refused_before_anything_loads_and_left_where_it_is(
        tmp_path, tiny_model_dir, monkeypatch):
    """Its own recipe.yaml made the project folder look like a run stopped before its first
    checkpoint: the run moved the whole project aside (recipe, data, reward code) and took its
    place, overwrite or not."""
    from typer.testing import CliRunner

    from lora_ppo import parts
    from lora_ppo.cli import app
    from tests.conftest import write_recipe

    monkeypatch.setattr(parts, "load_base_model", lambda cfg: pytest.fail("loaded the model first"))
    project = tmp_path / "project"
    files = _project(project)
    for overwrite in ("false", "true"):
        recipe = write_recipe(tmp_path / "r.yaml", tiny_model_dir, project)
        result = CliRunner().invoke(app, ["train", str(recipe), f"train.overwrite={overwrite}", "--no-progress"])
        assert result.exit_code == 2
        assert result.stderr.strip() == (f"error: train.output_dir: {str(project)!r} holds files no run writes "
                                         "(my_reward.py, prompts.jsonl); give the run a folder of its own (a new run "
                                         "moves an old one's folder aside)")
    assert {p.name: p.read_text() for p in project.iterdir()} == files
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("project")] == ["project"]


def test_what_a_run_writes_is_a_run_folder_and_a_users_file_in_a_run_moves_aside_with_it(tmp_path):
    """A run folder with its tracker logs, its report and a file the desktop adds (.DS_Store) is
    a run's; so is one where the user saved a file of their own (eval records, notes) beside the
    run's records: the next run with train.overwrite moves it aside whole. A recipe.yaml alone
    beside such a file is not a run's."""
    from lora_ppo.tracking import TENSORBOARD_DIR

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    for name in ("recipe.yaml", "summary.json", ".DS_Store"):
        (run.root / name).write_text("x")
    for folder in (TENSORBOARD_DIR, "wandb", "report", "checkpoints"):
        (run.root / folder).mkdir()
    assert run.foreign_entries() == []
    (run.root / "notes.txt").write_text("mine")
    assert run.foreign_entries() == ["notes.txt"]
    for records in ("summary.json", "checkpoints"):  # each alone is a run's record
        run.refuse_if_taken(overwrite=True)
        (run.root / records).unlink() if records.endswith(".json") else (run.root / records).rmdir()
    with pytest.raises(RecipeError, match=r"holds files no run writes \(notes.txt\)"):
        run.refuse_if_taken(overwrite=True)


def test_the_current_folder_holding_a_run_is_refused_not_moved_with_the_shell_in_it(tmp_path, monkeypatch):
    """`train.output_dir: .` a second time: moving the current folder aside took `.` with it, so
    the new run wrote into the old one's folder."""
    (tmp_path / "recipe.yaml").write_text("the last run's\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "checkpoints").mkdir()
    for cwd in (tmp_path, tmp_path / "checkpoints"):  # the folder itself, and a folder inside it
        monkeypatch.chdir(cwd)
        for root in (".", str(tmp_path)) if cwd == tmp_path else ("..",):
            with pytest.raises(RecipeError, match=f"^train.output_dir: {re.escape(repr(root))} holds a run and the "
                                                  "current folder, which a new run cannot move aside"):
                RunDir(root).refuse_if_taken(overwrite=True)
    assert (tmp_path / "recipe.yaml").read_text() == "the last run's\n"
    monkeypatch.chdir(tmp_path.parent)
    RunDir(tmp_path).refuse_if_taken(overwrite=True)  # from elsewhere: moved aside as any old run
