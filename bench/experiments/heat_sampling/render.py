"""The heat-sampling study's tables and figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.experiments.heat_sampling.settings import PROPOSALS, TARGETS, VARIANTS


def tables(d: dict[str, Any]) -> dict[str, str]:
    out = {"heat-sampling-proposals": table_proposals(d), "heat-sampling-drift-screen": table_screen(d)}
    if all("coverage" in s for s in d["sets"].values()):
        out["heat-sampling-coverage"] = table_coverage(d)
    if "verdict" in d:
        out["heat-sampling-engine"] = table_engine(d)
    return out


def table_proposals(d: dict[str, Any]) -> str:
    rows = [
        "| set | proposal | level p5 / median / p95 | a row alone p5 – p95 | mean squared log error |",
        "|---|---|---|---|---|",
    ]
    for name, s in d["sets"].items():
        for m, v in s["proposals"].items():
            tag = " (reported only)" if not v["independent"] else ""
            rows.append(
                f"| {name} | {m}{tag} | {v['level_p5']:.2f} / {v['level_median']:.2f} / {v['level_p95']:.2f} | "
                f"{v['row_p5']:.2f} – {v['row_p95']:.2f} | {v['msle']:.3f} |"
            )
    dec = d["proposal_decision"]
    cfg = d["config"]
    rows += [
        "",
        f"Stage A: {cfg['replicates']} replicates of a pool of {cfg['pool']} batches from the truth pool of "
        f"{cfg['truth_batches']}, M = {cfg['batches']} drawn from it; level: the median over words of estimate / "
        f"truth. Decision: **{dec['proposal']}** (the smallest mean squared log error of the rows' heat on the worse "
        f"set among the independent draws).",
    ]
    return "\n".join(rows)


def table_engine(d: dict[str, Any]) -> str:
    rows = [
        "| set | heat batches | median V2 max/min over seeds | relative-heat coverage [95% CI] | cross-seed r_eq | "
        "V2 coverage | r_eq half-width (median) | wall time (median) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in d["sets"].items():
        e = s["engine"]
        for variant in VARIANTS:
            v = e[variant]
            lo, hi = v["heat_rel_coverage_ci95"]
            label = "plain (first M)" if variant == "plain" else "drawn by energy (default)"
            ratio = "" if variant == "plain" else f" ({e['wall_ratio']:.2f}× plain)"
            rows.append(
                f"| {name} | {label} | {v['level_ratio']:.2f} | {v['heat_rel_coverage']:.3f} [{lo:.2f}, {hi:.2f}] | "
                f"{v['cross_seed_r_eq']:.3f} | {v['V2_coverage']:.3f} | ±{v['r_eq_half_width_median']:.0%} | "
                f"{v['seconds_median']:.0f} s{ratio} |"
            )
    checks = d["verdict"]["checks"]
    missed = [f"{s}: {k}" for s, c in checks.items() for k, ok in c.items() if not ok]
    rows += [
        "",
        f"{d['config']['seeds']} seeds per variant, the engine's defaults (M = 16, K = 8, M_D = 1 024), one thread. "
        f"Targets: max/min ≤ {TARGETS['level_ratio_max']:g}, coverage in [{TARGETS['coverage'][0]}, "
        f"{TARGETS['coverage'][1]}], cross-seed ≥ {TARGETS['cross_seed_min']}, wall time ≤ "
        f"{TARGETS['wall_ratio_max']}× plain: "
        + ("**met on both sets**." if d["verdict"]["met"] else f"**not met**: {', '.join(missed)}."),
    ]
    return "\n".join(rows)


def table_screen(d: dict[str, Any]) -> str:
    rows = ["| set | screened pool S | drift batches M_D' | cost (gradients) | se_D² × time gain: median [p10, p90] |"]
    rows.append("|---|---|---|---|---|")
    for name, s in d["sets"].items():
        sc = s["drift_screen"]
        for g in sc["designs"]:
            rows.append(
                f"| {name} | {g['screened_pool']} | {g['drift_batches']} | {g['cost']:.0f} | "
                f"{g['gain_median']:.2f} [{g['gain_p10']:.2f}, {g['gain_p90']:.2f}] |"
            )
    f = [s["drift_screen"]["proxy_cost"] for s in d["sets"].values()]
    gains = [g["gain_median"] for s in d["sets"].values() for g in s["drift_screen"]["designs"]]
    rows += [
        "",
        f"Against the plain M_D = {d['config']['pool']} (cost {d['config']['pool']}); the forward-only proxy costs "
        f"{min(f):.2f}–{max(f):.2f} of a full gradient here. Adopted only at a gain ≥ 1.5 on both sets: "
        + ("adopted." if max(gains) >= 1.5 else f"**not adopted** (best median gain {max(gains):.2f})."),
    ]
    return "\n".join(rows)


def figures(result: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = result["sets"]
    has_engine = all("engine" in s for s in sets.values())
    fig, axes = plt.subplots(1, 2 if has_engine else 1, figsize=(12 if has_engine else 6.5, 4.8), squeeze=False)
    ax = axes[0][0]
    props = PROPOSALS
    for j, (name, s) in enumerate(sets.items()):
        xs = np.arange(len(props)) + (j - 0.5) * 0.3
        p = s["proposals"]
        med = np.array([p[m]["level_median"] for m in props])
        lo = np.array([p[m]["level_p5"] for m in props])
        hi = np.array([p[m]["level_p95"] for m in props])
        ax.errorbar(xs, med, yerr=[med - lo, hi - med], fmt="o", color=f"C{j}", ecolor=f"C{j}", alpha=0.9,
                    elinewidth=1.2, capsize=3, label=f"{name} words")  # fmt: skip
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(props)), [m.replace("_", "\n") for m in props])
    ax.set_ylabel("heat level / truth (median over words)")
    ax.set_title(
        "Stage A: the level at M = 16, 90% of replicates\n(the plain draw misses the rare batches)", fontsize=10
    )
    ax.legend(fontsize=8, loc="lower right")
    if has_engine:
        ax = axes[0][1]
        for j, (name, s) in enumerate(sets.items()):
            for k, variant in enumerate(VARIANTS):
                ratios = s["engine"][variant]["median_V2_over_truth"]
                x = j * 2.5 + k
                ax.scatter(np.full(len(ratios), x), ratios, color=f"C{k}", s=18, alpha=0.8,
                           label=("plain (first M)" if k == 0 else "drawn by energy") if j == 0 else None)  # fmt: skip
        ax.axhline(1.0, color="0.5", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks([0.5, 3.0], list(sets))
        ax.set_ylabel("median V2 / truth, one point per seed")
        ax.set_title("Stage B: the engine at its defaults, 8 seeds per variant", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "heat_sampling.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def table_coverage(d: dict[str, Any]) -> str:
    rows = [
        "| set | heat batches M | proposal | the jackknife's coverage (half-width) | with the rows' pool error |",
        "|---|---|---|---|---|",
    ]
    for name, s in d["sets"].items():
        for r in s["coverage"]["rows"]:
            rows.append(
                f"| {name} | {r['M']} | {r['proposal']} | {r['coverage']:.3f} (±{r['half_width']:.3f}) | "
                f"{r['coverage_with_pool']:.3f} (±{r['half_width_with_pool']:.3f}) |"
            )
    c = next(iter(d["sets"].values()))["coverage"]
    rows += [
        "",
        f"Exploratory (stage D, added after stage B's first set was seen): {c['replicates']} replicates of a pool of "
        f"{d['config']['pool']} from the truth pool, K = {c['groups']}, 95% intervals of the relative heat against "
        "its truth; half-widths in log units (median).",
    ]
    return "\n".join(rows)
