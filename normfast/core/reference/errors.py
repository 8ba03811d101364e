"""How close a fast path must come to the references: the tolerances by dtype and the
scale-relative errors they are compared with."""

from __future__ import annotations

import torch

#: Allowed error of a fast path against the float64 brute force, by the
#: dtype of the inputs. Errors are scale-relative (see :func:`stat_errors`).
#: float32/float64: ``rtol``. float16/bfloat16 follow the flash-attention
#: rule: ``error <= factor * (error of the plain-torch reference run in that
#: dtype) + atol``.
TOLERANCES: dict[torch.dtype, dict[str, float | None]] = {
    torch.float64: {"rtol": 1e-10, "factor": None, "atol": 0.0},
    torch.float32: {"rtol": 1e-5, "factor": None, "atol": 0.0},
    torch.float16: {"rtol": None, "factor": 2.0, "atol": 1e-3},
    torch.bfloat16: {"rtol": None, "factor": 2.0, "atol": 8e-3},
}


def allowed_error(dtype: torch.dtype, plain_error: float | None = None, *, table: dict | None = None) -> float:
    """Tolerance from :data:`TOLERANCES` (or a kernel's own ``table`` of the same form); low precision
    needs the plain-torch error."""
    tol = (TOLERANCES if table is None else table)[dtype]
    if tol["factor"] is None:
        return float(tol["rtol"])
    if plain_error is None:
        raise ValueError(f"allowed_error: {dtype} needs the plain-torch error of the same computation")
    return float(tol["factor"]) * float(plain_error) + float(tol["atol"])


def head_stack_errors(got, want: dict, A, Z, G, S, *, has_bias: bool = False) -> dict[str, float]:
    """Max error of each stacked product relative to its natural size, over all rows.

    ``got`` is ``(zdot, sq, quad, norm)`` (or a dict of them), ``want`` the
    truth (e.g. :func:`head_stack_reference` in float64). The size of each
    entry is the same product with absolute values, ``|z|·(|G_k||ã|)``,
    ``|(|G_k||ã|)|²``, ``|ã|ᵀ|S_k||ã|`` and ``|z|``: it bounds the rounding
    error of any summation order, so the ratio is comparable to the
    tolerances of :data:`TOLERANCES`. A shape mismatch or a NaN where the
    truth is finite counts as ``inf``.
    """
    keys = ("zdot", "sq", "quad", "norm")
    got = got if isinstance(got, dict) else dict(zip(keys, got))
    A, Z, G, S = (torch.as_tensor(x).detach().cpu().to(torch.float64) for x in (A, Z, G, S))
    if has_bias:
        A = torch.cat([A, torch.ones(A.shape[0], 1, dtype=A.dtype)], 1)
    v_abs = torch.einsum("kjd,nd->nkj", G.abs(), A.abs())
    scale = {
        "zdot": torch.einsum("nj,nkj->nk", Z.abs(), v_abs),
        "sq": v_abs.square().sum(-1),
        "quad": torch.einsum("nd,kde,ne->nk", A.abs(), S.abs(), A.abs()),
        "norm": torch.linalg.vector_norm(Z, dim=1),
    }
    errors = {}
    for key in keys:
        g = torch.as_tensor(got[key]).detach().cpu().to(torch.float64)
        w = torch.as_tensor(want[key]).detach().cpu().to(torch.float64).reshape(scale[key].shape)
        if tuple(g.shape) != tuple(w.shape):
            errors[key] = float("inf")
        elif w.numel() == 0:
            errors[key] = 0.0
        else:
            diff = (g - w).abs().nan_to_num(nan=float("inf"))
            errors[key] = float((diff / scale[key].clamp_min(torch.finfo(torch.float64).tiny)).max())
    return errors


def output_errors(got, want) -> dict[str, float]:
    """Max error of each output relative to the output's largest magnitude: ``{"0": ..., "1": ...}``.

    ``got`` and ``want`` are a tensor or a tuple of tensors (a launcher's
    outputs and its reference's). A shape mismatch, or a NaN where the truth
    is finite, counts as ``inf``.
    """
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    if len(got) != len(want):
        return {"outputs": float("inf")}
    errors = {}
    for i, (g, w) in enumerate(zip(got, want)):
        g = torch.as_tensor(g).detach().cpu().to(torch.float64)
        w = torch.as_tensor(w).detach().cpu().to(torch.float64)
        if tuple(g.shape) != tuple(w.shape):
            errors[str(i)] = float("inf")
        elif w.numel() == 0:
            errors[str(i)] = 0.0
        else:
            diff = (g - w).abs().nan_to_num(nan=float("inf"))
            scale = w.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
            errors[str(i)] = float(diff.max() / scale)
    return errors


def _scale_of(key: str, want: dict) -> torch.Tensor:
    """Natural size of a statistic: |D|, se_D <= sqrt(Q); m2, V2, se_V2, se_Q <= Q; |C_uw| <= sqrt(Q Q_w)."""
    suffix = "_w" if key.endswith("_w") else ""
    q = want["Q" + suffix].to(torch.float64).abs()
    if key == "C_uw":
        return torch.sqrt(want["Q"].to(torch.float64).abs() * want["Q_w"].to(torch.float64).abs())
    if key.startswith(("D", "se_D")):
        return torch.sqrt(q)
    return q


def stat_errors(got: dict, want: dict, keys=None) -> dict[str, float]:
    """Scale-relative max error per statistic over the rows ``want`` marks valid.

    ``|got - want| / scale`` with the scales of :func:`_scale_of`. Returns
    ``inf`` for a key whose NaN pattern differs (a valid row that came out
    NaN, or an invalid one that did not). ``sign_stability`` is reported as
    the fraction of valid rows that differ at all (a radial dot within
    rounding of zero may flip sign), ``sign_stability_batches`` as the
    largest difference in batches (``M`` times the fraction).
    """
    valid = want["valid"].cpu()
    if keys is None:
        keys = [k for k in want if k not in ("valid", "reason", "M", "loo", "groups") and k in got]
    errors = {}
    for key in keys:
        g = torch.as_tensor(got[key]).detach().cpu().to(torch.float64)
        w = torch.as_tensor(want[key]).detach().cpu().to(torch.float64)
        if not torch.equal(torch.isnan(g), torch.isnan(w)) or not torch.isnan(w[~valid]).all():
            errors[key] = float("inf")
            continue
        if valid.sum() == 0:
            errors[key] = 0.0
            continue
        diff = (g - w).abs()[valid]
        if key.startswith("sign_stability"):
            errors[key] = float((diff > 0.5 / int(want["M"])).to(torch.float64).mean())
            batches = key.replace("sign_stability", "sign_stability_batches")
            errors[batches] = float(diff.max() * int(want["M"]))
            continue
        tensors = {k: torch.as_tensor(v).cpu() for k, v in want.items() if k not in ("M", "loo", "groups")}
        scale = _scale_of(key, tensors)[valid]
        errors[key] = float((diff / scale.clamp_min(torch.finfo(torch.float64).tiny)).max())
    return errors
