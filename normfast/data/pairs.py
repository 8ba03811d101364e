"""Pair sources: where virtual batches come from.

A :class:`PairSource` holds the training-like data an objective needs (see
``Objective.needs``) and hands out batches by index:

* ``kind="pairs"``  -- ``batch(idx) -> (anchors, positives)``, two lists;
* ``kind="labels"`` -- ``batch(idx) -> (items, labels)``, a list and an int64
  tensor of class codes (original labels in :attr:`PairSource.classes`);
* ``kind="items"``  -- ``batch(idx) -> items``, a list.

:func:`virtual_batches` draws the index sets: ``M`` batches, each of distinct
indices, reproducible from a seed.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from normfast.core.checks import check_positive_int

KINDS = ("pairs", "labels", "items")


def virtual_batches(n: int, M: int, batch_size: int, seed: int = 0) -> list[np.ndarray]:
    """``M`` index arrays of ``batch_size`` distinct indices in ``[0, n)``.

    Batches are drawn independently (an index may appear in several batches,
    never twice in one), from ``numpy.random.default_rng(seed)``: the same
    arguments always give the same batches.
    """
    fn = "virtual_batches"
    n = check_positive_int(fn, "n (the number of pairs/items in the source)", n)
    M = check_positive_int(fn, "M", M, minimum=2)
    batch_size = check_positive_int(fn, "batch_size", batch_size, minimum=2)
    if batch_size > n:
        raise ValueError(f"{fn}: expected batch_size <= n (batches hold distinct indices), "
                         f"got batch_size={batch_size}, n={n}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"{fn}: expected seed to be an int, got {seed!r}")
    rng = np.random.default_rng(int(seed))
    return [np.sort(rng.choice(n, size=batch_size, replace=False)).astype(np.int64)
            for _ in range(M)]


class PairSource:
    """Pairs, labelled items or plain items, indexable into virtual batches.

    Build one with :meth:`from_iterable`, :meth:`from_jsonl` or :meth:`from_tsv`,
    or directly: ``PairSource("pairs", anchors, positives)``,
    ``PairSource("labels", items, labels)``, ``PairSource("items", items)``.
    """

    def __init__(self, kind: str, first: Sequence[Any], second: Sequence[Any] | None = None):
        fn = "PairSource"
        if kind not in KINDS:
            raise ValueError(f"{fn}: kind must be one of {KINDS}, got {kind!r}")
        first = list(first)
        if not first:
            what = "pair" if kind == "pairs" else "item"
            raise ValueError(f"{fn}: expected at least one {what}, got none")
        self.kind = kind
        self.classes: list[Any] | None = None
        self._labels: torch.Tensor | None = None
        if kind == "items":
            if second is not None:
                raise ValueError(f"{fn}: kind='items' takes one sequence, got a second one")
            self._first, self._second = first, None
            return
        if second is None:
            raise ValueError(f"{fn}: kind={kind!r} needs a second sequence "
                             f"({'positives' if kind == 'pairs' else 'labels'})")
        second = list(second)
        if len(second) != len(first):
            many, per = ("positives", "anchors") if kind == "pairs" else ("labels", "items")
            raise ValueError(f"{fn}: expected as many {many} as {per}, "
                             f"got {len(first)} and {len(second)}")
        self._first, self._second = first, second
        if kind == "labels":
            self.classes, codes = _encode_labels(second)
            self._labels = torch.as_tensor(codes, dtype=torch.int64)

    # -- constructors -----------------------------------------------------------
    @classmethod
    def from_iterable(cls, data: Iterable[Any], labels: Iterable[Any] | None = None,
                      kind: str | None = None) -> "PairSource":
        """From Python objects.

        * ``labels`` given -> ``"labels"`` with ``data`` the items;
        * ``kind="pairs"`` / ``"labels"`` -> ``data`` holds 2-tuples
          ``(anchor, positive)`` / ``(item, label)``;
        * ``kind="items"`` -> ``data`` holds items;
        * ``kind=None`` -> 2-tuples (or lists) are pairs, anything else items.
        """
        fn = "PairSource.from_iterable"
        rows = list(data)
        if not rows:
            raise ValueError(f"{fn}: expected at least one element, got an empty iterable")
        if kind is not None and kind not in KINDS:
            raise ValueError(f"{fn}: kind must be one of {KINDS} or None, got {kind!r}")
        if labels is not None:
            if kind not in (None, "labels"):
                raise ValueError(f"{fn}: labels= makes a 'labels' source, got kind={kind!r}")
            return cls("labels", rows, list(labels))
        if kind is None:
            kind = "pairs" if all(_is_pair(r) for r in rows) else "items"
        if kind == "items":
            return cls("items", rows)
        for i, row in enumerate(rows):
            if not _is_pair(row):
                raise ValueError(f"{fn}: kind={kind!r} expects 2-tuples, "
                                 f"got {type(row).__name__} at index {i}")
        return cls(kind, [r[0] for r in rows], [r[1] for r in rows])

    @classmethod
    def from_jsonl(cls, path: str | os.PathLike, anchor_key: str = "anchor",
                   positive_key: str = "positive", label_key: str | None = None,
                   text_key: str = "text", kind: str | None = None) -> "PairSource":
        """From a JSON-lines file (one object per line; blank lines are skipped).

        ``kind=None``: ``"labels"`` when ``label_key`` is given (items under
        ``text_key``), else ``"pairs"`` (``anchor_key``, ``positive_key``).
        ``kind="items"`` reads ``text_key`` only.
        """
        fn = "PairSource.from_jsonl"
        if kind is None:
            kind = "labels" if label_key is not None else "pairs"
        if kind not in KINDS:
            raise ValueError(f"{fn}: kind must be one of {KINDS} or None, got {kind!r}")
        if kind == "labels" and label_key is None:
            raise ValueError(f"{fn}: kind='labels' needs label_key")
        keys = {"pairs": (anchor_key, positive_key), "labels": (text_key, label_key),
                "items": (text_key,)}[kind]
        first, second = [], []
        for line_no, line in _read_lines(fn, path):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{fn}: {os.fspath(path)!r} line {line_no}: invalid JSON "
                                 f"({exc.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{fn}: {os.fspath(path)!r} line {line_no}: expected a JSON "
                                 f"object, got {type(record).__name__}")
            for key in keys:
                if key not in record:
                    raise ValueError(f"{fn}: {os.fspath(path)!r} line {line_no}: missing key "
                                     f"{key!r} (keys present: {sorted(record)})")
            first.append(record[keys[0]])
            if len(keys) == 2:
                second.append(record[keys[1]])
        if not first:
            raise ValueError(f"{fn}: {os.fspath(path)!r} holds no records")
        return cls(kind, first, second if len(keys) == 2 else None)

    @classmethod
    def from_tsv(cls, path: str | os.PathLike, columns: Sequence[int | str] = (0, 1),
                 kind: str | None = None) -> "PairSource":
        """From a tab-separated file (no quoting; blank lines are skipped).

        ``columns`` picks one or two columns by 0-based index, or by name when
        they are strings (the first line is then a header). ``kind=None``: two
        columns are ``"pairs"``, one column ``"items"``; pass ``kind="labels"``
        for ``(item, label)`` columns.
        """
        fn = "PairSource.from_tsv"
        columns = list(columns)
        if len(columns) not in (1, 2):
            raise ValueError(f"{fn}: expected one or two columns, got columns={columns!r}")
        if kind is None:
            kind = "pairs" if len(columns) == 2 else "items"
        if kind not in KINDS:
            raise ValueError(f"{fn}: kind must be one of {KINDS} or None, got {kind!r}")
        if (kind == "items") != (len(columns) == 1):
            need = "one column" if kind == "items" else "two columns"
            raise ValueError(f"{fn}: kind={kind!r} needs {need}, got columns={columns!r}")
        by_name = all(isinstance(c, str) for c in columns)
        by_index = all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in columns)
        if not (by_name or by_index):
            raise ValueError(f"{fn}: columns must be all non-negative ints or all header names, "
                             f"got {columns!r}")
        lines = ((no, line.rstrip("\r\n")) for no, line in _read_lines(fn, path))
        index = columns
        if by_name:
            header = next(((no, line) for no, line in lines if line.strip()), None)
            if header is None:
                raise ValueError(f"{fn}: {os.fspath(path)!r} is empty (expected a header line)")
            names = header[1].split("\t")
            missing = [c for c in columns if c not in names]
            if missing:
                raise ValueError(f"{fn}: {os.fspath(path)!r} line {header[0]}: header lacks "
                                 f"column(s) {missing} (header: {names})")
            index = [names.index(c) for c in columns]
        first, second = [], []
        for line_no, line in lines:
            if not line.strip():
                continue
            fields = line.split("\t")
            if max(index) >= len(fields):
                raise ValueError(f"{fn}: {os.fspath(path)!r} line {line_no}: expected at least "
                                 f"{max(index) + 1} tab-separated columns, got {len(fields)}")
            first.append(fields[index[0]])
            if len(index) == 2:
                second.append(fields[index[1]])
        if not first:
            raise ValueError(f"{fn}: {os.fspath(path)!r} holds no rows")
        return cls(kind, first, second if len(index) == 2 else None)

    # -- access -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._first)

    def __repr__(self) -> str:
        extra = f", {len(self.classes)} classes" if self.classes is not None else ""
        return f"PairSource(kind={self.kind!r}, n={len(self)}{extra})"

    def batch(self, indices: Sequence[int] | np.ndarray) -> Any:
        """The batch at ``indices`` (see the module docstring for its form)."""
        idx = np.asarray(indices)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise ValueError(f"PairSource.batch: expected a 1-D sequence of integer indices, got "
                             f"shape={idx.shape}, dtype={idx.dtype}")
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"PairSource.batch: indices must lie in [0, {len(self)}), "
                             f"got min={idx.min()}, max={idx.max()}")
        first = [self._first[i] for i in idx.tolist()]
        if self.kind == "items":
            return first
        if self.kind == "labels":
            return first, self._labels[torch.as_tensor(idx, dtype=torch.int64)]
        return first, [self._second[i] for i in idx.tolist()]

    def virtual_batches(self, M: int, batch_size: int, seed: int = 0) -> list[np.ndarray]:
        """:func:`virtual_batches` over this source."""
        return virtual_batches(len(self), M, batch_size, seed)

    @property
    def labels(self) -> torch.Tensor | None:
        """Class codes of all items (``kind="labels"``), else None."""
        return self._labels


def _is_pair(row: Any) -> bool:
    return isinstance(row, (tuple, list)) and len(row) == 2


def _encode_labels(labels: list[Any]) -> tuple[list[Any], list[int]]:
    """Map labels to codes ``0..K-1`` in order of first appearance."""
    classes: list[Any] = []
    code_of: dict[Any, int] = {}
    codes = []
    for i, label in enumerate(labels):
        if isinstance(label, torch.Tensor):
            label = label.item()
        elif isinstance(label, np.generic):
            label = label.item()
        try:
            code = code_of.get(label)
        except TypeError:
            raise TypeError(f"PairSource: labels must be hashable (ints, strings), got "
                            f"{type(label).__name__} at index {i}") from None
        if code is None:
            code = code_of[label] = len(classes)
            classes.append(label)
        codes.append(code)
    return classes, codes


def _read_lines(fn: str, path: str | os.PathLike) -> Iterable[tuple[int, str]]:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{fn}: no such file {path!r}")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{fn}: {path!r} is empty")
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            yield line_no, line
