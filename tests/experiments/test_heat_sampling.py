"""The heat sampling study: its truth pool is the engine's plain heat over the same batches, and its
stage A simulation draws as the engine does."""

from __future__ import annotations

import numpy as np
import pytest

from bench.experiments.heat_sampling import settings, stages, truth


@pytest.fixture(scope="module")
def tiny(tiny_bert_folder):
    import normfast

    return normfast.load_encoder(str(tiny_bert_folder))


def test_the_truth_pool_is_the_engines_plain_heat_over_the_same_batches(tiny, monkeypatch):
    import normfast

    monkeypatch.setattr(truth, "PARAMS", r"encoder\.layer\.1\.")
    words = [f"word{i} token{i % 7}" for i in range(12)]
    cfg = settings.Config(words=12, truth_batches=10, batch_size=4)
    pool = truth.truth_pool(tiny, words, cfg, progress=False)
    config = normfast.ProbeConfig(
        params=truth.PARAMS,
        output="pooled",
        batches=10,
        drift_batches=None,
        batch_size=4,
        seed=settings.TRUTH_SEED,
        batch_indices=pool["batches"],
        uncertainty=False,
    )
    res = normfast.probe(tiny, words, "simcse", None, config, progress=False)
    np.testing.assert_allclose(pool["V2_true"], res.column("V2"), rtol=1e-5)
    np.testing.assert_allclose(pool["drift_true"], res.column("D"), rtol=1e-4, atol=1e-9)
    assert pool["c"].shape == (10, 12) and np.all(pool["energy"] > 0) and np.all(pool["proxy"] > 0)


def test_stage_a_compares_every_proposal_and_the_plain_draw_misses_a_heavy_tail():
    rng = np.random.default_rng(0)
    n_t, rows = 400, 30
    energy = rng.pareto(1.2, n_t) + 1e-3  # a heavy tail: a few batches carry most of the energy
    c = energy[:, None] * rng.gamma(2.0, 0.5, (n_t, rows))  # every row's heat made of the same energies
    t = {"c": c, "energy": energy, "V2_true": c.sum(0) / (n_t - 1)}
    cfg = settings.Config(pool=200, batches=16, replicates=300)
    out = stages.stage_a(t, cfg)
    assert set(out) == set(settings.PROPOSALS + settings.REPORTED_ONLY)
    spread = {k: v["level_p95"] / v["level_p5"] for k, v in out.items()}
    assert spread["energy"] < spread["uniform"] / 2 and spread["mixture"] < spread["uniform"] / 2
    assert 0.8 < out["mixture"]["level_median"] < 1.2 and out["uniform"]["level_median"] < 0.9
    assert stages.choose_proposal({"x": out})["proposal"] != "uniform"
