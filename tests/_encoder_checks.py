"""Checks shared by the encoder adapter tests (test_encoders, test_mpnet): stage bookkeeping,
staged forwards against the full forward, tail JVPs against central differences, and tangents
batched with vmap against a loop over them."""

from __future__ import annotations

import torch
from torch.func import functional_call, jvp, vmap

from normfast.encoders import Encoder, forward_ad_safe


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check_stage_cover(enc: Encoder) -> None:
    """Every parameter in exactly one stage, and stage_of_parameters agrees with the views."""
    names = [n for n, _ in enc.named_parameters()]
    listed = [n for _, module in enc.stages for n, _ in module.named_parameters()]
    assert sorted(listed) == sorted(names)
    assert len(listed) == len(set(listed))
    owner = enc.stage_of_parameters()
    for k, (_, module) in enumerate(enc.stages):
        for n, p in module.named_parameters():
            assert owner[n] == k
            assert p is enc.get_parameter(n)
    assert len(enc.stages) == enc.n_stages


def check_cuts(enc: Encoder, state: dict, outputs=("pooled", "tokens")) -> None:
    with torch.no_grad():
        for output in outputs:
            full = enc(state, output=output)
            for k in range(enc.n_stages):
                front = enc(state, 0, k)
                assert isinstance(front, dict) and "mask" in front
                torch.testing.assert_close(enc(front, k, output=output), full, rtol=0, atol=1e-6)


def check_tail_jvp(enc: Encoder, state: dict, k: int, output: str = "tokens") -> float:
    """Relative error of the tail JVP (w.r.t. the tail's parameters) against central differences."""
    owner = enc.stage_of_parameters()
    with torch.no_grad():
        front = enc(state, 0, k)
    params = {n: p.detach() for n, p in enc.named_parameters() if owner[n] >= k}
    g = torch.Generator().manual_seed(k)
    tangents = {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()}

    def tail(p):
        return functional_call(enc, p, (front,), {"start": k, "output": output})

    with forward_ad_safe():
        _, dz = jvp(tail, (params,), (tangents,))
    eps = 1e-6
    with torch.no_grad():
        plus = tail({n: params[n] + eps * tangents[n] for n in params})
        minus = tail({n: params[n] - eps * tangents[n] for n in params})
    fd = (plus - minus) / (2 * eps)
    assert fd.norm() > 0
    return rel_err(dz, fd)


def check_vmap_over_tangents(enc: Encoder, state: dict, k: int, *, rtol: float, atol: float) -> None:
    """Three tangents of the tail (from stage ``k``) pushed through one vmapped JVP equal a loop over them."""
    owner = enc.stage_of_parameters()
    with torch.no_grad():
        front = enc(state, 0, k)
    params = {n: p.detach() for n, p in enc.named_parameters() if owner[n] >= k}
    g = torch.Generator().manual_seed(0)
    batched = {n: torch.randn((3, *p.shape), generator=g) for n, p in params.items()}

    def push(t):
        return jvp(lambda p: functional_call(enc, p, (front,), {"start": k, "output": "tokens"}), (params,), (t,))[1]

    with forward_ad_safe():
        together = vmap(push)(batched)
        apart = torch.stack([push({n: t[i] for n, t in batched.items()}) for i in range(3)])
    torch.testing.assert_close(together, apart, rtol=rtol, atol=atol)
