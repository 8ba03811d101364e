"""E1: the equilibrium law in a controlled experiment.

Small encoders are trained on a scale-invariant InfoNCE objective over
synthetic concepts of varying ambiguity until their embedding norms are
stationary; the engine's prediction of each item's equilibrium norm is then
compared with the norm the item actually keeps. ``--ledger`` adds the
radial-budget ledger: every step's realized change of every item's squared
norm, split into its terms, beside the engine's estimates of the same terms.

Protocol (v4; fixed before any fit of this version was computed; v3 fed the
dense meter of step 3 a fresh batch instead of the step's own; v2 was v3
without the dense estimator, the curvature heat and the snapshot candidates):

1. train for ``steps`` steps with torch's own optimizer on batches drawn from
   a fixed pool of pairs;
2. over the late window (the last ``window`` fraction of steps) record every
   item's norm every ``record_every`` steps and average -> observed norm;
3. trajectory average, dense (the headline): at every step of the window
   sample the state's drift, heat and curvature heat along the update
   direction of the batch the training step then takes (its gradient before
   the step; AdamW: the optimizer's v̂ as it stands)
   (:class:`normfast.engine.trajectory.virtual.TrajectoryMeter`; κ every 10 steps);
   solve the corrected law (heat + curvature heat,
   :mod:`normfast.core.equilibrium`) with the window means; also without the
   curvature heat, and heat-only; beside it, v3's dense meter (one fresh
   virtual batch per step from its own generator, independent of the training
   batches), corrected law; the target is read on the own-batch meter.
   Why the step's own batch: both are one-batch samples of the same state
   statistics, but the own-batch samples are the terms that actually moved
   the norms (``python -m bench run e1_adamw``: every AdamW run metered along
   its own batch fits, the same run metered along a fresh batch misses);
4. trajectory average, checkpoints: at checkpoints every ``probe_every`` steps
   run the engine (``normfast.engine.probe``, jvp mode over all parameters,
   virtual batches from the same pool, same batch size, lr, weight decay and
   optimizer preset; for AdamW the optimizer's own ``v̂``; a different seed
   per checkpoint): heat from ``M`` batches, drift from the mean update
   direction over ``drift_batches`` batches; average D, Q and κ (``D_w``,
   ``Q_w``) over the checkpoints and solve the law (full and heat-only), and
   from the last checkpoint alone;
5. single snapshot: the candidates of :data:`.snapshot.SNAPSHOT_PROTOCOL`,
   from the window's last checkpoint only;
6. every predictor: the log-log slope and Pearson r of observed against
   predicted; target for every variant: slope in [0.85, 1.15], r >= 0.93;
7. ledger (``--ledger``): per item and step in the window, ``R'² − R²``
   split into first-order task, second-order task, decay and remainder
   (:mod:`bench.experiments.e1.ledger`), averaged over the window; beside
   each, the engine's estimate of the same term (a) averaged over the
   checkpoints, (b) from the last checkpoint; per term the ratio of means
   (realized / estimated) and the per-item Pearson r.

Why dense: at a checkpoint the drift's batch noise over 64 batches is only
0.1-0.5 of its fluctuation along the window, and that fluctuation
decorrelates within ~20 steps (``python -m bench run e1_drift``): the time
average needs many states, not many batches per state.

Variants (``data.VARIANT_SPECS``): a 2-layer ReLU MLP without biases (κ = 2
exactly), the same with biases, a free embedding table (κ = 1, D = 0: the
classic weight-norm equilibrium), all with SGD (lr 0.01, wd 0.05); the
bias-free MLP with AdamW (lr 1e-3, wd 0.05) at β1 = 0.9 and at β1 = 0; and the
bias-free MLP with heavy-ball SGD (momentum 0.9, lr 1e-3, torch's coupled
weight decay), which tests the law's ``η -> η/(1−β)`` momentum rule.

Layout: :mod:`.data` (concepts, encoders, optimizers), :mod:`.training` (the
run, its checkpoints, the dense meter), :mod:`.ledger` (the realized terms and the engine's
estimates of them), :mod:`.laws` (probing the checkpoints, solving the laws),
:mod:`.snapshot` (the single-snapshot candidates),
:mod:`.experiment` (one run per variant, the JSON), :mod:`.plots` (the figures),
and this module (the runner's entry: options, tables).

Commands::

    python -m bench run e1 --ledger --out bench/results/e1           # seed 0, with the ledger
    python -m bench run e1 --seed 1 --out bench/results/e1/seed1     # the fresh seed
    python -m bench run e1 --quick                                    # a toy size (the tests)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from bench.common import fmt, names_in
from bench.harness import Context

RESULTS = ("equilibrium.json", "seed1/equilibrium.json", "ledger.json")
FIGURES = ("equilibrium.png", "seed1/equilibrium.png", "ledger.png")
TABLES = ("e1", "e1-snapshot", "e1-ledger", "e1-resists")
#: fields of the committed quick run (variants mlp, table) that rounding alone moves on another CPU path
#: (bench.harness.differences): the free embedding table's drift is zero by construction, so its drift
#: statistics, first-order task terms and the regression on them are statistics of rounding noise; the
#: realized task term (both orders) is the difference of two nearly equal terms, for every variant
QUICK_TOLERANCE: dict[str, float | None] = {
    "/results[[]*]/realized/task[[]*": None,
    "/results[[]1]/drift*": None,
    "/results[[]1]/snapshot/shrinkage/*": None,
    "/results[[]1]/terms/task*": None,
    "/results[[]1]/realized/task*": None,
    "/results[[]1]/estimated_*/task1*": None,
    "/results[[]1]/estimated_*/task[[]*": None,
}
#: the run writes equilibrium.json / .png (and ledger.json / .png with --ledger)
WRITES_OWN_FILES = True
#: the single-snapshot predictors (computed by bench.experiments.e1.snapshot, whose docstring defines
#: them; named here so that the tables render without importing torch)
SNAPSHOT_CANDIDATES = (
    "heat_only",
    "heat_only_curvature",
    "snapshot_full",
    "trajectory",
    "trajectory_curvature",
    "trajectory_shrunk",
    "trajectory_shrunk_regression",
)


@dataclass
class Config:
    variants: str | None = field(
        default=None, metadata={"help": "comma-separated subset of the variants (none: all of them)"}
    )
    ledger: bool = field(default=False, metadata={"help": "also the radial-budget ledger (ledger.json/.png)"})
    steps: int | None = field(default=None, metadata={"help": "override the number of training steps"})
    size: str = field(
        default="full", metadata={"choices": ("full", "quick"), "help": "E1's full or quick configuration"}
    )
    seed: int = 0

    @classmethod
    def quick(cls) -> "Config":
        return cls(size="quick")

    def variant_names(self) -> tuple[str, ...]:
        from bench.experiments.e1.data import VARIANTS

        return tuple(names_in(self.variants or ",".join(VARIANTS), VARIANTS, "e1", "variant"))

    def validate(self) -> None:
        self.variant_names()
        if self.steps is not None and self.steps < 100:
            raise ValueError(f"e1: expected --steps of at least 100, got {self.steps}")


def run(config: Config, ctx: Context) -> dict[str, Any]:
    from bench.experiments.e1.data import E1Config
    from bench.experiments.e1.experiment import run as run_variants

    variants = config.variant_names()
    cfg = replace(
        E1Config.quick() if config.size == "quick" else E1Config(),
        seed=config.seed,
        **({"steps": config.steps} if config.steps is not None else {}),
    )
    summary = run_variants(cfg, variants, out=ctx.out, progress=ctx.progress, ledger=config.ledger)
    result = {k: v for k, v in summary.items() if k != "ledger"}
    result["_written"] = ["equilibrium.json", "equilibrium.png"]
    if config.ledger:
        result["ledger"] = summary["ledger"]
        result["_written"] += ["ledger.json", "ledger.png"]
    return result


def figures(result: dict[str, Any], out: Path) -> list[Path]:
    """Redraw equilibrium.png from an equilibrium.json (``python -m bench figures e1 --json F --out D``;
    a run draws its own)."""
    from bench.experiments.e1.plots import plot

    plot(result["results"], out / "equilibrium.png")
    return [out / "equilibrium.png"]


def tables(result: dict[str, Any]) -> dict[str, str]:
    """The README's E1 tables for this run alone."""
    runs = [(str(result["config"]["seed"]), result)]
    ledger = result.get("ledger")
    out = {"e1": table_e1(runs, (ledger or {}).get("timing")), "e1-snapshot": table_e1_snapshot(runs)}
    if ledger:
        out.update({"e1-ledger": table_e1_ledger(ledger), "e1-resists": table_e1_resists(ledger)})
    return {k: v for k, v in out.items() if v is not None}


#: the committed runs of the README's E1 table: (seed label, file)
E1_RUNS = (("0", "equilibrium.json"), ("1 (fresh)", "seed1/equilibrium.json"))


def blocks(load: Callable[[str], dict | None]) -> dict[str, str | None]:
    runs = [(seed, d) for seed, path in E1_RUNS if (d := load(path)) is not None]
    ledger = load("ledger.json")
    return {
        "e1": table_e1(runs, (ledger or {}).get("timing")),
        "e1-snapshot": table_e1_snapshot(runs),
        "e1-ledger": None if ledger is None else table_e1_ledger(ledger),
        "e1-resists": None if ledger is None else table_e1_resists(ledger),
    }


# ---------------------------------------------------------------------------
# the README's renderers
E1_NAMES = {
    "mlp": "MLP, no biases",
    "mlp_bias": "MLP, biases",
    "table": "embedding table",
    "mlp_adamw": "MLP, AdamW β1 = 0.9",
    "mlp_adamw_b0": "MLP, AdamW β1 = 0",
    "mlp_heavyball": "MLP, heavy-ball SGD β = 0.9",
}


def _lag(t: dict, lag: str) -> str:
    """A block autocorrelation, or n/a when the window holds too few blocks for that lag."""
    v = t["block_autocorrelation_by_lag"].get(lag)
    return "n/a" if v is None else f"{v:+.2f}"


def _sr(fit: dict) -> str:
    return f"{fmt(fit['slope'])} / {fmt(fit['pearson_r'])}"


def e1_setup(size: str, seed: int, steps: int | None = None, **overrides: Any) -> tuple[Any, Any]:
    """E1's configuration (``E1Config()`` or its ``quick()``, with ``seed``, ``steps`` and ``overrides``) and
    its data, for the studies that train as E1 does; torch runs single-threaded (their runs are compared
    number for number)."""
    from dataclasses import replace

    import torch

    from bench.experiments.e1.data import E1Config, make_concepts

    torch.set_num_threads(1)
    cfg = replace(
        E1Config.quick() if size == "quick" else E1Config(),
        seed=seed,
        **({"steps": steps} if steps else {}),
        **{k: v for k, v in overrides.items() if v},
    )
    return cfg, make_concepts(cfg)


def e1_name(r: dict) -> str:
    return E1_NAMES.get(r["variant"], r["variant"])


def table_e1(runs: list[tuple[str, dict]], ledger_timing: dict | None) -> str | None:
    """Every run's fits (``runs``: (seed label, result)); the timing note says which run made the ledger."""
    runs = [(seed, d) for seed, d in runs if "dense_corrected_law" in d["results"][0]["fits"]]
    if not runs:
        return None
    cols = (
        ("dense_corrected_law", "dense, corrected law"),
        ("dense_law_without_curvature", "dense, no curvature"),
        ("dense_heat_only_law", "dense, heat-only"),
        ("full_law", "checkpoints, full law"),
        ("heat_only_law", "checkpoints, heat-only"),
        ("dense_fresh_batch_corrected_law", "dense, fresh batch (v3)"),
    )
    rows = [
        "| seed | E1 variant (slope / r) | " + " | ".join(c for _, c in cols) + " | target met |",
        "|---" * (len(cols) + 3) + "|",
    ]
    for seed, d in runs:
        for r in d["results"]:
            rows.append(
                f"| {seed} | {e1_name(r)} | "
                + " | ".join(_sr(r["fits"][k]) if k in r["fits"] else "n/a" for k, _ in cols)
                + f" | {'yes' if r['target']['met'] else 'no'} |"
            )
    d = runs[0][1]
    cfg, r0 = d["config"], d["results"][0]
    rows.append("")
    rows.append(
        f"{cfg['concepts']} concepts x {cfg['items_per_concept']} items, {cfg['steps']} steps, window = last "
        f"{int(cfg['window'] * 100)}% ({r0['dense_samples']} steps); SGD lr {cfg['lr']}, heavy-ball lr "
        f"{cfg['heavyball_lr']}, AdamW lr {cfg['adamw_lr']}, wd {cfg['weight_decay']} throughout. "
        f"Dense: at every step of the window, along the batch the step takes{_meter_note(r0)}. "
        f"Checkpoints: {r0['checkpoints']} x (M = {cfg['M']}, "
        f"M_D = {cfg['drift_batches']}). Target: slope in [0.85, 1.15], r >= 0.93 (on the dense corrected law)."
    )
    for seed, d in runs:
        t = d.get("timing")
        if t:
            how = "with" if seed == runs[0][0] and ledger_timing == t else "without"
            rows.append(
                f"Seed {seed}: `python -m bench run e1 --seed {d['config']['seed']}` ({how} --ledger) took "
                f"{t['wall_seconds'] / 60:.0f} min wall, {t['cpu_seconds'] / 60:.0f} min CPU on the shared "
                f"2-core machine."
            )
    return "\n".join(rows)


def _meter_note(r0: dict) -> str:
    if r0.get("dense_meter_batch") == "own":
        return "; fresh batch (v3): one fresh virtual batch per step instead"
    return " (this run predates protocol v4: its dense meter took one fresh virtual batch per step)"


def table_e1_snapshot(runs: list[tuple[str, dict]]) -> str | None:
    runs = [(n, d) for n, d in runs if "snapshot" in d["results"][0]]
    if not runs:
        return None
    cands = SNAPSHOT_CANDIDATES
    extra = all("norm_continued_fit" in d["results"][0]["snapshot"] for _, d in runs)
    head = " | reference: present norm |" + (
        " reference: norm continued | 95% interval coverage (r_eq snapshot / norm continued) |" if extra else ""
    )
    rows = [
        "| seed | E1 variant (slope / r) | " + " | ".join(c.replace("_", " ") for c in cands) + head,
        "|---" * (len(cands) + 3 + 2 * extra) + "|",
    ]
    for seed, d in runs:
        for r in d["results"]:
            s = r["snapshot"]
            row = (
                f"| {seed} | {e1_name(r)} | "
                + " | ".join(_sr(s["fits"][c]) for c in cands)
                + f" | {_sr(s['present_norm_fit'])} |"
            )
            if extra:
                cov = s["interval_coverage"]
                row += (
                    f" {_sr(s['norm_continued_fit'])} | {fmt(cov['trajectory_shrunk_regression']['coverage'])}"
                    f" / {fmt(cov['norm_continued']['coverage'])} |"
                )
            rows.append(row)
    notes = []
    for seed, d in runs:
        ch = d.get("snapshot_choice", {})
        w = ch.get("winner")
        met = ch.get("scores", {}).get(w, {}).get("targets_met")
        steps = {r["variant"]: r["snapshot"]["trajectory_steps"] for r in d["results"]}
        t = d.get("timing", {})
        notes.append(
            f"seed {seed}: protocol's choice {w} (target met on {met} of 4); "
            f"trajectory steps {', '.join(f'{k} {v}' for k, v in steps.items())}; "
            f"the whole run {t.get('wall_seconds', float('nan')) / 60:.0f} min wall, "
            f"{t.get('cpu_seconds', float('nan')) / 60:.0f} min CPU"
        )
    rows.append("")
    rows.append("; ".join(notes) + ".")
    return "\n".join(rows)


LEDGER_TERMS = (
    ("task1", "first-order task"),
    ("task2", "second-order task"),
    ("task", "task, both orders"),
    ("decay", "decay"),
    ("remainder", "curvature remainder"),
)


def table_e1_ledger(d: dict) -> str:
    rows = [
        "| E1 variant | term | realized, mean per step | / decay | checkpoint mean: ratio, r | "
        "last checkpoint: ratio, r |",
        "|---|---|---|---|---|---|",
    ]
    for r in d["results"]:
        dec = abs(r["terms"]["decay"]["realized_mean"])
        for t, label in LEDGER_TERMS:
            row = r["terms"][t]
            a, b = row["checkpoint_average"], row["last_checkpoint"]
            rows.append(
                f"| {e1_name(r)} | {label} | {row['realized_mean']:.2e} | {row['realized_mean'] / dec:+.2f} | "
                f"{fmt(a['ratio_realized_over_estimated'], 2)}, {fmt(a['pearson_r'], 2)} | "
                f"{fmt(b['ratio_realized_over_estimated'], 2)}, {fmt(b['pearson_r'], 2)} |"
            )
    rows.append("")
    rows.append(
        "Ratio = realized mean / engine's mean over items; r = per-item Pearson r (realized window mean "
        "against the engine's estimate). The engine has no remainder term (ratio n/a)."
    )
    ts = [(r, r["drift_time_structure"]) for r in d["results"] if "drift_time_structure" in r]
    if ts:
        rows.append("")
        rows.append(
            f"The realized first-order term in blocks of {ts[0][1]['block_steps']} steps: its spread from "
            "block to block over the absolute value of its window mean, its block autocorrelation at lags "
            "1 and 5, and the per-item r of the last checkpoint's estimate against the window's realized "
            "term: "
            + "; ".join(
                f"{e1_name(r)} {t['median_block_std_over_abs_window_mean']:.1f}, "
                f"{_lag(t, '1')} / {_lag(t, '5')}, "
                f"r {t['per_item_r_last_checkpoint_drift_vs_window_realized']:+.2f}"
                for r, t in ts
            )
            + "."
        )
    return "\n".join(rows)


def table_e1_resists(d: dict) -> str | None:
    if "term_swaps" not in d["results"][0]:
        return None
    names = list(d["results"][0]["term_swaps"])
    rows = [
        "| law from the checkpoints' terms (slope / r) | " + " | ".join(e1_name(r) for r in d["results"]) + " |",
        "|---" * (len(d["results"]) + 1) + "|",
    ]
    for n in names:
        rows.append(f"| {n} | " + " | ".join(_sr(r["term_swaps"][n]) for r in d["results"]) + " |")
    rows.append(
        "| closure: median abs(sum of realized terms) / abs(decay) | "
        + " | ".join(fmt(r["closure"]["median_abs_sum_over_abs_decay"], 3) for r in d["results"])
        + " |"
    )
    return "\n".join(rows)
