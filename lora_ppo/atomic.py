"""Publish a folder (or a file) all at once: write it in a hidden sibling, fsync, rename over
the target.

A reader, or a process killed at any moment, sees the previous folder or the complete new
one, never half of one. Used for the builtin model conversion, checkpoints, exports, and the
run folder's summary and evaluation files.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

STAGING_MARK = ".tmp-"


def staging_prefix(name: str) -> str:
    """Hidden staging folders are named `.NAME.tmp-XXXX` beside their target."""
    return f".{name}{STAGING_MARK}"


@contextmanager
def atomic_folder(target: str | Path) -> Iterator[Path]:
    """Yield an empty staging folder; when the block ends without an exception, its contents
    replace `target` (which may exist) in one rename. On any exception, Ctrl-C included, the
    staging folder is removed and `target` is left as it was.

    Raises OSError (disk full, permissions) from the writes or the rename.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=staging_prefix(target.name), dir=target.parent))
    try:
        yield staging
        _make_readable(staging)
        fsync_tree(staging)
        _replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def write_file_atomically(target: str | Path, text: str) -> None:
    """Replace the file `target` with `text` in one rename: a reader, or a process killed
    meanwhile, sees the previous file or the whole new one."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=staging_prefix(target.name), dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o666 & ~umask)  # mkstemp's file is private; a saved file is not
        os.replace(staging, target)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def _make_readable(folder: Path) -> None:
    # mkdtemp makes a private folder and some writers (safetensors) private files; what is
    # published gets the permissions any saved file would have under the user's umask.
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def fsync_tree(folder: Path) -> None:
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


def _replace(staging: Path, target: Path) -> None:
    """Rename `staging` to `target`; an existing target is moved aside first and put back if
    the rename fails (a link at `target` is replaced, never followed)."""
    aside = None
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        holder = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        try:
            os.replace(target, holder / "previous")
        except OSError:
            holder.rmdir()  # nothing moved: no empty holder left behind
            raise
        aside = holder / "previous"
    try:
        os.replace(staging, target)
    except OSError:
        if aside is not None:
            # Put the previous folder back; if even that fails it stays aside, never deleted.
            os.replace(aside, target)
            aside.parent.rmdir()
        raise
    if aside is not None:
        shutil.rmtree(aside.parent, ignore_errors=True)  # the new folder is published: the old one goes
    _fsync(target.parent)
