"""README renderers for E1 (`normfast validate`): the dense and checkpoint laws, the single
snapshot, the radial-budget ledger and which term resists. Used by bench/tables.py."""
from __future__ import annotations

from tables_common import _f, _load

E1_NAMES = {"mlp": "MLP, no biases", "mlp_bias": "MLP, biases", "table": "embedding table",
            "mlp_adamw": "MLP, AdamW β1 = 0.9", "mlp_adamw_b0": "MLP, AdamW β1 = 0",
            "mlp_heavyball": "MLP, heavy-ball SGD β = 0.9"}


def _sr(fit: dict) -> str:
    return f"{_f(fit['slope'])} / {_f(fit['pearson_r'])}"


def _e1_name(r: dict) -> str:
    return E1_NAMES.get(r["variant"], r["variant"])


E1_RUNS = (("0", "equilibrium.json"), ("1 (fresh)", "e1_seed1/equilibrium.json"))


def table_e1() -> str | None:
    runs = [(seed, _load(path)) for seed, path in E1_RUNS]
    runs = [(seed, d) for seed, d in runs if d is not None and "dense_corrected_law" in d["results"][0]["fits"]]
    if not runs:
        return None
    cols = (("dense_corrected_law", "dense, corrected law"), ("dense_law_without_curvature", "dense, no curvature"),
            ("dense_heat_only_law", "dense, heat-only"), ("full_law", "checkpoints, full law"),
            ("heat_only_law", "checkpoints, heat-only"))
    rows = ["| seed | E1 variant (slope / r) | " + " | ".join(c for _, c in cols) + " | target met |",
            "|---" * (len(cols) + 3) + "|"]
    for seed, d in runs:
        for r in d["results"]:
            rows.append(f"| {seed} | {_e1_name(r)} | " + " | ".join(_sr(r["fits"][k]) for k, _ in cols)
                        + f" | {'yes' if r['target']['met'] else 'no'} |")
    d = runs[0][1]
    cfg, r0 = d["config"], d["results"][0]
    rows.append("")
    rows.append(f"{cfg['concepts']} concepts x {cfg['items_per_concept']} items, {cfg['steps']} steps, window = last "
                f"{int(cfg['window'] * 100)}% ({r0['dense_samples']} steps); SGD lr {cfg['lr']}, heavy-ball lr "
                f"{cfg['heavyball_lr']}, AdamW lr {cfg['adamw_lr']}, wd {cfg['weight_decay']} throughout. Dense: one "
                f"fresh virtual batch at every step of the window. Checkpoints: {r0['checkpoints']} x (M = {cfg['M']}, "
                f"M_D = {cfg['drift_batches']}). Target: slope in [0.85, 1.15], r >= 0.93 (on the dense corrected law).")
    ledger_timing = (_load("ledger.json") or {}).get("timing")
    for seed, d in runs:
        t = d.get("timing")
        if t:
            how = "with" if seed == runs[0][0] and ledger_timing == t else "without"
            rows.append(f"Seed {seed}: `normfast validate --seed {d['config']['seed']}` ({how} --ledger) took "
                        f"{t['wall_seconds'] / 60:.0f} min wall, {t['cpu_seconds'] / 60:.0f} min CPU on the shared "
                        f"2-core machine.")
    return "\n".join(rows)


def table_e1_snapshot() -> str | None:
    runs = [(name, _load(path)) for name, path in E1_RUNS]
    runs = [(n, d) for n, d in runs if d is not None and "snapshot" in d["results"][0]]
    if not runs:
        return None
    cands = ("heat_only", "heat_only_curvature", "snapshot_full", "trajectory", "trajectory_curvature",
             "trajectory_shrunk", "trajectory_shrunk_regression")
    rows = ["| seed | E1 variant (slope / r) | " + " | ".join(c.replace("_", " ") for c in cands)
            + " | reference: present norm |", "|---" * (len(cands) + 3) + "|"]
    for seed, d in runs:
        for r in d["results"]:
            s = r["snapshot"]
            rows.append(f"| {seed} | {_e1_name(r)} | " + " | ".join(_sr(s["fits"][c]) for c in cands)
                        + f" | {_sr(s['present_norm_fit'])} |")
    notes = []
    for seed, d in runs:
        ch = d.get("snapshot_choice", {})
        w = ch.get("winner")
        met = ch.get("scores", {}).get(w, {}).get("targets_met")
        steps = {r["variant"]: r["snapshot"]["trajectory_steps"] for r in d["results"]}
        t = d.get("timing", {})
        notes.append(f"seed {seed}: protocol's choice {w} (target met on {met} of 4); "
                     f"trajectory steps {', '.join(f'{k} {v}' for k, v in steps.items())}; "
                     f"the whole run {t.get('wall_seconds', float('nan')) / 60:.0f} min wall, "
                     f"{t.get('cpu_seconds', float('nan')) / 60:.0f} min CPU")
    rows.append("")
    rows.append("; ".join(notes) + ".")
    return "\n".join(rows)


LEDGER_TERMS = (("task1", "first-order task"), ("task2", "second-order task"), ("task", "task, both orders"),
                ("decay", "decay"), ("remainder", "curvature remainder"))


def table_e1_ledger() -> str | None:
    d = _load("ledger.json")
    if d is None:
        return None
    rows = ["| E1 variant | term | realized, mean per step | / decay | checkpoint mean: ratio, r | "
            "last checkpoint: ratio, r |", "|---|---|---|---|---|---|"]
    for r in d["results"]:
        dec = abs(r["terms"]["decay"]["realized_mean"])
        for t, label in LEDGER_TERMS:
            row = r["terms"][t]
            a, b = row["checkpoint_average"], row["last_checkpoint"]
            rows.append(f"| {_e1_name(r)} | {label} | {row['realized_mean']:.2e} | {row['realized_mean'] / dec:+.2f} | "
                        f"{_f(a['ratio_realized_over_estimated'], 2)}, {_f(a['pearson_r'], 2)} | "
                        f"{_f(b['ratio_realized_over_estimated'], 2)}, {_f(b['pearson_r'], 2)} |")
    rows.append("")
    rows.append("Ratio = realized mean / engine's mean over items; r = per-item Pearson r (realized window mean "
                "against the engine's estimate). The engine has no remainder term (ratio n/a).")
    ts = [(r, r["drift_time_structure"]) for r in d["results"] if "drift_time_structure" in r]
    if ts:
        rows.append("")
        rows.append(f"The realized first-order term in blocks of {ts[0][1]['block_steps']} steps: its spread from "
                    "block to block over the absolute value of its window mean, its block autocorrelation at lags "
                    "1 and 5, and the per-item r of the last checkpoint's estimate against the window's realized "
                    "term: " + "; ".join(
                        f"{_e1_name(r)} {t['median_block_std_over_abs_window_mean']:.1f}, "
                        f"{t['block_autocorrelation_by_lag']['1']:+.2f} / {t['block_autocorrelation_by_lag']['5']:+.2f}, "
                        f"r {t['per_item_r_last_checkpoint_drift_vs_window_realized']:+.2f}" for r, t in ts) + ".")
    return "\n".join(rows)


def table_e1_resists() -> str | None:
    d = _load("ledger.json")
    if d is None or "term_swaps" not in d["results"][0]:
        return None
    names = list(d["results"][0]["term_swaps"])
    rows = ["| law from the checkpoints' terms (slope / r) | " + " | ".join(_e1_name(r) for r in d["results"]) + " |",
            "|---" * (len(d["results"]) + 1) + "|"]
    for n in names:
        rows.append(f"| {n} | " + " | ".join(_sr(r["term_swaps"][n]) for r in d["results"]) + " |")
    rows.append("| closure: median abs(sum of realized terms) / abs(decay) | "
                + " | ".join(_f(r["closure"]["median_abs_sum_over_abs_decay"], 3) for r in d["results"]) + " |")
    return "\n".join(rows)


def table_e1_drift() -> str | None:
    d = _load("e1_drift.json")
    if d is None:
        return None
    rows = ["| E1 variant | checkpoints x drift batches | total batches | slope / r |", "|---|---|---|---|"]
    for r in d["results"]:
        for p in r["precision"]:
            rows.append(f"| {_e1_name(r)} | {p['checkpoints']} x {p['groups'] * r['group_batches']} | "
                        f"{p['drift_batches_total']} | {_f(p['slope'])} / {_f(p['pearson_r'])} |")
    rows.append("")
    for r in d["results"]:
        ts = r["time_structure"]
        lags = ts["noise_free_autocorrelation_by_lag_median"]
        sp = ts["checkpoint_spacing_steps"]
        rows.append(f"{_e1_name(r)}: the drift's spread along the window is "
                    f"{ts['median_temporal_std_over_between_item_std_of_window_mean']:.0f}x the spread of its window "
                    f"mean between items; batch noise of {r['group_batches']} batches: "
                    f"{ts['median_batch_noise_std_per_group_over_temporal_std']:.2f}x the temporal spread; "
                    f"autocorrelation " + ", ".join(f"{_f(v, 2)} at {int(k) * sp} steps" for k, v in list(lags.items())[:4])
                    + ".")
    return "\n".join(rows)
