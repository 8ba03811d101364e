"""Reading a user's text file as UTF-8, one way for every reader, with errors that name the file and the line.

* A UTF-8 byte-order mark (``EF BB BF``) at the start of a file is dropped. It marks the
  encoding and is no part of the text: Windows Notepad ("UTF-8 with BOM") and Excel
  ("CSV UTF-8") write it, and Python's ``utf-8-sig`` codec drops it the same way. Refusing it
  would only make a user re-save a file that means exactly what it says; keeping it made it
  the first item's first character (and JSON lines refuse it). Anywhere else, U+FEFF is the
  text's own character and is kept.
* A NUL byte is refused: text holds none. A file with NUL bytes is UTF-16 (every ASCII
  character followed by a NUL) or not text at all, and tokenizers would drop the NULs silently.
* ``\\n``, ``\\r\\n`` and a lone ``\\r`` (old Mac files) all end a line, as in Python's text mode
  and the ``csv`` module: a ``\\r``-only file used to be read as one item.
* :func:`iter_lines` streams a file in blocks of :data:`BLOCK_BYTES`, so a line is in memory
  only up to its cap (:data:`MAX_LINE_BYTES` by default): a longer line is refused while it is
  read, never read whole.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import BinaryIO, Iterator

#: bytes read from a text file at a time
BLOCK_BYTES = 1 << 16
#: the longest line :func:`iter_lines` reads by default (1 MiB). A line is one probe item, pair or
#: record; a text encoder reads at most a few thousand tokens of one (512 for BERT, 8192 for the
#: longest), a few tens of kilobytes, and cuts the rest. A longer line is nearly always a file
#: that is not one-record-per-line (a whole document, a JSON file on one line); reading and
#: tokenizing it whole cost about 230 MB and seconds per MB, again at every virtual batch.
MAX_LINE_BYTES = 1 << 20

BOM = b"\xef\xbb\xbf"
_BREAK = re.compile(rb"\r\n|\r|\n")


def read_text(path: str | os.PathLike, what: str = "file") -> str:
    """The contents of ``path`` decoded as UTF-8, without a leading byte-order mark.

    Bytes that are not UTF-8, and NUL bytes, raise ``ValueError`` naming ``what``, the file,
    the line, the byte offset and the offending bytes, with the fix, where Python's own error
    names none of them; a folder raises ``ValueError`` too.
    """
    path = Path(path)
    _check_not_folder(path, what, "a text file")
    data = path.read_bytes()
    start = len(BOM) if data.startswith(BOM) else 0
    nul = data.find(b"\0", start)
    if nul >= 0:
        raise ValueError(_nul_error(path, _line_at(data, nul), nul, what))
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start : exc.end]
        offset = start + exc.start
        raise ValueError(_decode_error(path, _line_at(data, offset), offset, bad, exc.reason, what)) from None


def iter_lines(
    path: str | os.PathLike, what: str = "file", *, max_bytes: int | None = MAX_LINE_BYTES
) -> Iterator[tuple[int, str]]:
    """``(line number, line without its line break)`` of a UTF-8 text file, streamed.

    Lines end at ``\\n``, ``\\r\\n`` or ``\\r``; a leading byte-order mark is dropped. A line
    that is not UTF-8 or holds a NUL byte raises the ``ValueError`` of :func:`read_text`, and a
    line longer than ``max_bytes`` (``None``: no limit) a ``ValueError`` as soon as that many
    bytes of it are read, so memory stays bounded by the cap whatever the file holds.
    """
    path = Path(path)
    with open(path, "rb") as fh:
        for number, offset, raw in _raw_lines(fh, max_bytes):
            if raw is None:
                raise ValueError(
                    f"{what} {path}: line {number} is longer than {max_bytes} bytes, the limit of one "
                    f"line; split it into shorter texts (a model reads at most a few thousand tokens of "
                    f"one and cuts the rest), or give long documents as a corpus (--corpus), which "
                    f"windows them"
                )
            if number == 1 and raw.startswith(BOM):
                raw, offset = raw[len(BOM) :], offset + len(BOM)
            nul = raw.find(b"\0")
            if nul >= 0:
                raise ValueError(_nul_error(path, number, offset + nul, what))
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad = raw[exc.start : exc.end]
                raise ValueError(_decode_error(path, number, offset + exc.start, bad, exc.reason, what)) from None


def _raw_lines(fh: BinaryIO, max_bytes: int | None) -> Iterator[tuple[int, int, bytes | None]]:
    """``(line number, byte offset of its start, its bytes without the line break)`` of a binary
    file, read in blocks; ``None`` for the bytes of a line once it is longer than ``max_bytes``
    (and nothing after it)."""
    number, start_of_line, position = 1, 0, 0  # position: the file offset of the block's first byte
    parts: list[bytes] = []
    size = 0
    after_cr = False  # the last block ended with \r: a \n that opens this one belongs to it
    while block := fh.read(BLOCK_BYTES):
        start = 0
        if after_cr and block.startswith(b"\n"):
            start = 1
            start_of_line += 1
        after_cr = False
        for brk in _BREAK.finditer(block, start):
            parts.append(block[start : brk.start()])
            size += brk.start() - start
            if max_bytes is not None and size > max_bytes:
                yield number, start_of_line, None
                return
            yield number, start_of_line, b"".join(parts)
            parts, size, start = [], 0, brk.end()
            number, start_of_line = number + 1, position + start
            after_cr = brk.end() == len(block) and brk.group() == b"\r"
        parts.append(block[start:])
        size += len(block) - start
        if max_bytes is not None and size > max_bytes:
            yield number, start_of_line, None
            return
        position += len(block)
    if size:
        yield number, start_of_line, b"".join(parts)


def _line_at(data: bytes, offset: int) -> int:
    """The line (from 1) that byte ``offset`` of ``data`` is on, lines ending as in :func:`iter_lines`."""
    return sum(1 for _ in _BREAK.finditer(data, 0, offset)) + 1


def _check_not_folder(path: Path, what: str, expected: str) -> None:
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder; expected a file ({expected})")


def _decode_error(path: str | os.PathLike, line: int, offset: int, bad: bytes, reason: str, what: str = "file") -> str:
    """The message for bytes ``bad`` that are not UTF-8, at byte ``offset`` (line ``line``) of ``path``."""
    return (
        f"{what} {path}: line {line} (byte {offset}) is not UTF-8 ({bad!r}: {reason}); "
        f"save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 {Path(path).name})"
    )


def _nul_error(path: str | os.PathLike, line: int, offset: int, what: str = "file") -> str:
    """The message for a NUL byte at byte ``offset`` (line ``line``) of ``path``."""
    name = Path(path).name
    return (
        f"{what} {path}: line {line} (byte {offset}) holds a NUL byte, which no text holds: the file is "
        f"UTF-16 (save it as UTF-8, e.g. iconv -f utf-16 -t utf-8 {name}) or not text at all"
    )
