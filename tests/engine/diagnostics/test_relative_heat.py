"""The heat's two parts (normfast.engine.diagnostics.relative_heat): the relative heat's jackknife against a
brute-force recomputation without each group, the columns a probe writes across chunks, and the
common factor as what moves when only the seed changes."""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

import normfast
from normfast.engine.diagnostics.relative_heat import (
    heat_reference,
    ranking_resolution,
    relative_heat,
    with_relative_heat,
)
from normfast.engine.estimators.grouped import GroupedAccumulator

pytestmark = pytest.mark.usefixtures("single_thread")


def _brute_force(T: torch.Tensor, Z: torch.Tensor, k: int, used: np.ndarray) -> dict[str, np.ndarray]:
    """Relative heat and its jackknife straight from the definitions: for every group g, V2 recomputed
    from the batches outside g (x = R t), the reference as the median of its log over the used rows,
    and the delete-a-group jackknife of log V2_{i,-g} - ref_{-g} written out as a loop."""
    T, Z = T.double(), Z.double()
    R = torch.linalg.vector_norm(Z, dim=1)
    X = (T * R[None, :, None]).numpy()
    m, n, _ = X.shape
    ids = np.arange(m) % k
    v2 = ((X - X.mean(0)) ** 2).sum((0, 2)) / (m - 1)
    ref = np.median(np.log(v2[used]))
    rel_g, ref_g = np.zeros((n, k)), np.zeros(k)
    for g in range(k):
        h = X[ids != g]
        v2_g = ((h - h.mean(0)) ** 2).sum((0, 2)) / (h.shape[0] - 1)
        ref_g[g] = np.median(np.log(v2_g[used]))
        rel_g[:, g] = np.log(v2_g) - ref_g[g]
    se = np.zeros(n)
    for i in range(n):
        mean = rel_g[i].mean()
        se[i] = np.sqrt((k - 1) / k * sum((rel_g[i, g] - mean) ** 2 for g in range(k)))
    level_se = np.sqrt((k - 1) / k * ((ref_g - ref_g.mean()) ** 2).sum())
    return {
        "heat_rel": np.log(v2) - ref,
        "se_heat_rel": se,
        "log_level": ref,
        "se_log_level": level_se,
        "loo_levels": ref_g,
    }


@pytest.mark.parametrize("n,d,m,k", [(23, 5, 16, 4), (9, 3, 11, 8), (40, 7, 24, 3)])
def test_the_relative_heat_jackknife_equals_a_brute_force_recomputation(gen, n, d, m, k):
    T = torch.randn(m, n, d, generator=gen, dtype=torch.float64) * (
        1 + torch.rand(n, 1, generator=gen, dtype=torch.float64)
    )
    Z = torch.randn(n, d, generator=gen, dtype=torch.float64) + 0.5
    acc = GroupedAccumulator(n, d, groups=k, dtype=torch.float64).update(T, Z, first_batch=0)
    stats = acc.finalize()
    special = np.zeros(n, bool)
    special[::4] = True  # left out of the reference, still given a relative heat
    valid = np.ones(n, bool)
    valid[1] = False  # likewise
    want = _brute_force(T, Z, k, valid & ~special)
    loo = stats["loo"]["V2"].numpy()
    offsets = pa.array(np.arange(0, n * k + 1, k, dtype=np.int32))
    table = pa.table(
        {
            "valid": valid,
            "is_special": special,
            "V2": stats["V2"].numpy(),
            "heat_loo": pa.ListArray.from_arrays(offsets, pa.array(loo.reshape(-1))),
        }
    )
    # the reference from two pieces (the chunks of a run), the rows from the whole table
    ref = heat_reference([table.slice(0, n // 2), table.slice(n // 2)])
    assert ref["rows"] == int((valid & ~special).sum())
    np.testing.assert_allclose(ref["log_level"], want["log_level"], rtol=1e-12)
    np.testing.assert_allclose(ref["loo_log_levels"], want["loo_levels"], rtol=1e-12)
    np.testing.assert_allclose(ref["se_log_level"], want["se_log_level"], rtol=1e-10)
    out = with_relative_heat(table, ref)
    np.testing.assert_allclose(out.column("heat_rel").to_numpy(), want["heat_rel"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out.column("se_heat_rel").to_numpy(), want["se_heat_rel"], rtol=1e-9)
    # the common factor cancels: scaling every row's heat (and every replicate) by one factor per
    # replicate changes the level and its error, never a relative heat or its error
    factors = np.exp(np.linspace(-0.5, 0.7, k))
    scaled = table.set_column(3, "heat_loo", pa.ListArray.from_arrays(offsets, pa.array((loo * factors).reshape(-1))))
    ref_s = heat_reference([scaled])
    assert ref_s["se_log_level"] > ref["se_log_level"] + 0.1
    rel_s, se_s = relative_heat(stats["V2"].numpy(), loo * factors, ref_s)
    np.testing.assert_allclose(se_s, want["se_heat_rel"], rtol=1e-9)
    np.testing.assert_allclose(rel_s, want["heat_rel"], rtol=1e-10, atol=1e-12)


def test_without_error_bars_the_relative_heat_has_no_standard_error():
    table = pa.table({"valid": [True, True, True], "is_special": [False, False, True], "V2": [1.0, 4.0, 100.0]})
    ref = heat_reference([table])
    assert ref["rows"] == 2 and np.isclose(ref["log_level"], np.log(2.0)) and np.isnan(ref["se_log_level"])
    out = with_relative_heat(table, ref)
    np.testing.assert_allclose(out.column("heat_rel").to_numpy(), np.log([0.5, 2.0, 50.0]))
    assert np.isnan(out.column("se_heat_rel").to_numpy()).all()
    res = ranking_resolution(out.column("se_heat_rel").to_numpy(), ref, 8)
    assert np.isnan(res["rank_resolved_fraction"]) and np.isnan(res["level_half_width"])


# ---------------------------------------------------------------------------
# a probe: the columns across chunks, and the common factor across seeds


def _common_factor_problem():
    """A linear head whose inputs share one large component: the batch sample moves every row's
    heat by nearly the same factor (the situation of a real encoder's rows)."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(8, generator=g)
    feats = base + 0.3 * torch.randn(360, 8, generator=g)
    torch.manual_seed(0)
    enc = normfast.ModuleEncoder([nn.Linear(8, 6)], collate=lambda ids: feats[torch.as_tensor(list(ids))])
    pairs = normfast.PairSource.from_iterable([(i, 60 + (i * 7) % 300) for i in range(300)])
    return enc, list(range(60)), pairs


def _probe(enc, items, pairs, seed, **kw):
    cfg = normfast.ProbeConfig(
        batches=16, drift_batches=16, batch_size=8, groups=4, seed=seed, chunk_size=25, params="head", mode="head"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return normfast.probe(enc, items, "infonce", pairs, cfg, progress=False, **kw)


def test_a_probe_writes_the_relative_heat_over_all_its_chunks(tmp_path):
    enc, items, pairs = _common_factor_problem()
    res = _probe(enc, items, pairs, 0, out=tmp_path / "run.parquet")
    table = pq.read_table(res.path)
    assert {"heat_loo", "heat_rel", "se_heat_rel"} <= set(table.column_names)
    assert pq.ParquetFile(res.path).num_row_groups == 3  # the reference spans the chunks
    ref = res.metadata["heat_reference"]
    assert normfast.read_metadata(res.path)["heat_reference"] == ref
    v2 = table.column("V2").to_numpy()
    np.testing.assert_allclose(ref["log_level"], np.median(np.log(v2)), rtol=1e-12)
    np.testing.assert_allclose(table.column("heat_rel").to_numpy(), np.log(v2) - ref["log_level"], atol=1e-12)
    loo = np.array(table.column("heat_loo").to_pylist())
    assert loo.shape == (len(items), 4)
    rel_g = np.log(loo) - np.median(np.log(loo), axis=0)
    want = np.sqrt(3 / 4 * ((rel_g - rel_g.mean(1, keepdims=True)) ** 2).sum(1))
    np.testing.assert_allclose(table.column("se_heat_rel").to_numpy(), want, rtol=1e-9)
    # in memory: the same numbers
    mem = _probe(enc, items, pairs, 0)
    np.testing.assert_allclose(mem.column("se_heat_rel"), table.column("se_heat_rel").to_numpy(), rtol=1e-9)
    assert mem.metadata["heat_reference"]["log_level"] == pytest.approx(ref["log_level"], rel=1e-12)


def test_the_common_factor_is_what_moves_when_the_seed_changes():
    enc, items, pairs = _common_factor_problem()
    a, b = (_probe(enc, items, pairs, seed) for seed in (0, 1))
    d_log = np.log(b.column("V2")) - np.log(a.column("V2"))
    d_rel = b.column("heat_rel") - a.column("heat_rel")
    d_level = b.metadata["heat_reference"]["log_level"] - a.metadata["heat_reference"]["log_level"]
    # every row's heat moved by about the same factor: the level took it, the ranking did not
    assert np.median(np.abs(d_log)) > 0.2
    assert np.median(np.abs(d_rel)) < 0.15 * np.median(np.abs(d_log))
    assert abs(d_level - np.median(d_log)) < 0.15 * abs(d_level)
    # and the error bars say so: the relative heat's is a fraction of the heat's own
    for r in (a, b):
        se_rel = np.median(r.column("se_heat_rel"))
        assert se_rel < 0.4 * np.median(r.column("se_V2") / r.column("V2"))
        assert se_rel < 0.4 * r.metadata["heat_reference"]["se_log_level"]
    # the seed-to-seed change of a relative heat is within its error bars (two runs: sqrt(2) se)
    se_pair = np.sqrt(a.column("se_heat_rel") ** 2 + b.column("se_heat_rel") ** 2)
    assert np.mean(np.abs(d_rel) <= 3 * se_pair) > 0.8


def test_a_run_without_group_replicates_still_gets_its_relative_heat(tmp_path):
    """Head mode's per-batch form (--per-batch) has no leave-one-group-out values: the file still gets
    heat_rel (no error bar) and the level, and no heat_loo."""
    enc, items, pairs = _common_factor_problem()
    cfg = normfast.ProbeConfig(
        batches=16,
        drift_batches=16,
        batch_size=8,
        seed=0,
        chunk_size=25,
        params="head",
        mode="head",
        radial_spread=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = normfast.probe(enc, items, "infonce", pairs, cfg, progress=False, out=tmp_path / "run.parquet")
    table = pq.read_table(res.path)
    assert "heat_loo" not in table.column_names
    v2 = table.column("V2").to_numpy()
    np.testing.assert_allclose(table.column("heat_rel").to_numpy(), np.log(v2) - np.median(np.log(v2)), atol=1e-12)
    assert np.isnan(table.column("se_heat_rel").to_numpy()).all()
    assert np.isnan(res.metadata["heat_reference"]["se_log_level"])
