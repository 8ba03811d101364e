"""Writing a file atomically: into a temporary file on the same file system, then renamed into place.

A reader (or a process that resumes after a kill) sees the old file or the whole new
one, never a half-written file; a failed write (a full disk) leaves nothing behind.

The temporary file is created with the mode every new file gets (``0666`` less the
umask), never ``tempfile.mkstemp``'s private ``0600``: the rename keeps the mode, so a
Parquet output was unreadable to the group and to other users where the HTML, PNG and
JSON files written beside it (plain ``open``) were readable.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any


def temporary_file(path: Path, tmp_dir: Path | None = None, suffix: str = ".tmp") -> Path:
    """A new, empty file ``.NAME.RANDOM.tmp`` for the content of ``path``, in ``tmp_dir`` (default:
    beside ``path``; the same filesystem), with the mode the umask gives any new file."""
    folder = Path(tmp_dir) if tmp_dir is not None else path.parent
    for _ in range(100):
        tmp = folder / f".{path.name}.{secrets.token_hex(6)}{suffix}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(f"temporary_file: no free temporary name for {path.name} in {folder}")


def temporary_folder(path: Path) -> Path:
    """A new, empty folder ``.NAME.RANDOM.tmp`` beside ``path``, to be renamed into ``path`` once filled,
    with the mode the umask gives any new folder (``tempfile.mkdtemp`` makes it ``0700``)."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            tmp.mkdir()
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"temporary_folder: no free temporary name for {path.name} in {path.parent}")


def write_file_atomically(data: Any, path: Path, tmp_dir: Path | None = None) -> None:
    """``data`` (bytes or a pyarrow buffer) into ``path`` through a temporary file in ``tmp_dir``
    (default: beside ``path``; the same filesystem) and an atomic rename."""
    tmp = temporary_file(path, tmp_dir)
    try:
        with open(tmp, "wb") as fh:
            fh.write(memoryview(data))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomically(text: str, path: Path, tmp_dir: Path | None = None) -> None:
    """``text`` as UTF-8 into ``path``, atomically (:func:`write_file_atomically`)."""
    write_file_atomically(text.encode(), path, tmp_dir)
