"""The single-snapshot predictor as a probe output (``ProbeConfig(snapshot=True)``, ``--snapshot``):
its shrinkage and step rule, its columns and metadata, its independence of chunking, the caller's
model untouched, and its prediction on a small model trained to stationary norms."""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch

from normfast.core.stats import loglog_fit
from normfast.data.schema import check_metadata, check_table
from normfast.engine.config import ProbeConfig
from normfast.engine.trajectory.snapshot import shrink, snapshot_prediction, trajectory_steps

pytestmark = pytest.mark.usefixtures("single_thread")


# ---------------------------------------------------------------------------
# the pieces


def test_shrink_keeps_resolved_means_and_drops_noise(rng):
    """Blocks that agree (no error between the halves) keep their means; blocks that are pure noise
    around the prior go to the prior; in between, the weight is τ²/(τ²+σ²)."""
    prior = np.zeros(200)
    signal = rng.normal(size=200)
    same, info = shrink(np.tile(signal, (4, 1)), prior)
    np.testing.assert_allclose(same, signal)
    assert info["weight"] == pytest.approx(1.0)
    # first half +e, second half -e: the means equal the prior, the halves differ by 2e
    e = rng.normal(size=200)
    noise, info = shrink(np.stack([e, e, -e, -e]), prior)
    np.testing.assert_allclose(noise, prior)
    assert info["weight"] == 0.0
    mixed, info = shrink(np.stack([signal + e, signal + e, signal - e, signal - e]), prior)
    w = np.mean(signal**2 - 0) - np.mean(e**2)  # signal variance estimate: spread - error
    assert info["weight"] == pytest.approx(max(w, 0) / (max(w, 0) + np.mean(e**2)))
    np.testing.assert_allclose(mixed, info["weight"] * signal)


def test_trajectory_steps_follow_the_relaxation_rule():
    """T = 4 relaxation times 1/(2η'λκ̃), clipped to [min, max]; heavy-ball shortens it by (1−β)."""
    kappa = np.array([0.5, 1.0, 1.5])  # median 1
    cfg = ProbeConfig(lr=0.1, weight_decay=0.01)  # τ = 1/(2·0.1·0.01) = 500 steps
    assert trajectory_steps(cfg, kappa) == (2000, pytest.approx(4.0))
    assert trajectory_steps(replace(cfg, momentum=0.5), kappa)[0] == 1000
    assert trajectory_steps(replace(cfg, snapshot_max_steps=800), kappa) == (800, pytest.approx(1.6))
    assert trajectory_steps(replace(cfg, lr=10.0), kappa)[0] == 500  # the floor
    assert trajectory_steps(replace(cfg, snapshot_steps=100), kappa) == (100, pytest.approx(0.2))
    with pytest.raises(ValueError, match="no radial grip"):
        trajectory_steps(cfg, np.array([-0.1, 0.0, 0.05]) - 0.1)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(snapshot=True, output="tokens"), "output='pooled'"),
        (dict(snapshot=True, optimizer={"a": "sgd", "b": "adamw"}), "one optimizer preset"),
        (dict(snapshot_steps=10), "snapshot_steps must be"),
        (dict(snapshot_min_steps=600, snapshot_max_steps=500), "snapshot_max_steps"),
        (dict(snapshot_relaxations=0), "snapshot_relaxations"),
    ],
)
def test_snapshot_settings_are_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        ProbeConfig(**kw).validate()


# ---------------------------------------------------------------------------
# on a model trained to stationary norms (E1's MLP at a toy size)


@pytest.fixture(scope="module")
def trained():
    from bench.experiments.e1.data import VARIANT_SPECS, make_concepts
    from bench.experiments.e1.training import train
    from tests._models import e1_toy

    cfg = e1_toy(steps=1500, window=0.4, record_every=10, probe_every=250)
    data = make_concepts(cfg)
    torch.manual_seed(0)
    return cfg, data, train(VARIANT_SPECS["mlp"], cfg, data, progress=False)


def _setup(trained, **kw):
    from bench.experiments.e1.data import VARIANT_SPECS, probe_config
    from bench.experiments.e1.training import load_checkpoint
    from normfast.data.pairs import PairSource
    from normfast.engine.directions.objectives import InfoNCE

    cfg, data, run = trained
    load_checkpoint(run.encoder, run.checkpoints[-1])
    n = data.x.shape[0]
    pairs = PairSource.from_iterable([(int(a), int(b)) for a, b in data.pairs])
    pcfg = replace(
        probe_config(VARIANT_SPECS["mlp"], cfg, n, batches=4, drift_batches=8),
        radial_spread=False,
        snapshot=True,
        seed=3,
        **kw,
    )
    return run.encoder, list(range(n)), InfoNCE(temperature=cfg.temperature), pairs, pcfg


def _probe(*args, **kw):
    from normfast.engine.probe import probe

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return probe(*args, progress=False, **kw)


def test_probe_writes_the_snapshot_columns_and_leaves_the_model_alone(trained, tmp_path):
    enc, items, objective, pairs, pcfg = _setup(trained)
    before = {k: p.detach().clone() for k, p in enc.named_parameters()}
    res = _probe(enc, items, objective, pairs, pcfg, out=tmp_path / "run.parquet")
    for k, p in enc.named_parameters():
        assert torch.equal(p, before[k]), k
    assert check_table(res.table.schema) == [] and check_metadata(res.metadata) == []
    snap = res.metadata["snapshot"]
    # T by the rule: 4 relaxation times of R² at the median κ, at least 500 steps
    tau = 1 / (2 * pcfg.lr * pcfg.weight_decay * snap["kappa_median_at_snapshot"])
    assert snap["steps"] == max(500, round(4 * tau)) and snap["relaxations_covered"] >= 4 - 1e-9
    direct = snapshot_prediction(enc, items, objective, pairs, pcfg, progress=False)
    np.testing.assert_array_equal(res.column("r_eq_snapshot"), direct.r_eq)
    np.testing.assert_array_equal(res.column("D_snapshot"), direct.D)
    np.testing.assert_array_equal(res.column("Q_snapshot"), direct.Q)
    # the plain-SGD law solved with the columns it reports (κ from the trajectory) gives the column
    d, q, k, lam, eta = direct.D, direct.Q, direct.kappa, pcfg.weight_decay, pcfg.lr
    r2 = (d + np.sqrt(d**2 + 2 * lam * k * eta * q)) / (2 * lam * k)
    np.testing.assert_allclose(direct.r_eq, np.sqrt(r2), rtol=1e-9)
    # it predicts the window-mean norm the items kept during training, to E1's target, at a toy size
    fit = loglog_fit(direct.r_eq, trained[2].observed)
    assert 0.85 <= fit["slope"] <= 1.15 and fit["pearson_r"] >= 0.93, fit  # E1's target (measured 0.98 / 0.99)
    # and the summary says what it is
    text = res.format_summary()
    assert "single-snapshot predictor r_eq_snapshot" in text and "not a reading of its present norm" in text


def test_snapshot_column_does_not_depend_on_chunking(trained):
    enc, items, objective, pairs, pcfg = _setup(trained, snapshot_steps=60)
    whole = _probe(enc, items, objective, pairs, pcfg)
    chunked = _probe(enc, items, objective, pairs, replace(pcfg, chunk_size=5))
    np.testing.assert_array_equal(whole.column("r_eq_snapshot"), chunked.column("r_eq_snapshot"))
    np.testing.assert_array_equal(whole.column("norm_continued"), chunked.column("norm_continued"))
    assert whole.metadata["snapshot"]["steps"] == 60
    plain = _probe(enc, items, objective, pairs, replace(pcfg, snapshot=False))
    assert "r_eq_snapshot" not in plain.column_names and "snapshot" not in plain.metadata
    np.testing.assert_array_equal(plain.column("r_eq"), whole.column("r_eq"))


class _Norms:
    """What ``virtual_trajectory``'s ``measure`` returns: the present norms of the items."""

    column_names = ["norm"]

    def __init__(self, model, items):
        with torch.no_grad():
            self.norm = model(model.prepare(items)).double().norm(dim=-1).numpy()

    def column(self, name):
        return self.norm


def test_norm_continued_is_the_rms_norm_of_the_continuation(trained):
    """Brute force: the same continuation replayed with the norms read at every state it measured
    (the snapshot, then the state after each step but the last), sqrt of their mean square."""
    from normfast.engine.trajectory.virtual import virtual_trajectory

    enc, items, objective, pairs, pcfg = _setup(trained, snapshot_steps=60)
    res = _probe(enc, items, objective, pairs, pcfg)
    replay = virtual_trajectory(
        enc,
        items,
        objective,
        pairs,
        pcfg,
        steps=60,
        points=60,
        meter=False,
        measure=lambda m, step, v: _Norms(m, items),
        columns=("norm",),
        progress=False,
    )
    states = np.vstack([_Norms(enc, items).norm[None], replay.columns["norm"][:-1]])
    assert states.shape == (60, len(items))
    want = np.sqrt((states**2).mean(0))
    np.testing.assert_allclose(res.column("norm_continued"), want, rtol=1e-5)
    assert not np.allclose(want, states[0], rtol=1e-3)  # the continuation moved: not the present norm
    # its interval: 60 steps = two segments (steps 1-25 and 26-60), each left out in turn
    # (jackknife se of two replicates: half their difference; t_0.975 at 1 degree of freedom: 12.706)
    half = 12.706 * np.abs(np.log((states[25:] ** 2).mean(0)) - np.log((states[:25] ** 2).mean(0))) / 4
    np.testing.assert_allclose(res.column("norm_continued_lo"), want * np.exp(-half), rtol=1e-4)
    np.testing.assert_allclose(res.column("norm_continued_hi"), want * np.exp(half), rtol=1e-4)
    snap, lo, hi = (res.column(c) for c in ("r_eq_snapshot", "r_eq_snapshot_lo", "r_eq_snapshot_hi"))
    ok = np.isfinite(snap)
    assert ok.sum() >= len(items) // 2 and np.all((lo[ok] < snap[ok]) & (snap[ok] < hi[ok]))
    assert res.metadata["snapshot"]["interval_segments"] == 2
    text = res.format_summary()
    assert "95% interval from the continuation's 2 segments: median ±" in text
    assert "norm_continued (the continuation's own mean norm, the plain baseline)" in text
    assert "The law predicts no better than simulating" in text


def test_cli_snapshot_flag(tmp_path, tiny_bert_folder, capsys):
    """``normfast probe --snapshot-steps T`` on a local BERT: the column, the summary's paragraph; with
    --tokens the flag is refused with the reason."""
    import pyarrow.parquet as pq

    from normfast.cli import main

    words = tmp_path / "words.txt"
    words.write_text("apple\nriver\nthe\ndemocracy\nblue\nquantum\n")
    out = tmp_path / "run.parquet"
    args = [
        "probe",
        str(tiny_bert_folder),
        "--probes",
        str(words),
        "--params",
        r"encoder\.layer\.1\.",
        "--batches",
        "3",
        "--drift-batches",
        "6",
        "--groups",
        "3",
        "--batch-size",
        "3",
        "--lr",
        "0.05",
        "--wd",
        "0.1",
        "--snapshot-steps",
        "50",
        "--no-progress",
    ]
    rc = main([*args, "--out", str(out)])
    text = capsys.readouterr()
    assert rc == 0, text.err
    assert "single-snapshot predictor r_eq_snapshot (50 virtual steps" in text.out
    assert "r_eq_snapshot" in pq.read_schema(out).names
    assert main([*args, "--tokens", "--out", str(tmp_path / "tokens.parquet")]) == 2
    assert "snapshot=True needs output='pooled'" in capsys.readouterr().err


def test_meter_jackknife_replicates_are_the_statistics_without_their_segment(trained):
    """Each replicate equals a second meter fed every sample but that segment's (directions at one
    state, so the samples are known), its drift blocks included; the last segment takes the rest."""
    from normfast.engine.trajectory.virtual import TrajectoryMeter

    enc, items, _, _, pcfg = _setup(trained)
    gen = torch.Generator().manual_seed(5)
    dirs = [
        {n: torch.randn(p.shape, generator=gen, dtype=p.dtype) for n, p in enc.named_parameters()} for _ in range(110)
    ]
    whole = TrajectoryMeter(enc, items, pcfg, block=5, segment=30, n_segments=3)
    for i, d in enumerate(dirs):
        whole.add(d, kappa=i % 4 == 0)
    stats = whole.statistics()
    bounds = [(0, 30), (30, 60), (60, 110)]  # 30-step segments, the last with the 20 left over
    assert len(stats["jackknife"]) == 3
    for (a, b), rep in zip(bounds, stats["jackknife"]):
        part = TrajectoryMeter(enc, items, pcfg, block=5)
        for i, d in enumerate(dirs):
            if not a <= i < b:
                part.add(d, kappa=i % 4 == 0)
        want = part.statistics()
        assert rep["n"] == want["n"] == 110 - (b - a)
        for k in ("D", "Q", "norm", "norm_rms", "kappa", "D_blocks", "se_D"):
            np.testing.assert_allclose(rep[k], want[k], rtol=1e-9, err_msg=k)
