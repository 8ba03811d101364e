"""Stages A (the proposal), C (the drift screen) and B (the engine at its defaults) of the heat-sampling
study, and the verdict against issue 39's targets."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import numpy as np

from bench.experiments.heat_sampling.settings import (
    COVERAGE_M,
    COVERAGE_PROPOSALS,
    JSON,
    MODEL,
    PARAMS,
    PROPOSALS,
    REPORTED_ONLY,
    SCREENS,
    TARGETS,
    VARIANTS,
    Config,
)
from bench.harness import Context, resumable

# ---------------------------------------------------------------------------
# stage A: the proposal


def proposal(method: str, energy: np.ndarray) -> np.ndarray:
    """q over a pool of batches with energies ``energy`` (the engine's :func:`heat_proposal`)."""
    from normfast.engine.directions import heat_proposal

    return heat_proposal(energy, method)


def stage_a(t: dict[str, Any], cfg: Config, seed: int = 1) -> dict[str, Any]:
    """Every proposal over R replicates of a pool of N from the truth pool, M draws each."""
    c = np.asarray(t["c"], dtype=np.float64)
    e = np.asarray(t["energy"])
    v2 = np.asarray(t["V2_true"])
    n_t, m, n = c.shape[0], cfg.batches, cfg.pool
    rng = np.random.default_rng(seed)
    methods = PROPOSALS + REPORTED_ONLY
    levels = {k: [] for k in methods}
    logs = {k: [] for k in methods}
    zeros = {k: 0 for k in methods}
    for _ in range(cfg.replicates):
        pool = rng.choice(n_t, n, replace=False)
        for method in methods:
            if method == "uniform":  # the plain draw: M distinct batches of the pool, equal weights
                picks, w = rng.choice(pool, m, replace=False), np.ones(m)
            elif method == "stratified":
                q = proposal("mixture", e[pool])
                order = np.argsort(e[pool])
                cdf = np.cumsum(q[order])
                u = (np.arange(m) + rng.random(m)) / m
                j = order[np.minimum(np.searchsorted(cdf, u * cdf[-1]), n - 1)]
                picks, w = pool[j], 1.0 / (n * q[j])
            else:
                q = proposal(method, e[pool])
                j = rng.choice(n, m, replace=True, p=q)
                picks, w = pool[j], 1.0 / (n * q[j])
            est = (w[:, None] * c[picks]).mean(0)
            zeros[method] += int((est <= 0).sum())
            with np.errstate(divide="ignore"):
                lr = np.log(est / v2)
            levels[method].append(float(np.exp(np.median(lr))))
            logs[method].append(lr)
    out = {}
    for method in methods:
        lr = np.asarray(logs[method])
        finite = np.isfinite(lr)
        ratio = np.exp(lr[finite])
        lv = np.asarray(levels[method])
        out[method] = {
            "level_p5": float(np.quantile(lv, 0.05)),
            "level_median": float(np.median(lv)),
            "level_p95": float(np.quantile(lv, 0.95)),
            "row_p5": float(np.quantile(ratio, 0.05)),
            "row_p95": float(np.quantile(ratio, 0.95)),
            "msle": float(np.mean(lr[finite] ** 2)),
            "zero_share": zeros[method] / lr.size,
            "independent": method not in REPORTED_ONLY,
        }
    return out


def choose_proposal(stage: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Stage A's decision: the independent-draw proposal with the smallest mean squared log error on the
    worse set."""
    worst = {m: max(s[m]["msle"] for s in stage.values()) for m in PROPOSALS}
    chosen = min(PROPOSALS, key=lambda m: worst[m])
    return {"proposal": chosen, "worst_msle": worst}


# ---------------------------------------------------------------------------
# stage C: the drift screen


def stage_c(t: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """The drift's ``se_D² × time`` of each screened design against the plain M_D (module docstring)."""
    r = np.asarray(t["r"], dtype=np.float64)  # [N_T, rows]
    proxy = np.asarray(t["proxy"])
    n_t = r.shape[0]
    f = float(np.median(t["proxy_seconds"]) / np.median(t["grad_seconds"]))
    sigma2 = r.var(0, ddof=1)
    q = np.sqrt(proxy) / np.sqrt(proxy).sum()
    w = 1.0 / (n_t * q)
    rbar = r.mean(0)
    vq = (q[:, None] * (w[:, None] * r - rbar[None]) ** 2).sum(0)  # one draw's variance of w r under q
    drift_batches = cfg.pool  # the plain M_D
    plain = sigma2 / drift_batches * drift_batches  # variance × cost
    designs = []
    scale = cfg.pool / 1024  # the designs at the quick size shrink with the pool
    for s_pool, m_d in SCREENS:
        s_pool, m_d = max(2, int(s_pool * scale)), max(2, int(m_d * scale))
        var = sigma2 / s_pool + vq / m_d
        cost = m_d + s_pool * f
        gain = plain / (var * cost)
        designs.append(
            {
                "screened_pool": s_pool,
                "drift_batches": m_d,
                "cost": cost,
                "gain_median": float(np.median(gain)),
                "gain_p10": float(np.quantile(gain, 0.1)),
                "gain_p90": float(np.quantile(gain, 0.9)),
            }
        )
    return {"proxy_cost": f, "plain_drift_batches": drift_batches, "designs": designs}


# ---------------------------------------------------------------------------
# stage D (exploratory): where the relative heat's intervals lose their coverage


def stage_d(t: dict[str, Any], cfg: Config, seed: int = 2, groups: int = 8) -> dict[str, Any]:
    """The engine's jackknife interval of the relative heat against the truth, per proposal and M, with
    and without the rows' relative pool error (the module docstring's amendment)."""
    from scipy.stats import t as student

    c = np.asarray(t["c"], dtype=np.float64)
    e = np.asarray(t["energy"])
    log_true = np.log(np.asarray(t["V2_true"]))
    rel_true = log_true - np.median(log_true)
    n_t, n = c.shape[0], cfg.pool
    quantile = student.ppf(0.975, groups - 1)
    rng = np.random.default_rng(seed)
    replicates = max(20, cfg.replicates // 20)
    out: dict[str, Any] = {"replicates": replicates, "groups": groups, "rows": []}
    for m in COVERAGE_M if cfg.pool >= 1024 else (cfg.batches,):
        for method in COVERAGE_PROPOSALS:
            plain_hits, with_hits, widths, plain_widths = [], [], [], []
            for _ in range(replicates):
                pool = rng.choice(n_t, n, replace=False)
                if method == "uniform":
                    picks, w = rng.choice(pool, m, replace=False), np.ones(m)
                else:
                    q = proposal(method, e[pool])
                    j = rng.choice(n, m, replace=True, p=q)
                    picks, w = pool[j], 1.0 / (n * q[j])
                terms = w[:, None] * c[picks]  # [m, rows]
                est = terms.mean(0)
                group = np.arange(m) % groups
                loo = np.stack([terms[group != g].mean(0) for g in range(groups)], 1)
                rel = np.log(est) - np.median(np.log(est))
                rel_loo = np.log(loo) - np.median(np.log(loo), 0)[None]
                jack = np.sqrt(((rel_loo - rel_loo.mean(1, keepdims=True)) ** 2).sum(1) * (groups - 1) / groups)
                share = c[picks] / est[None]  # each draw's share of each row's heat
                dev = share - np.median(share, 1, keepdims=True)  # less the share the rows have in common
                pool_rel = np.sqrt((w[:, None] * dev**2).mean(0) / n)
                total = np.hypot(jack, pool_rel)
                err = np.abs(rel - rel_true)
                plain_hits.append(np.mean(err <= quantile * jack))
                with_hits.append(np.mean(err <= quantile * total))
                plain_widths.append(np.median(quantile * jack))
                widths.append(np.median(quantile * total))
            out["rows"].append(
                {
                    "M": m,
                    "proposal": method,
                    "coverage": float(np.mean(plain_hits)),
                    "half_width": float(np.median(plain_widths)),
                    "coverage_with_pool": float(np.mean(with_hits)),
                    "half_width_with_pool": float(np.median(widths)),
                }
            )
    return out


# ---------------------------------------------------------------------------
# stage B: the engine


def probe_config(variant: str, seed: int, cfg: Config) -> Any:
    """The engine's defaults for these words, the heat's sampling as the variant says."""
    import normfast

    return normfast.ProbeConfig(
        params=PARAMS,
        output="pooled",
        optimizer="sgd",
        lr=1e-3,
        weight_decay=1e-2,
        batch_size=cfg.batch_size,
        seed=seed,
        heat_sampling="uniform" if variant == "plain" else "energy",
        **({} if cfg.pool == 1024 else {"drift_batches": cfg.pool, "batches": cfg.batches}),
    )


ROW_COLUMNS = ("V2", "se_V2", "heat_rel", "se_heat_rel", "r_eq", "r_eq_lo", "r_eq_hi", "valid")


def engine_run(load: Any, words: list[str], variant: str, seed: int, cfg: Config) -> dict[str, Any]:
    """One ``normfast.probe`` of the set's words: the rows the read-outs need, the level and the time."""
    import normfast

    encoder = load()
    config = probe_config(variant, seed, cfg)
    t0 = time.perf_counter()
    res = normfast.probe(encoder, words, "simcse", None, config, progress=False, model_name=MODEL)
    seconds = time.perf_counter() - t0
    rows = {k: [float(x) if k != "valid" else bool(x) for x in res.column(k)] for k in ROW_COLUMNS}
    ref = res.metadata["heat_reference"]
    return {
        "seconds": seconds,
        "groups": res.metadata["groups"],
        "median_V2": float(np.nanmedian(res.column("V2"))),
        "log_level": ref["log_level"],
        "se_log_level": ref["se_log_level"],
        "heat_sampling": res.metadata["heat_sampling"],
        "rows": rows,
    }


def stage_b(ctx: Context, name: str, load: Any, words: list[str], t: dict[str, Any], cfg: Config, units: list) -> dict:
    """Every (variant, seed) run of one set, alternating the variants' order, and the set's read-outs."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    key = {"set": name, "words": words, "cfg": asdict(cfg) | {"stages": None, "replicates": None, "bootstrap": None}}
    for seed in range(cfg.seeds):
        order = VARIANTS if seed % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            unit = f"{name}_{variant}_seed{seed}"
            runs[variant].append(
                resumable(ctx, unit, key, lambda v=variant, s=seed: engine_run(load, words, v, s, cfg), JSON)
            )
            units.append(unit)
            print(f"  {unit}: {runs[variant][-1]['seconds']:.0f} s", flush=True)
    return readouts(runs, np.asarray(t["V2_true"]))


def readouts(runs: dict[str, list[dict[str, Any]]], v2_true: np.ndarray) -> dict[str, Any]:
    """Per variant: the level's spread over seeds, the relative heat's and V2's coverage, the cross-seed check
    of the r_eq intervals, and the wall time (with the sampled variant's ratio to the plain one's)."""
    from normfast.engine.estimators import t_quantile

    log_true = np.log(v2_true)
    rel_true = log_true - np.median(log_true)
    out: dict[str, Any] = {}
    for variant, rs in runs.items():
        t = t_quantile(int(rs[0]["groups"]) - 1)
        col = {k: np.array([r["rows"][k] for r in rs], dtype=float) for k in ROW_COLUMNS}  # [seeds, rows]
        valid = col["valid"].astype(bool)
        with np.errstate(invalid="ignore"):
            rel_hit = np.abs(col["heat_rel"] - rel_true[None]) <= t * col["se_heat_rel"]
            v2_hit = np.abs(col["V2"] - v2_true[None]) <= t * col["se_V2"]
        rel_hit = np.where(valid, rel_hit, np.nan)
        v2_hit = np.where(valid, v2_hit, np.nan)
        cross = []
        for a in range(len(rs)):
            for b in range(len(rs)):
                if a != b:
                    ok = valid[a] & valid[b]
                    held = (col["r_eq_lo"][a] <= col["r_eq"][b]) & (col["r_eq"][b] <= col["r_eq_hi"][a])
                    cross.append(float(np.mean(held[ok])))
        medians = np.array([r["median_V2"] for r in rs])
        out[variant] = {
            "seeds": len(rs),
            "median_V2": medians.tolist(),
            "median_V2_over_truth": (medians / np.median(v2_true)).tolist(),
            "level_ratio": float(medians.max() / medians.min()),
            "heat_rel_coverage": float(np.nanmean(rel_hit)),
            "heat_rel_coverage_ci95": _boot(rel_hit),
            "V2_coverage": float(np.nanmean(v2_hit)),
            "cross_seed_r_eq": float(np.mean(cross)),
            "cross_seed_r_eq_min": float(np.min(cross)),
            "r_eq_half_width_median": float(np.nanmedian((col["r_eq_hi"] - col["r_eq_lo"]) / (2 * col["r_eq"]))),
            "seconds_median": float(np.median([r["seconds"] for r in rs])),
            "effective_sample_size_median": float(
                np.median([r["heat_sampling"].get("effective_sample_size", np.nan) for r in rs])
            ),
        }
    if "plain" in out and "sampled" in out:
        out["wall_ratio"] = out["sampled"]["seconds_median"] / out["plain"]["seconds_median"]
    return out


def _boot(hits: np.ndarray, seed: int = 0, n_boot: int = 2000) -> list[float]:
    """95% interval of the mean hit rate, resampling seeds (rows: seeds)."""
    rng = np.random.default_rng(seed)
    per = np.nanmean(hits, axis=1)
    boots = [np.mean(per[rng.integers(0, len(per), len(per))]) for _ in range(n_boot)]
    return [float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))]


def verdict(sets: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets for the default (the sampled variant) on every set."""
    checks = {}
    for name, s in sets.items():
        e = s["engine"]
        d = e["sampled"]
        checks[name] = {
            "level_ratio": d["level_ratio"] <= TARGETS["level_ratio_max"],
            "coverage": TARGETS["coverage"][0] <= d["heat_rel_coverage"] <= TARGETS["coverage"][1],
            "cross_seed": d["cross_seed_r_eq"] >= TARGETS["cross_seed_min"],
            "wall_ratio": e["wall_ratio"] <= TARGETS["wall_ratio_max"],
        }
    return {"checks": checks, "met": all(all(c.values()) for c in checks.values())}
