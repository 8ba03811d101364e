"""Pair sources: where virtual batches come from.

A :class:`PairSource` holds the training-like data an objective needs (see
``Objective.needs``) and hands out batches by index:

* ``kind="pairs"``  -- ``batch(idx) -> (anchors, positives)``, two lists;
* ``kind="labels"`` -- ``batch(idx) -> (items, labels)``, a list and an int64
  tensor of class codes (original labels in :attr:`PairSource.classes`);
* ``kind="items"``  -- ``batch(idx) -> items``, a list.

:func:`normfast.data.batches.virtual_batches` draws the index sets: ``M`` batches, each of
distinct indices, reproducible from a seed.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from normfast.core.checks import as_tensor
from normfast.data.batches import virtual_batches
from normfast.data.records import read_jsonl, read_tsv

__all__ = ["KINDS", "PairSource", "as_pair_source", "check_batch_size"]

KINDS = ("pairs", "labels", "items")


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
            raise ValueError(
                f"{fn}: kind={kind!r} needs a second sequence ({'positives' if kind == 'pairs' else 'labels'})"
            )
        second = list(second)
        if len(second) != len(first):
            many, per = ("positives", "anchors") if kind == "pairs" else ("labels", "items")
            raise ValueError(f"{fn}: expected as many {many} as {per}, got {len(first)} and {len(second)}")
        self._first, self._second = first, second
        if kind == "labels":
            self.classes, codes = _encode_labels(second)
            self._labels = torch.as_tensor(codes, dtype=torch.int64)

    # -- constructors -----------------------------------------------------------
    @classmethod
    def from_iterable(
        cls, data: Iterable[Any], labels: Iterable[Any] | None = None, kind: str | None = None
    ) -> "PairSource":
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
                raise ValueError(f"{fn}: kind={kind!r} expects 2-tuples, got {type(row).__name__} at index {i}")
        return cls(kind, [r[0] for r in rows], [r[1] for r in rows])

    @classmethod
    def from_jsonl(
        cls,
        path: str | os.PathLike,
        anchor_key: str = "anchor",
        positive_key: str = "positive",
        label_key: str | None = None,
        text_key: str = "text",
        kind: str | None = None,
    ) -> "PairSource":
        """From a JSON-lines file (one object per line; blank lines are skipped).

        ``kind=None``: ``"labels"`` when ``label_key`` is given (items under
        ``text_key``), else ``"pairs"`` (``anchor_key``, ``positive_key``).
        ``kind="items"`` reads ``text_key`` only. Anchors, positives and items must be
        strings (texts, or image paths), labels strings or integers: any other value is
        refused with the file and the line named.
        """
        fn = "PairSource.from_jsonl"
        if kind is None:
            kind = "labels" if label_key is not None else "pairs"
        if kind not in KINDS:
            raise ValueError(f"{fn}: kind must be one of {KINDS} or None, got {kind!r}")
        if kind == "labels" and label_key is None:
            raise ValueError(f"{fn}: kind='labels' needs label_key")
        keys = {"pairs": (anchor_key, positive_key), "labels": (text_key, label_key), "items": (text_key,)}[kind]
        texts = keys if kind == "pairs" else keys[:1]
        first, second = [], []
        for _, record in read_jsonl(path, fn=fn, fields=keys, text_fields=texts, key_fields=keys[len(texts) :]):
            first.append(record[keys[0]])
            if len(keys) == 2:
                second.append(record[keys[1]])
        if not first:
            raise ValueError(f"{fn}: {os.fspath(path)!r} holds no records (the file is empty or blank)")
        return cls(kind, first, second if len(keys) == 2 else None)

    @classmethod
    def from_tsv(
        cls, path: str | os.PathLike, columns: Sequence[int | str] = (0, 1), kind: str | None = None
    ) -> "PairSource":
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
            raise ValueError(f"{fn}: columns must be all non-negative ints or all header names, got {columns!r}")
        rows = [fields for _, fields in read_tsv(path, fn=fn, columns=columns)]
        if not rows:
            raise ValueError(f"{fn}: {os.fspath(path)!r} holds no rows")
        return cls(kind, [r[0] for r in rows], [r[1] for r in rows] if len(columns) == 2 else None)

    @classmethod
    def from_tensors(cls, anchors: Any, positives: Any = None, labels: Any = None) -> "PairSource":
        """From arrays whose first dimension indexes the items (torch tensors, numpy or DLPack arrays).

        * ``positives`` given -> ``"pairs"``: ``batch(idx) -> (anchors[idx], positives[idx])``;
        * ``labels`` given -> ``"labels"``: ``batch(idx) -> (anchors[idx], class codes)``, with the
          sorted distinct labels in :attr:`classes`;
        * neither -> ``"items"``: ``batch(idx) -> anchors[idx]``.

        Batches are tensor slices (no per-item Python objects), which any encoder whose
        ``prepare`` takes a tensor accepts (:class:`~normfast.encoders.ModuleEncoder` passes
        them through its ``collate`` when it has one). Nothing is copied up front.
        """
        return _TensorSource(anchors, positives, labels)

    @classmethod
    def from_dataset(
        cls, dataset: Any, kind: str | None = None, collate: Callable[[list[Any]], Any] | None = None
    ) -> "PairSource":
        """Index-backed source over any map-style dataset (``len`` and ``dataset[i]``), e.g. a
        ``torch.utils.data.Dataset``; items are read only when a virtual batch needs them.

        ``dataset[i]`` is an ``(anchor, positive)`` pair (``kind="pairs"``), an ``(item, label)``
        pair (``"labels"``) or an item (``"items"``). ``kind=None`` looks at ``dataset[0]``: a
        2-tuple whose second element is an integer is ``"labels"``, any other 2-tuple ``"pairs"``,
        anything else ``"items"``.

        A ``torch.utils.data.DataLoader`` is accepted too: its ``dataset`` is indexed and its
        ``collate_fn`` is applied to every virtual batch (never skipped); its sampler, batch size
        and shuffling are not used -- normfast draws the virtual batches itself. ``collate``, when
        given, replaces the loader's. A collated ``"pairs"`` batch must come out as
        ``(anchors, positives)``, a ``"labels"`` batch as ``(items, labels)``; a ``ValueError``
        says so otherwise. Without a collate function a batch is a list of items (as for
        :meth:`from_iterable`), and labels become an int64 tensor.
        """
        return _DatasetSource(dataset, kind, collate)

    # -- access -----------------------------------------------------------------
    _what: str | None = None

    @property
    def what(self) -> str:
        """What the source's elements are, in the plural, for messages: ``"pairs"``, ``"items"``, or
        what a caller set (``"sentences of the corpus"``)."""
        return self._what or {"pairs": "pairs", "labels": "labelled items"}.get(self.kind, "items")

    @what.setter
    def what(self, value: str) -> None:
        self._what = str(value)

    def __len__(self) -> int:
        return len(self._first)

    def __repr__(self) -> str:
        extra = f", {len(self.classes)} classes" if self.classes is not None else ""
        return f"PairSource(kind={self.kind!r}, n={len(self)}{extra})"

    def _indices(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise ValueError(
                f"PairSource.batch: expected a 1-D sequence of integer indices, got "
                f"shape={idx.shape}, dtype={idx.dtype}"
            )
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(
                f"PairSource.batch: indices must lie in [0, {len(self)}), got min={idx.min()}, max={idx.max()}"
            )
        return idx

    def batch(self, indices: Sequence[int] | np.ndarray) -> Any:
        """The batch at ``indices`` (see the module docstring for its form)."""
        idx = self._indices(indices)
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


class _TensorSource(PairSource):
    """:meth:`PairSource.from_tensors`: items are rows of arrays."""

    def __init__(self, anchors: Any, positives: Any = None, labels: Any = None):
        fn = "PairSource.from_tensors"
        if positives is not None and labels is not None:
            raise ValueError(f"{fn}: pass positives= (pairs) or labels= (labelled items), not both")
        first = as_tensor(fn, "anchors", anchors)
        if first.dim() < 1 or first.shape[0] == 0:
            raise ValueError(f"{fn}: expected anchors with at least one row, got anchors.shape={tuple(first.shape)}")
        self.kind = "items"
        self.classes = None
        self._labels = None
        self._first, self._second = first, None
        if positives is not None:
            second = as_tensor(fn, "positives", positives)
            if second.dim() < 1 or second.shape[0] != first.shape[0]:
                raise ValueError(
                    f"{fn}: expected as many positives as anchors, got anchors.shape="
                    f"{tuple(first.shape)}, positives.shape={tuple(second.shape)}"
                )
            self.kind, self._second = "pairs", second
        elif labels is not None:
            lab = np.asarray(labels.detach().cpu() if isinstance(labels, torch.Tensor) else labels)
            if lab.ndim != 1 or lab.shape[0] != first.shape[0]:
                raise ValueError(
                    f"{fn}: expected one label per anchor (1-D, {first.shape[0]} entries), got labels.shape={lab.shape}"
                )
            if lab.dtype.kind == "f" or lab.dtype.kind == "c":
                raise TypeError(f"{fn}: expected integer or string class labels, got dtype={lab.dtype}")
            classes, codes = np.unique(lab, return_inverse=True)
            self.kind = "labels"
            self.classes = classes.tolist()
            self._labels = torch.as_tensor(codes.reshape(-1), dtype=torch.int64)

    def __len__(self) -> int:
        return int(self._first.shape[0])

    def batch(self, indices: Sequence[int] | np.ndarray) -> Any:
        idx = torch.as_tensor(self._indices(indices), dtype=torch.int64)
        first = self._first[idx.to(self._first.device)]
        if self.kind == "items":
            return first
        if self.kind == "labels":
            return first, self._labels[idx]
        return first, self._second[idx.to(self._second.device)]


class _DatasetSource(PairSource):
    """:meth:`PairSource.from_dataset`: items are read from a map-style dataset on demand."""

    def __init__(self, dataset: Any, kind: str | None, collate: Callable[[list[Any]], Any] | None):
        fn = "PairSource.from_dataset"
        loader_collate = None
        if _is_data_loader(dataset):
            loader_collate = dataset.collate_fn
            dataset = dataset.dataset
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(
                f"{fn}: expected a map-style dataset (with __len__ and __getitem__) or a "
                f"DataLoader over one, got {type(dataset).__name__}; for an iterable-style "
                f"dataset use PairSource.from_iterable"
            )
        if len(dataset) == 0:
            raise ValueError(f"{fn}: the dataset is empty")
        if kind is None:
            kind = _infer_kind(dataset[0])
        if kind not in KINDS:
            raise ValueError(f"{fn}: kind must be one of {KINDS} or None, got {kind!r}")
        self.kind = kind
        self.dataset = dataset
        self.collate = collate if collate is not None else loader_collate
        self.classes = None
        self._labels = None
        self._codes: dict[Any, int] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def __repr__(self) -> str:
        via = f", collate={getattr(self.collate, '__name__', type(self.collate).__name__)}" if self.collate else ""
        return f"PairSource(kind={self.kind!r}, n={len(self)}, dataset={type(self.dataset).__name__}{via})"

    def _label_codes(self, labels: Any) -> torch.Tensor:
        if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
            return labels.to(torch.int64).reshape(-1)
        codes = []
        for label in labels:
            label = label.item() if isinstance(label, (torch.Tensor, np.generic)) else label
            if isinstance(label, (int, np.integer)) and not isinstance(label, bool):
                codes.append(int(label))
                continue
            try:  # other hashable labels: a code per distinct value, in the order first seen
                codes.append(self._codes.setdefault(label, -1 - len(self._codes)))
            except TypeError:
                raise TypeError(
                    f"PairSource.from_dataset: labels must be integers or hashable, got {type(label).__name__}"
                ) from None
        return torch.as_tensor(codes, dtype=torch.int64)

    def batch(self, indices: Sequence[int] | np.ndarray) -> Any:
        fn = "PairSource.from_dataset"
        rows = [self.dataset[i] for i in self._indices(indices).tolist()]
        if self.kind != "items":
            for i, row in zip(indices, rows):
                if not _is_pair(row):
                    raise ValueError(
                        f"{fn}: kind={self.kind!r} needs dataset[i] to be a 2-tuple, got "
                        f"{type(row).__name__} at index {int(i)}"
                    )
        if self.collate is not None:
            out = self.collate(rows)
            if self.kind == "items":
                return out
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise ValueError(
                    f"{fn}: the collate function must return (anchors, positives) for pairs or "
                    f"(items, labels) for labels, got {type(out).__name__}"
                    + (f" of length {len(out)}" if hasattr(out, "__len__") else "")
                )
            first, second = out
        else:
            if self.kind == "items":
                return rows
            first, second = [r[0] for r in rows], [r[1] for r in rows]
        if self.kind == "labels":
            return first, self._label_codes(second)
        return first, second


def as_pair_source(pairs: Any, objective: Any, probes: Sequence[Any]) -> "PairSource":
    """The virtual-batch source a probe run reads: ``pairs`` as given when it is a :class:`PairSource`,
    read on demand from a torch ``Dataset``/``DataLoader``, collected from any other iterable, or
    (``pairs=None``, objectives that need only items, e.g. SimCSE) the probes themselves."""
    if isinstance(pairs, PairSource):
        return pairs
    if isinstance(pairs, (torch.utils.data.Dataset, torch.utils.data.DataLoader)):  # read on demand
        return PairSource.from_dataset(pairs, kind=objective.needs)
    if pairs is None:
        if objective.needs == "items":
            source = PairSource.from_iterable(list(probes), kind="items")
            # the objective says how it draws from items (a loss that is no Objective may not)
            describe = getattr(objective, "batch_source", None)
            source.what = describe("probe items") if callable(describe) else "probe items"
            return source
        raise ValueError(f"probe: objective {objective.name!r} needs {objective.needs}; pass pairs=")
    return PairSource.from_iterable(pairs, kind=objective.needs)


def _is_data_loader(obj: Any) -> bool:
    try:
        from torch.utils.data import DataLoader
    except ImportError:  # pragma: no cover - torch always has it
        return False
    return isinstance(obj, DataLoader)


def _infer_kind(row: Any) -> str:
    if not _is_pair(row):
        return "items"
    label = row[1]
    if isinstance(label, torch.Tensor) and label.dim() == 0 and not label.is_floating_point():
        return "labels"
    if isinstance(label, (int, np.integer)) and not isinstance(label, bool):
        return "labels"
    return "pairs"


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
            raise TypeError(
                f"PairSource: labels must be hashable (ints, strings), got {type(label).__name__} at index {i}"
            ) from None
        if code is None:
            code = code_of[label] = len(classes)
            classes.append(label)
        codes.append(code)
    return classes, codes


def check_batch_size(fn: str, batch_size: int, source: "PairSource") -> None:
    """Refuse a virtual batch larger than its source, naming the setting and what the source counts.

    A virtual batch holds distinct elements of the source, so ``batch_size <= len(source)``; checked
    before any model is loaded or run."""
    n = len(source)
    if isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size > n:
        what = getattr(source, "what", None) or "elements"
        raise ValueError(
            f"{fn}: batch_size={batch_size} (CLI --batch-size) is larger than the virtual batches' source, "
            f"which holds {n} {what}; a batch holds distinct ones: pass batch_size <= {n} "
            f"(e.g. {max(2, n // 2)}), or a larger source"
        )
