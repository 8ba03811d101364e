"""Writing a file atomically: into a temporary file on the same file system, then renamed into place.

A reader (or a process that resumes after a kill) sees the old file or the whole new
one, never a half-written file; a failed write (a full disk) leaves nothing behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any


def write_file_atomically(data: Any, path: Path, tmp_dir: Path | None = None) -> None:
    """``data`` (bytes or a pyarrow buffer) into ``path`` through a temporary file in ``tmp_dir``
    (default: beside ``path``; the same filesystem) and an atomic rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=tmp_dir or path.parent)
    os.close(fd)
    try:
        with open(tmp, "wb") as fh:
            fh.write(memoryview(data))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomically(text: str, path: Path, tmp_dir: Path | None = None) -> None:
    """``text`` as UTF-8 into ``path``, atomically (:func:`write_file_atomically`)."""
    write_file_atomically(text.encode(), path, tmp_dir)
