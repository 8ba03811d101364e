"""A run's page: the data it shows (:func:`page_data`), the HTML (:func:`page_html`), the file
(:func:`write_page`), and the small summary table a notebook shows for a result (:func:`summary_html`).

The page is one HTML file rendered from a jinja2 template with its script, style and data
inline: it needs no network and works opened from ``file://``. Its script is a few hundred
lines of plain JavaScript drawing SVG (no plotting library): the page must stay small and
bounded for runs of any size, and the figures need only points, bars and axes.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from normfast.engine.report.page import collect
from normfast.engine.report.page.frame import InlinePage, data_size, html_path, render_page, rounded, write_html

#: significant digits kept on the page: per-type means (sortable, compared with the Parquet) and the rest
TYPE_DIGITS, ROW_DIGITS, SE_DIGITS = 6, 4, 3
#: characters kept of a token or type label, and of a pooled row's input text
MAX_LABEL, MAX_TEXT = 40, 160
#: the page's data never exceeds this many bytes (UTF-8): the sample and the type tables are cut to fit
MAX_DATA_BYTES = 9_500_000


def _nums(values: Any, digits: int) -> list[float | None]:
    return rounded(values, digits)


def _ints(values: Any) -> list[int]:
    return np.asarray(values).astype(np.int64).tolist()


def _meaning(name: str) -> str:
    from normfast.data.schema import column

    try:
        return column(name).meaning
    except KeyError:
        return ""


def _stat_specs(result, stats: Sequence[str]) -> list[dict[str, Any]]:
    names = set(result.column_names)
    labels = {
        result.heat_column: f"{result.heat_column} (heat)",
        result.drift_column: f"{result.drift_column} (drift)",
        "norm": "norm",
        "r_eq": "r_eq",
        "r_eq_heat": "r_eq_heat",
        "kappa": "κ (kappa)",
        "drift_to_heat": "drift / heat",
        "r_eq_snapshot": "r_eq_snapshot",
    }
    out = []
    for s in stats:
        spec = {
            "key": s,
            "label": labels.get(s, s),
            "kind": "div" if s == result.drift_column else "seq",
            "about": _meaning(s),
        }
        if f"se_{s}" in names:
            spec["se"] = f"se_{s}"
        if f"{s}_lo" in names and f"{s}_hi" in names:
            spec["lo"], spec["hi"] = f"{s}_lo", f"{s}_hi"
        out.append(spec)
    return out


def _header(
    result, scanned: dict[str, Any], shown_docs: int, all_docs: bool, cut: bool, seed: int, notes: str | None
) -> dict[str, Any]:
    from normfast.engine.diagnostics.health import loss_text
    from normfast.engine.diagnostics.regime import fit_context
    from normfast.engine.report.summary import opening_lines, result_regime

    meta = result.metadata
    regime = (
        meta.get("regime")
        if isinstance(meta.get("regime"), dict) and "regime" in meta["regime"]
        else result_regime(result)
    )
    lines = [ln.strip() for ln in opening_lines(meta, regime)]  # the page does not indent
    lines.append(
        f"rows: {scanned['rows']:,} ({scanned['valid']:,} with valid statistics"
        + (
            f"; {scanned['special']:,} special-token rows ([CLS], [SEP], ...) left out of every scale and aggregate"
            if scanned["special"]
            else ""
        )
        + ")"
    )
    reading = fit_context(regime if regime and "regime" in regime else None, meta).strip()
    unit = "documents" if scanned["key"] == "doc_id" else "inputs"
    n_keys = len(scanned["keys"])
    where = "the row table" if meta.get("output") == "pooled" else "the text view and the row table"
    if all_docs and not cut:
        sample = f"All {n_keys:,} {unit} of the run are shown ({where})."
    else:
        sample = (
            f"{where[0].upper() + where[1:]} show {shown_docs:,} of the run's {n_keys:,} {unit}, "
            f"drawn at random (seed {seed})"
            + (", the last one cut at the row limit" if cut else "")
            + (
                "; the heat's distribution covers every row."
                if meta.get("output") == "pooled"
                else "; the type tables and the heat's distribution cover every row."
            )
        )
    facts = [
        ("model", meta.get("model")),
        (
            "objective",
            f"{meta.get('objective')}"
            + (f" (temperature {meta['temperature']})" if meta.get("temperature") is not None else ""),
        ),
        (
            "preset",
            f"{meta.get('optimizer')} lr={meta.get('lr')} wd={meta.get('weight_decay')}"
            + (f" momentum={meta.get('momentum')}" if meta.get("momentum") else ""),
        ),
        ("M (heat batches)", meta.get("M")),
        ("M_D (drift batches)", meta.get("M_D") or "per batch of M"),
        ("K (batch groups)", meta.get("groups")),
        ("batch size", meta.get("batch_size")),
        ("batches drawn from", "{n:,} {what}".format(**meta["pair_source"]) if meta.get("pair_source") else None),
        ("virtual loss", loss_text(meta.get("objective_health"))),
        ("mode", meta.get("mode")),
        ("output", meta.get("output")),
        ("probed", meta.get("params")),
        ("rows", f"{scanned['rows']:,}"),
        ("regime", (regime or {}).get("regime", "not checked")),
        ("file", str(result.path) if result.path is not None else "in memory"),
        ("normfast", (meta.get("versions") or {}).get("normfast")),
        ("device", meta.get("device")),
    ]
    return {
        "lines": lines,
        "reading": reading,
        "sample": sample,
        "notes": notes or "",
        "facts": [(k, "" if v is None else str(v)) for k, v in facts],
        "regime": (regime or {}).get("regime"),
        "reason": (regime or {}).get("reason"),
    }


def _rows_payload(
    rows: pa.Table, specs: list[dict[str, Any]], layout: tuple | None, doc_of_row: np.ndarray
) -> dict[str, Any]:
    """The sampled rows, column by column (``layout``: the text view's token layout; None: pooled)."""
    names = rows.column_names
    n = rows.num_rows
    pooled = layout is None
    out: dict[str, Any] = {"n": n, "doc": _ints(doc_of_row)}
    out["tok"] = [t[:MAX_LABEL] for t in layout[0]] if not pooled else []
    out["gap"] = list(layout[1]) if not pooled else []
    out["special"] = _ints(collect.special_rows(rows))
    out["valid"] = _ints(rows.column("valid").to_numpy(zero_copy_only=False))
    out["pos"] = _ints(rows.column("position").to_numpy(zero_copy_only=False))
    out["item"] = _ints(rows.column("item").to_numpy(zero_copy_only=False))
    if pooled:
        ids = rows.column("id").to_pylist() if "id" in names else out["item"]
        out["id"] = [str(x)[:MAX_LABEL] for x in ids]
        out["text"] = (
            [str(x or "")[:MAX_TEXT] for x in rows.column("text").to_pylist()] if "text" in names else [""] * n
        )
    regimes = rows.column("regime").to_pylist() if "regime" in names else [None] * n
    out["regime"] = [collect.REGIMES.index(r) if r in collect.REGIMES else -1 for r in regimes]
    if "regime_reason" in names:
        reasons = rows.column("regime_reason").to_pylist()
        codes = sorted({r for r in reasons if r})
        out["reasons"] = codes
        out["reason"] = [codes.index(r) if r else -1 for r in reasons]
    values: dict[str, list] = {}
    for spec in specs:
        for k in (spec["key"], spec.get("se"), spec.get("lo"), spec.get("hi")):
            if k and k not in values:
                digits = SE_DIGITS if k.startswith("se_") else ROW_DIGITS
                values[k] = _nums(rows.column(k).to_numpy(zero_copy_only=False), digits)
    for k in ("r_eq_lo", "r_eq_hi"):
        if k in names and k not in values:
            values[k] = _nums(rows.column(k).to_numpy(zero_copy_only=False), ROW_DIGITS)
    out["v"] = values
    return out


def _types_payload(agg: dict[str, Any], quantities: Sequence[str], min_count: int, rank_min: int) -> dict[str, Any]:
    """The type tables; ``rank_min``: the minimum count the page ranks by at first (the summary's)."""
    from normfast.engine.report.ranking import is_punctuation

    out = {}
    for by, got in agg.items():
        t: pa.Table = got["table"]
        label = t.column("token" if by == "token" else "word").to_pylist()
        entry: dict[str, Any] = {
            "total": got["types"],
            "n": t.num_rows,
            "label": [str(s)[:MAX_LABEL] for s in label],
            "count": _ints(t.column("count").to_numpy()),
            "occurrences": _ints(t.column("occurrences").to_numpy()),
            "min_count": min_count,
            "rank": {"key": "heat_rel" if "heat_rel" in quantities else quantities[0], "min": rank_min},
            "punct": [int(is_punctuation(x)) for x in label],
            "q": {},
        }
        if by == "word":
            entry["pieces"] = _nums(t.column("pieces").to_numpy(zero_copy_only=False), 3)
        for q in quantities:
            entry["q"][q] = {
                "mean": _nums(t.column(f"{q}_mean").to_numpy(zero_copy_only=False), TYPE_DIGITS),
                "se": _nums(t.column(f"{q}_se").to_numpy(zero_copy_only=False), SE_DIGITS),
            }
        z = collect.zipf_of(entry["label"])
        if z is not None and np.isfinite(z).any():
            entry["zipf"] = _nums(z, 3)
        out[by] = entry
    return out


def page_data(
    result,
    *,
    stat: str | None = None,
    docs: int = collect.DEFAULT_DOCS,
    min_count: int = 1,
    max_rows: int = collect.DEFAULT_MAX_ROWS,
    max_types: int = collect.DEFAULT_MAX_TYPES,
    seed: int = 0,
    notes: str | None = None,
) -> dict[str, Any]:
    """Everything the page shows, as JSON-ready data (see :mod:`normfast.engine.report.page.collect`)."""
    fn = "normfast view"
    for name, v in (("docs", docs), ("min_count", min_count), ("max_rows", max_rows), ("max_types", max_types)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{fn}: expected {name} to be a positive int, got {v!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{fn}: expected seed to be an int, got {seed!r}")
    collect.check_run(result)
    stats = collect.stat_columns(result)
    aliases = {
        "V2": result.heat_column,
        "D": result.drift_column,
        "heat": result.heat_column,
        "drift": result.drift_column,
    }
    chosen = aliases.get(stat, stat) if stat is not None else result.heat_column
    if chosen not in stats:
        raise ValueError(f"{fn}: --stat {stat!r} is not a statistic of this run; choose one of {stats}")
    meta = result.metadata
    pooled = (
        (meta["output"] == "pooled") if "output" in meta else int(np.max(result.column("position"), initial=-1)) < 0
    )
    corpus = "doc_id" in result.column_names and not pooled

    scanned = collect.scan(result)
    picked, every = collect.sample_documents(scanned["key_rows"], docs, max_rows, seed)
    keys = [scanned["keys"][i] for i in picked]
    rows, cut = collect.sampled_rows(result, scanned["key"], keys, max_rows)
    key_values = rows.column(scanned["key"]).to_pylist()
    index = {k: i for i, k in enumerate(keys)}
    doc_of_row = np.array([index[k] for k in key_values], np.int64)
    specs = _stat_specs(result, stats)
    layout = None if pooled else collect.token_layout(rows, corpus)
    row_data = _rows_payload(rows, specs, layout, doc_of_row)
    docs_out = [] if pooled else collect.documents(rows, scanned["key"], corpus, *layout)

    quantities = [
        q
        for q in ("norm", result.heat_column, result.drift_column, "kappa", "r_eq", "r_eq_heat")
        if q in result.column_names
    ]
    from normfast.engine.report.ranking import default_min_count

    # the type tables add the relative heat, ranked by it as every list is (normfast.engine.report.ranking)
    type_quantities = (["heat_rel"] if "heat_rel" in result.column_names else [result.heat_column]) + [
        q for q in quantities if q != result.heat_column
    ]
    if "heat_rel" in type_quantities:
        type_quantities.insert(1, result.heat_column)
    rank_min = max(min_count, default_min_count(meta, result.column_names))
    types = (
        _types_payload(
            collect.type_tables(result, type_quantities, min_count, max_types), type_quantities, min_count, rank_min
        )
        if not pooled
        else {}
    )
    data = {
        "title": f"{meta.get('model')} — {Path(str(result.path)).name if result.path else 'probe run'}",
        "stat": chosen,
        "stats": specs,
        "kind": "pooled" if pooled else ("corpus" if corpus else "tokens"),
        "heat": result.heat_column,
        "drift": result.drift_column,
        "regimes": list(collect.REGIMES),
        "rows": row_data,
        "docs": docs_out,
        "sample": {
            "docs": len(keys),
            "of": len(scanned["keys"]),
            "seed": seed,
            "all": every,
            "cut": cut,
            "unit": "documents" if corpus else "inputs",
        },
        "types": types,
        "quantities": quantities,
        "type_quantities": type_quantities,
        "hist": collect.heat_histogram(scanned),
        "totals": {k: scanned[k] for k in ("rows", "valid", "special")},
    }
    data["header"] = _header(result, scanned, len(keys), every, cut, seed, notes)
    trimmed = _fit(data, MAX_DATA_BYTES - 1024)  # room for the header's note of what was cut
    if trimmed:
        every = False
    data["header"] = _header(result, scanned, data["sample"]["docs"], every, cut, seed, notes)
    if trimmed:
        data["header"]["sample"] += f" Cut to fit the page's size limit: {trimmed}."
    return data


def _size(data: Any) -> int:
    return data_size(data)


def _fit(data: dict[str, Any], budget: int) -> str:
    """Cut the sample (whole documents, from the end) and the type tables (the least frequent
    types) until the data fits ``budget`` bytes; returns what was cut, in words ("" if nothing).
    The defaults fit typical runs without any cut; this bounds runs with long texts or tokens."""
    done = []
    for _ in range(40):
        size = _size(data)
        if size <= budget:
            break
        rows_bytes = _size(data["rows"]) + _size(data["docs"])
        types = data["types"]
        if types and rows_bytes < size / 2:
            for by, entry in types.items():
                keep = max(1, int(entry["n"] * 0.8))
                _cut_lists(entry, entry["n"], keep)
                entry["q"] = {q: {k: v[:keep] for k, v in m.items()} for q, m in entry["q"].items()}
                entry["n"] = keep
            done.append("types")
            continue
        n_docs = data["sample"]["docs"]
        if n_docs <= 1:
            break
        keep = max(1, int(n_docs * 0.8))
        end = data["docs"][keep - 1]["end"] if data["docs"] else keep
        rows = data["rows"]
        _cut_lists(rows, rows["n"], end)
        rows["v"] = {k: v[:end] for k, v in rows["v"].items()}
        rows["n"] = end
        data["docs"] = data["docs"][:keep]
        data["sample"]["docs"] = keep
        done.append("documents")
    parts = []
    if "documents" in done:
        parts.append(f"{data['sample']['docs']:,} documents kept")
    if "types" in done:
        parts.append(", ".join(f"the {e['n']:,} most frequent types by {by}" for by, e in data["types"].items()))
    return "; ".join(parts)


def _cut_lists(d: dict[str, Any], n: int, keep: int) -> None:
    for k, v in list(d.items()):
        if isinstance(v, list) and len(v) == n and k != "reasons":
            d[k] = v[:keep]


def render(data: dict[str, Any]) -> str:
    """The page's HTML for ``page_data``'s output."""
    return render_page(data, template="page.html.j2", script="page.js", generator="normfast view")


def page_html(result, **options: Any) -> str:
    """The page of a run as one self-contained HTML string (options: see :func:`page_data`)."""
    return render(page_data(result, **options))


def write_page(result, path: str | Path, **options: Any) -> Path:
    """Write the page of ``result`` to ``path`` (``.html``); returns the path."""
    path = html_path(path, "normfast view")
    return write_html(page_html(result, **options), path)


__all__ = ["InlinePage", "page_data", "page_html", "render", "summary_html", "write_page"]


#: results with more rows show only their header in a notebook (the quantiles read every row)
SUMMARY_ROWS_LIMIT = 2_000_000


def summary_html(result) -> str:
    """The notebook view of a result: the summary's header lines and its table of quantiles."""
    from normfast.engine.diagnostics.health import health_line
    from normfast.engine.diagnostics.regime import headline
    from normfast.engine.report.summary import run_line, summarize

    meta = result.metadata
    n = len(result)
    esc = html.escape
    parts = [
        f"<div><b>ProbeResult</b>: {n:,} rows"
        + (f" &middot; <code>{esc(str(result.path))}</code>" if result.path is not None else "")
        + "</div>",
        f"<div><code>{esc(run_line(meta))}</code></div>",
    ]
    regime = meta.get("regime")
    if n > SUMMARY_ROWS_LIMIT or not isinstance(regime, dict) or "regime" not in regime:
        if isinstance(regime, dict) and "regime" in regime:
            parts += [f"<div>{esc(ln.strip())}</div>" for ln in headline(regime)]
        if n > SUMMARY_ROWS_LIMIT:
            parts.append(
                f"<div>(over {SUMMARY_ROWS_LIMIT:,} rows: call <code>result.summary()</code> for the "
                f"quantiles, <code>result.to_html(path)</code> for the page)</div>"
            )
            return "<div class='normfast-result'>" + "".join(parts) + "</div>"
    s = summarize(result)
    if s["regime"] is not None and "regime" in s["regime"]:
        parts += [f"<div>{esc(ln.strip())}</div>" for ln in headline(s["regime"])]
    health = health_line(meta.get("objective_health"))
    if health is not None:
        parts.append(f"<div>{esc(health)}</div>")
    cols = ("norm", result.drift_column, result.heat_column, "kappa", "r_eq", "r_eq_heat")
    body = "".join(
        f"<tr><td>{esc(c)}</td>" + "".join(f"<td>{s[c][q]:.4g}</td>" for q in ("p10", "median", "p90")) + "</tr>"
        for c in cols
    )
    parts.append(
        "<table><thead><tr><th>quantity</th><th>p10</th><th>median</th><th>p90</th></tr></thead>"
        f"<tbody>{body}</tbody></table>"
    )
    parts.append(
        f"<div>{s['valid']:,} rows with valid statistics; special-token rows left out: "
        f"{s['special_rows']:,}. <code>result.view()</code> shows the page.</div>"
    )
    return "<div class='normfast-result'>" + "".join(parts) + "</div>"
