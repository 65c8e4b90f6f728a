"""atomic_folder and write_file_atomically: the target is the old folder (file) or the complete
new one, never half of one."""

from __future__ import annotations

import os
import stat
from pathlib import Path

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


# ---- a rename that fails while publishing -----------------------------------------------------


def _old_folder(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    return target


def _failing_replace(monkeypatch, fails):
    """Make atomic's os.replace raise OSError for the renames `fails(src, dst)` picks."""
    real = os.replace

    def replace(src, dst):
        if fails(str(src), str(dst)):
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)


def test_a_failed_publishing_rename_leaves_the_previous_folder_and_nothing_else(tmp_path, monkeypatch):
    target = _old_folder(tmp_path)
    staging_prefix = atomic.staging_prefix(target.name)  # staging -> target fails, putting back works
    _failing_replace(monkeypatch, lambda src, dst: dst == str(target) and Path(src).name.startswith(staging_prefix))
    with pytest.raises(OSError, match="Input/output error"):
        with atomic_folder(target) as staging:
            (staging / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["old.txt"] and (target / "old.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # staging and set-aside folders removed


def test_a_failed_rename_of_a_new_target_leaves_nothing(tmp_path, monkeypatch):
    _failing_replace(monkeypatch, lambda src, dst: True)
    with pytest.raises(OSError):
        with atomic_folder(tmp_path / "out") as staging:
            (staging / "new.txt").write_text("new")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_move_aside_leaves_the_previous_folder_and_nothing_else(tmp_path, monkeypatch):
    target = _old_folder(tmp_path)
    _failing_replace(monkeypatch, lambda src, dst: src == str(target))  # target -> aside
    with pytest.raises(OSError):
        with atomic_folder(target) as staging:
            (staging / "new.txt").write_text("new")
    assert (target / "old.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_failed_put_back_never_deletes_the_previous_folder(tmp_path, monkeypatch):
    target = _old_folder(tmp_path)
    # Publishing fails, and so does putting the previous folder back where it was (both rename onto it).
    _failing_replace(monkeypatch, lambda src, dst: dst == str(target))
    with pytest.raises(OSError):
        with atomic_folder(target) as staging:
            (staging / "new.txt").write_text("new")
    survivors = [p for p in tmp_path.rglob("old.txt")] + [p for p in tmp_path.rglob("new.txt")]
    assert survivors, "the previous folder and the new one were both deleted"


def test_publishes_below_folders_that_do_not_exist_yet(tmp_path):
    with atomic_folder(tmp_path / "a" / "b" / "out") as staging:
        (staging / "x.txt").write_text("x")
    write_file_atomically(tmp_path / "c" / "d" / "summary.json", "{}")
    assert (tmp_path / "a" / "b" / "out" / "x.txt").read_text() == "x"
    assert (tmp_path / "c" / "d" / "summary.json").read_text() == "{}"


def test_a_dangling_link_at_the_target_is_replaced(tmp_path):
    (tmp_path / "out").symlink_to(tmp_path / "missing")
    with atomic_folder(tmp_path / "out") as staging:
        (staging / "a.txt").write_text("a")
    assert not (tmp_path / "out").is_symlink() and (tmp_path / "out" / "a.txt").read_text() == "a"
    assert not (tmp_path / "missing").exists()


def test_the_process_umask_and_file_descriptors_are_left_as_they_were(tmp_path):
    """Both writers read the umask by setting it; they must put it back (a umask of 0 would
    make every later file world-writable) and close every descriptor they open to fsync."""
    old = os.umask(0o027)
    try:
        fds = len(os.listdir("/proc/self/fd"))
        with atomic_folder(tmp_path / "out") as staging:
            (staging / "sub").mkdir()
            (staging / "sub" / "a.txt").write_text("a")
        write_file_atomically(tmp_path / "f.txt", "f")
        assert len(os.listdir("/proc/self/fd")) == fds
        assert os.umask(0o027) == 0o027
    finally:
        os.umask(old)


@pytest.fixture
def fsyncs(monkeypatch):
    """Every os.fsync as (path, size in bytes, or None for a folder) at the moment it ran."""
    calls = []
    real_fsync = os.fsync

    def spy(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        calls.append((path, None if path.is_dir() else path.stat().st_size))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return calls


def test_a_published_folder_is_on_disk_before_and_after_its_rename(tmp_path, fsyncs):
    """Durability (a power cut cannot be tested): every file is fsynced whole, every folder after
    the files in it, the staging folder last before the rename, and the parent after it."""
    with atomic_folder(tmp_path / "out") as staging:
        (staging / "sub").mkdir()
        (staging / "sub" / "a.txt").write_text("aaaa")
        (staging / "b.txt").write_text("bb")
    order = [(path.relative_to(staging) if path.is_relative_to(staging) else path, size) for path, size in fsyncs]
    assert sorted(order[:3], key=str) == [(Path("b.txt"), 2), (Path("sub"), None), (Path("sub/a.txt"), 4)]
    assert order.index((Path("sub/a.txt"), 4)) < order.index((Path("sub"), None))
    assert order[3:] == [(Path("."), None), (tmp_path, None)]


def test_a_written_file_is_fsynced_whole(tmp_path, fsyncs):
    write_file_atomically(tmp_path / "summary.json", "0123456789")
    assert len(fsyncs) == 1 and fsyncs[0][1] == 10


def test_a_failing_cleanup_never_hides_the_error_that_caused_it(tmp_path, monkeypatch):
    """The staging folder cannot be removed (a busy network mount): the user still sees the
    error raised inside the block, not the cleanup's."""
    def refuse(*args, **kwargs):
        raise OSError("device or resource busy")

    with pytest.raises(ValueError, match="the writer failed"):
        with atomic_folder(tmp_path / "out") as staging:
            (staging / "a.txt").write_text("a")
            monkeypatch.setattr(os, "rmdir", refuse)
            raise ValueError("the writer failed")


def test_an_old_folder_that_cannot_be_removed_does_not_undo_the_publish(tmp_path, monkeypatch):
    """Once the new folder is published, failing to delete the previous one (moved aside) is
    not an error: the new folder is in place."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")

    def refuse(*args, **kwargs):
        raise OSError("device or resource busy")

    with atomic_folder(tmp_path / "out") as staging:
        (staging / "new.txt").write_text("new")
        monkeypatch.setattr(os, "rmdir", refuse)
        monkeypatch.setattr(os, "unlink", refuse)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["new.txt"]
