"""E5 (uncertainty and the projection-head regime): the quick run end to end.

Runs ``python -m bench run e5 --quick`` twice with the same seed (the ``e5_quick``
fixture of conftest.py: the runner in this process, from a scratch copy of the
repository, the first run into its default output folder) and checks the JSON
it writes: fields present, values finite, correlations in [-1, 1], each
bootstrap interval containing its point estimate, retrieval figures coherent
with the sweep curves, and the two runs identical apart from timings.
"""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.needs_data("fashion-mnist")


@pytest.fixture
def runs(e5_quick):
    return e5_quick


def _numbers(obj, path=""):
    """Every number in a JSON tree with its path (timings and versions excluded)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("timing", "versions"):
                continue
            yield from _numbers(v, f"{path}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj


def test_outputs_written(runs):
    _, _, out = runs
    for name in ("e5_uncertainty.json", "e5_entropy_heat.png", "e5_alpha_sweep.png"):
        f = out / name
        assert f.is_file() and f.stat().st_size > 1000, name
    assert (out / "e5_entropy_heat.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_correlations_finite_bounded_and_inside_their_intervals(runs):
    s, _, _ = runs
    heat = s["heat_vs_entropy"]
    assert heat["n_probe"] == s["config"]["n_probe"]
    assert heat["valid_rows"] == heat["n_probe"]
    # the engine's norm column and the directly computed embedding norm agree
    assert heat["engine_vs_direct_norm_max_rel_diff"] < 1e-5
    corr = heat["correlations_with_entropy"]
    assert set(corr) == {"V2", "norm", "r_eq", "r_eq_heat"}
    for q, c in corr.items():
        assert c["n"] >= heat["n_probe"] - 5, q
        assert c["n_bootstrap"] >= 1000
        for kind in ("pearson", "spearman"):
            r = c[kind]["r"]
            lo, hi = c[kind]["ci95"]
            assert all(math.isfinite(v) for v in (r, lo, hi)), (q, kind)
            assert -1.0 <= lo <= r <= hi <= 1.0, (q, kind, lo, r, hi)
            assert hi - lo > 0, (q, kind)  # a bootstrap over hundreds of probes is never degenerate
        w = c["within_class_spearman"]
        assert -1.0 <= w["mean"] <= 1.0
        assert len(w["per_class"]) == 10
    part = heat["exploratory"]["partial_spearman_V2_entropy_given_norm"]
    assert -1.0 <= part["ci95"][0] <= part["r"] <= part["ci95"][1] <= 1.0
    ent = heat["entropy"]
    assert 0.0 < ent["mean"] < ent["max_possible"] == pytest.approx(math.log(10))
    # the quick model has learned something: well above the 10% of chance
    assert heat["zero_shot_accuracy"] > 0.25
    q = heat["quantiles"]["V2"]
    assert 0 < q["p10"] <= q["median"] <= q["p90"]


def test_retrieval_summary_matches_its_sweep(runs):
    s, _, _ = runs
    cfg = s["config"]
    for space, dim in (("with_head", cfg["embed_dim"]), ("without_head", cfg["channels"][-1])):
        r = s["retrieval"][space]
        assert r["dim"] == dim
        sw = r["sweep"]
        assert sw["n_docs"] == cfg["n_docs"] and sw["n_queries"] == cfg["n_queries"]
        assert sw["select_on"] == "dev" and 0 < sw["n_dev"] < cfg["n_queries"]
        alphas = sw["alphas"]
        assert r["best_alpha"] in alphas and 0.0 in alphas and min(alphas) <= -2 and max(alphas) >= 2
        curve = sw["curves"]["norm"]["all"]["ndcg@10"]
        assert len(curve) == len(alphas)
        assert all(0.0 <= v <= 1.0 for v in curve)
        assert r["ndcg@10"] == pytest.approx(curve[alphas.index(r["best_alpha"])])
        assert r["cosine_ndcg@10"] == pytest.approx(curve[alphas.index(0.0)])
        assert r["gain_pct"] == pytest.approx(100 * (r["ndcg@10"] / r["cosine_ndcg@10"] - 1))
        lc = r["length_control"]
        assert lc["best_beta"] in alphas and math.isfinite(lc["gain_pct"])
        # both controls are cosine at 0
        at_zero = alphas.index(0.0)
        assert sw["curves"]["length"]["all"]["ndcg@10"][at_zero] == pytest.approx(curve[at_zero])
    v = s["verdicts"]
    assert v["paper_sign_flip_reproduced"] == (
        v["best_alpha_with_head_negative"] and v["best_alpha_without_head_positive"]
    )


@pytest.mark.quick
def test_quick_reproduces_the_committed_quick_result(runs):
    from tests.conftest import assert_reproduces

    assert_reproduces("e5", runs[2])


def test_every_number_finite_and_runs_identical(runs):
    a, b, _ = runs
    na, nb = dict(_numbers(a)), dict(_numbers(b))
    assert na.keys() == nb.keys()
    bad = [p for p, v in na.items() if not math.isfinite(v)]
    # only the documented optional gains may be missing; nothing may be NaN or infinite
    assert not bad, bad[:5]
    differ = [p for p in na if na[p] != nb[p]]
    assert not differ, differ[:5]
