"""Per-type aggregation of a token-level run: which vocabulary entries (or whole words) run hot or
cold across their contexts, and how many occurrences back each figure.

``aggregate(run, by="token")`` groups the token rows of a probe run by vocabulary entry
(``token_id``; ``by="word"``: by whole word) and reports, per type, the number of
occurrences and, for each of ``norm, V2, D, kappa, r_eq, r_eq_heat``, the mean, the
standard deviation over the occurrences (``ddof = 1``) and the standard error of the mean
(``std / sqrt(n)``).

Relative heat
    Runs that have the ``heat_rel`` column (:mod:`normfast.engine.diagnostics.relative_heat`) also get
    ``heat_rel``: the type's mean relative heat (log V2 minus the run's reference level, so
    the mean log heat relative to the run's typical row), with the same ``_std``, ``_se``,
    ``_n`` -- ``heat_rel_se`` is the spread over the type's contexts -- and, with error bars
    (``heat_loo``), ``heat_rel_se_batches``: the error of that mean from the batch sample,
    the delete-a-group jackknife of the type's mean with the reference recomputed in each
    replicate (the type-level twin of ``se_heat_rel``). The first says how much the type's
    contexts differ, the second how well this run measured them.

Rows counted
    Token rows only (``position >= 0``); special tokens are left out (the ``is_special``
    column when the run has one, else the token strings of ``SPECIAL_TOKENS``), and so are
    overlap duplicates of corpus runs (``primary == False``: each token is counted in the one
    window that owns it). ``occurrences`` counts the remaining rows of a type; ``count``
    those with valid statistics (``valid``), over which everything is computed; a quantity
    that is not finite on a valid row (``r_eq`` without a positive root) is left out of
    that quantity only, and ``{q}_n`` says how many values its mean is over.

Whole words (``by="word"``)
    Needs the ``word_id`` and ``word`` columns of a corpus run
    (:mod:`normfast.data.corpus`): the pieces of one word occurrence are the consecutive
    rows of one probe item with the same ``word_id``. The word's value for each quantity
    is the *mean over its pieces* (an occurrence is valid when all its pieces are, and a
    quantity is kept when it is finite on every piece); the occurrences are then grouped by
    the word's text (``casefold=True``: case-folded). ``pieces`` is the mean number of
    word pieces per occurrence.

Engine
    pyarrow's hash group-by (``Table.group_by(...).aggregate``: C++, already a core
    dependency, exact) computes per batch of rows the count, mean and variance of every
    quantity per type; the batch results are merged exactly into running per-type
    accumulators with Chan's parallel update of (n, mean, M2) -- the same merge the probe
    accumulators use. Rows stream from the Parquet file(s) one batch at a time, so memory
    is one batch plus a few numbers per type, whatever the size of the run; a run split
    over several files (a sharded run's manifest) is read part by part.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

QUANTITIES = ("norm", "V2", "D", "kappa", "r_eq", "r_eq_heat")
#: special-token texts, for runs written before the ``is_special`` column existed
SPECIAL_TOKENS = {"[CLS]", "[SEP]", "[PAD]", "<s>", "</s>", "<pad>", "<start_of_text>", "<end_of_text>"}
BY = ("token", "word")
_VAR0 = pc.VarianceOptions(ddof=0)


def _source(run: Any) -> tuple[Any, list[str], int, list[Path], dict[str, Any]]:
    """``(batch reader, column names, rows, Parquet files, run metadata)`` of a path, manifest, file
    list or ProbeResult (file-backed or in memory). The reader: ``reader(columns=, batch_size=)``."""
    import pyarrow.parquet as pq

    from normfast.data.io import count_rows, iter_batches

    if hasattr(run, "files") and hasattr(run, "metadata") and run.files is None:
        return run.iter_batches, list(run.column_names), len(run), [], dict(run.metadata)
    files, metadata = _files(run)

    def reader(columns: Sequence[str], batch_size: int) -> Iterable[pa.RecordBatch]:
        return iter_batches(files, columns=columns, batch_size=batch_size)

    return reader, list(pq.read_schema(files[0]).names), count_rows(files), files, metadata


def _files(run: Any) -> tuple[list[Path], dict[str, Any]]:
    """``(Parquet files in item order, run metadata)`` of a path, manifest, file list or file-backed ProbeResult."""
    from normfast.data.io import check_columns, open_run, read_metadata

    if hasattr(run, "files") and hasattr(run, "metadata"):
        return run.files, dict(run.metadata)
    if isinstance(run, (str, os.PathLike)):
        path = Path(run)
        if not path.exists():
            raise FileNotFoundError(f"aggregate: run {path} does not exist")
        return open_run(path)
    files = [Path(p) for p in run]
    if not files:
        raise ValueError("aggregate: expected at least one Parquet file, got none")
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"aggregate: run file {f} does not exist")
    metadata = read_metadata(files[0])
    check_columns(files)
    return files, metadata


class _Merged:
    """Running per-type (n, mean, M2) for several quantities, merged exactly batch by batch."""

    def __init__(self, quantities: Sequence[str], extra: Sequence[str]):
        self.quantities = list(quantities)
        self.extra = list(extra)  # plain sums per type (occurrences, count, pieces)
        self.keys: pa.Array | None = None
        self.labels: list[Any] = []
        self.sums = {k: np.zeros(0) for k in self.extra}
        self.n = {q: np.zeros(0) for q in self.quantities}
        self.mean = {q: np.zeros(0) for q in self.quantities}
        self.m2 = {q: np.zeros(0) for q in self.quantities}

    def _slots(self, keys: pa.Array, labels: pa.Array) -> np.ndarray:
        if self.keys is None:
            idx = pa.nulls(len(keys), pa.int32())
        else:
            idx = pc.index_in(keys, value_set=self.keys)
        idx = idx.to_numpy(zero_copy_only=False)
        new = np.isnan(idx) if idx.dtype.kind == "f" else np.zeros(len(keys), bool)
        if new.any():
            start = 0 if self.keys is None else len(self.keys)
            fresh = keys.filter(pa.array(new))
            self.keys = fresh if self.keys is None else pa.concat_arrays([self.keys, fresh])
            self.labels += labels.filter(pa.array(new)).to_pylist()
            idx = np.where(new, 0, idx)
            idx[new] = np.arange(start, start + int(new.sum()))
            grow = len(self.keys)
            for d in (self.sums, self.n, self.mean, self.m2):
                for k in d:
                    d[k] = np.concatenate([d[k], np.zeros(grow - len(d[k]))])
        return idx.astype(np.int64)

    def add(self, part: pa.Table, key: str, label: str) -> None:
        """Merge one batch's group-by result (columns key, label, extra sums, q_n, q_mean, q_var)."""
        if part.num_rows == 0:
            return
        slot = self._slots(part.column(key).combine_chunks(), part.column(label).combine_chunks())
        for k in self.extra:
            np.add.at(self.sums[k], slot, part.column(k).to_numpy(zero_copy_only=False).astype(float))
        for q in self.quantities:
            nb = np.nan_to_num(part.column(f"{q}_n").to_numpy(zero_copy_only=False).astype(float))
            mb = np.nan_to_num(part.column(f"{q}_mean").to_numpy(zero_copy_only=False).astype(float))
            vb = np.nan_to_num(part.column(f"{q}_var").to_numpy(zero_copy_only=False).astype(float))
            na, ma, m2a = self.n[q][slot], self.mean[q][slot], self.m2[q][slot]
            n = na + nb
            with np.errstate(invalid="ignore", divide="ignore"):
                delta = mb - ma
                mean = np.where(n > 0, ma + delta * np.where(n > 0, nb / n, 0.0), 0.0)
                m2 = m2a + vb * nb + np.where(n > 0, delta * delta * na * nb / np.where(n > 0, n, 1.0), 0.0)
            # slots are unique within one group-by result, so plain assignment is exact
            self.n[q][slot], self.mean[q][slot], self.m2[q][slot] = n, mean, m2


def _null_where(values: pa.Array, bad: pa.Array) -> pa.Array:
    return pc.if_else(bad, pa.scalar(None, values.type), values)


def _prepared(batch: pa.RecordBatch, quantities: Sequence[str]) -> pa.Table | None:
    """The batch's countable rows, with ``_valid`` and each quantity null where not usable."""
    t = pa.Table.from_batches([batch])
    keep = pc.greater_equal(t.column("position"), 0)
    if "is_special" in t.column_names:
        keep = pc.and_(keep, pc.invert(t.column("is_special")))
    elif "token" in t.column_names:
        keep = pc.and_(keep, pc.invert(pc.is_in(t.column("token"), value_set=pa.array(sorted(SPECIAL_TOKENS)))))
    if "primary" in t.column_names:
        keep = pc.and_(keep, t.column("primary"))
    t = t.filter(keep)
    if t.num_rows == 0:
        return None
    valid = t.column("valid")
    cols = {}
    for q in quantities:
        v = pc.cast(t.column(q), pa.float64())
        bad = pc.or_(pc.invert(valid), pc.invert(pc.is_finite(v)))
        cols[q] = _null_where(v, pc.fill_null(bad, True))
    out = t.drop_columns([c for c in quantities if c in t.column_names])
    out = out.append_column("_valid", pc.cast(valid, pa.int64()))
    out = out.append_column("_one", pa.array(np.ones(out.num_rows, np.int64)))
    for q in quantities:
        out = out.append_column(q, cols[q])
    return out


def _moments(quantities: Sequence[str]) -> list[tuple]:
    aggs = []
    for q in quantities:
        aggs += [(q, "count"), (q, "mean"), (q, "variance", _VAR0)]
    return aggs


def _rename(table: pa.Table, quantities: Sequence[str], keep: dict[str, str]) -> pa.Table:
    names = {}
    for q in quantities:
        names[f"{q}_count"] = f"{q}_n"
        names[f"{q}_variance"] = f"{q}_var"
    names.update(keep)
    return table.rename_columns([names.get(c, c) for c in table.column_names])


def _token_part(t: pa.Table, quantities: Sequence[str]) -> pa.Table:
    aggs = [("_one", "sum"), ("_valid", "sum"), ("token", "min")] + _moments(quantities)
    g = t.group_by(["token_id"], use_threads=False).aggregate(aggs)
    return _rename(g, quantities, {"_one_sum": "occurrences", "_valid_sum": "count", "token_min": "label"})


def _word_occurrences(t: pa.Table, quantities: Sequence[str], casefold: bool) -> pa.Table:
    """One row per word occurrence: the mean of each quantity over the word's pieces."""
    t = t.filter(pc.greater_equal(t.column("word_id"), 0))
    aggs = [("_one", "sum"), ("_valid", "min"), ("word", "min")]
    for q in quantities:
        aggs += [(q, "count"), (q, "mean")]
    g = t.group_by(["item", "word_id"], use_threads=False).aggregate(aggs)
    pieces = g.column("_one_sum")
    occ_valid = pc.equal(g.column("_valid_min"), 1)
    cols = {
        "word": pc.utf8_lower(g.column("word_min")) if casefold else g.column("word_min"),
        "pieces": pc.cast(pieces, pa.float64()),
        "_one": pa.array(np.ones(g.num_rows, np.int64)),
        "_valid": pc.cast(occ_valid, pa.int64()),
    }
    for q in quantities:
        complete = pc.and_(occ_valid, pc.equal(g.column(f"{q}_count"), pieces))
        cols[q] = _null_where(g.column(f"{q}_mean"), pc.invert(complete))
    return pa.table(cols)


def _word_part(occ: pa.Table, quantities: Sequence[str]) -> pa.Table:
    occ = occ.append_column("label", occ.column("word"))
    aggs = [("_one", "sum"), ("_valid", "sum"), ("pieces", "sum"), ("label", "min")] + _moments(quantities)
    g = occ.group_by(["word"], use_threads=False).aggregate(aggs)
    return _rename(
        g, quantities, {"_one_sum": "occurrences", "_valid_sum": "count", "pieces_sum": "pieces", "label_min": "label"}
    )


def _batches_with_whole_words(batches: Iterable[pa.RecordBatch]) -> Iterable[pa.RecordBatch]:
    """Batches in item order in which no word occurrence is split: the rows of a batch's last
    (item, word_id) are held back and prepended to the next batch."""
    held: pa.RecordBatch | None = None
    for batch in batches:
        if held is not None and held.num_rows:
            batch = pa.Table.from_batches([held, batch.cast(held.schema)]).combine_chunks().to_batches()[0]
        n = batch.num_rows
        if n == 0:
            continue
        item = batch.column("item").to_numpy(zero_copy_only=False)
        wid = batch.column("word_id").to_numpy(zero_copy_only=False)
        tail = np.flatnonzero((item != item[-1]) | (wid != wid[-1]))
        cut = int(tail[-1]) + 1 if tail.size else 0
        held = batch.slice(cut)
        if cut:
            yield batch.slice(0, cut)
    if held is not None and held.num_rows:
        yield held


def aggregate(
    run: Any,
    by: str = "token",
    *,
    min_count: int = 1,
    quantities: Sequence[str] = QUANTITIES,
    casefold: bool = False,
    batch_size: int = 1 << 18,
    progress: bool = False,
) -> pa.Table:
    """Per-type statistics of a token-level run (see the module docstring).

    Args:
        run: a run's Parquet file or manifest, a list of its Parquet files (in item order),
            or a :class:`~normfast.engine.result.ProbeResult` (file-backed or in memory).
        by: ``"token"`` (vocabulary entries, keyed by ``token_id``) or ``"word"``
            (whole words, keyed by their text; needs a corpus run's word columns).
        min_count: keep types with at least this many valid occurrences.
        quantities: the columns to aggregate (default ``norm, V2, D, kappa, r_eq, r_eq_heat``).
        casefold: ``by="word"`` only: group words case-insensitively.
        batch_size: rows read per batch (memory is one batch plus O(number of types)).
        progress: show a progress bar over the rows.

    Returns:
        A ``pyarrow.Table``, one row per type, most frequent first: ``token_id`` and
        ``token`` (or ``word`` and ``pieces``), ``occurrences``, ``count``, and for every
        quantity ``q``: ``q_mean``, ``q_std``, ``q_se``, ``q_n``. The schema metadata holds
        the run's metadata and the aggregation settings.
    """
    import json

    from tqdm.auto import tqdm

    from normfast.data.schema import METADATA_KEY
    from normfast.engine.diagnostics.relative_heat import (
        batch_error_bar,
        heat_replicates,
        replicate_name,
        with_replicates,
    )

    fn = "aggregate"
    if by not in BY:
        raise ValueError(f"{fn}: by must be one of {BY}, got {by!r}")
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
        raise ValueError(f"{fn}: expected min_count to be a positive int, got {min_count!r}")
    default = quantities is QUANTITIES
    quantities = list(quantities)
    if not quantities:
        raise ValueError(f"{fn}: expected at least one quantity to aggregate")
    reader, names, total, files, metadata = _source(run)
    names = set(names)
    if default and "heat_rel" in names:
        quantities.append("heat_rel")
    missing = [q for q in quantities if q not in names]
    if missing:
        raise ValueError(f"{fn}: the run has no column(s) {missing}; its columns are {sorted(names)}")
    need = {"item", "position", "token_id", "token", "valid", *quantities}
    if by == "word":
        if not {"word_id", "word"} <= names:
            raise ValueError(
                f"{fn}: by='word' needs the word_id and word columns of a corpus run "
                f"(normfast probe MODEL --corpus FILE); this run has none -- use by='token'"
            )
        need |= {"word_id", "word"}
    elif casefold:
        raise ValueError(f"{fn}: casefold applies to by='word' only")
    need |= {c for c in ("is_special", "primary") if c in names}
    if metadata.get("output") == "pooled":
        raise ValueError(
            f"{fn}: the run has pooled rows (one per input); per-type aggregation needs a "
            f"token-level run (--tokens or --corpus)"
        )
    replicates = heat_replicates(metadata) if "heat_rel" in quantities and "heat_loo" in names else []
    if replicates:
        need.add("heat_loo")
    public = list(quantities)
    quantities = public + [replicate_name(g) for g in range(len(replicates))]
    columns = sorted(need)
    merged = _Merged(quantities, ["occurrences", "count"] + (["pieces"] if by == "word" else []))
    key = "token_id" if by == "token" else "word"
    batches = reader(columns=columns, batch_size=batch_size)
    if by == "word":
        batches = _batches_with_whole_words(batches)
    bar = tqdm(total=total, desc=f"aggregating by {by}", unit="row", unit_scale=total >= 10_000, disable=not progress)
    rows_read = 0
    try:  # closed however it ends: an error (a damaged file) then starts on a line of its own
        for batch in batches:
            rows_read += batch.num_rows
            bar.update(batch.num_rows)
            if replicates:
                batch = with_replicates(batch, replicates)
            t = _prepared(batch, quantities)
            if t is None:
                continue
            part = (
                _token_part(t, quantities)
                if by == "token"
                else _word_part(_word_occurrences(t, quantities, casefold), quantities)
            )
            merged.add(part, key, "label")
    finally:
        bar.close()
    if rows_read != total:
        raise RuntimeError(f"{fn}: read {rows_read} rows of {total}")
    table = _finish(
        merged,
        by,
        key,
        min_count,
        quantities,
        {
            METADATA_KEY: json.dumps(
                {
                    "run": metadata,
                    "aggregation": {
                        "by": by,
                        "min_count": min_count,
                        "casefold": casefold,
                        "quantities": public,
                        "rows": total,
                        "files": [str(f) for f in files],
                    },
                },
                default=str,
            ).encode()
        },
    )
    return batch_error_bar(table, len(replicates)) if replicates else table


def _finish(
    merged: _Merged, by: str, key: str, min_count: int, quantities: Sequence[str], schema_metadata: dict
) -> pa.Table:
    if merged.keys is None:
        n_types = 0
        keys = pa.array([], pa.int64() if by == "token" else pa.string())
    else:
        n_types = len(merged.keys)
        keys = merged.keys
    count = merged.sums["count"] if n_types else np.zeros(0)
    occ = merged.sums["occurrences"] if n_types else np.zeros(0)
    keep = np.flatnonzero(count >= min_count)
    label = np.asarray(merged.labels, dtype=object)
    order = keep[np.lexsort((label[keep].astype(str) if n_types else np.zeros(0), -count[keep]))] if keep.size else keep
    cols: dict[str, Any] = {}
    if by == "token":
        cols["token_id"] = keys.take(pa.array(order, pa.int64())) if n_types else keys
        cols["token"] = pa.array(label[order].tolist(), pa.string())
    else:
        cols["word"] = keys.take(pa.array(order, pa.int64())) if n_types else keys
        with np.errstate(invalid="ignore", divide="ignore"):
            cols["pieces"] = merged.sums["pieces"][order] / occ[order]
    cols["occurrences"] = occ[order].astype(np.int64)
    cols["count"] = count[order].astype(np.int64)
    for q in quantities:
        n = merged.n[q][order]
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(n > 0, merged.mean[q][order], np.nan)
            std = np.where(n > 1, np.sqrt(np.maximum(merged.m2[q][order], 0.0) / (n - 1)), np.nan)
            se = std / np.sqrt(n)
        cols[f"{q}_mean"], cols[f"{q}_std"], cols[f"{q}_se"] = mean, std, se
        cols[f"{q}_n"] = n.astype(np.int64)
    return pa.table(cols).replace_schema_metadata(schema_metadata)


def write_table(table: pa.Table, path: str | os.PathLike) -> Path:
    """Write an aggregate table as ``.parquet`` or ``.csv`` (by the suffix), atomically."""
    from normfast.data.atomic import temporary_file

    path = Path(path)
    if path.suffix not in (".parquet", ".csv"):
        raise ValueError(f"write_table: expected a .parquet or .csv path, got {str(path)!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_file(path)
    try:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, tmp)
        else:
            import pyarrow.csv as pcsv

            pcsv.write_csv(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
