"""Real file systems for the tests of what a full or read-only disk does: a tmpfs mounted for the
test (root with CAP_SYS_ADMIN, as in CI's container), skipped with the reason where it cannot be."""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

PAGE = 4096  # tmpfs counts space in pages


@contextmanager
def tmpfs(path: Path, size_kb: int, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of `size_kb` KiB mounted at `path` for the block (read-only if asked)."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command on this machine")
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size_kb}k" + (",ro" if read_only else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def fill_until_free(folder: Path, free_bytes: int) -> Path:
    """Write a file into `folder`'s file system until about `free_bytes` (rounded to a page) are
    left; returns the file (remove it to give the space back)."""
    filler = folder / "filler.bin"
    excess = shutil.disk_usage(folder).free - free_bytes
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, excess // PAGE * PAGE))
        f.flush()
        os.fsync(f.fileno())
    return filler
