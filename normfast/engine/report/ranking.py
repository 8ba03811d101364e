"""One ranking of types, for every hottest / coldest list normfast prints or shows.

The probe's summary, ``normfast aggregate``, the run's figure of tokens and its page all rank
the types of a token-level run the same way (:func:`rank_types` over the per-type table of
:func:`normfast.engine.report.aggregate.aggregate`):

* **by the mean relative heat** ``heat_rel_mean`` (``log V2`` minus the run's median, averaged
  over the type's occurrences: the ranking the heat resolves, see the docs' Concepts, "The
  heat's two parts"); runs written before the relative heat existed rank by the mean heat;
* **over the types seen at least** ``min_count`` **times** (valid occurrences). The default is
  :func:`default_min_count`: 2 for a corpus run, where a type's figure is a mean over its
  contexts and one context is anecdote; 1 for a list of probe items (the demo's words), where
  each item is probed once, in no context;
* **without punctuation**: types with no letter or digit (``,`` ``.`` ``"`` ``##.``) are left out
  of the lists (their heat is the punctuation's, not a word's); word pieces (``##ing``) stay in
  token lists -- they are vocabulary entries -- and a word list (``by="word"``) holds whole words.

Nothing is left out silently: :meth:`Ranking.note` says how many types each rule left out. The
per-type table itself keeps every type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

__all__ = ["CORPUS_MIN_COUNT", "Ranking", "default_min_count", "is_punctuation", "rank_types"]

#: a corpus run's lists rank types seen at least this many times
CORPUS_MIN_COUNT = 2


def is_punctuation(label: str) -> bool:
    """A type with no letter or digit (after a word piece's ``##``): punctuation or symbols."""
    text = str(label).removeprefix("##")
    return not any(ch.isalnum() for ch in text)


def default_min_count(metadata: Mapping[str, Any] | None, column_names: Any = ()) -> int:
    """The lists' minimum count for a run: 2 for a corpus run (``corpus`` metadata or a ``doc_id``
    column), 1 otherwise."""
    corpus = bool((metadata or {}).get("corpus")) or "doc_id" in set(column_names)
    return CORPUS_MIN_COUNT if corpus else 1


@dataclass
class Ranking:
    """The ranked types of a per-type table: ``order`` (row indices, hottest first) and what was left out."""

    order: np.ndarray
    key: str
    labels: list[str]
    counts: np.ndarray
    values: np.ndarray
    min_count: int
    types: int
    below_min_count: int
    punctuation: int
    no_value: int

    def hottest(self, top: int) -> np.ndarray:
        return self.order[:top]

    def coldest(self, top: int) -> np.ndarray:
        return self.order[::-1][:top]

    @property
    def measure(self) -> str:
        return "mean relative heat" if self.key == "heat_rel_mean" else f"mean {self.key.removesuffix('_mean')}"

    def note(self) -> str:
        """How the list was made: the measure, the minimum count and every type left out."""
        left = []
        if self.below_min_count:
            left.append(f"{self.below_min_count} seen fewer than {self.min_count} times")
        if self.punctuation:
            left.append(f"{self.punctuation} punctuation type{'s' if self.punctuation != 1 else ''}")
        if self.no_value:
            left.append(f"{self.no_value} without a valid value")
        seen = f"seen at least {self.min_count} times" if self.min_count > 1 else "every type"
        return f"ranked by {self.measure}, {seen}: {len(self.order)} of {self.types} types" + (
            f" ({'; '.join(left)} left out)" if left else ""
        )

    def label(self, i: int) -> str:
        n = int(self.counts[i])
        return f"{self.labels[i]} ×{n}" if n > 1 else self.labels[i]


def rank_types(table: pa.Table, *, min_count: int = 1, punctuation: bool = False) -> Ranking:
    """Rank the rows of a per-type table (``aggregate``'s) hottest first (see the module docstring).

    ``min_count``: types with fewer valid occurrences are left out (and counted); ``punctuation``:
    keep the types without a letter or digit."""
    names = table.column_names
    label_col = "token" if "token" in names else "word"
    key = "heat_rel_mean" if "heat_rel_mean" in names else next(c for c in ("V2_mean", "V2_w_mean") if c in names)
    labels = [str(s) for s in table.column(label_col).to_pylist()]
    counts = table.column("count").to_numpy(zero_copy_only=False).astype(np.int64)
    values = table.column(key).to_numpy(zero_copy_only=False).astype(float)
    often = counts >= int(min_count)
    punct = np.array([not punctuation and is_punctuation(s) for s in labels], dtype=bool)
    finite = np.isfinite(values)
    keep = often & ~punct & finite
    idx = np.flatnonzero(keep)
    # hottest first; ties by label, so the order is stable
    order = idx[np.lexsort((np.asarray(labels, dtype=object)[idx].astype(str), -values[idx]))] if idx.size else idx
    return Ranking(
        order=order,
        key=key,
        labels=labels,
        counts=counts,
        values=values,
        min_count=int(min_count),
        types=len(labels),
        below_min_count=int((~often).sum()),
        punctuation=int((often & punct).sum()),
        no_value=int((often & ~punct & ~finite).sum()),
    )


def run_ranking(result: Any, by: str = "token", min_count: int | None = None) -> tuple[pa.Table, Ranking] | None:
    """The per-type table of a token-level run (``result.types(by)``, with the heat, the relative heat
    and the norm) and its :func:`rank_types` at the run's :func:`default_min_count`; None for a run
    without token rows."""
    from normfast.engine.report.aggregate import aggregate

    names = result.column_names
    if "token_id" not in names or result.metadata.get("output") == "pooled":
        return None
    if by == "word" and "word_id" not in names:
        return None
    quantities = ["norm", result.heat_column] + (["heat_rel"] if "heat_rel" in names else [])
    table = aggregate(result, by=by, quantities=quantities)
    count = default_min_count(result.metadata, names) if min_count is None else int(min_count)
    return table, rank_types(table, min_count=count)
