"""The drift from the mean update direction over its own M_D batches (ProbeConfig.drift_batches).

Every estimate is checked against a float64 brute force that materializes each
displacement t_i^B of all M_D batches and averages; head mode against jvp mode;
the settings' validation, resume, and the directions-outer loop order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import functional_call, jvp

from normfast.core.reference import brute_force_drift, brute_force_stats
from normfast.data.batches import virtual_batches
from normfast.data.pairs import PairSource
from normfast.engine.directions.objectives import InfoNCE
from normfast.engine.probe import ProbeConfig, probe
from normfast.ops import drift_from_groups, head_stats, prepare_head
from tests._chunks import interrupted_at
from tests._models import tanh_mlp, vector_data

pytestmark = pytest.mark.usefixtures("single_thread")

DRIFT = ("D", "se_D", "sign_stability", "m2")


def rel(a, b):
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12)))


def _group_means(X, k):
    ids = torch.arange(X.shape[0]) % k
    return torch.stack([X[ids == g].mean(0) for g in range(k)]), [int((ids == g).sum()) for g in range(k)]


# ---------------------------------------------------------------------------
# the backend functions


@pytest.mark.parametrize("branch", ["u", "w"])
@pytest.mark.parametrize("m_d,k", [(23, 4), (16, 2), (9, 9)])
def test_drift_from_groups_equals_brute_force(gen, branch, m_d, k):
    n, d = 40, 7
    Z = torch.randn(n, d, generator=gen, dtype=torch.float64)
    T = 0.4 * torch.randn(n, d, generator=gen, dtype=torch.float64) + torch.randn(
        m_d, n, d, generator=gen, dtype=torch.float64
    )
    want = brute_force_drift(T, Z, k, branch)
    means, counts = _group_means(T, k)
    sfx = "" if branch == "u" else "_w"
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        got = drift_from_groups(means.to(dtype), Z.to(dtype), counts, branch=branch)
        assert got["D" + sfx].dtype == dtype and got["M"] == m_d
        for key in DRIFT:
            scale = torch.sqrt(want["m2" + sfx]) if key != "sign_stability" else 1.0
            err = ((got[key + sfx].double() - want[key + sfx]).abs() / scale).max()
            assert err <= tol, (key, dtype, float(err))
    # unequal groups: se_D is the unbiased weighted form, not sd(D_g)/sqrt(K)
    if m_d % k:
        equal = drift_from_groups(means, Z, None, branch=branch)
        assert not torch.allclose(equal["se_D" + sfx], want["se_D" + sfx])


@pytest.mark.parametrize("bias", [False, True])
def test_head_drift_from_group_means_equals_brute_force(gen, bias):
    n, d_in, d_out, m, m_d, k = 60, 9, 6, 5, 31, 4
    A = torch.randn(n, d_in, generator=gen, dtype=torch.float64)
    Z = torch.randn(n, d_out, generator=gen, dtype=torch.float64)
    G = 0.3 * torch.randn(d_out, d_in, generator=gen, dtype=torch.float64) + torch.randn(
        m_d, d_out, d_in, generator=gen, dtype=torch.float64
    )
    g = torch.randn(m_d, d_out, generator=gen, dtype=torch.float64) if bias else None
    T = -torch.einsum("bji,ni->bnj", G, A) - (0 if g is None else g[:, None, :])
    want = brute_force_drift(T, Z, k, "u")
    heat = brute_force_stats(T[:m], Z, "u")
    Gd, counts = _group_means(G, k)
    gd = None if g is None else _group_means(g, k)[0]
    for dtype, tol in ((torch.float64, 1e-11), (torch.float32, 2e-5)):

        def cast(x):
            return None if x is None else x.to(dtype)

        got = head_stats(
            cast(A),
            cast(Z),
            cast(G[:m]),
            cast(None if g is None else g[:m]),
            drift_means=cast(Gd),
            drift_bias=cast(gd),
            drift_counts=counts,
        )
        dirs = prepare_head(
            cast(G[:m]),
            cast(None if g is None else g[:m]),
            drift_means=cast(Gd),
            drift_bias=cast(gd),
            drift_counts=counts,
        )
        again = head_stats(cast(A), cast(Z), dirs, form="per_batch")  # the drift's groups in any form
        for res in (got, again):
            scale = torch.sqrt(want["m2"] + heat["V2"])
            for key in DRIFT:
                s = scale if key != "sign_stability" else 1.0
                assert ((res[key].double() - want[key]).abs() / s).max() <= tol, (key, dtype)
            assert rel(res["V2"], heat["V2"]) <= tol * 10
            assert rel(res["Q"], want["m2"] + heat["V2"]) <= tol * 10


def test_head_drift_argument_errors(gen):
    A, Z = torch.randn(4, 3, generator=gen), torch.randn(4, 2, generator=gen)
    G, g = torch.randn(5, 2, 3, generator=gen), torch.randn(5, 2, generator=gen)
    with pytest.raises(ValueError, match=r"drift_means of shape \[K, d_out, d_in\]"):
        head_stats(A, Z, G, drift_means=torch.randn(3, 3, 3))
    with pytest.raises(ValueError, match="K >= 2"):
        head_stats(A, Z, G, drift_means=torch.randn(1, 2, 3))
    with pytest.raises(ValueError, match="drift_bias"):
        head_stats(A, Z, G, g, drift_means=torch.randn(3, 2, 3))
    with pytest.raises(ValueError, match="drift_counts"):
        head_stats(A, Z, G, drift_means=torch.randn(3, 2, 3), drift_counts=[1, 0, 2])
    with pytest.raises(ValueError, match="expected at least 2 groups"):
        drift_from_groups(torch.randn(1, 4, 2), Z)


# ---------------------------------------------------------------------------
# the probe engine


def _mlp(dtype=torch.float64, seed=0):
    return tanh_mlp(dtype, seed)


def _toy(n_items=11, n_pairs=50, dtype=torch.float64, seed=1):
    return vector_data(n_items, n_pairs, dtype, seed)


def _materialize(enc, items, pairs, cfg, obj, adamw_eps=None):
    """Every t_B = -J p_B of all M_D batches, by autograd gradients and explicit per-batch jvps."""
    source = PairSource.from_iterable(pairs)
    seed = int(np.random.default_rng(cfg.seed).integers(2**31))
    batches = virtual_batches(len(source), cfg.drift_batches, cfg.batch_size, seed)
    params = {n: p.detach() for n, p in enc.named_parameters()}
    grads = []
    for idx in batches:
        a, b = source.batch(idx)
        live = dict(enc.named_parameters())
        loss = obj.loss(enc(enc.prepare(a)), enc(enc.prepare(b)))
        grads.append(dict(zip(live, torch.autograd.grad(loss, list(live.values())))))
    if adamw_eps is not None:  # v̂ = mean of ĝ² over all M_D batches, the same for every batch
        v = {n: torch.stack([g[n] for g in grads]).square().mean(0) for n in params}
        grads = [{n: g[n] / (v[n].sqrt() + adamw_eps) for n in params} for g in grads]
    state = enc.prepare(items)

    def f(p):
        return functional_call(enc, p, (state,))

    with torch.no_grad():
        Z = enc(state)
    T = torch.stack([-jvp(f, (params,), (g,))[1] for g in grads])
    return T, Z


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_probe_drift_matches_float64_brute_force(optimizer):
    enc = _mlp()
    items, pairs = _toy()
    obj = InfoNCE(0.2)
    cfg = ProbeConfig(
        params="all",
        mode="jvp",
        optimizer=optimizer,
        batches=5,
        drift_batches=23,
        groups=4,
        batch_size=8,
        chunk_size=4,
        seed=3,
        directions_per_pass=3,
        heat_sampling="uniform",  # the heat of the first M (drawn by energy: tests/engine/runner/test_heat_sampling.py)
    )
    res = probe(enc, items, obj, pairs, cfg, progress=False)
    T, Z = _materialize(enc, items, pairs, cfg, obj, adamw_eps=cfg.eps if optimizer == "adamw" else None)
    branch = "u" if optimizer == "sgd" else "w"
    sfx = "" if branch == "u" else "_w"
    want = brute_force_drift(T, Z, cfg.groups, branch)
    heat = brute_force_stats(T[: cfg.batches], Z, branch)
    for key in DRIFT:
        assert rel(res.column(key + sfx), want[key + sfx].numpy()) < 1e-9, key
    assert rel(res.column("V2" + sfx), heat["V2" + sfx].numpy()) < 1e-9
    assert rel(res.column("Q" + sfx), (want["m2" + sfx] + heat["V2" + sfx]).numpy()) < 1e-9
    assert res.metadata["M_D"] == 23 and res.metadata["groups"] == 4 and res.metadata["M"] == 5
    if optimizer == "adamw":
        return  # without M_D, AdamW's v̂ comes from the M batches alone: another estimate
    # the per-batch drift of the M heat batches stays available (without error bars: se_D per batch)
    old = probe(
        enc,
        items,
        obj,
        pairs,
        ProbeConfig(**{**cfg.__dict__, "drift_batches": None, "uncertainty": False}),
        progress=False,
    )
    assert rel(old.column("D" + sfx), heat["D" + sfx].numpy()) < 1e-9
    assert rel(old.column("se_D" + sfx), heat["se_D" + sfx].numpy()) < 1e-9
    assert old.metadata["M_D"] is None


def test_head_mode_equals_jvp_mode_with_the_mean_direction_drift():
    enc = _mlp(torch.float32)
    items, pairs = _toy(dtype=torch.float32)
    out = {}
    for mode in ("jvp", "head"):
        cfg = ProbeConfig(params="head", mode=mode, batches=5, drift_batches=30, groups=4, batch_size=8, chunk_size=5)
        out[mode] = probe(enc, items, InfoNCE(0.1), pairs, cfg, progress=False)
    for k in (*DRIFT, "V2", "Q", "kappa", "r_eq", "r_eq_heat"):
        assert rel(out["jvp"].column(k), out["head"].column(k)) < 1e-5, k


def test_directions_outer_order_with_the_drift_gives_the_same_table():
    enc = _mlp()
    items, pairs = _toy()
    base = dict(batches=6, drift_batches=20, groups=3, batch_size=8, chunk_size=4, directions_per_pass=2)
    for optimizer in ("sgd", "adamw"):
        a = probe(enc, items, InfoNCE(0.1), pairs, ProbeConfig(optimizer=optimizer, **base), progress=False)
        n_params = sum(p.numel() for p in enc.parameters())
        tiny = ProbeConfig(optimizer=optimizer, memory_budget_mb=2.5 * n_params * 4 * 2 / 2**20, **base)
        with pytest.warns(UserWarning, match="directions-outer"):
            b = probe(enc, items, InfoNCE(0.1), pairs, tiny, progress=False)
        for k in a.table.column_names:
            if a.table.schema.field(k).type in ("double",):
                assert rel(a.column(k), b.column(k)) < 1e-10, (optimizer, k)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(drift_batches=8), r"drift_batches \(M_D.*>= batches \(M=16\)"),
        (dict(drift_batches=-3), r"drift_batches"),
        (dict(drift_batches=True), r"drift_batches"),
        (dict(drift_batches=2.5e3), r"drift_batches"),
        (dict(target_rse=0.1, max_batches=300, drift_batches=256), r">= max_batches=300"),
        (dict(groups=1), r"groups \(K.*>= 2"),
    ],
)
def test_drift_settings_are_validated(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ProbeConfig(**kwargs).validate()
    ProbeConfig(drift_batches=0).validate()
    ProbeConfig(drift_batches=None).validate()


def test_resume_with_other_drift_batches_is_refused_naming_it(tmp_path):
    enc = _mlp(torch.float32)
    items, pairs = _toy(dtype=torch.float32, n_items=9)
    cfg = ProbeConfig(batches=4, drift_batches=12, groups=2, batch_size=8, chunk_size=3)
    out = tmp_path / "run.parquet"
    with interrupted_at(1), pytest.raises(KeyboardInterrupt):
        probe(enc, items, InfoNCE(0.1), pairs, cfg, out=out, progress=False)
    other = ProbeConfig(**{**cfg.__dict__, "drift_batches": 16})
    with pytest.raises(ValueError, match=r"config\.drift_batches 12 -> 16"):
        probe(enc, items, InfoNCE(0.1), pairs, other, out=out, resume=True, progress=False)
    done = probe(enc, items, InfoNCE(0.1), pairs, cfg, out=out, resume=True, progress=False)
    with pytest.raises(ValueError, match=r"finished run .*config\.drift_batches 12 -> 16"):
        probe(enc, items, InfoNCE(0.1), pairs, other, out=out, resume=True, progress=False)
    assert done.metadata["M_D"] == 12
