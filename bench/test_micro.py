"""Micro-benchmarks of the estimator's CPU paths and the quartic solver (pytest-benchmark).

    pytest bench/test_micro.py --benchmark-only
    pytest bench/test_micro.py --benchmark-only --benchmark-json bench/results/micro.json

Outside pytest's ``testpaths`` (``tests``): a plain ``pytest`` never runs
them. Each benchmark also checks its result against the plain references of
:mod:`normfast.core.reference`, once, outside the timed calls. Sizes are those of
a probe chunk of a MiniLM-sized model (d = 384, M = 16); the solver gets the
rows of 200 000 probes. Times are of this machine only; compare runs made on
the same machine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from normfast import equilibrium_coefficients, ops, solve_quartic
from normfast.core.reference import (
    accumulate_reference,
    head_stats_reference,
    project_reference,
    solve_quartic_reference,
    stat_errors,
)

pytest.importorskip("pytest_benchmark")

ProbeAccumulator, head_stats, prepare_head = ops.ProbeAccumulator, ops.head_stats, ops.prepare_head

D = 384
M = 16
N_CHUNK = 4096


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # many mid-sized ops: one thread gives steadier numbers on a shared machine
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture
def head_problem():
    g = torch.Generator().manual_seed(11)
    A = torch.randn(N_CHUNK, D, generator=g)
    W = torch.randn(D, D, generator=g) / D**0.5
    b = 0.1 * torch.randn(D, generator=g)
    Z = torch.addmm(b, A, W.T)
    G = 1e-2 * torch.randn(M, D, D, generator=g)
    gb = 1e-2 * torch.randn(M, D, generator=g)
    return A, Z, G, gb


def _max_error(got: dict, want: dict, keys) -> float:
    return max(stat_errors(got, want, list(keys)).values())


def test_accumulator_update(benchmark):
    """One accumulator update: K = 8 directions of N_CHUNK displacements (torch path, fp32 state)."""
    g = torch.Generator().manual_seed(12)
    z = torch.randn(N_CHUNK, D, generator=g)
    t = torch.randn(8, N_CHUNK, D, generator=g)
    acc = ProbeAccumulator(N_CHUNK, D, backend="torch")
    reference = accumulate_reference(
        ProbeAccumulator(N_CHUNK, D, dtype=torch.float64).state_dict(), t.double(), z.double()
    )
    got = ProbeAccumulator(N_CHUNK, D, backend="torch").update(t, z).state_dict()
    for key in ("mean_u", "M2_u", "rmean_u", "rM2_u"):
        scale = reference[key].abs().max()
        assert (got[key].double() - reference[key]).abs().max() <= 1e-5 * scale, key
    benchmark(acc.update, t, z)


def test_head_stats_s_form(benchmark, head_problem):
    """Head mode, S form (``N d_in²`` per chunk), directions prepared once."""
    A, Z, G, gb = head_problem
    dirs = prepare_head(G, gb)
    dirs.covariance()
    got = head_stats(A, Z, dirs, form="S", radial_spread=False, backend="torch")
    want = head_stats_reference(A.double(), Z.double(), G.double(), gb.double())
    assert _max_error(got, want, ("D", "m2", "V2", "Q")) < 1e-4
    benchmark(head_stats, A, Z, dirs, form="S", radial_spread=False, backend="torch")


def test_head_stats_per_batch_form(benchmark, head_problem):
    """Head mode, per-batch form (``N M d_in d_out``; gives se_D and sign stability)."""
    A, Z, G, gb = head_problem
    dirs = prepare_head(G, gb)
    got = head_stats(A, Z, dirs, form="per_batch", backend="torch")
    want = project_reference(A.double(), Z.double(), G.double(), gb.double())
    assert _max_error(got, want, ("D", "se_D", "m2", "V2", "Q")) < 1e-4
    benchmark(head_stats, A, Z, dirs, form="per_batch", backend="torch")


def test_prepare_head(benchmark, head_problem):
    """Centering the M head directions and forming ``S_c`` (once per run)."""
    _, _, G, gb = head_problem

    def prepare():
        dirs = prepare_head(G, gb)
        return dirs.covariance()

    s_c = prepare()
    aug = torch.cat([G, gb[:, :, None]], 2).double()
    centered = aug - aug.mean(0)
    want = torch.einsum("bji,bjk->ik", centered, centered) / (M - 1)
    assert torch.allclose(s_c.double(), want, rtol=1e-4, atol=1e-9)
    benchmark(prepare)


@pytest.fixture
def quartic_rows():
    rng = np.random.default_rng(13)
    n = 200_000
    D_ = rng.normal(0.0, 1e-3, n)
    Q = rng.lognormal(-8.0, 1.0, n)
    kappa = rng.uniform(0.5, 3.0, n)
    D_w = rng.normal(0.0, 1e-3, n)
    Q_w = rng.lognormal(-8.0, 1.0, n)
    C = 0.1 * np.sqrt(Q * Q_w)
    return equilibrium_coefficients(D_, Q, kappa, lr=1e-3, weight_decay=1e-2, D_w=D_w, Q_w=Q_w, C_uw=C)


def test_solve_quartic(benchmark, quartic_rows):
    """The C++ batched solver on 200 000 general quartics (SGD + AdamW branches)."""
    roots, count = solve_quartic(quartic_rows)
    sample = slice(0, 2000)
    ref_roots, ref_count = solve_quartic_reference(quartic_rows[sample])
    ok = np.isfinite(ref_roots)
    assert ok.mean() > 0.9
    assert np.allclose(roots[sample][ok], ref_roots[ok], rtol=1e-9)
    benchmark(solve_quartic, quartic_rows)


def test_solve_quartic_reference(benchmark, quartic_rows):
    """The numpy companion-matrix reference on 20 000 rows, for scale."""
    rows = quartic_rows[:20_000]
    roots, _ = solve_quartic_reference(rows)
    fast, _ = solve_quartic(rows)
    ok = np.isfinite(roots)
    assert np.allclose(fast[ok], roots[ok], rtol=1e-9)
    benchmark(solve_quartic_reference, rows)
