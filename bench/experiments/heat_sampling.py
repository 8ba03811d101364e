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

Writes OUT/heat_sampling.json and OUT/heat_sampling.png; resumable per unit (a set's truth,
its stage A and C, each (set, variant, seed) run) in OUT/partial/.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import Context, JsonStyle, drop_partial, resumable

RESULTS = ("heat_sampling.json",)
FIGURES = ("heat_sampling.png",)
TABLES = ("heat-sampling-proposals", "heat-sampling-engine", "heat-sampling-drift-screen")
JSON = JsonStyle(newline=False, strict=False)
MODEL = "all-MiniLM-L6-v2"
PARAMS = r"encoder\.layer\.5\."
SETS = {"common": 2000, "rare": 20000}
TRUTH_SEED = 999_999
#: stage A: the proposals compared (independent draws) and the one reported only
PROPOSALS = ("uniform", "energy", "sqrt_energy", "mixture", "mixture_sqrt")
REPORTED_ONLY = ("stratified",)
#: stage B's variants: the plain draw and the engine's default
VARIANTS = ("plain", "sampled")
#: stage C's screened designs (S, M_D')
SCREENS = ((1024, 256), (1024, 512), (2048, 512), (2048, 1024))
TARGETS = {"level_ratio_max": 3.0, "coverage": (0.90, 0.98), "cross_seed_min": 0.75, "wall_ratio_max": 1.15}
STAGES = ("truth", "a", "c", "b")


@dataclass
class Config:
    words: int = field(default=400, metadata={"help": "words per set"})
    truth_batches: int = field(default=2048, metadata={"help": "N_T, the truth pool's virtual batches"})
    pool: int = field(default=1024, metadata={"help": "N, the pool of stage A (the engine's M_D)"})
    batches: int = field(default=16, metadata={"help": "M, the heat's batches"})
    replicates: int = field(default=4000, metadata={"help": "stage A's replicates"})
    seeds: int = field(default=8, metadata={"help": "stage B's seeds per variant"})
    batch_size: int = 32
    bootstrap: int = 200
    stages: str = field(default=",".join(STAGES), metadata={"help": "comma-separated subset of " + ", ".join(STAGES)})

    @classmethod
    def quick(cls) -> "Config":
        return cls(words=24, truth_batches=64, pool=32, batches=4, replicates=200, seeds=2, batch_size=8, bootstrap=20)

    def stage_names(self) -> list[str]:
        from bench.common import names_in

        return names_in(self.stages, STAGES, "heat_sampling", "stage")


# ---------------------------------------------------------------------------
# the truth pool


def set_words(name: str, cfg: Config, quick: bool) -> list[str]:
    from normfast.data.word_frequencies import top_words

    first = SETS[name] if not quick else (0 if name == "common" else cfg.words)
    return top_words(first + cfg.words)[first : first + cfg.words]


def _setup(encoder: Any, words: list[str]) -> dict[str, Any]:
    from normfast.data.pairs import as_pair_source
    from normfast.engine.directions.gradients import resolve_parameters
    from normfast.engine.directions.objectives import get_objective

    objective = get_objective("simcse")
    names = resolve_parameters(encoder, PARAMS)
    cut = min(encoder.stage_of_parameters()[n] for n in names)
    return {"objective": objective, "pairs": as_pair_source(None, objective, words), "names": names, "cut": cut}


def _proxy(encoder: Any, objective: Any, items: list[str], cut: int, seed: int) -> float:
    """``|∂L/∂z|²`` over the batch's two views: a forward pass of the model, a backward of the loss only
    (the same dropout as the batch's gradient: the engine's seeding of batch ``seed``)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.no_grad():
            views = []
            for _ in range(2):
                state = encoder.prepare(items)
                front = encoder(state, 0, cut) if cut > 0 else state
                views.append(encoder(front, cut, output="pooled"))
        za, zb = (v.detach().requires_grad_(True) for v in views)
        loss = objective.loss(za, zb)
        ga, gb = torch.autograd.grad(loss, (za, zb))
    return float(ga.double().square().sum() + gb.double().square().sum())


def truth_pool(encoder: Any, words: list[str], cfg: Config, progress: bool) -> dict[str, Any]:
    """The truth pool of one set: per batch its energy, proxy and timings, per (batch, row) the centered
    squared displacement ``c`` and the radial dot ``r``; ``V2_true`` per row."""
    import torch
    from tqdm.auto import tqdm

    from normfast.data.batches import virtual_batches
    from normfast.engine.directions.gradients import iter_gradients
    from normfast.engine.transmission.jvp import Tail

    s = _setup(encoder, words)
    objective, pairs, names, cut = s["objective"], s["pairs"], s["names"], s["cut"]
    batch_seed = int(np.random.default_rng(TRUTH_SEED).integers(2**31))
    batches = virtual_batches(len(pairs), cfg.truth_batches, cfg.batch_size, batch_seed)
    n_t = len(batches)
    kw = dict(cut=cut, seed=TRUTH_SEED, progress=False, check_invariance=False)
    # pass 1: the mean gradient (for the exact mean displacement), each batch's energy and proxy, timed
    total = {n: torch.zeros_like(encoder.get_parameter(n), dtype=torch.float64) for n in names}
    energy, loss, proxy, t_grad, t_proxy = (np.zeros(n_t) for _ in range(5))
    bar = tqdm(total=n_t, desc="truth pool, pass 1", disable=not progress, leave=False)
    t0 = time.perf_counter()
    for gb, g, value in iter_gradients(encoder, objective, pairs, names, batches, **kw):
        t1 = time.perf_counter()
        t_grad[gb] = t1 - t0
        for n in names:
            total[n] += g[n].double()
        energy[gb] = sum(float(g[n].double().square().sum()) for n in names)
        loss[gb] = value
        was = encoder.training
        encoder.train(True)  # SimCSE's dropout, as in the gradient
        proxy[gb] = _proxy(encoder, objective, pairs.batch(batches[gb]), cut, TRUTH_SEED * 1_000_003 + gb)
        encoder.train(was)
        t0 = time.perf_counter()
        t_proxy[gb] = t0 - t1
        bar.update()
    bar.close()
    encoder.eval()
    state = encoder.prepare(words)
    with torch.no_grad():
        front = encoder(state, 0, cut)
    tail = Tail(encoder, names, cut, "pooled")
    z = tail.primal(front, None).double()
    norm = torch.linalg.vector_norm(z, dim=1)
    zhat = z / norm[:, None]
    mean = {n: (t / n_t).float()[None] for n, t in total.items()}
    xbar = -norm[:, None] * tail.jvp(front, mean, None)[0].double()
    # pass 2: every batch's displacement of every word, centered at the exact mean
    c = np.zeros((n_t, len(words)), dtype=np.float64)
    r = np.zeros((n_t, len(words)), dtype=np.float64)
    bar = tqdm(total=n_t, desc="truth pool, pass 2", disable=not progress, leave=False)
    pending: list[tuple[int, dict]] = []

    def flush() -> None:
        ids = [b for b, _ in pending]
        tang = {n: torch.stack([g[n] for _, g in pending]) for n in names}
        was = encoder.training
        encoder.eval()  # the displacement of the model as probed (the gradients' pass runs SimCSE's dropout)
        x = -norm[None, :, None] * tail.jvp(front, tang, None).double()
        encoder.train(was)
        c[ids] = (x - xbar[None]).square().sum(-1).numpy()
        r[ids] = (x * zhat[None]).sum(-1).numpy()
        bar.update(len(pending))
        pending.clear()

    for gb, g, _ in iter_gradients(encoder, objective, pairs, names, batches, **kw):
        pending.append((gb, g))
        if len(pending) == 8:
            flush()
    if pending:
        flush()
    bar.close()
    v2 = c.sum(0) / (n_t - 1)
    return {
        "batches": [b.tolist() for b in batches],
        "energy": energy,
        "loss": loss,
        "proxy": proxy,
        "grad_seconds": t_grad,
        "proxy_seconds": t_proxy,
        "c": c.astype(np.float32),
        "r": r.astype(np.float32),
        "V2_true": v2,
        "drift_true": r.mean(0),
    }


def _truth_unit(ctx: Context, name: str, encoder_fn: Any, words: list[str], cfg: Config) -> dict[str, Any]:
    """A set's truth pool, its arrays in OUT/partial/truth_SET.npz and its summary in the unit's JSON."""
    path = ctx.out / "partial" / f"truth_{name}.npz"
    key = {"set": name, "words": words, "truth_batches": cfg.truth_batches, "batch_size": cfg.batch_size, "v": 1}

    def compute() -> dict[str, Any]:
        t0 = time.perf_counter()
        pool = truth_pool(encoder_fn(), words, cfg, ctx.progress)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **{k: np.asarray(v) for k, v in pool.items() if k != "batches"})
        tmp.replace(path)
        return {"npz": path.name, "seconds": time.perf_counter() - t0}

    summary = resumable(ctx, f"truth_{name}", key, compute, JSON)
    if not path.is_file():  # the JSON outlived its arrays: compute both again
        (ctx.out / "partial" / f"truth_{name}.json").unlink(missing_ok=True)
        summary = resumable(ctx, f"truth_{name}", key, compute, JSON)
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    return {**summary, **arrays}


def truth_summary(t: dict[str, Any], cfg: Config, seed: int = 0) -> dict[str, Any]:
    """The pool's heavy tail, the proxy's agreement, the costs and the truth's own error (bootstrap)."""
    from scipy.stats import spearmanr

    e = np.asarray(t["energy"])
    top = np.sort(e)[::-1]
    k = max(1, len(e) // 100)
    c, v2 = np.asarray(t["c"], dtype=np.float64), np.asarray(t["V2_true"])
    rng = np.random.default_rng(seed)
    levels, rows = [], []
    n_t = c.shape[0]
    for _ in range(cfg.bootstrap):
        idx = rng.integers(0, n_t, n_t)
        est = c[idx].sum(0) / (n_t - 1)
        ratio = est / v2
        levels.append(float(np.median(ratio)))
        rows.append(np.log(ratio) - math.log(levels[-1]))
    rows = np.asarray(rows)
    return {
        "batches": int(n_t),
        "energy": {
            "median": float(np.median(e)),
            "p99": float(np.quantile(e, 0.99)),
            "max": float(e.max()),
            "mean_over_median": float(e.mean() / np.median(e)),
            "top1pct_share": float(top[:k].sum() / e.sum()),
        },
        "proxy_spearman": float(spearmanr(t["proxy"], e).statistic),
        "loss_spearman": float(spearmanr(t["loss"], e).statistic),
        "grad_seconds_median": float(np.median(t["grad_seconds"])),
        "proxy_seconds_median": float(np.median(t["proxy_seconds"])),
        "proxy_cost": float(np.median(t["proxy_seconds"]) / np.median(t["grad_seconds"])),
        "median_V2_true": float(np.median(v2)),
        "truth_level_p5_p95": [float(np.quantile(levels, 0.05)), float(np.quantile(levels, 0.95))],
        "truth_row_log_sd_median": float(np.median(rows.std(0))),
        "row_heat_top1pct_share_median": float(np.median(_top_share(c, e))),
    }


def _top_share(c: np.ndarray, energy: np.ndarray) -> np.ndarray:
    """Per row, the share of its heat carried by the top 1% of the batches by energy."""
    k = max(1, c.shape[0] // 100)
    top = np.argsort(-np.asarray(energy))[:k]
    return c[top].sum(0) / c.sum(0)


# ---------------------------------------------------------------------------
# stage A: the proposal


def proposal(method: str, energy: np.ndarray) -> np.ndarray:
    """q over a pool of batches with energies ``energy`` (the engine's :func:`heat_proposal`)."""
    from normfast.engine.directions.sampling import heat_proposal

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
# the run


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
        t = _truth_unit(ctx, name, load, words, cfg)
        units.append(f"truth_{name}")
        out: dict[str, Any] = {"words": len(words), "truth": truth_summary(t, cfg)}
        key = {"set": name, "cfg": asdict(cfg) | {"stages": None, "seeds": None}}
        if "a" in stages:
            out["proposals"] = resumable(ctx, f"stage_a_{name}", key, lambda t=t: stage_a(t, cfg), JSON)
            units.append(f"stage_a_{name}")
        if "c" in stages:
            out["drift_screen"] = resumable(ctx, f"stage_c_{name}", key, lambda t=t: stage_c(t, cfg), JSON)
            units.append(f"stage_c_{name}")
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


# ---------------------------------------------------------------------------
# tables and figure


def tables(d: dict[str, Any]) -> dict[str, str]:
    out = {"heat-sampling-proposals": table_proposals(d), "heat-sampling-drift-screen": table_screen(d)}
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
