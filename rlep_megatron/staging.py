"""Atomic outputs: a directory (:func:`staged_output`) or a small file (:func:`write_file_atomic`)
is written under a temporary name next to the target and renamed onto it when complete, so a
failed or killed writer leaves no partial output.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def staged_output(out_dir: str, replace_existing: bool = False) -> Iterator[str]:
    """Yield a staging directory; on success it becomes ``out_dir`` (world-readable, like a
    directory made with ``mkdir``), on any exception it is removed.

    An existing non-empty ``out_dir`` is refused unless ``replace_existing`` (then it is
    replaced only once the new content is complete)."""
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not replace_existing:
        raise FileExistsError(f"output directory {out_dir} exists and is not empty; choose "
                              "another --out-dir or remove it")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.partial-", dir=parent)
    try:
        yield staging
        _make_readable(staging)  # mkdtemp (and some writers) make files private
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _make_readable(root: str) -> None:
    os.chmod(root, 0o755)
    for directory, subdirs, files in os.walk(root):
        for name in subdirs:
            os.chmod(os.path.join(directory, name), 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o644)


def write_file_atomic(path: str, text: str) -> str:
    """Write ``text`` to ``path`` through a temporary file in the same directory (fsynced, then
    renamed): readers see the old content or the new, never a part. Returns ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path
