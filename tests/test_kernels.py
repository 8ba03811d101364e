"""Triton kernels vs plain-torch references vs the float64 brute force.

On a machine without a GPU the kernels run through ``TRITON_INTERPRET=1``
(set in conftest.py before triton is imported): sizes stay small and inputs
fp32. The CUDA-only cases (low precision, larger shapes) run when a GPU is
present and the interpreter is off. The compiled path is checked without a
GPU by tests/test_kernel_resources.py (every shipped configuration lowered
to sm_80/sm_90 code, with its registers, spills and occupancy).
"""
import os

import pytest
import torch

pytest.importorskip("triton")

from normfast.kernels import (  # noqa: E402
    MAX_FUSED_DIM,
    accumulate,
    block_sizes,
    capture_launches,
    head_configs,
    head_stack,
    head_stats,
    interpreted,
    project,
)
from normfast.kernels.head_stack import head_stack_operands  # noqa: E402
from normfast.kernels.utils import MAX_BLOCK_ROWS, accumulate_configs  # noqa: E402
from normfast.engine.ops import ProbeAccumulator, head_stats as ops_head_stats, prepare_head  # noqa: E402
from normfast.core.reference import (  # noqa: E402
    accumulate_reference,
    brute_force_grouped,
    allowed_error,
    brute_force_stats,
    head_stack_errors,
    head_stack_reference,
    head_stats_reference,
    project_reference,
    stat_errors,
)

ON_GPU = torch.cuda.is_available() and not interpreted()
DEVICE = "cuda" if ON_GPU else "cpu"
if not ON_GPU and not interpreted():
    pytest.skip("no GPU and TRITON_INTERPRET is off", allow_module_level=True)

TOL = allowed_error(torch.float32)


def _worst(errors):
    return max(v for k, v in errors.items() if not k.startswith("sign_stability"))


def _sign_ok(errors):
    return all(v <= (1 if "batches" in k else 0.01)
               for k, v in errors.items() if k.startswith("sign_stability"))


def _rand(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


# ---------------------------------------------------------------- accumulate
def _acc_cases():
    """Branch "u" over every N x d with M cycling through {2, 5, 64}; a few w / uw cases.

    N = 333 rows span several row blocks with a partial last one at every block height (the
    interpreter runs each block in Python: 1000 rows took three times as long, for no more cover)."""
    cases = []
    for i, n in enumerate((1, 7, 333)):
        for j, d in enumerate((1, 3, 64, 384)):
            m = (2, 5, 64)[(i + j) % 3]
            cases.append(("u", n, d, m if n * d * m <= 5_000_000 else 5))
    return cases + [("w", 7, 3, 5), ("uw", 7, 3, 5), ("uw", 5, 384, 2), ("w", 3, 200, 64),
                    ("uw", 333, 64, 2)]


ACC_CASES = _acc_cases()


@pytest.mark.parametrize("branch,n,d,m", ACC_CASES)
def test_accumulate_kernel(gen, branch, n, d, m):
    Z = _rand(gen, n, d) + 0.3
    T = 0.4 * _rand(gen, n, d)[None] + _rand(gen, m, n, d)
    T_w = _rand(gen, m, n, d) if branch == "uw" else None
    if n >= 7:
        Z[2] = 0.0
        T[m - 1, 4, d - 1] = float("nan")
    # strided views of the displacements: [M, N, d] stored N-major
    t32 = T.float().permute(1, 0, 2).contiguous().permute(1, 0, 2)
    tw32 = None if T_w is None else T_w.float().permute(1, 0, 2).contiguous().permute(1, 0, 2)
    acc = ProbeAccumulator(n, d, branch=branch, backend="triton", device=DEVICE)
    acc._mean.fill_(float("nan"))  # poisoned: an empty state must not read its old values
    acc._moments.fill_(float("nan"))
    if acc._cross is not None:
        acc._cross.fill_(float("nan"))
    split = max(1, m // 2)
    for lo, hi in ((0, split), (split, m)):
        t_w = None if tw32 is None else tw32[lo:hi].to(DEVICE)
        acc.update(t32[lo:hi].to(DEVICE), Z.float().to(DEVICE), t_w=t_w)
    got = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in acc.finalize().items()}

    # the reference: a Welford loop in float64 on the same fp32 inputs
    empty = ProbeAccumulator(n, d, branch=branch, dtype=torch.float64).state_dict()
    ref_state = accumulate_reference(empty, t32.double(), Z.float().double(), branch=branch,
                                     t_w=None if tw32 is None else tw32.double())
    ref = ProbeAccumulator(n, d, branch=branch, dtype=torch.float64)
    ref = ref.load_state_dict(ref_state).finalize()
    torch_path = ProbeAccumulator(n, d, branch=branch, backend="torch")
    for lo, hi in ((0, split), (split, m)):
        torch_path.update(t32[lo:hi], Z.float(), t_w=None if tw32 is None else tw32[lo:hi])

    want = brute_force_stats(T.float(), Z.float(), branch, None if T_w is None else T_w.float())
    for other in (ref, torch_path.finalize(), want):
        errors = stat_errors(got, other)
        assert _worst(errors) <= TOL and _sign_ok(errors), errors
    assert torch.equal(got["reason"], want["reason"])
    state = acc.state_dict()
    assert torch.equal(state["reason"].cpu(), ref_state["reason"])
    for key in [k for k in state if k.startswith(("npos", "nneg"))]:
        assert (state[key].cpu() - ref_state[key]).abs().max() <= 1, key


def test_accumulate_launcher_validates_state():
    t, z = torch.randn(2, 4, 3), torch.randn(4, 3)
    mean, moments = torch.zeros(1, 4, 3), torch.zeros(1, 3, 4)
    counts, reason = torch.zeros(1, 2, 4, dtype=torch.int64), torch.zeros(4, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"accumulate: expected counts contiguous torch.int64"):
        accumulate(t, z, mean, moments, counts.int(), reason, 0)
    with pytest.raises(ValueError, match=r"accumulate: expected t \[K, N, D\] and z \[N, D\]"):
        accumulate(t, z[:3], mean, moments, counts, reason, 0)
    with pytest.raises(ValueError, match=r"t_w and cross are required for branch 'uw'"):
        accumulate(t, z, mean, moments, counts, reason, 0, branch="uw")
    with pytest.raises(TypeError, match=r"accumulate: expected t to have dtype"):
        accumulate(t.double(), z, mean, moments, counts, reason, 0)


def test_block_sizes():
    for d in (1, 3, 64, 384, 1000, MAX_FUSED_DIM):
        cfg = block_sizes("accumulate", dim=d)
        assert cfg["BLOCK_D"] >= d and cfg["BLOCK_D"] & (cfg["BLOCK_D"] - 1) == 0
        assert cfg["BLOCK_N"] * cfg["BLOCK_D"] <= max(4096, cfg["BLOCK_D"])
    with pytest.raises(ValueError, match="accumulate supports dim"):
        block_sizes("accumulate", dim=MAX_FUSED_DIM + 1)
    cfg = block_sizes("project", d_in=3, d_out=700)
    assert min(cfg["BLOCK_N"], cfg["BLOCK_J"], cfg["BLOCK_K"]) >= 16  # tl.dot minimum
    # the GPU candidates: several to tune from, rows within the int32 offset bound
    for dtype, precision in ((torch.float32, "ieee"), (torch.float32, "tf32"),
                             (torch.bfloat16, "ieee"), (torch.float16, "ieee")):
        pool = head_configs(d_in=384, d_out=256, dtype=dtype, precision=precision, for_gpu=True)
        assert len(pool) >= 2 and all(c["BLOCK_N"] <= MAX_BLOCK_ROWS for c in pool)
        assert all(min(c["BLOCK_J"], c["BLOCK_N"]) >= 16 and c["BLOCK_K"] >= 8 for c in pool)
    # the interpreter never autotunes: one configuration per launch
    assert len(head_configs(d_in=384, d_out=256)) == 1 or ON_GPU
    for d in (1, 3, 384, 1000, MAX_FUSED_DIM):
        for cfg in accumulate_configs(dim=d, for_gpu=True):
            per_thread = cfg["BLOCK_N"] * cfg["BLOCK_D"] / (32 * cfg["num_warps"])
            assert cfg["BLOCK_D"] >= d and per_thread <= 8, (d, cfg)


# ------------------------------------------------------- head_stats / project
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
    A = _rand(gen, n, d_in)
    Z = A @ (_rand(gen, d_out, d_in) / d_in ** 0.5).T + _rand(gen, d_out)
    G = 0.5 * _rand(gen, d_out, d_in)[None] + _rand(gen, m, d_out, d_in)
    g = _rand(gen, m, d_out) if bias else None
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
    g_bar, g_c, s_c = (x.contiguous().to(DEVICE)
                       for x in (dirs.g_bar, dirs.g_centered, dirs.covariance()))
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
        assert _worst(stat_errors(s_form, truth, s_keys)) <= TOL
    for truth in (project_reference(*args, branch=branch), want):
        errors = stat_errors(per_batch, truth)
        assert _worst(errors) <= TOL and _sign_ok(errors), errors
    assert torch.equal(reason_s.cpu(), want["reason"])
    assert torch.equal(reason_p.cpu(), want["reason"])

    # the public entry point dispatches to the same kernels
    on_device = [None if x is None else x.to(DEVICE) for x in (A, Z, G, g)]
    via_ops = ops_head_stats(*on_device, branch=branch, backend="triton", radial_spread=True)
    for key, value in per_batch.items():
        torch.testing.assert_close(via_ops[key].cpu(), value, rtol=1e-6, atol=0, equal_nan=True)
    torch_path = ops_head_stats(A, Z, G, g, branch=branch, backend="torch", radial_spread=True)
    assert _worst(stat_errors(per_batch, torch_path)) <= TOL


@pytest.mark.parametrize("n,d_in,d_out,m,bias,branch", [(70, 33, 20, 12, True, "u"), (66, 17, 40, 9, False, "w"),
                                                        (9, 5, 7, 64, True, "u")])
@pytest.mark.parametrize("drift", [False, True])
def test_grouped_head_stats_triton_equals_torch_and_brute_force(gen, n, d_in, d_out, m, bias, branch, drift):
    """The default head-mode form (grouped error bars) on the head_stack kernel: the same numbers as the torch
    path and as the float64 brute force of the grouped estimators."""
    A, Z, G, g = _head_inputs(gen, n, d_in, d_out, m, bias)
    kw = {}
    T_drift = None
    if drift:  # the drift from its own 2m batches in K groups (the heat's m are the first of them)
        k = min(8, m)
        Gd = torch.cat([G, 0.5 * _rand(gen, d_out, d_in)[None].float() + _rand(gen, m, d_out, d_in).float()])
        gd = torch.cat([g, _rand(gen, m, d_out).float()]) if bias else None
        kw = {"drift_means": torch.stack([Gd[j::k].mean(0) for j in range(k)]),
              "drift_counts": [len(range(j, 2 * m, k)) for j in range(k)]}
        if bias:
            kw["drift_bias"] = torch.stack([gd[j::k].mean(0) for j in range(k)])
        T_drift = -torch.einsum("bji,ni->bnj", Gd.double(), A.double())
        if bias:
            T_drift = T_drift - gd.double()[:, None, :]
    on_device = [None if x is None else x.to(DEVICE) for x in (A, Z, G, g)]
    fast = ops_head_stats(*on_device, branch=branch, backend="triton",
                          **{key: (v.to(DEVICE) if torch.is_tensor(v) else v) for key, v in kw.items()})
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
        assert _worst(errors) <= TOL and _sign_ok(errors), errors
        for q in ("D", "m2", "V2", "Q"):
            got_loo, want_loo = got["loo"][q + sfx].cpu().double(), truth["loo"][q + sfx].double()
            scale = want_loo[torch.isfinite(want_loo)].abs().max()
            assert torch.allclose(got_loo, want_loo, rtol=0, atol=float(TOL * scale), equal_nan=True), q
        assert torch.equal(got["reason"].cpu(), truth["reason"])
    for key in keys[:1] + keys[3:]:
        torch.testing.assert_close(fast[key].cpu().double(), slow[key].double(), rtol=1e-4, atol=1e-4 * float(
            slow[key][torch.isfinite(slow[key])].abs().max()), equal_nan=True)


def test_head_launchers_validate():
    A, Z = torch.randn(5, 4), torch.randn(5, 3)
    g_bar, s_c = torch.randn(3, 5), torch.randn(5, 5)
    with pytest.raises(ValueError, match=r"head_stats: expected g_bar contiguous float32 "
                                         r"of shape \(3, 4\)"):
        head_stats(A, Z, g_bar, s_c)
    with pytest.raises(ValueError, match=r"head_stats: expected out contiguous float32 "
                                         r"of shape \(4, 5\)"):
        head_stats(A, Z, g_bar, s_c, has_bias=True, out=torch.empty(6, 5))
    with pytest.raises(ValueError, match=r"project: expected at least 2 virtual batches"):
        project(A, Z, g_bar, torch.randn(1, 3, 5), has_bias=True)
    with pytest.raises(ValueError, match=r"project: expected branch 'u' or 'w'"):
        project(A, Z, g_bar, torch.randn(2, 3, 5), has_bias=True, branch="uw")


# ------------------------------------------------------------- CUDA only
gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (TRITON_INTERPRET=0)")


@gpu
@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_on_gpu(gen, low):
    A, Z, G, g = _head_inputs(gen, 4099, 384, 256, 16, True)
    A64, Z64 = A.double(), Z.double()
    T = -torch.einsum("bji,ni->bnj", G.double(), A64) - g.double()[:, None, :]
    want = brute_force_stats(T, Z64, "u")
    low_inputs = [x.to(low).cuda() for x in (A, Z, G, g)]
    plain = stat_errors(project_reference(*low_inputs), want)
    fast = stat_errors(ops_head_stats(A.to(low).cuda(), Z.to(low).cuda(), G.cuda(), g.cuda(), radial_spread=True),
                       want)
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
        assert _worst(stat_errors(got, want, keys)) <= TOL
    tf32 = ops_head_stats(A, Z, G, g, form="S", radial_spread=False, allow_tf32=True)
    assert _worst(stat_errors(tf32, want, ["D", "m2", "V2", "Q"])) <= 5e-3


@gpu
def test_accumulate_large_on_gpu(gen):
    n, d, m = 100_003, 384, 16
    t = (0.3 + torch.randn(m, n, d, generator=gen)).cuda()
    z = torch.randn(n, d, generator=gen).cuda()
    got = ProbeAccumulator(n, d, device="cuda").update(t[:5], z).update(t[5:], z).finalize()
    want = brute_force_stats(t.double(), z.double(), "u")
    errors = stat_errors(got, want)
    assert _worst(errors) <= TOL and _sign_ok(errors), errors


def test_interpreter_flag_is_set_for_cpu_runs():
    assert ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------- head_stack
STACK_CASES = [  # n, d_in, d_out, k1, k2, bias
    (1, 1, 1, 1, 1, False),
    (37, 32, 48, 2, 2, True),  # aligned widths: contiguous inputs go in without a copy
    (7, 3, 5, 1, 3, True),
    (13, 17, 11, 4, 1, False),
    (70, 33, 20, 3, 2, True),
    (66, 65, 7, 1, 2, False),
    (5, 4, 3, 0, 2, True),
    (29, 6, 37, 5, 0, True),
]


def _stack_inputs(gen, n, d_in, d_out, k1, k2, bias):
    da = d_in + int(bias)
    A = _rand(gen, n, d_in)
    Z = _rand(gen, n, d_out) + 0.2
    G = 0.5 * _rand(gen, 1, d_out, da) + _rand(gen, k1, d_out, da)
    S = _rand(gen, k2, da, da)  # not symmetric: the quadratic form only sees (S + Sᵀ)/2
    S[0:1] = S[0:1] @ S[0:1].transpose(1, 2) if k2 else S[0:1]
    return A.float(), Z.float(), G.float(), S.float()


def _stack_brute_force(A, Z, G, S, bias):
    """Every product straight from its definition, all at once, in float64."""
    A, Z, G, S = (x.double() for x in (A, Z, G, S))
    if bias:
        A = torch.cat([A, torch.ones(A.shape[0], 1, dtype=A.dtype)], 1)
    v = torch.einsum("kjd,nd->nkj", G, A)
    return {"zdot": torch.einsum("nj,nkj->nk", Z, v), "sq": v.square().sum(-1),
            "quad": torch.einsum("nd,kde,ne->nk", A, S, A),
            "norm": Z.square().sum(1).sqrt()}


@pytest.mark.parametrize("n,d_in,d_out,k1,k2,bias", STACK_CASES)
def test_head_stack_kernel(gen, n, d_in, d_out, k1, k2, bias):
    A, Z, G, S = _stack_inputs(gen, n, d_in, d_out, k1, k2, bias)
    if d_in % 16:  # strided probe inputs: A column-major, Z every other column of a wider tensor
        a_dev = A.T.contiguous().T.to(DEVICE)
        z_dev = torch.stack([Z, -Z], 2)[:, :, 0].to(DEVICE)
    else:
        a_dev, z_dev = A.to(DEVICE), Z.to(DEVICE)
    got = head_stack(a_dev, z_dev, G.to(DEVICE), S.to(DEVICE), has_bias=bias)
    assert all(x.dtype == torch.float32 and x.is_contiguous() for x in got)
    want = _stack_brute_force(A, Z, G, S, bias)
    truths = [want]
    if k1 and k2:  # the reference stacks its per-matrix results: it needs both stacks
        ref = head_stack_reference(A.double(), Z.double(), G.double(), S.double(), has_bias=bias)
        truths.append(ref)
    for truth in truths:
        errors = head_stack_errors(got, truth, A, Z, G, S, has_bias=bias)
        assert max(errors.values()) <= TOL, errors


def test_head_stack_every_gpu_tile_configuration_computes_the_same(gen):
    """Each autotuning candidate (block shape) runs through the interpreter on an awkward shape."""
    n, d_in, d_out, k1, k2 = 70, 37, 45, 2, 2
    A, Z, G, S = _stack_inputs(gen, n, d_in, d_out, k1, k2, True)
    want = _stack_brute_force(A, Z, G, S, True)
    shapes = {(c["BLOCK_N"], c["BLOCK_J"], c["BLOCK_K"])
              for dtype, prec in ((torch.float32, "ieee"), (torch.float32, "tf32"),
                                  (torch.bfloat16, "ieee"))
              for c in head_configs(d_in=d_in, d_out=d_out, dtype=dtype, precision=prec,
                                    for_gpu=True)}
    with capture_launches() as launches:
        outs = head_stack(A.to(DEVICE), Z.to(DEVICE), G.to(DEVICE), S.to(DEVICE), has_bias=True)
    (spec,) = launches
    for bn, bj, bk in sorted(shapes):
        for x in outs:
            x.fill_(float("nan"))  # poisoned: every entry must be written
        cfg = {"BLOCK_N": bn, "BLOCK_J": bj, "BLOCK_K": bk, "num_warps": 4}
        spec.kernel[spec.grid(cfg)](*spec.args, **spec.meta, **cfg)
        errors = head_stack_errors(outs, want, A, Z, G, S, has_bias=True)
        assert max(errors.values()) <= TOL, (cfg, errors)


def test_head_stack_non_finite_rows_stay_in_their_rows(gen):
    A, Z, G, S = _stack_inputs(gen, 9, 5, 4, 2, 2, False)
    A[2, 1] = float("inf")
    Z[4] = 0.0
    Z[6, 0] = float("nan")
    zdot, sq, quad, norm = (x.cpu() for x in head_stack(A.to(DEVICE), Z.to(DEVICE),
                                                         G.to(DEVICE), S.to(DEVICE)))
    assert not torch.isfinite(sq[2]).any() and not torch.isfinite(quad[2]).any()
    assert norm[4] == 0 and torch.isnan(norm[6]) and torch.isnan(zdot[6]).all()
    others = [i for i in range(9) if i not in (2, 6)]
    assert torch.isfinite(torch.cat([zdot[others], sq[others], quad[others]], 1)).all()


def test_head_stack_validates():
    A, Z = torch.randn(5, 4, device=DEVICE), torch.randn(5, 3, device=DEVICE)
    G, S = torch.randn(2, 3, 4, device=DEVICE), torch.randn(1, 4, 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"head_stack: expected G \[K1, d_out, da\] = \[K1, 3, 5\]"):
        head_stack(A, Z, G, S, has_bias=True)
    with pytest.raises(ValueError, match=r"head_stack: expected S \[K2, da, da\] = \[K2, 4, 4\]"):
        head_stack(A, Z, G, S[0])
    with pytest.raises(ValueError, match=r"same N"):
        head_stack(A, Z[:4], G, S)
    with pytest.raises(TypeError, match=r"head_stack: expected A to have dtype"):
        head_stack(A.double(), Z, G, S)
    with pytest.raises(TypeError, match=r"head_stack: expected G to be a float tensor"):
        head_stack(A, Z, G.long(), S)
    zdot, sq, quad, norm = head_stack(A[:0], Z[:0], G, None)
    assert zdot.shape == (0, 2) and quad.shape == (0, 0) and norm.shape == (0,)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_low_precision_operands_keep_the_tolerance_rule(gen, low):
    """What the kernel does for 16-bit inputs, in plain torch (no GPU, no interpreter needed).

    The launcher rounds the folded right factors to the input dtype so that the
    products run on tensor cores with fp32 accumulation. Emulated here with the
    launcher's own operand layout and float64 accumulation, the error against
    float64 on the same rounded inputs must stay inside the flash-attention rule
    of the tolerance table against plain torch in that dtype (and below plain
    torch's own error: it rounds the same operands, and its outputs too).
    """
    n, d_in, d_out, k1, k2 = 512, 96, 80, 3, 2
    A, Z, G, S = _stack_inputs(gen, n, d_in, d_out, k1, k2, True)
    S = S @ S.transpose(1, 2) / d_in  # second moments are PSD
    A, Z = A.to(low), Z.to(low)
    want = _stack_brute_force(A, Z, G, S, True)
    gw, gb, lw, lb = head_stack_operands(G, S, d_in, d_out, True, low)
    assert gw.shape[1:] == (d_out, d_in) and lw.shape[1:] == (d_in, d_in)  # 16-multiples already
    a = A.double()
    v = torch.einsum("kjd,nd->nkj", gw.double(), a) + gb.double()[None]
    p = torch.einsum("kjd,nd->nkj", lw.double(), a) + lb[:, :d_in].double()[None]
    emulated = (torch.einsum("nj,nkj->nk", Z.double(), v), v.square().sum(-1),
                (p * a[:, None]).sum(-1) + lb[:, d_in].double()[None], want["norm"])
    plain = head_stack_reference(A, Z, G.to(low), S.to(low), has_bias=True)
    fast = head_stack_errors(emulated, want, A, Z, G, S, has_bias=True)
    base = head_stack_errors(plain, want, A, Z, G, S, has_bias=True)
    for key in ("zdot", "sq", "quad"):
        assert fast[key] <= allowed_error(low, base[key]), (key, fast[key], base[key])
        assert fast[key] <= base[key], (key, fast[key], base[key])  # fp32 outputs, not 16-bit


def test_head_stack_copies_only_rows_that_are_not_16_aligned(gen):
    """Aligned contiguous inputs go to the kernel as they are; others as zero-padded copies."""
    A, Z, G, S = _stack_inputs(gen, 5, 32, 48, 1, 1, False)
    with capture_launches() as launches:
        head_stack(A, Z, G, S)
        head_stack(A[:, :31], Z[:, 1:], G[:, 1:, :31], S[:, :31, :31])
    aligned, odd = launches
    assert aligned.args[0] is A and aligned.args[1] is Z
    a, z = odd.args[0], odd.args[1]
    assert a.shape == (5, 32) and z.shape == (5, 48) and a.is_contiguous() and z.is_contiguous()
    assert torch.equal(a[:, :31], A[:, :31]) and not a[:, 31].any() and not z[:, 47].any()


@pytest.mark.parametrize("branch,d", [("u", 300), ("uw", 100), ("w", 3)])
def test_accumulate_every_gpu_tile_configuration_computes_the_same(gen, branch, d):
    """The GPU candidates (rows per tile down to one) through the interpreter, one update each."""
    n, k = 7, 3
    t, z = _rand(gen, k, n, d).float(), (_rand(gen, n, d) + 0.3).float()
    t_w = _rand(gen, k, n, d).float() if branch == "uw" else None
    want = brute_force_stats(t, z, branch, t_w)
    for cfg in accumulate_configs(dim=d, branch=branch, for_gpu=True):
        acc = ProbeAccumulator(n, d, branch=branch, backend="triton", device=DEVICE)
        with capture_launches() as launches:
            acc.update(t.to(DEVICE), z.to(DEVICE), t_w=None if t_w is None else t_w.to(DEVICE))
        (spec,) = launches
        spec.kernel[spec.grid(cfg)](*spec.args, **spec.meta, **cfg)  # update() counted the K
        errors = stat_errors(acc.finalize(), want)
        assert _worst(errors) <= TOL and _sign_ok(errors), (cfg, errors)
