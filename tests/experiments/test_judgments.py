"""Norm-aware similarity against human scores (the held-out alpha choice, paired bootstrap CIs), and the
two experiments' messages when their optional data or model is missing."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from bench.experiments.judgments.sweep import judgment_sweep, norm_aware_similarity, verdict
from normfast.core.stats import correlation, paired_bootstrap


def _pairs(rng, n=400, d=8):
    a = rng.normal(size=(n, d)) * rng.lognormal(0, 0.5, (n, 1))
    b = a * 0.3 + rng.normal(size=(n, d)) * rng.lognormal(0, 0.5, (n, 1))
    return a, b


def test_norm_aware_similarity(rng):
    a, b = _pairs(rng, 5)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    np.testing.assert_allclose(norm_aware_similarity(a, b, 0.0), cos)
    prod = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    np.testing.assert_allclose(norm_aware_similarity(a, b, 1.0), (a * b).sum(1))
    np.testing.assert_allclose(norm_aware_similarity(a, b, -0.5), cos / np.sqrt(prod))
    with pytest.raises(ValueError, match="same shape"):
        norm_aware_similarity(a, b[:3], 0.5)
    z = b.copy()
    z[2] = 0
    with pytest.raises(ValueError, match="zero-norm"):
        norm_aware_similarity(a, z, 0.5)


def test_sweep_finds_a_planted_alpha_on_held_out_pairs(rng):
    a, b = _pairs(rng)
    human = norm_aware_similarity(a, b, 0.6) + rng.normal(0, 0.05, len(a))
    r = judgment_sweep(a, b, human, method="pearson", resamples=300)
    for fold in r["folds"]:
        assert 0.35 <= fold["best_alpha"] <= 0.85
        g = fold["test"]["gain"]
        assert g["ci_low"] > 0 and g["ci_low"] <= g["value"] <= g["ci_high"]
        assert fold["dev_pairs"] + fold["test_pairs"] == len(a)
    assert verdict(r).startswith("norm-aware beats cosine")
    assert r["alphas"][r["alphas"].index(0.0)] == 0.0 and len(r["all_pairs_curve"]) == len(r["alphas"])


def test_sweep_without_a_norm_signal_keeps_cosine(rng):
    a, b = _pairs(rng)
    human = norm_aware_similarity(a, b, 0.0) + rng.normal(0, 0.05, len(a))
    r = judgment_sweep(a, b, human, method="spearman", resamples=300)
    for fold in r["folds"]:
        assert abs(fold["best_alpha"]) <= 0.15
        assert fold["test"]["gain"]["ci_high"] > -0.02
    assert "beats" not in verdict(r)
    with pytest.raises(ValueError, match="at least 20"):
        judgment_sweep(a[:10], b[:10], human[:10])
    with pytest.raises(ValueError, match="contain 0"):
        judgment_sweep(a, b, human, alphas=[0.5, 1.0])


def test_paired_bootstrap(rng):
    x = rng.normal(size=300)
    y = x + rng.normal(size=300)
    z = rng.normal(size=300)
    out = paired_bootstrap({"x": x, "z": z}, y, baseline="z", resamples=400, seed=1)
    assert out["x"]["value"] == pytest.approx(correlation(x, y, "spearman"))
    assert out["x"]["ci_low"] < out["x"]["value"] < out["x"]["ci_high"]
    d = out["x - z"]
    assert d["value"] == pytest.approx(out["x"]["value"] - out["z"]["value"]) and d["ci_low"] > 0
    p = paired_bootstrap({"x": x}, y, method="pearson", resamples=200)
    assert p["x"]["value"] == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert paired_bootstrap({"x": x}, y, resamples=200, seed=3) == paired_bootstrap({"x": x}, y, resamples=200, seed=3)
    with pytest.raises(ValueError, match="method"):
        paired_bootstrap({"x": x}, y, method="kendall")
    with pytest.raises(ValueError, match="shape"):
        paired_bootstrap({"x": x[:5]}, y)


# ---------------------------------------------------------------------------
# the experiments say which extra is missing


@pytest.mark.parametrize("name", ["judgments", "corpus"])
def test_scripts_name_the_gensim_extra(name, monkeypatch, capsys, tmp_path):
    from bench.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gensim" else real(n, *a))
    assert main(["run", name, "--out", str(tmp_path)]) == 2
    assert "normfast[gensim]" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name", ["judgments", "corpus"])
def test_scripts_name_the_mpnet_extra(name, monkeypatch, capsys, tmp_path):
    from normfast.data import gensim_data
    from normfast.encoders import packaged
    from tests.data.test_corpus import _fake_gensim

    fake = _fake_gensim(tmp_path)
    monkeypatch.setattr(gensim_data, "gensim_test_data", lambda root=None: fake)
    monkeypatch.setattr(packaged, "MPNET_PARTS", ("normfast-no-such-part-001",))
    monkeypatch.setenv("NORMFAST_CACHE", str(tmp_path / "cache"))
    from bench.cli import main

    out = tmp_path / "out"
    argv = ["run", name, "--out", str(out), "--models", "all-mpnet-base-v2"]
    if name == "corpus":
        argv += ["--probe-dir", str(tmp_path / "runs"), "--no-progress"]
    assert main(argv) == 2
    assert "normfast[mpnet]" in capsys.readouterr().err
    assert not out.exists() or not list(out.iterdir())
