"""The run folder: which checkpoints are complete, how a resumed run trims its logs, and that a
run started over an old one keeps the old one."""

from __future__ import annotations

import json

from lora_ppo.run_dir import (
    MANIFEST_FILE,
    RunDir,
    append_jsonl,
    find_run_root,
    is_checkpoint,
    read_jsonl,
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
