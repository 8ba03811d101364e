"""Stage "truth" of the heat-sampling study: a plain pool of virtual batches per set, every batch's
energy, forward-only proxy and cost, and every word's centered squared displacement per batch."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from bench.experiments.heat_sampling.settings import JSON, PARAMS, SETS, TRUTH_SEED, Config
from bench.harness import Context, resumable

# ---------------------------------------------------------------------------
# the truth pool


def set_words(name: str, cfg: Config, quick: bool) -> list[str]:
    from normfast.data.word_frequencies import top_words

    first = SETS[name] if not quick else (0 if name == "common" else cfg.words)
    return top_words(first + cfg.words)[first : first + cfg.words]


def _setup(encoder: Any, words: list[str]) -> dict[str, Any]:
    from normfast.data.pairs import as_pair_source
    from normfast.engine.directions import get_objective, resolve_parameters

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
    from normfast.engine.directions import iter_gradients
    from normfast.engine.transmission import Tail

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


def truth_unit(ctx: Context, name: str, encoder_fn: Any, words: list[str], cfg: Config) -> dict[str, Any]:
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
