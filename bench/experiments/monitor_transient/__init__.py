"""Monitor transient: after a change of settings or data, does the monitor's law say where each norm is heading?

    python -m bench run monitor_transient --out bench/results/monitor_transient                  # seed 0
    python -m bench run monitor_transient --seed 1 --out bench/results/monitor_transient/seed1   # the fresh seed
    python -m bench run monitor_transient --quick                                                # toy size

In a stationary window every predictor looks good, and the training monitor's law from the
realized terms reproduces the window's mean norm by construction (an identity of a closed
balance). The law is worth running where the present norm is wrong: after a change, before
the norms settle. This experiment asks it there, with the answer known.

Protocol (v1, written down and committed before any of its runs):

1. Models, each trained to its stationary state at its base settings:
   ``mlp``, ``mlp_bias`` (SGD) and ``mlp_adamw`` (AdamW): E1's models, data and training
   (E1's configuration and seed; ``bench.experiments.e1``);
   ``head``: a different family, a linear head 384 -> 64 (with bias) on frozen
   all-MiniLM-L6-v2 sentence embeddings of 512 WordNet nouns (the item is the noun's
   lemma; a training pair is (lemma, gloss) of one noun), InfoNCE temperature 0.05, SGD lr
   0.05, wd 0.01, batch 64, trained 5 relaxation times (5 000 steps) from a seeded start.
2. Changes: ``wd x4``, ``wd /4``, ``lr x4`` for the SGD models, ``wd x4``, ``lr x4`` for
   AdamW (``wd /4`` left out, as in e1_counterfactual: its observation needs ~180 000
   steps), and one data change for every model, ``data half``: from the change on, the
   batches are drawn only from the pairs whose anchor lies in the first half of the items
   (the other half stay probe items but are no longer trained on as anchors).
3. After the change the real training continues (the model and its optimizer state) with
   the training monitor on at every step (``every=1``, realized terms) for the first
   relaxation time τ₂ = 1/(2 η₂' λ₂ κ̃) of the new settings (κ̃: the median κ at the
   change; the data change keeps τ₂ = τ₁), then without it for 5 τ₂ more; the final
   norms are the mean norm of every item over the next 4 τ₂ (recorded every
   ``record_every`` steps, as E1's observed norms).
4. Predictions at T = 0.1, 0.25, 0.5, 1 relaxation times after the change
   (S = max(16, round(T τ₂)) steps: the snapshot's interval needs 16), for every item:
   ``monitor_law``: the law solved with the realized terms' means over the first S steps
   (``normfast.engine.monitor.realized_law`` at the new settings; R² and R the window's
   means); ``present_norm``: the norm after step S; ``extrapolated``: each item's R²(t)
   over the first S steps fitted by least squares to a + b·exp(-t/τ₂), τ₂ as in 3, the
   prediction sqrt(a) (the present norm where a <= 0); ``snapshot_law``: the engine's
   ``r_eq_snapshot`` from the state at the change with max(50, S) virtual steps at the new
   settings (its drift's error variance needs two blocks of 25; for the data change: the
   virtual batches from the new pairs). It sees no real step after the change: its T is the
   length of its own virtual continuation.
5. Read-outs per (model, change, T, predictor) against the final norms: log-log slope and
   Pearson r, the level (median of prediction / final) and the skill over the present
   norm, ``1 - Σ(log p - log f)² / Σ(log present - log f)²`` (0: no better than the
   present norm; 1: exact).
6. Verdict, per (model, change): the smallest T at which the monitor's law beats both the
   present norm and the extrapolation on skill; where none, the docs say the law did not
   help there. Two seeds (0, and 1 fresh: data, initialization, batches).

Writes OUT/monitor_transient.json and OUT/monitor_transient.png.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import Context, JsonStyle, UsageError, drop_partial, resumable

RESULTS = ("monitor_transient.json", "seed1/monitor_transient.json")
FIGURES = ("monitor_transient.png", "seed1/monitor_transient.png")
TABLES = ("monitor-transient", "monitor-transient-seed1", "monitor-transient-verdict")
JSON = JsonStyle(newline=False, strict=False)

MODELS = ("mlp", "mlp_bias", "mlp_adamw", "head")
T_RELAXATIONS = (0.1, 0.25, 0.5, 1.0)
PREDICTORS = ("monitor_law", "present_norm", "extrapolated", "snapshot_law")
CHANGES = {"sgd": ("wd x4", "wd /4", "lr x4", "data half"), "adamw": ("wd x4", "lr x4", "data half")}
#: burn-in and averaging window of the final norms, in relaxation times after the monitored one (step 3)
BURN_IN, WINDOW = 5.0, 4.0


@dataclass
class Config:
    models: str = field(default=",".join(MODELS), metadata={"help": "comma-separated subset of " + ", ".join(MODELS)})
    size: str = field(default="full", metadata={"choices": ("full", "quick"), "help": "E1's configuration"})
    steps: int | None = field(default=None, metadata={"help": "override E1's training steps"})
    head_items: int = field(default=512, metadata={"help": "WordNet nouns of the head model"})
    head_steps: int = field(default=5000, metadata={"help": "the head model's training steps"})
    seed: int = 0

    @classmethod
    def quick(cls) -> "Config":
        return cls(models="mlp", size="quick", steps=600, head_items=64, head_steps=200)

    def model_names(self) -> list[str]:
        from bench.common import names_in

        return names_in(self.models, MODELS, "monitor_transient", "model")


def run(config: Config, ctx: Context) -> dict[str, Any]:
    import torch

    from bench.experiments.monitor_transient.continuation import run_model
    from normfast.engine.runner import library_versions

    names = config.model_names()
    torch.set_num_threads(1)  # tiny models: one thread is faster and the runs are compared number for number
    t0 = time.perf_counter()
    # one model a unit, kept in OUT/partial/ so that an interrupted run repeats only the models it had
    # not finished (each model's run is deterministic at one thread)
    results = [
        resumable(ctx, name, config.__dict__, lambda n=name: run_model(n, config, ctx.progress), JSON) for name in names
    ]
    drop_partial(ctx, names)  # the whole result is returned now; the harness writes it
    out = {
        "experiment": "monitor transient",
        "config": {**config.__dict__, "t_relaxations": T_RELAXATIONS, "burn_in": BURN_IN, "window": WINDOW},
        "results": results,
        "verdict": verdict(results),
        "seconds": round(time.perf_counter() - t0, 1),
        "versions": library_versions(),
    }
    if not results:
        raise UsageError("monitor_transient: no model to run")
    return out


def verdict(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Protocol step 6: per (model, change), the smallest T at which the monitor's law beats both baselines."""
    rows = []
    for r in results:
        for c in r["changes"]:
            first = None
            for a in c["answers"]:
                s = {p: a["fits"][p]["skill"] for p in PREDICTORS}
                if s["monitor_law"] > 0 and s["monitor_law"] > s["extrapolated"]:
                    first = a["T_relaxations"]
                    break
            rows.append({"model": r["model"], "change": c["change"], "law_helps_from_T": first})
    return rows


def _cell(f: dict[str, float]) -> str:
    return f"{f['slope']:.2f} / {f['pearson_r']:.2f} / {f['level']:.2f} / {f['skill']:+.2f}"


def tables(result: dict[str, Any]) -> dict[str, str]:
    head = " | ".join(p.replace("_", " ") for p in PREDICTORS)
    rows = [f"| model | change | T (relaxation times) | {head} |", "|---" * (3 + len(PREDICTORS)) + "|"]
    for r in result["results"]:
        for c in r["changes"]:
            for a in c["answers"]:
                cells = " | ".join(_cell(a["fits"][p]) for p in PREDICTORS)
                rows.append(f"| {r['model']} | {c['change']} | {a['T_relaxations']:.2f} | {cells} |")
    rows += ["", "Each cell: slope / r / level (median prediction over final) / skill over the present norm."]
    helps = [f"{v['model']} {v['change']}: {v['law_helps_from_T']}" for v in result["verdict"]]
    rows += ["", "The monitor's law beats the present norm and the extrapolation from T = " + "; ".join(helps) + "."]
    return {"monitor-transient": "\n".join(rows)}


def blocks(committed: Any) -> dict[str, str | None]:
    """Each seed's table, and the verdict of both seeds side by side (only what is committed)."""
    runs = {name: committed(name) for name in RESULTS}
    seed0, seed1 = (runs[name] for name in RESULTS)
    out: dict[str, str | None] = {
        "monitor-transient": tables(seed0)["monitor-transient"] if seed0 else None,
        "monitor-transient-seed1": tables(seed1)["monitor-transient"] if seed1 else None,
    }
    if seed0 and seed1:
        fmt = lambda t: "never" if t is None else f"{t:.2f}"  # noqa: E731
        moved = {
            (seed, r["model"], c["change"]): c["final_over_start_median"]
            for seed, d in ((0, seed0), (1, seed1))
            for r in d["results"]
            for c in r["changes"]
        }
        first = {(v["model"], v["change"]): v["law_helps_from_T"] for v in seed1["verdict"]}
        rows = [
            "| model | change | law helps from T, seed 0 | seed 1 | final / at the change, seed 0 | seed 1 |",
            "|---|---|---|---|---|---|",
        ]
        for v in seed0["verdict"]:
            key = (v["model"], v["change"])
            rows.append(
                f"| {v['model']} | {v['change']} | {fmt(v['law_helps_from_T'])} | {fmt(first.get(key))} | "
                f"{moved[(0, *key)]:.2f} | {moved.get((1, *key), float('nan')):.2f} |"
            )
        rows += [
            "",
            "Law helps from T: the smallest T (relaxation times after the change) at which the monitor's law beats "
            "both the present norm and the extrapolation on skill (never: at no T up to 1). Final / at the change: "
            "the median over items of the final norm over the norm at the change.",
        ]
        out["monitor-transient-verdict"] = "\n".join(rows)
    return out


def figures(result: dict[str, Any], out: Path) -> list[Path]:
    from bench.experiments.monitor_transient.continuation import plot

    return [plot(result, out / "monitor_transient.png")]
