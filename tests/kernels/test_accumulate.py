"""The accumulate kernel (kernels/accumulate.py) against its plain-torch reference
(normfast.core.reference.accumulate_reference) and the float64 brute force; every GPU tile
configuration through the interpreter.

On a machine without a GPU the kernels run through ``TRITON_INTERPRET=1`` (set in conftest.py before
triton is imported): sizes stay small and inputs fp32. The CUDA-only cases run where a GPU is present
and the interpreter is off; the compiled path is checked without a GPU by tests/kernels/test_resources.py.
"""

import os

import pytest
import torch

from tests.kernels._helpers import DEVICE, ON_GPU, TOL, gpu, rand, sign_ok, skip_without_kernels, worst

skip_without_kernels()

from normfast.core.reference import accumulate_reference, brute_force_stats, stat_errors  # noqa: E402
from normfast.kernels import MAX_FUSED_DIM, accumulate, block_sizes, capture_launches, head_configs  # noqa: E402
from normfast.kernels.utils import MAX_BLOCK_ROWS, accumulate_configs  # noqa: E402
from normfast.ops import ProbeAccumulator  # noqa: E402


def _acc_cases():
    """Branch "u" over every N x d with M cycling through {2, 5, 64}; a few w / uw cases.

    N = 333 rows span several row blocks with a partial last one at every block height (the
    interpreter runs each block in Python: 1000 rows took three times as long, for no more cover)."""
    cases = []
    for i, n in enumerate((1, 7, 333)):
        for j, d in enumerate((1, 3, 64, 384)):
            m = (2, 5, 64)[(i + j) % 3]
            cases.append(("u", n, d, m if n * d * m <= 5_000_000 else 5))
    return cases + [("w", 7, 3, 5), ("uw", 7, 3, 5), ("uw", 5, 384, 2), ("w", 3, 200, 64), ("uw", 333, 64, 2)]


ACC_CASES = _acc_cases()


@pytest.mark.parametrize("branch,n,d,m", ACC_CASES)
def test_accumulate_kernel(gen, branch, n, d, m):
    Z = rand(gen, n, d) + 0.3
    T = 0.4 * rand(gen, n, d)[None] + rand(gen, m, n, d)
    T_w = rand(gen, m, n, d) if branch == "uw" else None
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
    ref_state = accumulate_reference(
        empty, t32.double(), Z.float().double(), branch=branch, t_w=None if tw32 is None else tw32.double()
    )
    ref = ProbeAccumulator(n, d, branch=branch, dtype=torch.float64)
    ref = ref.load_state_dict(ref_state).finalize()
    torch_path = ProbeAccumulator(n, d, branch=branch, backend="torch")
    for lo, hi in ((0, split), (split, m)):
        torch_path.update(t32[lo:hi], Z.float(), t_w=None if tw32 is None else tw32[lo:hi])

    want = brute_force_stats(T.float(), Z.float(), branch, None if T_w is None else T_w.float())
    for other in (ref, torch_path.finalize(), want):
        errors = stat_errors(got, other)
        assert worst(errors) <= TOL and sign_ok(errors), errors
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
    for dtype, precision in (
        (torch.float32, "ieee"),
        (torch.float32, "tf32"),
        (torch.bfloat16, "ieee"),
        (torch.float16, "ieee"),
    ):
        pool = head_configs(d_in=384, d_out=256, dtype=dtype, precision=precision, for_gpu=True)
        assert len(pool) >= 2 and all(c["BLOCK_N"] <= MAX_BLOCK_ROWS for c in pool)
        assert all(min(c["BLOCK_J"], c["BLOCK_N"]) >= 16 and c["BLOCK_K"] >= 8 for c in pool)
    # the interpreter never autotunes: one configuration per launch
    assert len(head_configs(d_in=384, d_out=256)) == 1 or ON_GPU
    for d in (1, 3, 384, 1000, MAX_FUSED_DIM):
        for cfg in accumulate_configs(dim=d, for_gpu=True):
            per_thread = cfg["BLOCK_N"] * cfg["BLOCK_D"] / (32 * cfg["num_warps"])
            assert cfg["BLOCK_D"] >= d and per_thread <= 8, (d, cfg)


@gpu
def test_accumulate_large_on_gpu(gen):
    n, d, m = 100_003, 384, 16
    t = (0.3 + torch.randn(m, n, d, generator=gen)).cuda()
    z = torch.randn(n, d, generator=gen).cuda()
    got = ProbeAccumulator(n, d, device="cuda").update(t[:5], z).update(t[5:], z).finalize()
    want = brute_force_stats(t.double(), z.double(), "u")
    errors = stat_errors(got, want)
    assert worst(errors) <= TOL and sign_ok(errors), errors


def test_interpreter_flag_is_set_for_cpu_runs():
    assert ON_GPU or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.parametrize("branch,d", [("u", 300), ("uw", 100), ("w", 3)])
def test_accumulate_every_gpu_tile_configuration_computes_the_same(gen, branch, d):
    """The GPU candidates (rows per tile down to one) through the interpreter, one update each."""
    n, k = 7, 3
    t, z = rand(gen, k, n, d).float(), (rand(gen, n, d) + 0.3).float()
    t_w = rand(gen, k, n, d).float() if branch == "uw" else None
    want = brute_force_stats(t, z, branch, t_w)
    for cfg in accumulate_configs(dim=d, branch=branch, for_gpu=True):
        acc = ProbeAccumulator(n, d, branch=branch, backend="triton", device=DEVICE)
        with capture_launches() as launches:
            acc.update(t.to(DEVICE), z.to(DEVICE), t_w=None if t_w is None else t_w.to(DEVICE))
        (spec,) = launches
        spec.kernel[spec.grid(cfg)](*spec.args, **spec.meta, **cfg)  # update() counted the K
        errors = stat_errors(acc.finalize(), want)
        assert worst(errors) <= TOL and sign_ok(errors), (cfg, errors)
