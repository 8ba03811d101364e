"""bench.training: SGD + decay to a stationary state, its health criteria, the pilot and the
checkpoint-averaged law, on small models (fast); and the bootstrap fit of normfast.core.stats."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

from bench.training import (
    CheckpointLaw,
    CheckpointSnapshots,
    HealthThresholds,
    Resume,
    TrainSettings,
    health,
    mean_cosine,
    pilot,
    probe_checkpoints,
    split_decay,
    train,
)
from normfast.core.equilibrium import equilibrium_norm
from normfast.core.stats import loglog_fit, loglog_fit_ci
from normfast.data.pairs import PairSource
from normfast.encoders import ModuleEncoder
from normfast.engine.directions.objectives import InfoNCE
from normfast.engine.probe import ProbeConfig, probe

pytestmark = pytest.mark.usefixtures("single_thread")

N = 40


def toy(seed: int = 0, layer_norm: bool = False) -> tuple[ModuleEncoder, np.ndarray]:
    """Items 0..N-1 with features in 4 clusters; pairs within a cluster."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 8, generator=g) * 2
    x = centers[torch.arange(N) % 4] + 0.5 * torch.randn(N, 8, generator=g)
    torch.manual_seed(seed)
    layers = [nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 6, bias=not layer_norm)]
    if layer_norm:
        layers.append(nn.LayerNorm(6))
    enc = ModuleEncoder(layers, collate=lambda ids: x[torch.as_tensor(np.asarray(ids))], head=False)
    rng = np.random.default_rng(seed)
    a = rng.integers(0, N, 800)
    b = (a + 4 * rng.integers(1, N // 4, 800)) % N  # same cluster, another item
    return enc, np.stack([a, b], 1)


SETTINGS = TrainSettings(
    lr=0.1,
    weight_decay=0.05,
    steps=400,
    temperature=0.2,
    batch_size=16,
    warmup=20,
    window=0.5,
    record_every=10,
    probe_every=50,
    trajectory_every=50,
)


def test_split_decay_partitions_and_freezes():
    enc, _ = toy(layer_norm=True)
    decayed, exempt = split_decay(enc, r"blocks\.[23]\.", r"blocks\.3\.")
    names = {id(p): n for n, p in enc.named_parameters()}
    assert sorted(names[id(p)] for p in decayed) == ["blocks.2.weight"]
    assert sorted(names[id(p)] for p in exempt) == ["blocks.3.bias", "blocks.3.weight"]
    assert not enc.get_parameter("blocks.0.weight").requires_grad
    with pytest.raises(ValueError, match="no decayed parameter"):
        split_decay(enc, r"blocks\.3\.", "blocks")


def test_settings_validate_the_window():
    with pytest.raises(ValueError, match="warmup"):
        TrainSettings(lr=0.1, weight_decay=0.1, steps=100, warmup=80).validate()
    with pytest.raises(ValueError, match="two checkpoints"):
        TrainSettings(lr=0.1, weight_decay=0.1, steps=100, warmup=0, probe_every=30).validate()
    with pytest.raises(ValueError, match="lr, weight_decay"):
        TrainSettings(lr=0.1, weight_decay=0.0, steps=1000).validate()


def test_train_decays_only_the_decayed_group_and_records_the_window():
    enc, pairs = toy(layer_norm=True)
    groups = split_decay(enc, r"blocks\.(0|2|3)\.", r"blocks\.3\.")
    ln_before = enc.get_parameter("blocks.3.weight").detach().clone()
    calls = []
    rec = train(enc, pairs, list(range(N)), SETTINGS, groups, on_checkpoint=calls.append, progress=False)
    window = SETTINGS.steps - SETTINGS.window_start
    assert calls == list(range(window // SETTINGS.probe_every))
    assert len(rec.window_norms) == window // SETTINGS.record_every
    assert len(rec.losses) == SETTINGS.steps and np.isfinite(rec.losses).all()
    assert [t["step"] for t in rec.trajectory] == list(range(50, 401, 50))
    assert rec.cpu_seconds > 0 and rec.seconds > 0
    # the exempt LayerNorm gain moved by gradients only; with lr·λ = 5e-3 over 400 steps, a decay
    # on it would have shrunk it by a factor ~e^-2
    assert enc.get_parameter("blocks.3.weight").norm() > 0.5 * ln_before.norm()
    h = health(rec, SETTINGS)
    assert set(h) >= {
        "loss_below_chance",
        "no_collapse",
        "stationary",
        "passed",
        "norm_change_between_window_halves_median",
    }
    assert h["passed"] == (h["loss_below_chance"] and h["no_collapse"] and h["stationary"])


def test_collapse_is_detected_and_stops_the_run():
    enc, pairs = toy()
    groups = split_decay(enc, "blocks", None)
    with torch.no_grad():  # a constant embedding for every item: mean pairwise cosine 1
        enc.get_parameter("blocks.2.bias").fill_(50.0)
        enc.get_parameter("blocks.2.weight").mul_(1e-4)
    rec = train(enc, pairs, list(range(N)), SETTINGS, groups, stop_on_collapse=True, progress=False)
    assert rec.stopped_at == SETTINGS.trajectory_every
    h = health(rec, SETTINGS)
    assert not h["no_collapse"] and not h["passed"] and h["max_mean_cosine"] > 0.9
    z = torch.randn(30, 5)
    assert mean_cosine(torch.cat([z[:1]] * 30)) == pytest.approx(1.0)
    assert abs(mean_cosine(z)) < 0.2


def test_pilot_takes_the_first_passing_candidate_and_restores_the_model():
    enc, pairs = toy()
    before = {n: p.detach().clone() for n, p in enc.named_parameters()}
    strict = HealthThresholds(norm_change_max=-1.0)  # nothing can pass
    rec = pilot(
        enc,
        pairs,
        list(range(N)),
        SETTINGS,
        [{"lr": 0.1}, {"lr": 0.05}],
        trained="blocks",
        no_decay=None,
        thresholds=strict,
        progress=False,
    )
    assert rec["chosen"] is None and [r["lr"] for r in rec["results"]] == [0.1, 0.05]
    loose = HealthThresholds(loss_fraction_of_chance=10, collapse_cosine=1.1, norm_change_max=10, weight_change_max=10)
    rec = pilot(
        enc,
        pairs,
        list(range(N)),
        SETTINGS,
        [{"lr": 0.1}, {"lr": 0.05}],
        trained="blocks",
        no_decay=None,
        thresholds=loose,
        progress=False,
    )
    assert rec["chosen"] == {"lr": 0.1} and len(rec["results"]) == 1
    for n, p in enc.named_parameters():
        torch.testing.assert_close(p.detach(), before[n], rtol=0, atol=0)
    assert "fits" not in rec and "lr" not in rec["fixed"] and rec["fixed"]["trained"] == "blocks"
    assert all("pearson_r" not in str(r) for r in rec["results"])  # health only


def test_checkpoint_law_averages_and_solves():
    enc, pairs = toy()
    source = PairSource.from_iterable([(int(a), int(b)) for a, b in pairs])
    cfg = ProbeConfig(
        mode="jvp",
        lr=SETTINGS.lr,
        weight_decay=SETTINGS.weight_decay,
        batches=3,
        drift_batches=8,
        batch_size=16,
        chunk_size=N,
    )
    seeds = []

    def run(seed):
        seeds.append(seed)
        with torch.no_grad():
            enc.get_parameter("blocks.2.weight").mul_(1.1)  # another state per checkpoint
        return probe(
            enc,
            list(range(N)),
            InfoNCE(temperature=0.2),
            source,
            ProbeConfig(**{**cfg.__dict__, "seed": seed}),
            progress=False,
        )

    law = CheckpointLaw(run, seed=2)
    for i in range(3):
        law(i)
    assert seeds == [2 * 7919, 2 * 7919 + 1, 2 * 7919 + 2] and law.n == 3
    avg = law.averages()
    np.testing.assert_allclose(avg["Q"], np.mean(law.columns["Q"], axis=0))
    pred = law.predictions(SETTINGS.lr, SETTINGS.weight_decay)
    np.testing.assert_allclose(
        pred["full"],
        equilibrium_norm(avg["D"], avg["Q"], avg["kappa"], lr=SETTINGS.lr, weight_decay=SETTINGS.weight_decay),
    )
    np.testing.assert_allclose(pred["last_full"], law.last["r_eq"])
    regime = law.regime(SETTINGS.lr, SETTINGS.weight_decay)
    assert regime["fractions"]["not applicable"] == 0.0  # a bias-free MLP: κ = 2
    assert len(regime["rows"]["regime"]) == N and regime["last_checkpoint"]["regime"] in (
        "law applicable",
        "heat-dominated",
    )


def _toy_law(enc, pairs, calls: list | None = None) -> CheckpointLaw:
    source = PairSource.from_iterable([(int(a), int(b)) for a, b in pairs])
    cfg = ProbeConfig(
        mode="jvp",
        lr=SETTINGS.lr,
        weight_decay=SETTINGS.weight_decay,
        batches=3,
        drift_batches=8,
        batch_size=16,
        chunk_size=N,
    )

    def run(seed):
        if calls is not None:
            calls.append(seed)
        return probe(enc, list(range(N)), InfoNCE(temperature=0.2), source, replace(cfg, seed=seed), progress=False)

    return CheckpointLaw(run, seed=1)


@pytest.mark.parametrize("workers", [1, 2])
def test_checkpoints_probed_after_training_equal_probing_during_it(tmp_path, workers):
    enc, pairs = toy()
    law = _toy_law(enc, pairs)
    train(
        enc,
        pairs,
        list(range(N)),
        SETTINGS,
        split_decay(enc, r"blocks\.[02]\.", None),
        on_checkpoint=law,
        progress=False,
    )

    enc2, pairs2 = toy()
    law2 = _toy_law(enc2, pairs2)
    groups = split_decay(enc2, r"blocks\.[02]\.", None)
    snapshots = CheckpointSnapshots([*groups[0], *groups[1]], tmp_path / "ckpt", {"toy": 0})
    train(enc2, pairs2, list(range(N)), SETTINGS, groups, on_checkpoint=snapshots, progress=False)
    final = [p.detach().clone() for p in snapshots.params]
    phase = probe_checkpoints({"jvp": law2}, snapshots, workers=workers, progress=False)
    assert snapshots.indices() == list(range(law.n)) and law2.n == law.n == 4
    assert phase["workers"] == workers and phase["seconds"] > 0 and phase["cpu_seconds"] > 0
    for col in CheckpointLaw.COLUMNS:
        np.testing.assert_allclose(np.stack(law2.columns[col]), np.stack(law.columns[col]), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(law2.last["r_eq"], law.last["r_eq"], rtol=1e-6)
    assert all(torch.equal(p, q) for p, q in zip(snapshots.params, final))  # the trained values are back


def test_probing_checkpoints_resumes_and_refuses_another_run(tmp_path):
    enc, pairs = toy()
    groups = split_decay(enc, r"blocks\.[02]\.", None)
    snapshots = CheckpointSnapshots([*groups[0], *groups[1]], tmp_path / "ckpt", {"toy": 0})
    train(enc, pairs, list(range(N)), SETTINGS, groups, on_checkpoint=snapshots, progress=False)
    first = _toy_law(enc, pairs)
    probe_checkpoints({"jvp": first}, snapshots, progress=False)
    (tmp_path / "ckpt" / "00002.result.pt").unlink()  # as if interrupted while probing checkpoint 2
    calls: list[int] = []
    again = _toy_law(enc, pairs, calls)
    probe_checkpoints({"jvp": again}, snapshots, progress=False)
    assert calls == [1 * 7919 + 2] and again.n == first.n == 4
    for col in CheckpointLaw.COLUMNS:
        np.testing.assert_array_equal(np.stack(again.columns[col]), np.stack(first.columns[col]))
    with pytest.raises(ValueError, match="another run"):
        CheckpointSnapshots(snapshots.params, tmp_path / "ckpt", {"toy": 1})
    snapshots.remove()
    assert not (tmp_path / "ckpt").exists()


class _Stop(Exception):
    pass


def _resumable_run(tmp_path, stop_at: int | None) -> tuple:
    """SETTINGS on the toy model with a checkpoint law; ``stop_at``: the checkpoint index at which
    the first process dies (then a second one resumes from the state file)."""

    def attempt(stop):
        enc, pairs = toy()
        source = PairSource.from_iterable([(int(a), int(b)) for a, b in pairs])
        # M_D = 8 drift batches, not the default 1024: the law runs at every checkpoint of both runs
        cfg = ProbeConfig(
            mode="jvp",
            lr=SETTINGS.lr,
            weight_decay=SETTINGS.weight_decay,
            batches=3,
            drift_batches=8,
            batch_size=16,
            chunk_size=N,
        )
        law = CheckpointLaw(
            lambda seed: probe(
                enc,
                list(range(N)),
                InfoNCE(temperature=0.2),
                source,
                ProbeConfig(**{**cfg.__dict__, "seed": seed}),
                progress=False,
            ),
            1,
        )

        def checkpoint(i):
            if i == stop:
                raise _Stop
            law(i)

        resume = Resume(tmp_path / "state.pt", every=60, parts={"law": law}, identity={"toy": 0})
        groups = split_decay(enc, r"blocks\.[02]\.", None)
        rec = train(
            enc, pairs, list(range(N)), SETTINGS, groups, on_checkpoint=checkpoint, progress=False, resume=resume
        )
        return rec, law, enc

    if stop_at is not None:
        with pytest.raises(_Stop):
            attempt(stop_at)
        assert (tmp_path / "state.pt").exists()
    return attempt(None)


def test_an_interrupted_run_resumes_to_the_same_result(tmp_path):
    rec, law, enc = _resumable_run(tmp_path / "once", None)
    rec2, law2, enc2 = _resumable_run(tmp_path / "twice", stop_at=2)
    assert not (tmp_path / "twice" / "state.pt").exists()  # removed once the run completed
    assert rec2.losses == rec.losses and rec2.trajectory == rec.trajectory
    np.testing.assert_array_equal(np.stack(rec2.window_norms), np.stack(rec.window_norms))
    assert law2.n == law.n == 4
    for col in ("D", "Q", "kappa"):
        np.testing.assert_array_equal(np.stack(law2.columns[col]), np.stack(law.columns[col]))
    for (n, p), (_, p2) in zip(enc.named_parameters(), enc2.named_parameters()):
        assert torch.equal(p, p2), n
    # the last save before the failed checkpoint 2: right after checkpoint 1
    assert [s["first_step"] for s in rec2.segments] == [0, SETTINGS.window_start + SETTINGS.probe_every + 1]
    assert rec2.loop_seconds >= rec2.seconds > 0


def test_resume_refuses_a_state_of_other_settings(tmp_path):
    enc, pairs = toy()
    groups = split_decay(enc, r"blocks\.2\.", None)
    resume = Resume(tmp_path / "s.pt", every=50, keep=True)
    train(enc, pairs, list(range(N)), SETTINGS, groups, progress=False, resume=resume)
    assert resume.path.exists()
    with pytest.raises(ValueError, match="settings"):
        train(enc, pairs, list(range(N)), replace(SETTINGS, lr=0.2), groups, progress=False, resume=resume)
    with pytest.raises(ValueError, match="identity"):
        train(
            enc,
            pairs,
            list(range(N)),
            SETTINGS,
            groups,
            progress=False,
            resume=Resume(tmp_path / "s.pt", identity={"data": 1}),
        )
    with pytest.raises(ValueError, match="every"):
        Resume(tmp_path / "x.pt", every=0)


def test_bootstrap_fit_brackets_the_estimate(rng):
    x = rng.lognormal(0, 1, 300)
    y = 2.0 * x**0.9 * rng.lognormal(0, 0.1, 300)
    fit = loglog_fit_ci(x, y, n_boot=500, seed=1)
    assert fit["slope"] == pytest.approx(loglog_fit(x, y)["slope"])
    lo, hi = fit["slope_ci95"]
    assert lo < fit["slope"] < hi and lo < 0.9 < hi and hi - lo < 0.1
    assert fit["pearson_r_ci95"][0] < fit["pearson_r"] < fit["pearson_r_ci95"][1] <= 1
    x[:5] = np.nan
    assert loglog_fit_ci(x, y, n_boot=50)["n_no_prediction"] == 5
    assert np.isnan(loglog_fit_ci(x[:7], y[:7], n_boot=50)["slope_ci95"]).all()
