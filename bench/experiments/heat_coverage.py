"""Heat coverage on held-out words: do the heat's 95% intervals hold at the default M, outside the calibration?

    python -m bench run heat_coverage --out bench/results/heat_coverage   # the committed result
    python -m bench run heat_coverage --quick                               # toy size: exercises the code

Protocol v1 (issue 34; fixed before any of its runs):

* Probe: all-MiniLM-L6-v2 (the packaged weights), the last transformer layer
  probed (``encoder\\.layer\\.5\\.``), pooled output, SimCSE (its default
  temperature) on the probe words themselves, SGD lr 1e-3, wd 1e-2, batch
  size 32: the demo's objective and optimizer, one row per word. The drift is
  the per-batch drift of the heat batches (``drift_batches=None``): the heat
  and its error bars do not read the drift's batches, and it keeps each run
  short.
* Inputs outside the calibration's (synthetic concepts; a MiniLM head on
  WordNet pairs): two sets of English words from wordfreq's list (letters
  only, two letters or more), ``common`` = ranks 2 000-2 399 and ``rare`` =
  ranks 20 000-20 399.
* Truth, per set: one run with M = 2 048 heat batches (seed 999 999, no
  error bars): ``V2_true`` per word; the relative heat's truth is
  ``log V2_true`` minus its median over the words, the common level's truth is
  that median. Its noise is 1/128 of the tested heat's variance at M = 16.
  (Amended before any run from 4 096, for time: a 64-batch run of a set takes
  about 35 s on one core here.)
* Tested variants, R = 16 replicates each (seed r = 0..15 for replicate r, the
  same seeds for every variant):
  ``M16_K8`` (the default), ``M16_K16``, ``M32_K8``, ``M64_K8``.
* Intervals: the table's, as the library writes them: ``heat_rel +- t se_heat_rel``,
  ``V2 +- t se_V2`` (lower end clipped at 0), and the metadata's
  ``log_level +- t se_log_level``; t = the 97.5% Student quantile with K-1
  degrees of freedom.
* Read-outs per (set, variant): the coverage of the relative heat and of V2
  over (word, replicate) pairs, with a 95% bootstrap interval over replicates;
  the common level's hits over the R replicates; the cross-seed check of the
  issue (replicates paired 2j, 2j+1: the share of words whose one run's
  interval holds the other run's value; calibrated intervals of two runs of
  equal variance give about 0.83 for 95% intervals); the spread of
  ``z = (heat_rel - truth) / se_heat_rel`` (sd, share |z| > 3) and how much
  of the relative heat's error variance is the reference level's (the
  variance over replicates of the median log V2, against the mean squared
  error of heat_rel); the dominance of one batch group (per word, the largest
  share of the summed squared deviations one group holds,
  ``1 - (M - n_g - 1) V2_-g / ((M - 1) V2)``, its median over words).
* Decision (the default M and K): the cheapest variant (fewest heat batches,
  then fewest groups) whose relative-heat coverage lies in [0.90, 0.98] on
  both sets. If none does, the variant closest to 0.95 on the worse set is
  reported as such, and the default is not changed by this study.
* The absolute level (V2, and so r_eq): reported, not targeted. A run-level
  flag "level not resolved" is tested as written here: raised when the median
  dominance share exceeds 0.5 or when the common level's 95% half-width
  exceeds a factor 2; reported is how often it is raised on each set at the
  chosen default, beside that set's V2 coverage.

Writes OUT/heat_coverage.json (OUT defaults to runs/heat_coverage).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.harness import Context, JsonStyle

RESULTS = ("heat_coverage.json",)
FIGURES = ()
TABLES = ("heat_coverage",)
JSON = JsonStyle(newline=False, strict=False)
PARAMS = r"encoder\.layer\.5\."
SETS = {"common": 2000, "rare": 20000}
VARIANTS = {"M16_K8": (16, 8), "M16_K16": (16, 16), "M32_K8": (32, 8), "M64_K8": (64, 8)}
BAND = (0.90, 0.98)
DOMINANCE_FLAG = 0.5
LEVEL_FLAG = math.log(2.0)


@dataclass
class Config:
    words: int = field(default=400, metadata={"help": "words per set"})
    truth_batches: int = field(default=2048, metadata={"help": "heat batches of the truth run"})
    replicates: int = field(default=16, metadata={"help": "seeds per variant"})
    batch_size: int = 32
    threads: int = 1

    @classmethod
    def quick(cls) -> "Config":
        return cls(words=24, truth_batches=64, replicates=2, batch_size=8)


def _config(m: int, k: int | None, seed: int, batch_size: int):
    import normfast

    extra = dict(groups=k) if k else dict(uncertainty=False)
    return normfast.ProbeConfig(
        params=PARAMS,
        output="pooled",
        optimizer="sgd",
        lr=1e-3,
        weight_decay=1e-2,
        batches=m,
        drift_batches=None,
        batch_size=batch_size,
        seed=seed,
        **extra,
    )


def _log(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=float)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(x > 0, np.log(np.where(x > 0, x, 1.0)), np.nan)


def _dominance(v2: np.ndarray, loo: np.ndarray, m: int, k: int) -> np.ndarray:
    """Per word, the largest share of the summed squared deviations that one group holds."""
    counts = np.array([len(range(g, m, k)) for g in range(k)], dtype=float)
    rest = (m - counts - 1)[None, :] * loo / ((m - 1) * v2[:, None])
    return np.nanmax(1.0 - rest, axis=1)


def _boot_ci(hits: np.ndarray, seed: int = 0, n_boot: int = 2000) -> list[float]:
    """95% interval of the mean hit rate, resampling replicates (rows: replicates, columns: words)."""
    rng = np.random.default_rng(seed)
    per_rep = np.nanmean(hits, axis=1)
    boots = [np.mean(per_rep[rng.integers(0, len(per_rep), len(per_rep))]) for _ in range(n_boot)]
    return [float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))]


def _one_set(encoder, words: list[str], cfg: Config, progress: bool) -> dict[str, Any]:
    import normfast
    from normfast.engine.estimators import t_quantile

    def run(c):
        return normfast.probe(encoder, words, "simcse", None, c, progress=progress, model_name="all-MiniLM-L6-v2")

    t0 = time.perf_counter()
    truth = run(_config(cfg.truth_batches, None, 999_999, cfg.batch_size))
    v2_true = truth.column("V2")
    log_true = _log(v2_true)
    level_true = float(np.nanmedian(log_true))
    rel_true = log_true - level_true
    out: dict[str, Any] = {
        "words": len(words),
        "truth": {"M": cfg.truth_batches, "seconds": time.perf_counter() - t0, "median_V2": float(np.median(v2_true))},
        "variants": {},
    }
    for name, (m, k) in VARIANTS.items():
        t = t_quantile(k - 1)
        rel_hit, v2_hit, level_hit, z, dom, flags, rel_err, levels = [], [], [], [], [], [], [], []
        runs = []
        t0 = time.perf_counter()
        for r in range(cfg.replicates):
            res = run(_config(m, k, r, cfg.batch_size))
            rel, se_rel = res.column("heat_rel"), res.column("se_heat_rel")
            v2, se_v2 = res.column("V2"), res.column("se_V2")
            loo = np.stack(res.column("heat_loo"))
            ref = res.metadata["heat_reference"]
            rel_hit.append(np.abs(rel - rel_true) <= t * se_rel)
            v2_hit.append((v2_true >= np.maximum(v2 - t * se_v2, 0.0)) & (v2_true <= v2 + t * se_v2))
            level_hit.append(abs(ref["log_level"] - level_true) <= t * ref["se_log_level"])
            z.append((rel - rel_true) / se_rel)
            rel_err.append(rel - rel_true)
            levels.append(ref["log_level"])
            d = _dominance(v2, loo, m, k)
            dom.append(float(np.nanmedian(d)))
            flags.append(bool(np.nanmedian(d) > DOMINANCE_FLAG or t * ref["se_log_level"] > LEVEL_FLAG))
            runs.append((rel, se_rel, v2, se_v2))
        rel_hit, v2_hit, z = np.array(rel_hit, float), np.array(v2_hit, float), np.concatenate(z)
        pairs = [(runs[i], runs[i + 1]) for i in range(0, len(runs) - 1, 2)]
        cross_rel = np.concatenate([np.abs(a[0] - b[0]) <= t * a[1] for a, b in pairs]) if pairs else np.zeros(0)
        cross_v2 = np.concatenate([np.abs(a[2] - b[2]) <= t * a[3] for a, b in pairs]) if pairs else np.zeros(0)
        mse = float(np.nanmean(np.square(np.concatenate(rel_err))))
        out["variants"][name] = {
            "M": m,
            "K": k,
            "t": t,
            "heat_rel_coverage": float(np.nanmean(rel_hit)),
            "heat_rel_coverage_ci95": _boot_ci(rel_hit),
            "V2_coverage": float(np.nanmean(v2_hit)),
            "V2_coverage_ci95": _boot_ci(v2_hit),
            "level_hits": int(np.sum(level_hit)),
            "level_runs": len(level_hit),
            "cross_seed_heat_rel": float(np.mean(cross_rel)) if cross_rel.size else math.nan,
            "cross_seed_V2": float(np.mean(cross_v2)) if cross_v2.size else math.nan,
            "z_sd": float(np.nanstd(z)),
            "z_beyond_3": float(np.nanmean(np.abs(z) > 3)),
            "heat_rel_mse": mse,
            "reference_variance_share": float(np.var(levels) / mse) if mse > 0 else math.nan,
            "dominance_median": float(np.median(dom)),
            "level_unresolved_share": float(np.mean(flags)),
            "seconds": time.perf_counter() - t0,
        }
        v = out["variants"][name]
        print(
            f"  {name}: heat_rel coverage {v['heat_rel_coverage']:.3f} {v['heat_rel_coverage_ci95']}, V2 "
            f"{v['V2_coverage']:.3f}, cross-seed {v['cross_seed_heat_rel']:.3f} / {v['cross_seed_V2']:.3f}, "
            f"z sd {v['z_sd']:.2f}, dominance {v['dominance_median']:.2f} ({v['seconds']:.0f} s)",
            flush=True,
        )
    return out


def decide(sets: dict[str, Any]) -> dict[str, Any]:
    """The protocol's decision: the cheapest variant in the band on both sets, else the closest."""
    order = sorted(VARIANTS, key=lambda n: VARIANTS[n])
    ok = [n for n in order if all(BAND[0] <= s["variants"][n]["heat_rel_coverage"] <= BAND[1] for s in sets.values())]
    if ok:
        return {"chosen": ok[0], "in_band": True, "qualifying": ok}
    worst = {n: min(s["variants"][n]["heat_rel_coverage"] for s in sets.values()) for n in order}
    closest = min(order, key=lambda n: abs(worst[n] - 0.95))
    return {"chosen": closest, "in_band": False, "qualifying": []}


def run(config: Config, ctx: Context) -> dict[str, Any]:
    import torch

    import normfast
    from normfast.data.word_frequencies import top_words
    from normfast.engine.runner import library_versions

    torch.set_num_threads(config.threads)
    encoder = normfast.load_encoder("all-MiniLM-L6-v2")
    start = 0 if ctx.quick else None
    ranked = top_words(max(SETS.values()) + config.words)
    sets = {}
    for name, rank in SETS.items():
        first = start if start is not None else rank
        if ctx.quick and name == "rare":
            first = config.words
        words = ranked[first : first + config.words]
        print(f"{name}: words of rank {first}-{first + config.words - 1}", flush=True)
        sets[name] = _one_set(encoder, words, config, ctx.progress) | {"first_rank": first}
    return {
        "experiment": "heat coverage on held-out words",
        "config": {**config.__dict__, "params": PARAMS, "variants": VARIANTS, "sets": SETS},
        "sets": sets,
        "decision": decide(sets),
        "versions": library_versions(),
    }


def tables(result: dict[str, Any]) -> dict[str, str]:
    rows = [
        "| set | variant | heat_rel coverage [95% CI] | V2 coverage [95% CI] | common level hits | cross-seed "
        "heat_rel / V2 | z sd | reference share of error | dominance | level flagged |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s, d in result["sets"].items():
        for n, v in d["variants"].items():
            lo, hi = v["heat_rel_coverage_ci95"]
            vlo, vhi = v["V2_coverage_ci95"]
            rows.append(
                f"| {s} | {n} | {v['heat_rel_coverage']:.3f} [{lo:.2f}, {hi:.2f}] | {v['V2_coverage']:.3f} "
                f"[{vlo:.2f}, {vhi:.2f}] | {v['level_hits']}/{v['level_runs']} | {v['cross_seed_heat_rel']:.3f} / "
                f"{v['cross_seed_V2']:.3f} | {v['z_sd']:.2f} | {v['reference_variance_share']:.2f} | "
                f"{v['dominance_median']:.2f} | {v['level_unresolved_share']:.2f} |"
            )
    dec = result["decision"]
    rows += [
        "",
        f"Decision: {dec['chosen']} ({'in the band on both sets' if dec['in_band'] else 'no variant in the band'}).",
    ]
    return {"heat_coverage": "\n".join(rows)}
