"""The equilibrium law: from probe statistics to the equilibrium norm ``R_eq``.

With learning rate ``eta`` and decoupled weight decay ``lambda``, zero expected
change of ``R^2`` per step gives, per probe, the quartic

    a R^4 + b R^3 + c R^2 + d R + e = 0
    a = 2 lambda kappa,  b = -2 D_w,  c = -(2 D + eta Q_w),  d = -2 eta C_uw,  e = -eta Q

(``D``, ``Q``: drift and heat of the scale-invariant branch; ``D_w``, ``Q_w``:
the scale-free branch; ``C_uw``: their cross term; ``kappa``: effective radial
damping). ``R_eq`` is the largest positive real root, the equilibrium that is
stable from above; the number of distinct positive roots flags bistability.

* :func:`solve_quartic` -- the batched solver (C++ extension ``normfast.core._quartic``);
* :func:`equilibrium_coefficients` -- the law's coefficients from the statistics;
* :func:`equilibrium_norm` -- both in one call;

The ``normfast solve`` command over :func:`solve_quartic` is :mod:`normfast.apps.solve`.

Derivation (per probe, per step; DESIGN §1). A step moves the parameters by
``Δθ = Δθ_t + Δθ_d`` (task and weight-decay parts) and the embedding by
``R'² − R² = 2 z·JΔθ + |JΔθ|² + r``, where ``r`` is what the linearization
misses (the network's curvature along the step, and for ReLU networks the
activation patterns it flips). Each term, in expectation over the batch:

* SGD, ``Δθ_t = −η ĝ``: first-order task ``2η D``; second-order
  ``η² Q / R²``; remainder ``η² Q_curv / R²`` (``Q_curv``: the curvature heat,
  :mod:`normfast.engine.trajectory.curvature`); decay ``−2ηλ κ R²``. Zero expected change,
  times ``R²/η``: ``2λκ R⁴ − 2D R² − η (Q + Q_curv) = 0``.
* AdamW, ``Δθ_t = −η ĝ/(sqrt(v̂)+eps)`` (the scale-free branch): first-order
  ``2η R D_w``; second-order ``η² Q_w``; remainder ``η² Q_curv_w``; decay
  ``−2ηλ κ R²`` (decoupled). Times ``R²/η``:
  ``2λκ R⁴ − 2D_w R³ − η (Q_w + Q_curv_w) R² = 0``. ``v̂`` is the optimizer's own
  (bias-corrected ``exp_avg_sq``; it moves on a time scale ``1/(1−β2)``, slow
  against a step); ``eps`` enters only through ``p_B``.
* Momentum. An EMA of gradients (AdamW's ``β1``) gives each gradient a total
  weight of 1 spread over ``~1/(1−β1)`` steps: over times long against that,
  the displacement and its noise are those of ``β1 = 0``. Per step, only
  ``(1−β1)/(1+β1)`` of the second-order term is realized as ``|JΔθ|²``; the
  rest appears in the first-order term, through the correlation of the
  buffer's past gradients with the present ``z`` (measured by E1's ledger:
  ``python -m bench run e1 --ledger``). The law is a long-run balance and needs no
  β1 correction. Heavy-ball SGD as torch implements it (``b ← βb + ĝ + λθ``,
  ``Δθ = −ηb``: the decay is *coupled*, it goes through the buffer) gives each
  gradient and each decay contribution a total weight ``1/(1−β)``: long-run
  per step, first-order task ``2ηD/(1−β)``, decay ``−2ηλκR²/(1−β)`` and
  second-order ``(η/(1−β))² (Q + Q_curv)/R²``. Times ``(1−β)R²/η``:
  ``2λκ R⁴ − 2D R² − (η/(1−β)) (Q + Q_curv) = 0`` -- the rule ``η -> η/(1−β)``
  in the heat only, derived (for decoupled decay with momentum, SGDW, the
  decay is not amplified and the same steps give ``λ -> λ(1−β)`` as well).
  Both hold when the buffer's memory is short against the time over which
  ``J``, ``z`` and ``v̂`` change.

Which terms matter, and how well the engine estimates them, is measured in
E1 (the docs' "E1" page and its radial-budget ledger). The drift is the delicate
term: its window mean is small against its per-batch noise, and in AdamW runs
the first-order drift nearly cancels the heat, so ``D_w`` must be precise to a
few percent (hence the drift from the mean direction over many batches).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from normfast.core.checks import as_tensor, check_finite_scalar, check_positive_int, describe

__all__ = ["solve_quartic", "solver_threads", "equilibrium_coefficients", "equilibrium_norm", "TOUCH_FACTOR"]

# A local extremum y_c of the polynomial counts as a double root when
# |p(y_c)| <= TOUCH_FACTOR * eps * sum_i |p_i| |y_c|^i (csrc/quartic.hpp).
TOUCH_FACTOR = 16.0


# --------------------------------------------------------------------- input


def _as_numpy(fn: str, name: str, x: Any) -> np.ndarray:
    """Any array-like as a numpy array, sharing memory where the input allows it.

    torch tensors are detached and moved to the CPU; DLPack-capable arrays go
    through torch; nested sequences through ``np.asarray``.
    """
    if isinstance(x, np.ndarray):
        arr = x
    else:
        if not isinstance(x, torch.Tensor) and hasattr(x, "__dlpack__"):
            x = as_tensor(fn, name, x)
        if isinstance(x, torch.Tensor):
            t = x.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            if t.is_complex() or t.dtype == torch.bool:
                raise TypeError(f"{fn}: expected {name} to be real-valued, got {describe(name, t)}")
            if t.dtype in (torch.float16, torch.bfloat16) or not t.dtype.is_floating_point:
                t = t.to(torch.float64)
            arr = t.resolve_neg().numpy()
        else:
            try:
                arr = np.asarray(x)
            except ValueError as exc:  # ragged nested sequences
                raise ValueError(f"{fn}: could not read {name} as an array ({exc})") from None
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{fn}: expected {name} to be a real numeric array, got {describe(name, arr)}")
    return arr


def _as_rows(fn: str, coeffs: Any) -> np.ndarray:
    """coeffs as a C-contiguous float64 ``[N, 5]`` array (the input itself if it already is one)."""
    arr = _as_numpy(fn, "coeffs", coeffs)
    if arr.ndim != 2 or arr.shape[1] != 5:
        raise ValueError(f"{fn}: expected coeffs of shape [N, 5], got coeffs.shape={tuple(arr.shape)}")
    return np.ascontiguousarray(arr, dtype=np.float64)


def _threads(fn: str, threads: int | None) -> int:
    return 0 if threads is None else check_positive_int(fn, "threads", threads)


# --------------------------------------------------------------------- solver


def solver_threads() -> int:
    """The OpenMP team size :func:`solve_quartic` uses when ``threads`` is not given."""
    from . import _quartic

    return int(_quartic.default_threads())


def solve_quartic(coeffs: Any, *, threads: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Largest positive real root of ``a R^4 + b R^3 + c R^2 + d R + e = 0``, row by row.

    Args:
        coeffs: ``[N, 5]`` rows ``(a, b, c, d, e)``: a numpy array of any real
            dtype (views and non-contiguous arrays are fine), a torch tensor
            (CUDA tensors are moved to the CPU), any DLPack-capable array, or
            nested lists. Converted to C-contiguous float64; no copy is made
            when the input already is one.
        threads: OpenMP threads for the row loop (``None``: OpenMP's default).
            The GIL is released while rows are solved.

    Returns:
        ``(roots, n_positive)``: ``roots`` float64 ``[N]``, the largest positive
        real root, NaN where there is none or where the row holds a NaN/inf;
        ``n_positive`` int8 ``[N]``, the number of *distinct* positive real roots.

    Conventions:
        * leading zeros lower the degree: ``a = 0`` is a cubic, ``a = b = 0`` a
          quadratic, ``a = b = c = 0`` linear; only ``e != 0`` has no root;
        * an all-zero row gives ``(NaN, 0)``: every ``R`` solves it, so there
          is no single root to report;
        * ``R = 0`` is never a positive root;
        * a double root counts once. Two roots also count once when the
          polynomial's extremum between them is within its rounding-error
          bound of zero (``|p| <= 16 eps sum|p_i R^i|``): for a well-scaled pair
          that is a relative separation below about ``1.7e-7``. The reported
          root is then that extremum. A complex pair that close to the real
          axis counts the same way (one touching root);
        * a positive root beyond the float64 range comes back as ``inf``.

    Accuracy: a simple root comes back within a few ulps of the exact root of
    the float64 coefficients, whatever their scale (``1e-200 .. 1e200``); a
    double root within about ``sqrt(eps)`` relative (its own conditioning).
    """
    fn = "solve_quartic"
    n_threads = _threads(fn, threads)
    rows = _as_rows(fn, coeffs)
    from . import _quartic

    return _quartic.solve(rows, n_threads)


# --------------------------------------------------------------------- the law


def _stat(fn: str, name: str, x: Any) -> np.ndarray:
    arr = np.asarray(_as_numpy(fn, name, x), dtype=np.float64)
    if arr.ndim > 1:
        raise ValueError(
            f"{fn}: expected {name} to be a scalar or 1-D per-probe array, got {name}.shape={tuple(arr.shape)}"
        )
    return arr


def equilibrium_coefficients(
    D: Any,
    Q: Any,
    kappa: Any,
    *,
    lr: float,
    weight_decay: float,
    D_w: Any = None,
    Q_w: Any = None,
    C_uw: Any = None,
    momentum: float = 0.0,
    Q_curv: Any = None,
    Q_curv_w: Any = None,
) -> np.ndarray:
    """Coefficients ``(a, b, c, d, e)`` of the equilibrium quartic, one row per probe.

    ``a = 2 lambda kappa``, ``b = -2 D_w``, ``c = -(2 D + eta' (Q_w + Q_curv_w))``,
    ``d = -2 eta' C_uw``, ``e = -eta' (Q + Q_curv)`` with ``lambda = weight_decay`` and
    ``eta' = lr / (1 - momentum)`` (heavy-ball momentum with torch's coupled decay; only
    the heat terms carry the learning rate once the law is divided by it; see the
    module docstring for the derivation).

    Args:
        D, Q: drift and heat (second moment) of the scale-invariant branch;
            either may be ``None`` (zero), e.g. for a pure AdamW run.
        kappa: effective radial damping. ``kappa <= 0`` is legal but then no
            equilibrium is stable from above (a warning is issued, once per
            call); the solver returns whatever positive root exists.
        lr, weight_decay: ``> 0`` and finite.
        D_w, Q_w, C_uw: scale-free branch drift and heat, and the cross term
            (``None``: zero).
        momentum: heavy-ball ``beta`` in ``[0, 1)``.
        Q_curv, Q_curv_w: the curvature heat of each branch (the linearization's
            remainder in heat units, :func:`normfast.engine.trajectory.curvature.curvature_heat`;
            ``None``: zero, the law without it).

    All per-probe inputs are scalars or 1-D arrays that broadcast together
    (numpy, torch, DLPack or sequences). A NaN/inf in a probe's statistics
    makes that probe's row non-finite, which the solver maps to ``NaN``: rows
    are data and one bad probe does not fail the batch.

    Returns:
        float64 ``[N, 5]`` (``N = 1`` when every input is a scalar).
    """
    fn = "equilibrium_coefficients"
    eta = check_finite_scalar(fn, "lr", lr, minimum=0.0, strictly=True)
    lam = check_finite_scalar(fn, "weight_decay", weight_decay, minimum=0.0, strictly=True)
    beta = check_finite_scalar(fn, "momentum", momentum, minimum=0.0)
    if beta >= 1.0:
        raise ValueError(f"{fn}: expected 0 <= momentum < 1, got {momentum!r}")
    if kappa is None:
        raise TypeError(f"{fn}: kappa is required")
    if D is None and Q is None and D_w is None and Q_w is None:
        raise ValueError(f"{fn}: expected at least one of D, Q, D_w, Q_w")
    named = {
        "D": D,
        "Q": Q,
        "kappa": kappa,
        "D_w": D_w,
        "Q_w": Q_w,
        "C_uw": C_uw,
        "Q_curv": Q_curv,
        "Q_curv_w": Q_curv_w,
    }
    arrays = {k: _stat(fn, k, v) for k, v in named.items() if v is not None}
    try:
        shape = np.broadcast_shapes(*(a.shape for a in arrays.values()))
    except ValueError:
        listing = ", ".join(f"{k}.shape={a.shape}" for k, a in arrays.items())
        raise ValueError(f"{fn}: per-probe inputs do not broadcast: {listing}") from None
    n = int(shape[0]) if shape else 1

    kap = arrays["kappa"]
    with np.errstate(invalid="ignore"):
        n_bad = int(np.count_nonzero(kap <= 0))
        n_neg_heat = sum(int(np.count_nonzero(arrays[k] < 0)) for k in ("Q", "Q_w") if k in arrays)
    if n_bad:
        warnings.warn(
            f"{fn}: {n_bad} probe(s) have kappa <= 0: no equilibrium is stable from "
            "above there; the solver returns whatever positive root exists",
            RuntimeWarning,
            stacklevel=2,
        )
    if n_neg_heat:
        warnings.warn(
            f"{fn}: {n_neg_heat} value(s) of Q/Q_w are negative; heat is a second moment and should be >= 0",
            RuntimeWarning,
            stacklevel=2,
        )

    eta_eff = eta / (1.0 - beta)
    zero = 0.0

    def get(k: str) -> np.ndarray | float:
        return arrays.get(k, zero)

    out = np.empty((n, 5), dtype=np.float64)
    out[:, 0] = 2.0 * lam * kap
    out[:, 1] = -2.0 * get("D_w")
    out[:, 2] = -(2.0 * get("D") + eta_eff * (get("Q_w") + get("Q_curv_w")))
    out[:, 3] = -2.0 * eta_eff * get("C_uw")
    out[:, 4] = -eta_eff * (get("Q") + get("Q_curv"))
    return out


def equilibrium_norm(
    D: Any,
    Q: Any,
    kappa: Any,
    *,
    lr: float,
    weight_decay: float,
    D_w: Any = None,
    Q_w: Any = None,
    C_uw: Any = None,
    momentum: float = 0.0,
    Q_curv: Any = None,
    Q_curv_w: Any = None,
    return_count: bool = False,
    threads: int | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Equilibrium norm ``R_eq`` per probe: the law's coefficients, solved row by row.

    Pure SGD (``b = d = 0``) reduces to
    ``R_eq^2 = (D + sqrt(D^2 + 2 lambda kappa eta Q)) / (2 lambda kappa)``,
    evaluated without cancellation also when ``D < 0`` and ``|D| >> V``; pure
    AdamW to ``R_eq = (D_w + sqrt(D_w^2 + 2 lambda kappa eta Q_w)) / (2 lambda kappa)``.

    Returns:
        ``r_eq`` float64 ``[N]`` (NaN where there is no positive root), or
        ``(r_eq, n_positive)`` with ``return_count=True``; ``n_positive > 1``
        flags bistability.
    """
    n_threads = _threads("equilibrium_norm", threads)
    coeffs = equilibrium_coefficients(
        D,
        Q,
        kappa,
        lr=lr,
        weight_decay=weight_decay,
        D_w=D_w,
        Q_w=Q_w,
        C_uw=C_uw,
        momentum=momentum,
        Q_curv=Q_curv,
        Q_curv_w=Q_curv_w,
    )
    r_eq, n_positive = solve_quartic(coeffs, threads=n_threads or None)
    return (r_eq, n_positive) if return_count else r_eq
