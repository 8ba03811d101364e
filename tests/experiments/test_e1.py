"""E1's radial-budget ledger and the law's per-step terms (bench.experiments.e1)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from bench.experiments.e1.data import VARIANT_SPECS, make_concepts
from bench.experiments.e1.ledger import RealizedLedger, estimated_terms, realized_terms
from bench.experiments.e1.training import train
from tests._models import e1_toy

# a run whose window is stationary at test size: 2ηλκ = 0.02 per step (a relaxation time of ~50 steps)
TINY = e1_toy(heavyball_lr=0.005, steps=1500, window=0.4, record_every=10, probe_every=50)


@pytest.fixture(scope="module")
def tiny_data():
    return make_concepts(TINY)


@pytest.fixture(scope="module")
def tiny_runs(tiny_data):
    torch.set_num_threads(1)
    return {
        v: train(VARIANT_SPECS[v], TINY, tiny_data, ledger=True, fresh_meter=(v == "mlp"), progress=False)
        for v in ("mlp", "table")
    }


def test_dense_meter_samples_the_steps_own_batch(tiny_runs):
    """E1's dense meter (protocol v4) samples each state along the batch the step then takes: for plain
    SGD its drift sample is the realized first-order task term over 2η (task1 = 2z·J(−ηg) = 2η D), so
    the window means agree to the float32 step's rounding; the fresh-batch meter (v3) samples the same
    states along other batches and does not."""
    run = tiny_runs["mlp"]
    task1 = run.ledger.means()["task1"]
    own = 2 * TINY.lr * run.meter["D"]
    scale = np.abs(task1).max()
    assert run.meter["n"] == run.ledger.steps == run.meter_fresh["n"]
    np.testing.assert_allclose(own, task1, rtol=0, atol=1e-6 * scale)
    fresh = 2 * TINY.lr * run.meter_fresh["D"]
    assert np.max(np.abs(fresh - task1)) > 1e-2 * scale


def test_table_terms_are_exact(tiny_runs):
    """A free table is linear in its parameters (no remainder) and its rows only receive gradients
    orthogonal to themselves (no first-order task term); decay is -2ηλR² per step."""
    m = tiny_runs["table"].ledger.means()
    decay = np.abs(m["decay"])
    assert np.max(np.abs(m["remainder"]) / decay) < 1e-9
    assert np.max(np.abs(m["task1"]) / decay) < 1e-6  # float32 steps: the split is exact to their rounding
    eta, lam = TINY.lr, TINY.weight_decay
    np.testing.assert_allclose(m["decay_first_order"], -2 * eta * lam * m["R2"], rtol=1e-9)
    assert np.all(m["task2"] > 0)


def test_mlp_decay_is_kappa_two_and_the_balance_closes(tiny_runs):
    """Bias-free 2-layer ReLU network: κ = 2 exactly, so the first-order decay term is -4ηλR²; over a
    stationary window the realized terms sum to ≈ 0 against the size of each."""
    run = tiny_runs["mlp"]
    m = run.ledger.means()
    eta, lam = TINY.lr, TINY.weight_decay
    np.testing.assert_allclose(m["decay_first_order"], -4 * eta * lam * m["R2"], rtol=1e-9)
    real = realized_terms(m)
    # the four terms add up to the realized change (telescoped over the window)
    np.testing.assert_allclose(real["total"], real["total_telescoped"], rtol=1e-9, atol=1e-15)
    telescoped = (run.ledger.r2_last - run.ledger.r2_first).numpy() / run.ledger.steps
    np.testing.assert_allclose(real["total"], telescoped, rtol=1e-7, atol=1e-12)
    closure = np.abs(real["total"]) / np.abs(real["decay"])
    assert np.median(closure) < 0.05
    # heat and decay are of one size; the curvature remainder is smaller but not zero
    assert 0.3 < np.mean(real["task2"]) / np.abs(np.mean(real["decay"])) < 3
    assert 0 < abs(np.mean(real["remainder"])) < np.mean(real["task2"])


def test_heavy_ball_shadow_buffer():
    """With zero task gradients, heavy-ball SGD moves only by its (coupled) decay buffer: the ledger's
    shadow buffer must account for the whole step, so the task part is zero to float32 rounding."""
    torch.manual_seed(0)
    cfg = replace(TINY, heavyball_lr=0.01)
    data = make_concepts(cfg)
    from bench.experiments.e1.data import build_encoder, variant_optimizer

    variant = VARIANT_SPECS["mlp_heavyball"]
    enc = build_encoder("table", cfg, data)
    opt = variant_optimizer(variant, cfg, enc.parameters())
    led = RealizedLedger(enc, enc.prepare(list(range(data.x.shape[0]))), variant, cfg)
    for step in range(40):
        for p in enc.parameters():
            p.grad = torch.zeros_like(p)
        led.before_step(record=step >= 30)
        opt.step()
        led.after_step(record=step >= 30)
    m = led.means()
    assert np.max(np.abs(m["task1"]) / np.abs(m["decay"])) < 1e-4
    # after 30 steps the buffer holds ~ (1 - 0.9^31) / (1 - 0.9) ≈ 9.6 decay steps of the (larger) past
    # parameters; a ledger that took the decay step as -ηλθ would find 1
    ratio = m["decay_first_order"] / (-2 * cfg.heavyball_lr * cfg.weight_decay * m["R2"])
    assert np.all((ratio > 9.0) & (ratio < 11.5))


@pytest.mark.parametrize("optimizer, momentum", [("sgd", 0.0), ("sgd", 0.9), ("adamw", 0.0)])
def test_estimated_terms_balance_at_the_laws_root(rng, optimizer, momentum):
    """The ledger's per-step estimates are the law's terms: at R = R_eq they sum to zero."""
    from normfast.core.equilibrium import equilibrium_norm

    n, lr, wd = 50, 0.01, 0.05
    kappa = rng.uniform(0.5, 2.0, n)
    D = rng.normal(0, 1, n)
    Q = rng.uniform(0.5, 5.0, n)
    if optimizer == "adamw":
        R = equilibrium_norm(None, None, kappa, D_w=D, Q_w=Q, lr=lr, weight_decay=wd)
        stats = {"norm": R, "kappa": kappa, "D_w": D, "Q_w": Q}
    else:
        R = equilibrium_norm(D, Q, kappa, lr=lr, weight_decay=wd, momentum=momentum)
        stats = {"norm": R, "kappa": kappa, "D": D, "Q": Q}
    est = estimated_terms(optimizer, stats, lr=lr, weight_decay=wd, momentum=momentum)
    np.testing.assert_allclose(est["total"] / np.abs(est["decay"]), 0, atol=1e-9)
    # and away from the root the imbalance has the restoring sign
    est_hi = estimated_terms(optimizer, dict(stats, norm=1.5 * R), lr=lr, weight_decay=wd, momentum=momentum)
    assert np.all(est_hi["total"] < 0)


def test_curvature_heat_matches_the_realized_remainder(tiny_runs, tiny_data):
    """The remainder of virtual steps at the run's last state against the remainder realized over the
    window (SGD, where one step is the long-run step): same size, and it ranks the items alike."""
    from bench.experiments.e1.data import probe_config
    from normfast.data.pairs import PairSource
    from normfast.engine.directions.objectives import InfoNCE
    from normfast.engine.trajectory.curvature import curvature_heat

    run = tiny_runs["mlp"]
    n = tiny_data.x.shape[0]
    pairs = PairSource.from_iterable([(int(a), int(b)) for a, b in tiny_data.pairs])
    cfg = probe_config(run.variant, TINY, n, batches=128, drift_batches=128)
    before = {k: p.detach().clone() for k, p in run.encoder.named_parameters()}
    est = curvature_heat(run.encoder, list(range(n)), InfoNCE(temperature=TINY.temperature), pairs, cfg)
    for k, p in run.encoder.named_parameters():
        assert torch.equal(p, before[k])
    realized = run.ledger.means()["remainder"]
    assert 0.5 < est["c"].mean() / realized.mean() < 1.5
    assert np.corrcoef(est["c"], realized)[0, 1] > 0.6
    np.testing.assert_allclose(est["Q_curv"], est["norm"] ** 2 * est["c"] / TINY.lr**2)


def test_virtual_trajectory_is_torch_training_on_a_copy(tiny_data):
    """The trajectory is plain torch SGD on its virtual batches, run on a copy (the model is untouched),
    and probed at evenly spaced steps."""
    from bench.experiments.e1.data import build_encoder, probe_config
    from normfast.data.batches import virtual_batches
    from normfast.data.pairs import PairSource
    from normfast.engine.directions.gradients import batch_loss
    from normfast.engine.directions.objectives import InfoNCE
    from normfast.engine.trajectory.virtual import virtual_trajectory

    enc = build_encoder("mlp", TINY, tiny_data)
    n = tiny_data.x.shape[0]
    pairs = PairSource.from_iterable([(int(a), int(b)) for a, b in tiny_data.pairs])
    objective = InfoNCE(temperature=TINY.temperature)
    cfg = probe_config(VARIANT_SPECS["mlp"], TINY, n, batches=4, drift_batches=8)
    before = {k: p.detach().clone() for k, p in enc.named_parameters()}
    from dataclasses import replace

    from normfast.engine.probe import probe

    def measure(model, step, second_moments):
        return probe(
            model,
            list(range(n)),
            objective,
            pairs,
            replace(cfg, seed=step),
            progress=False,
            second_moments=second_moments,
        )

    traj = virtual_trajectory(
        enc, list(range(n)), objective, pairs, cfg, steps=30, points=3, measure=measure, progress=False
    )
    for k, p in enc.named_parameters():
        assert torch.equal(p, before[k])
    assert traj.steps == [10, 20, 30] and traj.columns["D"].shape == (3, n) and len(traj.losses) == 30
    # replay: the same batches through torch's SGD reach the norms of the last probe point
    import copy

    ref = copy.deepcopy(enc)
    opt = torch.optim.SGD(ref.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    rng = np.random.default_rng(cfg.seed)
    batches = virtual_batches(len(pairs), 30, cfg.batch_size, int(rng.integers(2**31)))
    for b in batches:
        loss = batch_loss(ref, objective, pairs, b)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        norms = ref(ref.prepare(list(range(n)))).norm(dim=-1).double().numpy()
    np.testing.assert_allclose(traj.columns["norm"][-1], norms, rtol=1e-5)
    with pytest.raises(ValueError, match="points"):
        virtual_trajectory(
            enc, list(range(n)), objective, pairs, cfg, steps=5, points=6, measure=measure, progress=False
        )
    with pytest.raises(ValueError, match="needs measure="):
        virtual_trajectory(enc, list(range(n)), objective, pairs, cfg, steps=5, points=2, progress=False)


@pytest.mark.parametrize("variant", ["mlp_bias", "mlp_adamw"])
def test_trajectory_meter_matches_the_engine_batch_by_batch(tiny_data, variant):
    """Fed the engine's own per-batch directions at one state, the meter's means are the engine's
    per-batch drift and κ, and its heat is the mean of |u|² (the engine's Q less its V2/M bias term)."""
    from bench.experiments.e1.data import build_encoder, probe_config
    from normfast.data.batches import virtual_batches
    from normfast.data.pairs import PairSource
    from normfast.engine.directions.gradients import compute_directions, estimate_second_moments
    from normfast.engine.directions.objectives import InfoNCE
    from normfast.engine.directions.presets import OptimizerPreset
    from normfast.engine.probe import probe
    from normfast.engine.trajectory.virtual import TrajectoryMeter

    spec = VARIANT_SPECS[variant]
    enc = build_encoder(spec, TINY, tiny_data)
    n = tiny_data.x.shape[0]
    pairs = PairSource.from_iterable([(int(a), int(b)) for a, b in tiny_data.pairs])
    objective = InfoNCE(temperature=TINY.temperature)
    M = 6
    cfg = replace(probe_config(spec, TINY, n, batches=M, drift_batches=M), drift_batches=None, seed=3)
    names = [k for k, _ in enc.named_parameters()]
    rng = np.random.default_rng(cfg.seed)
    batches = virtual_batches(len(pairs), M, cfg.batch_size, int(rng.integers(2**31)))
    v = (
        estimate_second_moments(enc, objective, pairs, names, batches, progress=False)
        if spec.optimizer == "adamw"
        else None
    )
    res = probe(enc, list(range(n)), objective, pairs, cfg, progress=False, second_moments=v)
    presets = {k: OptimizerPreset(spec.optimizer, cfg.lr, cfg.weight_decay, second_moments=v) for k in names}
    dirs = compute_directions(enc, objective, pairs, names, presets, batches, progress=False)
    meter = TrajectoryMeter(enc, list(range(n)), cfg, curvature=True, block=2)
    for b in range(M):
        meter.add(dirs.directions[b], kappa=b == 0)
    st = meter.statistics()
    sfx = "_w" if spec.optimizer == "adamw" else ""
    np.testing.assert_allclose(st[f"D{sfx}"], res.column(f"D{sfx}"), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(st[f"Q{sfx}"], res.column(f"Q{sfx}") - res.column(f"V2{sfx}") / M, rtol=1e-4)
    np.testing.assert_allclose(st["kappa"], res.column("kappa"), rtol=1e-5)
    assert st["n"] == M and st[f"D{sfx}_blocks"].shape == (M // 2, n) and np.all(st[f"se_D{sfx}"] > 0)
    assert np.all(np.isfinite(st[f"Q_curv{sfx}"]))
