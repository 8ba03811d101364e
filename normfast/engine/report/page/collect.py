"""What a run's page shows, gathered from the run in a bounded number of streaming passes.

The page's size is bounded by design, whatever the size of the run:

* the text view and the row table hold a *sample of documents* (probe inputs; the
  documents of a corpus run): documents are taken in a seeded random order until
  ``docs`` of them or ``max_rows`` rows are reached (all of them when the run is
  smaller), and shown in their order in the run;
* the type tables are the exact per-type aggregates of every row
  (:func:`normfast.engine.report.aggregate.aggregate`), at most ``max_types`` types (the
  most frequent);
* the heat's distribution is a histogram of every valid row (fixed bins in log10).

Pass 1 reads the document keys and the heat of every row (counts, histogram), pass 2
the sampled documents' rows; the aggregation streams the run once more per grouping.
Memory: one batch of rows plus the sample and a few numbers per document and type.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from normfast.engine.diagnostics.regime import REGIMES as REGIME_CLASSES

DEFAULT_DOCS = 2000
DEFAULT_MAX_ROWS = 20_000
DEFAULT_MAX_TYPES = 20_000
#: the heat histogram's bins: log10 values from HIST_LO in steps of HIST_STEP (HIST_BINS of them)
HIST_LO, HIST_STEP, HIST_BINS = -16.0, 0.05, 640
#: columns a table must have to be viewed as a probe run
REQUIRED = ("item", "position", "norm", "valid", "kappa", "r_eq")
REGIMES = REGIME_CLASSES  # the row regimes, in the order the page's data indexes them


def _fail(msg: str) -> None:
    raise ValueError(f"normfast view: {msg}")


def check_run(result) -> None:
    """Refuse what is not a probe run, with what it is instead where that is known."""
    names = set(result.column_names)
    meta = result.metadata
    if "aggregation" in meta and "run" in meta:
        _fail(
            f"{result.path} is a per-type table written by `normfast aggregate`, not a probe run; "
            f"view the run it was made from ({', '.join(meta['aggregation'].get('files') or []) or '?'})"
        )
    missing = [c for c in REQUIRED if c not in names]
    if missing or not ({"V2", "V2_w"} & names) or not ({"D", "D_w"} & names):
        _fail(
            f"{result.path} is not a normfast probe run: it lacks the column(s) "
            f"{missing or ['V2 or V2_w', 'D or D_w']} (columns: {sorted(names)[:12]}...)"
        )


def stat_columns(result) -> list[str]:
    """The statistics the page can color by, in menu order (those the run has)."""
    names = set(result.column_names)
    order = [
        result.heat_column,
        result.drift_column,
        "norm",
        "r_eq",
        "r_eq_heat",
        "kappa",
        "drift_to_heat",
        "r_eq_snapshot",
    ]
    return [c for c in order if c in names]


def _key_column(result) -> str:
    return "doc_id" if "doc_id" in result.column_names else "item"


def special_rows(t: pa.Table) -> np.ndarray:
    """Rows of tokens the tokenizer added: the ``is_special`` column, or by token text for older runs."""
    if "is_special" in t.column_names:
        return t.column("is_special").to_numpy(zero_copy_only=False).astype(bool)
    from normfast.engine.report.summary import SPECIAL_TOKENS

    if "token" not in t.column_names:
        return np.zeros(t.num_rows, bool)
    tok = pc.is_in(t.column("token"), value_set=pa.array(sorted(SPECIAL_TOKENS))).to_numpy(zero_copy_only=False)
    return tok & (t.column("position").to_numpy(zero_copy_only=False) >= 0)


def scan(result) -> dict[str, Any]:
    """Pass 1: rows per document key (in order of first appearance), row counts, the heat histogram."""
    key = _key_column(result)
    heat = result.heat_column
    cols = [c for c in (key, heat, "valid", "position", "is_special", "token") if c in result.column_names]
    counts: dict[Any, int] = {}
    hist = np.zeros(HIST_BINS, np.int64)
    out = {"rows": 0, "valid": 0, "special": 0, "heat_nonpositive": 0, "heat_below": 0, "heat_above": 0}
    for batch in result.iter_batches(columns=sorted(set(cols))):
        t = pa.Table.from_batches([batch])
        vc = pc.value_counts(t.column(key).combine_chunks())
        for k, n in zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist()):
            counts[k] = counts.get(k, 0) + n
        special = special_rows(t)
        valid = t.column("valid").to_numpy(zero_copy_only=False).astype(bool)
        out["rows"] += t.num_rows
        out["valid"] += int(valid.sum())
        out["special"] += int(special.sum())
        h = t.column(heat).to_numpy(zero_copy_only=False).astype(float)[valid & ~special]
        h = h[np.isfinite(h)]
        out["heat_nonpositive"] += int((h <= 0).sum())
        with np.errstate(divide="ignore"):
            b = np.floor((np.log10(h[h > 0]) - HIST_LO) / HIST_STEP).astype(np.int64)
        out["heat_below"] += int((b < 0).sum())
        out["heat_above"] += int((b >= HIST_BINS).sum())
        hist += np.bincount(b[(b >= 0) & (b < HIST_BINS)], minlength=HIST_BINS)
    out["key"] = key
    out["keys"] = list(counts)
    out["key_rows"] = np.fromiter(counts.values(), np.int64, len(counts))
    out["hist"] = hist
    return out


def sample_documents(key_rows: np.ndarray, docs: int, max_rows: int, seed: int) -> tuple[np.ndarray, bool]:
    """Indices (ascending) of the documents to show: a seeded random order, taken until ``docs``
    documents or ``max_rows`` rows; and whether that is every document. At least one document."""
    n = len(key_rows)
    if n == 0:
        return np.zeros(0, np.int64), True
    order = np.random.default_rng(seed).permutation(n)
    total = np.cumsum(key_rows[order])
    take = int(min(docs, np.searchsorted(total, max_rows, side="right")))
    take = max(1, take)
    return np.sort(order[:take]), take == n


def _row_columns(result) -> list[str]:
    names = result.column_names
    want = [
        "item",
        "id",
        "text",
        "position",
        "token",
        "is_special",
        "valid",
        "reason",
        "regime",
        "regime_reason",
        "doc_id",
        "window",
        "doc_position",
        "word_id",
        "word",
        "primary",
        "norm",
        "kappa",
        result.heat_column,
        f"se_{result.heat_column}",
        result.drift_column,
        f"se_{result.drift_column}",
        "r_eq",
        "r_eq_lo",
        "r_eq_hi",
        "r_eq_heat",
        "r_eq_heat_lo",
        "r_eq_heat_hi",
        "drift_to_heat",
        "r_eq_snapshot",
    ]
    return [c for c in dict.fromkeys(want) if c in names]


def sampled_rows(result, key: str, keys: Sequence[Any], max_rows: int) -> tuple[pa.Table, bool]:
    """Pass 2: the rows of the chosen documents (in run order), at most ``max_rows`` (and whether cut)."""
    value_set = pa.array(list(keys), type=result.schema.field(key).type)
    parts, rows = [], 0
    for batch in result.iter_batches(columns=_row_columns(result)):
        t = pa.Table.from_batches([batch])
        t = t.filter(pc.is_in(t.column(key), value_set=value_set))
        if t.num_rows:
            parts.append(t)
            rows += t.num_rows
        if rows >= max_rows:
            break
    table = (
        pa.concat_tables(parts)
        if parts
        else pa.Table.from_batches([], schema=pa.schema([result.schema.field(c) for c in _row_columns(result)]))
    )
    cut = table.num_rows > max_rows
    return table.slice(0, max_rows).combine_chunks(), cut


def type_tables(result, quantities: Sequence[str], min_count: int, max_types: int) -> dict[str, Any]:
    """The `normfast aggregate` tables of a token run: by token, and by word for a corpus run."""
    from normfast.engine.report.aggregate import aggregate

    if result.metadata.get("output") == "pooled" or "token_id" not in result.column_names:
        return {}
    by = ["token"] + (["word"] if {"word_id", "word"} <= set(result.column_names) else [])
    out = {}
    for b in by:
        t = aggregate(result, by=b, min_count=min_count, quantities=list(quantities))
        out[b] = {"types": t.num_rows, "table": t.slice(0, max_types)}
    return out


def zipf_of(labels: Sequence[str]) -> np.ndarray | None:
    """English Zipf frequency (wordfreq) of the labels that are alphabetic words; NaN elsewhere."""
    from normfast.data.word_frequencies import zipf_frequency  # wordfreq is a dependency: never optional

    words = [s for s in labels if s.isalpha()]
    z = np.full(len(labels), np.nan)
    if not words:
        return z
    try:
        got = iter(np.asarray(zipf_frequency(words), float))
    except (LookupError, OSError):  # wordfreq's data for the language missing or unreadable
        return None
    for i, s in enumerate(labels):
        if s.isalpha():
            v = next(got)
            z[i] = v if v > 0 else np.nan  # 0: a word wordfreq does not know
    return z


# ---------------------------------------------------------------------------
# the text of a document, token by token


_NO_SPACE_BEFORE = set(".,;:!?%)]}'\"”’…")
_NO_SPACE_AFTER = set("([{'\"“‘$#")


def _piece(token: str) -> tuple[str, bool]:
    """A token's text as shown, and whether it joins the previous one (a word-piece continuation)."""
    if token.startswith("##"):
        return token[2:], True
    if token.startswith(("Ġ", "▁")):
        return token[1:], False
    if token.endswith("</w>"):
        return token[:-4], False
    return token, False


def token_layout(rows: pa.Table, corpus: bool) -> tuple[list[str], list[int], list[int]]:
    """Per sampled row: the text to show, whether a space precedes it, and whether it appears in
    the text view (corpus runs: each document token once, in document order, no special tokens)."""
    n = rows.num_rows
    token = rows.column("token").to_pylist() if "token" in rows.column_names else [""] * n
    special = special_rows(rows)
    shown, gap, visible = [], [], []
    words = rows.column("word").to_pylist() if corpus else None
    wids = rows.column("word_id").to_numpy(zero_copy_only=False) if corpus else None
    primary = rows.column("primary").to_numpy(zero_copy_only=False).astype(bool) if corpus else None
    items = rows.column("item").to_numpy(zero_copy_only=False)
    i = 0
    while i < n:
        if corpus and not special[i]:
            # one word: its consecutive pieces in this window; show the word as written, split by piece lengths
            j = i + 1
            while j < n and items[j] == items[i] and wids[j] == wids[i] and not special[j]:
                j += 1
            pieces = [_piece(token[k])[0] for k in range(i, j)]
            word = words[i] or "".join(pieces)
            if "".join(pieces).casefold() == word.casefold() and len("".join(pieces)) == len(word):
                cut = np.cumsum([0] + [len(p) for p in pieces])
                pieces = [word[cut[k] : cut[k + 1]] for k in range(len(pieces))]
            for k, text in enumerate(pieces):
                first = k == 0
                shown.append(text)
                gap.append(int(first and not (text[:1] in _NO_SPACE_BEFORE and len(text) == 1)))
                visible.append(int(primary[i + k]))
            i = j
            continue
        text, joins = _piece(token[i])
        shown.append(text)
        gap.append(int(not joins and not (len(text) == 1 and text in _NO_SPACE_BEFORE)))
        visible.append(int(not (corpus and special[i])))
        i += 1
    # no space after an opening bracket or quote
    for k in range(1, n):
        if len(shown[k - 1]) == 1 and shown[k - 1] in _NO_SPACE_AFTER:
            gap[k] = 0
    return shown, gap, visible


def documents(
    rows: pa.Table, key: str, corpus: bool, shown: Sequence[str], gap: Sequence[int], visible: Sequence[int]
) -> list[dict[str, Any]]:
    """The sampled documents: label, rows [start, end) in the row table, and the text view's rows."""
    keys = rows.column(key).to_pylist()
    out: list[dict[str, Any]] = []
    start = 0
    for i in range(1, len(keys) + 1):
        if i < len(keys) and keys[i] == keys[start]:
            continue
        idx = list(range(start, i))
        if corpus:
            dpos = rows.column("doc_position").to_numpy(zero_copy_only=False)[start:i]
            idx = [j for j in sorted(idx, key=lambda j: (dpos[j - start], j)) if visible[j]]
        label = str(keys[start])
        if corpus:
            head = "".join((" " if gap[j] and k else "") + shown[j] for k, j in enumerate(idx[:12]))
            label = f"{label}: {head}"
        else:
            text = rows.column("text")[start].as_py() if "text" in rows.column_names else ""
            ident = rows.column("id")[start].as_py() if "id" in rows.column_names else label
            label = f"{ident}: {text}" if text else str(ident)
        out.append({"label": label[:80], "start": start, "end": i, "view": idx})
        start = i
    return out


def heat_histogram(scanned: dict[str, Any]) -> dict[str, Any]:
    """The non-empty span of the heat histogram (bins in log10)."""
    hist = scanned["hist"]
    nz = np.flatnonzero(hist)
    if nz.size == 0:
        return {"lo": 0.0, "step": HIST_STEP, "counts": [], "total": 0}
    a, b = int(nz[0]), int(nz[-1]) + 1
    return {
        "lo": HIST_LO + a * HIST_STEP,
        "step": HIST_STEP,
        "counts": hist[a:b].tolist(),
        "total": int(hist.sum()),
        "nonpositive": scanned["heat_nonpositive"],
        "outside": scanned["heat_below"] + scanned["heat_above"],
    }
