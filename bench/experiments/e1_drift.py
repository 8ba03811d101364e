"""E1 drift diagnostics: how precise must the drift be, and how fast does it move along the window?

For each variant: train as E1 does (``bench.experiments.e1``), then at every
checkpoint of the window probe the model ``--groups`` times, each time on
``--group-batches`` fresh virtual batches (independent seeds). From the per
checkpoint, per group drifts:

* precision: the trajectory-averaged full law with the drift from 1, 2, ...,
  G groups and every 1st, 2nd, 4th, ... checkpoint (heat and κ from all of
  them), against the observed window-mean norms -> slope and r per budget;
* time structure: the drift's autocorrelation along the window by lag, free of
  batch noise (covariances between *different* groups only), and the share of
  the drift's variance that is temporal rather than between items.

A diagnostic for the E1 protocol (which drift budget, which trajectory length
for a single snapshot); its numbers are quoted in the README's E1 section.

    python -m bench run e1_drift --variants mlp_bias,mlp_adamw_b0 --out runs/e1_drift
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from bench.common import fmt
from bench.experiments.e1 import e1_name, e1_setup
from bench.harness import Context, JsonStyle

RESULTS = ("e1_drift.json",)
FIGURES = ()
TABLES = ("e1-drift",)
JSON = JsonStyle(newline=False)


@dataclass
class Config:
    variants: str = field(default="mlp_bias,mlp_adamw_b0", metadata={"help": "comma-separated E1 variants"})
    groups: int = 4
    group_batches: int = 64
    probe_every: int | None = field(default=None, metadata={"help": "checkpoint spacing in steps (none: E1's)"})
    last: int | None = field(default=None, metadata={"help": "probe only the last N checkpoints of the window"})
    size: str = field(
        default="full",
        metadata={"choices": ("full", "quick"), "help": "E1's training configuration: E1Config() or its quick()"},
    )
    steps: int | None = field(default=None, metadata={"help": "override E1's training steps"})
    seed: int = 0

    @classmethod
    def quick(cls) -> "Config":
        return cls(size="quick")


def run_variant(name: str, cfg, data, groups: int, group_batches: int, progress: bool, last: int | None = None) -> dict:
    from tqdm.auto import tqdm

    import normfast
    from bench.experiments.e1.data import VARIANT_SPECS, probe_config
    from bench.experiments.e1.laws import law_norms
    from bench.experiments.e1.training import load_checkpoint, train
    from normfast.core.stats import loglog_fit

    PairSource, InfoNCE, probe = normfast.PairSource, normfast.InfoNCE, normfast.probe
    variant = VARIANT_SPECS[name]
    t0 = time.perf_counter()
    run = train(variant, cfg, data, meter=False, fresh_meter=False, progress=progress)
    if last:
        run.checkpoints = run.checkpoints[-last:]
    n = data.x.shape[0]
    items = list(range(n))
    pairs = PairSource.from_iterable([(int(a), int(b)) for a, b in data.pairs])
    objective = InfoNCE(temperature=cfg.temperature)
    pcfg = probe_config(variant, cfg, n, batches=group_batches, drift_batches=group_batches)
    adam = variant.optimizer == "adamw"
    dcol, qcol = ("D_w", "Q_w") if adam else ("D", "Q")
    D = np.zeros((len(run.checkpoints), groups, n))
    Q = np.zeros((len(run.checkpoints), n))
    K = np.zeros((len(run.checkpoints), n))
    for ci, ck in enumerate(tqdm(run.checkpoints, desc=f"{name}: probe", disable=not progress, leave=False)):
        load_checkpoint(run.encoder, ck)
        for g in range(groups):
            res = probe(
                run.encoder,
                items,
                objective,
                pairs,
                replace(pcfg, seed=(cfg.seed * 7919 + ci) * 131 + g),
                progress=False,
                second_moments=ck.second_moments,
            )
            D[ci, g] = res.column(dcol)
            Q[ci] += res.column(qcol) / groups
            K[ci] += res.column("kappa") / groups
    obs = run.observed
    precision = []
    g_list = [g for g in (1, 2, 4, 8, 16) if g <= groups]
    for stride in (1, 2, 4, 8, 16):
        for g in g_list:
            d = D[::stride, :g].mean((0, 1))
            stats = {dcol: d, qcol: Q.mean(0), "kappa": K.mean(0)}
            fit = loglog_fit(law_norms(variant, stats, cfg), obs)
            precision.append(
                {
                    "checkpoints": int(D[::stride].shape[0]),
                    "groups": g,
                    "drift_batches_total": int(D[::stride].shape[0] * g * group_batches),
                    "slope": fit["slope"],
                    "pearson_r": fit["pearson_r"],
                }
            )
    # noise-free time structure: covariances across different groups only
    Dc = D - D.mean((0, 1))
    T = D.shape[0]
    pairs_g = [(a, b) for a in range(groups) for b in range(groups) if a != b]

    def cross_cov(lag: int) -> np.ndarray:
        vals = [(Dc[: T - lag, a] * Dc[lag:, b]).mean(0) for a, b in pairs_g]
        return np.mean(vals, 0)  # per item

    var0 = cross_cov(0)
    lags = {str(k): float(np.median(cross_cov(k) / var0)) for k in (1, 2, 5, 10, 25, 50, 100) if k < T}
    window_mean = D.mean((0, 1))
    temporal_var = np.maximum(var0 - 0, 0)
    noise_var = (Dc.var(1, ddof=1)).mean(0)  # between groups at one checkpoint: batch noise
    return {
        "variant": name,
        "checkpoints": T,
        "groups": groups,
        "group_batches": group_batches,
        "precision": precision,
        "time_structure": {
            "checkpoint_spacing_steps": cfg.probe_every,
            "noise_free_autocorrelation_by_lag_median": lags,
            "lags_in_checkpoints": True,
            "median_temporal_std_over_between_item_std_of_window_mean": float(
                np.median(np.sqrt(temporal_var)) / np.std(window_mean)
            ),
            "median_batch_noise_std_per_group_over_temporal_std": float(
                np.median(np.sqrt(noise_var) / np.sqrt(np.maximum(temporal_var, 1e-300)))
            ),
        },
        "seconds": round(time.perf_counter() - t0, 1),
    }


def run(config: Config, ctx: Context) -> dict[str, Any]:
    cfg, data = e1_setup(config.size, config.seed, config.steps, probe_every=config.probe_every)
    results = [
        run_variant(v.strip(), cfg, data, config.groups, config.group_batches, ctx.progress, config.last)
        for v in config.variants.split(",")
        if v.strip()
    ]
    return {"results": results}


def tables(result: dict[str, Any]) -> dict[str, str]:
    return {"e1-drift": table_e1_drift(result)}


def table_e1_drift(d: dict) -> str:
    rows = ["| E1 variant | checkpoints x drift batches | total batches | slope / r |", "|---|---|---|---|"]
    for r in d["results"]:
        for p in r["precision"]:
            rows.append(
                f"| {e1_name(r)} | {p['checkpoints']} x {p['groups'] * r['group_batches']} | "
                f"{p['drift_batches_total']} | {fmt(p['slope'])} / {fmt(p['pearson_r'])} |"
            )
    rows.append("")
    for r in d["results"]:
        ts = r["time_structure"]
        lags = ts["noise_free_autocorrelation_by_lag_median"]
        sp = ts["checkpoint_spacing_steps"]
        rows.append(
            f"{e1_name(r)}: the drift's spread along the window is "
            f"{ts['median_temporal_std_over_between_item_std_of_window_mean']:.0f}x the spread of its window "
            f"mean between items; batch noise of {r['group_batches']} batches: "
            f"{ts['median_batch_noise_std_per_group_over_temporal_std']:.2f}x the temporal spread; "
            f"autocorrelation "
            + ", ".join(f"{fmt(v, 2)} at {int(k) * sp} steps" for k, v in list(lags.items())[:4])
            + "."
        )
    return "\n".join(rows)
