"""References of the head-mode kernels ``head_stats`` (the S form) and ``project`` (the per-batch form)."""

from __future__ import annotations

import numpy as np
import torch

from normfast.core.reference.accumulate import embedding_codes, nan_where_invalid


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
    m2 = scale**2 * (v * v).sum(1)
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
    v2 = scale**2 * ((At @ s_c) * At).sum(1)
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
    v2 = scale**2 * spread / (m - 1)
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
