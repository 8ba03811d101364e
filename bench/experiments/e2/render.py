"""E2's figure and tables: one run's fits, and the README block over the committed runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench.common import pyplot, save


# ----------------------------------------------------------------------------
# figure and printout
# ----------------------------------------------------------------------------
def plot(summary: dict[str, Any], path: str | Path) -> Path:
    """Observed vs predicted norms (log-log) per probe, trajectory average and last checkpoint, and
    the training health."""
    plt = pyplot()
    from matplotlib.ticker import NullFormatter

    items, fits = summary["items"], summary["fits"]
    obs = np.asarray(items["observed"])
    names = list(summary["protocol"]["probes"]) if "probes" in summary["protocol"] else ["jvp"]
    panels = []
    for name in names:
        p = "" if len(names) == 1 else f"{name}_"
        tag = "" if len(names) == 1 else f"{name} mode: "
        panels.append((f"{tag}trajectory-averaged D, Q, κ", p, ("full", "full_law"), ("heat", "heat_only_law")))
        panels.append(
            (
                f"{tag}last checkpoint alone",
                p,
                ("last_full", "last_checkpoint_full_law"),
                ("last_heat", "last_checkpoint_heat_only_law"),
            )
        )
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(5 * (len(panels) + 1), 4.8))
    for ax, (title, p, full, heat) in zip(axes, panels):
        values = [obs]
        for (key, fit_key), color, label in ((full, "tab:blue", "full law"), (heat, "tab:orange", "heat-only")):
            pred = np.asarray(items[f"{p}predicted_{key}"], dtype=float)
            f = fits[p + fit_key]
            ax.loglog(
                pred,
                obs,
                ".",
                ms=3,
                alpha=0.6,
                color=color,
                label=f"{label}: slope {f['slope']:.2f}, r {f['pearson_r']:.3f}",
            )
            values.append(pred[np.isfinite(pred) & (pred > 0)])
        lo = min(float(np.min(v)) for v in values if v.size)
        hi = max(float(np.max(v)) for v in values if v.size)
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="y = x")
        ax.set_title(title, fontsize=10)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("predicted R_eq")
        ax.set_ylabel("observed stationary norm (window mean)")
        ax.legend(fontsize=7, loc="upper left")
    ax = axes[-1]
    traj = summary["trajectory"]
    steps = [t["step"] for t in traj]
    ax.plot(steps, [t["loss_mean"] for t in traj], color="tab:red", label="loss (100-step mean)")
    ax.axhline(summary["loss_chance"], color="tab:red", ls=":", lw=0.8, label="chance ln(batch)")
    ax.plot(steps, [t["norm_median"] for t in traj], color="tab:blue", label="median probe norm")
    ax.plot(steps, [t["mean_cosine"] for t in traj], color="tab:green", label="mean pairwise cosine")
    w0 = np.asarray([t["decayed_weight_norm"] for t in traj])
    ax.plot(steps, w0 / w0[0], color="tab:purple", label="decayed weight norm / initial")
    start, stop = summary["protocol"]["window_steps"]
    ax.axvspan(start, stop, color="0.9", zorder=0, label="window")
    ax.set_xlabel("step")
    ax.set_title("training health", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    cfg, h = summary["config"], summary["health"]
    regime = summary.get("regime", {}).get(names[0], {})
    fig.suptitle(
        f"E2 ({cfg['protocol']}): {summary['model']}; SGD η={cfg['lr']} λ={cfg['weight_decay']} "
        f"(decay exempt: {cfg['no_decay']}), {summary['n_probe_items']} WordNet lemmas, "
        f"{summary['protocol']['checkpoints']} checkpoints × M={cfg['M']}\nregime check: "
        f"{regime.get('regime', 'n/a')} ({regime.get('reason', '')}); health criteria "
        f"{'met' if h['passed'] else 'NOT met'} (max mean cosine {h['max_mean_cosine']:.3f}, "
        f"norm change between halves "
        f"{h.get('norm_change_between_window_halves_median', np.nan):.3f})",
        fontsize=9,
    )
    return save(fig, path)


def health_line(h: dict[str, Any]) -> str:
    return (
        f"loss ok {h['loss_below_chance']}, no collapse {h['no_collapse']} (max cosine "
        f"{h['max_mean_cosine']:.3f}), stationary {h['stationary']} (norm change "
        f"{h.get('norm_change_between_window_halves_median', float('nan')):.4f}, weight change "
        f"{h.get('decayed_weight_norm_change_between_window_halves', float('nan')):.4f})"
    )


E2_PREDICTORS = {
    "full_law": "full law, trajectory average",
    "heat_only_law": "heat-only law, trajectory average",
    "last_checkpoint_full_law": "full law, last checkpoint",
    "last_checkpoint_heat_only_law": "heat-only law, last checkpoint",
}


E2_RUNS = (
    ("e2_real_encoder_A.json", "A: everything decayed"),
    ("e2_real_encoder_B.json", "B: projection head"),
    ("e2_real_encoder.json", "v3 (negative control): LayerNorm exempt"),
)


E2_PROBES = {"jvp": "jvp over the trained layer", "head": "head mode (head only)"}


def _e2_probes(d: dict) -> list[tuple[str, str]]:
    """``(fit-key prefix, label)`` for each probe of a run (v3 has one, unprefixed)."""
    probes = (d.get("protocol") or {}).get("probes")
    if not probes or len(probes) == 1:
        return [("", "")]
    labels = {"jvp": "jvp over head + last layer", "head": "head mode, head only"}
    return [(f"{name}_", labels.get(name, name)) for name in probes]


def e2_regime(d: dict, probe: str = "jvp") -> dict | None:
    """The regime check of a run: stored by the run, else recomputed from its averaged items
    (runs made before the check: κ only, the exempt-parameter test not available)."""
    stored = (d.get("regime") or {}).get(probe)
    if stored:
        return stored
    from normfast.engine.diagnostics import classify_rows, run_regime

    it, c = d["items"], d["config"]
    n = len(it["D"])
    cols = {
        "D": it["D"],
        "Q": it["Q"],
        "kappa": it["kappa"],
        "kappa_exempt": np.zeros(n),
        "se_D": np.full(n, np.nan),
        "valid": np.isfinite(it["kappa"]),
    }
    out = run_regime([{**cols, **classify_rows(cols, lr=c["lr"], weight_decay=c["weight_decay"])}])
    out["exempt_check"] = "not available (run made before the regime check)"
    return out


def _regime_cell(rg: dict | None) -> str:
    if rg is None:
        return "n/a"
    fr = rg["fractions"]
    return f"{rg['regime']} ({fr[rg['regime']]:.0%}; {rg['reason'].replace('_', ' ')})"


def e2_fits_table(d: dict, predictor: str = "predictor") -> str:
    """One run's slope / r table (with the paper's figures), as the E2 script prints it."""
    rows = [f"| {predictor} | slope [95% CI] | Pearson r [95% CI] |", "|---|---|---|"]
    for prefix, label in _e2_probes(d):
        for key, name in E2_PREDICTORS.items():
            f = d["fits"][prefix + key]
            (slo, shi), (rlo, rhi) = f["slope_ci95"], f["pearson_r_ci95"]
            rows.append(
                f"| {label + ': ' if label else ''}{name} | {f['slope']:.3f} [{slo:.3f}, {shi:.3f}] | "
                f"{f['pearson_r']:.3f} [{rlo:.3f}, {rhi:.3f}] |"
            )
    p = d["paper"]
    rows.append(f"| paper ({p['model']}) | {p['slope']:.2f} | {p['pearson_r']:.2f} |")
    return "\n".join(rows)


def _e2_note(d: dict, run: str) -> str:
    c, h, pr = d["config"], d["health"], d["protocol"]
    chosen = (d.get("pilot") or {}).get("chosen")
    choice = (
        (
            f"η = {chosen['lr']}, λ = {chosen['weight_decay']}"
            + (f", {chosen['steps']} steps" if "steps" in chosen else "")
        )
        if chosen
        else "none passed"
    )
    k = d["kappa"]
    cpu = d.get("cpu_seconds")
    sec = d["seconds"]
    times = f"run time {sec['total'] / 60:.1f} min wall" + (
        f", {cpu['total'] / 60:.0f} min process CPU" + _threads(d) if cpu else ""
    )
    if "train" in sec and "probe" in sec:
        workers = d.get("probe_workers")
        after = f" after training, in {workers} worker processes" if workers and workers > 1 else ""
        times += (
            f" (caching the frozen front {sec.get('cache_front', 0) / 60:.1f} min, training "
            f"{sec['train'] / 60:.1f}, the checkpoint probes {sec['probe'] / 60:.1f}{after})"
        )
    pilot = d.get("pilot") or {}
    if pilot.get("seconds"):
        times += f"; the pilot: {pilot['seconds']['total'] / 60:.1f} min wall" + (
            f", {pilot['cpu_seconds']['total'] / 60:.0f} min CPU" + _threads(pilot) if pilot.get("cpu_seconds") else ""
        )
    drift = "" if not c.get("drift_batches") else f", drift from the mean direction over {c['drift_batches']} batches"
    return (
        f"**{run}.** SGD η = {c['lr']}, λ = {c['weight_decay']} (decay exempt: `{c['no_decay']}`), "
        f"{c['steps']} steps of {c['batch_size']} pairs, window = last {c['window']:.0%} "
        f"({pr['equilibration_times_before_window']:.1f} equilibration times in), {pr['checkpoints']} "
        f"checkpoints × M = {c['M']}{drift}. Pilot's choice: {choice}. Training health in the window: "
        f"loss {h.get('loss_window_mean', float('nan')):.2f} (chance {h['loss_chance']:.2f}), max mean "
        f"pairwise cosine {h['max_mean_cosine']:.3f}, median norm change between the window halves "
        f"{h.get('norm_change_between_window_halves_median', float('nan')):.1%}, decayed-weight norm "
        f"change {h.get('decayed_weight_norm_change_between_window_halves', float('nan')):.1%} — "
        f"criteria {'met' if h['passed'] else 'NOT met'}. κ (window average) median {k['median']:.2f}, "
        f"range {k['min']:.2f} … {k['max']:.2f}, ≤ 0 for {k['negative_fraction']:.0%} of the items; "
        f"median |D| / heat scale {d['drift_over_heat_median']:.2f}; {times}."
    )


def _threads(d: dict) -> str:
    """`` on N torch threads`` when the run recorded its thread count."""
    n = d.get("torch_threads")
    return "" if n is None else f" on {n} torch thread{'s' if n != 1 else ''}"


def _e2_pilot_note(pilot: dict) -> str:
    """Every candidate of a pilot with its health outcome, and the choice."""
    parts = []
    for r in pilot["results"]:
        h = r["health"]
        if h.get("passed"):
            outcome = "passed"
        elif not h.get("no_collapse", True):
            outcome = f"collapsed (stopped at step {h.get('stopped_at_step', '?')})"
        else:
            failed = [
                name
                for key, name in (("loss_below_chance", "loss"), ("stationary", "stationarity"))
                if not h.get(key, True)
            ]
            outcome = "failed " + " and ".join(failed)
            if "norm_change_between_window_halves_median" in h:
                outcome += (
                    f" (norm change {h['norm_change_between_window_halves_median']:.1%}, weight change "
                    f"{h.get('decayed_weight_norm_change_between_window_halves', float('nan')):.1%})"
                )
        if r.get("train_cpu_seconds") is not None:
            outcome += f" [{r['train_seconds'] / 60:.0f} min wall, {r['train_cpu_seconds'] / 60:.0f} min CPU]"
        parts.append(f"η = {r['lr']}, λ = {r['weight_decay']}, {r['steps']} steps: {outcome}")
    chosen = pilot.get("chosen")
    choice = f"η = {chosen['lr']}, λ = {chosen['weight_decay']}, {chosen['steps']} steps" if chosen else "none passed"
    times = ""
    if pilot.get("seconds"):
        times = f"; {pilot['seconds']['total'] / 60:.0f} min wall" + (
            f", {pilot['cpu_seconds']['total'] / 60:.0f} min process CPU" if pilot.get("cpu_seconds") else ""
        )
    return "; ".join(parts) + f" → chosen: {choice}{times}"


def table_e2(load: Callable[[str], dict | None]) -> str | None:
    """The README block: every committed protocol (``load(file)`` gives a committed result or None)."""
    loaded = [(name, label, load(name)) for name, label in E2_RUNS]
    runs = [(d, label) for _, label, d in loaded if d is not None and "fits" in d]
    if not runs:
        return None
    rows = [
        "| run | predictor | slope [95% CI] | Pearson r [95% CI] | regime check (share of items) |",
        "|---|---|---|---|---|",
    ]
    for d, label in runs:
        for prefix, probe_label in _e2_probes(d):
            rg = _regime_cell(e2_regime(d, prefix.rstrip("_") or "jvp"))
            for key, name in E2_PREDICTORS.items():
                f = d["fits"][prefix + key]
                (slo, shi), (rlo, rhi) = f["slope_ci95"], f["pearson_r_ci95"]
                run = label + (f", {probe_label}" if probe_label else "")
                rows.append(
                    f"| {run} | {name} | {f['slope']:.3f} [{slo:.3f}, {shi:.3f}] | "
                    f"{f['pearson_r']:.3f} [{rlo:.3f}, {rhi:.3f}] | {rg} |"
                )
    p = runs[0][0]["paper"]
    rows.append(f"| paper ({p['model']}) | full law | {p['slope']:.2f} | {p['pearson_r']:.2f} | |")
    rows.append("")
    rows.append(
        f"{runs[0][0]['n_probe_items']} WordNet lemmas per run; target (trajectory-averaged full "
        f"law): slope in [0.85, 1.15], r ≥ 0.90."
    )
    for d, label in runs:
        rows += ["", _e2_note(d, label.split(":")[0])]
    for name, label, d in loaded:  # the settings whose full run is not (yet) in the table
        if d is not None and "fits" in d:
            continue
        pilot = (d or {}).get("pilot")
        if pilot:
            rows += [
                "",
                f"**{label.split(':')[0]} (pilot only, no full run recorded).** Pilot: {_e2_pilot_note(pilot)}.",
            ]
        else:
            rows += ["", f"**{label.split(':')[0]}: not run** (no `bench/results/{name}`)."]
    return "\n".join(rows)
