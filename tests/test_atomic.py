"""atomic_folder and write_file_atomically: the target is the old folder (file) or the complete
new one, never half of one."""

from __future__ import annotations

import os
import stat

import pytest

from lora_ppo import atomic
from lora_ppo.atomic import atomic_folder, write_file_atomically


def test_publishes_the_staged_folder_and_replaces_an_old_one(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with atomic_folder(target) as staging:
        assert staging.parent == tmp_path and staging.name.startswith(".out.tmp-")
        (staging / "sub").mkdir()
        (staging / "sub" / "new.txt").write_text("new")
        assert not (target / "sub").exists()  # nothing visible before the block ends
    assert sorted(p.name for p in target.rglob("*")) == ["new.txt", "sub"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or old folder left


def test_an_error_inside_leaves_the_old_folder_and_no_staging(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_folder(target) as staging:
            (staging / "half.txt").write_text("half")
            raise KeyboardInterrupt
    assert (target / "old.txt").read_text() == "old" and not (target / "half.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_published_files_are_readable_by_others_under_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_folder(tmp_path / "out") as staging:
            path = staging / "weights.bin"
            path.write_bytes(b"x")
            os.chmod(path, 0o600)  # what some writers (safetensors) do
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out" / "weights.bin").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755


def test_a_link_at_the_target_is_replaced_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").symlink_to(elsewhere)
    with atomic_folder(tmp_path / "out") as staging:
        (staging / "a.txt").write_text("a")
    assert not (tmp_path / "out").is_symlink() and (tmp_path / "out" / "a.txt").is_file()
    assert list(elsewhere.iterdir()) == []


def test_a_file_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    target.write_text("old")
    old = os.umask(0o022)
    try:
        write_file_atomically(target, "new")
    finally:
        os.umask(old)
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o644  # like any saved file, not mkstemp's 0600

    def fail(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.os, "replace", fail)  # killed between the write and the rename
    with pytest.raises(KeyboardInterrupt):
        write_file_atomically(target, "newer")
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["summary.json"]
