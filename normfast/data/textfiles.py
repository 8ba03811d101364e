"""Reading a user's text file as UTF-8, with an error that names the file, the line and the byte."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """The contents of ``path`` decoded as UTF-8.

    Bytes that are not UTF-8 raise ``ValueError`` naming ``what``, the file, the line,
    the byte offset and the offending bytes, with the fix (re-encode the file), where
    Python's own error names none of them.
    """
    path = Path(path)
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(decode_error(path, data, exc, what)) from None


def decode_error(path: str | os.PathLike, data: bytes, exc: UnicodeDecodeError, what: str = "file") -> str:
    """The message for a UTF-8 decoding error at ``exc.start`` of ``data`` read from ``path``."""
    line = data.count(b"\n", 0, exc.start) + 1
    bad = data[exc.start : exc.end]
    return (
        f"{what} {path}: line {line} (byte {exc.start}) is not UTF-8 ({bad!r}: {exc.reason}); "
        f"save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 {Path(path).name})"
    )


def iter_lines(path: str | os.PathLike, what: str = "file") -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a UTF-8 text file, streamed (one line in memory at a time); a
    line that is not UTF-8 raises the ``ValueError`` of :func:`read_text`."""
    path = Path(path)
    offset = 0
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad = raw[exc.start : exc.end]
                raise ValueError(
                    f"{what} {path}: line {number} (byte {offset + exc.start}) is not UTF-8 "
                    f"({bad!r}: {exc.reason}); save the file as UTF-8 (e.g. iconv -f latin1 "
                    f"-t utf-8 {path.name})"
                ) from None
            offset += len(raw)
