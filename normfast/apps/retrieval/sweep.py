"""The alpha sweep: retrieval quality of ``cos(q, d) * ||d||**alpha`` over a grid, with the
length-only control, and its :class:`SweepResult` (curves, best alpha, baselines, JSON, table)."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from normfast.apps.retrieval.plot import plot_sweep
from normfast.apps.retrieval.scoring import (
    CONTROLS,
    DEFAULT_ALPHAS,
    METRICS,
    SCORE_MEMORY_MB,
    TREC_MEASURES,
    TREC_REQUEST,
    UNLABELLED,
    check_qrels,
    describe_invalid,
    embedding_table,
    finite_float,
    invalid_rows,
    lengths_vector,
    scale_rows,
    search,
)
from normfast.core.checks import check_positive_int, describe


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
            raise ValueError(f"SweepResult: subset must be all|dev|test|select|eval, got {subset!r}")
        if stratum is not None:
            if self.strata is None:
                raise ValueError("SweepResult: this sweep has no strata")
            m &= np.array([s == stratum for s in self.strata])
        return m

    def stratum_names(self) -> list[str]:
        return [] if self.strata is None else sorted(set(self.strata))

    def count(self, subset: str = "eval", stratum: str | None = None) -> int:
        return int(self._mask(subset, stratum).sum())

    def curve(
        self, control: str = "norm", metric: str = "ndcg@10", subset: str = "eval", stratum: str | None = None
    ) -> np.ndarray:
        """Mean of ``metric`` over the chosen queries, one value per alpha (NaN if none)."""
        if control not in self.per_query:
            raise ValueError(f"SweepResult: control must be one of {self.controls}, got {control!r}")
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
        order = sorted(range(len(self.alphas)), key=lambda i: (-ndcg[i], abs(self.alphas[i]), self.alphas[i]))
        return order[0]

    def summary(self, control: str = "norm") -> dict[str, Any]:
        """Best alpha (chosen on the selection split) and its gain over cosine on the eval split."""
        b, c = self.best_index(control), self._index(0.0)

        def gain(new: float, base: float) -> float | None:
            if not (np.isfinite(new) and np.isfinite(base)) or base == 0:
                return None
            return float(100.0 * (new - base) / base)

        out: dict[str, Any] = {"alpha": self.alphas[b], "selected_on": self.select_on, "n_queries": self.count("eval")}
        for metric in METRICS:
            cur = self.curve(control, metric, "eval")
            out[metric] = float(cur[b])
            out[f"cosine_{metric}"] = float(cur[c])
        out["gain_pct"] = gain(out["ndcg@10"], out["cosine_ndcg@10"])
        per = {}
        for s in self.stratum_names():
            cur = self.curve(control, "ndcg@10", "eval", s)
            per[s] = {
                "n_queries": self.count("eval", s),
                "ndcg@10": float(cur[b]),
                "cosine_ndcg@10": float(cur[c]),
                "gain_pct": gain(float(cur[b]), float(cur[c])),
            }
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
            entry: dict[str, Any] = {"all": {m: _jsonable(self.curve(control, m, "eval")) for m in METRICS}}
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
        lines.append(
            f"queries: {self.count('eval')} evaluated, documents: {self.n_docs}; "
            f"alpha chosen on {split}; strata columns show NDCG@10"
        )
        for control in self.controls:
            s = self.summary(control)
            label = "norm   cos*|d|^alpha" if control == "norm" else "length cos*len^beta "
            g = "n/a" if s["gain_pct"] is None else f"{s['gain_pct']:+.2f}%"
            lines.append(
                f"best {label}: {s['alpha']:+.2f}  NDCG@10 {s['ndcg@10']:.4f} vs cosine {s['cosine_ndcg@10']:.4f} ({g})"
            )
            for name, ps in s.get("per_stratum", {}).items():
                pg = "n/a" if ps["gain_pct"] is None else f"{ps['gain_pct']:+.2f}%"
                lines.append(
                    f"    {name:<14} n={ps['n_queries']:<6} {ps['ndcg@10']:.4f} vs {ps['cosine_ndcg@10']:.4f} ({pg})"
                )
        base = self.baselines()
        lines.append(
            f"baselines: cosine NDCG@10 {base['cosine']['ndcg@10']:.4f}, dot NDCG@10 {base['dot']['ndcg@10']:.4f}"
        )
        if self.invalid_docs or self.invalid_queries:
            lines.append(
                f"excluded without a direction: {len(self.invalid_docs)} documents, "
                f"{len(self.invalid_queries)} queries (listed in the JSON)"
            )
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


def alpha_sweep(
    queries: Any,
    docs: Any,
    qrels: Mapping[str, Mapping[str, int]],
    alphas: Iterable[float] = DEFAULT_ALPHAS,
    *,
    k: int = 100,
    strata: Mapping[str, str] | None = None,
    lengths: Any = None,
    select_on: str = "all",
    dev_fraction: float = 0.5,
    seed: int = 0,
    memory_mb: float = SCORE_MEMORY_MB,
    progress: bool = False,
) -> SweepResult:
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
    frac = finite_float(fn, "dev_fraction", dev_fraction)
    if select_on == "dev" and not 0 < frac < 1:
        raise ValueError(f"{fn}: expected 0 < dev_fraction < 1, got {dev_fraction!r}")
    grid = sorted({round(finite_float(fn, "alphas[...]", a), 12) for a in alphas} | {0.0, 1.0})
    q_ids, Q = embedding_table(fn, "queries", queries)
    d_ids, D = embedding_table(fn, "docs", docs)
    if Q.shape[1] != D.shape[1]:
        raise ValueError(
            f"{fn}: expected queries and docs with the same dimension, got "
            f"{describe('queries', Q)} and {describe('docs', D)}"
        )
    qrels = check_qrels(fn, qrels)
    notes: list[str] = []
    if k < 100:
        notes.append(f"k={k} < 100: recall@100 counts only the top {k}")

    lens = None
    if lengths is not None:
        if isinstance(lengths, Mapping):
            missing = [d for d in d_ids if d not in lengths]
            if missing:
                raise ValueError(f"{fn}: lengths has no entry for {len(missing)} document(s), e.g. {missing[0]!r}")
            lengths = [lengths[d] for d in d_ids]
        lens = lengths_vector(fn, lengths, len(d_ids))

    # documents in id order: ties are broken by it
    order = sorted(range(len(d_ids)), key=d_ids.__getitem__)
    d_ids = [d_ids[i] for i in order]
    D = D[torch.tensor(order, dtype=torch.long)]
    if lens is not None:
        lens = lens[torch.tensor(order, dtype=torch.long)]
    bad_docs = invalid_rows(D)
    invalid_docs = {d_ids[i]: why for i, why in bad_docs.items()}
    if bad_docs:
        warnings.warn(
            f"{fn}: {len(bad_docs)} document(s) without a direction are never retrieved "
            f"({describe_invalid(invalid_docs)}); see SweepResult.invalid_docs",
            stacklevel=2,
        )
    bad_q = invalid_rows(Q)
    invalid_queries = {q_ids[i]: why for i, why in bad_q.items()}

    # which queries are evaluated
    q_row = {q: i for i, q in enumerate(q_ids)}
    judged = {q: r for q, r in qrels.items() if any(v > 0 for v in r.values())}
    if len(judged) < len(qrels):
        notes.append(f"{len(qrels) - len(judged)} qrels queries without a relevant document skipped")
    no_vec = [q for q in judged if q not in q_row]
    if no_vec:
        notes.append(f"{len(no_vec)} qrels queries without an embedding skipped (e.g. {no_vec[0]!r})")
        warnings.warn(f"{fn}: {notes[-1]}", stacklevel=2)
    eval_ids = sorted(q for q in judged if q in q_row and q not in invalid_queries)
    if invalid_queries:
        notes.append(f"{len(invalid_queries)} queries without a direction skipped (invalid_queries)")
    if not eval_ids:
        raise ValueError(
            f"{fn}: no query can be evaluated: qrels and queries share no valid id "
            f"(qrels has {len(qrels)} queries, queries has {len(q_ids)})"
        )
    doc_set = set(d_ids)
    unknown = sum(1 for q in eval_ids for d, v in judged[q].items() if v > 0 and d not in doc_set)
    if unknown:
        notes.append(f"{unknown} relevant judgments name documents absent from docs (unreachable)")

    labels = None
    if strata is not None:
        if not isinstance(strata, Mapping):  # checked here, before the expensive part
            raise TypeError(f"{fn}: expected strata to be a {{query_id: label}} mapping, got {type(strata).__name__}")
        labels = [str(strata[q]) if q in strata else UNLABELLED for q in eval_ids]
        n_unl = labels.count(UNLABELLED)
        if n_unl:
            notes.append(f"{n_unl} evaluated queries have no stratum label ({UNLABELLED!r})")
    dev = _split_dev(eval_ids, frac, seed) if select_on == "dev" else np.zeros(len(eval_ids), dtype=bool)
    if select_on == "dev" and (dev.all() or not dev.any()):
        raise ValueError(
            f"{fn}: dev_fraction={dev_fraction} leaves an empty dev or test split with {len(eval_ids)} queries"
        )
    rows = torch.tensor([q_row[q] for q in eval_ids], dtype=torch.long)
    Qn = Q[rows]
    Qn = Qn / torch.linalg.vector_norm(Qn, dim=1, keepdim=True)

    import pytrec_eval

    evaluator = pytrec_eval.RelevanceEvaluator({q: judged[q] for q in eval_ids}, TREC_REQUEST)
    trec_keys = [TREC_MEASURES[m] for m in METRICS]

    def evaluate(doc_matrix: torch.Tensor) -> np.ndarray:
        idx, val = search(Qn, doc_matrix, k, memory_mb=memory_mb)
        finite = torch.isfinite(val)
        idx_l, fin_l = idx.tolist(), finite.tolist()
        depth = idx.shape[1]
        run = {}
        for qi, q in enumerate(eval_ids):
            # strictly decreasing rank scores: trec_eval re-sorts by score
            run[q] = {d_ids[j]: float(depth - r) for r, (j, ok) in enumerate(zip(idx_l[qi], fin_l[qi])) if ok}
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
    controls = {"norm": lambda a: scale_rows(D, norms ** (a - 1.0), bad_rows)}
    if lens is not None:
        controls["length"] = lambda b: scale_rows(D, lens**b / norms, bad_rows)
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

    return SweepResult(
        alphas=grid,
        k=k,
        query_ids=eval_ids,
        per_query=per_query,
        strata=labels,
        select_on=select_on,
        dev=dev,
        n_docs=len(d_ids),
        invalid_docs=invalid_docs,
        invalid_queries=invalid_queries,
        notes=notes,
    )
