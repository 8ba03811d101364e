"""Two probe runs on the same inputs, compared type by type: what changed between two models, two
checkpoints or two settings (``normfast compare RUN_A RUN_B``, ``ProbeResult.compare``).

Per type (a vocabulary entry, ``token_id``, for token and corpus runs; each probe input for pooled
runs) and per quantity -- the relative heat ``heat_rel``, the drift ``D`` (``D_w`` for AdamW-only
runs) and ``r_eq`` -- each run's *type mean* is the mean over the type's valid occurrences, with the
rows ``normfast aggregate`` counts (token rows; special tokens and the duplicates of overlapping
windows left out), and its *standard error* is the error of that mean from the run's batch sample:

* ``heat_rel``: the delete-a-group jackknife of the type's mean over the run's K batch groups
  (``normfast aggregate``'s ``heat_rel_se_batches``: the row heats without each group,
  ``heat_loo``, with the reference level recomputed), which holds whatever the correlation
  between the errors of the type's rows;
* ``D`` and ``r_eq``: the runs keep no per-group replicates of them, so the type's error is the
  mean of its rows' standard errors (``se_D``; for ``r_eq`` the upper half of its 95% interval over
  ``t_{K-1}``): exact when the rows' errors move together (they come from the same batches),
  an upper bound otherwise, so the test is conservative for types seen many times.

The difference is ``B − A``, its standard error ``√(se_A² + se_B²)`` (the two runs' errors taken as
independent; runs that share their seed and pair source draw the same batches, their errors are
then positively correlated and the test conservative). The test: ``z = (B − A) / se``, two-sided
normal p-value, and the Benjamini-Hochberg procedure at false-discovery rate ``q`` (default 0.05)
over every test of the table at once (every type and quantity with a finite p); a flagged
difference is ``{q}_changed``. A run compared with itself flags nothing (every difference is 0).

The runs must probe the same inputs: the same number of items, the same probe fingerprint
(metadata ``input_fingerprints.probes``) and, row by row, the same item, position and token id;
anything else is refused in one line. Rows are streamed from both runs side by side, so memory is
one batch plus a few numbers per type.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

DEFAULT_Q = 0.05
FN = "normfast compare"
#: the statistics of a run's metadata that are not its settings (left out of "what differs")
RUNTIME_KEYS = (
    "versions",
    "device",
    "spec_fingerprint",
    "world_size",
    "seconds",
    "regime",
    "heat_reference",
    "objective_health",  # the virtual batches' losses and gradient norms: what the settings gave, not a setting
)
TEST = (
    "per type and quantity, z = (B − A) / √(se_A² + se_B²), two-sided normal p-value; flagged by "
    "Benjamini-Hochberg at false-discovery rate q = {q:g} over all {m} tests of the table"
)


def _fail(msg: str) -> None:
    raise ValueError(f"{FN}: {msg}")


def _name(run) -> str:
    return str(run.path) if run.path is not None else "an in-memory run"


def quantities(a, b) -> list[str]:
    """The quantities both runs have, in table order (heat_rel, the drift, r_eq)."""
    if a.drift_column != b.drift_column:
        _fail(
            f"run A's drift is {a.drift_column} and run B's {b.drift_column} (one is an AdamW run): "
            "compare runs with the same optimizer branch"
        )
    names = set(a.column_names) & set(b.column_names)
    return [q for q in ("heat_rel", a.drift_column, "r_eq") if q in names]


def check_same_inputs(a, b) -> None:
    """Refuse two runs whose probe items differ, in one line naming what differs (the row-by-row
    token check runs while the rows are read)."""
    ma, mb = a.metadata, b.metadata
    out_a = ma.get("output", "tokens")
    out_b = mb.get("output", "tokens")
    if out_a != out_b:
        _fail(f"run A has {out_a} rows and run B {out_b} rows: compare needs two runs of the same kind")
    if ma.get("n_items") != mb.get("n_items"):
        _fail(
            f"the runs probe different inputs: {ma.get('n_items')} probe items in A ({_name(a)}), "
            f"{mb.get('n_items')} in B ({_name(b)})"
        )
    fa = (ma.get("input_fingerprints") or {}).get("probes")
    fb = (mb.get("input_fingerprints") or {}).get("probes")
    if fa and fb and fa != fb:
        _fail(
            f"the runs probe different inputs (input_fingerprints.probes {fa} in A, {fb} in B): "
            "compare needs two runs over the same probe items"
        )
    if len(a) != len(b):
        _fail(f"the runs have different rows ({len(a):,} in A, {len(b):,} in B) for the same probe items")


def _aligned(a, b, columns_a: list[str], columns_b: list[str]) -> Iterator[tuple[pa.Table, pa.Table]]:
    """The two runs' rows side by side, in equal-length slices (their batches need not line up)."""
    ia, ib = a.iter_batches(columns=columns_a), b.iter_batches(columns=columns_b)
    left = right = None
    while True:
        if left is None or left.num_rows == 0:
            left = next((pa.Table.from_batches([x]) for x in ia), None)
        if right is None or right.num_rows == 0:
            right = next((pa.Table.from_batches([x]) for x in ib), None)
        if left is None or right is None:
            return
        n = min(left.num_rows, right.num_rows)
        yield left.slice(0, n), right.slice(0, n)
        left, right = left.slice(n), right.slice(n)


def _col(t: pa.Table, name: str) -> np.ndarray:
    return t.column(name).to_numpy(zero_copy_only=False)


def _check_rows(ta: pa.Table, tb: pa.Table, start: int, token: bool) -> None:
    for name in ("item", "position") + (("token_id",) if token else ()):
        x, y = _col(ta, name), _col(tb, name)
        bad = np.flatnonzero(x != y)
        if bad.size:
            i = int(bad[0])
            what = (
                f"token {ta.column('token')[i].as_py()!r} (id {x[i]}) in A, {tb.column('token')[i].as_py()!r} "
                f"(id {y[i]}) in B"
                if name == "token_id"
                else f"{name} {x[i]} in A, {y[i]} in B"
            )
            _fail(
                f"the runs' inputs differ at row {start + i:,} (item {_col(ta, 'item')[i]}, position "
                f"{_col(ta, 'position')[i]}): {what}; compare needs two runs over the same inputs, tokenized alike"
            )


class _Sums:
    """Per type: row counts and, per run and quantity, the sums of values, of row errors, of replicates."""

    def __init__(self) -> None:
        self.index: dict[Any, int] = {}
        self.labels: list[str] = []
        self.sums: dict[str, np.ndarray] = {}

    def slots(self, keys: np.ndarray, labels: list[Any]) -> tuple[np.ndarray, int]:
        uniq, first, inv = np.unique(keys, return_index=True, return_inverse=True)
        slot = np.empty(len(uniq), np.int64)
        for k, (key, at) in enumerate(zip(uniq.tolist(), first.tolist())):
            if key not in self.index:
                self.index[key] = len(self.labels)
                self.labels.append(str(labels[at]))
            slot[k] = self.index[key]
        n = len(self.labels)
        for name, v in self.sums.items():
            if len(v) < n:
                self.sums[name] = np.concatenate([v, np.zeros(n - len(v))])
        return slot[inv], n

    def add(self, name: str, slot: np.ndarray, n: int, weights: np.ndarray) -> None:
        if name not in self.sums:
            self.sums[name] = np.zeros(n)
        np.add.at(self.sums[name], slot, weights)

    def get(self, name: str) -> np.ndarray:
        return self.sums.get(name, np.zeros(len(self.labels)))[: len(self.labels)]


def _row_values(t: pa.Table, q: str, run) -> tuple[np.ndarray, np.ndarray]:
    """A run's values of ``q`` on these rows (NaN where not usable) and their standard errors."""
    from normfast.engine.estimators.uncertainty import t_quantile

    valid = _col(t, "valid").astype(bool)
    v = np.where(valid, _col(t, q).astype(float), np.nan)
    if q == "r_eq":
        k = run.metadata.get("groups")
        t95 = t_quantile(int(k) - 1) if k else math.nan
        se = (_col(t, "r_eq_hi").astype(float) - v) / t95 if "r_eq_hi" in t.column_names else np.full(len(v), np.nan)
    else:
        name = f"se_{q}"
        se = _col(t, name).astype(float) if name in t.column_names else np.full(len(v), np.nan)
    return v, se


def _replicates(t: pa.Table, run) -> np.ndarray | None:
    """``[rows, K]``: each row's relative heat without each batch group (None without error bars)."""
    from normfast.engine.diagnostics.relative_heat import heat_replicates

    levels = heat_replicates(run.metadata)
    if not levels or "heat_loo" not in t.column_names:
        return None
    loo = t.column("heat_loo").combine_chunks()
    flat = np.asarray(loo.flatten().to_numpy(zero_copy_only=False), dtype=float)
    if flat.size != t.num_rows * len(levels):
        _fail(f"{_name(run)}: heat_loo holds {flat.size} values for {t.num_rows} rows x K={len(levels)} groups")
    with np.errstate(invalid="ignore", divide="ignore"):
        logs = np.where(flat > 0, np.log(np.where(flat > 0, flat, 1.0)), np.nan).reshape(t.num_rows, len(levels))
    return logs - np.asarray(levels)[None, :]


def _columns(run, qs: list[str], pooled: bool) -> list[str]:
    names = set(run.column_names)
    want = ["item", "position", "valid", "token_id", "token", "is_special", "primary", "id"] + qs
    want += [f"se_{q}" for q in qs] + ["r_eq_hi", "heat_loo"]
    if pooled:
        want.remove("token_id")
    return [c for c in dict.fromkeys(want) if c in names]


def benjamini_hochberg(p: np.ndarray, q: float) -> np.ndarray:
    """Which of the p-values the Benjamini-Hochberg procedure rejects at false-discovery rate ``q``
    (NaN: not a test, never rejected)."""
    p = np.asarray(p, dtype=float)
    out = np.zeros(p.shape, bool)
    ok = np.flatnonzero(np.isfinite(p))
    m = ok.size
    if m == 0:
        return out
    order = ok[np.argsort(p[ok], kind="stable")]
    passed = np.flatnonzero(p[order] <= q * np.arange(1, m + 1) / m)
    if passed.size:
        out[order[: passed[-1] + 1]] = True
    return out


def compare(a, b, *, q: float = DEFAULT_Q, min_count: int = 1) -> pa.Table:
    """The per-type comparison of two runs over the same inputs (see the module docstring).

    Args:
        a, b: the two runs (:class:`~normfast.engine.result.ProbeResult`); differences are ``B − A``.
        q: the false-discovery rate of the Benjamini-Hochberg flags.
        min_count: keep types with at least this many valid occurrences in each run.

    Returns:
        A ``pyarrow.Table``, one row per type, the most significant change first: ``token_id`` and
        ``token`` (pooled runs: ``item`` and ``id``), ``occurrences``, ``count_a``, ``count_b``, and
        per quantity ``x``: ``x_a``, ``x_se_a``, ``x_b``, ``x_se_b``, ``x_diff``, ``x_se``, ``x_z``,
        ``x_p``, ``x_changed``; then ``changed`` (any quantity flagged). Its schema metadata
        (``normfast``) holds the comparison: the runs, what differs between their settings, the test.
    """
    import json

    from scipy.special import ndtr

    from normfast.data.schema import METADATA_KEY
    from normfast.engine.estimators.uncertainty import jackknife_se

    if not (isinstance(q, float) or isinstance(q, int)) or isinstance(q, bool) or not 0 < q < 1:
        _fail(f"expected q (the false-discovery rate) in (0, 1), got {q!r}")
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
        _fail(f"expected min_count to be a positive int, got {min_count!r}")
    check_same_inputs(a, b)
    qs = quantities(a, b)
    pooled = a.metadata.get("output") == "pooled"
    key, label = ("item", "id") if pooled else ("token_id", "token")
    sums, start = _Sums(), 0
    for ta, tb in _aligned(a, b, _columns(a, qs, pooled), _columns(b, qs, pooled)):
        _check_rows(ta, tb, start, token=not pooled)
        start += ta.num_rows
        keep = np.ones(ta.num_rows, bool) if pooled else _col(ta, "position") >= 0
        if "is_special" in ta.column_names:
            keep &= ~_col(ta, "is_special").astype(bool)
        if "primary" in ta.column_names:
            keep &= _col(ta, "primary").astype(bool)
        rows = np.flatnonzero(keep)
        if rows.size == 0:
            continue
        ta, tb = ta.take(pa.array(rows)), tb.take(pa.array(rows))
        labels = ta.column(label).to_pylist() if label in ta.column_names else _col(ta, key).tolist()
        slot, n = sums.slots(_col(ta, key), labels)
        sums.add("occurrences", slot, n, np.ones(len(slot)))
        for side, t, run in (("a", ta, a), ("b", tb, b)):
            sums.add(f"count_{side}", slot, n, _col(t, "valid").astype(float))
            for x in qs:
                v, se = _row_values(t, x, run)
                ok = np.isfinite(v)
                sums.add(f"{x}_n_{side}", slot, n, ok.astype(float))
                sums.add(f"{x}_sum_{side}", slot, n, np.where(ok, v, 0.0))
                has = ok & np.isfinite(se)
                sums.add(f"{x}_se_n_{side}", slot, n, has.astype(float))
                sums.add(f"{x}_se_sum_{side}", slot, n, np.where(has, se, 0.0))
            reps = _replicates(t, run) if "heat_rel" in qs else None
            if reps is not None:
                for g in range(reps.shape[1]):
                    ok = np.isfinite(reps[:, g]) & _col(t, "valid").astype(bool)
                    sums.add(f"rep{g}_n_{side}", slot, n, ok.astype(float))
                    sums.add(f"rep{g}_sum_{side}", slot, n, np.where(ok, reps[:, g], 0.0))
    n_types = len(sums.labels)
    keys = list(sums.index)
    count = {s: sums.get(f"count_{s}") for s in "ab"}
    keep = np.flatnonzero(np.minimum(count["a"], count["b"]) >= min_count)
    cols: dict[str, Any] = {
        key: np.asarray(keys, dtype=np.int64) if n_types else np.zeros(0, np.int64),
        label: np.asarray(sums.labels, dtype=object),
        "occurrences": sums.get("occurrences").astype(np.int64),
        "count_a": count["a"].astype(np.int64),
        "count_b": count["b"].astype(np.int64),
    }
    with np.errstate(invalid="ignore", divide="ignore"):
        for x in qs:
            for s in "ab":
                cols[f"{x}_{s}"] = sums.get(f"{x}_sum_{s}") / sums.get(f"{x}_n_{s}")
                se = sums.get(f"{x}_se_sum_{s}") / sums.get(f"{x}_se_n_{s}")
                k = sum(1 for name in sums.sums if name.startswith("rep") and name.endswith(f"_n_{s}"))
                if x == "heat_rel" and k >= 2:
                    reps = np.stack([sums.get(f"rep{g}_sum_{s}") / sums.get(f"rep{g}_n_{s}") for g in range(k)], 1)
                    se = jackknife_se(reps)
                cols[f"{x}_se_{s}"] = se
            cols[f"{x}_diff"] = cols[f"{x}_b"] - cols[f"{x}_a"]
            cols[f"{x}_se"] = np.sqrt(np.square(cols[f"{x}_se_a"]) + np.square(cols[f"{x}_se_b"]))
            z = np.where(cols[f"{x}_se"] > 0, cols[f"{x}_diff"] / cols[f"{x}_se"], np.nan)
            cols[f"{x}_z"] = z
            cols[f"{x}_p"] = 2 * ndtr(-np.abs(z))
    cols = {k: np.asarray(v)[keep] for k, v in cols.items()}
    p = np.stack([cols[f"{x}_p"] for x in qs], 1) if qs else np.zeros((len(keep), 0))
    flags = benjamini_hochberg(p.ravel(), q).reshape(p.shape)
    for j, x in enumerate(qs):
        cols[f"{x}_changed"] = flags[:, j]
    cols["changed"] = flags.any(1) if qs else np.zeros(len(keep), bool)
    with np.errstate(invalid="ignore"):
        best = np.where(np.isfinite(p), p, 2.0).min(1) if qs else np.zeros(len(keep))
    order = np.lexsort((-cols["occurrences"], best))
    ordered = {}
    for k, v in cols.items():
        v = v[order]
        ordered[k] = pa.array(v.tolist(), pa.string()) if k == label else v
    m = int(np.isfinite(p).sum())
    info = {
        "a": _name(a),
        "b": _name(b),
        "model_a": a.metadata.get("model"),
        "model_b": b.metadata.get("model"),
        "differs": settings_change(a, b),
        "quantities": qs,
        "by": key,
        "q": q,
        "tests": m,
        "flagged": int(flags.sum()),
        "types": int(len(keep)),
        "min_count": min_count,
        "test": TEST.format(q=q, m=m),
    }
    table = pa.table(ordered)
    return table.replace_schema_metadata({METADATA_KEY: json.dumps({"comparison": info}, default=str).encode()})


def settings_change(a, b) -> str:
    """What differs between the two runs' settings, in words ("nothing" when they are the same)."""
    from normfast.data.io import describe_spec_change

    def spec(meta: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in meta.items() if k not in RUNTIME_KEYS}

    sa, sb = spec(a.metadata), spec(b.metadata)
    return "nothing: the same settings" if sa == sb else describe_spec_change(sa, sb)


def comparison_info(table: pa.Table) -> dict[str, Any]:
    """The comparison's description from a table written by :func:`compare`."""
    import json

    from normfast.data.schema import METADATA_KEY

    return json.loads((table.schema.metadata or {})[METADATA_KEY])["comparison"]


def write_comparison(table: pa.Table, path: str | Path) -> Path:
    """Write the table as Parquet (``.parquet``, its metadata kept) or CSV (``.csv``), atomically."""
    from normfast.engine.report.aggregate import write_table

    return write_table(table, path)
