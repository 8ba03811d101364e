"""``normfast retrieval``: the command-line driver over :func:`~normfast.apps.retrieval.sweep.alpha_sweep`."""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from normfast.apps.retrieval.scoring import export_faiss
from normfast.apps.retrieval.sweep import alpha_sweep
from normfast.core.paths import check_outputs
from normfast.data.beir import load_beir

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
        raise ValueError(
            f"--alphas: expected START:STOP:STEP (STOP >= START, STEP > 0) or a "
            f"comma-separated list of numbers, got {spec!r}"
        ) from None


def retrieval_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("data")
    src.add_argument(
        "--beir", required=True, metavar="DIR", help="BEIR collection (corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv)"
    )
    src.add_argument("--split", default="test", help="qrels split to evaluate (default: test)")
    emb = src.add_mutually_exclusive_group(required=True)
    emb.add_argument(
        "--vectors",
        metavar="FILE.npz",
        help="precomputed raw embeddings: query_ids, queries, doc_ids, docs[, doc_lengths]",
    )
    emb.add_argument("--model", metavar="SPEC", help="encoder to embed queries and documents with")
    src.add_argument("--batch-size", type=int, default=64, help="encoding batch size (default: 64)")
    src.add_argument(
        "--length-unit",
        choices=("words", "chars"),
        default="words",
        help="length for the control when the .npz has no doc_lengths (default: words)",
    )
    sw = parser.add_argument_group("sweep")
    sw.add_argument(
        "--alphas",
        default="-1:1:0.1",
        metavar="GRID",
        help="START:STOP:STEP or a comma list; write --alphas=-1:1:0.1 when it starts "
        "with a minus sign (default: -1:1:0.1; 0 and 1 are always added)",
    )
    sw.add_argument("--k", type=int, default=100, help="documents retrieved per query (default: 100)")
    sw.add_argument(
        "--strata-key", metavar="KEY", help="queries.jsonl metadata key whose value labels each query's stratum"
    )
    sw.add_argument(
        "--select-on",
        choices=("all", "dev"),
        default="all",
        help="choose the best alpha on all queries or on a dev half (default: all)",
    )
    sw.add_argument("--dev-fraction", type=float, default=0.5, help="dev share for --select-on dev")
    sw.add_argument("--seed", type=int, default=0, help="seed of the dev/test split (default: 0)")
    out = parser.add_argument_group("output")
    out.add_argument("--out", metavar="DIR", help="write retrieval.json and ndcg_vs_alpha.png here")
    out.add_argument("--faiss", metavar="PATH", help="also export an IndexFlatIP for --alpha to PATH")
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
        raise ValueError(
            f"--vectors: {p} lacks array(s) {', '.join(missing)} (has {', '.join(sorted(arrays)) or 'none'})"
        )
    return arrays


def _encode(spec: str, texts: list[str], batch_size: int, desc: str, progress: bool) -> np.ndarray:
    from normfast.encoders import load_encoder
    from normfast.encoders.text import encode_texts

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
    alphas = parse_alphas(args.alphas)
    progress = not args.no_progress
    beir = Path(args.beir)
    inputs = [args.vectors, *(beir.rglob("*") if beir.is_dir() else [])]
    out_dir = Path(args.out) if args.out else None
    check_outputs(
        inputs=inputs,
        folders={"--out": out_dir},
        files={
            "--faiss": args.faiss,
            "the ids beside --faiss": args.faiss and f"{args.faiss}.ids.json",
            "--out's retrieval.json": out_dir and out_dir / "retrieval.json",
            "--out's figure": out_dir and out_dir / "ndcg_vs_alpha.png",
        },
    )
    data = load_beir(args.beir, split=args.split)
    strata = None
    if args.strata_key:
        strata = data.strata(args.strata_key)
        if not strata:
            raise ValueError(
                f"--strata-key: no query in {args.beir}/queries.jsonl has metadata key {args.strata_key!r}"
            )

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
        Q = _encode(args.model, [data.queries[q] for q in q_ids], args.batch_size, "queries", progress)
        D = _encode(args.model, [data.doc_text(d) for d in d_ids], args.batch_size, "documents", progress)
    if doc_lengths is None:
        missing = [d for d in d_ids if d not in data.corpus]
        if missing:
            raise ValueError(
                f"--vectors: {len(missing)} doc_ids are not in the corpus (e.g. "
                f"{missing[0]!r}) and the .npz has no doc_lengths"
            )
        doc_lengths = np.array([_text_length(data.doc_text(d), args.length_unit) for d in d_ids], dtype=np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same facts are in result.notes, printed below
        result = alpha_sweep(
            (q_ids, Q),
            (d_ids, D),
            data.qrels,
            alphas,
            k=args.k,
            strata=strata,
            lengths=doc_lengths,
            select_on=args.select_on,
            dev_fraction=args.dev_fraction,
            seed=args.seed,
            progress=progress,
        )
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
