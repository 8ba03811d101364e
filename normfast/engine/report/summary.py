"""Summaries of a probe run (``ProbeResult.summary()``, ``format_summary()``); its figures: :mod:`.figures`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from normfast.core.stats import loglog_fit, quantiles, spearman
from normfast.engine.diagnostics.health import health_line
from normfast.engine.diagnostics.regime import PREDICTIVE, classify_rows, fit_context, headline, run_regime
from normfast.engine.diagnostics.relative_heat import RESOLUTION_RANK, ranking_resolution
from normfast.engine.report.aggregate import SPECIAL_TOKENS
from normfast.engine.report.ranking import run_ranking


def _is_special(result) -> np.ndarray:
    """Rows of tokens the tokenizer added (the ``is_special`` column; by token text for older runs)."""
    names = result.column_names
    if "is_special" in names:
        return result.column("is_special").astype(bool)
    if "token" not in names:
        return np.zeros(len(result), bool)
    tokens = result.column("token")
    pos = result.column("position")
    return np.array([(p >= 0 and t in SPECIAL_TOKENS) for t, p in zip(tokens, pos)], dtype=bool)


def result_regime(result) -> dict[str, Any] | None:
    """The run's regime check: from the metadata, else recomputed from the rows.

    Runs written before the check existed lack ``kappa_exempt``: they are
    classified with it taken as 0 (the exempt-parameter test cannot fire), and
    the result says so under ``"exempt_check"``. None when even that is impossible.
    """
    regime = result.metadata.get("regime")
    if isinstance(regime, dict) and "regime" in regime:
        return regime
    names = result.column_names
    if "kappa" not in names or not ({"D", "D_w"} & set(names)):
        return None
    meta = result.metadata
    cols = {k: result.column(k) for k in ("valid", "kappa", "D", "se_D", "Q", "D_w", "se_D_w", "Q_w") if k in names}
    n = len(cols["valid"])
    cols["kappa_exempt"] = result.column("kappa_exempt") if "kappa_exempt" in names else np.zeros(n)
    rows = classify_rows(
        cols,
        lr=float(meta.get("lr") or 0.0),
        weight_decay=float(meta.get("weight_decay") or 0.0),
        momentum=float(meta.get("momentum") or 0.0),
    )
    out = run_regime([{**cols, **rows}])
    if "kappa_exempt" not in names:
        out["exempt_check"] = "not available (run written before the regime check)"
    return out


def used_rows(result) -> np.ndarray:
    """The rows summaries and figures describe: valid, and not a special token."""
    return result.column("valid").astype(bool) & ~_is_special(result)


def applicable_rows(result) -> np.ndarray:
    """Used rows whose regime lets the law predict (law applicable or heat-dominated)."""
    used = used_rows(result)
    if "regime" not in result.column_names:
        return used
    return used & np.isin(result.column("regime").astype(str), PREDICTIVE)


def summarize(result) -> dict[str, Any]:
    """Headline figures of a run (see :func:`format_summary` for the printed form).

    The fits of the observed norm against ``r_eq`` / ``r_eq_heat`` use the rows
    where the regime check lets the law predict (``fit_rows`` of them).
    Special-token rows (``is_special``) are counted but left out of every statistic.
    """
    special = _is_special(result)
    valid = result.column("valid").astype(bool) & ~special
    reasons: dict[str, int] = {}
    for r in result.column("reason"):
        reasons[r] = reasons.get(r, 0) + 1
    heat, drift = result.heat_column, result.drift_column
    norm = result.column("norm")
    out: dict[str, Any] = {
        "rows": len(result),
        "valid": int(result.column("valid").astype(bool).sum()),
        "special_rows": int(special.sum()),
        "reasons": reasons,
        "truncated_inputs": _truncated_inputs(result),
    }
    for col in ("norm", drift, heat, "kappa", "r_eq", "r_eq_heat"):
        out[col] = quantiles(result.column(col)[valid])
    D = result.column(drift)[valid]
    se_name = "se_D" if drift == "D" else "se_D_w"
    se = result.column(se_name)[valid]
    ss = result.column("sign_stability" if drift == "D" else "sign_stability_w")[valid]
    with np.errstate(invalid="ignore", divide="ignore"):
        out["drift_significant_fraction"] = float(np.mean(np.abs(D) > 2 * se)) if np.isfinite(se).any() else math.nan
    out["sign_stability_mean"] = float(np.nanmean(ss)) if np.isfinite(ss).any() else math.nan
    out["bistable_fraction"] = float(np.mean(result.column("n_pos_roots")[valid] > 1)) if valid.any() else math.nan
    out.update(_resolution(result, valid, heat))
    out.update(_ranking(result, valid))
    # numerical conditions, counted here instead of warned chunk by chunk
    kappa = result.column("kappa")
    r_eq = result.column("r_eq")
    described = ~special & np.isfinite(kappa)
    with np.errstate(invalid="ignore"):
        nonpos = described & (kappa <= 0)
    n_described = int(described.sum())
    out["kappa_rows"] = n_described
    out["kappa_nonpositive_rows"] = int(nonpos.sum())
    out["kappa_nonpositive_no_root_rows"] = int((nonpos & ~np.isfinite(r_eq)).sum())
    out["kappa_nonpositive_fraction"] = float(nonpos.sum() / n_described) if n_described else math.nan
    fit = applicable_rows(result)
    out["fit_rows"] = int(fit.sum())
    out["norm_vs_r_eq"] = loglog_fit(r_eq[fit], norm[fit])
    out["norm_vs_r_eq_heat"] = loglog_fit(result.column("r_eq_heat")[fit], norm[fit])
    if "r_eq_snapshot" in result.column_names:
        snap = result.column("r_eq_snapshot")
        out["r_eq_snapshot"] = quantiles(snap[valid])
        out["norm_vs_r_eq_snapshot"] = loglog_fit(snap[fit], norm[fit])
        if "r_eq_snapshot_lo" in result.column_names:
            out["r_eq_snapshot_halfwidth"] = _log_halfwidth(result, "r_eq_snapshot", valid)
        if "norm_continued" in result.column_names:
            cont = result.column("norm_continued")
            out["norm_continued"] = quantiles(cont[valid])
            out["r_eq_snapshot_vs_norm_continued"] = loglog_fit(snap[valid], cont[valid])
            if "norm_continued_lo" in result.column_names:
                out["norm_continued_halfwidth"] = _log_halfwidth(result, "norm_continued", valid)
    out["regime"] = result_regime(result)
    out["spearman_norm_heat"] = spearman(norm[valid], result.column(heat)[valid])
    return out


def _log_halfwidth(result, column: str, rows: np.ndarray) -> float:
    """Median relative half-width of a column's 95% interval, ``exp((log hi − log lo)/2) − 1``."""
    lo, hi = result.column(f"{column}_lo")[rows], result.column(f"{column}_hi")[rows]
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.expm1((np.log(hi) - np.log(lo)) / 2)
    w = w[np.isfinite(w)]
    return float(np.median(w)) if w.size else math.nan


def _truncated_inputs(result) -> int:
    """How many inputs were cut at the model's maximum length (0 for runs written before it was counted)."""
    if "n_truncated" not in result.column_names:
        return 0
    cut = result.column("n_truncated") > 0
    return int(np.unique(result.column("item")[cut]).size)


#: The resolutions quoted by format_summary: the 95% half-width within this fraction of the value.
RESOLUTION_HEAT, RESOLUTION_REQ = 0.2, 0.1


def _resolution(result, valid: np.ndarray, heat: str) -> dict[str, Any]:
    """How many rows are resolved: 95% half-width of V2 within ±20%, of R_eq within ±10%; median se(V2)/V2."""
    from normfast.engine.estimators.uncertainty import t_quantile

    names = result.column_names
    se_name = "se_" + heat
    out: dict[str, Any] = {
        "heat_resolved_fraction": math.nan,
        "r_eq_resolved_fraction": math.nan,
        "heat_rse_median": math.nan,
        "error_bar_dof": None,
    }
    k = result.metadata.get("groups")
    if se_name not in names or not k or not valid.any():
        return out
    se, v2 = result.column(se_name)[valid], result.column(heat)[valid]
    if not np.isfinite(se).any():
        return out
    t = t_quantile(int(k) - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        rse = se / v2
        out["heat_resolved_fraction"] = float(np.mean(t * rse <= RESOLUTION_HEAT))
        out["heat_rse_median"] = float(np.nanmedian(rse)) if np.isfinite(rse).any() else math.nan  # V2 = 0: no ratio
        if "r_eq_lo" in names:
            r, lo, hi = (result.column(c)[valid] for c in ("r_eq", "r_eq_lo", "r_eq_hi"))
            out["r_eq_resolved_fraction"] = float(np.mean((hi - lo) / 2 <= RESOLUTION_REQ * r))
    out["error_bar_dof"] = int(k) - 1
    return out


def _ranking(result, valid: np.ndarray) -> dict[str, Any]:
    """The heat's two parts (:mod:`normfast.engine.diagnostics.relative_heat`): the share of rows whose relative heat
    is resolved to ±20% (95% interval), the median se of the relative heat, the common level's ±."""
    reference = result.metadata.get("heat_reference") or {}
    if "se_heat_rel" not in result.column_names:  # runs written before the split
        return ranking_resolution(np.zeros(0), reference, None)
    return ranking_resolution(result.column("se_heat_rel")[valid], reference, result.metadata.get("groups"))


def _objective_label(meta: dict[str, Any]) -> str:
    settings = meta.get("objective_settings")
    if not settings:
        t = meta.get("temperature")
        settings = {} if t is None else {"temperature": t}
    inner = ", ".join(f"{k}={v}" for k, v in settings.items())
    return f"{meta.get('objective')}" + (f" ({inner})" if inner else "")


def sampling_line(info: dict[str, Any] | None) -> str | None:
    """How the heat's batches were chosen, in one line (None for a run that predates the setting)."""
    if not info:
        return None
    if info.get("method") == "energy" and "draws" not in info:  # a run that recorded no figures of its draw
        return "heat batches: drawn by gradient energy from the drift batches (the draw's figures are not recorded)"
    if info.get("method") == "energy":
        return (
            f"heat batches: {info['draws']} drawn by gradient energy from the {info['pool']} drift batches "
            f"({info['distinct_batches']} distinct), weighted back; the pool's own level error "
            f"±{math.expm1(1.96 * info['pool_level_se']):.0%} (95%) is in the common level and every interval"
        )
    why = f" ({info['note']})" if info.get("note") else ""
    return f"heat batches: the first M of the virtual batches, unweighted (the plain draw){why}"


def run_line(meta: dict[str, Any]) -> str:
    """The first line of a summary: model, objective, preset, M (M_D, K), mode and output."""
    return (
        f"probe run: {meta.get('model')} | objective {_objective_label(meta)} | {meta.get('optimizer')} "
        f"lr={meta.get('lr')} wd={meta.get('weight_decay')} | M={meta.get('M')} x {meta.get('batch_size')} "
        + (f"(drift: M_D={meta['M_D']}, K={meta.get('groups')}) " if meta.get("M_D") else "")
        + f"| mode {meta.get('mode')} | {meta.get('output')}"
    )


def opening_lines(meta: dict[str, Any], regime: dict[str, Any] | None) -> list[str]:
    """The lines that open a run's summary and its page: the run, the regime check's headline (indented
    as the text shows it), the virtual objective's health and the encoder's note."""
    lines = [run_line(meta)]
    if regime is None or "regime" not in regime:
        lines.append("regime: not checked (the run lacks the columns the check needs)")
    else:
        lines += headline(regime)
    health = health_line(meta.get("objective_health"))
    if health is not None:
        lines.append(health)
    if meta.get("encoder_note"):
        lines.append(f"encoder: {meta['encoder_note']}")
    return lines


def format_summary(result, top: int = 8) -> str:
    s = summarize(result)
    meta = result.metadata
    heat, drift = result.heat_column, result.drift_column
    regime = s["regime"]
    lines = opening_lines(meta, regime)
    lines.append(
        f"rows: {s['rows']} ({s['valid']} with valid statistics"
        + "".join(f"; {k}: {v}" for k, v in s["reasons"].items() if k != "ok")
        + ")"
        + (f"; {s['special_rows']} special-token rows ([CLS], [SEP], ...) left out below" if s["special_rows"] else "")
    )
    if s["truncated_inputs"]:
        n = s["truncated_inputs"]
        lines.append(
            f"{n} input{'s' if n != 1 else ''} truncated to the model's maximum length of "
            f"{meta.get('max_length')} tokens (column n_truncated: the tokens cut per input)"
        )
    lines += ["", f"{'quantity':<12}{'p10':>12}{'median':>12}{'p90':>12}"]
    for col in ("norm", drift, heat, "kappa", "r_eq", "r_eq_heat"):
        q = s[col]
        lines.append(f"{col:<12}{q['p10']:>12.4g}{q['median']:>12.4g}{q['p90']:>12.4g}")
    f, fh = s["norm_vs_r_eq"], s["norm_vs_r_eq_heat"]
    lines += [""]
    if s["error_bar_dof"] is not None:
        adaptive = meta.get("adaptive")
        chosen = (
            (
                f"; M = {adaptive['M']} chosen for a {adaptive['target_quantile']:.0%} quantile of se(V2)/V2 "
                f"of {adaptive['quantile_rse']:.3f} (target {adaptive['target_rse']})"
            )
            if adaptive
            else ""
        )
        lines.append(
            f"{heat} resolved to ±{RESOLUTION_HEAT:.0%} (95% interval): {s['heat_resolved_fraction']:.0%} of rows; "
            f"R_eq to ±{RESOLUTION_REQ:.0%}: {s['r_eq_resolved_fraction']:.0%}; median se({heat})/{heat} "
            f"{s['heat_rse_median']:.3f} (K = {s['error_bar_dof'] + 1} batch groups, t with "
            f"{s['error_bar_dof']} dof){chosen}"
        )
        if np.isfinite(s["rank_resolved_fraction"]):
            fixed = (meta.get("heat_reference") or {}).get("source") == "pairs"  # a Prober's: fixed with its directions
            median = "the median of the pair source's items" if fixed else "the run's median"
            lines.append(
                f"heat ranking resolved to ±{RESOLUTION_RANK:.0%} for {s['rank_resolved_fraction']:.0%} of rows "
                f"(relative heat: log {heat} minus {median}); common level ±{s['level_half_width']:.0%} "
                f"(95%; shared by every row, it moves R_eq as {heat}^(1/4) where the heat dominates)"
            )
    sampling = sampling_line(meta.get("heat_sampling"))
    if sampling is not None:
        lines.append(sampling)
    lines += [
        f"drift |D| > 2 se: {s['drift_significant_fraction']:.1%} of rows; mean sign stability "
        f"{s['sign_stability_mean']:.3f}; bistable rows {s['bistable_fraction']:.1%}"
    ]
    n_bad, n_nan = s["kappa_nonpositive_rows"], s["kappa_nonpositive_no_root_rows"]
    if n_bad:
        parts = [f"R_eq is NaN for {n_nan}"] if n_nan else []
        if n_bad - n_nan:
            parts.append(f"an unstable root for {n_bad - n_nan}")
        lines.append(
            f"kappa <= 0 for {n_bad} of {s['kappa_rows']} rows ({s['kappa_nonpositive_fraction']:.1%}): "
            f"no stable equilibrium there ({', '.join(parts)})"
        )
    lines += [
        fit_context(regime if regime and "regime" in regime else None, meta),
        (
            f"observed norm vs R_eq (log-log, the {s['fit_rows']} rows where the law applies): slope "
            f"{f['slope']:.3f}, Pearson r {f['pearson_r']:.3f}  |  heat-only R_eq: slope {fh['slope']:.3f}, "
            f"r {fh['pearson_r']:.3f}"
        )
        if s["fit_rows"] >= 3
        else f"observed norm vs R_eq: no fit (the law applies to {s['fit_rows']} rows)",
        f"Spearman(norm, {heat}) = {s['spearman_norm_heat']:.3f}",
    ]
    if "norm_vs_r_eq_snapshot" in s:
        lines += _snapshot_lines(s, meta.get("snapshot") or {})
    if "token" in result.column_names and result.column("position").max() >= 0:
        lines += _type_lines(result, top)
    return "\n".join(lines)


def _type_lines(result, top: int) -> list[str]:
    """The hottest and coldest tokens, ranked as everywhere else (:mod:`normfast.engine.report.ranking`)."""
    ranked = run_ranking(result)
    if ranked is None:
        return []
    table, ranking = ranked
    examples = {} if result.metadata.get("corpus") else _examples(result, table, ranking, top)

    def label(i: int) -> str:
        text = ranking.label(i)
        example = examples.get(i)
        return f"{text} ({example})" if example and example != ranking.labels[i] else text

    return [
        "",
        f"tokens {ranking.note()}; ×n: occurrences averaged (every type: normfast aggregate RUN)",
        "hottest tokens: " + ", ".join(label(int(i)) for i in ranking.hottest(top)),
        "coldest tokens: " + ", ".join(label(int(i)) for i in ranking.coldest(top)),
    ]


def _examples(result, table, ranking, top: int) -> dict[int, str]:
    """For the listed types seen once in a run of separate inputs: the input they come from (short ones)."""
    if "token_id" not in table.column_names or "text" not in result.column_names:
        return {}
    listed = [int(i) for i in list(ranking.hottest(top)) + list(ranking.coldest(top)) if ranking.counts[i] == 1]
    if not listed:
        return {}
    wanted = {int(table.column("token_id")[i].as_py()): i for i in listed}
    use = used_rows(result)
    ids, texts = result.column("token_id")[use], result.column("text")[use]
    out = {}
    for tid, i in wanted.items():
        hit = np.flatnonzero(ids == tid)
        if hit.size and len(str(texts[hit[0]])) <= 40:
            out[i] = str(texts[hit[0]])
    return out


def _snapshot_lines(s: dict[str, Any], info: dict[str, Any]) -> list[str]:
    """The single-snapshot predictor in words: what it predicts, how far its trajectory went, the fit."""
    q, f = s["r_eq_snapshot"], s["norm_vs_r_eq_snapshot"]
    covered = info.get("relaxations_covered")
    asked = info.get("relaxations_asked")
    span = f"{info.get('steps', '?')} virtual steps"
    if covered is not None and math.isfinite(covered):
        span += f", {covered:.2g} relaxation times"
    lines = [
        "",
        f"single-snapshot predictor r_eq_snapshot ({span}): median {q['median']:.4g} "
        f"(p10 {q['p10']:.4g}, p90 {q['p90']:.4g}) -- the norm each item keeps on average under "
        f"continued training like the virtual one, not a reading of its present norm",
    ]
    if math.isfinite(s.get("r_eq_snapshot_halfwidth", math.nan)):
        lines.append(
            f"  95% interval from the continuation's {info.get('interval_segments', '?')} segments: median "
            f"±{100 * s['r_eq_snapshot_halfwidth']:.2g}% (the continuation's sampling error, not the "
            f"law's; norm_continued ±{100 * s.get('norm_continued_halfwidth', math.nan):.2g}%)"
        )
    if asked is not None and covered is not None and math.isfinite(covered) and covered < asked:
        lines.append(
            f"  the trajectory covered fewer relaxation times than asked ({covered:.2g} < {asked:g}; "
            f"capped at snapshot_max_steps): outside the validated scope, treat it as indicative"
        )
    if info.get("rows_no_root"):
        lines.append(
            f"  no prediction for {info['rows_no_root']} rows (heat + curvature heat < 0 for "
            f"{info.get('rows_heat_negative', 0)}, κ <= 0 for {info.get('rows_kappa_nonpositive', 0)}): "
            f"r_eq_snapshot is NaN there"
        )
    if math.isfinite(f.get("slope", math.nan)):
        lines.append(
            f"  present norm vs r_eq_snapshot (log-log): slope {f['slope']:.3f}, Pearson r "
            f"{f['pearson_r']:.3f} (near 1 when the snapshot already sits at its stationary norms)"
        )
    if "norm_continued" in s:
        c, g = s["norm_continued"], s["r_eq_snapshot_vs_norm_continued"]
        fit = (
            f"; r_eq_snapshot vs it (log-log): slope {g['slope']:.3f}, r {g['pearson_r']:.3f}"
            if math.isfinite(g.get("slope", math.nan))
            else ""
        )
        lines.append(
            f"  norm_continued (the continuation's own mean norm, the plain baseline): median "
            f"{c['median']:.4g}{fit}. The law predicts no better than simulating; what it adds is the "
            f"decomposition of each norm into heat, drift and decay (r_eq_heat, D_snapshot, "
            f"Q_snapshot)"
        )
    return lines


# ----------------------------------------------------------------------------
# CLI: normfast report RUN.parquet
# ----------------------------------------------------------------------------
report_description = """\
Summarize a finished probe run: the regime check (does the equilibrium law
apply here, and why not where it does not), quantiles of norm, drift D, heat V2, kappa and
R_eq; how noisy the drift is (|D| > 2 se, sign stability); the log-log slope and
Pearson r of observed norm against the predicted equilibrium norm (full law and
heat-only law); for token runs the hottest and coldest tokens. Writes PNG
figures next to the run (or to --out)."""
