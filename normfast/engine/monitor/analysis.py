"""What a monitor folder says: the law's window-averaged prediction per item, beside the norms it kept.

:func:`analyze` reads the rows a :class:`normfast.TrainingMonitor` wrote and, over a
window (the last ``window`` fraction of the recorded steps), gives per item:

* ``observed``: the mean norm over the window;
* ``r_eq_realized``: the law solved with coefficients read off the window means of the
  realized terms (:func:`normfast.engine.monitor.realized.realized_law`). When the window is
  stationary and the terms complete, the means balance (they add up to the mean ΔR², ≈ 0) and
  this reproduces the observed norm by construction, whatever the split between heat and drift:
  its fit checks that the recorded terms add up over the window, not that the law predicts
  (a prediction is a later window's norm, or the norm after a change: ``monitor_transient``);
* ``r_eq_virtual`` (with ``virtual=M``): the law from the engine's own estimates of drift,
  heat and κ at the recorded states, averaged over the window (what a user without the
  training run's steps would predict), and its heat-only form;
* the window means of the four terms, and whether the item is held up by heat or by drift:
  the larger of the first-order task term and the heat (second-order task term plus the
  curvature remainder). With momentum (heavy-ball, or AdamW's β1 > 0) the realized per-step
  split moves most of the heat into the first-order term (E1's ledger), so the split is then
  taken from the virtual estimate when there is one.

The window's means weigh each row by the steps it averages (``n_steps``). The window is
checked for stationarity (:func:`stationarity`): the net change of R² per step between the
window's first and last quarters against the decay term, the old balance ``|⟨ΔR²⟩| / |⟨decay⟩|``
(noise at ``every > 1`` without averaging), and the relative change of the mean norm between
the window's halves.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from normfast.core.checks import first_line
from normfast.core.stats import loglog_fit
from normfast.engine.monitor.layout import MONITOR_FILE, MONITOR_FORMAT, SUMMARY_FILE, monitor_metadata

WINDOW_TERMS = ("task1", "task2", "decay", "remainder", "delta_r2")


def is_monitor(path: str | Path) -> bool:
    """Whether ``path`` is a monitor folder (finished, or with its blocks still being written) or its Parquet."""
    path = Path(path)
    if path.is_dir():
        return (path / MONITOR_FILE).is_file() or (path / (MONITOR_FILE + ".parts")).is_dir()
    if path.suffix == ".parquet" and path.is_file():
        import warnings

        from normfast.data.io import read_metadata

        try:
            with warnings.catch_warnings():  # a probe run's reader says what it has to say
                warnings.simplefilter("ignore")
                return read_metadata(path).get("format") == MONITOR_FORMAT
        except Exception:  # noqa: BLE001 - not ours
            return False
    return False


def read_summary(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(summary.json's timing or None, why it cannot be used or None)``: the report goes on without
    the timing when the file is damaged (it holds nothing else)."""
    path = folder / SUMMARY_FILE
    if not path.is_file():
        return None, None
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {first_line(exc)}"
    if not isinstance(summary, dict):
        return None, f"a {type(summary).__name__}, not a JSON object"
    for key, value in summary.items():
        values = value.values() if isinstance(value, dict) else [value]
        if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
            return None, f"{key} is {value!r}, not a number"
    return summary, None


def monitor_inputs(folder: str | Path) -> list[Path]:
    """Every file a reader of the monitor folder opens (for the output-versus-input check)."""
    folder = Path(folder)
    parts = folder / (MONITOR_FILE + ".parts")
    return [folder / MONITOR_FILE, folder / SUMMARY_FILE, parts / "run.json", *sorted(parts.glob("chunk-*.parquet*"))]


def load_monitor(path: str | Path) -> tuple[pa.Table, dict[str, Any], dict[str, Any] | None, bool]:
    """``(rows, metadata, summary or None, finished)`` of a monitor folder (or its ``monitor.parquet``);
    the summary is None too when it cannot be used (:func:`read_summary`).

    An unfinished folder (training still running, or stopped) is read from its finished blocks;
    its metadata is then the settings of its work folder only. Either way the format is checked
    here (:func:`normfast.engine.monitor.layout.monitor_metadata`), and the rows are read with their
    checksums verified -- ``monitor.parquet``'s page checksums, each block's SHA-256 -- so a damaged
    file is one ``ValueError`` line naming it: every reader comes through.
    """
    from normfast.data.io import read_metadata, read_parquet
    from normfast.data.runwriter import verify_chunk

    path = Path(path)
    folder = path if path.is_dir() else path.parent
    final = folder / MONITOR_FILE
    summary = read_summary(folder)[0]
    if final.is_file():
        metadata = monitor_metadata(read_metadata(final), final)
        return read_parquet(final), metadata, summary, True
    parts = folder / (MONITOR_FILE + ".parts")
    chunks = sorted(parts.glob("chunk-*.parquet"))
    if not chunks:
        raise ValueError(f"{folder}: no monitor.parquet and no finished block of recorded steps yet")
    run = parts / "run.json"
    try:
        blob = json.loads(run.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{run} is not JSON ({first_line(exc)}): the unfinished monitor folder is damaged") from None
    spec = monitor_metadata(blob.get("spec") if isinstance(blob, dict) else blob, run)
    for chunk in chunks:
        problem = verify_chunk(chunk)
        if problem is not None:
            raise ValueError(
                f"{chunk} cannot be read ({problem}): the block was damaged or changed after it was written; "
                f"its recorded steps cannot be trusted"
            )
    return pa.concat_tables(read_parquet(c) for c in chunks), spec, summary, False


def _matrix(table: pa.Table, column: str, n_steps: int, n_items: int) -> np.ndarray:
    return np.asarray(table[column].to_numpy(zero_copy_only=False), dtype=float).reshape(n_steps, n_items)


def _fit(predicted: np.ndarray, observed: np.ndarray) -> dict[str, float]:
    fit = loglog_fit(predicted, observed)
    fit["n_no_prediction"] = int(np.sum(~(np.isfinite(predicted) & (predicted > 0))))
    return fit


def _beta1(metadata: dict[str, Any]) -> float:
    for group in metadata.get("param_groups") or ():
        if group.get("monitored_tensors") and "betas" in group:
            return float(group["betas"][0])
    return 0.0


def stationarity(norms: np.ndarray, steps: np.ndarray, means: dict[str, np.ndarray]) -> dict[str, float]:
    """How far the window is from stationary, against the decay term (median over items; 0: stationary).

    ``net_change_median``: the change of R² per step between the means over the window's first and
    last quarters of recorded steps, over the mean decay term per step. It comes from the recorded
    norms alone, and ΔR² telescopes, so it does not depend on how many steps were recorded.
    ``balance_median``: the mean realized ΔR² per step over the mean decay term. With every step's
    terms (``every=1``, or ``average=True``) it telescopes too, to the change between the window's
    ends; with sampled steps (``average=False``, ``every > 1``) it is a mean of a few noisy ΔR² draws,
    mostly sampling noise.
    """
    q = max(1, len(steps) // 4)
    r2 = np.square(norms)
    span = float(np.mean(steps[-q:]) - np.mean(steps[:q]))
    decay = np.maximum(np.abs(means["decay"]), 1e-300)
    net = (r2[-q:].mean(0) - r2[:q].mean(0)) / span if span > 0 else np.full(r2.shape[1], np.nan)
    return {
        "net_change_median": float(np.median(np.abs(net) / decay)),
        "balance_median": float(np.median(np.abs(means["delta_r2"]) / decay)),
    }


def analyze(path: str | Path, *, window: float = 0.5) -> dict[str, Any]:
    """The monitor folder's report (see the module docstring): settings, window, stationarity, fits, the
    per-item columns (``items``) and the trajectories (``trajectory``: the recorded steps, and
    ``[steps, items]`` matrices of the norms, of each realized term (``terms``, empty without them)
    and of the virtual snapshot ``virtual_r_eq`` (None without it), the learning rate per step, the steps
    each row's terms average (``n_steps``), the folder's metadata; not JSON-ready: the caller drops it)."""
    if not 0 < window <= 1:
        raise ValueError(f"analyze: expected 0 < window <= 1 (a fraction of the recorded steps), got {window!r}")
    table, meta, summary, finished = load_monitor(path)
    unreadable = read_summary(Path(path) if Path(path).is_dir() else Path(path).parent)[1]
    return analyze_table(
        table, meta, window=window, summary=summary, finished=finished, path=path, unreadable=unreadable
    )


def analyze_table(
    table: pa.Table,
    meta: dict[str, Any],
    *,
    window: float = 0.5,
    summary: dict[str, Any] | None = None,
    finished: bool = True,
    path: str | Path = "",
    unreadable: str | None = None,
) -> dict[str, Any]:
    """:func:`analyze` of rows already read: a monitor's ``table`` (every column of ``monitor.parquet``,
    e.g. :meth:`TrainingMonitor.table`) and its ``meta`` (:meth:`TrainingMonitor.metadata`); ``summary``:
    its clock, ``unreadable``: why ``summary.json`` could not be read, ``path``: the name reports give."""
    from normfast.core.equilibrium import equilibrium_norm
    from normfast.engine.monitor.realized import estimated_terms, realized_law

    if not 0 < window <= 1:
        raise ValueError(f"analyze: expected 0 < window <= 1 (a fraction of the recorded steps), got {window!r}")
    table = table.sort_by([("step", "ascending"), ("item", "ascending")])
    steps = np.unique(table["step"].to_numpy())
    n_items = int(meta.get("n_items") or len(np.unique(table["item"].to_numpy())))
    S = len(steps)
    if table.num_rows != S * n_items:
        raise ValueError(
            f"analyze: {path}: {table.num_rows} rows for {S} steps x {n_items} items; the folder is damaged"
        )
    if S < 2:
        raise ValueError(f"analyze: {path}: {S} recorded step; the report needs at least 2")
    w = max(2, int(math.ceil(window * S)))
    first = S - w
    names = table.column_names
    norms = _matrix(table, "norm", S, n_items)
    win = slice(first, S)
    observed = norms[win].mean(0)
    halves = (norms[first : first + w // 2].mean(0), norms[first + w // 2 :].mean(0))
    law = meta.get("law") or "sgd"
    lr = float(np.mean(_matrix(table, "lr", S, n_items)[win, 0]))
    lr_all = _matrix(table, "lr", S, n_items)[win, 0]
    wd = float(meta.get("weight_decay") or 0.0)
    momentum = float(meta.get("momentum") or 0.0)
    beta1 = _beta1(meta) if law == "adamw" else momentum
    ids = table["id"].to_pylist()[:n_items]
    notes: list[str] = []
    if unreadable is not None:
        notes.append(f"the timing in {SUMMARY_FILE} is unreadable ({unreadable}); the report goes without it")
    if lr_all.max() > 1.05 * lr_all.min():
        notes.append(
            f"the learning rate changes over the window ({lr_all.min():.3g} to {lr_all.max():.3g}): the "
            f"law assumes a constant one and is solved at its mean"
        )
    items: dict[str, Any] = {"item": list(range(n_items)), "id": ids, "observed": observed}
    out: dict[str, Any] = {
        "folder": str(path),
        "finished": finished,
        "law": law,
        "optimizer": meta.get("optimizer"),
        "lr": lr,
        "weight_decay": wd,
        "momentum": momentum,
        "beta1": beta1 if law == "adamw" else None,
        "n_items": n_items,
        "every": meta.get("every"),
        "recorded_steps": S,
        "window": {
            "fraction": window,
            "recorded_steps": w,
            "first_step": int(steps[first]),
            "last_step": int(steps[-1]),
        },
        "stationarity": {
            "norm_halves_median_rel_change": float(
                np.median(np.abs(halves[1] - halves[0]) / np.maximum(observed, 1e-300))
            )
        },
        "fits": {},
        "dominant": None,
        "virtual": int(meta.get("virtual") or 0),
        "timing": summary,
        "notes": notes,
    }
    has_terms = "task1" in names
    realized_split = None
    terms = {k: _matrix(table, k, S, n_items) for k in WINDOW_TERMS} if has_terms else {}
    if has_terms:
        # a row averages n_steps steps (average=True; 1 otherwise and in version 1 files): weigh it by them
        weights = _matrix(table, "n_steps", S, n_items)[win, 0] if "n_steps" in names else np.ones(w)
        means = {k: np.average(terms[k][win], axis=0, weights=weights) for k in WINDOW_TERMS}
        means["R2"] = np.square(norms[win]).mean(0)
        means["R"] = observed
        items.update({k: means[k] for k in WINDOW_TERMS})
        out["stationarity"].update(stationarity(norms[win], steps[win], means))
        out["window"]["term_steps"] = int(weights.sum())
        if (meta.get("every") or 1) > 1 and weights.max() == 1:
            notes.append(
                f"the realized terms are the recorded steps' alone (1 step in {meta.get('every')}): their window "
                "means sample the steps, so they do not add up to the window's net change and the law from them "
                "is noisier; average=True (the default) averages every step"
            )
        if wd > 0:
            for key, rem in (("r_eq_realized", True), ("r_eq_realized_no_remainder", False)):
                items[key] = realized_law(
                    means, adamw=law == "adamw", lr=lr, weight_decay=wd, momentum=momentum, with_remainder=rem
                )
            out["fits"]["realized_law"] = _fit(items["r_eq_realized"], observed)
            out["fits"]["realized_law_no_remainder"] = _fit(items["r_eq_realized_no_remainder"], observed)
        else:
            notes.append("no weight decay on the monitored parameters: the law has no equilibrium to predict")
        realized_split = (means["task1"], means["task2"] + means["remainder"])
    if "virtual_D" in names and wd > 0:
        v = {k: _matrix(table, f"virtual_{k}", S, n_items)[win].mean(0) for k in ("D", "Q", "kappa")}
        zero = np.zeros(n_items)
        if law == "adamw":
            full = equilibrium_norm(None, None, v["kappa"], D_w=v["D"], Q_w=v["Q"], lr=lr, weight_decay=wd)
            heat = equilibrium_norm(None, None, v["kappa"], D_w=zero, Q_w=v["Q"], lr=lr, weight_decay=wd)
            stats = {"norm": observed, "kappa": v["kappa"], "D_w": v["D"], "Q_w": v["Q"]}
        else:
            full = equilibrium_norm(v["D"], v["Q"], v["kappa"], lr=lr, weight_decay=wd, momentum=momentum)
            heat = equilibrium_norm(zero, v["Q"], v["kappa"], lr=lr, weight_decay=wd, momentum=momentum)
            stats = {"norm": observed, "kappa": v["kappa"], "D": v["D"], "Q": v["Q"]}
        items.update(
            {
                "r_eq_virtual": full,
                "r_eq_virtual_heat": heat,
                "virtual_D": v["D"],
                "virtual_Q": v["Q"],
                "virtual_kappa": v["kappa"],
            }
        )
        last = _matrix(table, "virtual_r_eq", S, n_items)[-1]
        out["fits"]["virtual_law"] = _fit(full, observed)
        out["fits"]["virtual_heat_only"] = _fit(heat, observed)
        out["fits"]["virtual_last_state"] = _fit(last, observed)
        est = estimated_terms(law, stats, lr=lr, weight_decay=wd, momentum=momentum)
        virtual_split = (est["task1"], est["task2"])
    else:
        virtual_split = None
    if beta1 > 0 and virtual_split is not None:
        split, source = virtual_split, "the virtual estimate (momentum moves the realized heat into the first order)"
    elif realized_split is not None:
        split, source = realized_split, "the realized terms"
        if beta1 > 0:
            notes.append(
                "with momentum the realized first-order term carries most of the heat (E1's ledger): "
                "the heat/drift split below understates the heat; run with virtual=M for the law's split"
            )
    else:
        split, source = None, None
    if split is not None:
        drift_dominated = np.abs(split[0]) > np.abs(split[1])
        items["dominant"] = np.where(drift_dominated, "drift", "heat")
        out["dominant"] = {"heat": int((~drift_dominated).sum()), "drift": int(drift_dominated.sum()), "from": source}
    out["items"] = items
    out["trajectory"] = {
        "steps": steps,
        "norms": norms,
        "terms": terms,
        "virtual_r_eq": _matrix(table, "virtual_r_eq", S, n_items) if "virtual_r_eq" in names else None,
        "lr": _matrix(table, "lr", S, n_items)[:, 0],
        "n_steps": _matrix(table, "n_steps", S, n_items)[:, 0] if "n_steps" in names else np.ones(S),
        "metadata": meta,
    }
    return out
