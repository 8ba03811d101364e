"""The heat's batches drawn by their energy (normfast.engine.directions.sampling): the proposal, the
draw, and the weighted estimator, which the accumulators compute exactly as the float64 reference and
whose expectation over the draw is the pool's heat."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from normfast.core.reference import exact_expectation, weighted_heat_reference
from normfast.engine.directions.sampling import PROPOSALS, draw_heat, heat_proposal, pool_level_se
from normfast.engine.estimators import GroupedAccumulator, ProbeAccumulator


def heavy_population(p: int, n: int = 5, d: int = 3, seed: int = 0):
    """P batches' displacements of n rows (a few batches far larger: a heavy tail) and their energies."""
    rng = np.random.default_rng(seed)
    size = rng.pareto(1.1, p) + 0.05
    T = rng.normal(size=(p, n, d)) * size[:, None, None]
    energy = size**2 * rng.uniform(0.5, 1.5, p)  # the batches' energies follow their size, not exactly
    Z = rng.normal(size=(n, d)) + 2.0
    return T, Z, energy


@pytest.mark.parametrize("method", PROPOSALS)
def test_every_proposal_is_a_distribution_that_reaches_every_batch_with_energy(method):
    e = np.array([0.0, 1e-12, 3.0, 1e4, 2.0])
    q = heat_proposal(e, method)
    assert q.sum() == pytest.approx(1.0) and np.all(q[1:] > 0)
    assert q[3] == q.max()
    np.testing.assert_allclose(heat_proposal(np.zeros(4), method), 0.25)


def test_bad_energies_and_sizes_are_refused():
    with pytest.raises(ValueError, match="finite energies"):
        heat_proposal(np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match="method"):
        heat_proposal(np.ones(3), "cubic")
    with pytest.raises(ValueError, match="at least 2 batches"):
        draw_heat(np.ones(1), 4, 0)
    with pytest.raises(ValueError, match="m >= 2"):
        draw_heat(np.ones(8), 1, 0)


def test_the_draw_is_seeded_and_its_weights_undo_the_proposal():
    e = np.random.default_rng(1).pareto(1.0, 200)
    a, b, c = draw_heat(e, 16, 3, first=1000), draw_heat(e, 16, 3, first=1000), draw_heat(e, 16, 4, first=1000)
    assert a == b and a != c
    q = heat_proposal(e, a.proposal)
    picks = np.asarray(a.batches) - 1000
    np.testing.assert_allclose(a.weights, 1.0 / (199 * q[picks]), rtol=1e-15)
    assert 1 <= a.effective_size <= 16 and a.pool == 200 and a.metadata()["draws"] == 16


@pytest.mark.parametrize("zero_energy", [False, True], ids=["energies", "one-without-energy"])
@pytest.mark.parametrize("method", PROPOSALS)
def test_the_weighted_heat_is_unbiased_for_the_pools_heat_exactly(method, zero_energy):
    """Over every sequence of two draws (P² of them, enumerated), the estimator's mean is the pool's
    sample variance Σ_b |x_b - x̄|² / (P - 1), to rounding: a heavy-tailed population with a known answer
    (also with a batch of zero energy, which still moves every row by the centre)."""
    T, Z, energy = heavy_population(7)
    if zero_energy:
        T[3], energy[3] = 0.0, 0.0
    R = np.linalg.norm(Z, axis=1)
    x = T * R[None, :, None]
    centred = x - x.mean(0)
    truth = (centred**2).sum(-1).sum(0) / (len(T) - 1)
    q = heat_proposal(energy, method)
    expected = exact_expectation((centred**2).sum(-1), q, m=2)
    np.testing.assert_allclose(expected, truth, rtol=1e-12)


@pytest.mark.parametrize("branch", ["u", "w"])
def test_the_accumulators_compute_the_reference_on_fixed_draws(branch):
    """Directions folded as the engine folds them (sqrt(w) (p - p̄)) through a known-mean accumulator give
    the float64 reference's weighted heat, plain and grouped, leave-one-group-out included."""
    T, Z, energy = heavy_population(40, n=6, d=4, seed=2)
    draw = draw_heat(energy, 12, seed=5)
    centre = T.mean(0)
    picks = np.asarray(draw.batches)
    folded = np.sqrt(np.asarray(draw.weights))[:, None, None] * (T[picks] - centre[None])
    ref = weighted_heat_reference(T[picks], Z, draw.weights, centre, branch=branch).numpy()
    key = "V2" if branch == "u" else "V2_w"
    acc = ProbeAccumulator(6, 4, branch=branch, dtype=torch.float64, known_mean=True)
    acc.update(torch.as_tensor(folded[:5]), torch.as_tensor(Z)).update(torch.as_tensor(folded[5:]), torch.as_tensor(Z))
    np.testing.assert_allclose(acc.finalize()[key].numpy(), ref, rtol=1e-12)
    grouped = GroupedAccumulator(6, 4, groups=4, branch=branch, dtype=torch.float64, known_mean=True)
    grouped.update(torch.as_tensor(folded), torch.as_tensor(Z))
    out = grouped.finalize()
    np.testing.assert_allclose(out[key].numpy(), ref, rtol=1e-12)
    for g in range(4):
        keep = [i for i in range(12) if i % 4 != g]
        w = np.asarray(draw.weights)[keep]
        loo = weighted_heat_reference(T[picks][keep], Z, w, centre, branch=branch).numpy()
        np.testing.assert_allclose(out["loo"][key][:, g].numpy(), loo, rtol=1e-12)
    plain = ProbeAccumulator(6, 4, branch=branch, dtype=torch.float64)
    plain.update(torch.as_tensor(folded), torch.as_tensor(Z))
    assert not np.allclose(plain.finalize()[key].numpy(), ref)  # the known-mean estimator is another one
    with pytest.raises(ValueError, match="known_mean"):
        plain.merge(acc)


def test_drawing_by_energy_steadies_the_level_of_a_heavy_tailed_heat():
    """A plain mean of 16 of 2 000 heavy-tailed batches moves the level by large factors; 16 drawn by the
    mixture proposal keep it within a narrow band around the pool's."""
    T, Z, energy = heavy_population(2000, n=8, d=3, seed=3)
    R = np.linalg.norm(Z, axis=1)
    c = ((T - T.mean(0)) ** 2).sum(-1) * R[None] ** 2  # [P, rows]
    truth = c.sum(0) / (len(T) - 1)
    rng = np.random.default_rng(0)
    plain, drawn = [], []
    for r in range(400):
        pick = rng.choice(len(T), 16, replace=False)
        plain.append(np.median(c[pick].mean(0) * len(T) / (len(T) - 1) / truth))
        d = draw_heat(energy, 16, seed=r)
        est = (np.asarray(d.weights)[:, None] * c[list(d.batches)]).mean(0)
        drawn.append(np.median(est / truth))
    spread = lambda x: np.quantile(x, 0.95) / np.quantile(x, 0.05)  # noqa: E731
    assert spread(drawn) < spread(plain) / 3
    assert 0.8 < np.median(drawn) < 1.25 < 1 / np.median(plain)


def test_the_pools_level_error_grows_with_its_tail():
    light = np.random.default_rng(0).uniform(0.5, 1.5, 1024)
    heavy = np.random.default_rng(0).pareto(1.1, 1024)
    assert 0 < pool_level_se(light) < 0.02 < pool_level_se(heavy)
    assert pool_level_se(np.zeros(10)) == 0.0
