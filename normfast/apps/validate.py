"""E1, the controlled equilibrium experiment behind ``normfast validate``.

A small encoder is trained with SGD + weight decay on a scale-invariant
InfoNCE objective until its embedding norms are stationary; the engine's
prediction of each item's equilibrium norm is then compared with the norm
the item actually keeps.

Synthetic concepts of varying ambiguity: ``K`` concepts with prototypes
``μ_k``; each concept owns a few items ``x = μ_k + σ ε``. A training pair is
an item and a positive from the same concept, except that for concept ``k``
the positive is drawn from another concept with probability ``a_k``
(ambiguity, spread evenly over ``[0, a_max]``). Ambiguous items receive
inconsistent updates -- more heat -- and settle at larger norms.

Protocol (fixed before looking at results):

1. train for ``steps`` SGD steps on batches drawn from a fixed pool of pairs;
2. over the late window (the last ``window`` fraction of steps) record every
   item's norm every ``record_every`` steps and average -> observed norm;
3. at checkpoints every ``probe_every`` steps in the same window, run the
   engine (``normfast.engine.probe``, jvp mode over all parameters, ``M`` virtual
   batches from the same pool, same batch size, lr and weight decay, a
   different seed per checkpoint) and average D, Q and κ over checkpoints;
4. solve the law with the averaged statistics -> predicted R_eq; report the
   log-log slope and Pearson r of observed against predicted, for the full
   law and the heat-only law (D = 0), and for the last checkpoint alone.

Variants: a 2-layer ReLU MLP without biases (κ = 2 exactly), the same with
biases, a free embedding table (κ = 1, D = 0: the classic weight-norm
equilibrium), and the bias-free MLP trained with AdamW (reported, no target:
the AdamW law is a heuristic).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from normfast.engine.config import DEFAULT_DRIFT_BATCHES

VARIANTS = ("mlp", "mlp_bias", "table", "mlp_adamw")
TARGET_SLOPE = (0.85, 1.15)
TARGET_R = 0.93


@dataclass
class E1Config:
    concepts: int = 64
    items_per_concept: int = 4
    d_in: int = 32
    hidden: int = 128
    d_out: int = 32
    sigma: float = 0.5
    max_ambiguity: float = 0.9
    n_pairs: int = 20_000
    temperature: float = 0.1
    batch_size: int = 64
    lr: float = 0.01
    weight_decay: float = 0.05
    adamw_lr: float = 1e-3
    steps: int = 20_000
    window: float = 0.4
    record_every: int = 50
    probe_every: int = 100
    M: int = 16
    #: M_D, the drift's own virtual batches per checkpoint (its mean direction; 0: per batch from M)
    M_D: int = DEFAULT_DRIFT_BATCHES
    seed: int = 0

    @classmethod
    def quick(cls) -> "E1Config":
        return cls(concepts=16, items_per_concept=4, hidden=64, n_pairs=4000, steps=3000,
                   probe_every=150, M=8, M_D=64)


# ----------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------
@dataclass
class SyntheticConcepts:
    x: torch.Tensor            # [n_items, d_in] item inputs (for the MLP)
    concept: torch.Tensor      # [n_items] concept of each item
    ambiguity: torch.Tensor    # [concepts]
    pairs: np.ndarray          # [n_pairs, 2] item ids (anchor, positive)


def make_concepts(cfg: E1Config) -> SyntheticConcepts:
    g = torch.Generator().manual_seed(cfg.seed)
    K, m = cfg.concepts, cfg.items_per_concept
    mu = torch.randn(K, cfg.d_in, generator=g)
    concept = torch.arange(K).repeat_interleave(m)
    x = mu[concept] + cfg.sigma * torch.randn(K * m, cfg.d_in, generator=g)
    ambiguity = torch.linspace(0.0, cfg.max_ambiguity, K)
    rng = np.random.default_rng(cfg.seed)
    anchors = rng.integers(0, K * m, cfg.n_pairs)
    k_a = concept.numpy()[anchors]
    flip = rng.random(cfg.n_pairs) < ambiguity.numpy()[k_a]
    other = rng.integers(0, K - 1, cfg.n_pairs)
    other = other + (other >= k_a)
    k_b = np.where(flip, other, k_a)
    positives = k_b * m + rng.integers(0, m, cfg.n_pairs)
    return SyntheticConcepts(x, concept, ambiguity, np.stack([anchors, positives], 1))


def build_encoder(variant: str, cfg: E1Config, data: SyntheticConcepts):
    from normfast.encoders import ModuleEncoder

    torch.manual_seed(cfg.seed + 1)
    if variant == "table":
        table = nn.Embedding(data.x.shape[0], cfg.d_out)
        nn.init.normal_(table.weight, std=1.0)
        return ModuleEncoder([table], collate=lambda ids: torch.as_tensor(list(ids), dtype=torch.long))
    bias = variant == "mlp_bias"
    layers = [nn.Linear(cfg.d_in, cfg.hidden, bias=bias), nn.ReLU(), nn.Linear(cfg.hidden, cfg.d_out, bias=bias)]
    x = data.x
    return ModuleEncoder(layers, collate=lambda ids: x[torch.as_tensor(list(ids), dtype=torch.long)], head=False)


# ----------------------------------------------------------------------------
# the experiment
# ----------------------------------------------------------------------------
def run_variant(variant: str, cfg: E1Config, data: SyntheticConcepts, *, progress: bool = True) -> dict[str, Any]:
    from normfast.engine.directions import adam_second_moments
    from normfast.core.equilibrium import equilibrium_norm
    from normfast.engine.objectives import InfoNCE
    from normfast.data.pairs import PairSource
    from normfast.engine.probe import ProbeConfig, probe
    from normfast.core.stats import loglog_fit

    enc = build_encoder(variant, cfg, data)
    objective = InfoNCE(temperature=cfg.temperature)
    n_items = data.x.shape[0]
    items = list(range(n_items))
    pairs = PairSource.from_iterable([(int(a), int(b)) for a, b in data.pairs])
    adam = variant.endswith("adamw")
    lr = cfg.adamw_lr if adam else cfg.lr
    if adam:
        opt = torch.optim.AdamW(enc.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.SGD(enc.parameters(), lr=lr, weight_decay=cfg.weight_decay)
    all_ids = torch.arange(n_items)
    state_all = enc.prepare(items)
    window_start = int(cfg.steps * (1 - cfg.window))
    rng = np.random.default_rng(cfg.seed + 2)
    pairs_t = torch.as_tensor(data.pairs)
    observed = []
    checkpoints = []
    losses = []
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=f"E1 {variant}: train", unit="step", disable=not progress, leave=False)
    for step in bar:
        idx = torch.as_tensor(rng.integers(0, len(pairs_t), cfg.batch_size))
        a = enc.prepare(pairs_t[idx, 0].tolist())
        b = enc.prepare(pairs_t[idx, 1].tolist())
        loss = objective.loss(enc(a), enc(b))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step >= window_start:
            k = step - window_start
            if k % cfg.record_every == 0:
                with torch.no_grad():
                    observed.append(enc(state_all).norm(dim=-1))
            if k % cfg.probe_every == 0:
                sm = adam_second_moments(opt, enc) if adam else None
                checkpoints.append(({n: p.detach().clone() for n, p in enc.named_parameters()}, sm))
    train_seconds = time.perf_counter() - t0
    del all_ids
    observed_norm = torch.stack(observed).mean(0).double().numpy()
    first_half = torch.stack(observed[: len(observed) // 2]).mean(0).double().numpy()
    second_half = torch.stack(observed[len(observed) // 2:]).mean(0).double().numpy()

    # probe every checkpoint with the engine
    pcfg = ProbeConfig(params="all", mode="jvp", output="pooled", optimizer="adamw" if adam else "sgd",
                       lr=lr, weight_decay=cfg.weight_decay, batches=cfg.M, drift_batches=cfg.M_D or None,
                       batch_size=cfg.batch_size,
                       chunk_size=n_items, radial_spread=True)
    sums: dict[str, np.ndarray] = {}
    last = None
    t0 = time.perf_counter()
    for ci, (params, second) in enumerate(tqdm(checkpoints, desc=f"E1 {variant}: probe", unit="ckpt",
                                               disable=not progress, leave=False)):
        with torch.no_grad():
            for n, p in enc.named_parameters():
                p.copy_(params[n])
        res = probe(enc, items, objective, pairs, replace(pcfg, seed=cfg.seed * 7919 + ci), progress=False,
                    second_moments=second, model_name=f"E1-{variant}")
        for col in ("D", "Q", "D_w", "Q_w", "kappa", "V2", "V2_w", "se_D", "se_D_w"):
            if col in res.table.column_names:
                sums[col] = sums.get(col, 0) + res.column(col)
        last = res
    probe_seconds = time.perf_counter() - t0
    n_ck = len(checkpoints)
    avg = {k: v / n_ck for k, v in sums.items()}
    law = dict(lr=lr, weight_decay=cfg.weight_decay)
    zero = np.zeros(n_items)
    if adam:
        r_full = equilibrium_norm(None, None, avg["kappa"], D_w=avg["D_w"], Q_w=avg["Q_w"], **law)
        r_heat = equilibrium_norm(None, None, avg["kappa"], D_w=zero, Q_w=avg["Q_w"], **law)
    else:
        r_full = equilibrium_norm(avg["D"], avg["Q"], avg["kappa"], **law)
        r_heat = equilibrium_norm(zero, avg["Q"], avg["kappa"], **law)
    r_last = last.column("r_eq")
    drift = "D_w" if adam else "D"
    fits = {
        "full_law": loglog_fit(r_full, observed_norm),
        "heat_only_law": loglog_fit(r_heat, observed_norm),
        "last_checkpoint_full_law": loglog_fit(r_last, observed_norm),
    }
    stationarity = float(np.median(np.abs(second_half - first_half) / observed_norm))
    out = {
        "variant": variant,
        "optimizer": "adamw" if adam else "sgd",
        "lr": lr,
        "weight_decay": cfg.weight_decay,
        "items": n_items,
        "checkpoints": n_ck,
        "M_per_checkpoint": cfg.M,
        "fits": fits,
        "kappa": {"min": float(np.min(avg["kappa"])), "max": float(np.max(avg["kappa"]))},
        "drift_over_heat_median": float(np.median(np.abs(avg[drift]) / np.sqrt(
            cfg.weight_decay * np.abs(avg["kappa"]) * lr * avg["Q_w" if adam else "Q"]))),
        "norm_change_between_window_halves_median": stationarity,
        "final_loss_mean_last_500": float(np.mean(losses[-500:])),
        "train_seconds": round(train_seconds, 1),
        "probe_seconds": round(probe_seconds, 1),
        "observed": observed_norm.tolist(),
        "predicted_full": np.asarray(r_full).tolist(),
        "predicted_heat": np.asarray(r_heat).tolist(),
        "ambiguity": data.ambiguity[data.concept].tolist(),
    }
    if not adam:
        lo, hi = TARGET_SLOPE
        f = fits["full_law"]
        out["target"] = {"slope": [lo, hi], "pearson_r": TARGET_R,
                         "met": bool(lo <= f["slope"] <= hi and f["pearson_r"] >= TARGET_R)}
    return out


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(4 * n, 4), squeeze=False)
    for ax, res in zip(axes[0], results):
        obs = np.asarray(res["observed"])
        for key, color, label in (("predicted_full", "tab:blue", "full law"),
                                  ("predicted_heat", "tab:orange", "heat only")):
            pred = np.asarray(res[key])
            ax.loglog(pred, obs, ".", ms=3, color=color, alpha=0.6, label=label)
        lo = np.nanmin([obs.min(), np.nanmin(res["predicted_full"])])
        hi = np.nanmax([obs.max(), np.nanmax(res["predicted_full"])])
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        f = res["fits"]["full_law"]
        ax.set_title(f"{res['variant']} ({res['optimizer']})\nfull law: slope {f['slope']:.2f}, r {f['pearson_r']:.3f}",
                     fontsize=9)
        ax.set_xlabel("predicted R_eq")
        ax.set_ylabel("observed stationary norm")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: E1Config, variants: tuple[str, ...] = VARIANTS, out: str | Path | None = None,
        progress: bool = True) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is faster and the timings steadier
    try:
        data = make_concepts(cfg)
        results = [run_variant(v, cfg, data, progress=progress) for v in variants]
    finally:
        torch.set_num_threads(threads)
    from normfast.engine.probe import _library_versions

    summary = {"experiment": "E1 controlled equilibrium", "config": asdict(cfg), "results": results,
               "versions": _library_versions()}
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "equilibrium.json").write_text(json.dumps(summary, indent=1))
        plot(results, out / "equilibrium.png")
    return summary


def format_table(summary: dict[str, Any]) -> str:
    rows = ["| variant | optimizer | full law slope | full law r | heat-only slope | heat-only r | last ckpt slope | last ckpt r | target met |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["results"]:
        f, h, l = r["fits"]["full_law"], r["fits"]["heat_only_law"], r["fits"]["last_checkpoint_full_law"]
        met = r.get("target", {}).get("met")
        rows.append(f"| {r['variant']} | {r['optimizer']} | {f['slope']:.3f} | {f['pearson_r']:.3f} | "
                    f"{h['slope']:.3f} | {h['pearson_r']:.3f} | {l['slope']:.3f} | {l['pearson_r']:.3f} | "
                    f"{'yes' if met else ('no' if met is not None else 'n/a (heuristic)')} |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------
validate_description = __doc__ + """
Writes equilibrium.json and equilibrium.png to --out (default bench/results)."""


def validate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a small, fast configuration (used by the tests)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--steps", type=int, help="override the number of training steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results", help="output folder (default bench/results)")
    p.add_argument("--no-progress", action="store_true")


def validate_main(args: argparse.Namespace) -> int:
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        print(f"normfast validate: unknown variants {unknown}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    cfg = E1Config.quick() if args.quick else E1Config()
    cfg = replace(cfg, seed=args.seed)
    if args.steps is not None:
        if args.steps < 100:
            print("normfast validate: --steps must be at least 100", file=sys.stderr)
            return 2
        cfg = replace(cfg, steps=args.steps)
    summary = run(cfg, variants, out=args.out, progress=not args.no_progress)
    print(format_table(summary))
    print(f"\nwrote {Path(args.out) / 'equilibrium.json'} and {Path(args.out) / 'equilibrium.png'}")
    return 0

