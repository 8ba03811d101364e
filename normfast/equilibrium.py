"""The equilibrium law: from probe statistics to the equilibrium norm ``R_eq``.

With learning rate ``eta`` and decoupled weight decay ``lambda``, zero expected
change of ``R^2`` per step gives, per probe, the quartic

    a R^4 + b R^3 + c R^2 + d R + e = 0
    a = 2 lambda kappa,  b = -2 D_w,  c = -(2 D + eta Q_w),  d = -2 eta C_uw,  e = -eta Q

(``D``, ``Q``: drift and heat of the scale-invariant branch; ``D_w``, ``Q_w``:
the scale-free branch; ``C_uw``: their cross term; ``kappa``: effective radial
damping). ``R_eq`` is the largest positive real root, the equilibrium that is
stable from above; the number of distinct positive roots flags bistability.

* :func:`solve_quartic` -- the batched solver (C++ extension ``normfast._quartic``);
* :func:`equilibrium_coefficients` -- the law's coefficients from the statistics;
* :func:`equilibrium_norm` -- both in one call;
* ``solve_description`` / :func:`solve_arguments` / :func:`solve_main` -- the
  ``normfast solve`` command.

Heavy-ball momentum ``beta`` is handled by the heuristic ``eta -> eta / (1 - beta)``
(the long-run noise of a momentum run matches plain SGD with that learning
rate); it is a heuristic, not a derivation. An EMA of gradients (Adam's
``beta1``) leaves the long-run noise unchanged and needs no correction.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._checks import as_tensor, check_finite_scalar, check_positive_int, describe

__all__ = [
    "solve_quartic",
    "equilibrium_coefficients",
    "equilibrium_norm",
    "solve_description",
    "solve_arguments",
    "solve_main",
    "TOUCH_FACTOR",
]

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
        raise TypeError(f"{fn}: expected {name} to be a real numeric array, "
                        f"got {describe(name, arr)}")
    return arr


def _as_rows(fn: str, coeffs: Any) -> np.ndarray:
    """coeffs as a C-contiguous float64 ``[N, 5]`` array (the input itself if it already is one)."""
    arr = _as_numpy(fn, "coeffs", coeffs)
    if arr.ndim != 2 or arr.shape[1] != 5:
        raise ValueError(f"{fn}: expected coeffs of shape [N, 5], "
                         f"got coeffs.shape={tuple(arr.shape)}")
    return np.ascontiguousarray(arr, dtype=np.float64)


def _threads(fn: str, threads: int | None) -> int:
    return 0 if threads is None else check_positive_int(fn, "threads", threads)


# --------------------------------------------------------------------- solver


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
        raise ValueError(f"{fn}: expected {name} to be a scalar or 1-D per-probe array, "
                         f"got {name}.shape={tuple(arr.shape)}")
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
) -> np.ndarray:
    """Coefficients ``(a, b, c, d, e)`` of the equilibrium quartic, one row per probe.

    ``a = 2 lambda kappa``, ``b = -2 D_w``, ``c = -(2 D + eta' Q_w)``,
    ``d = -2 eta' C_uw``, ``e = -eta' Q`` with ``lambda = weight_decay`` and
    ``eta' = lr / (1 - momentum)`` (heavy-ball momentum heuristic; only the
    heat terms carry the learning rate once the law is divided by it).

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
    named = {"D": D, "Q": Q, "kappa": kappa, "D_w": D_w, "Q_w": Q_w, "C_uw": C_uw}
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
        warnings.warn(f"{fn}: {n_bad} probe(s) have kappa <= 0: no equilibrium is stable from "
                      "above there; the solver returns whatever positive root exists",
                      RuntimeWarning, stacklevel=2)
    if n_neg_heat:
        warnings.warn(f"{fn}: {n_neg_heat} value(s) of Q/Q_w are negative; heat is a second moment "
                      "and should be >= 0", RuntimeWarning, stacklevel=2)

    eta_eff = eta / (1.0 - beta)
    zero = 0.0

    def get(k: str) -> np.ndarray | float:
        return arrays.get(k, zero)

    out = np.empty((n, 5), dtype=np.float64)
    out[:, 0] = 2.0 * lam * kap
    out[:, 1] = -2.0 * get("D_w")
    out[:, 2] = -(2.0 * get("D") + eta_eff * get("Q_w"))
    out[:, 3] = -2.0 * eta_eff * get("C_uw")
    out[:, 4] = -eta_eff * get("Q")
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
    coeffs = equilibrium_coefficients(D, Q, kappa, lr=lr, weight_decay=weight_decay, D_w=D_w,
                                      Q_w=Q_w, C_uw=C_uw, momentum=momentum)
    r_eq, n_positive = solve_quartic(coeffs, threads=n_threads or None)
    return (r_eq, n_positive) if return_count else r_eq


# --------------------------------------------------------------------- CLI

MAX_PRINTED_ROWS = 20

solve_description = f"""\
Solve the equilibrium quartic row by row and write the equilibrium norm.

For a probe with radial drift D, heat Q (second moment of the normalized
displacement), effective radial damping kappa, learning rate eta and decoupled
weight decay lambda, zero expected change of R^2 per optimizer step gives

    a R^4 + b R^3 + c R^2 + d R + e = 0

    a = 2 lambda kappa         weight decay pulls the norm in
    b = -2 D_w                 drift of the scale-free branch (AdamW-like updates)
    c = -(2 D + eta Q_w)       drift of the scale-invariant branch (SGD on a
                               normalized loss) and heat of the scale-free one
    d = -2 eta C_uw            cross term when both branches are present
    e = -eta Q                 heat of the scale-invariant branch pushes it out

Pure SGD (b = d = 0) gives R_eq^2 = (D + sqrt(D^2 + 2 lambda kappa eta Q)) / (2 lambda kappa);
heavy-ball momentum beta is treated as eta -> eta / (1 - beta) (a heuristic).

Each input row holds (a, b, c, d, e). Per row the command reports
  r_eq        the largest positive real root: the equilibrium that is stable
              from above (nan when there is none, or when the row is not finite);
  n_positive  the number of distinct positive roots. 1 is the usual case;
              2 or more flags bistability (the norm can settle at more than
              one level, depending on where it starts); 0 means no
              equilibrium (e.g. kappa <= 0, or no heat and inward drift).

Input: a .npy array [N, 5] or a .csv file with 5 columns a,b,c,d,e (an
optional header row is skipped). Output (-o/--out): .npy (structured, fields
r_eq and n_positive), .csv (header r_eq,n_positive; nan written as nan) or
.parquet. Without --out a table is printed for up to {MAX_PRINTED_ROWS} rows.

examples:
  normfast solve coeffs.npy                      # print a table
  normfast solve coeffs.csv -o r_eq.parquet --threads 4
"""


class _InputError(Exception):
    """A problem with the user's files, reported without a traceback."""


def solve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="coefficient rows: .npy [N, 5] or .csv (a,b,c,d,e)")
    parser.add_argument("-o", "--out", default=None,
                        help="output file: .npy, .csv or .parquet (default: print a table, "
                             f"up to {MAX_PRINTED_ROWS} rows)")
    parser.add_argument("--threads", type=int, default=None,
                        help="OpenMP threads for the solve (default: OpenMP's default)")


def _read_csv(path: Path) -> np.ndarray:
    rows: list[list[float]] = []
    with path.open(newline="") as fh:
        for line_no, fields in enumerate(csv.reader(fh), start=1):
            if not fields or all(not f.strip() for f in fields):
                continue
            try:
                values = [float(f) for f in fields]
            except ValueError:
                if not rows and line_no == 1:
                    continue  # header row
                raise _InputError(f"{path}: line {line_no}: expected 5 numbers, "
                                  f"got {fields!r}") from None
            if len(values) != 5:
                raise _InputError(f"{path}: line {line_no}: expected 5 columns (a,b,c,d,e), "
                                  f"got {len(values)}")
            rows.append(values)
    return np.asarray(rows, dtype=np.float64).reshape(-1, 5)


def _read_input(path: Path) -> np.ndarray:
    if not path.is_file():
        raise _InputError(f"input file not found: {path}")
    ext = path.suffix.lower()
    if ext == ".csv":
        return _read_csv(path)
    if ext != ".npy":
        raise _InputError(f"unsupported input extension {path.suffix!r} (expected .npy or .csv)")
    try:
        arr = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise _InputError(f"{path}: not a plain numeric .npy array ({exc})") from None
    if arr.dtype.kind not in "fiu":
        raise _InputError(f"{path}: expected a real numeric array, got dtype={arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] != 5:
        raise _InputError(f"{path}: expected an array of shape [N, 5] (a,b,c,d,e), "
                          f"got shape={arr.shape}")
    return arr


def _format_float(x: float) -> str:
    return "nan" if math.isnan(x) else repr(float(x))


def _write_atomically(path: Path, write) -> None:
    # write to a temporary file beside the target, then rename: never a truncated file
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent or ".")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _write_output(path: Path, r_eq: np.ndarray, n_positive: np.ndarray) -> None:
    ext = path.suffix.lower()
    if ext == ".npy":
        table = np.empty(len(r_eq), dtype=[("r_eq", "<f8"), ("n_positive", "i1")])
        table["r_eq"] = r_eq
        table["n_positive"] = n_positive

        def write(tmp: str) -> None:
            with open(tmp, "wb") as fh:
                np.save(fh, table, allow_pickle=False)
    elif ext == ".csv":
        def write(tmp: str) -> None:
            with open(tmp, "w", newline="") as fh:
                fh.write("r_eq,n_positive\n")
                fh.writelines(f"{_format_float(r)},{int(k)}\n"
                              for r, k in zip(r_eq.tolist(), n_positive.tolist()))
    else:  # .parquet, checked before solving
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"r_eq": pa.array(r_eq, pa.float64()),
                          "n_positive": pa.array(n_positive, pa.int8())})

        def write(tmp: str) -> None:
            pq.write_table(table, tmp)
    _write_atomically(path, write)


def _print_table(r_eq: np.ndarray, n_positive: np.ndarray) -> None:
    print(f"{'row':>5}  {'r_eq':>24}  {'n_positive':>10}")
    for i, (r, k) in enumerate(zip(r_eq.tolist(), n_positive.tolist())):
        print(f"{i:>5}  {_format_float(r):>24}  {int(k):>10}")


def solve_main(args: argparse.Namespace) -> int:
    """Run ``normfast solve``; returns the exit code (2 on a usage or input error)."""
    try:
        if args.threads is not None and args.threads < 1:
            raise _InputError(f"--threads must be >= 1, got {args.threads}")
        out = Path(args.out) if args.out is not None else None
        if out is not None:
            if out.suffix.lower() not in (".npy", ".csv", ".parquet"):
                raise _InputError(f"unsupported output extension {out.suffix!r} "
                                  "(expected .npy, .csv or .parquet)")
            if not out.parent.is_dir():
                raise _InputError(f"output directory does not exist: {out.parent}")
        coeffs = _read_input(Path(args.input))
        if out is None and len(coeffs) > MAX_PRINTED_ROWS:
            raise _InputError(f"{len(coeffs)} rows: pass -o/--out (.npy, .csv or .parquet) to "
                              f"write them; tables are printed for up to {MAX_PRINTED_ROWS} rows")
        r_eq, n_positive = solve_quartic(coeffs, threads=args.threads)
        if out is None:
            _print_table(r_eq, n_positive)
        else:
            _write_output(out, r_eq, n_positive)
            n_root = int(np.count_nonzero(n_positive))
            n_multi = int(np.count_nonzero(n_positive > 1))
            print(f"wrote {len(r_eq)} rows to {out} ({n_root} with a positive root, "
                  f"{n_multi} bistable)", file=sys.stderr)
    except _InputError as exc:
        print(f"normfast solve: error: {exc}", file=sys.stderr)
        return 2
    return 0
