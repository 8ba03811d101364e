"""The monitor transient's pieces: the models at their stationary state, the monitored continuation
after a change, the four predictions and their fits against the final norms (protocol steps 1-5)."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench.common import PLAIN_HEAT
from bench.experiments.monitor_transient import BURN_IN, CHANGES, PREDICTORS, T_RELAXATIONS, WINDOW

#: the head model's settings (protocol step 1)
HEAD_LR, HEAD_WD, HEAD_TAU, HEAD_BATCH, HEAD_DIM = 0.05, 0.01, 0.05, 64, 64
RECORD_EVERY = 50


@dataclass
class Model:
    """A trained model at its stationary state, with what continuing its training needs."""

    name: str
    encoder: Any
    optimizer: Any
    kind: str  # "sgd" or "adamw"
    lr: float
    weight_decay: float
    temperature: float
    batch_size: int
    pairs: np.ndarray  # [P, 2] item indices
    n_items: int
    probe_config: Callable[[float, float, int], Any]  # (lr, wd, seed) -> ProbeConfig at those settings
    make_optimizer: Callable[[Any, float, float], Any]  # (params, lr, wd) -> a fresh optimizer of the same kind
    train_seconds: float


def e1_model(name: str, config: Any, progress: bool) -> Model:
    from bench.experiments.e1 import e1_setup
    from bench.experiments.e1.data import VARIANT_SPECS, probe_config, variant_optimizer
    from bench.experiments.e1.training import train

    cfg, data = e1_setup(config.size, config.seed, config.steps)
    variant = VARIANT_SPECS[name]
    t0 = time.perf_counter()
    run = train(variant, cfg, data, meter=False, fresh_meter=False, progress=progress)
    n = data.x.shape[0]

    def settings(lr: float, wd: float, seed: int):
        key = "adamw_lr" if variant.optimizer == "adamw" else "lr"
        cfg2 = replace(cfg, weight_decay=wd, **{key: lr})
        return replace(probe_config(variant, cfg2, n, batches=cfg.M, drift_batches=cfg.drift_batches), seed=seed)

    def optimizer(params: Any, lr: float, wd: float):
        key = "adamw_lr" if variant.optimizer == "adamw" else "lr"
        return variant_optimizer(variant, replace(cfg, weight_decay=wd, **{key: lr}), params)

    return Model(
        name=name,
        encoder=run.encoder,
        optimizer=run.optimizer,
        kind=variant.optimizer,
        lr=variant.lr(cfg),
        weight_decay=cfg.weight_decay,
        temperature=cfg.temperature,
        batch_size=cfg.batch_size,
        pairs=np.asarray(data.pairs),
        n_items=n,
        probe_config=settings,
        make_optimizer=optimizer,
        train_seconds=round(time.perf_counter() - t0, 1),
    )


def head_model(config: Any, progress: bool) -> Model:
    """A linear head on frozen MiniLM embeddings of WordNet nouns: items are lemmas, pairs (lemma, gloss)."""
    import torch
    from torch import nn

    from normfast import InfoNCE, ModuleEncoder, ProbeConfig, load_encoder
    from normfast.data.wordnet import gloss, lemma_names, load_wordnet, noun_synsets

    t0 = time.perf_counter()
    n = config.head_items
    synsets = noun_synsets(load_wordnet())
    pick = np.random.default_rng(config.seed).choice(len(synsets), n, replace=False)
    texts = [lemma_names(synsets[i])[0].replace("_", " ") for i in pick] + [gloss(synsets[i]) for i in pick]
    enc = load_encoder("all-MiniLM-L6-v2")
    with torch.no_grad():
        feats = torch.cat([enc(enc.prepare(texts[i : i + 64]), output="pooled") for i in range(0, len(texts), 64)])
    feats = feats.float()
    torch.manual_seed(config.seed + 2)
    head = ModuleEncoder(
        [nn.Linear(feats.shape[1], HEAD_DIM)], collate=lambda ids: feats[torch.as_tensor(list(ids), dtype=torch.long)]
    )
    pairs = np.array([(i, n + i) for i in range(n)])
    opt = torch.optim.SGD(head.parameters(), lr=HEAD_LR, weight_decay=HEAD_WD)
    loss_fn = InfoNCE(HEAD_TAU)
    rng = np.random.default_rng(config.seed + 3)
    for _ in range(config.head_steps):
        idx = pairs[rng.integers(0, n, HEAD_BATCH)]
        loss = loss_fn.loss(head(head.prepare(idx[:, 0].tolist())), head(head.prepare(idx[:, 1].tolist())))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def settings(lr: float, wd: float, seed: int):
        return ProbeConfig(
            params="all", output="pooled", optimizer="sgd", lr=lr, weight_decay=wd, batches=16, drift_batches=64,
            batch_size=HEAD_BATCH, seed=seed, **PLAIN_HEAT,  # its committed results predate the energy draw
        )  # fmt: skip

    return Model(
        name="head",
        encoder=head,
        optimizer=opt,
        kind="sgd",
        lr=HEAD_LR,
        weight_decay=HEAD_WD,
        temperature=HEAD_TAU,
        batch_size=HEAD_BATCH,
        pairs=pairs,
        n_items=n,
        probe_config=settings,
        make_optimizer=lambda params, lr, wd: torch.optim.SGD(params, lr=lr, weight_decay=wd),
        train_seconds=round(time.perf_counter() - t0, 1),
    )


def changed(model: Model, change: str) -> tuple[float, float, np.ndarray]:
    """(lr, wd, pairs) after ``change`` (protocol step 2)."""
    lr, wd, pairs = model.lr, model.weight_decay, model.pairs
    if change == "data half":
        return lr, wd, pairs[pairs[:, 0] < model.n_items // 2]
    what, how = change.split()
    factor = 4.0 if how == "x4" else 0.25
    return (lr * factor, wd, pairs) if what == "lr" else (lr, wd * factor, pairs)


def continue_training(
    model: Model,
    lr: float,
    wd: float,
    pairs: np.ndarray,
    monitored: int,
    burn: int,
    window: int,
    seed: int,
    progress: bool,
) -> dict[str, np.ndarray]:
    """Protocol step 3: the real training continued at the new settings, the monitor on for the first
    ``monitored`` steps; the norm of every item after each monitored step, the monitor's realized
    terms, and the final norms (the mean over ``window`` steps after ``burn`` more)."""
    import torch
    from tqdm.auto import tqdm

    from normfast import InfoNCE, TrainingMonitor

    enc = copy.deepcopy(model.encoder)
    opt = model.make_optimizer(enc.parameters(), lr, wd)
    opt.load_state_dict(model.optimizer.state_dict())
    for g in opt.param_groups:  # the loaded state carries the old settings: set the new ones
        g["lr"], g["weight_decay"] = lr, wd
    items = list(range(model.n_items))
    monitor = TrainingMonitor(enc, items, every=1, out=None, terms=True, optimizer=opt, model_name=model.name)
    objective = InfoNCE(temperature=model.temperature)
    state_all = enc.prepare(items)
    rng = np.random.default_rng(seed)
    norms, final = [], []
    total = monitored + burn + window
    for step in tqdm(range(total), desc=f"{model.name} continued", disable=not progress, leave=False):
        idx = pairs[rng.integers(0, len(pairs), model.batch_size)]
        loss = objective.loss(enc(enc.prepare(idx[:, 0].tolist())), enc(enc.prepare(idx[:, 1].tolist())))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step < monitored:
            monitor.before_step(opt)
        opt.step()
        if step < monitored:
            monitor.after_step(opt)
            with torch.no_grad():
                norms.append(enc(state_all).norm(dim=-1).double().numpy())
        k = step - monitored - burn
        if k >= 0 and k % RECORD_EVERY == 0:
            with torch.no_grad():
                final.append(enc(state_all).norm(dim=-1).double().numpy())
    table = monitor.table()
    monitor.close()
    steps = np.asarray(table.column("step"))
    order = np.lexsort((np.asarray(table.column("item")), steps))
    terms = {
        k: np.asarray(table.column(k), dtype=float)[order].reshape(monitored, model.n_items)
        for k in ("norm", "task1", "task2", "decay", "remainder")
    }
    return {"norms": np.stack(norms), "terms": terms, "final": np.mean(final, axis=0)}


def monitor_law(model: Model, terms: dict[str, np.ndarray], s: int, lr: float, wd: float) -> np.ndarray:
    from normfast.engine.monitor import realized_law

    means = {k: terms[k][:s].mean(0) for k in ("task1", "task2", "decay", "remainder")}
    means["R2"] = np.square(terms["norm"][:s]).mean(0)
    means["R"] = terms["norm"][:s].mean(0)
    return realized_law(means, adamw=model.kind == "adamw", lr=lr, weight_decay=wd)


def extrapolated(norms: np.ndarray, s: int, tau: float) -> np.ndarray:
    """Each item's R² over the first ``s`` steps fitted to a + b exp(-t/τ); sqrt(a), else the present norm."""
    t = np.arange(1, s + 1, dtype=float)
    x = np.stack([np.ones_like(t), np.exp(-t / tau)], 1)
    coef, *_ = np.linalg.lstsq(x, np.square(norms[:s]), rcond=None)
    a = coef[0]
    return np.where(a > 0, np.sqrt(np.where(a > 0, a, 1.0)), norms[s - 1])


def fit(pred: np.ndarray, final: np.ndarray, present: np.ndarray) -> dict[str, float]:
    from normfast.core.stats import loglog_fit

    ok = np.isfinite(pred) & (pred > 0)
    f = loglog_fit(pred[ok], final[ok])
    lp, lf, l0 = np.log(pred[ok]), np.log(final[ok]), np.log(present[ok])
    base = float(np.sum(np.square(l0 - lf)))
    return {
        "slope": f["slope"],
        "pearson_r": f["pearson_r"],
        "level": float(np.median(pred[ok] / final[ok])),
        "skill": 1.0 - float(np.sum(np.square(lp - lf))) / base if base > 0 else float("nan"),
        "n": int(ok.sum()),
    }


def run_model(name: str, config: Any, progress: bool) -> dict[str, Any]:
    import normfast
    from normfast.engine.directions import adam_second_moments
    from normfast.engine.trajectory import TrajectoryMeter, relaxation_steps, snapshot_prediction

    model = head_model(config, progress) if name == "head" else e1_model(name, config, progress)
    items = list(range(model.n_items))
    base = model.probe_config(model.lr, model.weight_decay, config.seed)
    kappa0 = TrajectoryMeter(model.encoder, items, base).kappa()
    v_hat = adam_second_moments(model.optimizer, model.encoder) if model.kind == "adamw" else None
    out: dict[str, Any] = {"model": name, "train_seconds": model.train_seconds, "changes": []}
    for ci, change in enumerate(CHANGES[model.kind]):
        t0 = time.perf_counter()
        lr, wd, pairs = changed(model, change)
        settings = model.probe_config(lr, wd, config.seed * 7919 + 31 * ci)
        tau = float(relaxation_steps(settings, kappa0))
        monitored = max(16, int(round(max(T_RELAXATIONS) * tau)))
        burn, window = int(round(BURN_IN * tau)), max(int(round(WINDOW * tau)), RECORD_EVERY)
        seed = config.seed * 7919 + 31 * ci + 11
        cont = continue_training(model, lr, wd, pairs, monitored, burn, window, seed, progress)
        final = cont["final"]
        source = normfast.PairSource.from_iterable([(int(a), int(b)) for a, b in pairs])
        objective = normfast.InfoNCE(temperature=model.temperature)
        answers = []
        for ti, T in enumerate(T_RELAXATIONS):
            s = max(16, int(round(T * tau)))
            present = cont["norms"][s - 1]
            snap = snapshot_prediction(
                model.encoder,
                items,
                objective,
                source,
                replace(settings, seed=settings.seed + ti + 1, snapshot=True),
                steps=max(50, s),
                second_moments=v_hat,
                progress=False,
            )
            preds = {
                "monitor_law": monitor_law(model, cont["terms"], s, lr, wd),
                "present_norm": present,
                "extrapolated": extrapolated(cont["norms"], s, tau),
                "snapshot_law": np.asarray(snap.r_eq, dtype=float),
            }
            answers.append(
                {
                    "T_relaxations": s / tau,
                    "steps": s,
                    "fits": {p: fit(preds[p], final, present) for p in PREDICTORS},
                    "values": {p: np.asarray(preds[p]).tolist() for p in PREDICTORS},
                }
            )
        out["changes"].append(
            {
                "change": change,
                "relaxation_steps": tau,
                "steps": {"monitored": monitored, "burn_in": burn, "window": window},
                "final": final.tolist(),
                "final_over_start_median": float(np.median(final / cont["norms"][0])),
                "answers": answers,
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
        print(
            f"{name} {change}: tau {tau:.0f} steps; skill at T = "
            + ", ".join(
                f"{a['T_relaxations']:.2f}: law {a['fits']['monitor_law']['skill']:+.2f} extrap "
                f"{a['fits']['extrapolated']['skill']:+.2f} snapshot {a['fits']['snapshot_law']['skill']:+.2f}"
                for a in answers
            ),
            flush=True,
        )
    return out


def plot(result: dict[str, Any], path: Path) -> Path:
    """Skill over the present norm against T, one panel per model: colour = change, line = predictor."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, NullFormatter

    from bench.common import pyplot

    plt = pyplot()
    runs = result["results"]
    fig, axes = plt.subplots(1, len(runs), figsize=(max(7.0, 4.0 * len(runs)), 4.6), squeeze=False, sharey=True)
    styles = {"monitor_law": "-", "extrapolated": "--", "snapshot_law": ":"}
    changes: list[str] = []
    for ax, r in zip(axes[0], runs):
        for c in r["changes"]:
            if c["change"] not in changes:
                changes.append(c["change"])
            colour = f"C{changes.index(c['change'])}"
            t = [a["T_relaxations"] for a in c["answers"]]
            for p, ls in styles.items():
                s = [max(a["fits"][p]["skill"], -1.0) for a in c["answers"]]
                ax.plot(t, s, ls, color=colour, marker="o", ms=3, lw=1.4)
        ax.axhline(0, color="0.5", lw=0.8)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(T_RELAXATIONS))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticklabels([f"{x:g}" for x in T_RELAXATIONS])
        ax.set_title(r["model"], fontsize=11)
        ax.set_xlabel("relaxation times after the change")
    axes[0][0].set_ylabel("skill over the present norm")
    fig.suptitle("Where the norms settle after a change: 1 = exact, 0 = no better than the present norm", fontsize=11)
    colour_handles = [Line2D([], [], color=f"C{i}", lw=2, label=c) for i, c in enumerate(changes)]
    style_handles = [Line2D([], [], color="0.3", ls=ls, label=p.replace("_", " ")) for p, ls in styles.items()]
    fig.legend(handles=colour_handles, loc="lower center", ncol=len(changes), fontsize=9, frameon=False,
               bbox_to_anchor=(0.5, 0.055))  # fmt: skip
    fig.legend(handles=style_handles, loc="lower center", ncol=3, fontsize=9, frameon=False, bbox_to_anchor=(0.5, 0.0))
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.27, top=0.86, wspace=0.08)
    fig.savefig(path, dpi=120)  # not bench.common.save: its tight_layout would undo the legends' room
    plt.close(fig)
    return path
