"""Norm-discounted retrieval: the score, an alpha sweep, baselines, BEIR I/O, FAISS export.

The score of document ``d`` for query ``q`` is

    score(q, d) = cos(q, d) * ||d||**alpha = q_hat . (d_hat * ||d||**alpha)

so a norm discount is nothing but a rescaling of the document vectors: any
inner-product index serves it at no query-time cost. ``alpha = 0`` is cosine
similarity, ``alpha = 1`` is the raw dot product (up to the query norm, which
does not change a ranking), ``alpha < 0`` penalizes large-norm documents.

Embedding norms often correlate with document length, so every sweep can run a
*length-only control* over the same grid: ``cos(q, d) * len(d)**beta`` with the
length (tokens, words or characters) supplied by the caller. If the norm
discount helps and the length discount helps as much, the norm carries no
information beyond length.

Metrics come from ``pytrec_eval`` (the C implementation of trec_eval):
NDCG@10 (``ndcg_cut_10``, trec_eval's linear gain ``rel / log2(rank + 1)``),
recall@100 (``recall_100``) and MRR (``recip_rank`` over the ``k`` retrieved
documents). Rankings are exact (brute-force inner products, queries processed
in chunks so memory stays bounded) and deterministic: documents are ordered by
id (lexicographic string order) once, and equal scores are broken by that
order. The run handed to trec_eval carries strictly decreasing rank scores, so
trec_eval's own tie rule never comes into play.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from normfast.core.checks import check_positive_int, describe
from normfast.apps.scoring import (  # noqa: F401 - re-exported: the retrieval API in one place
    _SCORE_MEMORY_MB, _TREC_MEASURES, _TREC_REQUEST, CONTROLS, DEFAULT_ALPHAS, METRICS, UNLABELLED, _check_qrels,
    _describe_invalid, _embedding_table, _finite_float, _lengths_vector, _scale_rows, export_faiss, invalid_rows,
    load_faiss, rescale_by_length, rescale_documents, scores, search)
from normfast.data.beir import BeirData, BeirFormatError, load_beir, write_beir  # noqa: F401

@dataclass
class SweepResult:
    """Per-query metrics of an alpha sweep, with the summaries derived from them.

    ``per_query[control]`` is ``[n_alpha, n_query, len(METRICS)]``; ``control`` is
    ``"norm"`` (``cos * ||d||**alpha``) or ``"length"`` (``cos * len(d)**alpha``,
    present when lengths were given). Queries follow ``query_ids`` (sorted).
    ``dev`` marks the queries used to choose alpha when ``select_on == "dev"``;
    the others form the test split on which everything is then reported.
    Queries or documents without a direction are listed, with the reason, in
    ``invalid_queries`` / ``invalid_docs`` and take no part in the metrics.
    """

    alphas: list[float]
    k: int
    query_ids: list[str]
    per_query: dict[str, np.ndarray]
    strata: list[str] | None
    select_on: str
    dev: np.ndarray
    n_docs: int
    invalid_docs: dict[str, str] = field(default_factory=dict)
    invalid_queries: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    # -- subsets --------------------------------------------------------------
    @property
    def controls(self) -> list[str]:
        return [c for c in CONTROLS if c in self.per_query]

    def _mask(self, subset: str, stratum: str | None = None) -> np.ndarray:
        if subset == "all":
            m = np.ones(len(self.query_ids), dtype=bool)
        elif subset == "dev":
            m = self.dev.copy()
        elif subset == "test":
            m = ~self.dev
        elif subset == "select":
            return self._mask("dev" if self.select_on == "dev" else "all", stratum)
        elif subset == "eval":
            return self._mask("test" if self.select_on == "dev" else "all", stratum)
        else:
            raise ValueError("SweepResult: subset must be all|dev|test|select|eval, "
                             f"got {subset!r}")
        if stratum is not None:
            if self.strata is None:
                raise ValueError("SweepResult: this sweep has no strata")
            m &= np.array([s == stratum for s in self.strata])
        return m

    def stratum_names(self) -> list[str]:
        return [] if self.strata is None else sorted(set(self.strata))

    def count(self, subset: str = "eval", stratum: str | None = None) -> int:
        return int(self._mask(subset, stratum).sum())

    def curve(self, control: str = "norm", metric: str = "ndcg@10", subset: str = "eval",
              stratum: str | None = None) -> np.ndarray:
        """Mean of ``metric`` over the chosen queries, one value per alpha (NaN if none)."""
        if control not in self.per_query:
            raise ValueError(f"SweepResult: control must be one of {self.controls}, "
                             f"got {control!r}")
        if metric not in METRICS:
            raise ValueError(f"SweepResult: metric must be one of {METRICS}, got {metric!r}")
        m = self._mask(subset, stratum)
        if not m.any():
            return np.full(len(self.alphas), np.nan)
        return self.per_query[control][:, m, METRICS.index(metric)].mean(axis=1)

    # -- summaries ------------------------------------------------------------
    def _index(self, alpha: float) -> int:
        return int(np.argmin(np.abs(np.asarray(self.alphas) - alpha)))

    def best_index(self, control: str = "norm") -> int:
        """Grid index with the highest NDCG@10 on the selection split (all queries or dev).

        Never chosen per stratum. Ties go to the smallest ``|alpha|`` (closest to
        cosine), then to the smaller alpha.
        """
        ndcg = np.round(self.curve(control, "ndcg@10", "select"), 12)
        order = sorted(range(len(self.alphas)),
                       key=lambda i: (-ndcg[i], abs(self.alphas[i]), self.alphas[i]))
        return order[0]

    def summary(self, control: str = "norm") -> dict[str, Any]:
        """Best alpha (chosen on the selection split) and its gain over cosine on the eval split."""
        b, c = self.best_index(control), self._index(0.0)

        def gain(new: float, base: float) -> float | None:
            if not (np.isfinite(new) and np.isfinite(base)) or base == 0:
                return None
            return float(100.0 * (new - base) / base)

        out: dict[str, Any] = {"alpha": self.alphas[b], "selected_on": self.select_on,
                               "n_queries": self.count("eval")}
        for metric in METRICS:
            cur = self.curve(control, metric, "eval")
            out[metric] = float(cur[b])
            out[f"cosine_{metric}"] = float(cur[c])
        out["gain_pct"] = gain(out["ndcg@10"], out["cosine_ndcg@10"])
        per = {}
        for s in self.stratum_names():
            cur = self.curve(control, "ndcg@10", "eval", s)
            per[s] = {"n_queries": self.count("eval", s), "ndcg@10": float(cur[b]),
                      "cosine_ndcg@10": float(cur[c]),
                      "gain_pct": gain(float(cur[b]), float(cur[c]))}
        if per:
            out["per_stratum"] = per
        return out

    def baselines(self) -> dict[str, dict[str, float]]:
        """Cosine (alpha = 0) and dot product (alpha = 1) on the eval split."""
        out = {}
        for name, a in (("cosine", 0.0), ("dot", 1.0)):
            i = self._index(a)
            out[name] = {m: float(self.curve("norm", m, "eval")[i]) for m in METRICS}
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary: curves (overall and per stratum), best alpha, gains, baselines."""
        curves: dict[str, Any] = {}
        for control in self.controls:
            entry: dict[str, Any] = {
                "all": {m: _jsonable(self.curve(control, m, "eval")) for m in METRICS}}
            for s in self.stratum_names():
                entry[s] = {m: _jsonable(self.curve(control, m, "eval", s)) for m in METRICS}
            curves[control] = entry
        return {
            "alphas": list(self.alphas),
            "k": self.k,
            "metrics": list(METRICS),
            "n_docs": self.n_docs,
            "n_queries": len(self.query_ids),
            "select_on": self.select_on,
            "n_dev": int(self.dev.sum()),
            "n_eval": self.count("eval"),
            "strata": {s: self.count("eval", s) for s in self.stratum_names()},
            "baselines": self.baselines(),
            "best": {c: self.summary(c) for c in self.controls},
            "curves": curves,
            "invalid_docs": self.invalid_docs,
            "invalid_queries": self.invalid_queries,
            "notes": self.notes,
        }

    def table(self) -> str:
        """A plain-text table: metrics per alpha (eval split), then the best-alpha summary."""
        lines = []
        head = f"{'alpha':>6}  " + "  ".join(f"{m:>10}" for m in METRICS)
        if "length" in self.per_query:
            head += f"  {'len:ndcg@10':>11}"
        strata = self.stratum_names()
        head += "".join(f"  {s[:12]:>12}" for s in strata)
        lines.append(head)
        cols = {m: self.curve("norm", m, "eval") for m in METRICS}
        lencol = self.curve("length", "ndcg@10", "eval") if "length" in self.per_query else None
        scols = {s: self.curve("norm", "ndcg@10", "eval", s) for s in strata}
        for i, a in enumerate(self.alphas):
            row = f"{a:>6.2f}  " + "  ".join(f"{cols[m][i]:>10.4f}" for m in METRICS)
            if lencol is not None:
                row += f"  {lencol[i]:>11.4f}"
            row += "".join(f"  {scols[s][i]:>12.4f}" for s in strata)
            lines.append(row)
        split = "dev split" if self.select_on == "dev" else "all queries"
        lines.append("")
        lines.append(f"queries: {self.count('eval')} evaluated, documents: {self.n_docs}; "
                     f"alpha chosen on {split}; strata columns show NDCG@10")
        for control in self.controls:
            s = self.summary(control)
            label = "norm   cos*|d|^alpha" if control == "norm" else "length cos*len^beta "
            g = "n/a" if s["gain_pct"] is None else f"{s['gain_pct']:+.2f}%"
            lines.append(f"best {label}: {s['alpha']:+.2f}  NDCG@10 {s['ndcg@10']:.4f} vs cosine "
                         f"{s['cosine_ndcg@10']:.4f} ({g})")
            for name, ps in s.get("per_stratum", {}).items():
                pg = "n/a" if ps["gain_pct"] is None else f"{ps['gain_pct']:+.2f}%"
                lines.append(f"    {name:<14} n={ps['n_queries']:<6} {ps['ndcg@10']:.4f} vs "
                             f"{ps['cosine_ndcg@10']:.4f} ({pg})")
        base = self.baselines()
        lines.append(f"baselines: cosine NDCG@10 {base['cosine']['ndcg@10']:.4f}, "
                     f"dot NDCG@10 {base['dot']['ndcg@10']:.4f}")
        if self.invalid_docs or self.invalid_queries:
            lines.append(f"excluded without a direction: {len(self.invalid_docs)} documents, "
                         f"{len(self.invalid_queries)} queries (listed in the JSON)")
        return "\n".join(lines)

    def save(self, out_dir: str | os.PathLike) -> tuple[Path, Path]:
        """Write ``retrieval.json`` and ``ndcg_vs_alpha.png`` into ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        js = out / "retrieval.json"
        js.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        png = plot_sweep(self, out / "ndcg_vs_alpha.png")
        return js, png


def _jsonable(a: np.ndarray) -> list[float | None]:
    return [None if not np.isfinite(v) else float(v) for v in a]


def _split_dev(query_ids: Sequence[str], fraction: float, seed: int) -> np.ndarray:
    """Deterministic dev mask: a seeded permutation of the sorted ids, first ``fraction`` to dev."""
    n = len(query_ids)
    order = np.argsort(np.array(query_ids, dtype=object), kind="stable")
    perm = np.random.default_rng(seed).permutation(n)
    n_dev = int(round(fraction * n))
    dev = np.zeros(n, dtype=bool)
    dev[order[perm[:n_dev]]] = True
    return dev


def alpha_sweep(queries: Any, docs: Any, qrels: Mapping[str, Mapping[str, int]],
                alphas: Iterable[float] = DEFAULT_ALPHAS, *, k: int = 100,
                strata: Mapping[str, str] | None = None, lengths: Any = None,
                select_on: str = "all", dev_fraction: float = 0.5, seed: int = 0,
                memory_mb: float = _SCORE_MEMORY_MB, progress: bool = False) -> SweepResult:
    """Retrieval quality of ``cos(q, d) * ||d||**alpha`` over a grid of alphas.

    Args:
        queries, docs: raw embeddings, each a ``{id: vector}`` mapping or an
            ``(ids, [n, d] matrix)`` pair.
        qrels: ``{query_id: {doc_id: relevance}}`` (integers; > 0 is relevant).
            Only queries with at least one relevant document and an embedding
            are evaluated; the others are counted in ``notes``.
        alphas: the grid. 0 (cosine) and 1 (dot product) are always added: they
            are the baselines.
        k: documents retrieved per query (recall@100 needs ``k >= 100``).
        strata: ``{query_id: label}``; metrics are also reported per label.
            Queries without a label form the stratum ``"(unlabelled)"``.
        lengths: document lengths (``{doc_id: length}`` or an array in the row
            order of ``docs``) for the length-only control
            ``cos * len**beta``, swept over the same grid.
        select_on: how the best alpha is chosen -- always on overall NDCG@10,
            never per stratum. ``"all"``: on all queries (the reported gain is
            then optimistic by the selection); ``"dev"``: on a deterministic
            dev split (``dev_fraction`` of the queries, drawn with ``seed``),
            and everything is reported on the remaining test queries.
        memory_mb: bound on one chunk of the score matrix.
        progress: show a progress bar over the grid.

    Returns:
        A :class:`SweepResult`.
    """
    fn = "alpha_sweep"
    k = check_positive_int(fn, "k", k)
    if select_on not in ("all", "dev"):
        raise ValueError(f"{fn}: expected select_on to be 'all' or 'dev', got {select_on!r}")
    frac = _finite_float(fn, "dev_fraction", dev_fraction)
    if select_on == "dev" and not 0 < frac < 1:
        raise ValueError(f"{fn}: expected 0 < dev_fraction < 1, got {dev_fraction!r}")
    grid = sorted({round(_finite_float(fn, "alphas[...]", a), 12) for a in alphas} | {0.0, 1.0})
    q_ids, Q = _embedding_table(fn, "queries", queries)
    d_ids, D = _embedding_table(fn, "docs", docs)
    if Q.shape[1] != D.shape[1]:
        raise ValueError(f"{fn}: expected queries and docs with the same dimension, got "
                         f"{describe('queries', Q)} and {describe('docs', D)}")
    qrels = _check_qrels(fn, qrels)
    notes: list[str] = []
    if k < 100:
        notes.append(f"k={k} < 100: recall@100 counts only the top {k}")

    lens = None
    if lengths is not None:
        if isinstance(lengths, Mapping):
            missing = [d for d in d_ids if d not in lengths]
            if missing:
                raise ValueError(f"{fn}: lengths has no entry for {len(missing)} document(s), "
                                 f"e.g. {missing[0]!r}")
            lengths = [lengths[d] for d in d_ids]
        lens = _lengths_vector(fn, lengths, len(d_ids))

    # documents in id order: ties are broken by it
    order = sorted(range(len(d_ids)), key=d_ids.__getitem__)
    d_ids = [d_ids[i] for i in order]
    D = D[torch.tensor(order, dtype=torch.long)]
    if lens is not None:
        lens = lens[torch.tensor(order, dtype=torch.long)]
    bad_docs = invalid_rows(D)
    invalid_docs = {d_ids[i]: why for i, why in bad_docs.items()}
    if bad_docs:
        warnings.warn(f"{fn}: {len(bad_docs)} document(s) without a direction are never retrieved "
                      f"({_describe_invalid(invalid_docs)}); see SweepResult.invalid_docs",
                      stacklevel=2)
    bad_q = invalid_rows(Q)
    invalid_queries = {q_ids[i]: why for i, why in bad_q.items()}

    # which queries are evaluated
    q_row = {q: i for i, q in enumerate(q_ids)}
    judged = {q: r for q, r in qrels.items() if any(v > 0 for v in r.values())}
    if len(judged) < len(qrels):
        notes.append(f"{len(qrels) - len(judged)} qrels queries without a relevant document "
                     "skipped")
    no_vec = [q for q in judged if q not in q_row]
    if no_vec:
        notes.append(f"{len(no_vec)} qrels queries without an embedding skipped "
                     f"(e.g. {no_vec[0]!r})")
        warnings.warn(f"{fn}: {notes[-1]}", stacklevel=2)
    eval_ids = sorted(q for q in judged if q in q_row and q not in invalid_queries)
    if invalid_queries:
        notes.append(f"{len(invalid_queries)} queries without a direction skipped "
                     "(invalid_queries)")
    if not eval_ids:
        raise ValueError(f"{fn}: no query can be evaluated: qrels and queries share no valid id "
                         f"(qrels has {len(qrels)} queries, queries has {len(q_ids)})")
    doc_set = set(d_ids)
    unknown = sum(1 for q in eval_ids for d, v in judged[q].items() if v > 0 and d not in doc_set)
    if unknown:
        notes.append(f"{unknown} relevant judgments name documents absent from docs (unreachable)")

    labels = None
    if strata is not None:
        if not isinstance(strata, Mapping):  # checked here, before the expensive part
            raise TypeError(f"{fn}: expected strata to be a {{query_id: label}} mapping, "
                            f"got {type(strata).__name__}")
        labels = [str(strata[q]) if q in strata else UNLABELLED for q in eval_ids]
        n_unl = labels.count(UNLABELLED)
        if n_unl:
            notes.append(f"{n_unl} evaluated queries have no stratum label ({UNLABELLED!r})")
    dev = (_split_dev(eval_ids, frac, seed) if select_on == "dev"
           else np.zeros(len(eval_ids), dtype=bool))
    if select_on == "dev" and (dev.all() or not dev.any()):
        raise ValueError(f"{fn}: dev_fraction={dev_fraction} leaves an empty dev or test split "
                         f"with {len(eval_ids)} queries")
    rows = torch.tensor([q_row[q] for q in eval_ids], dtype=torch.long)
    Qn = Q[rows]
    Qn = Qn / torch.linalg.vector_norm(Qn, dim=1, keepdim=True)

    import pytrec_eval

    evaluator = pytrec_eval.RelevanceEvaluator({q: judged[q] for q in eval_ids}, _TREC_REQUEST)
    trec_keys = [_TREC_MEASURES[m] for m in METRICS]

    def evaluate(doc_matrix: torch.Tensor) -> np.ndarray:
        idx, val = search(Qn, doc_matrix, k, memory_mb=memory_mb)
        finite = torch.isfinite(val)
        idx_l, fin_l = idx.tolist(), finite.tolist()
        depth = idx.shape[1]
        run = {}
        for qi, q in enumerate(eval_ids):
            # strictly decreasing rank scores: trec_eval re-sorts by score
            run[q] = {d_ids[j]: float(depth - r)
                      for r, (j, ok) in enumerate(zip(idx_l[qi], fin_l[qi])) if ok}
        res = evaluator.evaluate(run)
        out = np.zeros((len(eval_ids), len(METRICS)))
        for qi, q in enumerate(eval_ids):
            got = res.get(q)
            if got is not None:  # a query with nothing retrieved scores 0 everywhere
                out[qi] = [got[t] for t in trec_keys]
        return out

    # the same as rescale_documents / rescale_by_length(invalid="nan"), norms computed once
    norms = torch.linalg.vector_norm(D.double(), dim=1)
    bad_rows = list(bad_docs)
    controls = {"norm": lambda a: _scale_rows(D, norms ** (a - 1.0), bad_rows)}
    if lens is not None:
        controls["length"] = lambda b: _scale_rows(D, lens ** b / norms, bad_rows)
    per_query = {c: np.zeros((len(grid), len(eval_ids), len(METRICS))) for c in controls}
    jobs = [(c, i) for c in controls for i in range(len(grid))]
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(jobs), desc="alpha sweep", unit="alpha")
    cosine = None
    for c, i in jobs:
        a = grid[i]
        if a == 0.0 and cosine is not None:  # both controls reduce to cosine at 0
            per_query[c][i] = cosine
        else:
            per_query[c][i] = evaluate(controls[c](a))
            if a == 0.0:
                cosine = per_query[c][i]
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    return SweepResult(alphas=grid, k=k, query_ids=eval_ids, per_query=per_query, strata=labels,
                       select_on=select_on, dev=dev, n_docs=len(d_ids), invalid_docs=invalid_docs,
                       invalid_queries=invalid_queries, notes=notes)


# ---------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------

def plot_sweep(result: SweepResult, path: str | os.PathLike, metric: str = "ndcg@10") -> Path:
    """``metric`` vs alpha on the eval split, overall (thick) and per stratum.

    The length control is drawn dashed in the same colour; a dotted line marks
    the best alpha. Returns the PNG's path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = np.asarray(result.alphas)
    groups: list[tuple[str, str | None]] = [("all", None)]
    groups += [(s, s) for s in result.stratum_names()]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for gi, (name, stratum) in enumerate(groups):
        color = "black" if stratum is None else colors[(gi - 1) % len(colors)]
        width = 2.2 if stratum is None else 1.2
        n = result.count("eval", stratum)
        ax.plot(x, result.curve("norm", metric, "eval", stratum), color=color, lw=width,
                marker="o", ms=3, label=f"{name} (n={n}) cos*|d|^a")
        if "length" in result.per_query:
            ax.plot(x, result.curve("length", metric, "eval", stratum), color=color, lw=width,
                    ls="--", label=f"{name} length control cos*len^a")
    best = result.alphas[result.best_index("norm")]
    ax.axvline(best, color="grey", lw=0.8, ls=":")
    ax.axvline(0.0, color="grey", lw=0.5)
    ax.set_xlabel("alpha (exponent of the document norm, or of the length for dashed lines)")
    ax.set_ylabel(metric.upper() if metric != "mrr" else "MRR")
    split, chosen = (("test split", "dev split") if result.select_on == "dev"
                     else ("all queries", "all queries"))
    ax.set_title(f"{metric} vs alpha ({split}); dotted: best alpha {best:+.2f} "
                 f"(chosen on {chosen})", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# CLI
# ---------------------------------------------------------------------------

retrieval_description = """\
Norm-discounted retrieval on a BEIR-format collection.

The score of document d for query q is

    score(q, d) = cos(q, d) * |d|^alpha  =  q_hat . (d_hat * |d|^alpha)

alpha = 0 is cosine similarity, alpha = 1 the dot product, alpha < 0 favours
documents with small embedding norms. Because the discount only rescales the
document vectors, any inner-product index serves it (see --faiss).

The command sweeps alpha over a grid and reports NDCG@10, recall@100 and MRR
(computed by trec_eval through pytrec_eval). Baselines: cosine (alpha = 0),
dot (alpha = 1), and a LENGTH-ONLY CONTROL, cos(q, d) * len(d)^beta, swept over
the same grid. Embedding norms often track document length; if the length
control gains as much as the norm does, the norm adds nothing beyond length.

The best alpha is chosen on overall NDCG@10 -- never per stratum -- over all
queries, or with --select-on dev on a fixed random half of the queries, with
the gain then reported on the other half (an unbiased estimate).

Embeddings come from --vectors (an .npz with arrays query_ids, queries,
doc_ids, docs and optionally doc_lengths; raw, unnormalized vectors) or are
computed with --model. Without doc_lengths, lengths are counted from the
corpus text (title + text) in --length-unit.

examples:
  normfast retrieval --beir data/wn_defs --vectors emb.npz --strata-key stratum --out res/
  normfast retrieval --beir data/scifact --model MODEL --alphas=-1:1:0.1 --select-on dev
  normfast retrieval --beir data/scifact --vectors emb.npz --faiss idx.faiss --alpha -0.3
"""


def parse_alphas(spec: str) -> list[float]:
    """``"start:stop:step"`` (stop included) or a comma-separated list."""
    spec = spec.strip()
    try:
        if ":" in spec:
            parts = [float(p) for p in spec.split(":")]
            if len(parts) != 3 or parts[2] <= 0 or parts[1] < parts[0]:
                raise ValueError
            n = int(math.floor((parts[1] - parts[0]) / parts[2] + 1e-9)) + 1
            return [round(parts[0] + i * parts[2], 10) for i in range(n)]
        values = [float(p) for p in spec.split(",") if p.strip()]
        if not values:
            raise ValueError
        return values
    except ValueError:
        raise ValueError(f"--alphas: expected START:STOP:STEP (STOP >= START, STEP > 0) or a "
                         f"comma-separated list of numbers, got {spec!r}") from None


def retrieval_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("data")
    src.add_argument("--beir", required=True, metavar="DIR",
                     help="BEIR collection (corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv)")
    src.add_argument("--split", default="test", help="qrels split to evaluate (default: test)")
    emb = src.add_mutually_exclusive_group(required=True)
    emb.add_argument("--vectors", metavar="FILE.npz",
                     help="precomputed raw embeddings: query_ids, queries, doc_ids, docs"
                          "[, doc_lengths]")
    emb.add_argument("--model", metavar="SPEC", help="encoder to embed queries and documents with")
    src.add_argument("--batch-size", type=int, default=64, help="encoding batch size (default: 64)")
    src.add_argument("--length-unit", choices=("words", "chars"), default="words",
                     help="length for the control when the .npz has no doc_lengths "
                          "(default: words)")
    sw = parser.add_argument_group("sweep")
    sw.add_argument("--alphas", default="-1:1:0.1", metavar="GRID",
                    help="START:STOP:STEP or a comma list; write --alphas=-1:1:0.1 when it starts "
                         "with a minus sign (default: -1:1:0.1; 0 and 1 are always added)")
    sw.add_argument("--k", type=int, default=100,
                    help="documents retrieved per query (default: 100)")
    sw.add_argument("--strata-key", metavar="KEY",
                    help="queries.jsonl metadata key whose value labels each query's stratum")
    sw.add_argument("--select-on", choices=("all", "dev"), default="all",
                    help="choose the best alpha on all queries or on a dev half (default: all)")
    sw.add_argument("--dev-fraction", type=float, default=0.5, help="dev share for --select-on dev")
    sw.add_argument("--seed", type=int, default=0, help="seed of the dev/test split (default: 0)")
    out = parser.add_argument_group("output")
    out.add_argument("--out", metavar="DIR", help="write retrieval.json and ndcg_vs_alpha.png here")
    out.add_argument("--faiss", metavar="PATH",
                     help="also export an IndexFlatIP for --alpha to PATH")
    out.add_argument("--alpha", type=float, help="alpha of the exported index (with --faiss)")
    out.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _load_vectors(path: str) -> dict[str, np.ndarray]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--vectors: no such file {p}")
    with np.load(p, allow_pickle=False) as z:
        arrays = {name: z[name] for name in z.files}
    need = ("query_ids", "queries", "doc_ids", "docs")
    missing = [n for n in need if n not in arrays]
    if missing:
        raise ValueError(f"--vectors: {p} lacks array(s) {', '.join(missing)} "
                         f"(has {', '.join(sorted(arrays)) or 'none'})")
    return arrays


def wordpiece_lengths(tokenizer: Any, texts: Sequence[str]) -> np.ndarray:
    """Word-pieces per text as ``tokenizer`` splits it, without special tokens and without truncation."""
    out = np.zeros(len(texts), dtype=np.int64)
    for lo in range(0, len(texts), 4096):
        enc = tokenizer(list(texts[lo:lo + 4096]), add_special_tokens=False, truncation=False)
        out[lo:lo + 4096] = [len(ids) for ids in enc["input_ids"]]
    return out


def encode_texts(encoder: Any, texts: Sequence[str], *, batch_size: int = 64, lengths: Any = None,
                 desc: str = "encoding", progress: bool = True) -> np.ndarray:
    """Raw pooled embeddings (float32 ``[n, d]``) of ``texts``, in the input order.

    Texts are encoded in order of ``lengths`` (default: word-pieces when the encoder has a
    ``tokenizer``, else characters) so that a batch carries little padding; the attention
    mask makes padding irrelevant to the result.
    """
    from tqdm.auto import tqdm

    if batch_size < 1:
        raise ValueError(f"encode_texts: expected batch_size >= 1, got {batch_size}")
    if lengths is None:
        lengths = np.array([len(t) for t in texts])
        tokenizer = getattr(encoder, "tokenizer", None)
        if hasattr(tokenizer, "convert_ids_to_tokens"):  # a transformers tokenizer
            lengths = wordpiece_lengths(tokenizer, texts)
    order = np.argsort(np.asarray(lengths), kind="stable")
    chunks = []
    for lo in tqdm(range(0, len(texts), batch_size), desc=desc, unit="batch", disable=not progress):
        batch = [texts[i] for i in order[lo:lo + batch_size]]
        chunks.append(encoder.encode(batch, output="pooled").detach().to("cpu", torch.float32).numpy())
    if not chunks:
        return np.zeros((0, 0), dtype=np.float32)
    stacked = np.concatenate(chunks)
    out = np.empty_like(stacked)
    out[order] = stacked
    return out


def _encode(spec: str, texts: list[str], batch_size: int, desc: str, progress: bool) -> np.ndarray:
    try:
        from normfast.encoders import load_encoder
    except ImportError as exc:
        raise RuntimeError(f"--model needs normfast.encoders.load_encoder ({exc})") from None
    encoder = _ENCODERS.get(spec)
    if encoder is None:
        # BEIR collections are text: a CLIP model must use its text tower
        kwargs = {"tower": "text"} if spec.startswith("open_clip:") else {}
        encoder = _ENCODERS[spec] = load_encoder(spec, **kwargs)
    return encode_texts(encoder, texts, batch_size=batch_size, desc=desc, progress=progress)


_ENCODERS: dict[str, Any] = {}  # one load per spec and process (queries, then documents)


def _text_length(text: str, unit: str) -> int:
    return max(1, len(text) if unit == "chars" else len(text.split()))


def retrieval_main(args: argparse.Namespace) -> int:
    try:
        return _retrieval(args)
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, KeyError, OSError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"normfast retrieval: error: {msg}", file=sys.stderr)
        return 2


def _retrieval(args: argparse.Namespace) -> int:
    if (args.faiss is None) != (args.alpha is None):
        raise ValueError("--faiss and --alpha go together: give both to export an index")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size: expected an integer >= 1, got {args.batch_size}")
    from normfast.core.paths import check_outputs

    alphas = parse_alphas(args.alphas)
    progress = not args.no_progress
    beir = Path(args.beir)
    inputs = [args.vectors, *(beir.rglob("*") if beir.is_dir() else [])]
    out_dir = Path(args.out) if args.out else None
    check_outputs(inputs=inputs, folders={"--out": out_dir},
                  files={"--faiss": args.faiss, "the ids beside --faiss": args.faiss and f"{args.faiss}.ids.json",
                         "--out's retrieval.json": out_dir and out_dir / "retrieval.json",
                         "--out's figure": out_dir and out_dir / "ndcg_vs_alpha.png"})
    data = load_beir(args.beir, split=args.split)
    strata = None
    if args.strata_key:
        strata = data.strata(args.strata_key)
        if not strata:
            raise ValueError(f"--strata-key: no query in {args.beir}/queries.jsonl has metadata "
                             f"key {args.strata_key!r}")

    doc_lengths = None
    if args.vectors:
        arr = _load_vectors(args.vectors)
        q_ids = [str(x) for x in arr["query_ids"]]
        d_ids = [str(x) for x in arr["doc_ids"]]
        Q, D = arr["queries"], arr["docs"]
        if "doc_lengths" in arr:
            doc_lengths = arr["doc_lengths"].astype(np.float64)
    else:
        q_ids = [q for q in data.queries if q in data.qrels]
        d_ids = list(data.corpus)
        Q = _encode(args.model, [data.queries[q] for q in q_ids], args.batch_size, "queries",
                    progress)
        D = _encode(args.model, [data.doc_text(d) for d in d_ids], args.batch_size, "documents",
                    progress)
    if doc_lengths is None:
        missing = [d for d in d_ids if d not in data.corpus]
        if missing:
            raise ValueError(f"--vectors: {len(missing)} doc_ids are not in the corpus (e.g. "
                             f"{missing[0]!r}) and the .npz has no doc_lengths")
        doc_lengths = np.array([_text_length(data.doc_text(d), args.length_unit) for d in d_ids],
                               dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same facts are in result.notes, printed below
        result = alpha_sweep((q_ids, Q), (d_ids, D), data.qrels, alphas, k=args.k, strata=strata,
                             lengths=doc_lengths, select_on=args.select_on,
                             dev_fraction=args.dev_fraction, seed=args.seed, progress=progress)
    print(result.table())
    for note in result.notes:
        print(f"note: {note}")
    if args.out:
        js, png = result.save(args.out)
        print(f"wrote {js} and {png}")
    if args.faiss:
        export_faiss((d_ids, D), args.alpha, args.faiss)
        print(f"wrote {args.faiss} (alpha={args.alpha:+g}) and {args.faiss}.ids.json")
    return 0
