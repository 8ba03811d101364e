"""The stacked head products (kernels/head_stack.py) against their reference
(normfast.core.reference.head_stack_reference) and products straight from their definitions.

On a machine without a GPU the kernels run through ``TRITON_INTERPRET=1`` (set in conftest.py before
triton is imported): sizes stay small and inputs fp32. The CUDA-only cases run where a GPU is present
and the interpreter is off; the compiled path is checked without a GPU by tests/kernels/test_resources.py.
"""

import pytest
import torch

from tests.kernels._helpers import DEVICE, TOL, rand, skip_without_kernels

skip_without_kernels()

from normfast.core.reference import allowed_error, head_stack_errors, head_stack_reference  # noqa: E402
from normfast.kernels import capture_launches, head_configs, head_stack  # noqa: E402
from normfast.kernels.head_stack import head_stack_operands  # noqa: E402

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
    A = rand(gen, n, d_in)
    Z = rand(gen, n, d_out) + 0.2
    G = 0.5 * rand(gen, 1, d_out, da) + rand(gen, k1, d_out, da)
    S = rand(gen, k2, da, da)  # not symmetric: the quadratic form only sees (S + Sᵀ)/2
    S[0:1] = S[0:1] @ S[0:1].transpose(1, 2) if k2 else S[0:1]
    return A.float(), Z.float(), G.float(), S.float()


def _stack_brute_force(A, Z, G, S, bias):
    """Every product straight from its definition, all at once, in float64."""
    A, Z, G, S = (x.double() for x in (A, Z, G, S))
    if bias:
        A = torch.cat([A, torch.ones(A.shape[0], 1, dtype=A.dtype)], 1)
    v = torch.einsum("kjd,nd->nkj", G, A)
    return {
        "zdot": torch.einsum("nj,nkj->nk", Z, v),
        "sq": v.square().sum(-1),
        "quad": torch.einsum("nd,kde,ne->nk", A, S, A),
        "norm": Z.square().sum(1).sqrt(),
    }


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
    shapes = {
        (c["BLOCK_N"], c["BLOCK_J"], c["BLOCK_K"])
        for dtype, prec in ((torch.float32, "ieee"), (torch.float32, "tf32"), (torch.bfloat16, "ieee"))
        for c in head_configs(d_in=d_in, d_out=d_out, dtype=dtype, precision=prec, for_gpu=True)
    }
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
    zdot, sq, quad, norm = (x.cpu() for x in head_stack(A.to(DEVICE), Z.to(DEVICE), G.to(DEVICE), S.to(DEVICE)))
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
    emulated = (
        torch.einsum("nj,nkj->nk", Z.double(), v),
        v.square().sum(-1),
        (p * a[:, None]).sum(-1) + lb[:, d_in].double()[None],
        want["norm"],
    )
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
