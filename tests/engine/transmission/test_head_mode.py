"""Head mode (torch path): S form == per-batch form == accumulator == brute force.

The grouped form (the default) has its own checks in test_uncertainty.py."""

import numpy as np
import pytest
import torch

from normfast.core.reference import (
    allowed_error,
    brute_force_stats,
    head_stats_reference,
    project_reference,
    stat_errors,
)
from normfast.ops import ProbeAccumulator, head_flops, head_stats, prepare_head


def _head_problem(gen, n, d_in, d_out, m, *, bias=True, dtype=torch.float64):
    A = torch.randn(n, d_in, generator=gen, dtype=dtype)
    W = torch.randn(d_out, d_in, generator=gen, dtype=dtype) / max(d_in, 1) ** 0.5
    b = torch.randn(d_out, generator=gen, dtype=dtype)
    Z = A @ W.T + b
    G_mean = torch.randn(d_out, d_in, generator=gen, dtype=dtype)
    G = 0.5 * G_mean + torch.randn(m, d_out, d_in, generator=gen, dtype=dtype)
    g = torch.randn(m, d_out, generator=gen, dtype=dtype) if bias else None
    return A, Z, G, g


def _displacements(A, G, g):
    """All t_i^B = -(G_B a_i + g_B), materialized: [M, N, d_out]."""
    T = -torch.einsum("bji,ni->bnj", G.double(), A.double())
    return T if g is None else T - g.double()[:, None, :]


def _worst(errors, skip=("sign_stability",)):
    return max(v for k, v in errors.items() if not k.startswith(skip))


SHAPES = [(1, 1, 1, 2), (7, 3, 5, 5), (1000, 64, 32, 5), (7, 3, 384, 2), (1000, 17, 1, 64), (37, 384, 3, 64)]


@pytest.mark.parametrize("branch", ["u", "w"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,d_in,d_out,m", SHAPES)
def test_forms_agree_with_accumulator_and_brute_force(gen, n, d_in, d_out, m, bias, branch):
    A, Z, G, g = _head_problem(gen, n, d_in, d_out, m, bias=bias)
    T = _displacements(A, G, g)
    want = brute_force_stats(T, Z, branch)
    tol = allowed_error(torch.float32)
    f32 = (A.float(), Z.float(), G.float(), None if g is None else g.float())
    s_form = head_stats(*f32, branch=branch, form="S", radial_spread=False)
    per_batch = head_stats(*f32, branch=branch, radial_spread=True)
    acc = ProbeAccumulator(n, d_out, branch=branch).update(T.float(), Z.float()).finalize()
    sfx = "" if branch == "u" else "_w"
    assert torch.isnan(s_form["se_D" + sfx]).all()
    assert torch.isnan(s_form["sign_stability" + sfx]).all()
    s_keys = [k + sfx for k in ("D", "m2", "V2", "Q")]
    assert _worst(stat_errors(s_form, want, s_keys)) <= tol
    for got in (per_batch, acc):
        errors = stat_errors(got, want)
        assert _worst(errors) <= tol, errors
        assert errors["sign_stability" + sfx] <= 0.01
        assert errors["sign_stability_batches" + sfx] <= 1
    # the fp32 forms also agree with each other directly
    assert _worst(stat_errors(s_form, per_batch, s_keys)) <= 2 * tol
    assert s_form["M"] == per_batch["M"] == m


@pytest.mark.parametrize("branch", ["u", "w"])
@pytest.mark.parametrize("bias", [False, True])
def test_float64_path_and_references(gen, bias, branch):
    A, Z, G, g = _head_problem(gen, 50, 13, 11, 7, bias=bias)
    want = brute_force_stats(_displacements(A, G, g), Z, branch)
    f32 = [x.float() if x is not None else None for x in (A, Z, G, g)]
    want_f32 = brute_force_stats(_displacements(*[f32[0], f32[2], f32[3]]), f32[1], branch)
    sfx = "" if branch == "u" else "_w"
    for got, truth in (
        (head_stats(A, Z, G, g, branch=branch, radial_spread=True), want),
        (head_stats(*f32, branch=branch, dtype=torch.float64, radial_spread=True), want_f32),
        (project_reference(A, Z, G, g, branch=branch), want),
    ):
        assert got["D" + sfx].dtype == torch.float64
        errors = stat_errors(got, truth)
        assert _worst(errors) <= allowed_error(torch.float64), errors
        assert errors["sign_stability" + sfx] == 0
    for got in (
        head_stats(A, Z, G, g, branch=branch, form="S", radial_spread=False),
        head_stats_reference(A, Z, G, g, branch=branch),
    ):
        keys = [k + sfx for k in ("D", "m2", "V2", "Q")]
        assert _worst(stat_errors(got, want, keys)) <= allowed_error(torch.float64)


def test_auto_form_follows_flop_count(gen):
    A, Z, G, g = _head_problem(gen, 1, 40, 40, 64)
    cost = head_flops(1, 40, 40, 64, bias=True)
    assert cost["per_batch"] < cost["S"]  # one probe: forming S_c is not worth it
    tiny = head_stats(A, Z, G, g, uncertainty=False)
    assert torch.isfinite(tiny["se_D"]).all()
    A, Z, G, g = _head_problem(gen, 2000, 40, 40, 64)
    cost = head_flops(2000, 40, 40, 64, bias=True)
    assert cost["S"] < cost["per_batch"]
    many = head_stats(A, Z, G, g, uncertainty=False)
    assert torch.isnan(many["se_D"]).all() and torch.isfinite(many["V2"]).all()
    per_batch = head_stats(A, Z, G, g, uncertainty=False, form="per_batch")
    assert torch.isfinite(per_batch["se_D"]).all()
    assert _worst(stat_errors(many, per_batch, ["D", "m2", "V2", "Q"])) <= 1e-10


def test_prepared_directions_stream_in_chunks(gen):
    A, Z, G, g = _head_problem(gen, 301, 24, 16, 9, dtype=torch.float32)
    whole = head_stats(A, Z, G, g, form="S", radial_spread=False)
    dirs = prepare_head(G, g)
    assert dirs.M == 9 and dirs.d_in == 24 and dirs.d_out == 16 and dirs.has_bias
    parts = [
        head_stats(A[i : i + 100], Z[i : i + 100], dirs, form="S", radial_spread=False) for i in range(0, 301, 100)
    ]
    for key in ("D", "m2", "V2", "Q", "reason"):
        joined = torch.cat([p[key] for p in parts])
        assert torch.allclose(joined, whole[key], rtol=1e-6, atol=0), key
    spread = head_stats(A[:5], Z[:5], dirs)
    assert torch.isfinite(spread["se_D"]).all()


def test_strided_numpy_and_low_precision_inputs(gen):
    n, d_in, d_out, m = 45, 20, 12, 6
    A, Z, G, g = _head_problem(gen, n, d_in, d_out, m)
    want = brute_force_stats(_displacements(A, G, g), Z, "u")
    a_strided = A.float().T.contiguous().T
    z_strided = torch.stack([Z.float(), -Z.float()], 2)[:, :, 0]
    g_strided = G.float().transpose(1, 2).contiguous().transpose(1, 2)
    assert not (a_strided.is_contiguous() or z_strided.is_contiguous() or g_strided.is_contiguous())
    got = head_stats(a_strided, z_strided, g_strided, g.float(), radial_spread=True)
    assert _worst(stat_errors(got, want)) <= allowed_error(torch.float32)
    from_numpy = head_stats(A.numpy(), Z.numpy(), G.numpy(), g.numpy(), radial_spread=True)
    assert isinstance(from_numpy["D"], torch.Tensor)
    assert _worst(stat_errors(from_numpy, want)) <= allowed_error(torch.float64)
    for low in (torch.float16, torch.bfloat16):
        plain = stat_errors(project_reference(A.to(low), Z.to(low), G.to(low), g.to(low)), want)
        fast = stat_errors(head_stats(A.to(low), Z.to(low), G.to(low), g.to(low), radial_spread=True), want)
        for key in ("D", "se_D", "m2", "V2", "Q"):
            assert fast[key] <= allowed_error(low, plain[key]), (low, key, fast[key], plain[key])


def test_invalid_rows(gen):
    A, Z, G, g = _head_problem(gen, 6, 5, 4, 5)
    Z[1] = 0.0
    Z[2, 0] = float("nan")
    A[3, 1] = float("inf")
    A[4, 0] = float("nan")
    Z[4] = 0.0
    want = brute_force_stats(_displacements(A, G, g), Z, "w")
    for form, spread in (("S", False), ("per_batch", True)):
        got = head_stats(A.float(), Z.float(), G.float(), g.float(), branch="w", form=form, radial_spread=spread)
        assert got["reason"].tolist() == [0, 1, 2, 3, 1, 0]
        assert torch.equal(got["reason"], want["reason"])
        assert torch.isnan(got["Q_w"][1:5]).all() and torch.isfinite(got["Q_w"][[0, 5]]).all()
    bad_G = G.clone()
    bad_G[2, 1, 1] = float("nan")
    got = head_stats(A.float(), Z.float(), bad_G.float(), g.float())
    assert got["reason"].tolist() == [3, 1, 2, 3, 1, 3]


def test_head_matches_explicit_jvp_of_the_head(gen):
    """t_i^B from autograd on the head itself equals -(G_B a_i + g_B)."""
    n, d_in, d_out, m = 9, 6, 4, 3
    A, Z, G, g = _head_problem(gen, n, d_in, d_out, m)
    head = torch.nn.Linear(d_in, d_out).double().requires_grad_(False)
    Z = head(A)

    def forward(W, b):
        return torch.nn.functional.linear(A, W, b)

    params = (head.weight, head.bias)
    T = torch.stack([-torch.func.jvp(forward, params, (G[i], g[i]))[1] for i in range(m)])
    want = brute_force_stats(T, Z, "u")
    assert _worst(stat_errors(head_stats(A, Z, G, g, radial_spread=True), want)) <= 1e-10
    assert np.isfinite(want["D"].numpy()).all() and want["valid"].all()
