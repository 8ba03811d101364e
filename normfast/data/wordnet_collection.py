"""WordNet definition -> term retrieval, a BEIR-format collection derived from WordNet 3.0."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from normfast.core.checks import check_positive_int
from normfast.data.beir import write_beir
from normfast.data.wordnet import load_wordnet, noun_table

__all__ = ["DEPTH_BUCKETS", "build_wordnet_collection"]

#: (stratum, min depth, max depth inclusive or None) over hypernym_depth, fixed up front.
DEPTH_BUCKETS: tuple[tuple[str, int, int | None], ...] = (("shallow", 0, 5), ("mid", 6, 8), ("deep", 9, None))


def _bucket(depth: int, buckets: Sequence[tuple[str, int, int | None]]) -> str | None:
    for name, lo, hi in buckets:
        if depth >= lo and (hi is None or depth <= hi):
            return name
    return None


def build_wordnet_collection(
    out_dir: str | os.PathLike,
    *,
    n_queries: int = 3000,
    n_distractors: int = 20000,
    seed: int = 0,
    min_depth: int = 0,
    max_depth: int | None = None,
    buckets: Sequence[tuple[str, int, int | None]] = DEPTH_BUCKETS,
    wn: Any = None,
) -> Path:
    """WordNet definition -> term retrieval, written in BEIR format; returns ``out_dir``.

    * Query: the gloss of a noun synset. Document: that synset's lemma names,
      underscores as spaces, all of them joined by ", " (e.g. "dog, domestic
      dog, Canis familiaris") -- all lemmas rather than the first, so that
      fewer documents collide and the text is a fuller name of the concept.
      Ids: documents are synset names (``dog.n.01``), queries ``q:`` + name.
    * Synsets whose document text equals another noun synset's (e.g. the
      single-lemma senses of "bank") are left out entirely: their relevance
      would be ambiguous.
    * Exactly one relevant document per query (score 1). The corpus holds
      every query's document plus ``n_distractors`` documents of other noun
      synsets.
    * Stratum: ``buckets`` over the minimum hypernym depth (:func:`hypernym_depth`),
      default shallow <= 5, mid 6-8, deep >= 9. Queries are drawn evenly
      across buckets (``n_queries // len(buckets)`` each, the remainder to
      the first buckets). Query metadata: ``stratum``, ``depth``, ``synset``.
    * ``min_depth`` / ``max_depth`` restrict the query synsets.
    * Deterministic given ``seed`` (synsets sorted by name, numpy's PCG64).
    """
    fn = "build_wordnet_collection"
    check_positive_int(fn, "n_queries", n_queries)
    check_positive_int(fn, "n_distractors", n_distractors, minimum=0)
    if not buckets:
        raise ValueError(f"{fn}: expected at least one depth bucket")
    wn = load_wordnet() if wn is None else wn
    table = sorted(noun_table(wn))
    text_count: dict[str, int] = {}
    for _, text, _, _ in table:
        text_count[text] = text_count.get(text, 0) + 1
    eligible = [row for row in table if text_count[row[1]] == 1]

    by_bucket: dict[str, list[int]] = {b[0]: [] for b in buckets}
    for i, (_, _, depth, _) in enumerate(eligible):
        if depth < min_depth or (max_depth is not None and depth > max_depth):
            continue
        b = _bucket(depth, buckets)
        if b is not None:
            by_bucket[b].append(i)
    rng = np.random.default_rng(seed)
    per, extra = divmod(n_queries, len(buckets))
    chosen: list[int] = []
    for j, (name, _, _) in enumerate(buckets):
        want = per + (1 if j < extra else 0)
        pool = by_bucket[name]
        if want > len(pool):
            raise ValueError(
                f"{fn}: stratum {name!r} has only {len(pool)} eligible synsets within "
                f"the depth limits, asked for {want}"
            )
        chosen.extend(int(pool[i]) for i in rng.choice(len(pool), size=want, replace=False))
    taken = set(chosen)
    rest = [i for i in range(len(eligible)) if i not in taken]
    if n_distractors > len(rest):
        raise ValueError(f"{fn}: only {len(rest)} other eligible noun synsets, asked for {n_distractors} distractors")
    distractors = [rest[i] for i in rng.choice(len(rest), size=n_distractors, replace=False)]

    corpus = {eligible[i][0]: {"title": "", "text": eligible[i][1]} for i in sorted(chosen + distractors)}
    queries: dict[str, dict[str, Any]] = {}
    qrels: dict[str, dict[str, int]] = {}
    for i in sorted(chosen):
        name, _, depth, definition = eligible[i]
        qid = f"q:{name}"
        meta = {"stratum": _bucket(depth, buckets), "depth": depth, "synset": name}
        queries[qid] = {"text": definition, "metadata": meta}
        qrels[qid] = {name: 1}
    return write_beir(out_dir, corpus, queries, qrels, split="test")
