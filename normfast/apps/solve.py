"""``normfast solve``: the batched quartic solver on a file of coefficient rows."""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import sys
from pathlib import Path

import numpy as np

from normfast.core.equilibrium import solve_quartic

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
optional header row of names is skipped; a first row with a number in it is
data, so a malformed number there is an error). Output (-o/--out): .npy (structured, fields
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
    parser.add_argument(
        "-o",
        "--out",
        default=None,
        help=f"output file: .npy, .csv or .parquet (default: print a table, up to {MAX_PRINTED_ROWS} rows)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="OpenMP threads for the solve (default: OpenMP's default)"
    )


def _is_number(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True


def _read_csv(path: Path) -> np.ndarray:
    from normfast.data.textfiles import read_text

    try:
        text = read_text(path, "input")
    except ValueError as exc:
        raise _InputError(str(exc)) from None
    rows: list[list[float]] = []
    for line_no, fields in enumerate(csv.reader(io.StringIO(text, newline="")), start=1):
        if not fields or all(not f.strip() for f in fields):
            continue
        # a header is a first row of names only: a row with any number in it is data, and a
        # malformed number there is an error, not a header to skip
        if not rows and line_no == 1 and not any(_is_number(f) for f in fields):
            continue
        try:
            values = [float(f) for f in fields]
        except ValueError:
            bad = next(f for f in fields if not _is_number(f))
            raise _InputError(
                f"{path}: line {line_no}: expected 5 numbers, got {bad!r} in {','.join(fields)!r}"
            ) from None
        if len(values) != 5:
            raise _InputError(f"{path}: line {line_no}: expected 5 columns (a,b,c,d,e), got {len(values)}")
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
        raise _InputError(f"{path}: expected an array of shape [N, 5] (a,b,c,d,e), got shape={arr.shape}")
    return arr


def _format_float(x: float) -> str:
    return "nan" if math.isnan(x) else repr(float(x))


def _write_atomically(path: Path, write) -> None:
    # write to a temporary file beside the target, then rename: never a truncated file
    from normfast.data.atomic import temporary_file

    tmp = str(temporary_file(path, suffix=path.suffix))  # the suffix: np.save appends .npy to any other
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
                fh.writelines(f"{_format_float(r)},{int(k)}\n" for r, k in zip(r_eq.tolist(), n_positive.tolist()))
    else:  # .parquet, checked before solving
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"r_eq": pa.array(r_eq, pa.float64()), "n_positive": pa.array(n_positive, pa.int8())})

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
                raise _InputError(f"unsupported output extension {out.suffix!r} (expected .npy, .csv or .parquet)")
            if not out.parent.is_dir():
                raise _InputError(f"output directory does not exist: {out.parent}")
        from normfast.core.paths import check_outputs

        try:
            check_outputs(inputs=[args.input], files={"-o/--out": out})
        except ValueError as exc:
            raise _InputError(str(exc)) from None
        coeffs = _read_input(Path(args.input))
        if out is None and len(coeffs) > MAX_PRINTED_ROWS:
            raise _InputError(
                f"{len(coeffs)} rows: pass -o/--out (.npy, .csv or .parquet) to "
                f"write them; tables are printed for up to {MAX_PRINTED_ROWS} rows"
            )
        r_eq, n_positive = solve_quartic(coeffs, threads=args.threads)
        if out is None:
            _print_table(r_eq, n_positive)
        else:
            _write_output(out, r_eq, n_positive)
            n_root = int(np.count_nonzero(n_positive))
            n_multi = int(np.count_nonzero(n_positive > 1))
            print(
                f"wrote {len(r_eq)} rows to {out} ({n_root} with a positive root, {n_multi} bistable)", file=sys.stderr
            )
    except _InputError as exc:
        print(f"normfast solve: error: {exc}", file=sys.stderr)
        return 2
    return 0
