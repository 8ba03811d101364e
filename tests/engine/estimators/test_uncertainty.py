"""Error bars: the grouped estimators (head mode, GroupedAccumulator, the probe) against a float64
brute force of the same estimators, the stacked products against their reference, the jackknife
intervals of R_eq, the bare and per-batch forms, adaptive M, and the summary line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import t as student_t

from normfast.core.equilibrium import equilibrium_norm
from normfast.core.reference import brute_force_grouped, head_stack_reference
from normfast.engine.directions.objectives import InfoNCE
from normfast.engine.estimators.uncertainty import DEFAULT_GROUPS
from normfast.engine.probe import ProbeConfig, probe
from normfast.engine.transmission.head.products import head_products
from normfast.ops import GroupedAccumulator, head_stats, prepare_head
from tests._chunks import interrupted_at
from tests._models import tanh_mlp, vector_data

pytestmark = pytest.mark.usefixtures("single_thread")

GROUPED = ("D", "se_D", "sign_stability", "m2", "V2", "Q", "se_V2", "se_Q")


def _problem(gen, n, d_in, d_out, m, bias, dtype=torch.float64):
    A = torch.randn(n, d_in, generator=gen, dtype=dtype)
    Z = torch.randn(n, d_out, generator=gen, dtype=dtype) + 0.5
    G = 0.4 * torch.randn(d_out, d_in, generator=gen, dtype=dtype) + torch.randn(
        m, d_out, d_in, generator=gen, dtype=dtype
    )
    g = torch.randn(m, d_out, generator=gen, dtype=dtype) if bias else None
    return A, Z, G, g


def _T(A, G, g):
    T = -torch.einsum("bji,ni->bnj", G.double(), A.double())
    return T if g is None else T - g.double()[:, None, :]


def _max_rel(got, want, scale):
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    return float(((got - want).abs()[ok] / scale.expand_as(want)[ok]).max()) if ok.any() else 0.0


def _check(got, want, sfx, tol):
    scale_q = want["Q" + sfx].abs()
    for key in GROUPED:
        if key == "sign_stability":
            assert torch.allclose(got[key + sfx].double(), want[key + sfx], atol=1e-12), key
            continue
        scale = scale_q.sqrt() if key in ("D", "se_D") else scale_q
        assert _max_rel(got[key + sfx], want[key + sfx], scale) <= tol, key
    for key in ("D", "m2", "V2", "Q"):
        scale = scale_q.sqrt() if key == "D" else scale_q
        assert _max_rel(got["loo"][key + sfx], want["loo"][key + sfx], scale[:, None]) <= tol, ("loo", key)


# ---------------------------------------------------------------------------
# the stacked products (the contract with the kernel)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "n,d_in,d_out,k1,k2", [(1, 1, 1, 1, 0), (37, 5, 3, 4, 4), (301, 17, 6, 1, 1), (64, 24, 32, 9, 5)]
)
def test_head_products_match_the_reference(gen, bias, n, d_in, d_out, k1, k2):
    A = torch.randn(n, d_in, generator=gen, dtype=torch.float64)
    Z = torch.randn(n, d_out, generator=gen, dtype=torch.float64)
    da = d_in + int(bias)
    G = torch.randn(k1, d_out, da, generator=gen, dtype=torch.float64)
    S = torch.randn(k2, da, da, generator=gen, dtype=torch.float64)
    S = S + S.transpose(1, 2)
    want = head_stack_reference(A, Z, G, S, has_bias=bias)
    got = head_products(A, Z, G, S if k2 else None, bias)
    for key in ("zdot", "sq", "quad", "norm"):
        assert got[key].shape == want[key].shape
        torch.testing.assert_close(got[key], want[key], rtol=1e-12, atol=1e-12)
    got32 = head_products(A.float(), Z.float(), G.float(), S.float() if k2 else None, bias)
    for key in ("zdot", "sq", "quad"):
        if want[key].numel() == 0:
            assert got32[key].shape == want[key].shape
            continue
        scale = want[key].abs().max().clamp_min(1e-30)
        assert float((got32[key].double() - want[key]).abs().max() / scale) < 1e-5


# ---------------------------------------------------------------------------
# head mode, grouped


@pytest.mark.parametrize("branch", ["u", "w"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "n,d_in,d_out,m,groups", [(50, 7, 5, 16, 4), (33, 4, 9, 10, 4), (20, 3, 2, 3, 4), (40, 12, 6, 8, 2)]
)
def test_grouped_head_stats_equal_brute_force(gen, branch, bias, n, d_in, d_out, m, groups):
    A, Z, G, g = _problem(gen, n, d_in, d_out, m, bias)
    k = min(groups, m)  # K is capped at M: then every batch is its own group
    want = brute_force_grouped(_T(A, G, g), Z, k, branch)
    sfx = "" if branch == "u" else "_w"
    got = head_stats(A, Z, G, g, branch=branch, groups=groups)
    assert got["groups"] == k and got["loo"]["V2" + sfx].shape == (n, k)
    _check(got, want, sfx, 1e-10)
    f32 = head_stats(A.float(), Z.float(), G.float(), None if g is None else g.float(), branch=branch, groups=groups)
    _check(f32, want, sfx, 2e-4)


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_head_stats_with_the_drift_from_its_own_batches(gen, bias):
    n, d_in, d_out, m, m_d, k = 45, 6, 4, 9, 41, 4
    A, Z, G, g = _problem(gen, n, d_in, d_out, m_d, bias)
    T = _T(A, G, g)
    want = brute_force_grouped(T[:m], Z, k, "u", T_drift=T)
    ids = torch.arange(m_d) % k
    Gd = torch.stack([G[ids == j].mean(0) for j in range(k)])
    gd = None if g is None else torch.stack([g[ids == j].mean(0) for j in range(k)])
    counts = [int((ids == j).sum()) for j in range(k)]
    dirs = prepare_head(
        G[:m], None if g is None else g[:m], drift_means=Gd, drift_bias=gd, drift_counts=counts, groups=k
    )
    got = head_stats(A, Z, dirs)
    _check(got, want, "", 1e-10)


def test_bare_and_per_batch_forms_keep_their_meaning(gen):
    A, Z, G, g = _problem(gen, 30, 6, 5, 12, True)
    grouped = head_stats(A, Z, G, g)
    bare = head_stats(A, Z, G, g, uncertainty=False)
    per_batch = head_stats(A, Z, G, g, radial_spread=True)
    for res in (bare, per_batch):
        assert torch.isnan(res["se_V2"]).all() and torch.isnan(res["se_Q"]).all() and "loo" not in res
        assert res["groups"] == 0
        for key in ("D", "m2", "V2", "Q"):
            torch.testing.assert_close(res[key], grouped[key], rtol=1e-12, atol=1e-12)
    assert torch.isnan(bare["se_D"]).all() and torch.isfinite(per_batch["se_D"]).all()


# ---------------------------------------------------------------------------
# jvp mode: the grouped accumulator


@pytest.mark.parametrize("branch", ["u", "w", "uw"])
def test_grouped_accumulator_equals_brute_force_in_any_order(gen, branch):
    n, d, m, k = 23, 6, 11, 4
    T = 0.3 * torch.randn(n, d, generator=gen, dtype=torch.float64) + torch.randn(
        m, n, d, generator=gen, dtype=torch.float64
    )
    T_w = torch.randn(m, n, d, generator=gen, dtype=torch.float64) if branch == "uw" else None
    Z = torch.randn(n, d, generator=gen, dtype=torch.float64) + 0.5
    acc = GroupedAccumulator(n, d, groups=k, branch=branch, dtype=torch.float64)
    for lo, hi in ((5, 9), (0, 5), (9, 11)):  # out of order: the group follows the global batch index
        acc.update(T[lo:hi], Z, t_w=None if T_w is None else T_w[lo:hi], first_batch=lo)
    got = acc.finalize()
    assert acc.counts == [3, 3, 3, 2] and got["groups"] == k
    if branch in ("u", "w"):
        _check(got, brute_force_grouped(T, Z, k, branch), "" if branch == "u" else "_w", 1e-10)
        return
    _check(got, brute_force_grouped(T, Z, k, "u"), "", 1e-10)
    _check(got, brute_force_grouped(T_w, Z, k, "w"), "_w", 1e-10)
    ids = torch.arange(m) % k
    norm = Z.norm(dim=1)
    cross = torch.stack([((T[ids != j] * norm[None, :, None]) * T_w[ids != j]).sum(-1).mean(0) for j in range(k)], 1)
    torch.testing.assert_close(got["loo"]["C_uw"], cross, rtol=1e-10, atol=1e-12)


def test_grouped_accumulator_errors(gen):
    with pytest.raises(ValueError, match="groups"):
        GroupedAccumulator(3, 2, groups=1)
    acc = GroupedAccumulator(3, 2, groups=4, dtype=torch.float64)
    acc.update(torch.randn(3, 3, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64))
    with pytest.raises(
        ValueError, match=r"at least one direction in each of the K=4 groups, got counts=\[1, 1, 1, 0\]"
    ):
        acc.finalize()


# ---------------------------------------------------------------------------
# the probe: head == jvp, the intervals of R_eq


def _mlp(dtype=torch.float64):
    return tanh_mlp(dtype)


def _toy(n_items=12, n_pairs=60, dtype=torch.float64, seed=1):
    return vector_data(n_items, n_pairs, dtype, seed)


@pytest.mark.parametrize("drift_batches", [None, 30])
def test_probe_error_bars_head_equals_jvp_and_intervals_are_the_jackknife(drift_batches):
    enc = _mlp()
    items, pairs = _toy()
    out = {}
    for mode in ("jvp", "head"):
        cfg = ProbeConfig(
            params="head",
            mode=mode,
            batches=10,
            drift_batches=drift_batches,
            groups=4,
            batch_size=8,
            chunk_size=5,
            lr=0.05,
            weight_decay=0.01,
            heat_sampling="uniform",  # the plain draw: the independent jackknife below takes the first M batches
        )
        out[mode] = probe(enc, items, InfoNCE(0.1), pairs, cfg, progress=False)
    cols = (*GROUPED, "r_eq", "r_eq_heat", "r_eq_lo", "r_eq_hi", "r_eq_heat_lo", "r_eq_heat_hi")
    for c in cols:
        np.testing.assert_allclose(out["jvp"].column(c), out["head"].column(c), rtol=1e-9, err_msg=c)
    res = out["head"]
    assert res.metadata["groups"] == 4 and res.metadata["uncertainty"] is True
    # the interval from an independent jackknife of the leave-one-group-out statistics
    stats = head_stats(*_head_inputs(enc, items), *_head_dirs(enc, items, pairs, cfg), groups=cfg.groups)
    kap = res.column("kappa")
    loo_r = np.stack(
        [
            equilibrium_norm(
                stats["loo"]["D"][:, j].numpy(), stats["loo"]["Q"][:, j].numpy(), kap, lr=0.05, weight_decay=0.01
            )
            for j in range(4)
        ],
        1,
    )
    se = np.sqrt(((loo_r - loo_r.mean(1, keepdims=True)) ** 2).sum(1) * 3 / 4)
    half = student_t.ppf(0.975, 3) * se
    np.testing.assert_allclose(res.column("r_eq_hi"), res.column("r_eq") + half, rtol=1e-9)
    np.testing.assert_allclose(res.column("r_eq_lo"), np.maximum(res.column("r_eq") - half, 0), rtol=1e-9)
    assert np.all(res.column("r_eq_lo") <= res.column("r_eq")) and np.all(res.column("r_eq") <= res.column("r_eq_hi"))
    # without error bars the columns stay, as NaN
    bare = probe(enc, items, InfoNCE(0.1), pairs, ProbeConfig(**{**cfg.__dict__, "uncertainty": False}), progress=False)
    assert np.isnan(bare.column("se_V2")).all() and np.isnan(bare.column("r_eq_lo")).all()
    np.testing.assert_allclose(bare.column("V2"), res.column("V2"), rtol=1e-12)


def _head_inputs(enc, items):
    with torch.no_grad():
        state = enc.prepare(items)
        a = enc(state, 0, output="pre_head")
        return a, enc(state)


def _head_dirs(enc, items, pairs, cfg):
    """The run's head directions, recomputed with the library's own direction code."""
    from normfast.data.batches import virtual_batches
    from normfast.data.pairs import PairSource
    from normfast.engine.directions.gradients import compute_directions
    from normfast.engine.directions.presets import OptimizerPreset

    source = PairSource.from_iterable(pairs)
    seed = int(np.random.default_rng(cfg.seed).integers(2**31))
    batches = virtual_batches(len(source), cfg.total_batches, cfg.batch_size, seed)
    names = list(enc.head().parameter_names)
    presets = {n: OptimizerPreset("sgd", cfg.lr, cfg.weight_decay) for n in names}
    dirs = compute_directions(
        enc,
        InfoNCE(0.1),
        source,
        names,
        presets,
        batches,
        keep=cfg.batches,
        drift_groups=4 if cfg.drift_from_mean else 0,
        progress=False,
    )
    G = torch.stack([d["blocks.2.weight"] for d in dirs.directions])
    g = torch.stack([d["blocks.2.bias"] for d in dirs.directions])
    if dirs.drift is None:
        return G, g
    drift = dict(
        drift_means=torch.stack([m["blocks.2.weight"] for m in dirs.drift.means]),
        drift_bias=torch.stack([m["blocks.2.bias"] for m in dirs.drift.means]),
        drift_counts=dirs.drift.counts,
    )
    return (prepare_head(G, g, groups=4, **drift),)


# ---------------------------------------------------------------------------
# adaptive M


def test_adaptive_M_is_deterministic_and_resumable(tmp_path):
    enc = _mlp(torch.float32)
    items, pairs = _toy(n_items=20, n_pairs=200, dtype=torch.float32)
    cfg = ProbeConfig(
        params="head",
        mode="jvp",
        batches=8,
        groups=4,
        drift_batches=48,
        batch_size=8,
        chunk_size=10,
        target_rse=0.2,  # the heat drawn by energy reaches 0.25 at the first M already
        max_batches=48,
    )
    a = probe(enc, items, InfoNCE(0.1), pairs, cfg, progress=False)
    rounds = a.metadata["adaptive"]["rounds"]
    assert rounds[0]["M"] == 8 and a.metadata["M"] == rounds[-1]["M"] > 8
    assert all(r["M"] % 4 == 0 for r in rounds) and [r["M"] for r in rounds] == sorted(r["M"] for r in rounds)
    assert a.metadata["adaptive"]["reached"] == (rounds[-1]["quantile_rse"] <= 0.2)
    assert a.metadata["adaptive"]["reached"] or a.metadata["M"] == 48
    assert all(r["quantile_rse"] > 0.2 for r in rounds[:-1])
    # the pilot's figure is the first chunk's: recomputed from the table
    first = np.arange(len(a)) < 10
    # (the table's se_V2 also holds the heat pool's own level error, which more heat batches cannot reduce:
    # adaptive M measures the batches' part)
    pool = a.metadata["heat_sampling"]["pool_level_se"]
    rse = np.sqrt((a.column("se_V2")[first] / a.column("V2")[first]) ** 2 - pool**2)
    assert np.quantile(rse, 0.9) == pytest.approx(rounds[-1]["quantile_rse"], rel=1e-6)
    head = probe(enc, items, InfoNCE(0.1), pairs, ProbeConfig(**{**cfg.__dict__, "mode": "head"}), progress=False)
    assert head.metadata["M"] == a.metadata["M"]
    np.testing.assert_allclose(head.column("se_V2"), a.column("se_V2"), rtol=1e-4)
    # an interrupted adaptive run resumes to the same table
    out = tmp_path / "adaptive.parquet"
    with interrupted_at(1), pytest.raises(KeyboardInterrupt):
        probe(enc, items, InfoNCE(0.1), pairs, cfg, out=out, progress=False)
    resumed = probe(enc, items, InfoNCE(0.1), pairs, cfg, out=out, resume=True, progress=False)
    assert resumed.table.replace_schema_metadata(None).equals(a.table.replace_schema_metadata(None))
    assert resumed.metadata["M"] == a.metadata["M"]
    # the directions-outer order picks the same M and the same table
    n_head = sum(enc.get_parameter(n).numel() for n in enc.head().parameter_names)
    tiny = ProbeConfig(**{**cfg.__dict__, "memory_budget_mb": 10 * n_head * 4 * 2 / 2**20})  # 10 directions fit
    with pytest.warns(UserWarning, match="directions-outer"):
        outer = probe(enc, items, InfoNCE(0.1), pairs, tiny, progress=False)
    assert outer.metadata["M"] == a.metadata["M"]
    np.testing.assert_allclose(outer.column("se_V2"), a.column("se_V2"), rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(target_rse=0.0), r"target_rse"),
        (dict(target_rse=0.1, max_batches=8), r"max_batches must be an integer >= batches \(M=16\)"),
        (dict(target_rse=0.1, target_quantile=1.5), r"target_quantile"),
        (dict(target_rse=0.1, uncertainty=False), r"target_rse needs the grouped error bars"),
    ],
)
def test_adaptive_settings_are_validated(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ProbeConfig(**kwargs).validate()


def test_summary_reports_the_resolution():
    enc = _mlp(torch.float32)
    items, pairs = _toy(dtype=torch.float32)
    res = probe(
        enc,
        items,
        InfoNCE(0.1),
        pairs,
        ProbeConfig(params="head", batches=8, drift_batches=16, batch_size=8),
        progress=False,
    )
    text = res.format_summary()
    s = res.summary()
    assert f"V2 resolved to ±20% (95% interval): {s['heat_resolved_fraction']:.0%} of rows" in text
    k = res.metadata["groups"]
    # the default head-mode run is the grouped form: K groups, error bars on every row
    assert res.metadata["mode"] == "head" and res.metadata["uncertainty"] is True
    assert k == min(DEFAULT_GROUPS, 8) and f"t with {k - 1} dof" in text
    assert np.isfinite(res.column("se_V2")).all() and np.isfinite(res.column("r_eq_hi")).any()
    half = student_t.ppf(0.975, k - 1) * res.column("se_V2") / res.column("V2")
    assert s["heat_resolved_fraction"] == pytest.approx(np.mean(half <= 0.2))


def test_t_quantile_is_scipy_stats_t():
    from normfast.engine.estimators.uncertainty import t_quantile

    for dof in (1, 2, 3, 7, 15, 63, 1023):
        assert t_quantile(dof) == student_t.ppf(0.975, dof)
        assert t_quantile(dof, 0.9) == student_t.ppf(0.95, dof)
    assert t_quantile(3) == pytest.approx(3.182, abs=5e-4)
    assert np.isnan(t_quantile(0))
