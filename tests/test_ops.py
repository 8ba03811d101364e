"""Bad input to normfast.ops: the error type, and a message naming the argument.

Several cases use inputs far too large to allocate (views made by expand) or
tensors on the meta device, so a test also fails if validation comes after
the first large allocation or computation.
"""

import numpy as np
import pytest
import torch

from normfast import ops
from normfast.core.reference.accumulate import _NON_FINITE_DISPLACEMENT, _NON_FINITE_EMBEDDING, _ZERO_NORM
from normfast.ops import REASONS, ProbeAccumulator, head_stats, prepare_head

HUGE = 10**9  # rows: expanded views cost nothing, anything materialized would fail


def _huge(n, d):
    return torch.ones(1, d).expand(n, d)


# ----------------------------------------------------------- ProbeAccumulator
@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        (dict(n_probes=0, dim=3), ValueError, r"ProbeAccumulator: expected n_probes to be an integer >= 1, got 0"),
        (dict(n_probes=4, dim=0), ValueError, r"expected dim to be an integer >= 1, got 0"),
        (dict(n_probes=4, dim=2.5), ValueError, r"expected dim to be an integer >= 1, got 2.5"),
        (
            dict(n_probes=HUGE, dim=HUGE, branch="v"),
            ValueError,
            r"ProbeAccumulator: expected branch to be one of \('u', 'w', 'uw'\), got branch='v'",
        ),
        (
            dict(n_probes=HUGE, dim=HUGE, dtype=torch.bfloat16),
            TypeError,
            r"expected dtype torch.float32 or torch.float64, got dtype=torch.bfloat16",
        ),
        (dict(n_probes=HUGE, dim=HUGE, backend="cuda"), ValueError, r"expected backend to be one of"),
        (
            dict(n_probes=3, dim=4, dtype=torch.float64, backend="triton"),
            ValueError,
            r"backend='triton' needs dtype=torch.float32",
        ),
    ],
)
def test_constructor_errors(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ProbeAccumulator(**kwargs)


@pytest.fixture
def acc():
    return ProbeAccumulator(5, 3)


def test_update_shape_errors(acc):
    z = torch.randn(5, 3)
    with pytest.raises(
        ValueError,
        match=r"update: expected t to be \[N, d\] or \[K, N, d\] "
        r"with N=5, d=3, got t.shape=\(1, 2, 5, 3\)",
    ):
        acc.update(torch.randn(1, 2, 5, 3), z)
    with pytest.raises(
        ValueError,
        match=r"expected z to be \[N, d\] with N=5, d=3, "
        r"got z.shape=\(5,\)",
    ):
        acc.update(torch.randn(5, 3), torch.randn(5))
    with pytest.raises(
        ValueError,
        match=r"expected z of shape \(N, d\)=\(5, 3\), "
        r"got z.shape=\(4, 3\)",
    ):
        acc.update(torch.randn(2, 5, 3), torch.randn(4, 3))
    with pytest.raises(
        ValueError,
        match=r"expected t of shape \[K, N, d\] with \(N, d\)=\(5, 3\), "
        r"got t.shape=\(2, 5, 4\)",
    ):
        acc.update(torch.randn(2, 5, 4), z)
    with pytest.raises(
        ValueError,
        match=r"expected t of shape .* "
        r"got t.shape=\(2, 1000000000, 3\)",
    ):
        acc.update(torch.ones(1, 1, 3).expand(2, HUGE, 3), z)
    assert acc.M == 0  # nothing was applied by the failed calls


def test_update_dtype_errors(acc):
    z = torch.randn(5, 3)
    with pytest.raises(
        TypeError,
        match=r"update: expected t to have a floating dtype .* "
        r"got t.shape=\(2, 5, 3\), dtype=torch.int64",
    ):
        acc.update(torch.ones(2, 5, 3, dtype=torch.int64), z)
    with pytest.raises(TypeError, match=r"expected z to have a floating dtype .* dtype=torch.bool"):
        acc.update(torch.randn(2, 5, 3), torch.ones(5, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"expected t to be a numeric array"):
        acc.update(np.array([["a"]], dtype=object), z)
    with pytest.raises(TypeError, match=r"expected t to be a torch.Tensor, numpy array or DLPack"):
        acc.update([[1.0, 2.0, 3.0]], z)


def test_update_device_errors(acc):
    with pytest.raises(
        ValueError,
        match=r"update: expected all inputs on one device, "
        r"got accumulator on cpu, t on meta, z on cpu",
    ):
        acc.update(torch.empty(2, 5, 3, device="meta"), torch.randn(5, 3))


def test_branch_argument_errors():
    z = torch.randn(5, 3)
    with pytest.raises(
        ValueError,
        match=r"expected t_w \(the w-branch displacements\) "
        r"for branch='uw', got t_w=None",
    ):
        ProbeAccumulator(5, 3, branch="uw").update(torch.randn(2, 5, 3), z)
    with pytest.raises(
        ValueError,
        match=r"expected t_w=None for branch='u' .* "
        r"got t_w.shape=\(2, 5, 3\)",
    ):
        ProbeAccumulator(5, 3).update(torch.randn(2, 5, 3), z, t_w=torch.randn(2, 5, 3))
    with pytest.raises(
        ValueError,
        match=r"expected t_w.shape == t.shape=\(2, 5, 3\), "
        r"got t_w.shape=\(3, 5, 3\)",
    ):
        acc_uw = ProbeAccumulator(5, 3, branch="uw")
        acc_uw.update(torch.randn(2, 5, 3), z, t_w=torch.randn(3, 5, 3))


@pytest.mark.parametrize("m", [0, 1])
def test_finalize_needs_two_directions(acc, m):
    if m:
        acc.update(torch.randn(5, 3), torch.randn(5, 3))
    with pytest.raises(
        ValueError,
        match=rf"finalize: expected at least 2 directions "
        rf"\(M >= 2\), got M={m}",
    ):
        acc.finalize()


@pytest.mark.parametrize(
    "other,exc,pattern",
    [
        (
            lambda: ProbeAccumulator(5, 3, branch="w"),
            ValueError,
            r"merge: expected an accumulator with \(n_probes, dim, branch, dtype, device\)="
            r"\(5, 3, 'u', .*got \(5, 3, 'w'",
        ),
        (lambda: ProbeAccumulator(6, 3), ValueError, r"got \(6, 3, 'u'"),
        (lambda: ProbeAccumulator(5, 4), ValueError, r"got \(5, 4, 'u'"),
        (lambda: ProbeAccumulator(5, 3, dtype=torch.float64), ValueError, r"torch.float64"),
        (lambda: {"n": torch.tensor(3)}, TypeError, r"merge: expected a ProbeAccumulator, got dict"),
    ],
)
def test_merge_incompatible(acc, other, exc, pattern):
    with pytest.raises(exc, match=pattern):
        acc.merge(other())


def test_load_state_dict_errors(acc):
    state = ProbeAccumulator(5, 3, branch="uw").state_dict()
    with pytest.raises(
        ValueError,
        match=r"load_state_dict: expected keys .* "
        r"missing \[\], unexpected "
        r"\['M2_w', 'cross'",
    ):
        acc.load_state_dict(state)
    state = acc.state_dict()
    state["mean_u"] = torch.zeros(5, 4)
    with pytest.raises(
        ValueError,
        match=r"expected mean_u of shape \(5, 3\), "
        r"got mean_u.shape=\(5, 4\)",
    ):
        acc.load_state_dict(state)
    state = acc.state_dict()
    state["npos_u"] = torch.zeros(5)
    with pytest.raises(TypeError, match=r"expected npos_u with dtype torch.int64"):
        acc.load_state_dict(state)


# ----------------------------------------------------------------- head mode
def _head(n=6, d_in=4, d_out=3, m=5):
    return (torch.randn(n, d_in), torch.randn(n, d_out), torch.randn(m, d_out, d_in), torch.randn(m, d_out))


HEAD_INPUT_CASES = [  # (mutation of (A, Z, G, g), error, message)
    (
        lambda A, Z, G, g: (A[0], Z, G, g),
        ValueError,
        r"head_mode_stats: expected A to be 2-D \[N, d_in\], got A.shape=\(4,\)",
    ),
    (lambda A, Z, G, g: (A, Z[None], G, g), ValueError, r"expected Z to be 2-D \[N, d_out\], got Z.shape=\(1, 6, 3\)"),
    (lambda A, Z, G, g: (A, Z, G[0], g), ValueError, r"expected G to be 3-D \[M, d_out, d_in\], got G.shape=\(3, 4\)"),
    (lambda A, Z, G, g: (A, Z[:5], G, g), ValueError, r"expected Z with N=6 rows like A, got Z.shape=\(5, 3\)"),
    (
        lambda A, Z, G, g: (A[:, :3], Z, G, g),
        ValueError,
        r"expected A of shape \[N, d_in\] with d_in=4 from G, got A.shape=\(6, 3\)",
    ),
    (
        lambda A, Z, G, g: (A, Z[:, :2], G, g),
        ValueError,
        r"expected Z of shape \[N, d_out\] with d_out=3 from G, got Z.shape=\(6, 2\)",
    ),
    (
        lambda A, Z, G, g: (A, Z, G, g[:, :2]),
        ValueError,
        r"expected g_bias of shape \[M, d_out\]=\(5, 3\) matching G, got g_bias.shape=\(5, 2\)",
    ),
    (
        lambda A, Z, G, g: (A, Z, G, g[0]),
        ValueError,
        r"expected g_bias to be 2-D \[M, d_out\], got g_bias.shape=\(3,\)",
    ),
    (
        lambda A, Z, G, g: (A, Z, G[:1], g[:1]),
        ValueError,
        r"expected at least 2 virtual batches \(M >= 2\) in G \[M, d_out, d_in\], "
        r"got G.shape=\(1, 3, 4\)",
    ),
    (lambda A, Z, G, g: (A[:0], Z[:0], G, g), ValueError, r"expected at least one probe row, got A.shape=\(0, 4\)"),
    (lambda A, Z, G, g: (A.int(), Z, G, g), TypeError, r"expected A to have a floating dtype .* dtype=torch.int32"),
    (lambda A, Z, G, g: (A, Z, G.to(torch.int8), g), TypeError, r"expected G to have a floating dtype"),
    (lambda A, Z, G, g: (A, Z, G, g.to(torch.int64)), TypeError, r"expected g_bias to have a floating dtype"),
    (
        lambda A, Z, G, g: (A, Z, G.to("meta"), None),
        ValueError,
        r"expected all inputs on one device, got A on cpu, Z on cpu, G on meta",
    ),
    (lambda A, Z, G, g: (A, Z, G, g.to("meta")), ValueError, r"got G on cpu, g_bias on meta"),
    (
        lambda A, Z, G, g: (_huge(HUGE, 4), _huge(HUGE - 1, 3), G, g),
        ValueError,
        r"expected Z with N=1000000000 rows like A, got Z.shape=\(999999999, 3\)",
    ),
]


@pytest.mark.parametrize("mutate,exc,pattern", HEAD_INPUT_CASES)
def test_head_input_errors(mutate, exc, pattern):
    with pytest.raises(exc, match=pattern):
        head_stats(*mutate(*_head()))


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        (dict(branch="uw"), ValueError, r"head_mode_stats: expected branch 'u' or 'w' .* got branch='uw'"),
        (dict(branch="x"), ValueError, r"got branch='x'"),
        (
            dict(form="ghost"),
            ValueError,
            r"expected form to be one of \('auto', 'grouped', 'S', 'per_batch'\), got form='ghost'",
        ),
        (dict(form="S", radial_spread=True), ValueError, r"expected radial_spread=False with form='S'"),
        (dict(form="grouped", uncertainty=False), ValueError, r"expected uncertainty=True .* with form='grouped'"),
        (
            dict(groups=1),
            ValueError,
            r"expected groups \(K, the batch groups of the error bars\) to be an integer >= 2",
        ),
        (dict(backend="gpu"), ValueError, r"expected backend to be one of"),
        (dict(dtype=torch.float16), TypeError, r"expected dtype None, torch.float32 or torch.float64"),
    ],
)
def test_head_option_errors(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        head_stats(*_head(), **kwargs)


def test_head_directions_errors():
    A, Z, G, g = _head()
    dirs = prepare_head(G, g)
    with pytest.raises(ValueError, match=r"expected g_bias=None when G is a HeadDirections"):
        head_stats(A, Z, dirs, g)
    with pytest.raises(ValueError, match=r"expected A of shape \[N, d_in\] with d_in=4 from G"):
        head_stats(A[:, :2], Z, dirs)
    with pytest.raises(ValueError, match=r"prepare_head: expected at least 2 virtual batches"):
        prepare_head(G[:1])
    with pytest.raises(ValueError, match=r"prepare_head: expected non-empty d_out and d_in"):
        prepare_head(G[:, :, :0])


def test_reason_codes_and_lazy_exports():
    assert REASONS == ("ok", "zero_norm", "non_finite_embedding", "non_finite_displacement")
    codes = (_ZERO_NORM, _NON_FINITE_EMBEDDING, _NON_FINITE_DISPLACEMENT)
    assert tuple(REASONS[c] for c in codes) == REASONS[1:]
    assert {"solve_quartic", "equilibrium_coefficients", "equilibrium_norm"} <= set(dir(ops))
    with pytest.raises(AttributeError, match="has no attribute 'not_a_function'"):
        ops.not_a_function  # noqa: B018
