"""The heat's batches drawn by their energy, end to end (ProbeConfig.heat_sampling, the default): the
engine's V2 is the float64 reference's weighted estimator over the same draw, the drift comes from the
whole pool, the level's error goes into the intervals, and the plain draw runs where there is no pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import functional_call, jvp

from normfast.core.reference import brute_force_stats, weighted_heat_reference
from normfast.data.batches import virtual_batches
from normfast.data.pairs import PairSource
from normfast.engine.directions.objectives import InfoNCE
from normfast.engine.directions.sampling import draw_heat
from normfast.engine.probe import ProbeConfig, probe
from tests._models import tanh_mlp, vector_data

pytestmark = pytest.mark.usefixtures("single_thread")


def _setup():
    enc = tanh_mlp(torch.float64)
    items, pairs = vector_data(11, 50, torch.float64)
    # a few pairs far apart: rare batches with far more gradient energy than the rest
    for k in range(3):
        pairs[k] = (pairs[k][0] * 6, -pairs[k][1] * 6)
    return enc, items, pairs


def _displacements(enc, items, pairs, cfg, optimizer, probed):
    """Every pool batch's raw displacement ``t_b = -J p_b`` of every item along the ``probed`` parameters
    (float64, torch.func), the batches' energies |ĝ_b|² and the items' embeddings."""
    source = PairSource.from_iterable(pairs)
    seed = int(np.random.default_rng(cfg.seed).integers(2**31))
    batches = virtual_batches(len(source), cfg.drift_batches, cfg.batch_size, seed)
    params = {n: p.detach() for n, p in enc.named_parameters() if n in probed}
    obj = InfoNCE(0.1)
    grads, energy = [], []
    for idx in batches:
        a, b = source.batch(idx)
        loss = obj.loss(enc(enc.prepare(a)), enc(enc.prepare(b)))
        g = dict(zip(params, torch.autograd.grad(loss, [enc.get_parameter(n) for n in params])))
        grads.append(g)
        energy.append(sum(float(x.square().sum()) for x in g.values()))
    if optimizer == "adamw":  # p = ĝ / (sqrt(v̂) + eps), v̂ the mean of ĝ² over the pool
        v = {n: torch.stack([g[n] ** 2 for g in grads]).mean(0) for n in params}
        grads = [{n: g[n] / (v[n].sqrt() + cfg.eps) for n in params} for g in grads]
    X = torch.stack(items)

    def f(p):
        return functional_call(enc, p, (enc.prepare(X),), strict=False)

    T = torch.stack([-jvp(f, (params,), (g,))[1] for g in grads]).detach()
    with torch.no_grad():
        Z = enc(enc.prepare(X))
    return T, np.asarray(energy), Z


@pytest.mark.parametrize("mode, optimizer", [("jvp", "sgd"), ("head", "sgd"), ("jvp", "adamw")])
def test_the_engines_heat_is_the_weighted_estimator_over_its_draw(mode, optimizer):
    enc, items, pairs = _setup()
    cfg = ProbeConfig(
        params="head" if mode == "head" else "all",
        mode=mode,
        optimizer=optimizer,
        batches=6,
        drift_batches=20,
        groups=3,
        batch_size=8,
        chunk_size=4,
        seed=3,
    )
    res = probe(enc, items, InfoNCE(0.1), pairs, cfg, progress=False)
    probed = [n for n, _ in enc.named_parameters() if mode != "head" or n.startswith("blocks.2.")]
    T, energy, Z = _displacements(enc, items, pairs, cfg, optimizer, probed)
    draw = draw_heat(energy, cfg.batches, cfg.seed)
    branch, sfx = ("u", "") if optimizer == "sgd" else ("w", "_w")
    ref = weighted_heat_reference(T[list(draw.batches)], Z, draw.weights, T.mean(0), branch=branch).numpy()
    np.testing.assert_allclose(res.column("V2" + sfx), ref, rtol=1e-9)
    # se_V2: the delete-a-group jackknife over the draws (draw i in group i mod K) and the pool's own level
    # error in quadrature
    picks, w = np.asarray(draw.batches), np.asarray(draw.weights)
    loo = np.stack(
        [
            weighted_heat_reference(T[picks[keep]], Z, w[keep], T.mean(0), branch=branch).numpy()
            for keep in ([i for i in range(cfg.batches) if i % cfg.groups != g] for g in range(cfg.groups))
        ],
        1,
    )
    k = cfg.groups
    jack = np.sqrt(((loo - loo.mean(1, keepdims=True)) ** 2).sum(1) * (k - 1) / k)
    np.testing.assert_allclose(res.column("se_V2" + sfx), np.hypot(jack, ref * draw.level_se), rtol=1e-7)
    # the r_eq interval is at least as wide as the level's own shift of r_eq (t quantile, K - 1 dof)
    from normfast.core.equilibrium import equilibrium_norm
    from normfast.engine.estimators import t_quantile

    law = dict(lr=cfg.lr, weight_decay=cfg.weight_decay)
    kappa, m2 = res.column("kappa"), res.column("m2" + sfx)
    if optimizer == "sgd":
        ends = [
            equilibrium_norm(res.column("D"), m2 + f * ref, kappa, **law)
            for f in np.exp([draw.level_se, -draw.level_se])
        ]
        half_shift = np.abs(ends[0] - ends[1]) / 2
        assert np.all(res.column("r_eq_hi") - res.column("r_eq") >= t_quantile(k - 1) * half_shift * (1 - 1e-9))
    pool = brute_force_stats(T, Z, branch)  # the drift and m2: the whole pool's mean direction
    np.testing.assert_allclose(res.column("D" + sfx), pool["D" + sfx].numpy(), rtol=1e-9)
    np.testing.assert_allclose(res.column("m2" + sfx), pool["m2" + sfx].numpy(), rtol=1e-9)
    info = res.metadata["heat_sampling"]
    assert info["method"] == "energy" and info["pool"] == 20 and info["draws"] == 6
    assert info["pool_level_se"] == pytest.approx(draw.level_se) and info["pool_level_se"] > 0
    ref_level = res.metadata["heat_reference"]
    assert ref_level["se_log_level"] == pytest.approx(np.hypot(ref_level["se_log_level_groups"], draw.level_se))


def test_equal_seeds_equal_tables_and_the_plain_draw_is_a_setting():
    enc, items, pairs = _setup()
    kw = dict(params="all", batches=6, drift_batches=20, groups=3, batch_size=8, chunk_size=4, seed=3)
    a = probe(enc, items, InfoNCE(0.1), pairs, ProbeConfig(**kw), progress=False)
    b = probe(enc, items, InfoNCE(0.1), pairs, ProbeConfig(**kw), progress=False)
    assert a.table.equals(b.table.replace_schema_metadata(a.table.schema.metadata))
    plain = probe(enc, items, InfoNCE(0.1), pairs, ProbeConfig(**kw, heat_sampling="uniform"), progress=False)
    assert plain.metadata["heat_sampling"] == {"asked": "uniform", "method": "uniform"}
    np.testing.assert_array_equal(plain.column("D"), a.column("D"))  # the same pool gives the drift
    assert not np.allclose(plain.column("V2"), a.column("V2"))
    # the level's error widens the intervals of the sampled run (the plain one has no pool term)
    assert plain.metadata["heat_reference"]["se_log_level_pool"] == 0.0


@pytest.mark.parametrize(
    "kw, note",
    [
        ({"drift_batches": None}, "no pool of drift batches"),
        ({"batch_indices": [[0, 1, 2, 3]] * 20}, "batch_indices given"),
        ({"optimizer": {r"blocks\.0\.": "adamw", ".": "sgd"}}, "both optimizer branches"),
    ],
)
def test_without_a_pool_the_plain_draw_runs_and_says_why(kw, note):
    enc, items, pairs = _setup()
    base = dict(params="all", batches=6, drift_batches=20, groups=3, batch_size=4, chunk_size=4, seed=3)
    res = probe(enc, items, InfoNCE(0.1), pairs, ProbeConfig(**{**base, **kw}), progress=False)
    info = res.metadata["heat_sampling"]
    assert info["asked"] == "energy" and info["method"] == "uniform" and note in info["note"]


def test_a_bad_setting_is_refused():
    with pytest.raises(ValueError, match=r"heat_sampling must be one of \('energy', 'uniform'\)"):
        ProbeConfig(heat_sampling="importance").validate()
