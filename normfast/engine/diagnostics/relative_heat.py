"""The heat split into its two parts: a run-level common level and each row's relative heat.

The batch sample moves every row's heat by nearly the same factor (a run that
drew noisier batches is hotter everywhere), so ``se_V2`` -- the error of the
heat itself -- is mostly the error of that common factor, and says little about
how well the run *ranks* its rows. This module separates the two:

* the **reference level** ``ref = median over rows of log V2`` (valid rows that
  are not special tokens, with a finite positive heat), reported once per run
  with its standard error ``se_log_level`` (metadata ``heat_reference``). Its
  rows are the run's own (``source: "run"``, what ``normfast.probe`` does), or,
  for a :class:`~normfast.engine.prober.Prober`, those of a fixed set of the pair
  source's items probed once with the kept directions (``source: "pairs"``), so
  that a row's relative heat does not depend on the other items of its call;
* each row's **relative heat** ``heat_rel = log V2 − ref`` (column
  ``heat_rel``), with its standard error ``se_heat_rel``.

Both errors come from the delete-a-group jackknife the engine already uses
(:mod:`normfast.engine.estimators.uncertainty`): the leave-one-group-out heats of every
row (column ``heat_loo``) give, for each group ``g``, the reference
recomputed without it, ``ref_{−g} = median log V2_{−g}``, and the row's
relative heat without it, ``log V2_{i,−g} − ref_{−g}``; the jackknife of those
K values is the standard error. A factor common to every row cancels in the
difference, so ``se_heat_rel`` is the error of the ranking, and
``se_log_level`` the error of the level.

The heat is ``V2``, or ``V2_w`` for runs with the w branch only
(:attr:`ProbeResult.heat_column`). ``heat_rel`` is in log units (natural
log): 0.2 is a factor e^0.2 ≈ 1.22 above the run's typical row.

The reference needs every row, so it is computed once all chunks are written
(:func:`heat_reference`, reading only :func:`heat_inputs`) and the two per-row
columns are added when the chunks are joined into the output
(:func:`with_relative_heat`).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from normfast.engine.estimators.uncertainty import jackknife_se

#: the per-row columns this module adds to a finished table
ADDED = ("heat_rel", "se_heat_rel")


def heat_name(names: Iterable[str]) -> str:
    """The heat column of a table with these column names (``V2``; ``V2_w`` for a w-only run)."""
    return "V2" if "V2" in set(names) else "V2_w"


def heat_inputs(names: Iterable[str]) -> list[str]:
    """The columns of a run's chunks (with these column ``names``) that :func:`heat_reference` reads."""
    names = list(names)
    return ["valid", "is_special", heat_name(names)] + (["heat_loo"] if "heat_loo" in names else [])


def _log(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(np.isfinite(x) & (x > 0), np.log(np.where(x > 0, x, 1.0)), np.nan)


def _loo_matrix(column: Any, n: int) -> np.ndarray | None:
    """``[N, K]`` from a list column of leave-one-group-out values (None when the column is absent)."""
    if column is None:
        return None
    flat = pa.chunked_array(column).combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(flat) == 0:
        return np.zeros((0, 0))
    values = np.asarray(flat.flatten().to_numpy(zero_copy_only=False), dtype=float)
    return values.reshape(n, -1)


def reference_rows(valid: np.ndarray, special: np.ndarray, log_heat: np.ndarray) -> np.ndarray:
    """The rows the reference level is the median over: valid, not special, finite positive heat."""
    return np.asarray(valid, bool) & ~np.asarray(special, bool) & np.isfinite(log_heat)


def heat_reference(tables: Iterable[pa.Table], pool_se: float = 0.0) -> dict[str, Any]:
    """The run's reference level of ``log V2`` and its jackknife over the K groups.

    ``tables`` are the run's chunks (each with ``valid``, ``is_special``, the heat
    and, with error bars, ``heat_loo``); ``pool_se``: the error of the level that
    the batch groups cannot see, the heat's pool's own (log units; the run's
    ``heat_sampling.pool_level_se``, 0 for the plain draw). Returns a JSON-ready
    dict: ``source`` (``"run"``: the rows given are the run's own), ``column``
    (the heat), ``rows`` (how many the median is over), ``log_level`` (``ref``),
    ``level`` (``exp(ref)``), ``se_log_level`` (the common factor's standard
    error, log units: the groups' jackknife ``se_log_level_groups`` and
    ``pool_se`` in quadrature; NaN without error bars), ``loo_log_levels`` (the
    K ``ref_{−g}``; empty without error bars).
    """
    logs, loos, column = [], [], None
    for t in tables:
        column = column or heat_name(t.column_names)
        n = t.num_rows
        lh = _log(t.column(column).to_numpy(zero_copy_only=False))
        used = reference_rows(
            t.column("valid").to_numpy(zero_copy_only=False), t.column("is_special").to_numpy(zero_copy_only=False), lh
        )
        logs.append(lh[used])
        loo = _loo_matrix(t.column("heat_loo") if "heat_loo" in t.column_names else None, n)
        loos.append(None if loo is None else _log(loo[used]))
    out: dict[str, Any] = {
        "source": "run",
        "column": column or "V2",
        "rows": 0,
        "log_level": math.nan,
        "level": math.nan,
        "se_log_level": math.nan,
        "loo_log_levels": [],
    }
    every = np.concatenate(logs) if logs else np.zeros(0)
    out["rows"] = int(every.size)
    if every.size == 0:
        return out
    ref = float(np.median(every))
    out["log_level"], out["level"] = ref, math.exp(ref)
    if loos and all(x is not None for x in loos):
        loo = np.concatenate(loos)
        if loo.size and loo.shape[1] >= 2:
            with np.errstate(all="ignore"):
                ref_g = np.array(
                    [np.nanmedian(loo[:, g]) if np.isfinite(loo[:, g]).any() else np.nan for g in range(loo.shape[1])]
                )
            out["loo_log_levels"] = [float(v) for v in ref_g]
            groups_se = float(jackknife_se(ref_g))
            out["se_log_level_groups"] = groups_se
            out["se_log_level_pool"] = float(pool_se)
            out["se_log_level"] = math.hypot(groups_se, float(pool_se))
    return out


def pool_se_of(metadata: Mapping[str, Any]) -> float:
    """The heat's pool's own level error recorded in a run's metadata (0 for the plain draw)."""
    return float((metadata.get("heat_sampling") or {}).get("pool_level_se", 0.0) or 0.0)


def relative_heat(
    heat: np.ndarray, heat_loo: np.ndarray | None, reference: Mapping[str, Any]
) -> tuple[np.ndarray, np.ndarray]:
    """``heat_rel`` and ``se_heat_rel`` of rows with heats ``heat`` ``[N]`` and leave-one-group-out
    heats ``heat_loo`` ``[N, K]`` (None: no error bars) against ``reference`` (:func:`heat_reference`)."""
    rel = _log(heat) - float(reference["log_level"])
    se = np.full(rel.shape, np.nan)
    ref_g = np.asarray(reference.get("loo_log_levels") or [], dtype=float)
    if heat_loo is not None and heat_loo.size and ref_g.size == heat_loo.shape[1]:
        se = jackknife_se(_log(heat_loo) - ref_g[None, :])
    return rel, se


def with_relative_heat(table: pa.Table, reference: Mapping[str, Any]) -> pa.Table:
    """``table`` (a finished chunk) with the ``heat_rel`` and ``se_heat_rel`` columns added, every
    column in the registered order (:data:`normfast.data.schema.COLUMN_NAMES`)."""
    from normfast.data.schema import COLUMN_NAMES

    column = heat_name(table.column_names)
    loo = _loo_matrix(table.column("heat_loo") if "heat_loo" in table.column_names else None, table.num_rows)
    rel, se = relative_heat(table.column(column).to_numpy(zero_copy_only=False), loo, reference)
    table = table.drop_columns([c for c in ADDED if c in table.column_names])
    table = table.append_column("heat_rel", pa.array(rel, pa.float64()))
    table = table.append_column("se_heat_rel", pa.array(se, pa.float64()))
    order = [c for c in COLUMN_NAMES if c in table.column_names]
    order += [c for c in table.column_names if c not in order]
    return table.select(order)


#: The quoted resolution of the ranking: the 95% half-width of heat_rel within this (log units, about ±20%).
RESOLUTION_RANK = 0.2


def ranking_resolution(se_heat_rel: np.ndarray, reference: Mapping[str, Any], groups: int | None) -> dict[str, Any]:
    """The summary's figures: the share of rows whose relative heat has a 95% half-width within
    ±``RESOLUTION_RANK`` (log units), and the common level's 95% half-width as a percentage."""
    from normfast.engine.estimators.uncertainty import t_quantile

    out = {"rank_resolved_fraction": math.nan, "rank_se_median": math.nan, "level_half_width": math.nan}
    se = np.asarray(se_heat_rel, dtype=float)
    if not groups or se.size == 0 or not np.isfinite(se).any():
        return out
    t = t_quantile(int(groups) - 1)
    with np.errstate(invalid="ignore"):
        out["rank_resolved_fraction"] = float(np.mean(t * se <= RESOLUTION_RANK))
    out["rank_se_median"] = float(np.nanmedian(se))
    level_se = float(reference.get("se_log_level", math.nan)) if reference else math.nan
    if math.isfinite(level_se):
        out["level_half_width"] = math.expm1(t * level_se)
    return out


# ---------------------------------------------------------------------------
# normfast aggregate: a type's mean relative heat in each jackknife replicate, and its error bar


def heat_replicates(metadata: dict[str, Any]) -> list[float]:
    """The run's reference level without each group (empty: the run has no error bars)."""
    reference = metadata.get("heat_reference") or {}
    levels = reference.get("loo_log_levels") or []
    return [float(v) for v in levels] if len(levels) >= 2 else []


def replicate_name(g: int) -> str:
    return f"_heat_rel_g{g}"


def with_replicates(batch: pa.RecordBatch, levels: Sequence[float]) -> pa.RecordBatch:
    """The batch with one column per group: the row's relative heat without that group,
    ``log heat_loo[g] − ref_{−g}`` (averaged per type like any quantity)."""
    n, k = batch.num_rows, len(levels)
    loo = batch.column(batch.schema.get_field_index("heat_loo"))
    flat = np.asarray(pc.list_flatten(loo).to_numpy(zero_copy_only=False), dtype=float)
    lengths = pc.list_value_length(loo).to_numpy(zero_copy_only=False)
    if flat.size != n * k or (n and not np.all(lengths == k)):
        raise ValueError(
            f"aggregate: expected heat_loo to hold K={k} values per row (the run's "
            f"heat_reference.loo_log_levels), got lengths {sorted(set(lengths.tolist()))}"
        )
    with np.errstate(invalid="ignore", divide="ignore"):
        values = np.where(flat > 0, np.log(np.where(flat > 0, flat, 1.0)), np.nan).reshape(n, k)
    values = values - np.asarray(levels)[None, :]
    arrays = list(batch.columns) + [pa.array(values[:, g]) for g in range(k)]
    return pa.RecordBatch.from_arrays(arrays, names=list(batch.schema.names) + [replicate_name(g) for g in range(k)])


def batch_error_bar(table: pa.Table, k: int) -> pa.Table:
    """``heat_rel_se_batches`` (the jackknife over the K replicates of each type's mean) in place of the
    replicate columns, right after the other ``heat_rel`` columns."""
    means = np.stack([table.column(f"{replicate_name(g)}_mean").to_numpy(zero_copy_only=False) for g in range(k)], 1)
    se = jackknife_se(means)
    table = table.drop_columns([replicate_name(g) + s for g in range(k) for s in ("_mean", "_std", "_se", "_n")])
    at = table.column_names.index("heat_rel_n") + 1
    return table.add_column(at, "heat_rel_se_batches", pa.array(se, pa.float64()))
