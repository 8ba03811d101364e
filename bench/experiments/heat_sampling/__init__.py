"""Heat sampling: heat batches drawn by their gradient energy against the plain draw, on held-out words.

    python -m bench run heat_sampling --out bench/results/heat_sampling   # the committed result (hours, resumable)
    python -m bench run heat_sampling --quick                               # toy size: exercises the code

The heat of a row is a mean over virtual batches of squared displacements, and on some inputs
a few rare batches carry most of the gradient energy: at the default M = 16 a plain mean then
moves the heat's level tens of times between seeds. The engine can draw its M heat batches from
the M_D drift batches (whose gradients it computes anyway) with probability rising with their
energy and weight them so that the heat stays unbiased (``ProbeConfig.heat_sampling``). This
study chooses the proposal and measures the default against the plain draw.

Protocol v1 (issue 39; written down and committed before any of its runs):

* Probe: all-MiniLM-L6-v2 (the packaged weights), the last transformer layer probed
  (``encoder\\.layer\\.5\\.``), pooled output (one row per word), SimCSE at its default
  temperature (0.05) over the probe words themselves, SGD lr 1e-3, wd 1e-2, batch size 32, and
  the engine's defaults otherwise: M = 16, K = 8, M_D = 1024 (the drift from the mean direction).
* Sets (held out from every calibration): English words of wordfreq's list (letters only, two
  letters or more), ``common`` = ranks 2 000-2 399 and ``rare`` = ranks 20 000-20 399.
* Truth, per set: a plain pool of ``truth_batches`` = 2 048 virtual batches (the engine's draw
  at seed 999 999). For every batch b: its gradient over the probed layer (energy
  ``e_b = |g_b|²``, the engine's proposal input), a forward-only proxy (``|∂L/∂z|²`` over the
  batch's embeddings) with its wall time against the full gradient's, and every word's
  displacement ``x_bi = -R_i J_i g_b`` by forward-mode AD, centered at the pool's exact mean
  (one jvp along the mean gradient). ``V2_true_i = Σ_b |x_bi - x̄_i|² / (N_T - 1)``; the relative
  heat's truth is ``log V2_true`` minus its median over the words. Its own error is reported: a
  bootstrap over the pool's batches (200 resamples) of the median V2 (the level) and of each
  row's log V2. (The internals this stage uses: ``normfast.engine.directions.iter_gradients``,
  ``normfast.engine.transmission.Tail``; checked in the quick test against ``normfast.probe``
  with the same ``batch_indices``.)
* Stage A, the proposal (a simulation on the truth pool; no engine run): R = 4 000 replicates;
  each draws a pool of N = 1 024 of the N_T batches without replacement (the engine's M_D), then
  M = 16 heat batches from that pool by each proposal, and estimates every row's heat as
  ``(1/M) Σ w c_bi`` with ``c_bi = |x_bi - x̄_i|²`` and ``w = 1 / ((N - 1) q_b)``. Proposals
  (q over the pool): ``uniform`` (the plain draw: M distinct batches, weights N/(N-1)),
  ``energy`` (∝ e), ``sqrt_energy`` (∝ √e), ``mixture`` (½ uniform + ½ ∝ e), ``mixture_sqrt``
  (½ uniform + ½ ∝ √e), all drawn independently with replacement; and, reported only,
  ``stratified`` (the mixture's mass cut into M strata of the pool sorted by energy, one draw
  each). Read-outs per proposal: the level (median over rows of estimate / truth) p5, median,
  p95; a row alone (its estimate / truth) p5, p95; the mean squared log error of the rows'
  heat (level and ranking together); the share of zero estimates. Decision: among the
  independent-draw proposals (the K-group jackknife needs exchangeable groups of draws, which
  a stratified draw does not give), the one with the smallest mean squared log error on the
  worse of the two sets becomes the engine's default proposal.
* Stage B, the engine: for each set and seed 0..7, ``normfast.probe`` at the defaults with
  ``heat_sampling="uniform"`` (the plain draw: the first M of the M_D batches) and with the
  default sampling (the proposal of stage A), the two in one process, alternating, on one
  thread. Read-outs per set and variant: max/min over the 8 seeds of the median V2; the
  relative heat's coverage (``|heat_rel - truth| <= t se_heat_rel``, t the 97.5% Student
  quantile with K - 1 dof) over rows and seeds, with a bootstrap interval over seeds; the
  cross-seed check: over all ordered pairs of distinct seeds, the share of rows whose one
  seed's ``[r_eq_lo, r_eq_hi]`` holds the other seed's ``r_eq``; V2's coverage; the median wall
  time, and the sampled variant's as a ratio to the plain one's (same process).
  Targets (issue 39), on both sets at the defaults: max/min <= 3, coverage in [0.90, 0.98],
  cross-seed >= 0.75, wall-time ratio <= 1.15.
* Stage C, the drift screen (from the truth pool, taken as the population): whether choosing
  the drift's batches by the forward-only proxy (a pool of S batches screened by the proxy,
  M_D' of them drawn independently ∝ √proxy and weighted ``1/(S q_b)``, full gradients for
  those only) gives the drift's standard error for less time than the plain M_D = 1 024. Per
  row, the variance of the plain mean of M_D radial dots, ``σ²/M_D``, against the screened
  estimator's, ``σ²/S + V_q/M_D'`` (the screened pool's own error plus the draw's, ``V_q`` the
  variance of ``w r`` under q), each times its cost in full-gradient units (``M_D`` against
  ``M_D' + S f``, f the proxy's measured cost per batch relative to a full gradient); designs
  (S, M_D') in (1024, 256), (1024, 512), (2048, 512), (2048, 1024). Adopted only if
  ``se_D² × time`` (median over rows) improves by >= 1.5x on both sets; reported either way.

Amendment (exploratory, written after stage B's runs on the ``common`` set were seen: the
default's relative-heat coverage 0.75, below the plain draw's 0.85; nothing of v1 changes):

* Stage D, why the intervals are short (a simulation on the truth pool, as stage A): for the plain
  draw, ∝ energy and the half-uniform mixture, at M = 16, 32 and 64 (K = 8), 200 replicates of a
  pool of N = 1 024 and the draw, each row's relative heat with the engine's jackknife interval
  (the reference recomputed without each group): its coverage of the truth, and the coverage and
  median half-width when a candidate term is added in quadrature -- the row's own pool error
  relative to the others: per draw, each row's share of its heat minus the draw's median share
  over the rows, its variance over the pool estimated from the draws (weighted), over N. Not a
  change of the engine: it says where the missing error is.

Writes OUT/heat_sampling.json and OUT/heat_sampling.png; resumable per unit (a set's truth,
its stage A, C and D, each (set, variant, seed) run) in OUT/partial/.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from bench.experiments.heat_sampling.render import figures, tables
from bench.experiments.heat_sampling.settings import JSON, MODEL, PARAMS, SETS, STAGES, TARGETS, TRUTH_SEED, Config
from bench.experiments.heat_sampling.stages import choose_proposal, stage_a, stage_b, stage_c, stage_d, verdict
from bench.experiments.heat_sampling.truth import set_words, truth_summary, truth_unit
from bench.harness import Context, drop_partial, resumable

RESULTS = ("heat_sampling.json",)
FIGURES = ("heat_sampling.png",)
TABLES = ("heat-sampling-proposals", "heat-sampling-engine", "heat-sampling-drift-screen", "heat-sampling-coverage")
__all__ = ["Config", "figures", "run", "tables"]


def run(cfg: Config, ctx: Context) -> dict[str, Any]:
    import torch

    from normfast.engine.runner import library_versions

    stages = cfg.stage_names()
    torch.set_num_threads(1)  # beside other work, and the runs compared number for number
    t0 = time.perf_counter()
    encoder: list[Any] = []

    def load() -> Any:
        if not encoder:
            import normfast

            encoder.append(normfast.load_encoder(MODEL))
        return encoder[0]

    sets: dict[str, Any] = {}
    units: list[str] = []
    for name in SETS:
        words = set_words(name, cfg, ctx.quick)
        print(f"heat_sampling: {name}, words of rank {words[0]!r}.. ({len(words)})", flush=True)
        t = truth_unit(ctx, name, load, words, cfg)
        units.append(f"truth_{name}")
        out: dict[str, Any] = {"words": len(words), "truth": truth_summary(t, cfg)}
        key = {"set": name, "cfg": asdict(cfg) | {"stages": None, "seeds": None}}
        if "a" in stages:
            out["proposals"] = resumable(ctx, f"stage_a_{name}", key, lambda t=t: stage_a(t, cfg), JSON)
            units.append(f"stage_a_{name}")
        if "c" in stages:
            out["drift_screen"] = resumable(ctx, f"stage_c_{name}", key, lambda t=t: stage_c(t, cfg), JSON)
            units.append(f"stage_c_{name}")
        if "d" in stages:
            out["coverage"] = resumable(ctx, f"stage_d_{name}", key, lambda t=t: stage_d(t, cfg), JSON)
            units.append(f"stage_d_{name}")
        if "b" in stages:
            out["engine"] = stage_b(ctx, name, load, words, t, cfg, units)
        sets[name] = out
    result: dict[str, Any] = {
        "experiment": "heat sampling: heat batches drawn by their gradient energy, against the plain draw",
        "config": asdict(cfg) | {"model": MODEL, "params": PARAMS, "sets": SETS, "truth_seed": TRUTH_SEED},
        "targets": TARGETS,
        "sets": sets,
        "seconds": round(time.perf_counter() - t0, 1),
        "versions": library_versions(),
    }
    if "a" in stages:
        result["proposal_decision"] = choose_proposal({k: v["proposals"] for k, v in sets.items()})
    if "b" in stages:
        result["verdict"] = verdict(sets)
    if set(stages) == set(STAGES):  # the whole result: the units are no longer needed
        drop_partial(ctx, units)
        for name in SETS:
            (ctx.out / "partial" / f"truth_{name}.npz").unlink(missing_ok=True)
        drop_partial(ctx, [])
    return result
