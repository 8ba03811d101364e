"""The README's compact blocks, rendered from the committed results of several studies.

``headline``: one row per study (its main figure and target, from the same JSON as the
study's own table); ``demo-excerpt``: the head of what ``normfast demo`` printed.
"""

from __future__ import annotations

from bench.harness import RESULTS_DIR, read_json


def _load(name: str) -> dict | None:
    """The committed result ``bench/results/<name>``, or None when absent."""
    path = RESULTS_DIR / name
    return read_json(path) if path.exists() else None


def table_demo_excerpt() -> str | None:
    """The README's excerpt of the demo's output: its head, up to the error-bar lines."""
    path = RESULTS_DIR / "demo" / "demo_output.txt"
    if not path.exists():
        return None
    lines = path.read_text().splitlines()
    end = next((i for i, ln in enumerate(lines) if ln.startswith("drift |D|")), len(lines) - 1)
    return "```\n" + "\n".join(lines[: end + 1]) + "\n...\n```"


def table_headline() -> str | None:
    """The README's one small table: the headline of each study, from the same JSON as its own table."""
    e1 = [_load("e1/equilibrium.json"), _load("e1/seed1/equilibrium.json")]
    a, b = _load("e2/e2_real_encoder_A.json"), _load("e2/e2_real_encoder_B.json")
    e4, hj, cal, be, st = (
        _load(n)
        for n in (
            "e4/e4_retrieval.json",
            "judgments/human_judgments.json",
            "calibration/calibration.json",
            "throughput/throughput.json",
            "streaming/streaming.json",
        )
    )
    heat = _load("heat_sampling/heat_sampling.json")
    if None in (*e1, a, b, e4, hj, cal, be, st, heat):
        return None

    def span(xs: list[float], fmt: str = ".3f") -> str:
        lo, hi = f"{min(xs):{fmt}}", f"{max(xs):{fmt}}"
        return lo if lo == hi else f"{lo}–{hi}"

    def ci(f: dict, key: str) -> str:
        lo, hi = f[f"{key}_ci95"]
        return f"{f[key]:.3f} [{lo:.3f}, {hi:.3f}]"

    runs = [r for d in e1 for r in d["results"]]
    target = f"slope in [{runs[0]['target']['slope'][0]}, {runs[0]['target']['slope'][1]}], r ≥ {{}}"
    rows = ["| result | measured | target | verdict |", "|---|---|---|---|"]
    for label, group, with_v3 in (
        ("SGD and heavy-ball", [r for r in runs if r["optimizer"] == "sgd"], False),
        ("AdamW, β1 = 0.9 and 0", [r for r in runs if r["optimizer"] == "adamw"], True),
    ):
        fits = [r["fits"]["dense_corrected_law"] for r in group]
        met = sum(r["target"]["met"] for r in group)
        fresh = [
            r["fits"]["dense_fresh_batch_corrected_law"]
            for r in group
            if "dense_fresh_batch_corrected_law" in r["fits"]
        ]
        v3 = (
            (
                f"; along fresh batches (v3): slope {span([f['slope'] for f in fresh])}, r "
                f"{span([f['pearson_r'] for f in fresh])}"
            )
            if fresh and with_v3
            else ""
        )
        rows.append(
            f"| E1, small encoders trained to equilibrium, {label} (2 seeds) | dense law along the steps' "
            f"own batches: slope {span([f['slope'] for f in fits])}, r {span([f['pearson_r'] for f in fits])}"
            f"{v3} | "
            f"{target.format(runs[0]['target']['pearson_r'])} | met in {met} of {len(group)} runs |"
        )
    snap = [d["snapshot_choice"]["scores"][d["snapshot_choice"]["winner"]]["targets_met"] for d in e1]
    rows.append(
        f"| E1, single-snapshot predictor `r_eq_snapshot` | met on {snap[0]} of 4 choice variants at "
        f"seed 0, {snap[1]} of 4 at a fresh seed | {target.format(runs[0]['target']['pearson_r'])} | "
        f"{'met' if min(snap) == 4 else 'not met'} |"
    )
    for d, label in ((b, "E2, MiniLM fine-tuned, B: projection head"), (a, "E2, MiniLM fine-tuned, A: no head")):
        f = d["fits"].get(f"{d['main_predictor']}_full_law") or d["fits"]["full_law"]  # A has one probe
        rows.append(
            f"| {label} | slope {ci(f, 'slope')}, r {ci(f, 'pearson_r')} | "
            f"{target.format(d['target']['pearson_r'])} | {'met' if d['target']['met'] else 'not met'} |"
        )
    h = e4["headline"]
    rows.append(
        f"| E4, retrieval, NDCG@10 of `cos · ‖d‖^α` over cosine | {h['gain_pct']:+.2f}% "
        f"[{h['gain_ci_pct'][0]:+.2f}, {h['gain_ci_pct'][1]:+.2f}] at α = {h['best_alpha']:+.1f} | "
        f"paper, text-only encoders: ≤ ~{h['paper_text_only_max_gain_pct']}% | "
        f"{'holds' if h['within_paper_claim'] else 'does not hold'} |"
    )
    gains = [
        f["test"]["gain"]
        for m in hj["models"].values()
        for s in ("wordsim353", "simlex999", "lee")
        for f in m[s]["folds"]
    ]
    rows.append(
        f"| Norms vs human judgments, held-out gain over cosine | "
        f"{sum(g['ci_low'] > 0 for g in gains)} of {len(gains)} gains above 0 (95% CI) | "
        f"a gain | no gain |"
    )
    k = str(cal["decision"]["default_K"])
    parts = [q for q in ("D", "V2", "heat_rel") if q in next(iter(cal["results"].values()))[k]]
    cov = {q: [m[k][q]["coverage"] for m in cal["results"].values()] for q in parts}
    names = {"D": "D", "V2": "V2", "heat_rel": "relative heat"}
    rows.append(
        f"| Error bars, coverage of the 95% intervals at K = {k} (the plain heat draw) | "
        + ", ".join(f"{names[q]} {span(cov[q])}" for q in parts)
        + " | "
        f"[{cal['band'][0]:.2f}, {cal['band'][1]:.2f}] | "
        f"{'met (point estimates)' if cal['decision']['met'] else 'not met'} |"
    )
    rows.append(heat_row(heat))
    r = be["ratios"]
    head = [v for key, v in r.items() if key.startswith("head/")]
    rows.append(
        f"| Speed on CPU, ratios in one run: head mode vs per-sample-gradient tools; jvp mode vs "
        f"per-probe Jacobians | {span(head, '.1f')}x; {r['jacrev/normfast_vs_jacrev']:.1f}x | | |"
    )
    ok = st["targets"]["largest_under_limit"] and st["targets"]["ratio_within_limit"]
    rows.append(
        f"| Streaming 10⁷ token probes: peak memory / that of 10⁶ | {st['peak_rss_ratio']:.3f} | "
        f"≤ {st['targets']['ratio_limit']}, < {st['targets']['peak_rss_limit_bytes'] / 1e9:.0f} GB | "
        f"{'met' if ok else 'not met'} |"
    )
    return "\n".join(rows)


def heat_row(d: dict) -> str:
    """The heat-sampling study's headline: the default draw's level across seeds and its intervals."""
    from bench.experiments.heat_sampling.settings import TARGETS

    e = {name: s["engine"] for name, s in d["sets"].items()}
    sampled = {name: v["sampled"] for name, v in e.items()}

    def per_set(key: str, fmt: str) -> str:
        return " / ".join(f"{v[key]:{fmt}}" for v in sampled.values())

    lo, hi = TARGETS["coverage"]
    plain = " / ".join(f"{v['plain']['level_ratio']:.0f}" for v in e.values())
    return (
        f"| The heat at the defaults (batches drawn by energy), held-out {' / '.join(sampled)} words, 8 seeds | "
        f"median V2 max/min {per_set('level_ratio', '.2f')} (plain draw: "
        f"{plain}); coverage: V2 "
        f"{per_set('V2_coverage', '.2f')}, relative heat {per_set('heat_rel_coverage', '.2f')}; cross-seed r_eq "
        f"{per_set('cross_seed_r_eq', '.2f')} | max/min ≤ {TARGETS['level_ratio_max']:g}, coverage in "
        f"[{lo:.2f}, {hi:.2f}], cross-seed ≥ {TARGETS['cross_seed_min']} | "
        f"{'met' if d['verdict']['met'] else 'not met'} |"
    )
