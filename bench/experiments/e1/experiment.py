"""One E1 run per variant: train, probe the checkpoints, fit the laws, and (``ledger=True``) the ledger."""

from __future__ import annotations

import json
import resource
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.experiments.e1.data import (
    VARIANT_SPECS,
    VARIANTS,
    E1Config,
    SyntheticConcepts,
    Variant,
    drift_estimator_name,
    make_concepts,
)
from bench.experiments.e1.laws import TARGET_R, TARGET_SLOPE, ProbedRun, law_norms, probe_checkpoints, realized_law
from bench.experiments.e1.training import TrainingRun, train
from normfast.data.io import json_ready


def _target(fit: dict[str, float]) -> dict[str, Any]:
    lo, hi = TARGET_SLOPE
    return {
        "slope": [lo, hi],
        "pearson_r": TARGET_R,
        "met": bool(lo <= fit["slope"] <= hi and fit["pearson_r"] >= TARGET_R),
    }


def run_variant(
    variant: Variant,
    cfg: E1Config,
    data: SyntheticConcepts,
    *,
    ledger: bool = False,
    snapshot: bool = True,
    progress: bool = True,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Train, probe and fit one variant; returns (E1 result, ledger result or None)."""
    from bench.experiments.e1.snapshot import snapshot_predictors
    from normfast.core.stats import loglog_fit

    run = train(variant, cfg, data, ledger=ledger, progress=progress)
    probed = probe_checkpoints(run, cfg, data, progress=progress)
    observed = run.observed
    adam = variant.optimizer == "adamw"
    avg, last = probed.average, probed.last
    r_full = law_norms(variant, avg, cfg)
    r_heat = law_norms(variant, avg, cfg, heat_only=True)
    r_last = law_norms(variant, last, cfg)
    r_last_heat = law_norms(variant, last, cfg, heat_only=True)
    dense = run.meter
    qcol, ccol = ("Q_w", "Q_curv_w") if adam else ("Q", "Q_curv")

    def corrected(m: dict[str, Any]) -> dict[str, Any]:  # heat plus curvature heat
        return dict(m, **{qcol: m[qcol] + m[ccol]})

    r_dense = law_norms(variant, corrected(dense), cfg)
    r_dense_plain = law_norms(variant, dense, cfg)
    r_dense_heat = law_norms(variant, corrected(dense), cfg, heat_only=True)
    r_fresh = law_norms(variant, corrected(run.meter_fresh), cfg)
    fits = {
        "dense_corrected_law": loglog_fit(r_dense, observed),
        "dense_law_without_curvature": loglog_fit(r_dense_plain, observed),
        "dense_heat_only_law": loglog_fit(r_dense_heat, observed),
        "dense_fresh_batch_corrected_law": loglog_fit(r_fresh, observed),
        "full_law": loglog_fit(r_full, observed),
        "heat_only_law": loglog_fit(r_heat, observed),
        "last_checkpoint_full_law": loglog_fit(r_last, observed),
        "last_checkpoint_heat_only_law": loglog_fit(r_last_heat, observed),
        "last_checkpoint_norm": loglog_fit(last["norm"], observed),
    }
    lr = variant.lr(cfg)
    eta_eff = lr / (1 - variant.momentum)
    drift = avg["D_w"] if adam else avg["D"]
    heat_scale = np.sqrt(cfg.weight_decay * np.abs(avg["kappa"]) * eta_eff * (avg["Q_w"] if adam else avg["Q"]))
    first, second = run.observed_halves
    out = {
        "variant": variant.name,
        "description": variant.description,
        "optimizer": variant.optimizer,
        "momentum": variant.momentum,
        "beta1": variant.beta1 if adam else None,
        "lr": lr,
        "weight_decay": cfg.weight_decay,
        "items": int(data.x.shape[0]),
        "checkpoints": len(run.checkpoints),
        "M_per_checkpoint": cfg.M,
        "drift_batches_per_checkpoint": cfg.drift_batches,
        "drift_estimator": drift_estimator_name(cfg.M, cfg.drift_batches),
        "fits": fits,
        "target": _target(fits["dense_corrected_law"]),
        "target_checkpoint_law": _target(fits["full_law"]),
        "dense_samples": int(dense["n"]),
        "dense_seconds": round(run.meter_seconds, 1),
        "dense_fresh_batch_seconds": round(run.meter_fresh_seconds, 1),
        "dense_meter_batch": "own",
        "curvature_over_heat_median": float(np.median(dense[ccol] / dense[qcol])),
        "kappa": {"min": float(np.min(avg["kappa"])), "max": float(np.max(avg["kappa"]))},
        "drift_over_heat_median": float(np.median(np.abs(drift) / heat_scale)),
        "norm_change_between_window_halves_median": float(np.median(np.abs(second - first) / observed)),
        "drift_along_window": drift_time_structure(probed.per_checkpoint_drift, cfg.probe_every),
        "final_loss_mean_last_500": float(np.mean(run.losses[-500:])),
        "train_seconds": round(run.train_seconds, 1),
        "probe_seconds": round(probed.seconds, 1),
        "observed": observed.tolist(),
        "predicted_dense": np.asarray(r_dense).tolist(),
        "predicted_dense_fresh_batch": np.asarray(r_fresh).tolist(),
        "predicted_full": np.asarray(r_full).tolist(),
        "predicted_heat": np.asarray(r_heat).tolist(),
        "predicted_last_full": np.asarray(r_last).tolist(),
        "predicted_last_heat": np.asarray(r_last_heat).tolist(),
        "ambiguity": data.ambiguity[data.concept].tolist(),
    }
    if snapshot:
        snap = snapshot_predictors(run, cfg, data, progress=progress)
        out["snapshot"] = {
            "fits": {k: loglog_fit(v, observed) for k, v in snap["predicted"].items()},
            "present_norm_fit": loglog_fit(snap["present_norm"], observed),
            "norm_continued_fit": loglog_fit(snap["norm_continued"], observed),
            "interval_coverage": {k: interval_coverage(lo, hi, observed) for k, (lo, hi) in snap["intervals"].items()},
            "shrinkage": snap["shrinkage"],
            "trajectory_steps": snap["trajectory_steps"],
            "seconds": snap["seconds"],
            "predicted": {k: np.asarray(v).tolist() for k, v in snap["predicted"].items()},
            "norm_continued": np.asarray(snap["norm_continued"]).tolist(),
            "intervals": {
                k: [np.asarray(lo).tolist(), np.asarray(hi).tolist()] for k, (lo, hi) in snap["intervals"].items()
            },
        }
    led = ledger_result(run, probed, cfg, observed) if ledger else None
    return out, led


def interval_coverage(lo: np.ndarray, hi: np.ndarray, observed: np.ndarray) -> dict[str, float]:
    """How often the observed norm lies inside ``[lo, hi]`` (rows with a finite interval), and the median
    relative half-width ``exp((log hi − log lo)/2) − 1``."""
    ok = np.isfinite(lo) & np.isfinite(hi)
    inside = (observed[ok] >= lo[ok]) & (observed[ok] <= hi[ok])
    width = np.expm1((np.log(hi[ok]) - np.log(lo[ok])) / 2)
    return {
        "coverage": float(inside.mean()) if ok.any() else float("nan"),
        "rows": int(ok.sum()),
        "below": float((observed[ok] < lo[ok]).mean()) if ok.any() else float("nan"),
        "median_halfwidth": float(np.median(width)) if ok.any() else float("nan"),
    }


def _lag_correlations(series: np.ndarray, lags: tuple[int, ...]) -> dict[str, float]:
    """Mean over items of the lag-k autocorrelation of a ``[time, items]`` series."""
    centered = series - series.mean(0)
    out = {}
    for lag in lags:
        if lag < centered.shape[0]:
            a, b = centered[:-lag], centered[lag:]
            out[str(lag)] = float(np.mean((a * b).sum(0) / np.sqrt((a * a).sum(0) * (b * b).sum(0))))
    return out


def drift_time_structure(drift: np.ndarray, spacing: int) -> dict[str, Any]:
    """How the engine's drift ``[checkpoints, items]`` moves along the window: its spread over time
    against its window mean, its autocorrelation by lag (in checkpoints), and how well one checkpoint
    (the last) or the first half of the window tracks the window mean across items."""
    mean = drift.mean(0)
    half = drift.shape[0] // 2
    return {
        "checkpoint_spacing_steps": spacing,
        "median_time_std_over_abs_window_mean": float(np.median(drift.std(0) / np.maximum(np.abs(mean), 1e-300))),
        "between_item_std_of_window_mean_over_median_time_std": float(np.std(mean) / np.median(drift.std(0))),
        "autocorrelation_by_lag": _lag_correlations(drift, (1, 2, 5, 10, 25, 50, 100)),
        "per_item_r_last_vs_window_mean": float(np.corrcoef(drift[-1], mean)[0, 1]),
        "per_item_r_first_half_vs_second_half": float(np.corrcoef(drift[:half].mean(0), drift[half:].mean(0))[0, 1]),
    }


def _solve_per_step(terms: dict[str, np.ndarray], R0: np.ndarray, adam: bool) -> np.ndarray:
    """The norm at which per-step terms measured at ``R0`` balance, each term scaled with R as the law
    scales it (SGD: first-order task R⁰, heat and remainder R⁻², decay R²; AdamW: R¹, R⁰, R⁰, R²)."""
    from scipy.optimize import brentq

    p1, p2 = (1, 0) if adam else (0, -2)
    out = np.full(R0.shape, np.nan)
    for i in range(R0.size):
        t1, t2, dec = terms["task1"][i], terms["task2"][i] + terms["remainder"][i], terms["decay"][i]

        def f(x: float) -> float:
            return t1 * x**p1 + t2 * x**p2 + dec * x**2

        if f(1e-3) > 0 > f(1e3):
            out[i] = brentq(f, 1e-3, 1e3, xtol=1e-12) * R0[i]
    return out


def term_swaps(
    realized: dict[str, np.ndarray], estimated: dict[str, np.ndarray], observed: np.ndarray, adam: bool
) -> dict[str, dict[str, float]]:
    """Which term resists: the law from the engine's estimated terms, then with one term at a time (or
    a pair) replaced by its realized value, then all realized -- slope and r against the observed norms.
    The terms are per step at the checkpoints' norms; the law rescales them with R."""
    from normfast.core.stats import loglog_fit

    zero = np.zeros_like(observed)
    est = dict(estimated, remainder=zero)
    swaps = {
        "engine (no remainder)": {},
        "engine + realized remainder": {"remainder"},
        "realized first-order task": {"task1"},
        "realized first-order task + remainder": {"task1", "remainder"},
        "realized task (both orders) + remainder": {"task1", "task2", "remainder"},
        "realized decay": {"decay"},
        "all realized": {"task1", "task2", "decay", "remainder"},
    }
    out = {}
    for name, real in swaps.items():
        terms = {k: (realized[k] if k in real else est[k]) for k in ("task1", "task2", "decay", "remainder")}
        out[name] = loglog_fit(_solve_per_step(terms, observed, adam), observed)
    return out


def ledger_result(run: TrainingRun, probed: ProbedRun, cfg: E1Config, observed: np.ndarray) -> dict[str, Any]:
    from bench.experiments.e1.ledger import compare, realized_terms
    from normfast.core.stats import loglog_fit

    variant = run.variant
    means = run.ledger.means()
    real = realized_terms(means)
    rows = compare(real, {"checkpoint_average": probed.est_average, "last_checkpoint": probed.est_last})
    decay = np.abs(real["decay"])
    closure = np.abs(real["total"]) / decay
    telescoped = (run.ledger.r2_last - run.ledger.r2_first).numpy() / run.ledger.steps
    block_drift = run.ledger.block_means("task1")  # [blocks, items]
    lag_corr = _lag_correlations(block_drift, (1, 5, 25, 100))
    return {
        "variant": variant.name,
        "description": variant.description,
        "optimizer": variant.optimizer,
        "momentum": variant.momentum,
        "beta1": variant.beta1 if variant.optimizer == "adamw" else None,
        "steps": run.ledger.steps,
        "checkpoints": len(run.checkpoints),
        "drift_estimator": drift_estimator_name(cfg.M, cfg.drift_batches),
        "terms": rows,
        "closure": {
            "median_abs_sum_over_abs_decay": float(np.median(closure)),
            "max_abs_sum_over_abs_decay": float(np.max(closure)),
            "telescoping_max_abs_error": float(np.max(np.abs(telescoped - real["total_telescoped"]))),
        },
        "remainder_over_task2_mean": float(np.mean(real["remainder"]) / np.mean(real["task2"])),
        "remainder_over_decay_mean": float(np.mean(real["remainder"]) / abs(np.mean(real["decay"]))),
        "term_swaps": term_swaps(real, probed.est_average, observed, variant.optimizer == "adamw"),
        "realized_law": {
            "with_remainder": loglog_fit(realized_law(variant, cfg, means), observed),
            "without_remainder": loglog_fit(realized_law(variant, cfg, means, with_remainder=False), observed),
        },
        "drift_time_structure": {
            "block_steps": cfg.probe_every,
            "blocks": int(block_drift.shape[0]),
            "median_block_std_over_abs_window_mean": float(
                np.median(block_drift.std(0) / np.maximum(np.abs(block_drift.mean(0)), 1e-300))
            ),
            "block_autocorrelation_by_lag": lag_corr,
            "per_item_r_last_checkpoint_drift_vs_window_realized": float(
                np.corrcoef(probed.est_last["task1"], real["task1"])[0, 1]
            ),
        },
        "realized": {k: np.asarray(v).tolist() for k, v in real.items()},
        "estimated_checkpoint_average": {k: np.asarray(v).tolist() for k, v in probed.est_average.items()},
        "estimated_last_checkpoint": {k: np.asarray(v).tolist() for k, v in probed.est_last.items()},
        "seconds": round(run.train_seconds, 1),
    }


def run(
    cfg: E1Config,
    variants: tuple[str, ...] = VARIANTS,
    out: str | Path | None = None,
    progress: bool = True,
    ledger: bool = False,
    snapshot: bool = True,
) -> dict[str, Any]:
    """Every variant in turn; writes ``equilibrium.json``/``.png`` (and ``ledger.json``/``.png``) to ``out``."""
    from bench.experiments.e1.plots import plot, plot_ledger
    from normfast.engine.runner import library_versions as _library_versions

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is faster and the timings steadier
    t0 = time.perf_counter()
    cpu0 = _cpu_seconds()
    try:
        data = make_concepts(cfg)
        pairs = [
            run_variant(VARIANT_SPECS[v], cfg, data, ledger=ledger, snapshot=snapshot, progress=progress)
            for v in variants
        ]
    finally:
        torch.set_num_threads(threads)
    results = [p[0] for p in pairs]
    timing = {"wall_seconds": round(time.perf_counter() - t0, 1), "cpu_seconds": round(_cpu_seconds() - cpu0, 1)}
    summary = {
        "experiment": "E1 controlled equilibrium",
        "config": asdict(cfg),
        "results": results,
        "timing": timing,
        "versions": _library_versions(),
    }
    if snapshot:
        from bench.experiments.e1.snapshot import SNAPSHOT_PROTOCOL, choose

        summary["snapshot_protocol"] = SNAPSHOT_PROTOCOL
        summary["snapshot_choice"] = choose({r["variant"]: r["snapshot"]["fits"] for r in results})
    ledger_summary = None
    if ledger:
        ledger_summary = {
            "experiment": "E1 radial-budget ledger",
            "config": asdict(cfg),
            "results": [p[1] for p in pairs],
            "timing": timing,
            "versions": _library_versions(),
        }
        summary["ledger"] = ledger_summary
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "equilibrium.json").write_text(
            json.dumps(json_ready(_without(summary, "ledger")), indent=1, allow_nan=False)
        )
        plot(results, out / "equilibrium.png")
        if ledger_summary is not None:
            (out / "ledger.json").write_text(json.dumps(json_ready(ledger_summary), indent=1, allow_nan=False))
            plot_ledger(ledger_summary["results"], out / "ledger.png")
    return summary


def _without(d: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children."""
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
