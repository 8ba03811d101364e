"""References of the head-mode kernels: the S form, the per-batch form and the stacked products."""
from __future__ import annotations

import numpy as np
import torch

from normfast.core.reference.stats import embedding_codes, nan_where_invalid


def _augment(A, G, g_bias):
    if g_bias is None:
        return A, G
    ones = torch.ones(A.shape[0], 1, dtype=A.dtype, device=A.device)
    return torch.cat([A, ones], 1), torch.cat([G, g_bias[:, :, None].to(G.dtype)], 2)


def _head_common(A, Z, G, g_bias, branch):
    if branch not in ("u", "w"):
        raise ValueError(f"head reference: unknown branch {branch!r}")
    A, Z, G = torch.as_tensor(A), torch.as_tensor(Z), torch.as_tensor(G)
    g_bias = None if g_bias is None else torch.as_tensor(g_bias)
    At, Gt = _augment(A, G, g_bias)
    g_bar = Gt.mean(0)
    g_c = Gt - g_bar[None]
    norm = torch.linalg.vector_norm(Z, dim=1)
    zhat = Z / norm[:, None]
    scale = norm if branch == "u" else torch.ones_like(norm)
    v = At @ g_bar.T
    drift = -scale * (zhat * v).sum(1)
    m2 = scale ** 2 * (v * v).sum(1)
    bad = ~torch.isfinite(A).all(1) | (~torch.isfinite(Gt).all()).expand(A.shape[0])
    return At, g_c, zhat, scale, drift, m2, bad


def head_stats_reference(A, Z, G, g_bias=None, *, branch: str = "u") -> dict:
    """Reference for the ``head_stats`` kernel (S form), in the inputs' dtype.

    ``ã = [a, 1]``, ``G̃_B = [G_B | g_B]``, ``Ḡ = mean G̃_B``,
    ``S_c = Σ_B (G̃_B - Ḡ)ᵀ(G̃_B - Ḡ)/(M-1)``, ``s = R`` ("u") or 1 ("w"):
    ``D = -s ẑ·Ḡã``, ``m2 = s²|Ḡã|²``, ``V2 = s² ãᵀS_cã``, ``Q = m2 + V2``.
    """
    At, g_c, zhat, scale, drift, m2, bad = _head_common(A, Z, G, g_bias, branch)
    m = g_c.shape[0]
    s_c = torch.einsum("bji,bjk->ik", g_c, g_c) / (m - 1)
    v2 = scale ** 2 * ((At @ s_c) * At).sum(1)
    suffix = "" if branch == "u" else "_w"
    stats = {"D" + suffix: drift, "m2" + suffix: m2, "V2" + suffix: v2, "Q" + suffix: m2 + v2}
    out = nan_where_invalid(stats, embedding_codes(torch.as_tensor(Z), bad))
    out["M"] = m
    return out


def project_reference(A, Z, G, g_bias=None, *, branch: str = "u") -> dict:
    """Reference for the ``project`` kernel (per-batch form), in the inputs' dtype.

    As :func:`head_stats_reference`, but ``V2 = s² Σ_B |G̃^c_B ã|²/(M-1)``
    and the radial dots ``r^B = D - s ẑ·(G̃^c_B ã)`` give
    ``se_D = std(r, ddof=1)/√M`` and ``sign_stability``; one batch at a time.
    """
    At, g_c, zhat, scale, drift, m2, bad = _head_common(A, Z, G, g_bias, branch)
    m = g_c.shape[0]
    radial, spread = [], torch.zeros_like(drift)
    for b in range(m):
        y = At @ g_c[b].T
        radial.append(drift - scale * (zhat * y).sum(1))
        spread = spread + (y * y).sum(1)
    radial = torch.stack(radial)
    suffix = "" if branch == "u" else "_w"
    v2 = scale ** 2 * spread / (m - 1)
    agree = torch.sign(radial) == torch.sign(drift)[None]
    stats = {
        "D" + suffix: drift,
        "se_D" + suffix: radial.std(0, correction=1) / np.sqrt(m),
        "sign_stability" + suffix: agree.to(drift.dtype).mean(0),
        "m2" + suffix: m2,
        "V2" + suffix: v2,
        "Q" + suffix: m2 + v2,
    }
    out = nan_where_invalid(stats, embedding_codes(torch.as_tensor(Z), bad))
    out["M"] = m
    return out


def head_stack_reference(A, Z, G, S, *, has_bias: bool = False) -> dict:
    """Reference for the stacked head products (the primitive of the grouped head statistics).

    ``A`` ``[N, d_in]`` probe activations, ``Z`` ``[N, d_out]`` embeddings,
    ``G`` ``[K1, d_out, da]`` a stack of direction matrices (means: overall,
    per group, ...), ``S`` ``[K2, da, da]`` a stack of symmetric second-moment
    matrices, ``da = d_in + 1`` when ``has_bias`` (the last column of ``G`` and
    the last row/column of ``S`` act on the constant 1 of ``ã = [a, 1]``),
    else ``da = d_in`` and ``ã = a``. Per row ``i`` and stack entry ``k``:

    * ``zdot[i, k] = z_i · (G_k ã_i)``  -- ``[N, K1]``
    * ``sq[i, k]   = |G_k ã_i|²``       -- ``[N, K1]``
    * ``quad[i, k] = ã_iᵀ S_k ã_i``     -- ``[N, K2]``
    * ``norm[i]    = |z_i|``            -- ``[N]``

    Every estimator of the grouped head mode (drift, its group spread, m2,
    heat and its group spread) is an O(N K) epilogue over these; the kernel
    and the torch path compute exactly these products. Computed here one
    matrix at a time in the inputs' dtype (float64 for a reference).
    """
    A, Z, G, S = (torch.as_tensor(x) for x in (A, Z, G, S))
    if has_bias:
        A = torch.cat([A, torch.ones(A.shape[0], 1, dtype=A.dtype, device=A.device)], 1)
    if G.shape[-1] != A.shape[1] or S.shape[-1] != A.shape[1] or S.shape[-2] != A.shape[1]:
        raise ValueError(f"head_stack_reference: expected G [K1, d_out, {A.shape[1]}] and "
                         f"S [K2, {A.shape[1]}, {A.shape[1]}], got G.shape={tuple(G.shape)}, "
                         f"S.shape={tuple(S.shape)}")
    zdot, sq, quad = [], [], []
    for g in G:
        v = A @ g.T
        zdot.append((Z * v).sum(1))
        sq.append((v * v).sum(1))
    for s in S:
        quad.append(((A @ s) * A).sum(1))
    def stacked(columns):  # an empty stack gives [N, 0]
        return torch.stack(columns, 1) if columns else A.new_zeros((A.shape[0], 0))

    return {"zdot": stacked(zdot), "sq": stacked(sq), "quad": stacked(quad),
            "norm": torch.linalg.vector_norm(Z, dim=1)}
