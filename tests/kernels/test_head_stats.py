"""The head-mode kernels head_stats and project (kernels/head_stats.py) against their references
(normfast.core.reference.head_stats_reference, project_reference) and the float64 brute force.

On a machine without a GPU the kernels run through ``TRITON_INTERPRET=1`` (set in conftest.py before
triton is imported): sizes stay small and inputs fp32. The CUDA-only cases run where a GPU is present
and the interpreter is off; the compiled path is checked without a GPU by tests/kernels/test_resources.py.
"""

import pytest
import torch

from tests.kernels._helpers import DEVICE, TOL, gpu, rand, sign_ok, skip_without_kernels, worst

skip_without_kernels()

from normfast.core.reference import (  # noqa: E402
    allowed_error,
    brute_force_grouped,
    brute_force_stats,
    head_stats_reference,
    project_reference,
    stat_errors,
)
from normfast.kernels import head_stats, project  # noqa: E402
from normfast.ops import ProbeAccumulator, prepare_head  # noqa: E402
from normfast.ops import head_stats as ops_head_stats  # noqa: E402

HEAD_CASES = [  # n, d_in, d_out, m, bias, branch
    (1, 1, 1, 2, False, "u"),
    (7, 3, 5, 5, True, "w"),
    (70, 33, 20, 3, True, "u"),
    (66, 17, 40, 4, False, "w"),
    (9, 5, 7, 64, True, "u"),
    (333, 64, 3, 5, True, "u"),  # several row blocks, the last one partial
    (7, 384, 64, 2, False, "w"),
    (333, 3, 384, 2, True, "w"),
    (130, 1, 64, 5, False, "u"),
]


def _head_inputs(gen, n, d_in, d_out, m, bias):
    A = rand(gen, n, d_in)
    Z = A @ (rand(gen, d_out, d_in) / d_in**0.5).T + rand(gen, d_out)
    G = 0.5 * rand(gen, d_out, d_in)[None] + rand(gen, m, d_out, d_in)
    g = rand(gen, m, d_out) if bias else None
    if n >= 7:
        Z[3] = 0.0
        A[5, 0] = float("inf")
    return A.float(), Z.float(), G.float(), None if g is None else g.float()


@pytest.mark.parametrize("n,d_in,d_out,m,bias,branch", HEAD_CASES)
def test_head_kernels(gen, n, d_in, d_out, m, bias, branch):
    A, Z, G, g = _head_inputs(gen, n, d_in, d_out, m, bias)
    dirs = prepare_head(G, g)
    # strided probe inputs
    a_dev = A.T.contiguous().T.to(DEVICE) if d_in > 1 else A.to(DEVICE)
    z_dev = torch.stack([Z, Z], 2)[:, :, 1].to(DEVICE)
    g_bar, g_c, s_c = (x.contiguous().to(DEVICE) for x in (dirs.g_bar, dirs.g_centered, dirs.covariance()))
    out_s = torch.full((4, n), float("nan"), device=DEVICE)  # poisoned outputs
    out_p = torch.full((6, n), float("nan"), device=DEVICE)
    reason_s = torch.full((n,), 99, dtype=torch.int8, device=DEVICE)
    reason_p = reason_s.clone()
    head_stats(a_dev, z_dev, g_bar, s_c, branch=branch, has_bias=bias, out=out_s, reason=reason_s)
    project(a_dev, z_dev, g_bar, g_c, branch=branch, has_bias=bias, out=out_p, reason=reason_p)
    sfx = "" if branch == "u" else "_w"
    s_form = {k + sfx: v.cpu() for k, v in zip(("D", "m2", "V2", "Q"), out_s)}
    names = ("D", "se_D", "sign_stability", "m2", "V2", "Q")
    per_batch = {k + sfx: v.cpu() for k, v in zip(names, out_p)}

    args = (A.double(), Z.double(), G.double(), None if g is None else g.double())
    T = -torch.einsum("bji,ni->bnj", args[2], args[0])
    if g is not None:
        T = T - args[3][:, None, :]
    want = brute_force_stats(T, args[1], branch)
    s_keys = list(s_form)
    for truth in (head_stats_reference(*args, branch=branch), want):
        assert worst(stat_errors(s_form, truth, s_keys)) <= TOL
    for truth in (project_reference(*args, branch=branch), want):
        errors = stat_errors(per_batch, truth)
        assert worst(errors) <= TOL and sign_ok(errors), errors
    assert torch.equal(reason_s.cpu(), want["reason"])
    assert torch.equal(reason_p.cpu(), want["reason"])

    # the public entry point dispatches to the same kernels
    on_device = [None if x is None else x.to(DEVICE) for x in (A, Z, G, g)]
    via_ops = ops_head_stats(*on_device, branch=branch, backend="triton", radial_spread=True)
    for key, value in per_batch.items():
        torch.testing.assert_close(via_ops[key].cpu(), value, rtol=1e-6, atol=0, equal_nan=True)
    torch_path = ops_head_stats(A, Z, G, g, branch=branch, backend="torch", radial_spread=True)
    assert worst(stat_errors(per_batch, torch_path)) <= TOL


@pytest.mark.parametrize(
    "n,d_in,d_out,m,bias,branch", [(70, 33, 20, 12, True, "u"), (66, 17, 40, 9, False, "w"), (9, 5, 7, 64, True, "u")]
)
@pytest.mark.parametrize("drift", [False, True])
def test_grouped_head_stats_triton_equals_torch_and_brute_force(gen, n, d_in, d_out, m, bias, branch, drift):
    """The default head-mode form (grouped error bars) on the head_stack kernel: the same numbers as the torch
    path and as the float64 brute force of the grouped estimators."""
    A, Z, G, g = _head_inputs(gen, n, d_in, d_out, m, bias)
    kw = {}
    T_drift = None
    if drift:  # the drift from its own 2m batches in K groups (the heat's m are the first of them)
        k = min(8, m)
        Gd = torch.cat([G, 0.5 * rand(gen, d_out, d_in)[None].float() + rand(gen, m, d_out, d_in).float()])
        gd = torch.cat([g, rand(gen, m, d_out).float()]) if bias else None
        kw = {
            "drift_means": torch.stack([Gd[j::k].mean(0) for j in range(k)]),
            "drift_counts": [len(range(j, 2 * m, k)) for j in range(k)],
        }
        if bias:
            kw["drift_bias"] = torch.stack([gd[j::k].mean(0) for j in range(k)])
        T_drift = -torch.einsum("bji,ni->bnj", Gd.double(), A.double())
        if bias:
            T_drift = T_drift - gd.double()[:, None, :]
    on_device = [None if x is None else x.to(DEVICE) for x in (A, Z, G, g)]
    fast = ops_head_stats(
        *on_device,
        branch=branch,
        backend="triton",
        **{key: (v.to(DEVICE) if torch.is_tensor(v) else v) for key, v in kw.items()},
    )
    slow = ops_head_stats(A, Z, G, g, branch=branch, backend="torch", **kw)
    assert fast["groups"] == slow["groups"] == min(8, m)
    T = -torch.einsum("bji,ni->bnj", G.double(), A.double())
    if bias:
        T = T - g.double()[:, None, :]
    truth = brute_force_grouped(T, Z.double(), min(8, m), branch, T_drift)
    sfx = "" if branch == "u" else "_w"
    keys = [k + sfx for k in ("D", "se_D", "sign_stability", "m2", "V2", "Q", "se_V2", "se_Q")]
    for got in (fast, slow):
        errors = stat_errors(got, truth, keys)
        assert worst(errors) <= TOL and sign_ok(errors), errors
        for q in ("D", "m2", "V2", "Q"):
            got_loo, want_loo = got["loo"][q + sfx].cpu().double(), truth["loo"][q + sfx].double()
            scale = want_loo[torch.isfinite(want_loo)].abs().max()
            assert torch.allclose(got_loo, want_loo, rtol=0, atol=float(TOL * scale), equal_nan=True), q
        assert torch.equal(got["reason"].cpu(), truth["reason"])
    for key in keys[:1] + keys[3:]:
        torch.testing.assert_close(
            fast[key].cpu().double(),
            slow[key].double(),
            rtol=1e-4,
            atol=1e-4 * float(slow[key][torch.isfinite(slow[key])].abs().max()),
            equal_nan=True,
        )


def test_head_launchers_validate():
    A, Z = torch.randn(5, 4), torch.randn(5, 3)
    g_bar, s_c = torch.randn(3, 5), torch.randn(5, 5)
    with pytest.raises(
        ValueError,
        match=r"head_stats: expected g_bar contiguous float32 "
        r"of shape \(3, 4\)",
    ):
        head_stats(A, Z, g_bar, s_c)
    with pytest.raises(
        ValueError,
        match=r"head_stats: expected out contiguous float32 "
        r"of shape \(4, 5\)",
    ):
        head_stats(A, Z, g_bar, s_c, has_bias=True, out=torch.empty(6, 5))
    with pytest.raises(ValueError, match=r"project: expected at least 2 virtual batches"):
        project(A, Z, g_bar, torch.randn(1, 3, 5), has_bias=True)
    with pytest.raises(ValueError, match=r"project: expected branch 'u' or 'w'"):
        project(A, Z, g_bar, torch.randn(2, 3, 5), has_bias=True, branch="uw")


@gpu
@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_on_gpu(gen, low):
    A, Z, G, g = _head_inputs(gen, 4099, 384, 256, 16, True)
    A64, Z64 = A.double(), Z.double()
    T = -torch.einsum("bji,ni->bnj", G.double(), A64) - g.double()[:, None, :]
    want = brute_force_stats(T, Z64, "u")
    low_inputs = [x.to(low).cuda() for x in (A, Z, G, g)]
    plain = stat_errors(project_reference(*low_inputs), want)
    fast = stat_errors(ops_head_stats(A.to(low).cuda(), Z.to(low).cuda(), G.cuda(), g.cuda(), radial_spread=True), want)
    for key in ("D", "se_D", "m2", "V2", "Q"):
        assert fast[key] <= allowed_error(low, plain[key]), (key, fast[key], plain[key])
    t = (0.3 + torch.randn(8, 4099, 384, generator=gen)).to(low).cuda()
    z = torch.randn(4099, 384, generator=gen).to(low).cuda()
    want = brute_force_stats(t.double(), z.double(), "u")
    plain = stat_errors(brute_force_stats(t, z, "u", dtype=low), want)
    fast = stat_errors(ProbeAccumulator(4099, 384, device="cuda").update(t, z).finalize(), want)
    for key in ("D", "se_D", "m2", "V2", "Q"):
        assert fast[key] <= allowed_error(low, plain[key]), (key, fast[key], plain[key])


@gpu
@pytest.mark.parametrize("n,d_in,d_out,m", [(20011, 384, 384, 64), (4099, 768, 256, 8)])
def test_head_kernels_large_on_gpu(gen, n, d_in, d_out, m):
    A, Z, G, g = (x.cuda() for x in _head_inputs(gen, n, d_in, d_out, m, True))
    want = project_reference(A.double(), Z.double(), G.double(), g.double())
    for form, spread in (("S", False), ("per_batch", True)):
        got = ops_head_stats(A, Z, G, g, form=form, radial_spread=spread)
        keys = ["D", "m2", "V2", "Q"] + (["se_D"] if spread else [])
        assert worst(stat_errors(got, want, keys)) <= TOL
    tf32 = ops_head_stats(A, Z, G, g, form="S", radial_spread=False, allow_tf32=True)
    assert worst(stat_errors(tf32, want, ["D", "m2", "V2", "Q"])) <= 5e-3
