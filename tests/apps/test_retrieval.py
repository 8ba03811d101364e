"""Norm-discounted retrieval: score, exact search, alpha sweep, BEIR I/O, FAISS export, CLI."""

from __future__ import annotations

import argparse
import json
import math
import re

import numpy as np
import pytest
import torch

from normfast.apps import retrieval as R
from normfast.apps.retrieval import command
from normfast.data import beir


def _data(rng, n_q=40, n_d=300, dim=16):
    """Raw embeddings with norms spread over an order of magnitude."""
    Q = rng.normal(size=(n_q, dim)) * rng.uniform(0.5, 3.0, size=(n_q, 1))
    D = rng.normal(size=(n_d, dim)) * rng.uniform(0.2, 5.0, size=(n_d, 1))
    return Q, D


def _planted(rng, n_q=60, n_d=400, dim=16, alpha=-0.5, noise=0.0):
    """A collection whose single relevant doc per query is the top doc under cos * |d|^alpha."""
    Q, D = _data(rng, n_q, n_d, dim)
    s = R.scores(Q, D, alpha).numpy() + noise * rng.normal(size=(n_q, n_d))
    q_ids = [f"q{i:03d}" for i in range(n_q)]
    d_ids = [f"d{i:04d}" for i in range(n_d)]
    qrels = {q: {d_ids[int(np.argmax(s[i]))]: 1} for i, q in enumerate(q_ids)}
    return q_ids, Q, d_ids, D, qrels


# ---------------------------------------------------------------------------
# The score
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [-1.0, -0.5, 0.0, 0.3, 1.0, 2.0])
def test_rescaled_inner_product_equals_explicit_score(rng, alpha):
    Q, D = _data(rng)
    # the explicit formula, written out in numpy independently of the module
    qn = np.linalg.norm(Q, axis=1, keepdims=True)
    dn = np.linalg.norm(D, axis=1, keepdims=True)
    expected = (Q @ D.T) / (qn * dn.T) * dn.T**alpha
    np.testing.assert_allclose(R.scores(Q, D, alpha).numpy(), expected, rtol=1e-12, atol=1e-12)
    via_rescale = (Q / qn) @ R.rescale_documents(D, alpha).numpy().T
    np.testing.assert_allclose(via_rescale, expected, rtol=1e-10, atol=1e-12)


def test_rescale_endpoints(rng):
    _, D = _data(rng)
    unit = R.rescale_documents(D, 0.0).numpy()
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(R.rescale_documents(D, 1.0).numpy(), D, rtol=1e-12)
    half = R.rescale_documents(torch.tensor(D, dtype=torch.float16), -1.0)
    assert half.dtype == torch.float32  # half precision is upcast, not silently kept


def test_invalid_documents_raise_or_become_nan_rows(rng):
    _, D = _data(rng, n_d=6)
    D[2] = 0.0
    D[4, 1] = np.nan
    assert R.invalid_rows(D) == {2: "zero norm", 4: "non-finite values"}
    with pytest.raises(ValueError, match=r"row 2: zero norm; row 4: non-finite values"):
        R.rescale_documents(D, 0.5)
    out = R.rescale_documents(D, 0.5, invalid="nan").numpy()
    assert np.isnan(out[[2, 4]]).all()
    assert np.isfinite(np.delete(out, [2, 4], axis=0)).all()
    with pytest.raises(ValueError, match="invalid"):
        R.rescale_documents(D, 0.5, invalid="drop")


def test_length_control_uses_length_not_norm(rng):
    _, D = _data(rng, n_d=20)
    lengths = rng.integers(1, 40, size=20).astype(float)
    out = R.rescale_by_length(D, lengths, -0.7).numpy()
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), lengths**-0.7, rtol=1e-10)
    with pytest.raises(ValueError, match="positive finite lengths"):
        R.rescale_by_length(D, np.r_[0.0, lengths[1:]], 0.5)
    with pytest.raises(ValueError, match="one entry per document"):
        R.rescale_by_length(D, lengths[:5], 0.5)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"expected D to be 2-D"):
        R.rescale_documents(np.ones(5), 0.0)
    with pytest.raises(ValueError, match="alpha to be finite"):
        R.rescale_documents(np.ones((2, 3)), float("nan"))
    with pytest.raises(ValueError, match="same dimension"):
        R.scores(np.ones((2, 3)), np.ones((2, 4)), 0.0)


# ---------------------------------------------------------------------------
# Exact search
# ---------------------------------------------------------------------------


def _brute_topk(s: np.ndarray, k: int) -> np.ndarray:
    clean = np.where(np.isnan(s), -np.inf, s)
    cols = np.arange(s.shape[1])
    return np.stack([np.lexsort((cols, -row))[:k] for row in clean])


def test_search_breaks_ties_by_row_and_ranks_nan_last(rng):
    # small integer vectors: many exactly equal scores
    Q = torch.tensor(rng.integers(-2, 3, size=(30, 4)), dtype=torch.float64)
    D = torch.tensor(rng.integers(-2, 3, size=(200, 4)), dtype=torch.float64)
    D[7] = float("nan")
    s = (Q @ D.T).numpy()
    for k in (1, 5, 37, 200, 500):
        idx, val = R.search(Q, D, k)
        assert idx.shape == (30, min(k, 200))
        np.testing.assert_array_equal(idx.numpy(), _brute_topk(s, k))
        np.testing.assert_array_equal(val.numpy(), np.take_along_axis(s, idx.numpy(), 1))
    idx, _ = R.search(Q, D, 200)
    assert (idx[:, -1] == 7).all()  # the NaN document comes last


def test_search_chunking_does_not_change_results(rng):
    Q, D = _data(rng, n_q=50, n_d=500)
    a = R.search(Q, D, 20)
    b = R.search(Q, D, 20, memory_mb=1e-3)  # one query per chunk
    assert torch.equal(a[0], b[0])
    # BLAS may round a single row differently from a block of rows (last ulp)
    torch.testing.assert_close(a[1], b[1], rtol=1e-13, atol=0)


# ---------------------------------------------------------------------------
# FAISS export
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [-0.8, 0.0, 0.5])
def test_faiss_ranking_equals_explicit_ranking(rng, alpha, tmp_path):
    Q, D = _data(rng, n_q=25, n_d=400, dim=32)
    ids = [f"doc{i}" for i in range(len(D))]
    path = tmp_path / "idx.faiss"
    index = R.export_faiss((ids, D), alpha, path)
    assert index.ntotal == 400
    qhat = (Q / np.linalg.norm(Q, axis=1, keepdims=True)).astype(np.float32)
    _, got = index.search(qhat, 10)
    want = np.argsort(-R.scores(Q, D, alpha).numpy(), axis=1, kind="stable")[:, :10]
    np.testing.assert_array_equal(got, want)
    loaded, loaded_ids, loaded_alpha = R.load_faiss(path)
    assert loaded_ids == ids and loaded_alpha == alpha
    np.testing.assert_array_equal(loaded.search(qhat, 10)[1], want)


def test_faiss_rejects_rows_without_direction(rng):
    _, D = _data(rng, n_d=5)
    D[3] = 0
    with pytest.raises(ValueError, match="row 3: zero norm"):
        R.export_faiss(D, 0.0)


# ---------------------------------------------------------------------------
# Metrics and sweep
# ---------------------------------------------------------------------------


def test_toy_metrics_match_hand_computation():
    # q1 = (1, 0), q2 = (0, 1);
    # d1 = (1, .1):   |d| 1.005, cos(q1) .995, cos(q2) .0995
    # d2 = (3, 1.5):  |d| 3.354, cos(q1) .894, cos(q2) .447
    # d3 = (.1, .1):  |d| .1414, cos(q1) .707, cos(q2) .707
    # qrels: q1 -> d1 (rel 1), d3 (rel 2);  q2 -> d1 (rel 1)
    #
    # alpha = 0 (cosine): q1 ranks d1, d2, d3; q2 ranks d3, d2, d1.
    #   trec_eval NDCG uses gain rel / log2(rank + 1):
    #   q1: DCG = 1/1 + 0 + 2/log2(4) = 2; ideal = 2/1 + 1/log2(3) = 2.6309 -> 0.76019; RR = 1
    #   q2: DCG = 1/log2(4) = 0.5; ideal = 1 -> 0.5;                              RR = 1/3
    # alpha = 1 (q_hat . d = first / second coordinate of d):
    #   q1 scores d1 1, d2 3, d3 .1 -> d2, d1, d3:
    #      DCG = 1/log2(3) + 2/2 = 1.6309 -> 0.61991; RR = 1/2
    #   q2 scores d1 .1, d2 1.5, d3 .1 -> d2, then the d1/d3 tie broken by id: d1, d3
    #      DCG = 1/log2(3) = 0.63093 -> 0.63093; RR = 1/2
    queries = {"q1": [1.0, 0.0], "q2": [0.0, 1.0]}
    # id order, not insertion order, breaks ties
    docs = {"d3": [0.1, 0.1], "d1": [1.0, 0.1], "d2": [3.0, 1.5]}
    qrels = {"q1": {"d1": 1, "d3": 2}, "q2": {"d1": 1}}
    res = R.alpha_sweep(queries, docs, qrels, [0.0, 1.0], k=10)
    i0, i1 = res.alphas.index(0.0), res.alphas.index(1.0)
    ndcg, mrr = R.METRICS.index("ndcg@10"), R.METRICS.index("mrr")
    l3 = math.log2(3)
    np.testing.assert_allclose(res.per_query["norm"][i0, :, ndcg], [2 / (2 + 1 / l3), 0.5], rtol=1e-9)
    np.testing.assert_allclose(res.per_query["norm"][i0, :, mrr], [1.0, 1 / 3], rtol=1e-9)
    np.testing.assert_allclose(res.per_query["norm"][i1, :, ndcg], [(1 / l3 + 1) / (2 + 1 / l3), 1 / l3], rtol=1e-9)
    np.testing.assert_allclose(res.per_query["norm"][i1, :, mrr], [0.5, 0.5], rtol=1e-9)
    np.testing.assert_allclose(res.curve("norm", "recall@100"), [1.0, 1.0])
    assert res.baselines()["cosine"]["ndcg@10"] == pytest.approx((2 / (2 + 1 / l3) + 0.5) / 2)


def test_sweep_is_deterministic_and_has_length_control(rng):
    q_ids, Q, d_ids, D, qrels = _planted(rng, noise=0.3)
    lengths = rng.integers(1, 60, size=len(d_ids))
    runs = [R.alpha_sweep((q_ids, Q), (d_ids, D), qrels, [-0.5, 0.5], k=50, lengths=lengths) for _ in range(2)]
    assert runs[0].controls == ["norm", "length"]
    assert runs[0].alphas == [-0.5, 0.0, 0.5, 1.0]  # cosine and dot always added
    for c in runs[0].controls:
        np.testing.assert_array_equal(runs[0].per_query[c], runs[1].per_query[c])
    assert runs[0].to_dict() == runs[1].to_dict()
    # both controls are cosine at exponent 0; elsewhere they differ
    i0 = runs[0].alphas.index(0.0)
    np.testing.assert_array_equal(runs[0].per_query["norm"][i0], runs[0].per_query["length"][i0])
    assert not np.array_equal(runs[0].per_query["norm"], runs[0].per_query["length"])
    summary = runs[0].to_dict()["best"]["length"]
    assert {"alpha", "gain_pct", "ndcg@10", "cosine_ndcg@10"} <= set(summary)


def test_length_control_with_norms_as_lengths_equals_norm_control(rng):
    q_ids, Q, d_ids, D, qrels = _planted(rng, noise=0.2)
    res = R.alpha_sweep((q_ids, Q), (d_ids, D), qrels, [-1, -0.3, 0.4], k=20, lengths=np.linalg.norm(D, axis=1))
    np.testing.assert_allclose(res.per_query["length"], res.per_query["norm"], atol=1e-12)


def test_sweep_finds_planted_discount(rng):
    q_ids, Q, d_ids, D, qrels = _planted(rng, alpha=-0.5)
    res = R.alpha_sweep((q_ids, Q), (d_ids, D), qrels, [-1.0, -0.5, 0.5], k=100)
    curve = res.curve("norm", "mrr")
    assert curve[res.alphas.index(-0.5)] == pytest.approx(1.0)
    s = res.summary("norm")
    assert s["ndcg@10"] == pytest.approx(1.0)
    assert s["cosine_ndcg@10"] < 1.0 and s["gain_pct"] > 0
    assert s["gain_pct"] == pytest.approx(100 * (1 - s["cosine_ndcg@10"]) / s["cosine_ndcg@10"])


def test_per_stratum_results_weight_to_the_overall_mean(rng):
    q_ids, Q, d_ids, D, qrels = _planted(rng, noise=0.3)
    strata = {q: ("a", "b", "c")[i % 3] for i, q in enumerate(q_ids) if i % 7}  # some unlabelled
    res = R.alpha_sweep((q_ids, Q), (d_ids, D), qrels, [-0.4, 0.4], k=30, strata=strata)
    names = res.stratum_names()
    assert names == ["(unlabelled)", "a", "b", "c"]
    counts = {s: res.count("eval", s) for s in names}
    assert sum(counts.values()) == len(q_ids) and counts["(unlabelled)"] == 9
    for metric in R.METRICS:
        weighted = sum(counts[s] * res.curve("norm", metric, stratum=s) for s in names) / len(q_ids)
        np.testing.assert_allclose(weighted, res.curve("norm", metric), rtol=1e-12)
    s = res.summary()
    b = res.best_index()
    for name in names:
        assert s["per_stratum"][name]["ndcg@10"] == pytest.approx(res.curve(stratum=name)[b])
    # the best alpha is the overall argmax, the same for every stratum
    assert b == int(np.argmax(res.curve("norm", "ndcg@10")))


def test_select_on_dev_chooses_on_dev_and_reports_on_test(rng):
    q_ids, Q, d_ids, D, qrels = _planted(rng, n_q=80, noise=0.4)
    kw = dict(k=30, select_on="dev", dev_fraction=0.25, seed=3)
    res = R.alpha_sweep((q_ids, Q), (d_ids, D), qrels, [-1, -0.5, 0.5], **kw)
    again = R.alpha_sweep((q_ids, Q), (d_ids, D), qrels, [-1, -0.5, 0.5], **kw)
    np.testing.assert_array_equal(res.dev, again.dev)
    assert res.dev.sum() == 20 and res.count("eval") == 60
    other = R.alpha_sweep((q_ids, Q), (d_ids, D), qrels, [-1, -0.5, 0.5], **{**kw, "seed": 4})
    assert not np.array_equal(res.dev, other.dev)
    dev_curve = res.curve("norm", "ndcg@10", "dev")
    assert dev_curve[res.best_index()] == dev_curve.max()
    s = res.summary()
    assert s["ndcg@10"] == pytest.approx(res.curve("norm", "ndcg@10", "test")[res.best_index()])
    with pytest.raises(ValueError, match="select_on"):
        R.alpha_sweep((q_ids, Q), (d_ids, D), qrels, [0.0], select_on="best")


def test_sweep_reports_invalid_rows_instead_of_dropping_them(rng):
    q_ids, Q, d_ids, D, qrels = _planted(rng, noise=0.3)
    D[5] = 0.0
    Q[2] = np.nan
    with pytest.warns(UserWarning, match="never retrieved"):
        res = R.alpha_sweep((q_ids, Q), (d_ids, D), qrels, [0.5], k=20)
    assert res.invalid_docs == {d_ids[5]: "zero norm"}
    assert res.invalid_queries == {q_ids[2]: "non-finite values"}
    assert q_ids[2] not in res.query_ids and len(res.query_ids) == len(q_ids) - 1
    assert any("without a direction" in n for n in res.notes)


def test_sweep_validates_inputs(rng):
    Q, D = _data(rng, n_q=3, n_d=5)
    qids, dids = ["a", "b", "c"], [f"d{i}" for i in range(5)]
    qrels = {"a": {"d0": 1}}
    with pytest.raises(ValueError, match="same dimension"):
        R.alpha_sweep((qids, Q), (dids, D[:, :3]), qrels, [0.0])
    with pytest.raises(ValueError, match="unique ids"):
        R.alpha_sweep((qids, Q), (["d0"] * 5, D), qrels, [0.0])
    with (
        pytest.raises(ValueError, match="no query can be evaluated"),
        pytest.warns(UserWarning, match="without an embedding"),
    ):
        R.alpha_sweep((qids, Q), (dids, D), {"zz": {"d0": 1}}, [0.0])
    with pytest.raises(TypeError, match="integer relevance"):
        R.alpha_sweep((qids, Q), (dids, D), {"a": {"d0": 0.5}}, [0.0])
    with pytest.raises(ValueError, match="one id per row"):
        R.alpha_sweep((qids[:2], Q), (dids, D), qrels, [0.0])


def test_save_writes_json_and_png(rng, tmp_path):
    q_ids, Q, d_ids, D, qrels = _planted(rng, noise=0.3)
    strata = {q: "x" if i % 2 else "y" for i, q in enumerate(q_ids)}
    res = R.alpha_sweep(
        (q_ids, Q), (d_ids, D), qrels, [-0.5], k=20, strata=strata, lengths=np.arange(1, len(d_ids) + 1)
    )
    js, png = res.save(tmp_path / "out")
    data = json.loads(js.read_text())
    assert data["alphas"] == [-0.5, 0.0, 1.0]
    assert set(data["curves"]["length"]) == {"all", "x", "y"}
    assert data["best"]["norm"]["alpha"] == res.alphas[res.best_index()]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "best norm" in res.table() and "baselines: cosine" in res.table()


# ---------------------------------------------------------------------------
# BEIR format
# ---------------------------------------------------------------------------


def _toy_beir():
    corpus = {"d1": {"title": "Dogs", "text": "a domesticated canine"}, "d2": "plain text doc"}
    queries = {"q1": {"text": "what is a dog", "metadata": {"stratum": "deep", "depth": 9}}, "q2": "café ünïcode"}
    qrels = {"q1": {"d1": 1, "d2": 0}, "q2": {"d2": 2}}
    return corpus, queries, qrels


def test_beir_round_trip(tmp_path):
    corpus, queries, qrels = _toy_beir()
    beir.write_beir(tmp_path, corpus, queries, qrels, split="dev")
    data = beir.load_beir(tmp_path, split="dev")
    c, q, r = data  # unpacks like BEIR's loader
    assert c == {
        "d1": {"title": "Dogs", "text": "a domesticated canine"},
        "d2": {"title": "", "text": "plain text doc"},
    }
    assert q == {"q1": "what is a dog", "q2": "café ünïcode"}
    assert r == qrels
    assert data.metadata == {"q1": {"stratum": "deep", "depth": 9}}
    assert data.strata("stratum") == {"q1": "deep"}
    assert data.doc_text("d1") == "Dogs a domesticated canine"
    # and again through the loaded form
    beir.write_beir(tmp_path / "copy", data.corpus, data.queries, data.qrels, split="dev", metadata=data.metadata)
    assert beir.load_beir(tmp_path / "copy", split="dev") == data


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    "fname, content, pattern",
    [
        ("corpus.jsonl", '{"_id": "d1", "text": "x"}\n{"_id": "d2", "text": \n', r"corpus\.jsonl:2: not valid JSON"),
        (
            "corpus.jsonl",
            '{"_id": "d1", "text": "x"}\n\n{"title": "t", "text": "y"}\n',
            r"corpus\.jsonl:3: missing field '_id'",
        ),
        (
            "corpus.jsonl",
            '{"_id": "d1", "text": "x"}\n{"_id": "d1", "text": "y"}\n',
            r"corpus\.jsonl:2: duplicate _id 'd1'",
        ),
        ("queries.jsonl", '{"_id": "q1"}\n', r"queries\.jsonl:1: missing field 'text'"),
        ("queries.jsonl", '["q1", "text"]\n', r"queries\.jsonl:1: expected a JSON object"),
        (
            "queries.jsonl",
            '{"_id": "q1", "text": "t", "metadata": 3}\n',
            r"queries\.jsonl:1: metadata must be a JSON object",
        ),
        (
            "qrels/test.tsv",
            "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\thigh\n",
            r"test\.tsv:3: score must be an integer, got 'high'",
        ),
        ("qrels/test.tsv", "query-id\tcorpus-id\tscore\nq1 d1 1\n", r"test\.tsv:2: expected 3 tab-separated fields"),
    ],
)
def test_malformed_beir_files_name_file_and_line(tmp_path, fname, content, pattern):
    corpus, queries, qrels = _toy_beir()
    beir.write_beir(tmp_path, corpus, queries, qrels)
    _write(tmp_path / fname, content)
    with pytest.raises(beir.BeirFormatError, match=pattern):
        beir.load_beir(tmp_path)


def test_missing_beir_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        beir.load_beir(tmp_path / "nope")
    corpus, queries, qrels = _toy_beir()
    beir.write_beir(tmp_path, corpus, queries, qrels, split="dev")
    with pytest.raises(FileNotFoundError, match=r"qrels file .*test\.tsv \(splits present: dev\)"):
        beir.load_beir(tmp_path)
    (tmp_path / "queries.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing queries file .*queries\.jsonl"):
        beir.load_beir(tmp_path, split="dev")


def test_qrels_without_header_are_read(tmp_path):
    corpus, queries, qrels = _toy_beir()
    beir.write_beir(tmp_path, corpus, queries, qrels)
    _write(tmp_path / "qrels" / "test.tsv", "q1\td1\t1\nq2\td2\t0\n")
    assert beir.load_beir(tmp_path).qrels == {"q1": {"d1": 1}, "q2": {"d2": 0}}


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="normfast retrieval",
        description=command.retrieval_description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.retrieval_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def collection(rng, tmp_path):
    """A planted BEIR collection on disk and its embeddings in an .npz."""
    q_ids, Q, d_ids, D, qrels = _planted(rng, n_q=30, n_d=120, noise=0.2)
    corpus = {d: {"title": "", "text": " ".join(["w"] * (1 + i % 9))} for i, d in enumerate(d_ids)}
    queries = {
        q: {"text": f"query {q}", "metadata": {"band": "low" if i < 15 else "high"}} for i, q in enumerate(q_ids)
    }
    beir.write_beir(tmp_path / "beir", corpus, queries, qrels)
    np.savez(
        tmp_path / "emb.npz",
        query_ids=np.array(q_ids),
        queries=Q.astype(np.float32),
        doc_ids=np.array(d_ids),
        docs=D.astype(np.float32),
    )
    return tmp_path


def test_cli_runs_sweep_and_exports(collection, capsys):
    t = collection
    args = _parse(
        [
            "--beir",
            str(t / "beir"),
            "--vectors",
            str(t / "emb.npz"),
            "--alphas=-1:1:0.5",
            "--strata-key",
            "band",
            "--out",
            str(t / "out"),
            "--faiss",
            str(t / "i.faiss"),
            "--alpha",
            "-0.5",
            "--no-progress",
            "--k",
            "50",
        ]
    )
    assert command.retrieval_main(args) == 0
    out = capsys.readouterr().out
    assert "best norm" in out and "best length" in out and "high" in out
    data = json.loads((t / "out" / "retrieval.json").read_text())
    assert data["alphas"] == [-1.0, -0.5, 0.0, 0.5, 1.0]
    assert data["strata"] == {"high": 15, "low": 15}
    assert (t / "out" / "ndcg_vs_alpha.png").is_file()
    index, ids, alpha = R.load_faiss(t / "i.faiss")
    assert index.ntotal == 120 and alpha == -0.5 and ids[0] == "d0000"


def test_cli_with_model_batches_through_the_encoder(collection, monkeypatch, capsys):
    import normfast.encoders as enc

    calls = []

    class FakeEncoder:
        def encode(self, texts, output="pooled"):
            calls.append(len(texts))
            assert output == "pooled"
            g = torch.Generator().manual_seed(sum(map(ord, "".join(texts))))
            return torch.randn(len(texts), 8, generator=g) * 3

    monkeypatch.setattr(enc, "load_encoder", lambda spec, **kw: FakeEncoder(), raising=False)
    monkeypatch.setattr(command, "_ENCODERS", {})
    args = _parse(
        [
            "--beir",
            str(collection / "beir"),
            "--model",
            "fake",
            "--batch-size",
            "16",
            "--alphas",
            "0,0.5",
            "--no-progress",
        ]
    )
    assert command.retrieval_main(args) == 0
    assert calls == [16, 14, 16, 16, 16, 16, 16, 16, 16, 8]  # 30 queries, then 120 documents
    assert "queries: 30 evaluated, documents: 120" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv_tail, pattern",
    [
        (["--faiss", "x.faiss"], "--faiss and --alpha go together"),
        (["--alphas", "1:0:0.1"], "--alphas: expected START:STOP:STEP"),
        (["--strata-key", "nokey"], "no query .* has metadata key 'nokey'"),
    ],
)
def test_cli_errors_exit_2_without_traceback(collection, capsys, argv_tail, pattern):
    args = _parse(
        ["--beir", str(collection / "beir"), "--vectors", str(collection / "emb.npz"), "--no-progress", *argv_tail]
    )
    assert command.retrieval_main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("normfast retrieval: error:") and "Traceback" not in err
    assert re.search(pattern, err)


def test_cli_reports_bad_inputs(collection, capsys, tmp_path):
    np.savez(tmp_path / "bad.npz", queries=np.ones((2, 3)))
    args = _parse(["--beir", str(collection / "beir"), "--vectors", str(tmp_path / "bad.npz")])
    assert command.retrieval_main(args) == 2
    assert "lacks array(s) query_ids, doc_ids, docs" in capsys.readouterr().err
    args = _parse(["--beir", str(tmp_path / "missing"), "--vectors", str(collection / "emb.npz")])
    assert command.retrieval_main(args) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_parse_alphas():
    assert command.parse_alphas("-1:1:0.5") == [-1.0, -0.5, 0.0, 0.5, 1.0]
    assert len(command.parse_alphas("-1:1:0.1")) == 21
    assert command.parse_alphas("0.3, -0.2") == [0.3, -0.2]
    with pytest.raises(ValueError):
        command.parse_alphas("a,b")


def test_description_teaches_the_score_and_the_control():
    text = command.retrieval_description
    assert "cos(q, d) * |d|^alpha" in text and "LENGTH-ONLY CONTROL" in text
    assert "never per stratum" in text
