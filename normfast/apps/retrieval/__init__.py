"""Norm-discounted retrieval: the score, an alpha sweep with its baselines, FAISS export.

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

Modules: :mod:`.scoring` (the score, exact top-k search, FAISS export), :mod:`.sweep`
(:func:`alpha_sweep` and its :class:`SweepResult`), :mod:`.plot` (the figure) and
:mod:`.command` (``normfast retrieval``). BEIR collections are read by
:mod:`normfast.data.beir`; texts are embedded by :func:`normfast.encoders.text.encode_texts`.
"""

from normfast.apps.retrieval.plot import plot_sweep
from normfast.apps.retrieval.scoring import (
    CONTROLS,
    DEFAULT_ALPHAS,
    METRICS,
    UNLABELLED,
    export_faiss,
    invalid_rows,
    load_faiss,
    rescale_by_length,
    rescale_documents,
    scores,
    search,
)
from normfast.apps.retrieval.sweep import SweepResult, alpha_sweep

__all__ = [
    "CONTROLS",
    "DEFAULT_ALPHAS",
    "METRICS",
    "UNLABELLED",
    "SweepResult",
    "alpha_sweep",
    "export_faiss",
    "invalid_rows",
    "load_faiss",
    "plot_sweep",
    "rescale_by_length",
    "rescale_documents",
    "scores",
    "search",
]
