"""The norm-discounted score, exact top-k search and FAISS export (see :mod:`normfast.apps.retrieval`)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from normfast.core.checks import as_tensor, check_float, check_ndim, check_positive_int, describe

METRICS = ("ndcg@10", "recall@100", "mrr")
# our name -> the key pytrec_eval reports it under
TREC_MEASURES = {"ndcg@10": "ndcg_cut_10", "recall@100": "recall_100", "mrr": "recip_rank"}
TREC_REQUEST = {"ndcg_cut.10", "recall.100", "recip_rank"}  # as pytrec_eval takes them
CONTROLS = ("norm", "length")
#: -1.0, -0.9, ..., 1.0
DEFAULT_ALPHAS = tuple(round(i / 10, 1) for i in range(-10, 11))
UNLABELLED = "(unlabelled)"

SCORE_MEMORY_MB = 256  # budget for one chunk of the query x document score matrix


# ---------------------------------------------------------------------------
# The score
# ---------------------------------------------------------------------------


def invalid_rows(x: Any) -> dict[int, str]:
    """Rows of a ``[n, d]`` embedding matrix that have no direction: ``{row: reason}``.

    Reasons are ``"non-finite values"`` (NaN or inf anywhere in the row) and
    ``"zero norm"``.
    """
    t = as_tensor("invalid_rows", "x", x)
    check_ndim("invalid_rows", "x", t, 2, "2-D [n, d]")
    bad: dict[int, str] = {}
    finite = torch.isfinite(t).all(dim=1)
    for i in torch.nonzero(~finite).flatten().tolist():
        bad[i] = "non-finite values"
    norms = torch.linalg.vector_norm(t.double(), dim=1)
    for i in torch.nonzero(finite & (norms == 0)).flatten().tolist():
        bad[i] = "zero norm"
    return dict(sorted(bad.items()))


def describe_invalid(bad: Mapping[Any, str], limit: int = 5) -> str:
    shown = "; ".join(f"row {i}: {why}" for i, why in list(bad.items())[:limit])
    more = f"; ... ({len(bad) - limit} more)" if len(bad) > limit else ""
    return shown + more


def _float_matrix(fn: str, name: str, x: Any) -> torch.Tensor:
    t = as_tensor(fn, name, x)
    if not torch.is_floating_point(t):
        t = t.double()
    check_float(fn, name, t)
    check_ndim(fn, name, t, 2, "2-D [n, d]")
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    return t


def _check_invalid_policy(fn: str, invalid: str) -> None:
    if invalid not in ("raise", "nan"):
        raise ValueError(f"{fn}: expected invalid to be 'raise' or 'nan', got {invalid!r}")


def scale_rows(t: torch.Tensor, factor: torch.Tensor, bad: Sequence[int]) -> torch.Tensor:
    """``t * factor[:, None]`` with the rows in ``bad`` set to NaN."""
    factor = factor.clone()
    if bad:
        factor[torch.tensor(list(bad), dtype=torch.long)] = float("nan")
    return t * factor.to(t.dtype).unsqueeze(1)  # NaN * 0 is NaN: bad rows come out all NaN


def _rescale(fn: str, D: Any, factor_fn, invalid: str) -> torch.Tensor:
    _check_invalid_policy(fn, invalid)
    t = _float_matrix(fn, "D", D)
    bad = invalid_rows(t)
    if bad and invalid == "raise":
        raise ValueError(
            f"{fn}: D has {len(bad)} row(s) without a direction ({describe_invalid(bad)}); "
            "fix or remove them, or pass invalid='nan' to get NaN rows (see invalid_rows())"
        )
    norms = torch.linalg.vector_norm(t.double(), dim=1)
    return scale_rows(t, factor_fn(norms), list(bad))


def rescale_documents(D: Any, alpha: float, *, invalid: str = "raise") -> torch.Tensor:
    """Document vectors rescaled for the norm-discounted score: ``D_hat * ||D||**alpha``.

    Args:
        D: ``[n, d]`` raw (unnormalized) document embeddings (torch, numpy or DLPack).
        alpha: the norm exponent (0: unit vectors / cosine, 1: the raw vectors / dot).
        invalid: rows with a zero norm or non-finite values have no direction.
            ``"raise"`` (default) raises a ``ValueError`` naming them; ``"nan"``
            returns those rows as NaN (``invalid_rows(D)`` gives the reasons).

    Returns:
        A new ``[n, d]`` tensor (float32 for half-precision input, else D's
        dtype) whose inner product with a unit query is the score.
    """
    a = finite_float("rescale_documents", "alpha", alpha)
    return _rescale("rescale_documents", D, lambda n: n ** (a - 1.0), invalid)


def rescale_by_length(D: Any, lengths: Any, beta: float, *, invalid: str = "raise") -> torch.Tensor:
    """The length-only control: ``D_hat * lengths**beta`` (the norm is discarded).

    ``lengths`` (``[n]``, positive and finite) is whatever the caller measures:
    tokens, words or characters.
    """
    fn = "rescale_by_length"
    b = finite_float(fn, "beta", beta)
    t = _float_matrix(fn, "D", D)
    lens = lengths_vector(fn, lengths, t.shape[0])
    return _rescale(fn, t, lambda n: lens**b / n, invalid)


def lengths_vector(fn: str, lengths: Any, n: int) -> torch.Tensor:
    if isinstance(lengths, (list, tuple)):
        lengths = np.asarray(lengths)
    lens = as_tensor(fn, "lengths", lengths)
    if lens.dim() != 1 or lens.shape[0] != n:
        raise ValueError(
            f"{fn}: expected lengths to be 1-D with one entry per document ({n}), got {describe('lengths', lens)}"
        )
    lens = lens.double()
    bad = torch.nonzero(~torch.isfinite(lens) | (lens <= 0)).flatten().tolist()
    if bad:
        shown = ", ".join(f"row {i}: {lens[i].item()!r}" for i in bad[:5])
        raise ValueError(f"{fn}: expected positive finite lengths, got {len(bad)} invalid ({shown})")
    return lens


def scores(Q: Any, D: Any, alpha: float) -> torch.Tensor:
    """The explicit score matrix ``cos(q, d) * ||d||**alpha``, ``[n_q, n_d]`` in float64.

    A reference for tests and small problems; retrieval uses
    :func:`rescale_documents` and inner products instead. Rows without a
    direction give NaN.
    """
    fn = "scores"
    a = finite_float(fn, "alpha", alpha)
    q = _float_matrix(fn, "Q", Q).double()
    d = _float_matrix(fn, "D", D).double()
    if q.shape[1] != d.shape[1]:
        raise ValueError(
            f"{fn}: expected Q and D with the same dimension, got {describe('Q', q)} and {describe('D', d)}"
        )
    qn = torch.linalg.vector_norm(q, dim=1, keepdim=True)
    dn = torch.linalg.vector_norm(d, dim=1, keepdim=True)
    cos = (q @ d.T) / (qn * dn.T)
    return cos * dn.T**a


def finite_float(fn: str, name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{fn}: expected {name} to be a real number, got {value!r}") from None
    if not math.isfinite(v):
        raise ValueError(f"{fn}: expected {name} to be finite, got {value!r}")
    return v


# ---------------------------------------------------------------------------
# Exact top-k search
# ---------------------------------------------------------------------------


def search(queries: Any, docs: Any, k: int, *, memory_mb: float = SCORE_MEMORY_MB) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-``k`` by inner product, ties broken by document row (lower row first).

    Queries are processed in chunks so that one chunk of the score matrix stays
    within ``memory_mb``. Results are bit-for-bit repeatable for the same inputs
    and budget; another budget may change scores in the last ulp (BLAS rounds a
    lone row and a block of rows differently). NaN scores rank below every finite score (their
    returned score stays NaN). Returns ``(indices [n_q, k'], scores [n_q, k'])``
    with ``k' = min(k, n_docs)``, best first.
    """
    fn = "search"
    k = check_positive_int(fn, "k", k)
    q = _float_matrix(fn, "queries", queries)
    d = _float_matrix(fn, "docs", docs)
    if q.shape[1] != d.shape[1]:
        raise ValueError(
            f"{fn}: expected queries and docs with the same dimension, got "
            f"{describe('queries', q)} and {describe('docs', d)}"
        )
    if d.shape[0] == 0:
        raise ValueError(f"{fn}: expected at least one document, got {describe('docs', d)}")
    dtype = torch.promote_types(q.dtype, d.dtype)
    q, d = q.to(dtype), d.to(dtype)
    n_q, n_d = q.shape[0], d.shape[0]
    kk = min(k, n_d)
    # scores, a NaN-cleaned copy and the candidate mask live at once
    per_row = n_d * (2 * d.element_size() + 1)
    chunk = max(1, int(memory_mb * 2**20 // per_row))
    out_idx = torch.empty(n_q, kk, dtype=torch.long)
    out_val = torch.empty(n_q, kk, dtype=dtype)
    for start in range(0, n_q, chunk):
        s = q[start : start + chunk] @ d.T
        idx = _topk_stable(s, kk)
        out_idx[start : start + chunk] = idx
        out_val[start : start + chunk] = torch.gather(s, 1, idx)
    return out_idx, out_val


def _topk_stable(s: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row; equal values keep column order."""
    clean = torch.nan_to_num(s, nan=-math.inf)
    kth = torch.topk(clean, k, dim=1).values[:, -1:]
    cand = clean >= kth  # every entry that could make the top k, ties at the boundary included
    counts = cand.sum(dim=1)
    out = torch.empty(s.shape[0], k, dtype=torch.long)
    exact = counts == k
    if exact.any():
        rows = torch.nonzero(exact).flatten()
        # nonzero lists columns in ascending order; a stable sort keeps it among equals
        cols = torch.nonzero(cand[rows])[:, 1].view(-1, k)
        vals = torch.gather(clean[rows], 1, cols)
        order = torch.sort(vals, dim=1, descending=True, stable=True).indices
        out[rows] = torch.gather(cols, 1, order)
    for r in torch.nonzero(~exact).flatten().tolist():
        cols = torch.nonzero(cand[r]).flatten()
        order = torch.sort(clean[r, cols], descending=True, stable=True).indices[:k]
        out[r] = cols[order]
    return out


# ---------------------------------------------------------------------------
# Alpha sweep
# ---------------------------------------------------------------------------


def embedding_table(fn: str, name: str, x: Any) -> tuple[list[str], torch.Tensor]:
    """``(ids, matrix)`` from a ``{id: vector}`` mapping or an ``(ids, matrix)`` pair."""
    if isinstance(x, Mapping):
        ids = [str(i) for i in x]
        if not ids:
            raise ValueError(f"{fn}: expected {name} to hold at least one vector, got an empty mapping")
        mat = torch.stack(
            [torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v for v in x.values()]
        )
    elif isinstance(x, (tuple, list)) and len(x) == 2:
        ids = [str(i) for i in x[0]]
        mat = as_tensor(fn, f"{name}[1]", x[1])
    else:
        raise TypeError(
            f"{fn}: expected {name} to be a {{id: vector}} mapping or an (ids, matrix) pair, got {type(x).__name__}"
        )
    mat = _float_matrix(fn, name, mat)
    if mat.shape[0] != len(ids):
        raise ValueError(f"{fn}: expected one id per row of {name}, got {len(ids)} ids and {describe(name, mat)}")
    if mat.shape[0] == 0:
        raise ValueError(f"{fn}: expected {name} to hold at least one vector, got {describe(name, mat)}")
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = next(i for i in ids if i in seen or seen.add(i))
        raise ValueError(f"{fn}: expected unique ids in {name}, got {dup!r} more than once")
    return ids, mat


def check_qrels(fn: str, qrels: Any) -> dict[str, dict[str, int]]:
    if not isinstance(qrels, Mapping):
        raise TypeError(
            f"{fn}: expected qrels to be a {{query_id: {{doc_id: relevance}}}} mapping, got {type(qrels).__name__}"
        )
    out: dict[str, dict[str, int]] = {}
    for qid, judged in qrels.items():
        if not isinstance(judged, Mapping):
            raise TypeError(
                f"{fn}: expected qrels[{qid!r}] to be a {{doc_id: relevance}} mapping, got {type(judged).__name__}"
            )
        row = {}
        for did, rel in judged.items():
            if isinstance(rel, bool) or not isinstance(rel, (int, np.integer)):
                raise TypeError(f"{fn}: expected integer relevance, got qrels[{qid!r}][{did!r}]={rel!r}")
            row[str(did)] = int(rel)
        out[str(qid)] = row
    return out


# ---------------------------------------------------------------------------
# FAISS export
# ---------------------------------------------------------------------------


def export_faiss(
    docs: Any, alpha: float, path: str | os.PathLike | None = None, *, doc_ids: Sequence[str] | None = None
):
    """A ``faiss.IndexFlatIP`` holding the rescaled documents ``D_hat * ||D||**alpha``.

    Searching it with unit-normalized queries ranks by ``cos * ||d||**alpha``.
    ``docs`` is a matrix or an ``(ids, matrix)`` pair / ``{id: vector}``
    mapping. With ``path`` the index is written with ``faiss.write_index`` and
    the row -> id map beside it as ``<path>.ids.json`` (``{"alpha", "ids"}``).
    Rows without a direction raise a ``ValueError``.
    """
    import faiss

    fn = "export_faiss"
    if isinstance(docs, Mapping) or (isinstance(docs, (tuple, list)) and len(docs) == 2):
        ids, mat = embedding_table(fn, "docs", docs)
    else:
        mat = _float_matrix(fn, "docs", docs)
        ids = [str(i) for i in (doc_ids if doc_ids is not None else range(mat.shape[0]))]
        if len(ids) != mat.shape[0]:
            raise ValueError(f"{fn}: expected one doc id per row, got {len(ids)} ids and {describe('docs', mat)}")
    a = finite_float(fn, "alpha", alpha)
    scaled = rescale_documents(mat, a).detach().to("cpu", torch.float32).contiguous().numpy()
    index = faiss.IndexFlatIP(scaled.shape[1])
    index.add(scaled)
    if path is not None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        faiss.write_index(index, str(p))
        Path(str(p) + ".ids.json").write_text(json.dumps({"alpha": a, "ids": ids}))
    return index


def load_faiss(path: str | os.PathLike):
    """Read an index written by :func:`export_faiss`: ``(index, ids, alpha)``."""
    import faiss

    p = Path(path)
    idmap = Path(str(p) + ".ids.json")
    for f in (p, idmap):
        if not f.is_file():
            raise FileNotFoundError(f"load_faiss: missing {f}")
    meta = json.loads(idmap.read_text())
    index = faiss.read_index(str(p))
    if index.ntotal != len(meta["ids"]):
        raise ValueError(f"load_faiss: {p} holds {index.ntotal} vectors but {idmap} lists {len(meta['ids'])} ids")
    return index, meta["ids"], float(meta["alpha"])
