"""Line-oriented data files -- JSON lines and tab-separated values -- read in one place.

Every such file normfast reads (probe items, corpus documents, pair sources, BEIR
collections, word-pair judgments) goes through :func:`read_jsonl` or :func:`read_tsv`:
UTF-8 (bytes that are not are named by file, line and byte; a leading byte-order mark
dropped; NUL bytes refused), one record per line (ending at ``\\n``, ``\\r\\n`` or ``\\r``; at
most :data:`~normfast.data.textfiles.MAX_LINE_BYTES` long unless a reader lifts the cap), blank
lines skipped. A line that cannot be used raises a
:class:`RecordError` (a ``ValueError``) that names the reading function, the file and
the line -- ``read_documents: corpus.jsonl:7: field 'text' must be a string, got
NoneType`` -- and a missing file a ``FileNotFoundError``. Nothing is dropped silently.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

from normfast.data.textfiles import MAX_LINE_BYTES, iter_lines


class RecordError(ValueError):
    """A line of a data file that cannot be read; the message names the file and the line."""


def read_lines(
    path: str | os.PathLike,
    *,
    fn: str,
    comment: str | None = None,
    expected: str = "a text file, one item per line",
    max_bytes: int | None = MAX_LINE_BYTES,
) -> Iterator[tuple[int, str]]:
    """``(line number, line without its line break)`` for every non-blank line of a UTF-8 text file.

    Lines starting with ``comment`` (when given) are skipped like blank ones; line numbers
    count every line of the file, from 1. Lines end at ``\\n``, ``\\r\\n`` or ``\\r``; a
    line longer than ``max_bytes`` is refused (:func:`~normfast.data.textfiles.iter_lines`).
    ``expected`` says what the file should be when ``path`` is a folder.
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{fn}: {p} is a folder; expected a file ({expected})")
    if not p.is_file():
        raise FileNotFoundError(f"{fn}: {p} does not exist")
    for number, line in iter_lines(p, f"{fn}:", max_bytes=max_bytes):
        if line.strip() and not (comment and line.startswith(comment)):
            yield number, line


def read_jsonl(
    path: str | os.PathLike,
    *,
    fn: str,
    fields: Sequence[str] = (),
    text_fields: Sequence[str] = (),
    key_fields: Sequence[str] = (),
    error: type[RecordError] = RecordError,
    max_bytes: int | None = MAX_LINE_BYTES,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line of a JSON-lines file.

    Every line must hold a JSON object with each of ``fields``; each of ``text_fields`` must
    be there too and hold a string (``null``, a number or a list is refused, never read as
    the text ``"None"``, ``"5"`` or ``"['a']"``). Each of ``key_fields`` (an id, a label), where
    present, must hold a string or an integer. ``error`` is the :class:`RecordError` subclass
    raised for a bad line (e.g. a format's own error type). ``max_bytes``: the longest line read
    (:func:`read_lines`).
    """
    for number, line in read_lines(path, fn=fn, expected="a JSON-lines file, one object per line", max_bytes=max_bytes):
        where = f"{fn}: {path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise error(f"{where}: expected a JSON object, got {type(record).__name__}")
        for key in (*fields, *text_fields):
            if key not in record:
                raise error(f"{where}: missing field {key!r} (fields present: {sorted(record)})")
        for key in text_fields:
            if not isinstance(record[key], str):
                raise error(f"{where}: field {key!r} must be a string, got {_shown(record[key])}")
        for key in key_fields:
            value = record.get(key, "")
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise error(f"{where}: field {key!r} must be a string or an integer, got {_shown(value)}")
        yield number, record


def _shown(value: Any) -> str:
    """A JSON value for an error: its type, and the value itself when short."""
    text = json.dumps(value)
    return type(value).__name__ + (f" {text}" if len(text) <= 40 else "")


def read_tsv(
    path: str | os.PathLike,
    *,
    fn: str,
    columns: Sequence[int | str] | None = None,
    n_fields: int | None = None,
    comment: str | None = None,
    error: type[RecordError] = RecordError,
    max_bytes: int | None = MAX_LINE_BYTES,
) -> Iterator[tuple[int, list[str]]]:
    """``(line number, fields)`` for every non-blank line of a tab-separated file (no quoting).

    ``columns`` picks fields by 0-based index, or by name when they are strings: the first
    non-blank line is then the header (not yielded) and must name every one of them; a line
    with too few fields for ``columns`` is an error. ``n_fields``: every line must have
    exactly that many fields. ``comment``: lines starting with it are skipped. ``max_bytes``: the
    longest line read (:func:`read_lines`).
    """
    expected = "a tab-separated file, one record per line"
    lines = read_lines(path, fn=fn, comment=comment, expected=expected, max_bytes=max_bytes)
    index = None if columns is None else list(columns)
    if index is not None and any(isinstance(c, str) for c in index):
        header = next(lines, None)
        if header is None:
            raise error(f"{fn}: {path} is empty (expected a header line)")
        names = header[1].split("\t")
        missing = [c for c in index if c not in names]
        if missing:
            raise error(f"{fn}: {path}:{header[0]}: header lacks column(s) {missing} (header: {names})")
        index = [names.index(c) for c in index]
    for number, line in lines:
        fields = line.split("\t")
        if n_fields is not None and len(fields) != n_fields:
            raise error(f"{fn}: {path}:{number}: expected {n_fields} tab-separated fields, got {len(fields)}")
        if index is not None:
            if max(index) >= len(fields):
                raise error(
                    f"{fn}: {path}:{number}: expected at least {max(index) + 1} tab-separated fields, got {len(fields)}"
                )
            fields = [fields[i] for i in index]
        yield number, fields
