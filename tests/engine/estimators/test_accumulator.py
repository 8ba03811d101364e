"""ProbeAccumulator (torch path) against the float64 brute force.

Covers every branch, awkward shapes, strided inputs, chunking and merge
order, state round trips, invalid rows and low-precision inputs. The Triton
path of the same class is exercised in tests/kernels/test_accumulate.py.
"""

import numpy as np
import pytest
import torch

from normfast.core.reference import allowed_error, brute_force_stats, stat_errors
from normfast.ops import REASONS, ProbeAccumulator

SIZES_N = (1, 7, 1000)
SIZES_D = (1, 3, 64, 384)
SIZES_M = (2, 5, 64)


def _directions(gen, m, n, d, *, drift=0.3):
    """Random displacements with a common drift, so that D is not ~0 for every row."""
    base = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return drift * base[None] + torch.randn(m, n, d, generator=gen, dtype=torch.float64)


def _embeddings(gen, n, d):
    spread = torch.rand(n, d, generator=gen, dtype=torch.float64)
    return 0.5 + spread * torch.randn(n, d, generator=gen, dtype=torch.float64)


def _feed(acc, T, Z, T_w=None, chunks=(None,)):
    """Update ``acc`` with T split at the given chunk boundaries."""
    bounds = [0] + [c for c in chunks if c is not None] + [T.shape[0]]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        acc.update(T[lo:hi], Z, t_w=None if T_w is None else T_w[lo:hi])
    return acc


def _worst(errors):
    return max(v for k, v in errors.items() if not k.startswith("sign_stability"))


def _check_sign(errors, m):
    for key, value in errors.items():
        if key.startswith("sign_stability_batches"):
            assert value <= 1 + 1e-9, errors  # at most one near-zero dot flipped per row
        elif key.startswith("sign_stability"):
            assert value <= 0.01, errors


@pytest.mark.parametrize("m", SIZES_M)
@pytest.mark.parametrize("d", SIZES_D)
@pytest.mark.parametrize("n", SIZES_N)
def test_u_branch_full_grid(gen, n, d, m):
    if n * d * m > 5_000_000:
        pytest.skip("brute force of this size is covered by smaller M")
    T, Z = _directions(gen, m, n, d), _embeddings(gen, n, d)
    want = brute_force_stats(T, Z, "u")
    acc = ProbeAccumulator(n, d, branch="u")
    got = _feed(acc, T.float(), Z.float(), chunks=(m // 2,)).finalize()
    errors = stat_errors(got, want)
    assert _worst(errors) <= allowed_error(torch.float32), errors
    _check_sign(errors, m)
    assert got["M"] == m and got["valid"].all()


@pytest.mark.parametrize("branch", ["w", "uw"])
@pytest.mark.parametrize("n,d,m", [(1, 1, 2), (7, 3, 5), (1000, 64, 5), (7, 384, 64), (1000, 3, 64)])
def test_other_branches(gen, branch, n, d, m):
    T, Z = _directions(gen, m, n, d), _embeddings(gen, n, d)
    T_w = _directions(gen, m, n, d) if branch == "uw" else None
    want = brute_force_stats(T, Z, branch, T_w)
    acc = ProbeAccumulator(n, d, branch=branch)
    t_w = None if T_w is None else T_w.float()
    got = _feed(acc, T.float(), Z.float(), t_w, chunks=(1,)).finalize()
    errors = stat_errors(got, want)
    assert set(errors) >= {"D_w", "Q_w"} and ("C_uw" in errors) == (branch == "uw")
    assert _worst(errors) <= allowed_error(torch.float32), errors
    _check_sign(errors, m)


@pytest.mark.parametrize("branch", ["u", "w", "uw"])
def test_float64_state_matches_brute_force(gen, branch):
    n, d, m = 13, 17, 9
    T, Z = _directions(gen, m, n, d), _embeddings(gen, n, d)
    T_w = _directions(gen, m, n, d) if branch == "uw" else None
    acc = ProbeAccumulator(n, d, branch=branch, dtype=torch.float64)
    got = _feed(acc, T, Z, T_w, chunks=(2, 3)).finalize()
    errors = stat_errors(got, brute_force_stats(T, Z, branch, T_w))
    assert _worst(errors) <= allowed_error(torch.float64), errors
    assert all(v == 0 for k, v in errors.items() if k.startswith("sign_stability"))


@pytest.mark.parametrize("branch", ["u", "uw"])
def test_chunking_and_merge_order_invariance(gen, branch):
    n, d, m = 11, 6, 24
    # a large common offset: the stable update must not care
    T = _directions(gen, m, n, d) * 1e3 + 5e3
    T_w = _directions(gen, m, n, d) if branch == "uw" else None
    Z = _embeddings(gen, n, d)

    def make():
        return ProbeAccumulator(n, d, branch=branch, dtype=torch.float64)

    one_shot = make().update(T, Z, t_w=T_w).finalize()
    single_steps = _feed(make(), T, Z, T_w, chunks=tuple(range(1, m))).finalize()
    pieces = [(0, 5), (5, 6), (6, 17), (17, 24)]
    parts = [make().update(T[a:b], Z, t_w=None if T_w is None else T_w[a:b]) for a, b in pieces]
    forward = make()
    for p in parts:
        forward.merge(p)
    backward = make()
    for p in reversed(parts):
        backward.merge(p)
    tree = parts[2].merge(parts[0]).merge(parts[3].merge(parts[1]))
    for other in (single_steps, forward.finalize(), backward.finalize(), tree.finalize()):
        errors = stat_errors(other, one_shot)
        assert _worst(errors) <= 1e-10, errors
        assert all(v == 0 for k, v in errors.items() if k.startswith("sign_stability")), errors
    assert forward.M == backward.M == tree.M == m


def test_merge_with_empty_is_identity(gen):
    n, d = 5, 4
    T, Z = _directions(gen, 6, n, d), _embeddings(gen, n, d)
    full = ProbeAccumulator(n, d, dtype=torch.float64).update(T, Z)
    before = full.state_dict()
    full.merge(ProbeAccumulator(n, d, dtype=torch.float64))
    assert all(torch.equal(before[k], v) for k, v in full.state_dict().items())
    empty = ProbeAccumulator(n, d, dtype=torch.float64).merge(full)
    assert all(torch.equal(before[k], v) for k, v in empty.state_dict().items())


def test_state_dict_round_trip_continues_exactly(gen):
    n, d, m = 9, 5, 8
    T, Z, T_w = _directions(gen, m, n, d), _embeddings(gen, n, d), _directions(gen, m, n, d)
    straight = ProbeAccumulator(n, d, branch="uw")
    straight.update(T[:3].float(), Z.float(), t_w=T_w[:3].float())
    state = straight.state_dict()
    names = ("mean", "M2", "rmean", "rM2", "npos", "nneg")
    assert set(state) == {"n", "reason", "cross", *(f"{k}_{b}" for k in names for b in "uw")}
    resumed = ProbeAccumulator(n, d, branch="uw").load_state_dict(state)
    for acc in (straight, resumed):
        acc.update(T[3:].float(), Z.float(), t_w=T_w[3:].float())
    a, b = straight.finalize(), resumed.finalize()
    for key in a:
        if key != "M":
            assert torch.equal(a[key], b[key]), key
    state["mean_u"].fill_(123.0)  # a copy: mutating it leaves the accumulator alone
    assert not torch.equal(straight.state_dict()["mean_u"], state["mean_u"])


def test_strided_and_single_direction_inputs(gen):
    n, d, m = 37, 19, 6
    T, Z = _directions(gen, m, n, d), _embeddings(gen, n, d)
    want = brute_force_stats(T, Z, "u")
    # [M, N, d] stored N-major
    t_strided = T.permute(1, 0, 2).contiguous().permute(1, 0, 2).float()
    z_wide = torch.randn(n, 2 * d + 3, generator=gen)
    z_wide[:, 1 : 2 * d + 1 : 2] = Z.float()
    z_strided = z_wide[:, 1 : 2 * d + 1 : 2]
    assert not t_strided.is_contiguous() and not z_strided.is_contiguous()
    acc = ProbeAccumulator(n, d)
    acc.update(t_strided[:2], z_strided)
    for k in range(2, m):
        acc.update(t_strided[k], z_strided)  # [N, d]: one direction
    errors = stat_errors(acc.finalize(), want)
    assert _worst(errors) <= allowed_error(torch.float32), errors


def test_numpy_inputs_and_empty_update(gen):
    n, d, m = 6, 4, 5
    T, Z = _directions(gen, m, n, d), _embeddings(gen, n, d)
    acc = ProbeAccumulator(n, d, dtype=torch.float64)
    acc.update(np.zeros((0, n, d)), Z.numpy())  # K = 0: nothing happens
    assert acc.M == 0
    got = acc.update(T.numpy(), Z.numpy()).finalize()
    assert isinstance(got["D"], torch.Tensor)
    errors = stat_errors(got, brute_force_stats(T, Z, "u"))
    assert _worst(errors) <= 1e-12, errors


def test_invalid_rows_are_nan_with_reasons(gen):
    n, d, m = 8, 5, 6
    T, Z, T_w = _directions(gen, m, n, d), _embeddings(gen, n, d), _directions(gen, m, n, d)
    Z[1] = 0.0
    Z[2, 3] = float("nan")
    Z[3, 0] = float("inf")
    T[4, 4, 1] = float("inf")
    T_w[2, 5, 0] = float("nan")
    T[0, 6, 2] = float("nan")
    Z[6] = 0.0  # zero norm wins over the bad displacement in the same row
    acc = ProbeAccumulator(n, d, branch="uw")
    got = _feed(acc, T.float(), Z.float(), T_w.float(), chunks=(3,)).finalize()
    want = brute_force_stats(T, Z, "uw", T_w)
    expected = [
        "ok",
        "zero_norm",
        "non_finite_embedding",
        "non_finite_embedding",
        "non_finite_displacement",
        "non_finite_displacement",
        "zero_norm",
        "ok",
    ]
    assert [REASONS[c] for c in got["reason"].tolist()] == expected
    assert torch.equal(got["reason"], want["reason"])
    assert got["valid"].tolist() == [r == "ok" for r in expected]
    for key in ("D", "se_D", "sign_stability", "m2", "V2", "Q", "D_w", "Q_w", "C_uw"):
        assert torch.isnan(got[key][~got["valid"]]).all()
        assert torch.isfinite(got[key][got["valid"]]).all()
    errors = stat_errors(got, want)
    assert _worst(errors) <= allowed_error(torch.float32), errors


def test_sign_stability_convention():
    # Radial dots exactly 0 everywhere: D = 0 and sign(0) = 0 agrees with it.
    n, d = 2, 3
    Z = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    T = torch.zeros(4, n, d)
    T[:, 0, 1] = torch.tensor([1.0, -2.0, 3.0, 0.5])
    T[:, 1, 2] = torch.tensor([1.0, 2.0, -3.0, 4.0])
    got = ProbeAccumulator(n, d, branch="w").update(T, Z).finalize()
    assert got["D_w"].tolist() == [0.0, 0.0]
    assert got["sign_stability_w"].tolist() == [1.0, 1.0]
    # Radial dots +1, +2, -1, +3: D > 0 and three of four agree.
    T2 = torch.zeros(4, 1, 2)
    T2[:, 0, 0] = torch.tensor([1.0, 2.0, -1.0, 3.0])
    got = ProbeAccumulator(1, 2, branch="w").update(T2, torch.tensor([[3.0, 0.0]])).finalize()
    assert got["sign_stability_w"].item() == 0.75
    assert got["D_w"].item() == pytest.approx(1.25)
    assert got["se_D_w"].item() == pytest.approx(np.std([1, 2, -1, 3], ddof=1) / 2)


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_follow_the_tolerance_rule(gen, low):
    n, d, m = 64, 48, 16
    T, Z = _directions(gen, m, n, d), _embeddings(gen, n, d)
    want = brute_force_stats(T, Z, "u")
    plain = stat_errors(brute_force_stats(T.to(low), Z.to(low), "u", dtype=low), want)
    got = stat_errors(ProbeAccumulator(n, d).update(T.to(low), Z.to(low)).finalize(), want)
    for key, err in got.items():
        if key.startswith("sign_stability"):
            continue
        assert err <= allowed_error(low, plain[key]), (key, err, plain[key])
